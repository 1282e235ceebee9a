"""Users' own models (tests/_user_models.py) through ``strategy.step`` / ``strategy.apply``.

Each model is first trained with plain ``jax.jit`` on one device: the reference. Every
strategy must then give the reference's state, aux and predictions on 1, 2, 4 and 8
devices. Tolerances: SGD steps agree to float rounding (all-reduce order), 1e-5 here;
Adam divides by a running RMS, which turns rounding-level differences of near-zero
gradient components into updates of up to ~lr, so Adam models get 1e-4 (atol in the zoo).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from _user_models import ZOO, UserModel, reference_context, reference_run

STEPS, BATCH = 3, 8

_REFS: dict[str, tuple] = {}


def host(tree):
    """numpy copies of every leaf; typed PRNG keys as their raw key data. Flax boxes stay:
    a strategy's state has the structure jax.jit gives (Partitioned boxes included)."""
    def one(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    return jax.tree.map(one, tree)


def reference(name: str):
    """The one-device run of a zoo model, computed once per test session."""
    if name not in _REFS:
        _REFS[name] = host(reference_run(ZOO[name], STEPS, BATCH))
    return _REFS[name]


def assert_trees_close(got, want, atol, what):
    # Paths, not treedefs: a TrainState's static fields (tx, apply_fn) are new objects per make_state.
    got_leaves = jax.tree_util.tree_flatten_with_path(host(got))[0]
    want_leaves = jax.tree_util.tree_flatten_with_path(host(want))[0]
    got_paths = [jax.tree_util.keystr(p) for p, _ in got_leaves]
    assert got_paths == [jax.tree_util.keystr(p) for p, _ in want_leaves], f"{what}: leaves differ: {got_paths}"
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        assert g.shape == w.shape, f"{what}{jax.tree_util.keystr(path)}: shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g, w, atol=atol, rtol=atol, err_msg=f"{what}{jax.tree_util.keystr(path)}")


# ---- the reference itself: every model really trains on one device -------------------


@pytest.mark.parametrize("name", list(ZOO))
def test_reference_trains_on_one_device(name):
    model = ZOO[name]
    state, auxes, out = reference(name)
    with reference_context(model):
        initial = host(jax.jit(model.make_state)(jax.random.key(0)))
    assert all(np.isfinite(float(a["loss"])) for a in auxes)
    assert out.shape[0] == BATCH
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(state))]
    assert sum(changed) >= len(changed) // 2, f"{name}: most of the state did not change in {STEPS} steps"
    if name == "batchnorm_cnn":  # the running statistics are trained, not frozen
        assert not np.allclose(initial.batch_stats["BatchNorm_0"]["mean"], state.batch_stats["BatchNorm_0"]["mean"])
    if name == "dropout_mlp":  # predictions run without dropout: deterministic
        again = jax.jit(model.predict)(state, model.batch(999, BATCH))
        np.testing.assert_array_equal(np.asarray(again), out)


# ---- every strategy equals the reference ---------------------------------------------



def strategy_for(kind: str, n: int, model: UserModel):
    devices = jax.devices()[:n]
    if kind == "single":
        return spmdkit.Single()
    if kind == "data":
        return spmdkit.DataParallel(spmdkit.make_mesh(data=n, devices=devices))
    if kind == "sharded":
        model_axis = 4 if n == 8 else n  # 8 devices: the 2x4 mesh; fewer: all model-parallel
        mesh = spmdkit.make_mesh(data=n // model_axis, model=model_axis, devices=devices)
        return spmdkit.Sharded(mesh, model.rules, state_axes=model.state_axes)
    raise AssertionError(kind)


# Device counts per strategy: every count appears across the zoo, each model runs on
# Single and on one data-parallel and (mostly) one sharded count; kept few for CI time.
# The transformer's Single and fsdp+tp (2x4) runs are tests/test_examples.py's.
_COUNTS = {
    "batchnorm_cnn": [("data", 8), ("sharded", 8)],  # batch statistics over the global batch
    "dropout_mlp": [("data", 4), ("sharded", 2)],
    "two_optimizers": [("data", 8), ("sharded", 8)],
    "nnx_dropout_batchnorm": [("data", 2), ("sharded", 8)],
    "pjit_mlp": [("data", 8), ("sharded", 8)],
    "pjit_logical_mlp": [("data", 2), ("sharded", 8)],
    "transformer_lm": [("data", 4)],
}
CASES = [(name, kind, n) for name in ZOO
         for kind, n in ([] if name == "transformer_lm" else [("single", 1)]) + _COUNTS[name]]


def run_strategy(strategy, model: UserModel):
    state = strategy.init(model.make_state, jax.random.key(0))
    step = strategy.step(model.train_step)
    auxes = []
    for i in range(STEPS):
        state, aux = step(state, model.batch(100 + i, BATCH))
        auxes.append(jax.block_until_ready(aux))  # CPU collectives: block every step
    out = strategy.apply(model.predict)(state, model.batch(999, BATCH))
    return state, auxes, out


@pytest.mark.parametrize("name,kind,n", CASES, ids=[f"{a}-{b}-{c}dev" for a, b, c in CASES])
def test_step_equals_one_device(name, kind, n):
    model = ZOO[name]
    want_state, want_auxes, want_out = reference(name)
    state, auxes, out = run_strategy(strategy_for(kind, n, model), model)
    assert_trees_close(state, want_state, model.atol, f"{name} on {kind}({n}): state")
    assert_trees_close(auxes, want_auxes, model.atol, f"{name} on {kind}({n}): aux")
    assert_trees_close(out, want_out, model.atol, f"{name} on {kind}({n}): apply")


@pytest.mark.parametrize("name", ["batchnorm_cnn", "nnx_dropout_batchnorm"])
def test_ensemble_members_equal_one_device_runs(name):
    """Ensemble(2) on 2 devices: member m is the one-device run from key m of a split."""
    model = ZOO[name]
    strategy = spmdkit.Ensemble(2, devices=jax.devices()[:2])
    state, auxes, out = run_strategy(strategy, model)
    for m, key in enumerate(jax.random.split(jax.random.key(0), 2)):
        want_state, want_auxes, want_out = host(reference_run(model, STEPS, BATCH, key=key))
        member = jax.tree.map(lambda x: x[m], state)
        assert_trees_close(member, want_state, model.atol, f"{name} member {m}: state")
        assert_trees_close(jax.tree.map(lambda x: x[m], auxes), want_auxes, model.atol, f"{name} member {m}: aux")
        assert_trees_close(out[m], want_out, model.atol, f"{name} member {m}: apply")


@pytest.mark.parametrize("name,kind,n", [("batchnorm_cnn", "data", 4), ("pjit_mlp", "sharded", 8)])
def test_apply_takes_any_batch_size(name, kind, n):
    """5 rows on a mesh that splits the batch 2 or 4 ways: exactly the 5 one-device rows."""
    model = ZOO[name]
    strategy = strategy_for(kind, n, model)
    state = strategy.init(model.make_state, jax.random.key(0))
    batch = model.batch(7, 5)
    out = strategy.apply(model.predict)(state, batch)
    ref = reference_run(model._replace(batch=lambda s, b: batch), 0, 5)[2]
    assert out.shape[0] == 5
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=model.atol)


def test_state_axes_lay_out_every_copy_of_the_params():
    """Parameters, their EMA and both optimizers' moments follow the user's logical names."""
    model = ZOO["two_optimizers"]
    state = strategy_for("sharded", 8, model).init(model.make_state, jax.random.key(0))
    w = P(None, "model")
    assert state["params"]["encoder"]["w"].sharding.spec == w
    assert state["ema"]["encoder"]["w"].sharding.spec == w
    assert state["head_opt"][0].trace["w"].sharding.spec == P("model", None)
    assert state["encoder_opt"][0].mu["w"].sharding.spec == w
    assert state["encoder_opt"][0].nu["w"].sharding.spec == w


@pytest.mark.parametrize("name", ["batchnorm_cnn", "transformer_lm"])
def test_uneven_global_batch_is_exact_or_refused(name):
    """6 rows on data=4: batch statistics (BatchNorm) and a count-normalised loss (the LM's
    sum(w * l) / sum(w)) must give the one-device step on those 6 rows, or a clear refusal."""
    model = ZOO[name]
    strategy = strategy_for("data", 4, model)
    batch = model.batch(3, 6)
    try:
        state, aux = strategy.step(model.train_step)(strategy.init(model.make_state, jax.random.key(0)), batch)
    except spmdkit.BatchSizeError as e:  # refused: the message names the sizes
        assert "6" in str(e) and "4" in str(e)
        return
    want_state, want_aux = jax.jit(model.train_step)(jax.jit(model.make_state)(jax.random.key(0)), batch)
    assert np.isfinite(float(aux["loss"]))
    assert_trees_close(state, want_state, model.atol, f"{name}, 6 rows on 4 devices: state")
    assert_trees_close(aux, want_aux, model.atol, f"{name}, 6 rows on 4 devices: aux")
