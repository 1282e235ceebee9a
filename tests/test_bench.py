"""Benchmarks: the timing method, the multiprocess levers' steps, and `spmdkit bench` smoke runs.

No test asserts a speed: the machine running the tests is shared. The smoke runs check
that every suite runs, interleaves its cases and writes its figures with their spread.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit import _host_memory
from spmdkit._bench import _timing, multiprocess_suite, mp_worker

SPMDKIT = shutil.which("spmdkit") or os.path.join(os.path.dirname(sys.executable), "spmdkit")


def run_cli(*args: str, timeout: int = 300, **extra_env: str):
    env = {k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"} | extra_env
    return subprocess.run([SPMDKIT, *args], capture_output=True, text=True, timeout=timeout, env=env)


def scripted(values):
    """A self-timed case that returns the given seconds, one per call."""
    it = iter(values)
    return lambda: next(it)


# ---- the timing method -------------------------------------------------------------

def test_rounds_rotate_the_order_and_every_case_runs_once_per_round():
    calls = []
    cases = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    run = _timing.measure(cases, rounds=5, warmup=1, round_seconds=0, idle_seconds=0)
    assert run["order"][:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    # Warm-up and one calibration call each (how many calls fill a round), then the rounds.
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]
    assert calls[6:] == [n for order in run["order"] for n in order]
    assert all(len(c["times"]) == 5 for c in run["cases"].values())
    assert set(run["load"]) == {"before", "during", "after"}


def test_median_quartiles_and_paired_ratio():
    run = _timing.measure(
        {"a": scripted([2.0, 4.0, 2.2, 1.8, 2.0]), "b": scripted([1.0, 2.0, 1.1, 0.9, 1.0])},
        rounds=5, warmup=0, self_timed=True, idle_seconds=0,
    )
    a = run["cases"]["a"]
    assert a["median"] == 2.0 and (a["min"], a["max"]) == (1.8, 4.0)
    assert a["q1"] == 2.0 and a["q3"] == 2.2
    # Every round is twice as slow for a as for b, the outlier round included: the
    # paired ratio has no spread, while a's own times do.
    r = _timing.ratio(run, "a", "b")
    assert r["median"] == pytest.approx(2.0) and r["q3"] - r["q1"] == pytest.approx(0.0)
    assert r["of_medians"] == pytest.approx(2.0)
    flipped = _timing.inverse(r)
    assert flipped["median"] == pytest.approx(0.5)


def test_spread_over_ten_percent_is_flagged_and_warned(monkeypatch):
    monkeypatch.setattr(_timing, "_load_flag", lambda load: None)
    run = _timing.measure(
        {"steady": scripted([1.0] * 5), "noisy": scripted([1.0, 1.5, 0.7, 1.3, 1.0])},
        rounds=5, warmup=0, self_timed=True, idle_seconds=0,
    )
    assert run["cases"]["steady"]["flags"] == []
    assert run["cases"]["noisy"]["flags"] == ["spread"]
    assert any("noisy: spread" in w for w in run["warnings"])
    assert "spread" in _timing.ratio(run, "noisy", "steady")["flags"]


def test_a_busy_machine_flags_every_figure(monkeypatch):
    busy = {"loadavg": [3.0, 3.0, 3.0], "other_cpu": 0.6}
    monkeypatch.setattr(_timing, "idle_load", lambda seconds: busy)
    monkeypatch.setattr(_timing.LoadMeter, "stop", lambda self: busy)  # the real machine's load must not decide
    run = _timing.measure({"a": scripted([1.0] * 5)}, rounds=5, warmup=0, self_timed=True)
    assert "load" in run["flags"] and "load" in run["cases"]["a"]["flags"]
    assert any("machine busy: other processes used 60%" in w for w in run["warnings"])


def test_fewer_than_five_rounds_is_a_smoke_run_and_a_failed_case_is_named(monkeypatch):
    monkeypatch.setattr(_timing, "_load_flag", lambda load: None)
    run = _timing.measure({"ok": scripted([1.0, 1.0]), "broken": scripted([None, 2.0])},
                          rounds=2, warmup=0, self_timed=True, idle_seconds=0)
    assert run["flags"] == ["rounds"]
    assert run["cases"]["broken"]["times"] == [None, 2.0] and "failed" in run["cases"]["broken"]["flags"]
    assert any("broken: failed in 1 of 2 rounds" in w for w in run["warnings"])


def test_load_meter_reads_the_machine():
    snap = _timing.idle_load(0.05)
    assert len(snap["loadavg"]) == 3
    assert snap["other_cpu"] is None or 0.0 <= snap["other_cpu"] <= 1.0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_running_worker_of_ours_is_not_counted_as_other_load(tmp_path):
    # A suite's own worker (and its child) that keeps running is our work, not someone else's.
    spun = tmp_path / "spun"
    spin = (f"import time; t = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
            f"open({str(spun)!r}, 'w').close(); time.sleep(30)")
    code = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {spin!r}]).wait()"
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        before = _timing._live_descendants_cpu()
        deadline = time.monotonic() + 60  # a busy machine gives the spin its 0.6 CPU seconds late, not never
        while not spun.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spun.exists(), "the grandchild did not spin its 0.6 CPU seconds in 60 s"
        grown = _timing._live_descendants_cpu() - before
        assert grown >= 0.4, grown  # the grandchild's spin, read while both still run
    finally:
        subprocess.run(["pkill", "-9", "-P", str(worker.pid)], check=False)  # the grandchild, before it is orphaned
        worker.kill()
        worker.wait(timeout=10)


_SIBLING = """import os, sys, time
ready, spun = sys.argv[1], sys.argv[2]
while not os.path.exists(ready):
    time.sleep(0.02)
t = time.process_time()
while time.process_time() - t < 0.6:
    pass
open(spun, "w").close()
time.sleep(30)
"""
_MEASURER = """import os, sys, time
from spmdkit._bench import _timing
ready, spun = sys.argv[1], sys.argv[2]
before = _timing._own_cpu()
open(ready, "w").close()
while not os.path.exists(spun):
    time.sleep(0.02)
print(_timing._own_cpu() - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("launched", [True, False])
def test_a_process_of_a_launch_counts_the_other_processes_of_the_launch_as_its_own(tmp_path, launched):
    """Each of a launch's processes (the launcher sets SPMDKIT_LAUNCHER_PID; this test process
    stands in for it) counts its sibling's work as the run's own, not as another process's load;
    without the variable a process counts only itself and its descendants."""
    from spmdkit._launch import ENV_LAUNCHER_PID

    env = {k: v for k, v in os.environ.items() if k != ENV_LAUNCHER_PID}
    if launched:
        env[ENV_LAUNCHER_PID] = str(os.getpid())
    ready, spun = str(tmp_path / "ready"), str(tmp_path / "spun")
    procs = [subprocess.Popen([sys.executable, "-c", _SIBLING, ready, spun], env=env),
             subprocess.Popen([sys.executable, "-c", _MEASURER, ready, spun], env=env, stdout=subprocess.PIPE, text=True)]
    try:
        out, _ = procs[1].communicate(timeout=120)
        counted = float(out.strip())
        assert (counted >= 0.5) if launched else (counted < 0.3), counted  # the sibling's 0.6 s spin
    finally:
        for p in procs:
            p.kill()  # SIGKILL: nothing is left behind whatever failed
            p.wait(timeout=10)


# ---- the multiprocess suite's cases and levers -------------------------------------

def test_multiprocess_cases_without_torch_are_spmdkit_only():
    cases = multiprocess_suite._cases(quick=False, torch=False, levers=[])
    assert all(label.startswith(("(a)", "(b)")) for label in cases)
    assert "(b) hand shard_map, one all-reduce per leaf" in cases
    with_torch = multiprocess_suite._cases(quick=False, torch=True, levers=["allreduce", "bf16"])
    assert "(c) PyTorch, 1 process, torch.compile" in with_torch and "(d) PyTorch DDP, default threads" in with_torch
    assert "(b) lever: packed all-reduce in bf16" in with_torch
    with pytest.raises(ValueError, match="unknown lever"):
        multiprocess_suite.check_levers("allreduce,warp")
    assert multiprocess_suite.check_levers("all") == list(multiprocess_suite.LEVERS)


def test_pytorch_cases_run_with_the_torch_interpreter_and_jax_cases_with_this_one(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")  # as the spmdkit command leaves it for its children
    torch = ("/envs/torch/bin/python", {"PYTHONPATH": "/src", "MALLOC_ARENA_MAX": "1"})
    base = ["--model", "mlp"]
    for label, (prefix, args, allocator) in multiprocess_suite._cases(quick=True, torch=True, levers=[]).items():
        cmd, env = multiprocess_suite._command(prefix, args, base, torch, allocator)
        launched = prefix is multiprocess_suite.LAUNCH
        worker = len(prefix) if launched else 0
        assert cmd[-2:] == base
        if label.startswith(("(c)", "(d)")):  # on glibc's defaults, the spmdkit launcher included
            # No -P for the PyTorch Python: it may predate Python 3.11.
            assert cmd[worker:worker + 3] == ["/envs/torch/bin/python", "-m", "spmdkit._bench.mp_worker"], label
            assert env == {"PYTHONPATH": "/src", spmdkit.ENV_HOST_ALLOCATOR: "system"}, label
        else:
            # -P: a rich.py in the folder the bench runs from is not imported in place of the library's.
            assert cmd[worker:worker + 4] == [sys.executable, "-P", "-m", "spmdkit._bench.mp_worker"], label
            assert all(env[k] == v for k, v in _host_memory.MALLOC_SETTINGS.items()), label
        # The launcher itself stays on this interpreter: it is spmdkit's own launch.
        assert not launched or cmd[:worker] == multiprocess_suite.LAUNCH


def test_pytorchs_best_cases_also_run_with_spmdkits_malloc_settings():
    # The baseline is PyTorch's best: its fastest cases on glibc's defaults and with the
    # settings every spmdkit case gets, as in the lm suite.
    cases = multiprocess_suite._cases(quick=False, torch=True, levers=[])
    note = multiprocess_suite.MALLOC_NOTE
    for label in ("(c) PyTorch, 1 process", "(c) PyTorch, 1 process, torch.compile",
                  "(d) PyTorch DDP, 2 processes, cores/processes threads"):
        assert cases[label][2] == "system" and cases[label + note][2] == "reuse", label
        assert cases[label][:2] == cases[label + note][:2], label
    assert all(alloc == "reuse" for label, (_, _, alloc) in cases.items() if label.startswith(("(a)", "(b)")))


def test_torch_python_that_cannot_import_torch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--torch-python .*cannot"):
        multiprocess_suite.torch_interpreter(str(tmp_path / "no-such-python"))
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(ValueError, match="cannot import torch and spmdkit .*No module named torch"):
        multiprocess_suite.torch_interpreter(str(fake))


def test_torch_python_gets_this_spmdkit_alone_on_its_path(tmp_path):
    # spmdkit's parent directory went first on PYTHONPATH: in an install that is site-packages,
    # whose jax and numpy (built for this Python) shadowed the other interpreter's own.
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$PYTHONPATH\" > {tmp_path / 'path.txt'}\n")
    fake.chmod(0o755)
    python, env = multiprocess_suite.torch_interpreter(str(fake))
    first = (tmp_path / "path.txt").read_text().strip().split(os.pathsep)[0]
    assert python == str(fake) and env["PYTHONPATH"].split(os.pathsep)[0] == first
    assert os.listdir(first) == ["spmdkit"]
    assert os.path.realpath(os.path.join(first, "spmdkit")) == os.path.dirname(os.path.realpath(spmdkit.__file__))


def test_targets_compare_against_the_fastest_pytorch_case():
    def case(times):
        return {"times": times, "median": float(np.median(times)), "flags": []}

    run = {"cases": {
        "(a) spmdkit, 1 process": case([1.0, 1.0]),
        "(b) spmdkit, 2 processes, default": case([2.0, 2.0]),
        "(c) PyTorch, 1 process": case([4.0, 4.0]),
        "(c) PyTorch, 1 process, torch.compile": case([0.5, 0.5]),
        "(d) PyTorch DDP, 2 processes, cores/processes threads": case([1.0, 1.0]),
    }}
    targets = {t["name"].split(" [")[0]: t for t in multiprocess_suite._model_targets("mlp", run)}
    assert targets["mlp: (a) / best (c)"]["value"] == pytest.approx(0.5)  # vs torch.compile, not eager
    assert targets["mlp: (b) default / best (d)"]["value"] == pytest.approx(0.5)
    assert not targets["mlp: (a) / best (c)"]["met"]


def test_buckets_cover_every_leaf_once_in_backward_order():
    leaves = [np.zeros(n) for n in (10, 1, 30, 2, 50, 3)]
    groups = mp_worker._buckets(leaves, 3)
    assert len(groups) == 3
    assert [i for g in groups for i in g] == [5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize(
    "args",
    [
        ["--allreduce", "leaf"],
        ["--allreduce", "packed"],
        ["--allreduce", "bucketed", "--buckets", "3"],
        ["--allreduce", "packed", "--accum", "2"],
        ["--allreduce", "bucketed", "--grad-dtype", "bf16"],
    ],
)
def test_hand_written_levers_compute_the_single_device_step(args):
    """Every lever's step, on 8 devices, gives the plain one-device SGD step's parameters."""
    import flax.linen as nn
    from jax.sharding import NamedSharding, PartitionSpec as P

    from spmdkit._mesh import make_mesh

    a = mp_worker.parser().parse_args(["--framework", "jax", "--model", "mlp", *args])
    net = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(10)])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 12)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)
    params = net.init(jax.random.key(0), x[:1])["params"]
    opt = optax.sgd(0.5)

    def loss(p):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, x), y).mean()

    expected = optax.apply_updates(params, jax.tree.map(lambda g: -0.5 * g, jax.grad(loss)(params)))
    mesh = make_mesh(data=8)
    repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    step = mp_worker._hand_step(net, opt, mesh, a)
    placed = jax.device_put(params, repl)
    new, _ = step(placed, jax.device_put(opt.init(params), repl), jax.device_put(x, split), jax.device_put(y, split))
    tol = 2e-2 if a.grad_dtype == "bf16" else 1e-5  # bf16 keeps 8 bits of mantissa
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol * 1e-1)
    assert jnp.all(jnp.isfinite(jax.tree.leaves(new)[0]))


# ---- `spmdkit bench` smoke runs (--quick: small shapes, never figures) ----------------

def test_bench_levers_only_for_multiprocess():
    out = run_cli("bench", "--suite", "pmap", "--quick", "--levers", "bf16", timeout=120)
    assert out.returncode == 2 and "--levers is an option of --suite multiprocess" in out.stdout
    out = run_cli("bench", "--suite", "multiprocess", "--levers", "bf16,warp", timeout=120)
    assert out.returncode == 2 and "unknown lever(s) ['warp']" in out.stdout and "Traceback" not in out.stderr
    out = run_cli("bench", "--suite", "multiprocess", "--torch-python", "/no/such/python", timeout=120)
    assert out.returncode == 2 and "--torch-python '/no/such/python'" in out.stdout and "Traceback" not in out.stderr
    # The variable's form was a traceback (exit 1), after the suites before it had run.
    out = run_cli("bench", "--suite", "multiprocess", timeout=120, SPMDKIT_TORCH_PYTHON="/no/such/python")
    assert out.returncode == 2 and "--torch-python '/no/such/python'" in out.stdout and "Traceback" not in out.stderr


def test_bench_all_quick_writes_one_json_and_markdown_per_suite(bench_all_quick):
    from spmdkit._bench import SUITES

    out = bench_all_quick.done
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(os.listdir(bench_all_quick.json)) == sorted(f"{s}.json" for s in SUITES)
    assert sorted(os.listdir(bench_all_quick.markdown)) == sorted(f"{s}.md" for s in SUITES)
    reports = {s: json.loads((bench_all_quick.json / f"{s}.json").read_text()) for s in SUITES}
    for name, report in reports.items():
        assert report["suite"] == name and report["machine"]["devices"] == 8
        assert "target" in (bench_all_quick.markdown / f"{name}.md").read_text() or not report.get("targets")

    # Every suite that uses the method records rounds, per-round times and the load.
    for name in ("data", "ensemble", "sharded", "checkpoint", "multiprocess", "startup", "step"):
        report = reports[name]
        assert report["load"]["before"]["loadavg"] and report["load"]["after"]["loadavg"]
        for run in report["timings"].values():
            assert all(len(c["times"]) == run["rounds"] for c in run["cases"].values())
            if len(run["cases"]) > 1 and run["rounds"] > 1:
                assert run["order"][0] != run["order"][1]  # rotated
        for t in report["targets"]:
            assert isinstance(t["met"], bool) and "flags" in t

    data = reports["data"]
    assert {r["impl"] for r in data["rows"]} == {"spmdkit jit", "hand jit", "seed-002 pmap"}
    assert all(r["loss_spread"] < 1e-4 for r in data["rows"])  # same loss from the same state and batch
    assert [t["target"] for t in data["targets"]] == ["<= 1.02", "<= 1.0", ">= 0.8"]
    assert all(r["iqr_pct"] >= 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in data["rows"])

    inputs = reports["input"]  # uses the method too
    assert inputs["load"]["before"]["loadavg"] and all(
        len(c["times"]) == run["rounds"] for run in inputs["timings"].values() for c in run["cases"].values())
    assert {(r["measure"], r["source"]) for r in inputs["rows"]} == {
        (m, s) for m in ("train steps", "input only") for s in ("(a) arrays", "(b) grain", "(c) grain + prefetch")}
    assert [t["target"] for t in inputs["targets"]] == [">= 0.95"] and all(r["per_s"] > 0 for r in inputs["rows"])

    impls = [r["impl"] for r in reports["ensemble"]["rows"]]
    assert "sequential jit, 1 device" in impls and "spmdkit ensemble, 8 devices" in impls

    sharded = reports["sharded"]
    assert [r["layout"] for r in sharded["rows"]] == ["dp", "fsdp", "tp", "dp+tp", "fsdp+tp"]
    assert all(r["compile_s"] > 0 and r["args_mib"] > 0 for r in sharded["rows"])
    assert [r["layers"] for r in sharded["compile_rows"]] == [4, 16]

    step = reports["step"]
    cases = [r["case"] for r in step["rows"]]
    assert cases[:4] == ["step: Single", "step: DataParallel", "step: Ensemble(8, vmap)",
                         "step: Sharded fsdp+tp, data=2,model=4"]
    assert "transformer LM" in step["rows"][4]["model"] and step["rows"][4]["mesh"] == "data=2,model=4"
    assert {"apply rowwise: DataParallel", "apply exact: DataParallel"} <= set(cases)
    assert all(r["x_hand_jit"] > 0 and r["hand_ms"] > 0 for r in step["rows"])
    assert [t["target"] for t in step["targets"]] == ["<= 1.02"] * 6 + ["<= 1.05"] * 2
    assert "geometric mean" in step["targets"][5]["name"]

    ckpt = reports["checkpoint"]
    ops = [r["operation"] for r in ckpt["rows"]]
    assert "raw sequential write" in ops and "spmdkit restore (resharded)" in ops
    assert all(r["GB_per_s"] > 0 for r in ckpt["rows"])
    assert [t["target"] for t in ckpt["targets"]] == [">= 0.5", ">= 0.5"]

    mp = reports["multiprocess"]
    rates = {r["case"]: r["samples_per_s"] for r in mp["rows"]}
    assert rates["(a) spmdkit, 1 process"] > 0
    assert rates["(b) spmdkit, 2 processes, default"] > 0  # two processes really ran
    assert mp["errors"] == {}
    launches = mp["launch_step_times"]["mlp: (b) spmdkit, 2 processes, default"]
    assert len(launches) == mp["timings"]["MLP 784-1024-1024-10"]["rounds"] and all(len(t) == 5 for t in launches)
    assert "rounds" in mp["timings"]["MLP 784-1024-1024-10"]["flags"]  # quick: a smoke run, and it says so


def test_bench_compare_two_runs_target_by_target(tmp_path, capsys):
    from spmdkit._cli import main

    def write(d, values):
        d.mkdir()
        for suite, value in values.items():
            (d / f"{suite}.json").write_text(json.dumps(
                {"suite": suite, "targets": [{"name": f"{suite} ratio [best case]", "value": value}]}))

    write(tmp_path / "one", {"data": 1.00, "multiprocess": 0.80})
    write(tmp_path / "two", {"data": 1.05, "multiprocess": 0.80})
    assert main(["bench", "--compare", str(tmp_path / "one"), str(tmp_path / "two")]) == 0
    assert "data ratio" in capsys.readouterr().out
    write(tmp_path / "three", {"data": 1.30, "multiprocess": 0.80})
    assert main(["bench", "--compare", str(tmp_path / "one"), str(tmp_path / "three")]) == 6
    assert "NO" in capsys.readouterr().out
    assert main(["bench", "--compare", str(tmp_path / "one"), str(tmp_path / "missing")]) == 2
    out = capsys.readouterr()  # an error is for stderr: stdout holds only the table
    assert "error: no SUITE.json files in" in out.err and out.out == "", out


def test_bench_compare_best_of_different_case_sets_is_not_comparable():
    from spmdkit._bench.report import compare

    def run(cases, best, value):
        return {"multiprocess": {"columns": ["model", "case", "samples_per_s", "flag"],
                                 "rows": [{"model": "MLP", "case": c, "samples_per_s": 1.0, "flag": "spread" if value > 1 else ""} for c in cases],
                                 "targets": [{"name": f"mlp: best (b) [{best}] / (d)", "value": value},
                                             {"name": "mlp: (b) default / (d)", "value": 0.9}]}}

    plain = run(["default", "hand"], "hand", 0.99)
    levers = run(["default", "hand", "lever: packed bf16"], "lever: packed bf16", 1.5)
    rows = {r["target"]: r for r in compare(plain, levers)}
    assert rows["mlp: best (b)"]["agree"] is None and "different cases" in rows["mlp: best (b)"]["note"]
    assert rows["mlp: (b) default / (d)"]["agree"] is True  # the same cases on both sides: judged
    # The same case set with another winner is still a comparison of the same thing.
    other = run(["default", "hand"], "default", 1.5)  # flags differ too: they are not cases
    assert compare(plain, other)[0]["agree"] is False


def _fake_suite(ran: list):
    """A suite of one row that runs in no time, for the bench command's own behaviour."""
    def run(quick):
        ran.append(quick)
        machine = {"devices": 8, "backend": "cpu", "cpu_count": 2, "jax": jax.__version__, "date": "today",
                   "processor": "x", "python": "3"}
        return {"suite": "pmap", "machine": machine, "columns": ["case", "ms"], "rows": [{"case": "a", "ms": 1.0}],
                "targets": []}
    return run


@pytest.mark.parametrize("flags, where", [
    (["--suite", "pmap", "--json"], "afile/out.json"),  # a file where its directory belongs
    (["--suite", "pmap", "--markdown"], "."),  # a directory where the file belongs
    (["--all", "--json"], "afile"),  # --all's directory is a file
    (["--suite", "pmap", "--json"], "missing/out.json"),  # its directory does not exist
])
def test_bench_refuses_an_unwritable_output_before_running_a_suite(tmp_path, monkeypatch, capsys, flags, where):
    from spmdkit import _bench
    from spmdkit._cli import main

    (tmp_path / "afile").write_text("")
    ran = []
    monkeypatch.setattr(_bench, "SUITES", {"pmap": _fake_suite(ran)})
    path = str(tmp_path / where)
    assert main(["bench", *flags, path, "--quick"]) == 2  # a wrong path is bad input (it was 5, an I/O failure)
    err = capsys.readouterr().err
    assert ran == []  # found before minutes of benchmarking, not after
    assert f"error: {flags[-1]} {path}: cannot " in err and "Traceback" not in err
    assert any(reason in err for reason in ("Not a directory", "Is a directory", "File exists",
                                            "No such file or directory")), err
    assert len(err.strip().splitlines()) == 1, err


def test_bench_output_that_the_disk_refuses_is_an_io_failure(tmp_path, monkeypatch, capsys):
    import errno
    import tempfile

    from spmdkit import _bench
    from spmdkit._cli import main

    ran = []
    monkeypatch.setattr(_bench, "SUITES", {"pmap": _fake_suite(ran)})

    def refused(*args, **kwargs):  # as a read-only mount or a directory without write permission
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    assert main(["bench", "--suite", "pmap", "--quick", "--json", str(tmp_path / "out.json")]) == 5
    err = capsys.readouterr().err
    assert ran == [] and "cannot write it: Read-only file system" in err, err


def test_bench_report_that_cannot_be_written_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    import errno

    from spmdkit import _bench
    from spmdkit._cli import main

    monkeypatch.setattr(_bench, "SUITES", {"pmap": _fake_suite([])})
    out = tmp_path / "out.json"
    assert main(["bench", "--suite", "pmap", "--quick", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["suite"] == "pmap"
    out.write_text('{"previous": true}')

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # The disk fills up after the check that the place is writable: the write fails, as one on a full
    # disk does, and must leave the previous report whole (an open(path, "w") had already emptied it).
    monkeypatch.setattr(os, "fsync", disk_full)
    assert main(["bench", "--suite", "pmap", "--quick", "--json", str(out)]) == 5
    err = capsys.readouterr().err
    assert f"error: --json {out}: cannot write it: No space left on device" in err and "Traceback" not in err
    assert json.loads(out.read_text()) == {"previous": True}
    assert sorted(os.listdir(tmp_path)) == ["out.json"]  # no temporary file left beside it


@pytest.mark.parametrize("text, what", [
    ('{"suite": "data", "targ', "not JSON, damaged or cut short"),  # a write cut short
    ("", "not JSON, damaged or cut short"),
    ("[]", "not a spmdkit bench report (a JSON list without a \"suite\" name)"),
    ('{"a": 1}', "not a spmdkit bench report (an object without a \"suite\" name)"),
    ('{"suite": "data", "targets": [{"name": "x"}]}', "not a spmdkit bench report (its \"targets\" are not a list"),
    ('{"suite": "data", "targets": [], "rows": 3}', "not a spmdkit bench report (its \"rows\" are not a list"),
])
def test_bench_compare_names_a_damaged_or_foreign_report(tmp_path, capsys, text, what):
    from spmdkit._cli import main

    good, other = tmp_path / "good", tmp_path / "other"
    for d in (good, other):
        d.mkdir()
        (d / "data.json").write_text(json.dumps({"suite": "data", "targets": [{"name": "r", "value": 1.0}]}))
    (other / "data.json").write_text(text)
    assert main(["bench", "--compare", str(good), str(other)]) == 2
    out = capsys.readouterr()
    assert f"error: --compare: {other / 'data.json'}: {what}" in out.err, out
    assert len(out.err.strip().splitlines()) == 1 and out.out == "" and "Traceback" not in out.err
