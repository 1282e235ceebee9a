"""Evaluation data: arrays, a data set directory or a finite pipeline give the same means;
chunks are exact (none dropped or counted twice); in two processes each reads only its rows
of the eval set and the figure is the one process's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._data import BatchError
from spmdkit._data._eval import chunk_bounds
from spmdkit._train import evaluate_task
from spmdkit._train._steps import task_eval_step

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _eval_mp_program as program  # noqa: E402
from _launch_two import launch_two  # noqa: E402

sys.path.remove(str(HERE))


def _mean(eval_data, batch_size=16, strategy=None):
    task = program.task(eval_data)
    strategy = strategy or spmdkit.DataParallel()
    return evaluate_task(program.state(strategy), task.eval_data, batch_size,
                         strategy.evaluate(task_eval_step(task, jax.random.key(0))))


def test_chunks_cover_every_row_once_and_split_over_the_devices():
    for n, size, shards in [(45, 16, 8), (13, 50, 8), (5, 16, 8), (64, 20, 8), (7, 3, 1), (100, 256, 3)]:
        bounds = chunk_bounds(n, size, shards)
        assert [lo for lo, _ in bounds] == [0] + [hi for _, hi in bounds[:-1]] and bounds[-1][1] == n
        uneven = [hi - lo for lo, hi in bounds if (hi - lo) % shards]
        assert len(uneven) <= 1 and all(r < shards for r in uneven), (n, size, shards, bounds)
        assert all(hi - lo <= size for lo, hi in bounds)


def test_eval_from_a_directory_equals_eval_from_the_arrays_and_a_pipeline(tmp_path):
    arrays = program.eval_arrays()
    directory = spmdkit.write_dataset(tmp_path / "eval", arrays)
    from_arrays = _mean(arrays)
    assert _mean(str(directory)) == from_arrays  # the same chunks, the same program: bit-equal
    params = jax.device_get(program.state().params)
    want = float(np.mean((np.asarray(program.predict(params, arrays["x"])) - arrays["y"]) ** 2))
    assert from_arrays["loss"] == pytest.approx(want, rel=1e-5)  # the mean over all 45 rows, once each
    batches = [{k: v[i:i + 8] for k, v in arrays.items()} for i in range(0, 45, 8)]  # the last one has 5 rows
    assert _mean(batches)["loss"] == pytest.approx(from_arrays["loss"], rel=1e-6)
    assert _mean(arrays, strategy=spmdkit.Single())["loss"] == pytest.approx(from_arrays["loss"], rel=1e-6)
    # fit evaluates from the directory as from the arrays
    config = spmdkit.TrainConfig(steps=2, batch_size=16, eval_batch_size=16)
    runs = [spmdkit.fit(program.task(data, train=True), spmdkit.DataParallel(), optax.sgd(0.1), config,
                        progress=False).summary for data in (arrays, str(directory))]
    assert runs[0]["eval_loss"] == runs[1]["eval_loss"] and runs[0]["eval_loss"] is not None


def test_grain_eval_pipeline_equals_the_arrays(tmp_path):
    grain = pytest.importorskip("grain")
    arrays = program.eval_arrays()
    source = spmdkit.DatasetSource(spmdkit.write_dataset(tmp_path / "eval", arrays))
    pipeline = grain.MapDataset.source(source).batch(16, drop_remainder=False)  # 16, 16, 13
    assert _mean(pipeline)["loss"] == pytest.approx(_mean(arrays)["loss"], rel=1e-6)


def test_endless_grain_eval_pipelines_are_named_not_run_forever(tmp_path):
    grain = pytest.importorskip("grain")
    source = spmdkit.DatasetSource(spmdkit.write_dataset(tmp_path / "eval", program.eval_arrays()))
    batches = grain.MapDataset.source(source).batch(16)
    forever = grain.samplers.IndexSampler(len(source), num_epochs=None, shard_options=grain.sharding.NoSharding())
    loader = grain.DataLoader(data_source=source, sampler=forever, operations=[grain.transforms.Batch(16)])
    with pytest.raises(spmdkit.DataError, match="has no end .*RepeatMapDataset"):
        program.task(batches.repeat().to_iter_dataset())
    with pytest.raises(spmdkit.DataError, match="has no end .*num_epochs=None"):
        program.task(loader)
    once = grain.samplers.IndexSampler(len(source), num_epochs=1, shard_options=grain.sharding.NoSharding())
    finite = [batches.repeat(2).to_iter_dataset(), batches.repeat()[:3].to_iter_dataset(),
              grain.DataLoader(data_source=source, sampler=once, operations=[grain.transforms.Batch(16)])]
    for pipeline in finite:  # accepted, and read to the end
        assert _mean(program.task(pipeline).eval_data)["loss"] > 0


def test_bad_eval_pipelines_are_named():
    arrays = program.eval_arrays()
    with pytest.raises(spmdkit.DataError, match="eval_data is a one-shot iterator"):
        program.task(iter([arrays]))
    renamed = [{"x": arrays["x"][:8], "y": arrays["y"][:8]}, {"x": arrays["x"][8:16], "target": arrays["y"][8:16]}]
    with pytest.raises(BatchError, match="batch 1 has structure"):
        _mean(renamed)
    wide = [{"x": arrays["x"][:8], "y": arrays["y"][:8]}, {"x": np.ones((8, 5), np.float32), "y": arrays["y"][8:16]}]
    with pytest.raises(BatchError, match=r"batch 1\['x'\] has shape \(8, 5\)"):
        _mean(wide)
    with pytest.raises(spmdkit.DataError, match="yielded no batch"):
        _mean([])


def test_two_processes_read_only_their_eval_rows_and_agree_with_one(tmp_path):
    directory = spmdkit.write_dataset(tmp_path / "eval", program.eval_arrays())
    launch_two(HERE / "_eval_mp_program.py", str(directory), str(tmp_path / "out"), timeout=240)
    one = program.run(str(directory))
    tail = set(range(40, 45))  # 45 rows in chunks of 16 on 8 devices: 16, 16, 8, then 5 rows on every device
    halves = [set(range(lo + 4 * p, lo + 4 * p + 4)) if hi - lo == 8 else set(range(lo + 8 * p, lo + 8 * p + 8))
              for p in (0, 1) for lo, hi in ((0, 16), (16, 32), (32, 40))]
    for p in (0, 1):
        with np.load(tmp_path / f"out.{p}.npz") as got:
            assert sorted(got["reads"].tolist()) == sorted(set().union(*halves[3 * p: 3 * p + 3]) | tail)
            for key in ("array_loss", "pipeline_loss", "fit_eval_loss"):
                np.testing.assert_allclose(got[key], one[key], rtol=1e-5, err_msg=key)


def test_an_eval_set_the_model_cannot_read_is_named_before_training():
    arrays = program.eval_arrays()
    task = program.task({"x": np.ones((6, 5), np.float32), "y": arrays["y"][:6]})  # 5 features, trained on 4
    with pytest.raises(spmdkit.TaskError, match=r"fails on eval_data, whose examples are \['x'\] \(5,\), "
                                                r"\['y'\] \(2,\) \(training examples: \['x'\] \(4,\)"):
        spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=1, batch_size=8), progress=False)


def test_an_eval_pipeline_the_model_cannot_read_is_named_before_training(tmp_path):
    """Its first batch is checked as the arrays are: it failed at the first eval, after every step,
    with the loss's raw KeyError and nothing written but metrics.jsonl."""
    arrays = program.eval_arrays()
    renamed = [{"x": arrays["x"][i:i + 8], "target": arrays["y"][i:i + 8]} for i in range(0, 45, 8)]
    with pytest.raises(spmdkit.TaskError, match=r"fails on eval_data, whose examples are \['target'\] \(2,\), "
                                                r"\['x'\] \(4,\).*KeyError: 'y'"):
        spmdkit.fit(program.task(renamed), spmdkit.DataParallel(), optax.sgd(0.1),
                    spmdkit.TrainConfig(steps=30, batch_size=8), out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # no step ran


class _FailsOnSecondPass:
    """An eval pipeline whose reader fails on its second pass (a network file system gone)."""

    def __init__(self, batches):
        self.batches, self.passes = batches, 0

    def __iter__(self):
        self.passes += 1
        for i, batch in enumerate(self.batches):
            if self.passes > 1 and i == 1:
                raise OSError("the file server went away")
            yield batch


def test_an_eval_pipeline_that_raises_keeps_the_run(tmp_path):
    """The pipeline's own error ended the run raw, with no summary or parameters written; a
    None batch ended the eval set early, silently."""
    arrays = program.eval_arrays()
    batches = [{k: v[i:i + 8] for k, v in arrays.items()} for i in range(0, 45, 8)]
    config = spmdkit.TrainConfig(steps=6, batch_size=8, eval_every=3)
    with pytest.raises(spmdkit.DataError, match="eval_data raised OSError reading eval batch 1: the file server"):
        spmdkit.fit(program.task(_FailsOnSecondPass(batches)), spmdkit.DataParallel(), optax.sgd(0.1), config,
                    out_dir=tmp_path / "out", progress=False)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed" and "OSError" in summary["error"]
    assert (tmp_path / "out" / "params.npz").exists()
    with pytest.raises(BatchError, match=r"eval_data batch 2 holds no arrays \(it is NoneType\)"):
        _mean([*batches[:2], None, *batches[2:]])
    # failing at its first read, it is named before training: it failed after every step
    with pytest.raises(spmdkit.DataError, match="eval_data raised OSError reading its first batch"):
        spmdkit.fit(program.task(_FailsFirst()), spmdkit.DataParallel(), optax.sgd(0.1), config,
                    out_dir=tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2" / "summary.json").exists()
    with pytest.raises(spmdkit.DataError, match="eval_data yielded no batch"):
        spmdkit.fit(program.task([]), spmdkit.DataParallel(), optax.sgd(0.1), config, progress=False)


class _FailsFirst:
    def __iter__(self):
        raise OSError("no such eval file")
        yield
