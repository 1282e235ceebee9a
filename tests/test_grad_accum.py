"""Gradient accumulation: K micro-batches per step equal one step on the whole batch."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._tasks import digits, mlp

STRATEGIES = {
    "data-jit": lambda: spmdkit.DataParallel(),
    "data-shard_map": lambda: spmdkit.DataParallel(impl="shard_map"),
    "sharded": lambda: spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp"),
    "ensemble": lambda: spmdkit.Ensemble(members=4, devices=jax.devices()[:4]),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("rows", [64, 61], ids=["full", "padded"])
def test_accumulated_step_equals_one_step_on_the_whole_batch(name, rows):
    task = mlp.make(layers=2, depth=64, embed=32, num_train=128, num_eval=16) if name == "sharded" else digits.make()
    opt = optax.sgd(0.1, momentum=0.9)
    host = jax.tree.map(lambda x: x[:rows], task.train_data)
    results = []
    for accum in (1, 4):
        strategy = STRATEGIES[name]()
        state = strategy.init_state(task.init, opt, jax.random.key(0))
        size = -(-64 // (accum * strategy.batch_shards)) * accum * strategy.batch_shards
        batch, mask = strategy.put_batch(host, size=size)
        new, metrics = strategy.train_step(task.loss_fn, opt, accum=accum)(state, batch, mask, jax.random.key(1))
        results.append((strategy.host_params(new), float(metrics["loss"])))
    for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0])):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-5)


def test_fit_with_grad_accum_and_bad_value():
    task = digits.make()
    result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.05, momentum=0.9),
                         spmdkit.TrainConfig(steps=3, batch_size=64, grad_accum=4), progress=False)
    assert result.summary["steps"] == 3
    with pytest.raises(spmdkit.ConfigError, match="grad_accum=0"):
        spmdkit.TrainConfig(grad_accum=0)
