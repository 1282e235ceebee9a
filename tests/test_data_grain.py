"""Training from Grain pipelines (Python >= 3.12, the ``grain`` extra): datasets, loaders,
their saved iterator state, and SIGKILL + resume."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import spmdkit

grain = pytest.importorskip("grain")  # the oldest environment (Python 3.11) has no Grain

X = np.linspace(-1, 1, 64, dtype=np.float32)


def _fit(train_data, steps=8, **kw):
    import jax.numpy as jnp
    import optax

    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
                        loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
                        train_data=train_data)
    return spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.3), spmdkit.TrainConfig(steps=steps, batch_size=16),
                       progress=False, **kw)


def test_grain_datasets_and_resume_of_their_iterator(tmp_path):
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


def test_sigkill_and_resume_from_a_grain_pipeline_is_bit_equal(tmp_path):
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


def test_a_grain_data_loader_resumes_from_its_saved_state(tmp_path):

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



def test_grain_batches_are_fits_array_order_read_per_batch_and_resume_on_any_process_count(tmp_path):
    from spmdkit._data import ArrayFeed, PipelineFeed

    d = spmdkit.write_dataset(tmp_path / "ds", {"x": X, "y": 3 * X + 1})
    batches = spmdkit.grain_batches(d, 16, seed=2)
    assert isinstance(batches, grain.MapDataset) and len(batches) == 4
    order = ArrayFeed({"x": X}, 16, 2, True)
    for k in (0, 3, 4, 9):  # into later epochs, reshuffled as fit reshuffles arrays
        idx = order.indices(k)[1]
        np.testing.assert_array_equal(batches[k]["x"], X[idx])
        halves = [spmdkit.grain_batches(d, 16, seed=2, process_index=p, process_count=2)[k]["x"] for p in (0, 1)]
        np.testing.assert_array_equal(np.concatenate(halves), X[idx])  # each process reads only its half
    np.testing.assert_array_equal(batches.map(lambda b: b["x"] * 2)[1], 2 * X[order.indices(1)[1]])

    def fit(data):
        import jax.numpy as jnp
        import optax

        task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
                            loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
                            train_data=data)
        return spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.3),
                           spmdkit.TrainConfig(steps=6, batch_size=16, seed=2, prefetch=2), progress=False)

    from_grain, from_arrays = fit(batches), fit(str(d))
    for k in ("w", "b"):
        np.testing.assert_array_equal(from_grain.params[k], from_arrays.params[k])

    # A checkpoint written by 2 processes resumes in 1 by global position; anything else is refused.
    written_by_two = PipelineFeed(spmdkit.grain_batches(d, 16, seed=2), 16).state(4) | {"processes": 2}
    PipelineFeed(batches, 16).resume(written_by_two)
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)seed.: 2.*seed.: 5"):
        PipelineFeed(spmdkit.grain_batches(d, 16, seed=5), 16).resume(written_by_two)
    plain = grain.MapDataset.source([{"x": X[i], "y": X[i]} for i in range(64)]).batch(16)
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)written by 2 process.*this run has 1.*grain_batches"):
        PipelineFeed(plain, 16).resume(PipelineFeed(plain, 16).state(4) | {"processes": 2})
    with pytest.raises(spmdkit.ConfigError, match="batch_size=15 over 2 process"):
        spmdkit.grain_batches(d, 15, process_index=0, process_count=2)


def test_two_processes_killed_and_resumed_continue_each_iterator_from_its_saved_state(tmp_path):
    """2 processes, each with its own Grain iterator: SIGKILL mid-run, resume with 2 -> the parameters
    of the uninterrupted run, every process's iterator state restored (not re-read from the start)."""
    import os
    import signal
    import time
    from pathlib import Path

    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    try:
        from _launch_two import start_two
    finally:
        sys.path.remove(str(here))
    ck, out, total = tmp_path / "ck", str(tmp_path / "p"), 300
    program = here / "_data_kill_program.py"

    def steps():  # the intact ones: a step killed before its manifest was written cannot be resumed
        if not ck.exists():
            return []
        reader = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(ck)))
        return [s for s in reader.steps() if not reader.problems(s)]

    p = start_two(program, str(ck), out, str(total), "0", "mp")
    try:
        deadline = time.time() + 240
        while p.poll() is None and time.time() < deadline and not steps():
            time.sleep(0.05)
        time.sleep(0.3)
        assert p.poll() is None, "the run ended before it was killed; raise total" + p.stderr.read()[-2000:]
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and both workers
        p.wait(timeout=30)
        saved = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(ck))).meta(steps()[-1])["data"]
        assert saved["processes"] == 2 and sorted(saved["iterators"]) == ["0", "1"]
        assert all(s["iterator"] is not None for s in saved["iterators"].values())
        p = start_two(program, str(ck), out, str(total), "1", "mp")
        stdout, stderr = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, stderr[-3000:]
    resumed_from = int(stdout.split("resumed from step ")[1].split()[0])
    assert 0 < resumed_from < total
    with np.load(f"{out}.straight.npz") as straight:
        for proc in (0, 1):
            with np.load(f"{out}.{proc}.npz") as got:
                for k in ("w", "b"):
                    np.testing.assert_array_equal(got[k], straight[k])
                # Restored, the iterator reads from the checkpoint on (8 examples a batch, plus at most two
                # epochs of 4 batches read ahead: Grain's and the first-batch check's); read again from the
                # start and skipped, it would read all `total` batches and more.
                assert int(got["reads"]) <= 8 * (total - resumed_from + 8) < 8 * total, (int(got["reads"]),
                                                                                          resumed_from)


def test_a_short_last_batch_of_an_epoch_is_named_before_training_and_never_split_unevenly(tmp_path):
    from spmdkit._data import BatchError

    d = spmdkit.write_dataset(tmp_path / "ds", {"x": X[:40], "y": 3 * X[:40] + 1})  # 16, 16, then 8 rows
    seen = []
    counted = spmdkit.grain_batches(d, 16, drop_remainder=False).map(lambda b: (seen.append(1), b)[1])
    with pytest.raises(BatchError, match=r"batch 2\['x'\] has shape \(8,\)"):
        _fit(counted, steps=2)  # found when the run starts, not when its epoch ends
    assert len(seen) == 2  # the first batch and the epoch's last: nothing was trained
    halves = spmdkit.grain_batches(d, 16, drop_remainder=False, process_index=1, process_count=2)
    assert halves[1]["x"].shape == (8,) and halves[2]["x"].shape == (4,)  # 8 rows split over 2
    odd = spmdkit.write_dataset(tmp_path / "odd", {"x": X[:37], "y": X[:37]})  # last batch: 5 rows
    with pytest.raises(spmdkit.ConfigError, match="batch 2 holds 5 rows .* do not split over 2 processes"):
        spmdkit.grain_batches(odd, 16, drop_remainder=False, process_index=1, process_count=2)[2]


@pytest.mark.parametrize("kw, words", [
    (dict(batch_size="4"), r"batch_size='4' \(str\) is not a whole number"),
    (dict(batch_size=True), r"batch_size=True \(bool\) is not a whole number"),
    (dict(batch_size=4, seed=None), r"seed=None \(NoneType\) is not a whole number"),
    (dict(batch_size=4, process_index=5, process_count=2), r"process_index=5 with process_count=2.*\n.*from 0 to 1"),
])
def test_grain_batches_names_arguments_that_are_not_whole_numbers(tmp_path, kw, words):
    # A string batch size or a None seed was a bare TypeError from inside; True was a batch of 1; a
    # process_index out of range was reported as a batch size that does not split.
    d = spmdkit.write_dataset(tmp_path / "ds", {"x": np.arange(10.0)})
    with pytest.raises(spmdkit.ConfigError, match=words):
        spmdkit.grain_batches(d, **kw)
    assert len(spmdkit.grain_batches(d, np.int64(4), seed=np.int32(1))) == 2


def test_grain_batches_resumed_over_a_data_set_written_again_is_refused(tmp_path):
    """Its order held only the example count: the same path written again with other rows (the
    same count) resumed without a word, training on other data than the run it continued."""
    import jax.numpy as jnp
    import optax

    d = spmdkit.write_dataset(tmp_path / "ds", {"x": X, "y": 3 * X + 1})

    def fit(steps, resume):
        task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
                            loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
                            train_data=spmdkit.grain_batches(d, 16, seed=2))
        return spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.3), spmdkit.TrainConfig(steps=steps, batch_size=16,
                           seed=2), progress=False,
                           checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=3, resume=resume))

    fit(3, False)
    assert fit(6, True).summary["steps"] == 6  # the same data set resumes
    spmdkit.write_dataset(d, {"x": X[::-1].copy(), "y": 3 * X + 1}, overwrite=True)
    with pytest.raises(spmdkit.ConfigError, match=r"grain_batches whose data set differs .*manifest CRC-32 \w{8} then"):
        fit(9, True)
