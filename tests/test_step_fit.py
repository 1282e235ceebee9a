"""``fit`` on ``strategy.step``: exact partial batches, model state, train/eval, hooks alone."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._train._hooks import CheckpointHook, NaNGuard, StepInfo, run_hooks, to_python

RNG = np.random.default_rng(0)


def config(**kw):
    return spmdkit.TrainConfig(**{"steps": 4, "batch_size": 8, "log_every": 1, **kw})


def fit(task, strategy, opt=None, **kw):
    return spmdkit.fit(task, strategy, opt or optax.sgd(0.1), config(**kw), progress=False)


def assert_trees_close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_count_normalised_loss_on_a_partial_batch_is_exact_not_nan():
    # A token-weighted loss: sum(w * l) / sum(w). Some rows weigh 0, and so would padded
    # rows: computed row by row (the old padding scheme) they divide 0 by 0.
    x = RNG.normal(size=(13, 4)).astype(np.float32)
    w = np.ones(13, np.float32)
    w[[2, 5, 11]] = 0.0
    task = spmdkit.Task(
        name="weighted",
        init=lambda rng: {"w": jnp.zeros((4,))},
        loss_fn=lambda p, b, rng: (jnp.sum(b["w"] * (b["x"] @ p["w"] - 1.0) ** 2) / jnp.sum(b["w"]), {}),
        train_data={"x": x, "w": w},
        eval_data={"x": x, "w": w},
    )
    # 13 rows in batches of 8: every epoch ends with 5 rows, which 8 devices cannot split.
    ref = fit(task, spmdkit.Single(), steps=4)
    got = fit(task, spmdkit.DataParallel(), steps=4)
    losses = [r["loss"] for r in got.history if r["split"] == "train"]
    assert all(np.isfinite(losses)) and len(losses) == 4
    assert_trees_close(got.params, ref.params, 1e-6)
    # The same steps by hand on the exact batches, one device.
    order = [np.random.default_rng([0, epoch]).permutation(13) for epoch in range(2)]
    batches = [order[0][:8], order[0][8:], order[1][:8], order[1][8:]]
    p = np.zeros(4, np.float32)
    for idx in batches:
        g = jax.grad(lambda q: jnp.sum(w[idx] * (x[idx] @ q - 1.0) ** 2) / jnp.sum(w[idx]))(p)
        p = p - 0.1 * np.asarray(g)
    np.testing.assert_allclose(got.params["w"], p, rtol=1e-5, atol=1e-6)


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
        return nn.Dense(1)(x)


def bn_task():
    x = RNG.normal(size=(32, 3)).astype(np.float32)
    model = BNNet()

    def init(rng):
        variables = model.init(rng, x[:1], train=False)
        return variables["params"], {"batch_stats": variables["batch_stats"]}

    def loss_fn(params, model_state, batch, rng, train):
        out, updates = model.apply({"params": params, **model_state}, batch["x"], train=train,
                                   rngs={"dropout": rng}, mutable=["batch_stats"] if train else [])
        loss = jnp.mean((out[:, 0] - batch["y"]) ** 2)
        return loss, {"mae": jnp.mean(jnp.abs(out[:, 0] - batch["y"]))}, (dict(updates) if train else model_state)

    data = {"x": x, "y": np.sin(x[:, 0])}
    return spmdkit.Task(name="bn", init=init, loss_fn=loss_fn, train_data=data, eval_data=data, stateful=True), model


def test_batch_statistics_are_updated_checkpointed_and_written(tmp_path):
    task, model = bn_task()
    start = jax.device_get(task.variables(jax.random.split(jax.random.key(0), 3)[0])[1])
    ref = fit(task, spmdkit.Single(), batch_size=16)
    out = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.1), config(batch_size=16), progress=False, out_dir=tmp_path)
    stats = jax.device_get(out.state.model_state)
    moved = np.abs(stats["batch_stats"]["BatchNorm_0"]["mean"] - start["batch_stats"]["BatchNorm_0"]["mean"])
    assert moved.max() > 1e-3  # the running statistics changed
    assert_trees_close(stats, jax.device_get(ref.state.model_state))
    assert_trees_close(out.params, ref.params)
    saved = spmdkit.load_params(tmp_path / "params.npz")
    assert "['model_state']['batch_stats']['BatchNorm_0']['mean']" in saved
    # Eval is in eval mode: running statistics, no dropout, so it is the deterministic loss.
    pred = model.apply({"params": jax.device_get(out.state.params), **stats}, task.eval_data["x"], train=False)
    eval_row = [r for r in out.history if r["split"] == "eval"][-1]
    assert eval_row["loss"] == pytest.approx(float(np.mean((pred[:, 0] - task.eval_data["y"]) ** 2)), rel=1e-5)


def test_eval_fn_replaces_the_loss_in_eval_and_errors_name_the_function():
    x = RNG.normal(size=(16, 2)).astype(np.float32)
    task = spmdkit.Task(
        name="evalfn",
        init=lambda rng: {"w": jnp.ones(2)},
        loss_fn=lambda p, b, rng: (jnp.mean((b["x"] @ p["w"]) ** 2), {}),
        eval_fn=lambda p, b, rng: (jnp.float32(7.0), {"custom": jnp.mean(b["x"] @ p["w"])}),
        train_data={"x": x},
        eval_data={"x": x},
    )
    rows = [r for r in fit(task, spmdkit.Single(), steps=2).history if r["split"] == "eval"]
    assert rows[-1]["loss"] == 7.0 and "custom" in rows[-1]
    bad = spmdkit.Task(name="bad", init=lambda rng: {"w": jnp.ones(2)}, loss_fn=lambda p, b, rng: (1.0, 2.0, 3.0),
                       train_data={"x": x})
    with pytest.raises(TypeError, match="loss_fn returned a tuple of 3"):
        fit(bad, spmdkit.Single(), steps=1)
    with pytest.raises(spmdkit.ConfigError, match="not a multiple of grad_accum=3"):
        fit(task, spmdkit.Single(), grad_accum=3)


@pytest.mark.parametrize("metric, said", [
    (lambda e: jnp.abs(e), r"eval_fn's metric aux\['mae'\] has shape \(8,\); metrics are scalar means"),
    (lambda e: {"mae": jnp.mean(jnp.abs(e))}, r"eval_fn's metric aux\['mae'\] is a dict.*aux\['mae_mae'\]"),
], ids=["per-example", "nested"])
def test_an_eval_fn_metric_that_is_not_a_scalar_is_a_task_error_before_training(tmp_path, metric, said):
    """loss_fn's metrics were checked before training, eval_fn's not: a per-example metric in one
    eval chunk was reported as an ensemble's per-member list (eval_member_mae of a DataParallel
    run), in several chunks a raw numpy broadcast error at the first eval, and a nested dict a
    raw TypeError there; both after the steps, with no params.npz or summary.json."""
    x = RNG.normal(size=(24, 2)).astype(np.float32)
    task = spmdkit.Task(name="lin", init=lambda rng: {"w": jnp.ones(2)},
                        loss_fn=lambda p, b, rng: (jnp.mean((b["x"] @ p["w"]) ** 2), {}),
                        eval_fn=lambda p, b, rng: (jnp.mean((b["x"] @ p["w"]) ** 2), {"mae": metric(b["x"] @ p["w"])}),
                        train_data={"x": x}, eval_data={"x": x[:20]})
    with pytest.raises(spmdkit.TaskError, match="(?s)" + said) as e:
        spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=8,
                    eval_batch_size=8), progress=False, log=lambda m: None, out_dir=str(tmp_path / "out"))
    assert str(e.value).count("Fix:") == 1 and not (tmp_path / "out").exists()


def test_an_eval_fn_loss_that_is_not_a_scalar_says_one_fix():
    # A second "Fix: give eval_data the leaves and per-example shapes of train_data" followed, the shapes alike.
    x = RNG.normal(size=(16, 2)).astype(np.float32)
    task = spmdkit.Task(name="lin", init=lambda rng: {"w": jnp.ones(2)},
                        loss_fn=lambda p, b, rng: (jnp.mean((b["x"] @ p["w"]) ** 2), {}),
                        eval_fn=lambda p, b, rng: ((b["x"] @ p["w"]) ** 2, {}), train_data={"x": x}, eval_data={"x": x})
    with pytest.raises(spmdkit.TaskError, match="eval_fn returned a loss of shape") as e:
        fit(task, spmdkit.Single(), steps=1)
    assert str(e.value).count("Fix:") == 1


def test_hooks_work_alone_around_a_users_loop(tmp_path):
    """A user's own loop over strategy.step with only the checkpoint hook and a NaN guard."""
    strategy = spmdkit.DataParallel()

    def make_state(rng):
        return {"w": jax.random.normal(rng, (4,)), "step": jnp.zeros((), jnp.int32)}

    def train_step(state, batch):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - 1.0) ** 2))(state["w"])
        return {"w": state["w"] - 0.05 * g, "step": state["step"] + 1}, {"loss": loss}

    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=2), log=lambda m: None)
    hooks = [NaNGuard(), CheckpointHook(ckpt, every=2, meta=lambda info: {"step": info.step})]
    state, step = strategy.init(make_state, 0), strategy.step(train_step)
    batch = {"x": RNG.normal(size=(8, 4)).astype(np.float32)}
    for i in range(5):
        state, aux = step(state, batch)
        run_hooks(hooks, StepInfo(i + 1, 0, state, to_python(aux)))
    for hook in hooks:
        hook.close(StepInfo(5, 0, state, {}), "completed")
    reader = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    assert reader.steps() == [2, 4, 5]
    restored, _ = reader.restore(5, spmdkit.Single().abstract(make_state))
    np.testing.assert_array_equal(restored["w"], state["w"])
    with pytest.raises(spmdkit.NonFiniteLossError, match="at step 6"):
        NaNGuard()(StepInfo(6, 0, state, {"loss": float("nan")}))


def test_nan_guard_takes_an_ensembles_per_member_losses_and_names_a_missing_key():
    # An ensemble step's aux holds a loss per member: a JAX or numpy array raised a TypeError.
    guard = NaNGuard()
    for value in (jnp.array([1.0, 2.0]), np.array([1.0, 2.0]), [1.0, 2.0], np.float32(1.5)):
        guard(StepInfo(1, 0, None, {"loss": value}))
    assert guard.last == (1, 1.5)
    with pytest.raises(spmdkit.NonFiniteLossError, match=r"became \[1.0, nan\] at step 2"):
        guard(StepInfo(2, 0, None, {"loss": jnp.array([1.0, jnp.nan])}))
    with pytest.warns(RuntimeWarning, match=r"NaNGuard\(key='los'\): the step's metrics have no 'los'"):
        NaNGuard(key="los")(StepInfo(1, 0, None, {"loss": 1.0}))  # a typo checked nothing, silently
    with pytest.raises(spmdkit.ConfigError, match=r"NaNGuard\(every=0\)"):
        NaNGuard(every=0)


def test_hooks_and_checkpointer_name_an_argument_of_the_wrong_kind(tmp_path):
    # Each failed later with an AttributeError or TypeError, or saved a step -1.
    cases = [
        (lambda: spmdkit.Checkpointer(str(tmp_path / "ck")), spmdkit.CheckpointError,
         r"needs a spmdkit.CheckpointConfig.*CheckpointConfig\("),
        (lambda: CheckpointHook(str(tmp_path), every=1, meta=lambda i: {}), spmdkit.ConfigError, "needs a spmdkit.Checkpointer"),
        (lambda: spmdkit.MetricsHook([]), spmdkit.ConfigError, r"MetricsHook\(list\).*rows.append"),
        (lambda: run_hooks(NaNGuard(), StepInfo(1, 0, None, {})), spmdkit.ConfigError, "needs a list of hooks"),
        (lambda: run_hooks([NaNGuard()], (1, 0, None, {})), spmdkit.ConfigError, "needs a spmdkit.StepInfo"),
        (lambda: spmdkit.Single(0), spmdkit.MeshError, r"Single\(device=0\): a jax.Device"),
        (lambda: run_hooks([spmdkit.EvalHook(lambda s: 0.5, [].append, every=1)], StepInfo(1, 0, None, {})),
         spmdkit.ConfigError, r"evaluate\(state\) returned float 0.5, not a dict"),
    ]
    for build, error, words in cases:
        with pytest.raises(error, match=f"(?s){words}"):
            build()
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None).claim()
    with pytest.raises(spmdkit.CheckpointError, match=r"save\(step=-1\): a step is a whole number >= 0"):
        ckpt.save(-1, {"w": np.ones(2)}, {})
    ckpt.close()


def test_users_own_loop_with_only_the_checkpoint_hook_resumes_exactly(tmp_path):
    """Own loop + CheckpointHook; a second run restores the newest step and continues."""
    strategy = spmdkit.DataParallel()
    batch = {"x": RNG.normal(size=(8, 4)).astype(np.float32)}

    def make_state(rng):
        return {"w": jax.random.normal(rng, (4,)), "step": jnp.zeros((), jnp.int32)}

    def train_step(state, batch):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - 1.0) ** 2))(state["w"])
        return {"w": state["w"] - 0.05 * g, "step": state["step"] + 1}, {"loss": loss}

    def run(until, directory, resume=False):
        ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(directory), resume=resume), log=lambda m: None)
        state, start = strategy.init(make_state, 0), 0
        if resume:
            state, meta = ckpt.restore_latest(strategy.abstract(make_state))
            start = meta["step"]
        hook = CheckpointHook(ckpt, every=2, meta=lambda info: {"loss": info.metrics.get("loss")})
        step = strategy.step(train_step)
        for i in range(start, until):
            state, aux = step(state, batch)
            run_hooks([hook], StepInfo(i + 1, 0, state, to_python(aux)))
        hook.close(StepInfo(until, 0, state, {}), "completed")  # saves the last step too
        return state, start

    straight, _ = run(6, tmp_path / "straight")
    run(3, tmp_path / "ck")  # "crashes" after step 3
    resumed, start = run(6, tmp_path / "ck", resume=True)
    assert start == 3 and int(resumed["step"]) == 6
    np.testing.assert_array_equal(np.asarray(resumed["w"]), np.asarray(straight["w"]))
    # Run again once finished: nothing to train, and close() does not save step 6 over itself
    # (that was a CheckpointSaveError, "free disk space", exit 5).
    again, start = run(6, tmp_path / "ck", resume=True)
    assert start == 6 and np.array_equal(np.asarray(again["w"]), np.asarray(straight["w"]))
