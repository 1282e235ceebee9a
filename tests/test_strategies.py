"""The strategies' shared contract: constraints, rules, meshes, options, uneven batches, errors."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit
from spmdkit._strategies import get_strategy

X = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)


def linear_step(state, batch):
    loss = lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)  # noqa: E731
    value, grad = jax.value_and_grad(loss)(state["w"])
    return {"w": state["w"] - 0.1 * grad}, {"loss": value}


def make_linear(rng):
    return {"w": jax.random.normal(rng, (8, 2))}


def batch_of(n):
    return {"x": X[:n], "y": X[:n, :2] * 3.0}


# ---- a model that constrains its activations runs unchanged everywhere -----------------
class Constrained(nn.Module):
    """Seed 003's pattern: mesh axes written in the model, and a logical constraint."""

    @nn.compact
    def __call__(self, x):
        w1 = self.param("W1", nn.with_partitioning(nn.initializers.xavier_normal(), (None, "model")), (8, 16))
        y = jax.lax.with_sharding_constraint(jax.nn.relu(x @ w1), P("data", "model"))
        y = nn.with_logical_constraint(y, ("batch", "hidden"))
        w2 = self.param("W2", nn.with_partitioning(nn.initializers.xavier_normal(), ("model", None)), (16, 8))
        return y @ w2


def constrained_program():
    model, tx = Constrained(), optax.sgd(0.1)

    def make_state(rng):
        params = model.init(rng, jnp.zeros((1, 8)))["params"]
        return {"params": params, "opt": tx.init(params)}

    def train_step(state, batch):
        loss = lambda p: jnp.mean((model.apply({"params": p}, batch["x"]) - batch["x"]) ** 2)  # noqa: E731
        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}

    return make_state, train_step, lambda state, batch: model.apply({"params": state["params"]}, batch["x"])


def run_constrained(strategy):
    make_state, train_step, predict = constrained_program()
    state = strategy.init(make_state, jax.random.key(0))
    state, aux = strategy.step(train_step)(state, {"x": X})
    return jax.device_get(state["params"]), float(aux["loss"]), np.asarray(strategy.apply(predict)(state, {"x": X[:5]}))


def test_sharding_constraints_run_unchanged_on_single_and_data_parallel():
    mesh = spmdkit.make_mesh(data=2, model=4)
    rules = (("batch", "data"), ("hidden", "model"))  # Flax's own rules format
    params, loss, out = run_constrained(spmdkit.Sharded(mesh, rules))
    for strategy in (spmdkit.Single(), spmdkit.DataParallel()):
        got_params, got_loss, got_out = run_constrained(strategy)
        np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
        np.testing.assert_allclose(got_out, out, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(params)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert out.shape == (5, 8)


@pytest.mark.parametrize("loop", ["unroll", "vmap"])
def test_sharding_constraints_run_unchanged_in_every_ensemble_member(loop):
    # Members are manual over the member axis; the model's constraints over 'data' and 'model'
    # apply within a member (size-1 axes there), so each member is Single's run from its key.
    ens = spmdkit.Ensemble(4, devices=jax.devices()[:2], member_loop=loop)
    make_state, train_step, predict = constrained_program()
    state = ens.init(make_state, jax.random.key(0))
    state, aux = ens.step(train_step)(state, {"x": X})
    out = np.asarray(ens.apply(predict)(state, {"x": X[:5]}))
    single = spmdkit.Single()
    for m, key in enumerate(ens.member_keys(jax.random.key(0))):
        alone, alone_aux = single.step(train_step)(single.init(make_state, key), {"x": X})
        np.testing.assert_allclose(float(aux["loss"][m]), float(alone_aux["loss"]), rtol=1e-5)
        np.testing.assert_allclose(out[m], np.asarray(single.apply(predict)(alone, {"x": X[:5]})), rtol=1e-5, atol=1e-6)


# ---- the Python boundary: rules formats, meshes, options ------------------------------
def test_rules_accept_flax_tuples_and_dicts():
    mesh = spmdkit.make_mesh(data=2, model=4)
    flax_rules = spmdkit.Sharded(mesh, (("batch", "data"), ("hidden", "model"), ("hidden", None)))
    assert flax_rules.rules.mapping == {"batch": "data", "hidden": "model"}  # first rule of a name wins
    assert spmdkit.Sharded(mesh, {"batch": "data", "hidden": "model"}).rules.mapping["hidden"] == "model"
    with pytest.raises(spmdkit.ConfigError, match="is not a rules table"):
        spmdkit.Sharded(mesh, 3)


def test_meshes_with_explicit_axes_are_accepted():
    explicit = jax.make_mesh((2, 4), ("data", "model"))
    strategy = spmdkit.Sharded(explicit, "dp+tp", state_axes={"w": ("hidden", None)})
    state = strategy.init(lambda rng: {"w": jnp.ones((8, 2))}, jax.random.key(0))
    state, aux = strategy.step(linear_step)(state, batch_of(16))
    ref_state, ref_aux = spmdkit.Single().step(linear_step)({"w": jnp.ones((8, 2))}, batch_of(16))
    np.testing.assert_allclose(state["w"], ref_state["w"], rtol=1e-6)
    dp = spmdkit.DataParallel(jax.make_mesh((8,), ("data",)))
    assert float(dp.step(linear_step)(dp.init(lambda rng: {"w": jnp.ones((8, 2))}, 0), batch_of(16))[1]["loss"]) == pytest.approx(float(ref_aux["loss"]), rel=1e-6)


def test_get_strategy_rejects_options_the_strategy_does_not_take():
    with pytest.raises(spmdkit.ConfigError) as e:
        get_strategy("data", members=4, rules="tp")
    msg = str(e.value)
    assert "strategy 'data' does not take members, rules" in msg and "takes impl, mesh" in msg
    with pytest.raises(ValueError, match="does not take impl"):
        get_strategy("ensemble", impl="shard_map")
    with pytest.raises(spmdkit.ConfigError, match="unknown option"):
        get_strategy("single", member=2)
    assert get_strategy("ensemble", members=2).members == 2


def test_get_strategy_takes_python_objects_as_well_as_the_command_line_text():
    # A dict, Mesh, dict of rules or AxisRules from Python failed with an AttributeError.
    text = get_strategy("sharded", mesh="data=2,model=4", rules="dp+tp")
    for mesh in ({"data": 2, "model": 4}, spmdkit.make_mesh(data=2, model=4)):
        for rules in ("dp+tp", {"batch": "data", "hidden": "model"}, spmdkit.AxisRules.load("dp+tp")):
            made = get_strategy("sharded", mesh=mesh, rules=rules)
            assert dict(made.mesh.shape) == dict(text.mesh.shape) == {"data": 2, "model": 4}
            assert made.rules.mesh_axes("batch", "the batch") == text.rules.mesh_axes("batch", "the batch")
    assert dict(get_strategy("data", mesh={"data": 8}).mesh.shape) == {"data": 8}
    with pytest.raises(spmdkit.MeshError, match=r"(?s)mesh=3 is not a mesh.*Fix: pass mesh='data=2,model=4'"):
        get_strategy("data", mesh=3)
    # A blank string was taken as not given: the preset's mesh and the dp rules, without a word.
    with pytest.raises(spmdkit.MeshError, match=r"mesh=' ' names no mesh axes"):
        get_strategy("sharded", mesh=" ", rules="dp+tp")
    with pytest.raises(spmdkit.LayoutError, match=r"(?s)rules='' names no rules.*leave rules out for 'dp'"):
        get_strategy("sharded", rules="")


# ---- batches ------------------------------------------------------------------------
def test_uneven_batch_is_exact_and_compiles_once_per_shape():
    traces = []

    def counted(state, batch):
        traces.append(batch["x"].shape)
        return linear_step(state, batch)

    strategy, single = spmdkit.DataParallel(), spmdkit.Single()
    step, ref = strategy.step(counted), single.step(linear_step)
    state, ref_state = strategy.init(make_linear, 0), single.init(make_linear, 0)
    for n in (16, 13, 16, 13):  # 13 rows cannot split over 8 devices
        state, aux = step(state, batch_of(n))
        ref_state, ref_aux = ref(ref_state, batch_of(n))
        np.testing.assert_allclose(aux["loss"], ref_aux["loss"], rtol=1e-6)
        np.testing.assert_allclose(state["w"], ref_state["w"], rtol=1e-6, atol=1e-7)
    assert traces == [(16, 8), (13, 8)]
    strategy.step(counted)(state, batch_of(16))  # written inline: the same compiled step
    assert traces == [(16, 8), (13, 8)]


def test_step_takes_device_batches_and_apply_any_size():
    strategy = spmdkit.DataParallel(spmdkit.make_mesh(data=4, devices=jax.devices()[:4]))
    state = strategy.init(make_linear, 0)
    on_one_device = jax.device_put(batch_of(16), jax.devices()[5])
    state, _ = strategy.step(linear_step)(state, on_one_device)
    predict = strategy.apply(lambda s, b: b["x"] @ s["w"])
    for n in (1, 3, 4, 7):
        np.testing.assert_allclose(predict(state, batch_of(n)), X[:n] @ np.asarray(state["w"]), rtol=1e-5, atol=1e-6)


# ---- errors in the caller's terms, before or while tracing ------------------------------
def test_errors_name_the_argument_and_path():
    strategy = spmdkit.DataParallel()
    state = strategy.init(make_linear, 0)
    step = strategy.step(linear_step)
    with pytest.raises(spmdkit.BatchSizeError, match=r"batch\['y'\] has 5"):
        step(state, {"x": X, "y": X[:5]})
    with pytest.raises(spmdkit.BatchSizeError, match=r"batch\['lr'\] is a scalar"):
        step(state, {**batch_of(16), "lr": np.float32(0.1)})
    with pytest.raises(spmdkit.StepOutputError, match="it must return \\(state, aux\\)"):  # also a TypeError
        strategy.step(lambda s, b: s)(state, batch_of(16))
    with pytest.raises(spmdkit.TreeMismatchError, match=r"structure differs from the state it got: state had 1 "
                                                       r"entries, returned 2: \['extra'\] added\."):
        strategy.step(lambda s, b: ({"w": s["w"], "extra": s["w"]}, {}))(state, batch_of(16))
    # the first place they differ, by path (two whole PyTreeDefs of a large state hid it)
    nested = lambda rng: {"bn": {"mean": jnp.zeros(2), "var": jnp.ones(2)}, "opt": (jnp.zeros(2),)}  # noqa: E731
    typo = lambda s, b: ({"bn": {"mean": s["bn"]["mean"], "varr": s["bn"]["var"]}, "opt": s["opt"]}, {})  # noqa: E731
    with pytest.raises(spmdkit.TreeMismatchError, match=r"state\['bn'\] had 2 entries, returned 2: \['var'\] missing; "
                                                       r"\['varr'\] added\."):
        strategy.step(typo)(strategy.init(nested, 0), batch_of(16))
    listed = lambda s, b: ({"bn": s["bn"], "opt": list(s["opt"])}, {})  # noqa: E731
    with pytest.raises(spmdkit.TreeMismatchError, match=r"state\['opt'\] was tuple, returned list\."):
        strategy.step(listed)(strategy.init(nested, 0), batch_of(16))
    from flax.training import train_state

    def make_ts(rng):
        return train_state.TrainState.create(apply_fn=lambda p, x: x, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))

    swapped = lambda s, b: (s.replace(apply_fn=lambda p, x: -x), {})  # noqa: E731
    with pytest.raises(spmdkit.TreeMismatchError, match=r"state is a TrainState whose static fields \(not arrays"):
        strategy.step(swapped)(strategy.init(make_ts, 0), batch_of(16))
    with pytest.raises(spmdkit.BatchSizeError, match="per-example outputs"):
        strategy.apply(lambda s, b: jnp.sum(b["x"]))(state, batch_of(16))
    with pytest.raises(spmdkit.SignatureError, match="make_state must be a function"):
        strategy.init({"w": 1}, 0)
    with pytest.raises(spmdkit.SignatureError, match="rng must be a PRNG key") as err:  # also a TypeError
        strategy.init(make_linear, "seed")
    assert isinstance(err.value, TypeError)



@pytest.mark.parametrize("make, call", [
    (lambda: spmdkit.DataParallel(), "init"), (lambda: spmdkit.DataParallel(), "abstract"),
    (lambda: spmdkit.Sharded(spmdkit.make_mesh(data=8), "dp"), "init"),
    (lambda: spmdkit.Sharded(spmdkit.make_mesh(data=8), "dp"), "abstract"),
    (lambda: spmdkit.Sharded(spmdkit.make_mesh(data=8), "dp"), "plan"),
    (lambda: spmdkit.Ensemble(members=2), "init")])
def test_a_make_state_without_the_key_argument_is_named_before_tracing(make, call):
    # It raised Python's "<lambda>() takes 0 positional arguments" from inside eval_shape;
    # spmdkit.plan already said so (the same check).
    strategy = make()
    args = (lambda: {"w": jnp.zeros(3)}, jax.random.key(0))
    with pytest.raises(spmdkit.SignatureError, match=r"(?s)make_state must take one argument, the PRNG key.*"
                       r"<lambda>\(\) does not.*Fix: pass make_state=lambda rng") as err:
        getattr(strategy, call)(*args)
    assert isinstance(err.value, TypeError)


# ---- ensembles ------------------------------------------------------------------------
def test_ensemble_members_get_their_own_hyperparameters():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)

    def make_state(rng):
        params = make_linear(rng)
        return {"params": params, "opt": tx.init(params)}

    def train_step(state, batch):
        loss = lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)  # noqa: E731
        value, grad = jax.value_and_grad(loss)(state["params"]["w"])
        updates, opt = tx.update({"w": grad}, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}

    ens = spmdkit.Ensemble(3, hyperparams={"learning_rate": [0.1, 0.0, 0.05]}, devices=jax.devices()[:3])
    state = ens.init(make_state, 0)
    start = np.asarray(state["params"]["w"])
    state, aux = ens.step(train_step)(state, batch_of(16))
    assert aux["loss"].shape == (3,)
    np.testing.assert_array_equal(state["params"]["w"][1], start[1])  # learning rate 0: unchanged
    single = spmdkit.Single()
    alone = single.init(make_state, jax.random.split(jax.random.key(0), 3)[0])
    alone, _ = single.step(train_step)(alone, batch_of(16))
    np.testing.assert_allclose(state["params"]["w"][0], alone["params"]["w"], rtol=1e-6)
    with pytest.raises(spmdkit.ConfigError, match="one per member"):
        spmdkit.Ensemble(3, hyperparams={"learning_rate": [0.1]})
    with pytest.raises(spmdkit.ConfigError, match="inject_hyperparams"):
        spmdkit.Ensemble(2, hyperparams={"learning_rate": [0.1, 0.2]}).init(make_linear, 0)


def _members_moved(tx, hyperparams, members=3):
    def make_state(rng):
        params = make_linear(rng)
        return {"params": params, "opt": tx.init(params)}

    def train_step(state, batch):
        grad = jax.grad(lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2))(state["params"])
        updates, opt = tx.update(grad, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    ens = spmdkit.Ensemble(members, hyperparams=hyperparams, devices=jax.devices()[:members])
    state = ens.init(make_state, 0)
    new, _ = ens.step(train_step)(state, batch_of(16))
    return np.abs(np.asarray(new["params"]["w"]) - np.asarray(state["params"]["w"])).reshape(members, -1).sum(1)


def test_ensemble_hyperparameters_the_optimizer_would_overwrite_are_refused():
    # A schedule is evaluated at every update: every member trained at its value, silently.
    schedule = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.constant_schedule(0.5))
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)members' values \[0, 0.01, 1\] were replaced.*now "
                                                  r"\[0.5, 0.5, 0.5\].*is a schedule.*optax.scale"):
        _members_moved(schedule, {"learning_rate": [0.0, 0.01, 1.0]})
    # The way the error points to: the schedule's optimizer, then a per-member scale.
    scaled = optax.chain(optax.sgd(optax.constant_schedule(0.5)), optax.inject_hyperparams(optax.scale)(step_size=1.0))
    moved = _members_moved(scaled, {"step_size": [0.0, 1.0, 2.0]})
    assert moved[0] == 0 and moved[1] > 0 and moved[2] > 0  # each member's own scale took effect
    # Two injected groups (optax.multi_transform) both holding the name: each kept its own value before.
    two = optax.multi_transform({"a": optax.inject_hyperparams(optax.sgd)(learning_rate=1e-3),
                                 "b": optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)},
                               lambda params: jax.tree.map(lambda _: "a", params))
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)2 injected optimizer states hold them.*inner_states\['a'\].*"
                                                  r"inner_states\['b'\].*inject only the optimizer"):
        _members_moved(two, {"learning_rate": [0.1, 0.2, 0.3]})


def test_ensemble_step_checks_the_member_count():
    state = spmdkit.Ensemble(4).init(make_linear, 0)
    with pytest.raises(spmdkit.MembersMismatchError, match="members=2"):
        spmdkit.Ensemble(2).step(linear_step)(state, batch_of(16))


def test_sharded_state_is_never_whole_on_one_device_and_shardings_are_public():
    strategy = spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "fsdp+tp", state_axes={"w": ("embed", "hidden")})
    abstract = jax.eval_shape(lambda r: {"w": jnp.ones((8, 4))}, jax.random.key(0))
    shardings = strategy.shardings(abstract)
    assert shardings["w"].spec == P("data", "model")
    target = strategy.abstract(lambda r: {"w": jnp.ones((8, 4))})
    assert target["w"].sharding == shardings["w"] and target["w"].shape == (8, 4)


def test_unknown_logical_name_error_speaks_python_and_replicate_unknown_is_an_argument():
    make_state = lambda rng: {"w": nn.LogicallyPartitioned(jnp.ones((8, 4)), ("layers", "hidden"))}  # noqa: E731
    mesh = spmdkit.make_mesh(data=2, model=4)
    with pytest.raises(spmdkit.LayoutError) as e:
        spmdkit.Sharded(mesh, (("batch", "data"), ("hidden", "model"))).init(make_state, 0)
    assert "logical axis 'layers'" in str(e.value) and 'add a rule for it (e.g. ("layers", "model")' in str(e.value)
    assert "replicate_unknown=True to Sharded" in str(e.value)
    state = spmdkit.Sharded(mesh, (("batch", "data"), ("hidden", "model")), replicate_unknown=True).init(make_state, 0)
    assert state["w"].value.sharding.spec == P(None, "model")


def test_state_axes_parts_name_the_moments_of_an_optimizer_over_part_of_the_params():
    adam, sgd = optax.adam(1e-3), optax.sgd(0.1, momentum=0.9)

    def make_state(rng):
        params = {"encoder": {"w": jnp.ones((8, 16)), "b": jnp.ones((16,))}, "head": {"w": jnp.ones((16, 4)), "b": jnp.ones((4,))}}
        return {"params": params, "enc_opt": adam.init(params["encoder"]), "head_opt": sgd.init(params["head"])}

    # encoder and head have the same structure: the shapes where the params sit tell them apart.
    axes = {"encoder": {"w": ("embed", "hidden"), "b": ("hidden",)}, "head": {"w": ("hidden", None), "b": (None,)}}
    state = spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp", state_axes=axes).init(make_state, 0)
    assert state["params"]["encoder"]["w"].sharding.spec == P(None, "model")
    assert state["enc_opt"][0].mu["w"].sharding.spec == P(None, "model")
    assert state["enc_opt"][0].nu["b"].sharding.spec == P("model")
    assert state["head_opt"][0].trace["w"].sharding.spec == P("model", None)


def test_single_is_its_own_class():
    single = spmdkit.Single()
    assert type(single).__name__ == "Single" and isinstance(single, spmdkit.DataParallel)
    assert repr(single).startswith("Single(") and single.describe()["device_count"] == 1


def test_ensemble_refuses_a_single_model_state_before_tracing():
    ens = spmdkit.Ensemble(4)
    good = ens.init(make_linear, 0)
    step, predict = ens.step(linear_step), ens.apply(lambda s, b: b["x"] @ s["w"])
    step(good, batch_of(16))  # the same structure as the bad state below: checked per call, not per structure
    one_model = make_linear(jax.random.key(0))  # w: (8, 2), no member axis
    for call in (step, predict):
        with pytest.raises(spmdkit.MembersMismatchError) as e:
            call(one_model, batch_of(16))
        msg = str(e.value)
        assert "state['w'] has shape (8, 2)" in msg and "no member axis of size 4" in msg
        assert "ensemble.init(make_state, rng)" in msg


def test_ensemble_refuses_another_strategys_state_whose_leading_sizes_are_k():
    # One model whose every leaf happens to start with K = 4: leading sizes cannot tell,
    # the layout can (a state placed by DataParallel/Sharded is not split over members).
    ens = spmdkit.Ensemble(4)
    one_model = lambda rng: {"w": jnp.eye(4), "b": jnp.zeros(4)}  # noqa: E731
    predict = ens.apply(lambda s, b: b["x"] @ s["w"] + s["b"])
    x = {"x": np.ones((3, 4), np.float32)}
    assert predict(ens.init(lambda r: one_model(r), 0), x).shape == (4, 3, 4)
    for other in (spmdkit.Single(), spmdkit.DataParallel(),
                  spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp")):
        with pytest.raises(spmdkit.MembersMismatchError) as e:
            predict(other.init(one_model, 0), x)
        msg = str(e.value)
        assert "is laid out by another strategy" in msg and "one model's state" in msg
        assert "ensemble.init(make_state, rng)" in msg


def test_another_strategy_refuses_an_ensembles_state():
    ens = spmdkit.Ensemble(4)
    members = ens.init(make_linear, 0)
    for other in (spmdkit.Single(), spmdkit.DataParallel(),
                  spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp")):
        other.init(make_linear, 0)  # Sharded: this structure laid out before
        for call in (other.step(linear_step), other.apply(lambda s, b: b["x"] @ s["w"])):
            with pytest.raises(spmdkit.LayoutError) as e:
                call(members, batch_of(16))
            msg = str(e.value)
            assert isinstance(e.value, ValueError)
            assert "state['w'] has shape (4, 8, 2)" in msg and "an ensemble's state" in msg
            assert "jax.tree.map(lambda x: x[i], state)" in msg
    one = jax.tree.map(lambda x: x[1], members)  # the fix the message gives
    out = spmdkit.DataParallel().apply(lambda s, b: b["x"] @ s["w"])(one, batch_of(16))
    np.testing.assert_allclose(out, X[:16] @ np.asarray(members["w"][1]), rtol=1e-5)


def test_an_ensembles_state_is_named_before_a_step_that_cannot_trace_its_shapes():
    # A bias broadcast over the stacked member axis fails inside the user's function: the
    # LayoutError came only for steps that happened to trace, a raw ValueError for the others.
    make = lambda rng: {"w": jax.random.normal(rng, (8, 2)), "b": jnp.zeros(2)}  # noqa: E731
    members = spmdkit.Ensemble(4).init(make, 0)

    def step(s, b):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2))(s)
        return jax.tree.map(lambda p, d: p - 0.1 * d, s, g), {"loss": loss}

    for other in (spmdkit.Single(), spmdkit.DataParallel(), spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp")):
        with pytest.raises(spmdkit.LayoutError, match=r"state\['b'\] has shape \(4, 2\).*an ensemble's state"):
            other.step(step)(members, batch_of(16))


def test_an_ensembles_state_is_named_also_after_the_step_ran_on_one_models_state():
    # Its structure was compiled before (one model's state), so the new shapes traced unchecked and
    # the user's dot of (3,) and (4,) came out as JAX's raw TypeError.
    make = lambda rng: {"w": jnp.ones((8,))}  # noqa: E731
    step = lambda s, b: (s, {"loss": jnp.sum(b["x"] @ s["w"])})  # noqa: E731
    members = spmdkit.Ensemble(4).init(make, 0)
    for other in (spmdkit.Single(), spmdkit.DataParallel(), spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp")):
        compiled = other.step(step)
        compiled(other.init(make, 0), batch_of(16))
        for call in (compiled, other.step(step)):
            with pytest.raises(spmdkit.LayoutError, match=r"state\['w'\] has shape \(4, 8\).*an ensemble's state"):
                call(members, batch_of(16))


@pytest.mark.parametrize("strategy", ["single", "data", "sharded", "ensemble"])
def test_a_train_step_on_no_examples_is_refused(strategy):
    # The mean loss over 0 rows is NaN: the state became NaN without a word (an empty last piece of
    # a data pipeline). An apply may take no rows.
    s = {"single": spmdkit.Single(), "data": spmdkit.DataParallel(), "ensemble": spmdkit.Ensemble(2),
         "sharded": spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp")}[strategy]
    state = s.init(make_linear, 0)
    with pytest.raises(spmdkit.BatchSizeError, match=r"(?s)step\(train_step\)\(state, batch\): batch\['x'\] has shape "
                                                     r"\(0, 8\), no examples.*Fix: skip empty batches"):
        s.step(linear_step)(state, batch_of(0))
    assert np.isfinite(np.asarray(s.step(linear_step)(state, batch_of(16))[1]["loss"])).all()


def test_an_ensemble_names_another_ensembles_member_count():
    members = spmdkit.Ensemble(4).init(make_linear, 0)
    with pytest.raises(spmdkit.MembersMismatchError, match=r"(?s)the state is an ensemble of 4 members.*not of 2.*"
                                                             r"Ensemble\(members=4\)") as e:
        spmdkit.Ensemble(2).step(linear_step)(members, batch_of(16))
    assert "one model's state" not in str(e.value) and "x[:2]" in str(e.value)
    with pytest.raises(spmdkit.MembersMismatchError, match=r"ensemble of 4 members.*not of 8") as e:
        spmdkit.Ensemble(8).step(linear_step)(members, batch_of(16))
    assert "x[:" not in str(e.value)  # fewer members than asked: nothing to take


def test_another_strategy_names_a_sharded_or_replicated_state_and_the_move():
    # A Sharded state given to DataParallel failed deep in jit; replicate's was called an ensemble's.
    mesh = spmdkit.make_mesh(data=2, model=4)
    sharded = spmdkit.Sharded(mesh, (("batch", "data"), ("hidden", "model")), state_axes={"w": (None, "hidden")})
    state = sharded.init(lambda rng: {"w": jnp.ones((8, 4))}, 0)
    f = lambda s, b: (s, {"loss": jnp.mean(b["x"] @ s["w"])})  # noqa: E731
    dp = spmdkit.DataParallel()
    with pytest.raises(spmdkit.LayoutError, match=r"(?s)state\['w'\] \(shape \(8, 4\)\) is laid out on another mesh "
                                                  r"\(\{'data': 2, 'model': 4\}.*jax.device_put\(state, strategy.shardings"):
        dp.step(f)(state, batch_of(16))
    moved = jax.device_put(state, dp.shardings(state))  # the fix the message gives
    assert np.isfinite(float(dp.step(f)(moved, batch_of(16))[1]["loss"]))
    with pytest.raises(spmdkit.LayoutError, match=r"(?s)one copy per device, as spmdkit.replicate.*spmdkit.unreplicate"):
        dp.step(f)(spmdkit.replicate({"w": np.ones((8, 4), np.float32)}), batch_of(16))


def test_sharded_compiled_apply_refuses_a_same_structure_state_of_other_shapes():
    mesh = spmdkit.make_mesh(data=2, model=4)
    sharded = lambda: spmdkit.Sharded(mesh, (("batch", "data"), ("hidden", "model")),  # noqa: E731
                                      state_axes={"w": (None, "hidden")})
    f = lambda s, b: jnp.tanh(b["x"] @ s["w"])  # noqa: E731
    x = {"x": X[:5, :3]}
    sh = sharded()
    apply = sh.apply(f, rowwise=True)
    s8 = sh.init(lambda r: {"w": jax.random.normal(r, (3, 8))}, 0)
    np.testing.assert_allclose(apply(s8, x), f(jax.device_get(s8), x), rtol=1e-5)
    s12 = sh.init(lambda r: {"w": jax.random.normal(r, (3, 12))}, 0)  # laid out too: runs
    np.testing.assert_allclose(apply(s12, x), f(jax.device_get(s12), x), rtol=1e-5)
    np.testing.assert_allclose(apply(jax.device_get(s8), x), f(jax.device_get(s8), x), rtol=1e-5)
    host6 = {"w": np.ones((3, 6), np.float32)}
    for call in (apply, sharded().apply(f, rowwise=True)):  # compiled before, and fresh
        with pytest.raises(spmdkit.LayoutError, match="got a state this strategy has not laid out"):
            call(host6, x)
    with pytest.raises(spmdkit.LayoutError, match=r"state\['w'\] has shape \(3, 6\), but this strategy laid out"):
        apply(host6, x)
    # a structure never laid out: the leaf, where it is, and the move (DataParallel's fix)
    other = {"v": np.ones((3, 6), np.float32)}
    with pytest.raises(spmdkit.LayoutError, match=r"(?s)not laid out \(nor one of its structure\): state\['v'\] \(shape "
                                                  r"\(3, 6\)\) is a host ndarray, not laid out on this strategy's mesh "
                                                  r"\{'data': 2, 'model': 4\}.*jax.device_put\(state, strategy.shardings"):
        apply(other, x)
    with pytest.raises(spmdkit.LayoutError, match=r"(?s)state\['v'\] \(shape \(3, 6\)\) is laid out on another mesh "
                                                  r"\(\{'data': 1\}.*jax.device_put\(state, strategy.shardings"):
        apply(spmdkit.Single().init(lambda r: other, 0), x)
    # the fix as given, also for a state holding a Python number (shardings() had no shape for it)
    plain = spmdkit.Sharded(mesh, "dp")
    mixed = {"w": np.ones((3, 6), np.float32), "t": 2.0}
    moved = jax.device_put(mixed, plain.shardings(mixed))
    np.testing.assert_allclose(plain.apply(lambda s, b: b["x"] @ s["w"] * s["t"])(moved, x), X[:5, :3] @ mixed["w"] * 2)


def test_a_string_in_aux_or_output_is_named():
    strategy = spmdkit.DataParallel()
    state = strategy.init(make_linear, 0)
    with pytest.raises(spmdkit.StepOutputError, match=r"aux\['tag'\] = 'hello' of type str") as e:
        strategy.step(lambda s, b: (s, {"tag": "hello"}))(state, batch_of(16))
    assert isinstance(e.value, TypeError)
    with pytest.raises(spmdkit.StepOutputError, match=r"output\['name'\]"):
        strategy.apply(lambda s, b: {"y": b["x"], "name": "x"})(state, batch_of(16))


@pytest.mark.parametrize("value", [np.array(["a", "b"]), np.str_("a"), np.array([object()]),
                                   np.datetime64("2020-01-01"), np.zeros(1, dtype=[("a", "f4")])[0]],
                         ids=["str-array", "str_", "object", "datetime64", "void"])
def test_a_numpy_string_or_object_in_aux_or_output_is_named(value):
    strategy = spmdkit.DataParallel()
    state = strategy.init(make_linear, 0)
    with pytest.raises(spmdkit.StepOutputError, match=rf"aux\['v'\] = .* of numpy dtype {re.escape(str(value.dtype))}"):
        strategy.step(lambda s, b: (s, {"v": value}))(state, batch_of(16))
    with pytest.raises(spmdkit.StepOutputError, match=r"output\['tag'\] = .* of numpy dtype"):
        strategy.apply(lambda s, b: {"y": b["x"], "tag": value})(state, batch_of(16))


@pytest.mark.parametrize("rows", [16, 5])
def test_a_string_batch_leaf_is_named(rows):
    strategy = spmdkit.DataParallel()
    state = strategy.init(make_linear, 0)
    batch = {**batch_of(rows), "id": np.array(["a"] * rows)}
    with pytest.raises(spmdkit.SpmdkitError) as e:
        strategy.apply(lambda s, b: b["x"] @ s["w"], rowwise=True)(state, batch)
    assert isinstance(e.value, TypeError)
    msg = str(e.value)
    assert f"batch['id'] has numpy dtype <U1 (shape ({rows},))" in msg
    assert "drop batch['id']" in msg and "integers" in msg


@pytest.mark.parametrize("strategy", [spmdkit.DataParallel(), spmdkit.Ensemble(2, devices=jax.devices()[:2])],
                         ids=["data", "ensemble"])
def test_a_donated_state_passed_again_is_refused(strategy):
    # Without the check, jax 0.12 raises "Array has been deleted" and jax 0.10 crashes the process.
    step = strategy.step(linear_step, donate=True)
    old = strategy.init(make_linear, 0)
    new, _ = step(old, batch_of(16))
    with pytest.raises(spmdkit.DonatedStateError) as e:
        step(old, batch_of(16))
    assert isinstance(e.value, RuntimeError)
    msg = str(e.value)
    assert "state['w'] has been deleted" in msg and "donate=True" in msg and "donate=False" in msg
    with pytest.raises(spmdkit.DonatedStateError):
        strategy.apply(lambda s, b: b["x"] @ s["w"])(old, batch_of(16))
    new, _ = step(new, batch_of(16))  # the returned state goes on
    assert np.all(np.isfinite(np.asarray(new["w"])))


@pytest.mark.parametrize("strategy", [spmdkit.DataParallel(), spmdkit.Ensemble(2, devices=jax.devices()[:2])],
                         ids=["data", "ensemble"])
def test_a_step_that_changes_a_state_leafs_dtype_or_shape_is_refused(strategy):
    state = strategy.init(make_linear, 0)
    with pytest.raises(spmdkit.StepOutputError) as e:
        strategy.step(lambda s, b: ({"w": s["w"].astype(jnp.bfloat16)}, {}))(state, batch_of(16))
    msg = str(e.value)
    assert "state['w'] with shape (8, 2) and dtype bfloat16" in msg and "dtype float32" in msg
    with pytest.raises(spmdkit.StepOutputError, match=r"state\['w'\] with shape \(2, 8\)"):
        strategy.step(lambda s, b: ({"w": s["w"].T}, {}))(state, batch_of(16))


@pytest.mark.parametrize("build", ["step", "evaluate", "apply"])
def test_a_function_that_does_not_take_state_and_batch_is_refused_when_built(build):
    # A step written like a Task's loss_fn(params, batch, rng) failed inside the trace with
    # Python's bare TypeError (missing 1 required positional argument: 'rng').
    strategy = spmdkit.DataParallel()

    def loss_like(params, batch, rng):
        return params, {}

    with pytest.raises(spmdkit.SignatureError, match=r"(?s)must take two arguments, the state and the batch.*"
                                                     r"loss_like\(params, batch, rng\) does not.*jax\.random\.split"):
        getattr(strategy, build)(loss_like)
    getattr(strategy, build)(lambda state, batch, scale=2.0: (state, {}))  # defaults are fine
    getattr(strategy, build)(jax.jit(lambda state, batch: (state, {})))

    @functools.wraps(loss_like)  # a decorator that supplies the key: its __wrapped__ takes three
    def keyed(state, batch):
        return loss_like(state, batch, jax.random.key(0))
    getattr(strategy, build)(keyed)
    getattr(strategy, build)(jax.checkpoint(lambda state, batch: (state, {})))  # (*args, **kwargs) outside
    with pytest.raises(spmdkit.SignatureError, match="loss_like"):
        getattr(strategy, build)(jax.checkpoint(loss_like))


def test_a_step_that_returns_a_keys_data_for_a_key_is_told_how_to_wrap_it():
    # The fix said new.astype(key<fry>), which is no code: a key is no number type.
    strategy = spmdkit.DataParallel()
    state = strategy.init(lambda rng: {"w": jnp.zeros(3), "key": rng}, 0)
    with pytest.raises(spmdkit.StepOutputError, match=r"(?s)state\['key'\] with shape \(2,\) and dtype uint32.*"
                                                      r"jax\.random\.wrap_key_data\(new\)"):
        strategy.step(lambda s, b: ({**s, "key": jax.random.key_data(s["key"])}, {}))(state, batch_of(16))
    rbg = strategy.init(lambda rng: {"w": jnp.zeros(3), "key": jax.random.key(0, impl="rbg")}, 0)
    with pytest.raises(spmdkit.StepOutputError, match=r"jax\.random\.wrap_key_data\(new, impl='rbg'\)"):
        strategy.step(lambda s, b: ({**s, "key": jax.random.key_data(s["key"])}, {}))(rbg, batch_of(16))
    # Two keys where one came in: no astype can mend that.
    with pytest.raises(spmdkit.StepOutputError, match="one key as it came in: index or split it"):
        strategy.step(lambda s, b: ({**s, "key": jax.random.split(s["key"])}, {}))(state, batch_of(16))
    raw = strategy.init(lambda rng: {"w": jnp.zeros(3), "key": jax.random.key_data(rng)}, 0)
    with pytest.raises(spmdkit.StepOutputError, match=r"jax\.random\.key_data\(new\)"):
        strategy.step(lambda s, b: ({**s, "key": jax.random.wrap_key_data(s["key"])}, {}))(raw, batch_of(16))


@pytest.mark.parametrize("strategy", ["single", "data", "ensemble", "sharded"])
def test_a_state_leaf_that_is_no_array_is_named_with_its_path(strategy):
    # JAX's own TypeError before; under an ensemble's vmap it named no path.
    made = {"single": spmdkit.Single, "data": spmdkit.DataParallel, "ensemble": lambda: spmdkit.Ensemble(2),
            "sharded": lambda: spmdkit.Sharded({"data": 8}, "dp")}[strategy]()
    with pytest.raises(spmdkit.StepOutputError, match=r"(?s)make_state returned str 'run-1' at state\['cfg'\]\['name'\]"
                                                      r".*pytree_node=False"):
        made.init(lambda rng: {"w": jnp.zeros(3), "cfg": {"name": "run-1"}}, 0)
    # a numpy array of strings: JAX's "returned a value of type <class 'numpy.ndarray'> ... not a valid JAX type"
    with pytest.raises(spmdkit.StepOutputError, match=r"make_state returned ndarray array\(\['a', 'b'\].* at state\['names'\]"):
        made.init(lambda rng: {"w": jnp.zeros(3), "names": np.array(["a", "b"])}, 0)
