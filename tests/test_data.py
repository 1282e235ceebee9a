"""Training from pipelines (lists, generators, iterators): checks on the first batch and mid-run,
finite iterators, prefetch. Grain pipelines: test_data_grain.py."""

from __future__ import annotations

import json

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
    ckpt = spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=3)
    with pytest.raises(DataExhaustedError, match=r"one-shot iterator and ended after 4 batches"):
        _fit(iter(_batches()), steps=6, out_dir=tmp_path / "out", checkpoint=ckpt)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())  # nothing lost: the good part is written
    assert summary["status"] == "failed" and summary["steps"] == 4 and "ended after 4 batches" in summary["error"]
    assert spmdkit.Checkpointer(ckpt).steps()[-1] == 4  # the last good state is saved too


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
    lists = [{"x": b["x"].tolist(), "y": b["y"].tolist()} for b in _batches()]
    with pytest.raises(BatchError, match=r"(?s)batch\['x'\]\[0\] is a Python float, not an array.*np.asarray"):
        _fit(lists, prefetch=prefetch)


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


def test_many_prefetched_steps_with_collectives_do_not_hang():
    """The prefetch thread only reads and places; the steps stay synced, so XLA:CPU's
    rendezvous (which aborts when ~32+ collective steps are queued) is never starved."""
    result = _fit(DATA, steps=120, bs=8, prefetch=8)
    assert result.summary["status"] == "completed" and result.summary["steps"] == 120


def test_a_function_as_data_is_named_not_called_a_scalar():
    def make_batches():
        return iter(_batches())

    with pytest.raises(spmdkit.DataError, match=r"function 'make_batches'.*\n  Fix: pass what it returns"):
        _task(make_batches)


def test_a_first_batch_the_loss_cannot_read_is_named_before_training():
    renamed = [{"x": b["x"], "target": b["y"]} for b in _batches()]
    with pytest.raises(spmdkit.TaskError, match=r"failed on a batch of 16: KeyError: 'y'"):
        _fit(renamed)


def test_resuming_a_run_from_other_data_is_refused_and_leaves_the_directory_usable(tmp_path):
    ckpt = spmdkit.CheckpointConfig(str(tmp_path), every=2)
    _fit(DATA, steps=4, checkpoint=ckpt)
    refused, accepted = [], []
    with pytest.raises(spmdkit.ConfigError, match="this run trains from a pipeline"):
        _fit(_batches(), steps=6, checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=2, resume=True),
             log=refused.append)
    assert not any("resumed from step" in line for line in refused), refused  # logged only once accepted
    resumed = _fit(DATA, steps=6, checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=2, resume=True),
                   log=accepted.append)
    assert resumed.summary["resumed_from_step"] == 4
    assert any("resumed from step 4" in line for line in accepted), accepted


def test_resuming_on_arrays_of_the_same_length_with_other_values_is_refused(tmp_path):
    # Only the kind and the number of examples were compared: other data of the same length (a corpus
    # file edited between runs) resumed without a word, and the run was not the one it continued.
    _fit(DATA, steps=4, checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=2))
    resume = spmdkit.CheckpointConfig(str(tmp_path), every=2, resume=True)
    changed = {"x": X, "y": 3 * X + 1.5}
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)written training on other data: 64 examples as now, but their "
                                                  r"bytes differ \(CRC-32 [0-9a-f]{8} then, [0-9a-f]{8} now\).*Fix: resume "
                                                  r"with the training data the run started with"):
        _fit(changed, steps=6, checkpoint=resume, log=lambda m: None)
    same = {"x": X.copy(), "y": 3 * X + 1}  # equal bytes in other arrays: the same data
    assert _fit(same, steps=6, checkpoint=resume, log=lambda m: None).summary["resumed_from_step"] == 4


def test_a_pipeline_that_raises_mid_run_keeps_what_was_trained_and_resumes(tmp_path):
    good = _batches()

    class Flaky:  # re-iterable; fails once at its 6th batch, as a reader on a flaky disk would
        failed = False

        def __iter__(self):
            for k in range(len(good)):
                if k == 1 and not Flaky.failed and getattr(self, "epoch", 0) == 1:
                    Flaky.failed = True
                    raise OSError("read timed out")
                yield good[k]
            self.epoch = getattr(self, "epoch", 0) + 1

    ckpt = lambda resume: spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=100, resume=resume)  # noqa: E731
    with pytest.raises(spmdkit.DataError, match="raised OSError reading batch 5: read timed out") as raised:
        _fit(Flaky(), steps=8, out_dir=tmp_path / "out", checkpoint=ckpt(False))
    assert isinstance(raised.value.__cause__, OSError)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 5 and (tmp_path / "out" / "params.npz").exists()
    resumed = _fit(Flaky(), steps=8, checkpoint=ckpt(True))
    assert resumed.summary["resumed_from_step"] == 5
    for k in ("w", "b"):
        np.testing.assert_array_equal(resumed.params[k], _fit(good, steps=8).params[k])


def _refilled(bs=16):
    """A re-iterable that refills one buffer and yields it again for every batch, as a
    pipeline with a preallocated batch does."""
    class Refilled:
        def __iter__(self):
            buf = {"x": np.empty(bs, np.float32), "y": np.empty(bs, np.float32)}
            for b in _batches(bs=bs):
                buf["x"][...], buf["y"][...] = b["x"], b["y"]
                yield buf
    return Refilled()


@pytest.mark.parametrize("strategy", ["data", "single"])
def test_prefetch_of_a_pipeline_that_refills_one_buffer_trains_on_its_batches(strategy):
    """The prefetch thread reads ahead: it held the buffer itself (or a device array sharing its
    memory) while the pipeline refilled it, and the run trained on later rows, silently."""
    make = spmdkit.DataParallel if strategy == "data" else spmdkit.Single
    config = lambda prefetch: spmdkit.TrainConfig(steps=8, batch_size=16, prefetch=prefetch)  # noqa: E731
    want = spmdkit.fit(_task(_batches()), make(), optax.sgd(0.3), config(0), progress=False)
    got = spmdkit.fit(_task(_refilled()), make(), optax.sgd(0.3), config(3), progress=False)
    for k in ("w", "b"):
        np.testing.assert_array_equal(got.params[k], want.params[k])


def test_a_batch_of_another_dtype_or_example_shape_is_not_called_ragged():
    """Each was "(a ragged batch?)" with the fix to drop an epoch's last batch."""
    def changing(change):
        for i, b in enumerate(_batches() * 2):
            yield change(b) if i == 5 else b
    retyped = lambda b: {"x": b["x"].astype(np.float64), "y": b["y"]}  # noqa: E731
    with pytest.raises(BatchError, match=r"batch 5\['x'\] .* dtype float32 \(another dtype\)\.\n  Fix: yield one "
                                         r"dtype per leaf .*x\.astype\(np\.float32\)"):
        _fit(changing(retyped), steps=8)
    widened = lambda b: {"x": np.stack([b["x"], b["x"]], 1), "y": b["y"]}  # noqa: E731
    with pytest.raises(BatchError, match=r"batch 5\['x'\] has shape \(16, 2\).*\(another per-example shape\)"):
        _fit(changing(widened), steps=8)


def test_a_list_of_batches_changed_between_runs_is_named_on_resume(tmp_path):
    """Its bytes were not recorded: resumed with other batches (the same count), the run trained
    on them without a word; other eval batches changed its eval figures without one."""
    def fit(train, eval_data, steps, ck, resume=False):
        task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
                            loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
                            train_data=train, eval_data=eval_data)
        return spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.3), spmdkit.TrainConfig(steps=steps, batch_size=16),
                           progress=False, checkpoint=spmdkit.CheckpointConfig(str(tmp_path / ck), every=3,
                                                                               resume=resume))

    batches, other = _batches(), _batches(order_seed=1)
    whole = fit(batches, batches[:1], 6, "whole")
    fit(batches, batches[:1], 3, "cut")
    with pytest.raises(spmdkit.ConfigError, match=r"a list of 4 batches whose bytes differ .*CRC-32 \w{8} then"):
        fit(other, batches[:1], 6, "cut", resume=True)
    with pytest.warns(RuntimeWarning, match="written evaluating on other data"):
        resumed = fit(batches, other[:1], 6, "cut", resume=True)
    for k in ("w", "b"):  # the same batches resume the very same run
        np.testing.assert_array_equal(resumed.params[k], whole.params[k])


def test_a_list_of_the_datas_arrays_is_told_apart_from_a_list_of_batches():
    """[x, y] is read as two batches of 64 rows: "yield batches of 16 rows" did not say why."""
    with pytest.raises(BatchError, match=r"shape \(64,\);.*train_data is a list, which spmdkit reads as a pipeline "
                                         r"of batches.*pass them as a tuple \(x, y\)"):
        _fit([X, 3 * X + 1])
    with pytest.raises(spmdkit.ConfigError, match=r"or a data set directory \(train_data=DIR; --data DIR\)"):
        spmdkit.fit(_task(_batches()), spmdkit.Ensemble(2, bagging=True), optax.sgd(0.3),
                    spmdkit.TrainConfig(steps=2, batch_size=16), progress=False)


def test_a_run_reads_no_batch_past_its_last_step_from_a_one_shot_iterator():
    """The prefetch thread read up to prefetch + 1 batches ahead: a run continued with the same
    iterator skipped them without a word."""
    def numbered():
        for i in range(100):
            yield {"x": X[:16] + i, "y": 3 * X[:16] + 1, "i": np.full(16, i)}
    for prefetch in (0, 2):
        it = numbered()
        _fit(it, steps=5, prefetch=prefetch)
        assert int(next(it)["i"][0]) == 5, prefetch


def test_a_pipeline_of_bfloat16_batches_trains_and_evaluates():
    # NumPy files ml_dtypes' bfloat16 under kind "V": such a pipeline was refused, "dtype bfloat16;
    # JAX trains on numeric arrays".
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(32, 2)
    batches = [{"x": x[i:i + 8].astype(jnp.bfloat16), "y": x[i:i + 8, :1].astype(jnp.bfloat16)} for i in (0, 8, 16, 24)]
    task = spmdkit.Task(name="bf16", init=lambda rng: {"w": jnp.zeros((2, 1))},
                        loss_fn=lambda p, b, rng: (jnp.mean((b["x"].astype(jnp.float32) @ p["w"]
                                                             - b["y"].astype(jnp.float32)) ** 2), {}),
                        train_data=batches, eval_data=batches)
    result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.5), spmdkit.TrainConfig(steps=8, batch_size=8),
                         progress=False, log=lambda m: None)
    assert result.summary["eval_loss"] < result.history[0]["loss"]


@pytest.mark.parametrize("kind", ["iterator", "indexed"])
def test_a_pipeline_failing_at_its_first_batch_is_a_data_error_naming_it(kind):
    # A failure at batch 5 was a DataError naming the batch; at the first, the reader's bare OSError.
    class Failing:
        def __iter__(self):
            raise OSError("the bucket is not there")
            yield

    class FailingIndexed(list):
        def __getitem__(self, i):
            raise OSError("the bucket is not there")

    data = Failing() if kind == "iterator" else FailingIndexed([None] * 4)
    task = spmdkit.Task(name="fails", init=lambda rng: {"w": jnp.zeros((2, 1))},
                        loss_fn=lambda p, b, rng: (jnp.mean(b["x"] @ p["w"]), {}), train_data=data)
    also = "" if kind == "iterator" else r" \(or batch 3, its last, read to check its size\)"
    with pytest.raises(spmdkit.DataError, match=rf"(?s)train_data raised OSError reading its first batch{also}: the "
                                                r"bucket is not there.*Fix: fix the pipeline") as raised:
        spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=8),
                    progress=False, log=lambda m: None)
    assert isinstance(raised.value.__cause__, OSError)
