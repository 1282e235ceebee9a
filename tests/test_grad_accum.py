"""Gradient accumulation: K micro-batches per step equal one step on the whole batch."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._strategies._base import to_host
from spmdkit._tasks import digits, mlp
from spmdkit._train._steps import task_state, task_train_step

STRATEGIES = {
    "data": lambda: spmdkit.DataParallel(),
    "sharded": lambda: spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp"),
    "ensemble": lambda: spmdkit.Ensemble(members=4, devices=jax.devices()[:4]),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("rows", [64, 61], ids=["full", "uneven"])
def test_accumulated_step_equals_one_step_on_the_whole_batch(name, rows):
    task = mlp.make(layers=2, depth=64, embed=32, num_train=128, num_eval=16) if name == "sharded" else digits.make()
    opt = optax.sgd(0.1, momentum=0.9)
    host = jax.tree.map(lambda x: x[:rows], task.train_data)
    results = []
    for accum in (1, 4):  # 61 rows do not split into 4 micro-batches: one piece, the same gradient
        strategy = STRATEGIES[name]()
        state = strategy.init(task_state(task, opt), jax.random.key(0), unbox=True)
        new, metrics = strategy.step(task_train_step(task, opt, accum))(state, host)
        results.append((to_host(new.params), np.asarray(metrics["loss"])))
    for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0])):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)


def test_fit_with_grad_accum_and_bad_value():
    task = digits.make()
    result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.05, momentum=0.9),
                         spmdkit.TrainConfig(steps=3, batch_size=64, grad_accum=4), progress=False)
    assert result.summary["steps"] == 3
    with pytest.raises(spmdkit.ConfigError, match="grad_accum=0"):
        spmdkit.TrainConfig(grad_accum=0)


def _weighted_task(rows=64, eval_rows=37, report_weight=True):
    # A count-normalised loss sum(w * l) / sum(w) with uneven weights: micro-batches and eval
    # chunks of equal rows carry unequal shares of it.
    import jax.numpy as jnp

    r = np.random.default_rng(0)
    x = r.normal(size=(rows, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + r.normal(size=rows).astype(np.float32))
    w = np.zeros(rows, np.float32)
    w[::7], w[:4] = 1.0, 1.0
    w[16:32] = 0.0  # a micro-batch of weight 0 (its means are 0/0-guarded by the loss)

    def loss_fn(p, b, rng):
        per_row = (b["x"] @ p["w"] - b["y"]) ** 2
        total = jnp.sum(b["w"])
        aux = {"loss_weight": total} if report_weight else {}
        return jnp.sum(b["w"] * per_row) / jnp.maximum(total, 1.0), aux

    data = {"x": x, "y": y, "w": w}
    return spmdkit.Task(name="wls", init=lambda rng: {"w": jnp.array([0.3, -0.2, 0.1])}, loss_fn=loss_fn,
                        train_data=data, eval_data=jax.tree.map(lambda a: a[:eval_rows], data)), loss_fn, data


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_count_normalised_loss_that_reports_its_weight_accumulates_exactly(name):
    results = {}
    for report in (True, False):
        task, loss_fn, data = _weighted_task(report_weight=report)
        grad = jax.grad(lambda p: loss_fn(p, data, None)[0])(task.init(None))
        for accum in (1, 2, 4):
            strategy = STRATEGIES[name]()
            state = strategy.init(task_state(task, optax.sgd(0.1)), jax.random.key(0), unbox=True)
            new, metrics = strategy.step(task_train_step(task, optax.sgd(0.1), accum))(state, data)
            params = np.asarray(to_host(new.params)["w"]).reshape(-1, 3)
            results[report, accum] = params
            if report:  # one SGD step on the whole batch, for every member
                whole = np.asarray(task.init(None)["w"]) - 0.1 * np.asarray(grad["w"])
                np.testing.assert_allclose(params, np.broadcast_to(whole, params.shape), rtol=0, atol=2e-6)
                assert np.all(np.asarray(metrics["loss_weight"]) == data["w"].sum())
    # Without the weight, micro-batches count by their rows: not the whole batch's step (documented).
    assert np.abs(results[False, 4] - results[True, 4]).max() > 1e-2


def test_fit_eval_of_a_count_normalised_loss_weights_chunks_by_its_weight():
    for report in (True, False):
        task, loss_fn, data = _weighted_task(report_weight=report)
        exact = float(loss_fn(task.init(None), jax.tree.map(lambda a: a[:37], data), None)[0])
        for strategy in (spmdkit.Single(), spmdkit.DataParallel()):
            result = spmdkit.fit(task, strategy, optax.sgd(0.0), spmdkit.TrainConfig(steps=1, batch_size=16,
                                                                                      eval_batch_size=16),
                                 progress=False, log=lambda message: None)
            if report:
                assert result.summary["eval_loss"] == pytest.approx(exact, rel=1e-6)
                assert result.summary["eval_loss_weight"] == float(data["w"][:37].sum())
            else:  # chunks count by their rows: not the set's value (documented)
                assert abs(result.summary["eval_loss"] - exact) > 1e-3


def test_micro_batches_split_unevenly_over_a_2d_mesh_keep_a_lookups_gradient():
    # 24 rows in 4 micro-batches of 6, each constrained ("batch" -> data) over data=4 of a
    # data=4, model=2 mesh: XLA:CPU computed the embedding gather's gradient wrong there, and fit
    # ended 0.4 away from Single's parameters without a word (an even batch: no uneven path).
    import jax.numpy as jnp

    from tests._user_models import Lookup

    def loss_fn(params, batch, rng):
        logits = Lookup().apply({"params": params}, batch["tok"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tok"][:, 1:]).mean(), {}

    tok = np.random.default_rng(0).integers(0, 16, (48, 6)).astype(np.int32)
    task = spmdkit.Task(name="lookup", init=lambda rng: Lookup().init(rng, jnp.zeros((1, 5), jnp.int32))["params"],
                        loss_fn=loss_fn, train_data={"tok": tok})
    rules = {"batch": "data", "length": None, "embed": None, "vocab": None}
    config = spmdkit.TrainConfig(steps=2, batch_size=24, grad_accum=4)
    want = spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.5), config, progress=False, log=lambda s: None).params
    got = spmdkit.fit(task, spmdkit.Sharded(spmdkit.make_mesh(data=4, model=2), rules), optax.sgd(0.5), config,
                      progress=False, log=lambda s: None).params
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
