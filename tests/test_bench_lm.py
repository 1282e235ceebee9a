"""`spmdkit bench --suite lm`: the PyTorch model is the lm task's model, and a smoke run.

No test asserts a speed: the machine running the tests is shared.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from spmdkit._bench import lm_suite, lm_worker
from spmdkit._tasks.lm import TOKEN_EMBED_STD, LMConfig, lm_functions


def test_pytorch_model_is_the_lm_task_model():
    torch = pytest.importorskip("torch")
    cfg = LMConfig(layers=2, d_model=32, heads=4, seq_len=16)
    model, init, _ = lm_functions(cfg)
    params = nn.unbox(init(jax.random.key(0)))
    theirs = lm_worker.torch_lm(cfg.layers, cfg.d_model, cfg.heads, cfg.seq_len)
    ours = sum(x.size for x in jax.tree.leaves(params))
    assert sum(p.numel() for p in theirs.parameters()) == ours  # before loading: its own init, same count
    lm_worker.load_flat_init(theirs, lm_worker.flatten_params(params), cfg.layers)
    tokens = np.random.default_rng(0).integers(0, 256, (3, cfg.seq_len))
    expected = np.asarray(model.apply({"params": params}, tokens))
    with torch.no_grad():
        got = theirs(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-4)  # same function, not only the same count


def test_the_worker_knows_the_task_init_and_the_rolled_case_asks_for_the_loop():
    assert lm_worker.TOKEN_EMBED_STD == TOKEN_EMBED_STD  # its PyTorch model's own init (the copy overrides it)
    assert lm_suite.cases(quick=True, torch=False)[lm_suite.ROLLED][1][-2:] == ["--scan-unroll", "1"]


def test_a_torch_python_that_cannot_import_torch_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(lm_suite.TORCH_PYTHON_ENV, str(tmp_path / "no-python"))
    python, why = lm_suite.torch_python()
    assert python is None and lm_suite.TORCH_PYTHON_ENV in why and "no-python" in why
    assert {framework for framework, _, _ in lm_suite.cases(quick=False, torch=False).values()} == {"jax"}


def test_the_target_compares_with_the_faster_pytorch_f32_case():
    case = lambda times: {"times": times, "median": sorted(times)[len(times) // 2], "flags": []}  # noqa: E731
    run = {"cases": {"spmdkit f32": case([1.0, 1.0, 1.0]), "spmdkit bf16": case([2.0, 2.0, 2.0]),
                     "PyTorch f32, eager": case([2.0, 2.0, 2.0]), "PyTorch f32, torch.compile": case([0.5, 0.5, 0.5]),
                     "PyTorch bf16 autocast, eager": case([0.25, 0.25, 0.25])}}
    targets, extra = lm_suite._ratios(run)
    (t,) = targets  # bf16 autocast is faster still, but not the same numerics: no target against it
    assert "[PyTorch f32, torch.compile]" in t["name"] and t["value"] == pytest.approx(0.5) and not t["met"]
    assert {e["name"]: e["value"] for e in extra}["spmdkit bf16 / spmdkit f32 (tokens/s)"] == pytest.approx(0.5)


def test_workers_run_on_one_device():
    env = lm_suite.worker_env()
    assert "xla_force_host_platform_device_count" not in env["XLA_FLAGS"] and "SPMDKIT_HOST_DEVICES" not in env


def test_bench_lm_quick(bench_all_quick):
    out = bench_all_quick.done  # the lm suite's part of `bench --all --quick`
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((bench_all_quick.json / "lm.json").read_text())
    rows = {r["case"]: r for r in report["rows"]}
    assert {"spmdkit f32", "spmdkit bf16", "spmdkit f32, remat full", lm_suite.ROLLED} <= set(rows)
    assert report["errors"] == {}
    init_bpb = rows["spmdkit f32"]["bpb_init"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["min_per_s"] <= r["tokens_per_s"] <= r["max_per_s"]
        # The same initial parameters everywhere; a few steps of training lower the held-out bits per byte.
        assert r["bpb_init"] == pytest.approx(init_bpb, abs=0.05) and r["bpb"] < r["bpb_init"]
    assert [e["name"] for e in report["ratios"][:3]] == ["spmdkit bf16 / spmdkit f32 (tokens/s)",
                                                         "spmdkit remat full / no remat (tokens/s)",
                                                         "spmdkit rolled scan / unrolled (tokens/s)"]
    # The rolled loop and the unrolled default are the same function: the same losses, trained alike.
    assert rows[lm_suite.ROLLED]["bpb"] == pytest.approx(rows["spmdkit f32"]["bpb"], abs=1e-4)
    assert all(len(c["times"]) == 2 for c in report["timings"]["lm"]["cases"].values())
    if lm_suite.torch_python()[0] is None:  # the spmdkit part ran; the report says PyTorch is missing
        assert report["targets"] == [] and any("PyTorch is not installed" in w or lm_suite.TORCH_PYTHON_ENV in w
                                               for w in report["warnings"])
        return
    assert rows["PyTorch f32, eager"]["bpb"] == pytest.approx(rows["spmdkit f32"]["bpb"], abs=0.05)
    assert set(report["parameters"].values()) == {report["parameters"]["spmdkit"]}
    (t,) = report["targets"]
    assert t["target"] == ">= 1.0" and t["value"] > 0 and isinstance(t["met"], bool)
