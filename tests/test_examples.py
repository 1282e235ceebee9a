"""Every script in examples/ runs (small) and gives its one-device result."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdkit

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))  # the examples are scripts, not a package

import ensemble  # noqa: E402
import parallel_evaluation  # noqa: E402
import pmap_train_step  # noqa: E402
import regression  # noqa: E402
import sharded_mlp  # noqa: E402
import transformer_lm  # noqa: E402

# SGD steps agree across device counts to float rounding of the gradient all-reduce;
# Adam divides by a running RMS, which turns rounding-level differences of near-zero
# gradient components into updates of up to ~lr, so Adam runs get a looser bound.
SGD_TOL = 1e-5
ADAM_TOL = 1e-4


def close(got, want, tol, what=""):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(got))[0],
                            jax.tree.leaves(jax.device_get(want))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol, rtol=tol,
                                   err_msg=what + jax.tree_util.keystr(path))


def devices(n):
    return jax.devices()[:n]


def test_parallel_evaluation_equals_vmap():
    out = parallel_evaluation.main(nested=False)
    conv = jax.vmap(parallel_evaluation.convolve)
    np.testing.assert_array_equal(out["once"][0], [11.0, 20.0, 29.0])
    np.testing.assert_array_equal(out["once"], conv(out["xs"], out["ws"]))
    np.testing.assert_array_equal(out["twice"], conv(out["xs"], conv(out["xs"], out["ws"])))


def test_nested_parallel_evaluation_equals_nested_vmap():
    out = parallel_evaluation.main()
    want = jax.vmap(jax.vmap(parallel_evaluation.row_totals, axis_name="cols"), axis_name="rows")(*out["grid"])
    assert out["nested"].shape == (2, 4, 3)
    np.testing.assert_allclose(out["nested"], want, rtol=1e-6)


@pytest.mark.parametrize("n", [2, 8])
def test_pmap_train_step_by_hand_and_transformed_equal_one_device(n):
    steps = 20
    out = pmap_train_step.main(steps=steps, n_devices=n)
    x, y = pmap_train_step.make_data()
    params, step = jnp.zeros(x.shape[1]), jax.jit(pmap_train_step.train_step)
    for _ in range(steps):
        params, _ = step(params, x, y)
    close(out["by_hand"], params, SGD_TOL, "pmap by hand")
    close(out["transformed"], params, SGD_TOL, "strategy.step")


def test_data_parallel_regression_equals_one_device():
    one = regression.main(steps=50, strategy=spmdkit.Single())
    for n in (2, 8):
        many = regression.main(steps=50, strategy=spmdkit.DataParallel(spmdkit.make_mesh(data=n, devices=devices(n))))
        close(many, one, SGD_TOL, f"regression on {n} devices")
    start = regression.init(jax.random.key(123))
    assert abs(float(one.weight) - 2) < abs(float(start.weight) - 2)  # on its way to w = 2


def test_ensemble_members_equal_single_models():
    """A population of two learning rates: member m equals one model trained alone at rate m."""
    steps, members, rates = 4, 2, [0.1, 0.02]
    out = ensemble.main(steps=steps, learning_rates=rates)
    assert out["probs"].shape == (members, 360, 10)
    # Each member against the same model trained alone with plain jit (compiled once for both).
    init = jax.jit(lambda key, rate: ensemble.create_train_state(key, rate, 0.9))
    step = jax.jit(ensemble.train_step)
    train_ds, _ = ensemble.get_datasets()
    for m, key in enumerate(jax.random.split(jax.random.key(0), members)):
        single = init(key, rates[m])
        for i in range(steps):  # the example's data order
            rows = np.random.default_rng(i).permutation(len(train_ds["label"]))[:64]
            single, _ = step(single, {k: v[rows] for k, v in train_ds.items()})
        close(jax.tree.map(lambda x: x[m], out["state"].params), single.params, SGD_TOL, f"member {m}")
    mean_acc = np.mean(np.argmax(out["probs"].mean(0), -1) == ensemble.get_datasets()[1]["label"])
    assert out["ensemble_accuracy"] == pytest.approx(mean_acc)


def test_sharded_mlp_trains_like_one_device_and_restores_on_another_mesh(tmp_path):
    out = sharded_mlp.main(layers=2, depth=64, steps=2, workdir=str(tmp_path))
    w1 = out["state"].params["ScanDotReluDot_0"]["W1"].value
    assert w1.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    assert w1.addressable_shards[0].data.shape == (2, 64, 16)  # depth 64 over model=4
    # The one-device run: plain jit; the model names mesh axes, so it runs under a 1x1 mesh.
    mesh = jax.sharding.Mesh(np.array(devices(1)).reshape(1, 1), ("data", "model"))
    with jax.set_mesh(mesh):
        state = jax.jit(out["make_state"])(jax.random.key(0))
        for _ in range(2):
            state = jax.jit(out["train_step"])(state, out["x"])
        y = jax.jit(sharded_mlp.apply_fn)(state, out["x"])
    close(out["state"].params, state.params, ADAM_TOL, "sharded params")
    close(out["y"], y, ADAM_TOL, "sharded inference")
    restored = out["restored"].params["ScanDotReluDot_0"]["W1"].value
    assert dict(restored.sharding.mesh.shape) == {"data": 1, "model": 4}
    close(out["restored"], out["state"], 0, "restored state")  # bit for bit
    close(out["y_restored"], out["y"], 1e-6, "inference after restore")


def test_transformer_lm_fsdp_tp_equals_one_device():
    steps, cfg = 3, transformer_lm.LMConfig(embed=16, heads=4, kv=4, mlp=32, layers=2, length=8)
    sharded = transformer_lm.main(steps=steps, batch_size=8, cfg=cfg)
    emb = sharded["state"].params["embed"]["embedding"].value
    assert emb.sharding.spec == jax.sharding.PartitionSpec("model", "data")  # vocab x embed
    assert dict(emb.sharding.mesh.shape) == {"data": 2, "model": 4}
    one = transformer_lm.main(steps=steps, batch_size=8, cfg=cfg, strategy=spmdkit.Single())
    close(sharded["losses"], one["losses"], ADAM_TOL, "losses")
    close(sharded["state"].params, one["state"].params, ADAM_TOL, "params")
    assert sharded["next_bytes"].shape == (3, cfg.length)
    np.testing.assert_array_equal(sharded["next_bytes"], one["next_bytes"])
