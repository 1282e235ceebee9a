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
