"""DataParallel and Single: placement, exact masked means, topology invariance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._tasks import digits, linreg
from spmdkit._strategies._compile import place
from spmdkit._train import iterate_batches
from spmdkit._train._steps import task_state, task_train_step


def strategy_on(n: int) -> spmdkit.DataParallel:
    return spmdkit.DataParallel(spmdkit.make_mesh(data=n, devices=jax.devices()[:n]))


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ---- seed 002 --------------------------------------------------------------------


def test_seed002_linreg_on_eight_devices_finds_the_line():
    task = linreg.make()
    result = spmdkit.fit(
        task, strategy_on(8), optax.sgd(0.005), spmdkit.TrainConfig(steps=1000, batch_size=128),
        progress=False,
    )
    s = result.summary
    assert s["device_count"] == 8 and s["mesh"] == {"data": 8}
    # Within the noise of 128 samples with noise 0.5: the least-squares fit itself.
    x, y = task.train_data["x"][:, 0], task.train_data["y"][:, 0]
    w_ls, b_ls = np.polyfit(x, y, 1)
    assert abs(s["w"] - w_ls) < 1e-3 and abs(s["b"] - b_ls) < 1e-3
    assert abs(s["w"] - 2.0) < 0.15 and abs(s["b"] + 1.0) < 0.15


# ---- topology invariance -----------------------------------------------------------

# Measured on this machine: linreg <= 1e-7; digits (batch 64, its default) <= 2.1e-7
# after 50 steps. The differences are float32 rounding of the gradient all-reduce
# (partial sums per device instead of one sum). In a ReLU network such a 1e-8
# difference can flip one unit's gate for one example, and the gradient is
# discontinuous there: at batch 32 a flip at step 14 turns 3e-8 into 8e-6, and
# momentum grows it to 3e-4 by step 20. So the trajectory test uses batch 64, and
# the per-step test below pins down what always holds: from the same state, one
# step on n devices equals one step on 1 device to <= 1.5e-8.
TOLERANCE = 1e-5
STEP_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def digits_task():
    return digits.make()


@pytest.mark.parametrize("task_name", ["linreg", "digits"])
def test_same_parameters_on_1_2_4_8_devices(task_name, digits_task):
    task = digits_task if task_name == "digits" else linreg.make()
    opt = optax.sgd(0.05, momentum=0.9) if task_name == "digits" else optax.sgd(0.005)
    config = spmdkit.TrainConfig(steps=50, batch_size=64, eval_every=1000)
    reference = spmdkit.fit(task, spmdkit.Single(), opt, config, progress=False)
    assert reference.summary["device_count"] == 1
    for n in (2, 4, 8):
        result = spmdkit.fit(task, strategy_on(n), opt, config, progress=False)
        assert result.summary["device_count"] == n
        assert max_diff(result.params, reference.params) <= TOLERANCE, n
        assert result.summary["eval_loss"] == pytest.approx(reference.summary["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("n", [2, 8])
def test_each_step_from_the_same_state_matches_one_device(n, digits_task):
    """Batch 32, through the epoch's partial last batch of 30 at step 45 (on 8 devices uneven: run whole)."""
    task, opt = digits_task, optax.sgd(0.05, momentum=0.9)
    single, multi = spmdkit.Single(), strategy_on(n)
    train_step = task_train_step(task, opt)
    single_step, multi_step = single.step(train_step), multi.step(train_step)
    state = single.init(task_state(task, opt), jax.random.key(0), unbox=True)
    replicated = jax.NamedSharding(multi.mesh, jax.P())
    batches = iterate_batches(task.train_data, 32, 0, False)
    sizes = []
    for step in range(46):
        _, host = next(batches)
        sizes.append(len(host["label"]))
        ref, ref_m = single_step(state, host)
        got, got_m = multi_step(jax.device_put(state, replicated), host)
        assert max_diff(ref.params, got.params) <= STEP_TOLERANCE, step
        assert float(got_m["loss"]) == pytest.approx(float(ref_m["loss"]), rel=1e-5, abs=1e-6)
        state = ref
    assert sizes[44] == 30


# ---- uneven batches ----------------------------------------------------------------


def test_uneven_batch_of_13_on_4_devices_matches_one_device():
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((13, 3), dtype=np.float32), "y": rng.standard_normal(13).astype(np.float32)}

    def loss_fn(p, b):
        err = b["x"] @ p["w"] + p["b"] - b["y"]
        return jnp.mean(err**2), {"abs": jnp.mean(jnp.abs(err))}

    def train_step(p, b):  # new = old - grad, so the update is the gradient
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, b)
        return jax.tree.map(lambda x, g: x - g, p, grads), {"loss": loss, **aux}

    params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.float32(0.3)}
    (ref_loss, ref_aux), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    strategy = strategy_on(4)
    new, metrics = strategy.step(train_step)(strategy.init(lambda k: params, 0), batch)
    grads = jax.tree.map(lambda a, b: a - b, params, jax.device_get(new))
    assert float(metrics["loss"]) == pytest.approx(float(ref_loss), rel=1e-6)
    assert float(metrics["abs"]) == pytest.approx(float(ref_aux["abs"]), rel=1e-6)
    assert max_diff(grads, ref_grads) < 1e-6
    means = strategy.evaluate(lambda p, b: loss_fn(p, b)[0])(new, batch)
    assert float(means) == pytest.approx(float(loss_fn(jax.device_get(new), batch)[0]), rel=1e-6)


def test_state_is_replicated_on_every_device():
    strategy = strategy_on(4)
    opt = optax.adam(1e-3)
    state = strategy.init(lambda k: (p := {"w": jnp.ones((3, 3))}, opt.init(p)), jax.random.key(0))
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 4


def test_data_parallel_on_a_mesh_with_a_model_axis_splits_only_data():
    strategy = spmdkit.DataParallel(spmdkit.make_mesh(data=4, model=2))
    assert strategy.batch_shards == 4
    placed = place({"x": np.ones((8, 2), np.float32)}, strategy._batch_sharding(even=True))
    assert placed["x"].sharding.spec == jax.P("data")


def test_errors():
    with pytest.raises(spmdkit.MeshError, match=r"axes \['x'\] but the batch axis is 'data'"):
        spmdkit.DataParallel(spmdkit.make_mesh(x=8))
    with pytest.raises(spmdkit.ConfigError, match="impl='pmap'"):
        spmdkit.DataParallel(impl="pmap")
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)impl='shard_map'.*no packed shard_map all-reduce"):
        spmdkit.DataParallel(impl="shard_map")
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)strategy='ring' is not known.*\['data', 'ensemble', 'sharded', 'single'\]"):
        spmdkit.get_strategy("ring")
