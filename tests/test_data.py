"""Training from pipelines: iterables, Grain, checks on the first batch and mid-run."""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._data import BatchError, DataExhaustedError

X = np.linspace(-1, 1, 64, dtype=np.float32)
DATA = {"x": X, "y": 3 * X + 1}


def _task(train_data):
    return spmdkit.Task(
        name="line",
        init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
        loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
        train_data=train_data,
    )


def _fit(train_data, steps=8, bs=16, prefetch=2, **kw):
    config = spmdkit.TrainConfig(steps=steps, batch_size=bs, prefetch=prefetch)
    return spmdkit.fit(_task(train_data), spmdkit.DataParallel(), optax.sgd(0.3), config, progress=False, **kw)


def _batches(order_seed=0, bs=16):
    order = np.random.default_rng(order_seed).permutation(64)
    return [{"x": X[order[i:i + bs]], "y": 3 * X[order[i:i + bs]] + 1} for i in range(0, 64, bs)]


def test_iterables_train_as_the_same_batches_as_arrays():
    """A list, a generator, and a re-iterable: the same batches give the same parameters."""
    batches = _batches()
    from_list = _fit(batches, steps=8)  # two epochs of a re-iterable
    from_gen = _fit((b for b in batches * 2), steps=8)
    assert from_list.summary["status"] == "completed"
    for k in ("w", "b"):
        np.testing.assert_array_equal(from_list.params[k], from_gen.params[k])
    assert abs(float(from_list.params["w"]) - 3) < 1.0


def test_a_generator_is_not_called_a_scalar_and_a_short_one_says_it_is_finite(tmp_path):
    with pytest.raises(DataExhaustedError, match=r"one-shot iterator and ended after 4 batches"):
        _fit(iter(_batches()), steps=6, out_dir=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())  # nothing lost: the good part is written
    assert summary["status"] == "failed" and summary["steps"] == 4


@pytest.mark.parametrize("prefetch", [0, 2])
def test_first_batch_and_mid_run_errors_name_the_leaf(prefetch):
    bad = _batches()
    bad[0] = {"x": bad[0]["x"][:10], "y": bad[0]["y"][:10]}
    with pytest.raises(BatchError, match=r"batch\['x'\] has shape \(10,\); its leading \(batch\) axis must hold "
                                         r"batch_size=16 rows"):
        _fit(bad, prefetch=prefetch)
    ragged = _batches()
    ragged[2] = {"x": ragged[2]["x"][:5], "y": ragged[2]["y"][:5]}
    with pytest.raises(BatchError, match=r"batch 2\['x'\] has shape \(5,\).*ragged"):
        _fit(ragged, prefetch=prefetch)
    renamed = _batches()
    renamed[1] = {"x": renamed[1]["x"], "target": renamed[1]["y"]}
    with pytest.raises(BatchError, match="batch 1 has structure"):
        _fit(renamed, prefetch=prefetch)


def test_pipeline_of_unknown_length_needs_steps():
    def gen():
        yield from _batches()
    with pytest.raises(spmdkit.ConfigError, match="unknown length"):
        spmdkit.fit(_task(gen()), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(epochs=1, batch_size=16),
                    progress=False)


def test_prefetch_gives_the_same_parameters_as_none():
    a, b = _fit(DATA, steps=12, prefetch=0), _fit(DATA, steps=12, prefetch=3)
    for k in ("w", "b"):
        np.testing.assert_array_equal(a.params[k], b.params[k])


@pytest.mark.skipif(sys.version_info < (3, 12), reason="grain needs Python >= 3.12")
def test_grain_datasets_and_resume_of_their_iterator(tmp_path):
    grain = pytest.importorskip("grain")
    source = grain.MapDataset.source([{"x": X[i], "y": 3 * X[i] + 1} for i in range(64)])
    mapped = source.shuffle(seed=1).batch(16, drop_remainder=True)
    a = _fit(mapped, steps=10)
    assert a.summary["status"] == "completed" and a.summary["steps"] == 10
    iterable = mapped.to_iter_dataset()
    whole = _fit(iterable, steps=10)  # restarted each epoch (a MapDataset re-shuffles by index instead)
    ckpt = spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=3)
    _fit(iterable, steps=6, checkpoint=ckpt)
    meta = spmdkit.Checkpointer(ckpt).meta(6)
    assert meta["data"]["batches"] == 6 and meta["data"]["iterator"] is not None
    resumed = _fit(iterable, steps=10, checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=3,
                                                                             resume=True))
    assert resumed.summary["resumed_from_step"] == 6
    np.testing.assert_array_equal(resumed.params["w"], whole.params["w"])


def test_many_prefetched_steps_with_collectives_do_not_hang():
    """The prefetch thread only reads and places; the steps stay synced, so XLA:CPU's
    rendezvous (which aborts when ~32+ collective steps are queued) is never starved."""
    result = _fit(DATA, steps=120, bs=8, prefetch=8)
    assert result.summary["status"] == "completed" and result.summary["steps"] == 120


@pytest.mark.skipif(sys.version_info < (3, 12), reason="grain needs Python >= 3.12")
def test_sigkill_and_resume_from_a_grain_pipeline_is_bit_equal(tmp_path):
    pytest.importorskip("grain")
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    try:
        import _data_kill_program as program
    finally:
        sys.path.remove(str(here))
    ck, total = tmp_path / "ck", 600
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_")}

    def start(resume):
        return subprocess.Popen([sys.executable, str(here / "_data_kill_program.py"), str(ck), str(tmp_path / "p.npz"),
                                 str(total), str(resume)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    p = start(0)
    try:
        deadline = time.time() + 120
        while p.poll() is None and time.time() < deadline and not any(
                (spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(ck))).steps() if ck.exists() else [])[-1:]):
            time.sleep(0.05)
        time.sleep(0.3)
        assert p.poll() is None, "the run ended before it was killed; raise total"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        p = start(1)
        stdout, stderr = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, stderr[-3000:]
    resumed_from = int(stdout.split("resumed from step ")[1].split()[0])
    assert 0 < resumed_from < total
    with np.load(tmp_path / "p.npz") as got:
        straight = program.run(None, total, 0)
        for k in ("w", "b"):
            np.testing.assert_array_equal(got[k], straight[k])


@pytest.mark.skipif(sys.version_info < (3, 12), reason="grain needs Python >= 3.12")
def test_a_grain_data_loader_resumes_from_its_saved_state(tmp_path):
    grain = pytest.importorskip("grain")

    def loader():
        sampler = grain.samplers.IndexSampler(num_records=64, shuffle=True, seed=0, num_epochs=None,
                                              shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True))
        return grain.DataLoader(data_source=[{"x": X[i], "y": np.float32(3 * X[i] + 1)} for i in range(64)],
                                sampler=sampler, operations=[grain.transforms.Batch(16, drop_remainder=True)],
                                worker_count=0)

    whole = _fit(loader(), steps=10)
    _fit(loader(), steps=6, checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=3))
    saved = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path))).meta(6)["data"]
    assert saved["processes"] == 1 and '"0": 95' in saved["iterator"]["bytes"]  # 6 batches of 16 seen, not more
    resumed = _fit(loader(), steps=10, checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=3, resume=True))
    np.testing.assert_array_equal(resumed.params["w"], whole.params["w"])
    with pytest.raises(spmdkit.ConfigError, match="written by 2 process"):
        from spmdkit._data import PipelineFeed
        PipelineFeed(loader(), 16).resume({**saved, "processes": 2})


def test_a_function_as_data_is_named_not_called_a_scalar():
    def make_batches():
        return iter(_batches())

    with pytest.raises(spmdkit.DataError, match=r"function 'make_batches'.*\n  Fix: pass what it returns"):
        _task(make_batches)


def test_a_first_batch_the_loss_cannot_read_is_named_before_training():
    renamed = [{"x": b["x"], "target": b["y"]} for b in _batches()]
    with pytest.raises(spmdkit.TaskError, match=r"failed on a batch of 16: KeyError: 'y'"):
        _fit(renamed)
