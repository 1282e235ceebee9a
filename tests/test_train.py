"""The training loop: artifacts, data order, eval, divergence, users' own models."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._tasks import linreg
from spmdkit._train import evaluate_task, iterate_batches
from spmdkit._train._steps import task_eval_step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_artifacts(tmp_path):
    task = linreg.make()
    result = spmdkit.fit(
        task, spmdkit.DataParallel(), optax.sgd(0.005),
        spmdkit.TrainConfig(steps=40, batch_size=32, log_every=10),
        out_dir=tmp_path, progress=False, run_info={"lr": 0.005},
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert [r["step"] for r in evals] == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]  # each epoch of 4 steps
    assert all(r["steps_per_sec"] > 0 for r in train)
    assert rows == result.history

    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("task", "strategy", "device_count", "mesh", "steps", "final_train_loss", "eval_loss",
                "wall_time_s", "steps_per_sec", "params_digest", "w", "b", "status"):
        assert key in summary, key
    assert summary["status"] == "completed" and summary["steps"] == 40
    assert summary["device_count"] == 8 and summary["mesh"] == {"data": 8}
    assert summary["config"] == {"lr": 0.005}
    assert summary["eval_loss"] == evals[-1]["loss"]

    loaded = spmdkit.load_params(tmp_path / "params.npz")
    assert sorted(loaded) == ["['bias']", "['weight']"]
    back = spmdkit.load_params(tmp_path / "params.npz", like=task.init(jax.random.key(0)))
    assert float(back["weight"]) == summary["w"] == float(result.params["weight"])

    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_load_params_errors(tmp_path):
    spmdkit.save_params(tmp_path / "p.npz", {"w": np.ones((2, 3))})
    with pytest.raises(spmdkit.DataError, match=r"no array for parameter \['v'\]"):
        spmdkit.load_params(tmp_path / "p.npz", like={"v": np.ones(1)})
    with pytest.raises(spmdkit.DataError, match=r"\['w'\] has shape \(2, 3\) in the file but \(3, 2\)"):
        spmdkit.load_params(tmp_path / "p.npz", like={"w": np.ones((3, 2))})
    # A cast would hand a bf16 model the f64 weights it never trained with, without a word.
    with pytest.raises(spmdkit.DataError, match=r"(?s)\['w'\] is float64 in the file but bfloat16 in `like`.*astype"):
        spmdkit.load_params(tmp_path / "p.npz", like={"w": jnp.ones((2, 3), jnp.bfloat16)})
    # Shapes and dtypes alone (no arrays) and plain numbers (no dtype) are fine as `like`.
    back = spmdkit.load_params(tmp_path / "p.npz", like={"w": jax.ShapeDtypeStruct((2, 3), np.float64)})
    assert back["w"].dtype == np.float64 and back["w"].sum() == 6


def test_load_params_names_a_damaged_file(tmp_path):
    # A params.npz cut short (a copy interrupted) was a bare zipfile.BadZipFile.
    spmdkit.save_params(tmp_path / "p.npz", {"w": np.ones((20, 30))})
    whole = (tmp_path / "p.npz").read_bytes()
    for damaged in (whole[:len(whole) // 2], b"PK\x03\x04garbage", b""):
        (tmp_path / "p.npz").write_bytes(damaged)
        with pytest.raises(spmdkit.DataError, match=r"p.npz is damaged \(truncated or corrupt: .*\)\.\n  Fix: load an intact"):
            spmdkit.load_params(tmp_path / "p.npz")


def test_load_params_refuses_a_like_without_a_place_for_every_array(tmp_path):
    # A model built with one layer fewer than the file loaded the rest and dropped that layer, silently.
    layers = {f"layer_{i}": {"w": np.full((2, 2), i, np.float32)} for i in range(3)}
    spmdkit.save_params(tmp_path / "p.npz", layers)
    fewer = {k: v for k, v in layers.items() if k != "layer_2"}
    with pytest.raises(spmdkit.DataError, match=r"(?s)holds 1 array\(s\) that `like` has no place for: "
                                                 r"\[\"\['layer_2'\]\['w'\]\"\] \(like has 2, the file 3\).*Fix: load it"):
        spmdkit.load_params(tmp_path / "p.npz", like=fewer)
    back = spmdkit.load_params(tmp_path / "p.npz", like=layers)  # the whole structure still loads
    assert back["layer_2"]["w"][0, 0] == 2


def test_params_keep_bfloat16_float8_and_prng_keys(tmp_path):
    # np.savez keeps them as raw bytes ('|V2'), which failed far away, at the first use.
    params = {"w": jnp.arange(3, dtype=jnp.bfloat16) + 0.5, "s": jnp.ones(2, jnp.float8_e4m3fn), "b": np.ones(2)}
    spmdkit.save_params(tmp_path / "p.npz", params)
    back = spmdkit.load_params(tmp_path / "p.npz", like=params)
    for key in params:
        assert back[key].dtype == params[key].dtype
        np.testing.assert_array_equal(np.asarray(back[key], np.float32), np.asarray(params[key], np.float32))
    assert set(spmdkit.load_params(tmp_path / "p.npz")) == {"['w']", "['s']", "['b']"}
    keys = {"rng": jax.random.key(3), "rbg": jax.random.split(jax.random.key(1, impl="rbg"), 2)}
    spmdkit.save_params(tmp_path / "k.npz", keys)  # typed keys (NNX's Rngs in a state): a TypeError before
    back = spmdkit.load_params(tmp_path / "k.npz", like=keys)
    for key in keys:
        assert back[key].dtype == keys[key].dtype
        np.testing.assert_array_equal(jax.random.key_data(back[key]), jax.random.key_data(keys[key]))
    np.savez(tmp_path / "raw.npz", **{"['w']": np.asarray(params["w"])})
    with pytest.raises(spmdkit.DataError, match=r"(?s)\['w'\] holds raw bytes \(\|V2\).*arr.view\(jnp.bfloat16\)"):
        spmdkit.load_params(tmp_path / "raw.npz")


@pytest.mark.parametrize("report, expect", [
    (lambda p: {"w": np.full(3, float(p["weight"]))}, "array"),  # numpy arrays in the summary
    (lambda p: 3.0, "it returned float, not a dict"),
    (lambda p: p["missing"], "KeyError"),
])
def test_a_failing_report_loses_none_of_the_run(tmp_path, report, expect):
    # The user's report runs after the whole run: it crashed fit before summary.json and loss.png.
    task = dataclasses.replace(linreg.make(), report=report)
    if expect == "array":
        spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=3), progress=False, out_dir=tmp_path)
        assert len(json.loads((tmp_path / "summary.json").read_text())["w"]) == 3
        return
    with pytest.warns(RuntimeWarning, match=f"report\\(params\\) failed after training.*{expect}"):
        spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=3), progress=False, out_dir=tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"summary.json", "params.npz", "loss.png", "metrics.jsonl"}
    assert expect in json.loads((tmp_path / "summary.json").read_text())["report_error"]


@pytest.mark.parametrize("field, fn, words", [
    ("report", lambda: {}, r"spmdkit calls report\(params\), which report\(\) does not take"),
    ("report", "w", r"report is str, not a function"),
    ("init", lambda: {}, r"spmdkit calls init\(rng\)"),
    ("loss_fn", lambda p, b: (0.0, {}), r"spmdkit calls loss_fn\(params, batch, rng\), which loss_fn\(p, b\)"),
    ("eval_fn", lambda p, b: (0.0, {}), r"spmdkit calls eval_fn\(params, batch, rng\)"),
])
def test_task_functions_of_the_wrong_shape_are_named_before_training(field, fn, words):
    # A report of the wrong shape was found only after the whole run had trained.
    with pytest.raises(spmdkit.SignatureError, match=f"(?s)task 'linreg': {words}.*Fix: pass {field}="):
        dataclasses.replace(linreg.make(), **{field: fn})
    stateful = dataclasses.replace(linreg.make(), loss_fn=lambda p, s, b, rng, train: (0.0, {}, s), stateful=True)
    assert stateful.stateful  # (params, model_state, batch, rng, train=...) is what a stateful task's loss takes
    with pytest.raises(spmdkit.SignatureError, match=r"(?s)loss_fn\(params, model_state, batch, rng, train=\.\.\.\).*"
                                                     r"stateful=True: the model state comes second"):
        dataclasses.replace(linreg.make(), stateful=True)


def test_a_stateful_loss_that_fails_is_named_by_the_call_spmdkit_made():
    # It said loss_fn(params, batch, rng) and a check (task.loss_fn(task.init(key), batch, key))
    # that a stateful task cannot run: its init returns a pair, its loss takes the model state.
    base = linreg.make()

    def loss_fn(params, model_state, batch, rng, train):
        raise ValueError("the model's own mistake")

    task = dataclasses.replace(base, init=lambda rng: (base.init(rng), {"count": jnp.zeros(())}), loss_fn=loss_fn,
                               stateful=True)
    with pytest.raises(spmdkit.TaskError, match=r"(?s)loss_fn\(params, model_state, batch, rng, train=True\) failed on "
                                                r"a batch of 16: ValueError: the model's own mistake.*Fix: check it on one "
                                                r"device first: params, model_state = task.variables\(jax.random.key\(0\)\); "
                                                r"task.loss_fn\(params, model_state, batch, key, train=True\)"):
        spmdkit.validate_task(task, 16)


def test_a_metric_named_by_a_number_is_named_as_such():
    # {0: ..., "mae": ...} failed in JAX's sorting of the keys: "Comparator raised exception".
    base = linreg.make()

    def loss_fn(params, batch, rng):
        loss, _ = base.loss_fn(params, batch, rng)
        return loss, {"per_class": {0: loss, "mae": loss}}

    with pytest.raises(spmdkit.TaskError, match=r"(?s)loss_fn's metrics \(its aux\) have a key 0 \(int\) at "
                                                r"aux\['per_class'\]: metric names are strings.*Fix: name it with a "
                                                r"string, e.g. 'class_0'"):
        spmdkit.validate_task(dataclasses.replace(base, loss_fn=loss_fn), 16)


def test_data_order_is_deterministic_and_covers_every_example():
    data = {"i": np.arange(10)}
    a = iterate_batches(data, 4, seed=3, drop_remainder=False)
    b = iterate_batches(data, 4, seed=3, drop_remainder=False)
    first = [next(a) for _ in range(6)]
    assert all(np.array_equal(x[1]["i"], y[1]["i"]) for x, y in zip(first, (next(b) for _ in range(6))))
    assert [e for e, _ in first] == [0, 0, 0, 1, 1, 1]
    assert [len(batch["i"]) for _, batch in first[:3]] == [4, 4, 2]
    assert sorted(np.concatenate([batch["i"] for _, batch in first[:3]]).tolist()) == list(range(10))
    assert not np.array_equal(first[0][1]["i"], first[3][1]["i"])  # a new order each epoch
    other = next(iterate_batches(data, 4, seed=4, drop_remainder=False))
    assert not np.array_equal(other[1]["i"], first[0][1]["i"])
    dropped = iterate_batches(data, 4, seed=3, drop_remainder=True)
    assert [len(next(dropped)[1]["i"]) for _ in range(3)] == [4, 4, 4]


def test_epochs_and_drop_remainder_set_the_length():
    task = linreg.make(num_points=40)
    run = lambda **kw: spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.01), spmdkit.TrainConfig(**kw), progress=False)  # noqa: E731
    assert run(epochs=2, batch_size=16).summary["steps"] == 6  # ceil(40/16) = 3 per epoch
    assert run(epochs=2, batch_size=16, drop_remainder=True).summary["steps"] == 4


def test_a_batch_that_does_not_split_warns_at_the_users_call_of_fit():
    # The warning pointed at a line of spmdkit's loop, not at the call that chose the batch size.
    import warnings

    x = np.linspace(-1, 1, 24, dtype=np.float32)
    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(())},
                        loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] - b["y"]) ** 2), {}),
                        train_data={"x": x, "y": 2 * x})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.1), spmdkit.TrainConfig(steps=1, batch_size=12),
                    progress=False)
    split = [w for w in seen if "does not split over the 8 devices" in str(w.message)]
    assert len(split) == 1 and split[0].filename == __file__, [(str(w.message)[:60], w.filename) for w in seen]


def test_evaluate_is_the_exact_mean_over_uneven_chunks():
    task = linreg.make()
    strategy = spmdkit.DataParallel()
    state = spmdkit.TrainState(jnp.int32(0), {"weight": jnp.float32(1.5), "bias": jnp.float32(0.25)}, None)
    eval_step = strategy.evaluate(task_eval_step(task, jax.random.key(0)))
    # chunks of 50: the last one is uneven (and does not split over the 8 devices)
    means = evaluate_task(state, task.eval_data, 50, eval_step)
    x, y = task.eval_data["x"], task.eval_data["y"]
    assert means["loss"] == pytest.approx(float(np.mean((1.5 * x + 0.25 - y) ** 2)), rel=1e-6)


def test_divergence_stops_with_the_step_and_keeps_the_last_good_state(tmp_path):
    with pytest.raises(spmdkit.NonFiniteLossError) as e:
        spmdkit.fit(linreg.make(), spmdkit.DataParallel(), optax.sgd(40.0),
                    spmdkit.TrainConfig(steps=200, batch_size=128), out_dir=tmp_path, progress=False)
    err = e.value
    assert 1 < err.step < 200 and not np.isfinite(err.loss)
    assert f"at step {err.step}" in str(err) and "--lr" in str(err)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # The loss of step k comes from the state after k - 1 updates; the kept state is the one
    # before the bad one, and summary.json reports its step (as params.npz holds it).
    assert summary["status"] == "diverged" and summary["steps"] == err.step - 2
    saved = spmdkit.load_params(tmp_path / "params.npz")
    assert all(np.isfinite(v).all() for v in saved.values())


def test_batch_larger_than_the_data_set():
    with pytest.raises(spmdkit.ConfigError, match=r"batch_size=500 is larger than the training set .*\(128 examples\)"):
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(batch_size=500), progress=False)


@pytest.mark.parametrize("argument, value, words", [
    ("task", "linreg", r"fit\(task=\.\.\.\) got str 'linreg'.*Fix: pass spmdkit.get_task\('linreg'\)"),
    ("strategy", "data", r"fit\(strategy=\.\.\.\) got str 'data'.*Fix: pass spmdkit.get_strategy\('data'\)"),
    ("optimizer", "adam", r"fit\(optimizer=\.\.\.\) got str 'adam'.*optax.adam\(1e-3\)"),
    ("config", {"steps": 2}, r"fit\(config=\.\.\.\) got dict.*spmdkit.TrainConfig\(\*\*d\)"),
    ("checkpoint", "runs/ckpt", r"fit\(checkpoint=\.\.\.\) got str.*CheckpointConfig\('runs/ckpt'"),
    ("out_dir", 3, r"fit\(out_dir=\.\.\.\) got int 3"),
    ("log", "stdout", r"fit\(log=\.\.\.\) got str"),
    ("step_timeout", -1, r"fit\(step_timeout=\.\.\.\) got int -1.*seconds > 0, or None"),
    ("strategy", spmdkit.DataParallel, r"fit\(strategy=\.\.\.\) got the class DataParallel.*strategy=spmdkit.DataParallel\(\.\.\.\)"),
    ("config", spmdkit.TrainConfig, r"fit\(config=\.\.\.\) got the class TrainConfig.*config=spmdkit.TrainConfig\(\.\.\.\)"),
])
def test_fit_names_an_argument_of_the_wrong_kind(argument, value, words):
    # A name where an object belongs failed deep inside as an AttributeError.
    args = {"task": linreg.make(), "strategy": spmdkit.Single(), "optimizer": optax.sgd(0.1),
            "config": spmdkit.TrainConfig(steps=2), argument: value}
    with pytest.raises(spmdkit.ConfigError, match=f"(?s){words}"):
        spmdkit.fit(**args, progress=False)


def test_an_optimizer_that_needs_the_loss_gets_it_and_one_that_needs_more_is_named():
    # reduce_on_plateau needs update(..., value=loss); lbfgs also a value_fn: TypeErrors inside optax before.
    plateau = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1, factor=0.5))
    result = spmdkit.fit(linreg.make(), spmdkit.Single(), plateau, spmdkit.TrainConfig(steps=20), progress=False)
    assert np.isfinite(result.history[-1]["loss"])
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)needs more than fit gives it.*value_fn.*own train_step"):
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.lbfgs(), spmdkit.TrainConfig(steps=2), progress=False)


# ---- users' own models --------------------------------------------------------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.tanh(nn.Dense(16)(x)))


def two_moons(n: int, seed: int):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0, np.pi, n)
    label = rng.integers(0, 2, n)
    x = np.stack([np.cos(t) + label, np.sin(t) * (1 - 2 * label) + 0.5 * label], 1)
    return {"x": (x + 0.1 * rng.standard_normal(x.shape)).astype(np.float32), "y": label.astype(np.int32)}


def test_users_own_flax_module_loss_and_arrays():
    model = MLP()

    def loss_fn(params, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    task = spmdkit.Task(
        name="moons",
        init=lambda rng: model.init(rng, jnp.zeros((1, 2)))["params"],
        loss_fn=loss_fn,
        train_data=two_moons(500, 0),
        eval_data=two_moons(200, 1),
    )
    result = spmdkit.fit(task, spmdkit.DataParallel(), optax.adam(0.05),
                         spmdkit.TrainConfig(steps=150, batch_size=50), progress=False)
    assert result.summary["eval_accuracy"] > 0.95
    assert set(result.params) == {"Dense_0", "Dense_1"}


def test_users_plain_apply_fn_and_params_pytree():
    def apply_fn(params, x):
        return x @ params["w"] + params["b"]

    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 3)).astype(np.float32)
    true_w = np.array([[1.0], [-2.0], [0.5]], np.float32)
    task = spmdkit.Task(
        name="plain",
        init=lambda key: {"w": jnp.zeros((3, 1)), "b": jnp.zeros((1,))},
        loss_fn=lambda p, b, key: (jnp.mean((apply_fn(p, b["x"]) - b["y"]) ** 2), {}),
        train_data={"x": x, "y": x @ true_w + 0.5},
    )
    result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.1),
                         spmdkit.TrainConfig(steps=300, batch_size=24), progress=False)
    np.testing.assert_allclose(result.params["w"], true_w, atol=1e-3)
    np.testing.assert_allclose(result.params["b"], [0.5], atol=1e-3)


def test_summary_counts_epochs_only_when_an_epoch_has_a_length(tmp_path, capsys):
    from rich.console import Console

    from spmdkit._train_cli import _print_summary

    task = linreg.make(num_points=40)
    known = spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.01), spmdkit.TrainConfig(steps=5, batch_size=16),
                        progress=False).summary
    assert known["epochs"] == pytest.approx(5 / 3)  # 3 batches an epoch: 16 + 16 + 8 examples
    assert (known["examples_seen"], known["batches_seen"]) == (40 + 32, 5)

    def endless():  # a pipeline of unknown length: an epoch is not a thing it has
        while True:
            yield jax.tree.map(lambda x: x[:16], task.train_data)

    piped = spmdkit.fit(dataclasses.replace(task, train_data=endless()), spmdkit.Single(), optax.sgd(0.01),
                        spmdkit.TrainConfig(steps=5, batch_size=16), out_dir=tmp_path, progress=False).summary
    written = json.loads((tmp_path / "summary.json").read_text())
    for summary in (piped, written):
        assert summary["epochs"] is None and (summary["examples_seen"], summary["batches_seen"]) == (80, 5)
    _print_summary(piped, Path("run"), Console(width=200))
    table = capsys.readouterr().out
    assert "examples_seen" in table and "80" in table and "epochs" not in table


def test_a_params_file_that_cannot_be_written_leaves_the_other_files(tmp_path, monkeypatch):
    # Under `ulimit -f 100` params.npz failed and the files after it were never tried: --out held
    # metrics.jsonl alone, no summary.json to say the run failed.
    from spmdkit._train import _artifacts as art

    def too_large(path, params):
        raise art._cannot_write(Path(path), OSError(27, "File too large"))

    monkeypatch.setattr(art, "save_params", too_large)
    with pytest.raises(art.ArtifactError, match="cannot write .*params.npz: File too large"):
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=3, batch_size=16),
                    progress=False, out_dir=tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"summary.json", "loss.png", "metrics.jsonl", "spmdkit-out.json"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "params.npz: File too large" in summary["error"]


def test_a_plot_that_raises_still_leaves_the_summary(tmp_path, monkeypatch):
    # summary.json is written after the plots: a plot's bug (not an OSError) must not take it along.
    from spmdkit._train import _artifacts as art

    def broken(*args):
        raise ValueError("a plotting bug")

    monkeypatch.setattr(art, "plot_history", broken)
    with pytest.raises(ValueError, match="a plotting bug"):
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=3, batch_size=16),
                    progress=False, out_dir=tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
    assert (tmp_path / "params.npz").is_file()


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stop_request_while_the_final_files_are_written_waits_for_them(tmp_path, monkeypatch, sig):
    # It cut the plot short with a traceback, exiting 130/143 under a summary that said completed.
    import os
    import signal

    from spmdkit._train import _loop

    write = _loop._write_artifacts

    def interrupted_write(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, sig))
        return write(*args, **kwargs)

    monkeypatch.setattr(_loop, "_write_artifacts", interrupted_write)
    said = []
    result = spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=3, batch_size=16),
                         progress=False, out_dir=tmp_path, log=said.append)
    assert result.summary["status"] == "completed"
    assert {p.name for p in tmp_path.iterdir()} >= {"summary.json", "params.npz", "loss.png", "metrics.jsonl"}
    assert any("a stop request came while the final files were written" in m for m in said)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_a_preemption_without_a_checkpoint_directory_says_nothing_was_saved(monkeypatch):
    from spmdkit._train import _loop

    monkeypatch.setattr(_loop.Preemption, "reached", lambda self, step: step >= 2)
    said = []
    result = spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=5, batch_size=16),
                         progress=False, log=said.append)
    assert result.summary["status"] == "preempted" and result.summary["steps"] == 2
    assert any("preempted at step 2 with no checkpoint directory" in m for m in said)


@pytest.mark.parametrize("where, name", [("loss_fn", "step"), ("loss_fn", "split"), ("loss_fn", "loss"),
                                         ("loss_fn", "elapsed_s"), ("eval_fn", "epoch")])
def test_a_metric_named_like_a_row_field_is_refused_before_training(tmp_path, where, name):
    # A metric "step" renumbered every row of metrics.jsonl and "split" turned the eval rows
    # into neither train nor eval (summary eval_loss None, an empty plot), silently.
    x = np.linspace(-1, 1, 16, dtype=np.float32)

    def loss(p, b, rng):
        err = jnp.mean((p["w"] * b["x"] - b["y"]) ** 2)
        return err, ({name: err} if where == "loss_fn" else {})

    def eval_fn(p, b, rng):
        return loss(p, b, rng)[0], {name: jnp.float32(0.0)}

    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(())}, loss_fn=loss,
                        train_data={"x": x, "y": 2 * x}, eval_data={"x": x, "y": 2 * x},
                        eval_fn=eval_fn if where == "eval_fn" else None)
    with pytest.raises(spmdkit.TaskError, match=rf"(?s){where}'s aux has metric\(s\) \['{name}'\].*Fix: rename"):
        spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=8),
                    progress=False, out_dir=tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_loss_png_plots_every_metric_a_user_returns(tmp_path, monkeypatch):
    # A metric named "count" (tokens, positives...) was silently left out of loss.png.
    from spmdkit._train import _artifacts as art

    figures = []
    monkeypatch.setattr(art, "_save_figure", lambda fig, path: figures.append(fig))
    history = [{"split": "train", "step": s, "epoch": 1, "loss": 1.0 / s, "count": 8.0 * s, "acc": 0.5,
                "steps_per_sec": 3.0, "elapsed_s": 0.1 * s} for s in (1, 2)] + [{"split": "eval", "step": 2, "loss": 0.4,
                                                                                "count": 5.0}]
    art.plot_history(history, tmp_path / "loss.png", "t")
    labels = {line.get_label() for ax in figures[0].axes for line in ax.get_lines()}
    assert labels == {"train loss", "eval loss", "train acc", "train count", "eval count"}


def _strict_json(text: str):
    def refuse(token):
        raise AssertionError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_metrics_are_written_as_json_null(tmp_path):
    # NaN and inf were written as NaN/Infinity: JavaScript's JSON.parse refused the lines and jq read
    # Infinity as 1.8e308. A metric that is 0/0 on some batches (a precision) is ordinary.
    x = np.linspace(-1, 1, 16, dtype=np.float32)

    def loss(p, b, rng):
        err = jnp.mean((p["w"] * b["x"] - b["y"]) ** 2)
        return err, {"precision": jnp.float32(jnp.nan), "ratio": jnp.float32(jnp.inf)}

    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(())}, loss_fn=loss,
                        train_data={"x": x, "y": 2 * x}, eval_data={"x": x, "y": 2 * x})
    result = spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=8),
                         progress=False, out_dir=tmp_path)
    rows = [_strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows} == {"train", "eval"}
    assert all(r["precision"] is None and r["ratio"] is None and r["loss"] > 0 for r in rows)
    summary = _strict_json((tmp_path / "summary.json").read_text())
    assert summary["eval_precision"] is None and summary["final_train_metrics"]["ratio"] is None
    assert math.isnan(result.history[0]["precision"])  # in memory the values stay as they were
    # A resumed run's history is read back from metrics.jsonl, nulls included: it still plots.
    from spmdkit._train import _artifacts as art

    art.plot_history(rows + [{"split": "eval", "step": 3, "loss": None}], tmp_path / "again.png", "t")
    assert (tmp_path / "again.png").read_bytes().startswith(PNG_MAGIC)


def test_int64_labels_as_numpy_gives_them_start_a_run_without_jax_s_truncation_warning():
    # np.arange labels are int64: the abstract checks before training named int64 and JAX
    # warned "int64 ... will be truncated to dtype int32" at every start.
    import warnings

    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    y = np.arange(40) % 2
    loss = lambda p, b, r: (optax.softmax_cross_entropy_with_integer_labels(b["x"] @ p["w"], b["y"]).mean(), {})
    task = spmdkit.Task(name="t", init=lambda k: {"w": jax.random.normal(k, (4, 2))}, loss_fn=loss,
                        train_data={"x": x, "y": y}, eval_data={"x": x, "y": y})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=8),
                             progress=False, log=lambda m: None)
    assert result.summary["steps"] == 2


def test_an_nnx_task_with_sharding_annotations_trains_on_every_strategy_without_a_mesh_of_its_own():
    """Its variables name mesh axes (nnx.with_partitioning): created eagerly outside a mesh they
    fail, and fit's task check did so ("init(rng) failed: ... An auto mesh context ... is required")."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
            self.linear = nnx.Linear(2, 8, kernel_init=init, rngs=rngs)
            self.head = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.linear(x)))

    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(Net(nnx.Rngs(0)))

    def loss_fn(params, batch, rng):
        logits = nnx.merge(graphdef, params)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

    task = spmdkit.Task(name="nnx", init=lambda rng: nnx.state(Net(nnx.Rngs(rng))), loss_fn=loss_fn,
                        train_data=two_moons(64, 0))
    config = spmdkit.TrainConfig(steps=3, batch_size=16)
    losses = {}
    for strategy in (spmdkit.Single(), spmdkit.DataParallel(),
                     spmdkit.Sharded(spmdkit.make_mesh(data=4, model=2), {"embed": None, "hidden": "model", "batch": "data"})):
        result = spmdkit.fit(task, strategy, optax.sgd(0.1), config, progress=False)
        losses[strategy.name] = [row["loss"] for row in result.history]
    assert all(np.allclose(v, losses["single"], rtol=1e-5) for v in losses.values()), losses


def test_a_long_metric_name_keeps_the_plot_laid_out(tmp_path):
    # A metric named in 300 characters made the legend wider than the figure, over the loss panel
    # (matplotlib: "Tight layout not applied").
    import warnings

    from spmdkit._train import _artifacts as art

    name = "grad_norm_of_" + "a_very_deeply_nested_module_" * 10
    history = [{"split": "train", "step": s, "loss": 1.0 / s, name: 0.1 * s} for s in (1, 2, 3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        art.plot_history(history, tmp_path / "loss.png", "long")
    assert not [w for w in caught if "layout" in str(w.message).lower()], [str(w.message) for w in caught]
    assert (tmp_path / "loss.png").stat().st_size > 0


def _fit_line(tmp_path, steps, resume=False, log_every=1, **kw):
    return spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1),
                       spmdkit.TrainConfig(steps=steps, batch_size=16, log_every=log_every, **kw),
                       progress=False, out_dir=tmp_path / "out", log=lambda m: None,
                       checkpoint=spmdkit.CheckpointConfig(tmp_path / "ck", every=5, resume=resume))


def _rows(out: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_a_resumed_run_times_only_its_own_steps_and_its_elapsed_s_goes_on(tmp_path):
    # steps_per_sec was (all steps - 1) / the resumed part's time: 30 -> 40 reported 4x the speed; and
    # elapsed_s began again at 0, so a plot of loss against time folded back.
    _fit_line(tmp_path, 30)
    resumed = _fit_line(tmp_path, 40, resume=True).summary
    rows = _rows(tmp_path / "out")
    elapsed = [r["elapsed_s"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert elapsed == sorted(elapsed) and elapsed[30] > elapsed[29]
    rates = sorted(r["steps_per_sec"] for r in rows[31:])
    assert resumed["resumed_from_step"] == 30 and resumed["steps_per_sec"] < 2 * rates[len(rates) // 2]


def test_a_stop_between_rows_writes_them_and_a_resume_averages_as_if_uninterrupted(tmp_path, monkeypatch):
    # --log-every 4: a run stopped at step 9 wrote no row for step 9 (its summary's final loss was
    # step 8's), and its resume's row 12 averaged steps 10-12 where the uninterrupted run's averages 9-12.
    from spmdkit._train import _loop

    (tmp_path / "whole").mkdir()
    _fit_line(tmp_path / "whole", 16, log_every=4)
    whole = {r["step"]: r["loss"] for r in _rows(tmp_path / "whole" / "out")}
    with monkeypatch.context() as m:
        m.setattr(_loop.Preemption, "reached", lambda self, step: step >= 9)
        stopped = _fit_line(tmp_path, 16, log_every=4).summary
    rows = _rows(tmp_path / "out")
    assert stopped["status"] == "preempted" and stopped["steps"] == 9 and rows[-1]["step"] == 9
    assert stopped["final_train_loss"] == rows[-1]["loss"]
    _fit_line(tmp_path, 16, resume=True, log_every=4)
    resumed = {r["step"]: r["loss"] for r in _rows(tmp_path / "out")}
    assert sorted(resumed) == [4, 8, 9, 12, 16]
    for step in (12, 16):
        assert resumed[step] == pytest.approx(whole[step], abs=1e-6)


def test_a_diverged_runs_summary_gives_the_figures_of_the_step_it_keeps(tmp_path):
    # It reported step k's parameters with the eval of step k + 1 (the diverged state's: null).
    with pytest.raises(spmdkit.NonFiniteLossError):
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(10.0),
                    spmdkit.TrainConfig(steps=200, batch_size=16, eval_every=1), progress=False,
                    out_dir=tmp_path, log=lambda m: None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    evals = {r["step"]: r["loss"] for r in _rows(tmp_path, "eval")}
    trains = {r["step"]: r["loss"] for r in _rows(tmp_path)}
    assert summary["status"] == "diverged" and max(evals) > summary["steps"]
    assert summary["eval_loss"] == evals[summary["steps"]] is not None
    assert summary["final_train_loss"] == trains[summary["steps"]]


def test_out_probe_is_removed_when_its_write_fails_and_a_directory_in_the_id_files_place_is_named(tmp_path, monkeypatch):
    # A full disk left an empty .spmdkit-write-test-PID in the user's --out; a directory named
    # spmdkit-out.json was "a file stands where a directory is needed", the fix about parents.
    from spmdkit._train import _artifacts as art

    plain = Path.write_text

    def full(self, *args, **kwargs):
        if self.name.startswith(".spmdkit-write-test-"):
            plain(self, "")  # created, then the disk refused its byte
            raise OSError(28, "No space left on device")
        return plain(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(art.ArtifactError, match="No space left on device"):
        art.prepare_out_dir(tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "out" / art.RUN_FILE).mkdir()
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)spmdkit-out.json is not a file spmdkit wrote.*Fix: move "
                                                  r"spmdkit-out.json out of"):
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=1, batch_size=16),
                    progress=False, out_dir=tmp_path / "out", log=lambda m: None)
