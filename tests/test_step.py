"""The step transform: a user's own state, step and inference on every strategy == Single.

Four user programs, each written for one device with no axis names: a BatchNorm CNN in
a Flax ``TrainState`` subclass (params + batch_stats), a Dropout MLP drawing its key
from the state, a custom step with two optimizers, and an NNX model (``nnx.split``
state, Dropout and BatchNorm). Each runs on DataParallel over 1, 2, 4 and 8 devices,
Sharded over 2x2 and 2x4 meshes and as an ensemble, and must give Single's state.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import spmdkit

STEPS = 2
TOL = 1e-5  # SGD: layouts differ only in float32 reduction order


class Case(NamedTuple):
    make_state: Any
    train_step: Any
    predict: Any
    batch: dict[str, np.ndarray]
    rules: Any = "dp"
    state_axes: Any = None


# ---- a BatchNorm CNN in a TrainState subclass --------------------------------------
class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(3)(x)


class BNState(train_state.TrainState):
    batch_stats: Any


def cnn_case() -> Case:
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 6, 6, 1)).astype(np.float32), "y": rng.integers(0, 3, 16)}
    model = CNN()

    def make_state(key):
        variables = model.init(key, jnp.zeros((1, 6, 6, 1)), train=False)
        return BNState.create(apply_fn=model.apply, params=variables["params"],
                              batch_stats=variables["batch_stats"], tx=optax.sgd(0.1, momentum=0.9))

    def train_step(state, batch):
        def loss_fn(params):
            logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                             batch["x"], train=True, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, updates["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss}

    def predict(state, batch):
        return state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, batch["x"], train=False)

    return Case(make_state, train_step, predict, batch)


# ---- Dropout, the per-step key carried in the state ----------------------------------
class DropMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(8)(x))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(1)(x)


def dropout_case() -> Case:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    batch = {"x": x, "y": np.sin(x[:, :1])}
    model, tx = DropMLP(), optax.sgd(0.05)

    def make_state(key):
        params = model.init(key, jnp.zeros((1, 4)), train=False)["params"]
        return {"params": params, "opt": tx.init(params), "rng": jax.random.fold_in(key, 1)}

    def train_step(state, batch):
        rng, drop = jax.random.split(state["rng"])

        def loss_fn(params):
            pred = model.apply({"params": params}, batch["x"], train=True, rngs={"dropout": drop})
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "rng": rng}, {"loss": loss}

    def predict(state, batch):
        return model.apply({"params": state["params"]}, batch["x"], train=False)

    return Case(make_state, train_step, predict, batch)


# ---- a custom step with two optimizers (an encoder and a head), plain arrays -----------
def two_optimizer_case() -> Case:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    batch = {"x": x, "y": x * 2.0}
    enc_tx, head_tx = optax.sgd(0.05, momentum=0.9), optax.sgd(0.1)

    def make_state(key):
        k1, k2 = jax.random.split(key)
        enc = {"w": jax.random.normal(k1, (4, 8)) * 0.5}
        head = {"w": jax.random.normal(k2, (8, 4)) * 0.5}
        return {"enc": enc, "head": head, "enc_opt": enc_tx.init(enc), "head_opt": head_tx.init(head),
                "step": jnp.zeros((), jnp.int32)}

    def forward(enc, head, x):
        return jnp.tanh(x @ enc["w"]) @ head["w"]

    def train_step(state, batch):
        def loss_fn(enc, head):
            return jnp.mean((forward(enc, head, batch["x"]) - batch["y"]) ** 2)

        loss, (g_enc, g_head) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state["enc"], state["head"])
        u_enc, enc_opt = enc_tx.update(g_enc, state["enc_opt"], state["enc"])
        u_head, head_opt = head_tx.update(g_head, state["head_opt"], state["head"])
        return {"enc": optax.apply_updates(state["enc"], u_enc), "head": optax.apply_updates(state["head"], u_head),
                "enc_opt": enc_opt, "head_opt": head_opt, "step": state["step"] + 1}, {"loss": loss}

    def predict(state, batch):
        return forward(state["enc"], state["head"], batch["x"])

    # Logical names for plain arrays: a params-shaped tree also lays out the momentum.
    axes = {"w": ("embed", "hidden")}
    return Case(make_state, train_step, predict, batch, rules="fsdp+tp", state_axes=axes)


# ---- NNX: Dropout + BatchNorm, state from nnx.split ------------------------------------
class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def nnx_case() -> Case:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    batch = {"x": x, "y": np.cos(x[:, :1])}
    tx = optax.sgd(0.05)
    graphdef = nnx.graphdef(NNXNet(nnx.Rngs(0)))

    def make_state(key):
        _, params, rest = nnx.split(NNXNet(nnx.Rngs(key)), nnx.Param, ...)
        return {"params": params, "rest": rest, "opt": tx.init(params)}

    def train_step(state, batch):
        model = nnx.merge(graphdef, state["params"], state["rest"])

        def loss_fn(model):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)  # BatchNorm stats and dropout counter update
        _, params, rest = nnx.split(model, nnx.Param, ...)
        updates, opt = tx.update(grads, state["opt"], params)
        return {"params": optax.apply_updates(params, updates), "rest": rest, "opt": opt}, {"loss": loss}

    def predict(state, batch):
        model = nnx.merge(graphdef, state["params"], state["rest"])
        model.eval()
        return model(batch["x"])

    return Case(make_state, train_step, predict, batch)


CASES = {"batchnorm_cnn": cnn_case, "dropout": dropout_case, "two_optimizers": two_optimizer_case, "nnx": nnx_case}


@functools.lru_cache(maxsize=None)
def case(name: str) -> Case:
    return CASES[name]()


def host(tree):
    """Numpy leaves; PRNG keys as their raw bits."""
    def one(x):
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(x))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def run(strategy, c: Case, keys):
    """Train from each key (one strategy, so one compile) -> [(state, aux, apply output)]."""
    step, predict = strategy.step(c.train_step), strategy.apply(c.predict)
    odd = {k: v[:5] for k, v in c.batch.items()}  # 5 rows: no device count here divides it
    results = []
    for key in keys:
        state = strategy.init(c.make_state, key)
        for _ in range(STEPS):
            state, aux = step(state, c.batch)
        results.append((host(state), host(aux), host(predict(state, odd))))
    return results


@functools.lru_cache(maxsize=None)
def single(name: str, members: int = 0):
    """Single's results from key 0, or from each of an ensemble's member keys."""
    key = jax.random.key(0)
    keys = [key] if not members else list(jax.random.split(key, members))
    return run(spmdkit.Single(), case(name), keys)


def assert_close(got, want, what: str):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], want_leaves):
        np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL, err_msg=f"{what}{jax.tree_util.keystr(path)}")


def assert_matches_single(name: str, got) -> None:
    (state, aux, out), ((ref_state, ref_aux, ref_out),) = got, single(name)
    assert out.shape == (5, *ref_out.shape[1:])
    assert_close(state, ref_state, "state")
    assert_close(aux, ref_aux, "aux")
    assert_close(out, ref_out, "apply")


def devices(n: int):
    return jax.devices()[:n]


# Every program on 2 and 8 devices; the BatchNorm CNN (cross-device batch statistics) on all.
DP_CASES = [(name, n) for name in CASES for n in (2, 8)] + [("batchnorm_cnn", 1), ("batchnorm_cnn", 4)]


@pytest.mark.parametrize("name,n", DP_CASES)
def test_data_parallel_equals_single(name, n):
    strategy = spmdkit.DataParallel(spmdkit.make_mesh(data=n, devices=devices(n)))
    (got,) = run(strategy, case(name), [jax.random.key(0)])
    assert_matches_single(name, got)


SHARDED_CASES = [(name, (2, 4)) for name in CASES] + [("two_optimizers", (2, 2))]


@pytest.mark.parametrize("name,shape", SHARDED_CASES)
def test_sharded_equals_single(name, shape):
    c = case(name)
    mesh = spmdkit.make_mesh(data=shape[0], model=shape[1], devices=devices(shape[0] * shape[1]))
    strategy = spmdkit.Sharded(mesh, c.rules, state_axes=c.state_axes)
    (got,) = run(strategy, c, [jax.random.key(0)])
    assert_matches_single(name, got)


def test_sharded_lays_out_plain_arrays_from_state_axes():
    c = case("two_optimizers")
    strategy = spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), c.rules, state_axes=c.state_axes)
    state = strategy.init(c.make_state, jax.random.key(0))
    assert state["enc"]["w"].sharding.spec == jax.sharding.PartitionSpec("data", "model")
    # The momentum mirrors its parameter, so the params-shaped tree names it too.
    assert state["enc_opt"][0].trace["w"].sharding.spec == jax.sharding.PartitionSpec("data", "model")
    assert state["enc"]["w"].addressable_shards[0].data.shape == (2, 2)  # never whole on one device


ENSEMBLE_CASES = [(name, 4, 2) for name in CASES] + [("batchnorm_cnn", 8, 8)]


@pytest.mark.parametrize("name,members,n", ENSEMBLE_CASES)
def test_ensemble_members_equal_single(name, members, n):
    strategy = spmdkit.Ensemble(members, devices=devices(n))
    ((state, aux, out),) = run(strategy, case(name), [jax.random.key(0)])
    assert out.shape[:2] == (members, 5)
    for m, (ref_state, ref_aux, ref_out) in enumerate(single(name, members)):
        pick = lambda t, m=m: jax.tree.map(lambda x: x[m], t)  # noqa: E731
        assert_close(pick(state), ref_state, f"member {m} state")
        assert_close(pick(aux), ref_aux, f"member {m} aux")
        assert_close(out[m], ref_out, f"member {m} apply")


@pytest.mark.parametrize("rows", [5, 7, 8])
def test_apply_sees_the_exact_batch_never_padding(rows):
    # A function that mixes rows (here: centring on the batch mean) must give Single's answer
    # on every strategy and every batch size, uneven ones included.
    x = np.arange(rows, dtype=np.float32)[:, None]

    def centred(state, batch):
        return batch["x"] - batch["x"].mean(axis=0) + state["w"]

    def make(rng):
        return {"w": jnp.zeros(())}

    want = np.asarray(x - x.mean(axis=0))
    for strategy in (spmdkit.Single(), spmdkit.DataParallel(),
                     spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp")):
        state = strategy.init(make, jax.random.key(0))
        np.testing.assert_allclose(np.asarray(strategy.apply(centred)(state, {"x": x})), want, atol=1e-5)


from tests._user_models import Lookup as _Lookup  # noqa: E402  (an embedding lookup naming the batch axis)


def _lookup_step(state, batch):
    def loss(p):
        return jnp.mean(_Lookup().apply({"params": p}, batch["tok"]))  # a mean: every row's cotangent 1/n
    value, grads = jax.value_and_grad(loss)(state)
    return jax.tree.map(lambda a, g: a - 0.5 * g, state, grads), {"loss": value}


@pytest.mark.parametrize("rows", [13, 6])
def test_an_uneven_batch_constrained_over_data_keeps_a_lookups_gradient_exact(rows):
    # An uneven batch runs whole on every device, but the model's constraint ("batch" -> data)
    # split its rows over data=4 inside the program, and on a mesh with a second axis XLA:CPU
    # computed the gradient of the embedding gather wrong (off by more than its size, silently).
    r = np.random.default_rng(0)
    batch = {"tok": r.integers(0, 16, (rows, 5)).astype(np.int32)}
    make = lambda rng: _Lookup().init(rng, jnp.zeros((1, 5), jnp.int32))["params"]  # noqa: E731
    rules = {"batch": "data", "length": None, "embed": None, "vocab": None}
    ref = spmdkit.Single()
    want, _ = ref.step(_lookup_step)(ref.init(make, jax.random.key(0)), batch)
    mesh = spmdkit.make_mesh(data=4, model=2)
    for strategy in (spmdkit.Sharded(mesh, rules), spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), rules)):
        got, _ = strategy.step(_lookup_step)(strategy.init(make, jax.random.key(0)), batch)
        assert_close(got, want, f"{dict(strategy.mesh.shape)} rows={rows}")

    def dp_step(state, batch):  # the same with a mesh-axis constraint, on DataParallel over a 2-D mesh
        def loss(p):
            x = jax.lax.with_sharding_constraint(p["emb"][batch["tok"]], jax.sharding.PartitionSpec("data"))
            return jnp.mean(jnp.sin(x))
        value, grads = jax.value_and_grad(loss)(state)
        return jax.tree.map(lambda a, g: a - 0.5 * g, state, grads), {"loss": value}

    plain = lambda rng: {"emb": jax.random.normal(rng, (16, 8))}  # noqa: E731
    want, _ = ref.step(dp_step)(ref.init(plain, jax.random.key(0)), batch)
    dp = spmdkit.DataParallel(mesh)
    got, _ = dp.step(dp_step)(dp.init(plain, jax.random.key(0)), batch)
    assert_close(got, want, f"DataParallel {dict(mesh.shape)} rows={rows}")


def test_a_constraint_inside_a_custom_linear_solve_or_root_on_an_uneven_batch_equals_single():
    # The constraint-dropping rewrite of an uneven batch reaches the jaxprs of
    # custom_linear_solve and custom_root, which JAX keeps in named tuples (read by field:
    # jaxprs.solve); rebuilt as plain tuples they failed with AttributeError.
    def step(state, batch):
        def loss(a):
            m = a @ a.T * 0.5 + jnp.eye(4)
            matvec = lambda v: jax.lax.with_sharding_constraint(v @ m, jax.sharding.PartitionSpec("data"))  # noqa: E731
            sol = jax.lax.custom_linear_solve(matvec, batch["x"], lambda mv, r: jnp.linalg.solve(m, r.T).T,
                                              symmetric=True)
            root = jax.lax.custom_root(lambda y: matvec(y) - batch["x"], jnp.zeros_like(batch["x"]),
                                       lambda f, y0: jnp.linalg.solve(m, batch["x"].T).T,
                                       lambda g, r: jnp.linalg.solve(m, r.T).T)
            return jnp.mean(sol ** 2) + jnp.mean(root)
        value, grads = jax.value_and_grad(loss)(state["a"])
        return {"a": state["a"] - 0.1 * grads}, {"loss": value}

    make = lambda rng: {"a": jnp.eye(4) + 0.1 * jax.random.normal(rng, (4, 4))}  # noqa: E731
    batch = {"x": np.random.default_rng(0).normal(size=(13, 4)).astype(np.float32)}
    ref = spmdkit.Single()
    want = ref.step(step)(ref.init(make, 0), batch)
    for strategy in (spmdkit.DataParallel(), spmdkit.DataParallel(spmdkit.make_mesh(data=4, model=2))):
        got = strategy.step(step)(strategy.init(make, 0), batch)
        assert_close(got, want, f"{dict(strategy.mesh.shape)}")


def test_lower_of_a_rowwise_apply_on_an_uneven_batch_is_the_padded_split_program_that_runs():
    # lower() gave the whole-batch program (13 rows replicated), which a rowwise apply never runs:
    # it pads 13 rows to 16 and splits them over data.
    strategy = spmdkit.DataParallel()
    state = strategy.init(lambda rng: {"w": jnp.ones(3)}, 0)
    predict = strategy.apply(lambda s, b: b["x"] @ s["w"], rowwise=True)
    x = np.arange(39, dtype=np.float32).reshape(13, 3)
    compiled = predict.lower(state, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype)}).compile()
    assert compiled.input_shardings[0][1]["x"].spec == jax.sharding.PartitionSpec("data")
    out = compiled(state, {"x": jax.device_put(np.concatenate([x, x[-3:]]), compiled.input_shardings[0][1]["x"])})
    np.testing.assert_allclose(np.asarray(out), np.asarray(predict(state, {"x": x})))
    assert out.shape == (13,)


def test_the_uneven_constraint_workaround_is_on_exactly_where_xla_miscompiles():
    # Plain JAX, no spmdkit: a gather's gradient under a constraint splitting 13 rows over data=4
    # of a data=4, model=2 mesh. The workaround (_split_evenly) must be on where the installed
    # jax gets it wrong, and off where it gets it right (it drops the user's constraints).
    from jax.sharding import NamedSharding, PartitionSpec as P
    from spmdkit._strategies import _compile

    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, 16, (13, 5)), jnp.int32)
    emb = jax.random.normal(jax.random.key(0), (16, 8))

    def grad(constrain):
        def loss(e, t):
            x = e[t]
            return jnp.mean(jnp.sin(jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data"))) if constrain
                                    else x))
        rep = NamedSharding(mesh, P())
        return np.asarray(jax.jit(jax.grad(loss), in_shardings=(rep, rep), out_shardings=rep)(emb, tok))

    want, got = grad(False), grad(True)
    wrong = float(np.max(np.abs(got - want))) > 1e-3 * float(np.max(np.abs(want)))
    assert wrong == _compile.UNEVEN_CONSTRAINTS_MISCOMPILE, (jax.__version__, np.max(np.abs(got - want)))


def test_a_step_slicing_its_batch_on_a_2d_mesh_equals_single_or_warns_where_xla_cannot(monkeypatch):
    # No constraint here: XLA's own propagation splits tok[1:] (15 rows) over data=4. Before jax
    # 0.12.1 the lookup's gradient came out ~1e-2 off, silently; spmdkit cannot rewrite that, so
    # there it warns once per process, naming the fix.
    import warnings

    from spmdkit._strategies import _compile

    def step(state, batch):
        value, grads = jax.value_and_grad(lambda e: jnp.mean(jnp.sin(e[batch["tok"][1:]])))(state["emb"])
        return {"emb": state["emb"] - 0.5 * grads}, {"loss": value}

    make = lambda rng: {"emb": jax.random.normal(rng, (16, 8))}  # noqa: E731
    batch = {"tok": np.random.default_rng(0).integers(0, 16, (16, 5)).astype(np.int32)}
    ref = spmdkit.Single()
    want = ref.step(step)(ref.init(make, 0), batch)
    monkeypatch.setattr(_compile, "_WARNED_OLD_XLA", [False])
    for mesh in (spmdkit.make_mesh(data=4, model=2), spmdkit.make_mesh(data=2, model=4)):
        strategy = spmdkit.DataParallel(mesh)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = strategy.step(step)(strategy.init(make, 0), batch)
        said = [str(w.message) for w in seen if "XLA of this version" in str(w.message)]
        if not _compile.UNEVEN_CONSTRAINTS_MISCOMPILE:
            assert not said
            assert_close(got, want, f"{dict(mesh.shape)}")
        elif mesh.shape["data"] == 4:  # the first 2-D mesh of the process: warned, with the fix
            assert len(said) == 1 and "jax >= 0.12.1" in said[0] and "with_sharding_constraint(tok[1:]" in said[0]
        else:  # once per process
            assert not said


def test_a_constraint_is_kept_in_the_program_where_xla_is_right(monkeypatch):
    # Where jax computes the uneven split right, spmdkit leaves the user's program alone.
    from spmdkit._strategies import _compile

    calls = []
    real = _compile._split_evenly
    monkeypatch.setattr(_compile, "_split_evenly", lambda fn: calls.append(fn) or real(fn))
    batch = {"tok": np.random.default_rng(1).integers(0, 16, (13, 5)).astype(np.int32)}
    make = lambda rng: _Lookup().init(rng, jnp.zeros((1, 5), jnp.int32))["params"]  # noqa: E731
    rules = {"batch": "data", "length": None, "embed": None, "vocab": None}
    strategy = spmdkit.Sharded(spmdkit.make_mesh(data=4, model=2), rules)
    strategy.step(_lookup_step)(strategy.init(make, jax.random.key(0)), batch)
    assert bool(calls) == _compile.UNEVEN_CONSTRAINTS_MISCOMPILE


@pytest.mark.parametrize("rows", [5, 7])
def test_rowwise_apply_pads_an_uneven_batch_runs_split_and_equals_single(rows):
    # A rowwise function (here one that divides by row values) on a batch no device count
    # divides: padded by repeating the last row, run split over the devices, padding dropped.
    x = np.arange(1, rows + 1, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    seen = []

    def normalised(state, batch):
        seen.append(batch["x"].shape[0])
        return batch["x"] / batch["x"].sum(axis=1, keepdims=True) * state["w"]

    def make(rng):
        return {"w": jnp.full((3,), 2.0)}

    single = spmdkit.Single()
    want = np.asarray(single.apply(normalised, rowwise=True)(single.init(make, 0), {"x": x}))
    assert want.shape == (rows, 3)
    for strategy in (spmdkit.DataParallel(), spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp")):
        seen.clear()
        state = strategy.init(make, 0)
        out = strategy.apply(normalised, rowwise=True)(state, {"x": x})
        assert out.shape == (rows, 3) and np.all(np.isfinite(np.asarray(out)))
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
        assert seen and seen[-1] % strategy.batch_shards == 0 and seen[-1] > rows  # padded, so split
    with pytest.raises(TypeError, match="rowwise"):
        spmdkit.DataParallel().apply(normalised, rowwise="yes")
    with pytest.raises(spmdkit.BatchSizeError, match="8 rows went in"):  # the padded batch, checked before the cut
        spmdkit.DataParallel().apply(lambda s, b: jnp.sum(b["x"]), rowwise=True)(state, {"x": x})


def test_rowwise_check_catches_a_function_that_mixes_rows_on_an_uneven_batch():
    strategy = spmdkit.DataParallel()
    state = strategy.init(lambda rng: {"w": jnp.ones((3,))}, 0)
    softmax = lambda s, b: jax.nn.softmax(b["x"] @ s["w"], axis=0)  # noqa: E731  mixes rows
    rowwise = lambda s, b: jnp.tanh(b["x"] @ s["w"])  # noqa: E731
    x = np.random.default_rng(0).normal(size=(13, 3)).astype(np.float32)
    even = {"x": x[:8]}
    checked = strategy.apply(softmax, rowwise="check")
    np.testing.assert_allclose(checked(state, even), strategy.apply(softmax)(state, even), rtol=1e-5)
    with pytest.raises(spmdkit.BatchSizeError) as e:  # wrong only for uneven batches: caught there
        checked(state, {"x": x[:5]})
    msg = str(e.value)
    assert "batch of 5 rows" in msg and "fn mixes rows" in msg and "default apply(fn)" in msg
    out = strategy.apply(rowwise, rowwise="check")(state, {"x": x})
    np.testing.assert_allclose(out, np.tanh(x.sum(1)), rtol=1e-5)


def test_padding_repeats_the_last_row():
    from spmdkit._strategies._compile import pad_rows

    host = pad_rows({"x": np.array([[1.0], [2.0]])}, 2, 4)
    np.testing.assert_array_equal(host["x"][:, 0], [1.0, 2.0, 2.0, 2.0])
    device = pad_rows({"x": jnp.array([3, 4, 5])}, 3, 4)
    np.testing.assert_array_equal(np.asarray(device["x"]), [3, 4, 5, 5])


@pytest.mark.parametrize("strategy", [spmdkit.Single(), spmdkit.DataParallel(), spmdkit.Ensemble(2),
                                      spmdkit.Sharded({"data": 2, "model": 4}, "dp+tp")])
def test_a_collective_in_the_step_is_named_in_spmdkits_terms(strategy):
    # A pmap-style pmean(grads, "data") raised JAX's NameError "Found an unbound axis name: data.
    # To fix this, please call psum under `jax.shard_map`", advice for another API.
    make_state = lambda rng: {"w": jnp.zeros((4, 4))}  # noqa: E731

    def train_step(state, batch):
        return {"w": state["w"] - jax.lax.pmean(batch["x"].T @ batch["x"], "data")}, {}

    with pytest.raises(spmdkit.AxisNameError, match=r"(?s)train_step 'train_step' calls a collective over axis "
                                                    r"'data'.*remove the collective.*spmdkit.pmap") as err:
        strategy.step(train_step)(strategy.init(make_state, 0), {"x": np.ones((8, 4), np.float32)})
    assert isinstance(err.value, NameError)
    predict = strategy.apply(lambda s, b: jax.lax.psum(b["x"], "batch"))
    with pytest.raises(spmdkit.AxisNameError, match=r"apply function '<lambda>' calls a collective over axis 'batch'"):
        predict(strategy.init(make_state, 0), {"x": np.ones((8, 4), np.float32)})
