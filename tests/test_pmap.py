"""spmdkit.pmap, replicate, unreplicate, shard: seed parity, semantics, errors."""

from __future__ import annotations


import re

import jax
import jax.numpy as jnp

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spmdkit
from spmdkit._demo import convolve

N = 8  # conftest.py simulates 8 devices


def test_conftest_gives_eight_devices():
    assert jax.device_count() == N


# ---- seed 000 -------------------------------------------------------------------


def seed000_inputs(n=N):
    w = np.array([2.0, 3.0, 4.0], np.float32)
    xs = np.arange(5 * n, dtype=np.float32).reshape(-1, 5)
    return xs, np.stack([w] * n)


def test_seed000_convolve_equals_vmap():
    xs, ws = seed000_inputs()
    out = spmdkit.pmap(convolve)(xs, ws)
    np.testing.assert_array_equal(out, jax.vmap(convolve)(xs, ws))
    assert out[0].tolist() == [11.0, 20.0, 29.0]
    assert out[-1].tolist() == [326.0, 335.0, 344.0]
    # One row per device, row d on device d.
    assert sorted((s.device.id, s.index[0].start) for s in out.addressable_shards) == [
        (d, d) for d in range(N)
    ]


def test_seed000_nested_call_keeps_data_on_devices():
    xs, ws = seed000_inputs()
    expected = jax.vmap(convolve)(xs, jax.vmap(convolve)(xs, ws))
    inner = spmdkit.pmap(convolve)(xs, ws)
    # Put the inputs where the map keeps its outputs; from then on no transfer of
    # any kind may happen, host<->device or device<->device.
    xs_dev = jax.device_put(xs, inner.sharding)
    ws_dev = jax.device_put(ws, inner.sharding)
    with jax.transfer_guard("disallow"):
        nested = spmdkit.pmap(convolve)(xs_dev, spmdkit.pmap(convolve)(xs_dev, ws_dev))
        nested.block_until_ready()
    np.testing.assert_array_equal(nested, expected)


# ---- seed 001 -------------------------------------------------------------------


def test_seed001_f_on_four_devices_keeps_device_axis():
    def f(x):
        return x**2 + jnp.sin(x)

    x = jnp.arange(8.0).reshape(4, 2)
    out = spmdkit.pmap(f)(x)
    assert out.shape == (4, 2)
    assert len(out.sharding.device_set) == 4
    np.testing.assert_allclose(out, f(x), rtol=1e-6)


def test_seed001_square_on_four_devices():
    x = jnp.arange(4 * 4.0).reshape(4, 4)
    out = spmdkit.pmap(lambda v: v**2)(x)
    assert out.shape == (4, 4)
    np.testing.assert_array_equal(out, x**2)


def test_seed001_train_step_with_pmean_matches_single_device():
    """Seed 001's step with in_axes=(None, 0, 0) and a pmean of the gradient."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 3), dtype=np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32)
    params = jnp.zeros(3)

    def loss(p, bx, by):
        return jnp.mean((bx @ p - by) ** 2)

    def train_step(p, bx, by):
        l, g = jax.value_and_grad(loss)(p, bx, by)
        g = jax.lax.pmean(g, "batch")
        return p - 0.01 * g, jax.lax.pmean(l, "batch")

    step = spmdkit.pmap(train_step, axis_name="batch", in_axes=(None, 0, 0))
    new, losses = step(params, x.reshape(4, 8, 3), y.reshape(4, 8))
    ref_l, ref_g = jax.value_and_grad(loss)(params, x, y)
    # Every device holds the same, correctly averaged update: not N times too large.
    for d in range(4):
        np.testing.assert_allclose(new[d], params - 0.01 * ref_g, rtol=1e-5)
    np.testing.assert_allclose(losses, np.full(4, ref_l), rtol=1e-5)


def test_grad_of_broadcast_argument_is_per_device_like_jax_pmap():
    def step(p, x):
        return jax.grad(lambda q: jnp.sum(q * x))(p)

    p, x = jnp.ones(3), jnp.arange(24.0).reshape(8, 3)
    ours = spmdkit.pmap(step, "i", in_axes=(None, 0))(p, x)
    np.testing.assert_array_equal(ours, jax.pmap(step, "i", in_axes=(None, 0))(p, x))
    np.testing.assert_array_equal(ours, x)


# ---- semantics -----------------------------------------------------------------


def test_collectives():
    x = jnp.arange(1.0, N + 1)

    def f(v):
        return (
            jax.lax.psum(v, "i"),
            jax.lax.pmean(v, "i"),
            jax.lax.all_gather(v, "i"),
            jax.lax.axis_index("i"),
        )

    s, m, g, idx = spmdkit.pmap(f, axis_name="i")(x)
    np.testing.assert_allclose(s, np.full(N, x.sum()))
    np.testing.assert_allclose(m, np.full(N, x.mean()))
    np.testing.assert_array_equal(g, np.tile(x, (N, 1)))
    np.testing.assert_array_equal(idx, np.arange(N))


def test_fewer_than_all_devices_uses_that_many():
    out = spmdkit.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(jnp.ones(3))
    np.testing.assert_array_equal(out, [3.0, 3.0, 3.0])
    assert {d.id for d in out.sharding.device_set} == {0, 1, 2}


def test_pytrees_broadcast_and_kwargs():
    def f(tree, scale, *, shift):
        return {"y": tree["a"] * scale + tree["b"][0] + shift}

    tree = {"a": jnp.ones((4, 2)), "b": (jnp.arange(4.0),)}
    out = spmdkit.pmap(f, in_axes=({"a": 0, "b": (0,)}, None))(
        tree, jnp.float32(3.0), shift=jnp.full((4,), 10.0)
    )
    expected = 3.0 + np.arange(4.0)[:, None] + 10.0 + np.zeros((4, 2))
    np.testing.assert_array_equal(out["y"], expected)


def test_in_axes_and_out_axes_positions():
    x = jnp.arange(2 * 4 * 3.0).reshape(2, 4, 3)  # mapped axis 1, size 4
    out = spmdkit.pmap(lambda v: v * 2, in_axes=1, out_axes=1)(x)
    np.testing.assert_array_equal(out, x * 2)
    moved = spmdkit.pmap(lambda v: v * 2, in_axes=1, out_axes=0)(x)
    np.testing.assert_array_equal(moved, np.moveaxis(np.asarray(x) * 2, 1, 0))


def test_out_axes_none_returns_one_copy():
    total, per = spmdkit.pmap(
        lambda v: (jax.lax.psum(v, "i"), v), axis_name="i", out_axes=(None, 0)
    )(jnp.arange(4.0))
    assert total.shape == () and float(total) == 6.0
    np.testing.assert_array_equal(per, np.arange(4.0))


def test_vmap_outside_and_inside():
    xs = jnp.arange(3 * N * 2.0).reshape(3, N, 2)
    outer = jax.vmap(spmdkit.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i"))(xs)
    np.testing.assert_allclose(outer, np.broadcast_to(np.asarray(xs).sum(1, keepdims=True), xs.shape))
    inner = spmdkit.pmap(jax.vmap(lambda v: v.sum()))(xs.transpose(1, 0, 2))
    np.testing.assert_array_equal(inner, np.asarray(xs).sum(-1).T)


def test_inside_jit():
    f = jax.jit(lambda v: spmdkit.pmap(lambda u: u + 1)(v) * 2)
    np.testing.assert_array_equal(f(jnp.zeros((N, 2))), np.full((N, 2), 2.0))


def test_compiled_once_per_signature():
    traces = []

    def f(v):
        traces.append(v.shape)
        return v + 1

    pf = spmdkit.pmap(f)
    pf(jnp.zeros((N, 3)))
    pf(jnp.ones((N, 3)))
    pf(np.ones((N, 3), np.float32))
    assert traces == [(3,)]
    pf(jnp.zeros((N, 5)))
    assert traces == [(3,), (5,)]
    # The seeds write spmdkit.pmap(f)(x) inline: a new call site reuses the code too.
    spmdkit.pmap(f)(jnp.zeros((N, 3)))
    assert traces == [(3,), (5,)]


def test_static_broadcasted_argnums():
    traces = []

    def f(x, lr):
        traces.append(lr)
        return x * lr

    pf = spmdkit.pmap(f, static_broadcasted_argnums=(1,))
    np.testing.assert_array_equal(pf(jnp.ones(4), 3.0), np.full(4, 3.0))
    np.testing.assert_array_equal(pf(jnp.ones(4), 2.0), np.full(4, 2.0))
    pf(jnp.ones(4), 2.0)
    np.testing.assert_array_equal(pf(jnp.ones(4), 3.0), np.full(4, 3.0))  # each value's repeat path
    assert traces == [3.0, 2.0]
    with pytest.raises(spmdkit.MappedAxisError, match="not hashable"):
        pf(jnp.ones(4), [2.0])
    with pytest.raises(spmdkit.MappedAxisError, match="called with 1 positional"):
        pf(jnp.ones(4))
    with pytest.raises(spmdkit.MappedAxisError, match="size 16 along mapped axis 0"):
        pf(jnp.ones(16), 2.0)


def test_static_argument_keyed_with_its_type():
    # 1, 1.0 and True are == and hash alike but trace to different programs (as in jax.pmap).
    x = np.arange(N, dtype=np.int32)
    p = spmdkit.pmap(lambda x, s: x * jnp.asarray(s), static_broadcasted_argnums=1)
    assert p(x, 2).dtype == jnp.int32
    assert p(x, 2.0).dtype == jnp.float32
    assert p(x, 2.0).dtype == jnp.float32  # the repeat-call path too
    assert p(x, 2).dtype == jnp.int32
    q = spmdkit.pmap(lambda x, flag: x - 100 if flag is True else x + 1, static_broadcasted_argnums=1)
    np.testing.assert_array_equal(q(x, 1), x + 1)
    np.testing.assert_array_equal(q(x, True), x - 100)
    np.testing.assert_array_equal(q(x, True), x - 100)
    np.testing.assert_array_equal(q(x, 1), x + 1)
    lowered = q.lower(x, 1).compile()
    with pytest.raises(spmdkit.SignatureError, match="differ from the ones this was lowered"):
        lowered(x, True)


@pytest.mark.parametrize("value,what", [(np.array(["a"] * N), "numpy dtype <U1"), ("abc", "is a str")])
def test_an_argument_jax_cannot_hold_is_named_by_its_argument(value, what):
    p = spmdkit.pmap(lambda x, y: x, in_axes=(0, 0 if np.ndim(value) else None))
    with pytest.raises(spmdkit.MappedAxisError) as e:
        p(np.ones(N), value)
    msg = str(e.value)
    assert msg.startswith("args[1] ") and what in msg and "flat[" not in msg
    assert isinstance(e.value, TypeError)


def test_too_few_devices_given_with_devices_says_to_pass_more():
    p = spmdkit.pmap(lambda x: x + 1, devices=jax.devices()[4:])
    with pytest.raises(spmdkit.MappedAxisError) as e:
        p(np.ones((N, 2)))
    msg = str(e.value)
    assert "size 8 along mapped axis 0, but 4 device(s) were given with devices=" in msg
    assert "pass as many devices as the mapped size in devices=" in msg and "smaller leading axis" in msg
    assert "use_host_devices" not in msg  # 8 devices exist: simulating more is not the fix
    np.testing.assert_array_equal(p(np.ones((4, 2))), np.full((4, 2), 2.0))


# ---- property: spmdkit.pmap == jax.vmap ----------------------------------------

FUNCTIONS = {
    "affine": lambda x, y: 2.0 * x + y,
    "psum": lambda x, y: x - jax.lax.psum(x, "i") + y,
    "pmean": lambda x, y: jax.lax.pmean(x * y, "i"),
    "all_gather_sum": lambda x, y: jax.lax.all_gather(x, "i").sum(0) + y,
    "axis_index": lambda x, y: x * jax.lax.axis_index("i") + y,
}


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.sampled_from([1, 2, 4, 8]),
    rest=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    x_axis=st.integers(0, 2),
    y_mapped=st.booleans(),
    name=st.sampled_from(sorted(FUNCTIONS)),
    seed=st.integers(0, 2**16),
)
def test_property_pmap_equals_vmap(n, rest, x_axis, y_mapped, name, seed):
    x_axis = min(x_axis, len(rest))
    x_shape = list(rest)
    x_shape.insert(x_axis, n)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    y = rng.standard_normal((n, *rest) if y_mapped else tuple(rest)).astype(np.float32)
    in_axes = (x_axis, 0 if y_mapped else None)
    f = FUNCTIONS[name]
    ours = spmdkit.pmap(f, axis_name="i", in_axes=in_axes)(x, y)
    ref = jax.vmap(f, in_axes=in_axes, axis_name="i")(x, y)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    if name == "psum":  # psum is the sum over the mapped axis
        xs = np.moveaxis(x, x_axis, 0)
        np.testing.assert_allclose(
            ours, xs - xs.sum(0, keepdims=True) + (y if y_mapped else y[None]), rtol=1e-4, atol=1e-4
        )


# ---- errors, all raised before f is traced ------------------------------------


@pytest.fixture
def traced():
    calls = []

    def f(*args, **kwargs):
        calls.append(1)
        return args[0]

    f.calls = calls
    return f


def test_error_mapped_size_above_device_count(traced):
    with pytest.raises(spmdkit.MappedAxisError) as e:
        spmdkit.pmap(traced)(np.ones((16, 3)))
    msg = str(e.value)
    assert "args[0] has size 16 along mapped axis 0" in msg
    assert "8 local device(s)" in msg
    assert "spmdkit.shard" in msg and "use_host_devices(16)" in msg
    # It offered "env: SPMDKIT_HOST_DEVICES=16" to anyone; a plain script never reads it.
    assert "the spmdkit command: --host-devices 16 or SPMDKIT_HOST_DEVICES=16, which a plain Python script does not read" in msg
    assert traced.calls == []
    # The fix's code, run as written: it said "with spmdkit.shard(x)", whose result is a
    # (data, mask) pair, so pmap(f)(spmdkit.shard(x)) handed f a pair, not x's rows.
    scope = {"spmdkit": spmdkit, "x": np.arange(48.0).reshape(16, 3)}
    exec(re.search(r"(x, mask = spmdkit\.shard\(x\))", msg).group(1), scope)
    out = spmdkit.pmap(lambda rows: rows.sum(0))(scope["x"])
    np.testing.assert_array_equal(np.asarray(out).sum(0), np.arange(48.0).reshape(16, 3).sum(0))


def test_error_mapped_sizes_differ(traced):
    with pytest.raises(spmdkit.MappedAxisError) as e:
        spmdkit.pmap(traced)({"a": np.ones((4, 2))}, np.ones((2, 3, 4)))
    msg = str(e.value)
    assert "args[0]['a'] has 4 along axis 0" in msg and "args[1] has 2 along axis 0" in msg
    assert "in_axes=None" in msg
    assert traced.calls == []


def test_error_in_axes_tree_mismatch(traced):
    with pytest.raises(spmdkit.TreeMismatchError) as e:
        spmdkit.pmap(traced, in_axes=({"w": 0, "b": None},))({"w": np.ones(4), "c": np.ones(4)})
    msg = str(e.value)
    assert "at args[0]" in msg and "['b']" in msg and "['c']" in msg
    assert "prefix" in msg
    assert traced.calls == []


def test_error_in_axes_length(traced):
    with pytest.raises(spmdkit.MappedAxisError, match="in_axes has 3 entries but .* 2 positional"):
        spmdkit.pmap(traced, in_axes=(0, 0, None))(np.ones(4), np.ones(4))
    assert traced.calls == []


def test_error_nothing_to_map(traced):
    with pytest.raises(spmdkit.MappedAxisError, match="args\\[0\\] is float with no axes"):
        spmdkit.pmap(traced)(1.0)
    with pytest.raises(spmdkit.MappedAxisError, match="no axis 2 to map"):
        spmdkit.pmap(traced, in_axes=2)(np.ones((4, 4)))
    with pytest.raises(spmdkit.MappedAxisError, match="no argument has a mapped axis"):
        spmdkit.pmap(traced, in_axes=None)(np.ones(4))
    assert traced.calls == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"in_axes": -1}, "in_axes is -1; like jax.pmap"),
        ({"in_axes": (0, "x")}, r"in_axes\[1\] is 'x'"),
        ({"out_axes": {"a": 1.5}}, r"out_axes\['a'\] is 1.5"),
        ({"static_broadcasted_argnums": (-1,)}, "non-negative ints"),
    ],
)
def test_error_bad_axes_at_creation(traced, kwargs, match):
    with pytest.raises(spmdkit.MappedAxisError, match=match):
        spmdkit.pmap(traced, **kwargs)


def test_error_unknown_axis_name():
    with pytest.raises(spmdkit.AxisNameError) as e:
        spmdkit.pmap(lambda v: jax.lax.psum(v, "j"), axis_name="i")(jnp.ones(4))
    assert "names axis 'j'" in str(e.value) and "axis_name='i'" in str(e.value)
    with pytest.raises(spmdkit.AxisNameError, match="without an axis_name") as e:
        spmdkit.pmap(lambda v: jax.lax.pmean(v, "batch"))(jnp.ones(4))
    assert "spmdkit.pmap(f, axis_name='batch')" in str(e.value)
    for kwargs in ({}, {"axis_name": "i"}):  # None as the name: the fix was "axis_name='None'"
        with pytest.raises(spmdkit.AxisNameError, match="was given None as its axis name") as e:
            spmdkit.pmap(lambda v: jax.lax.pmean(v, None), **kwargs)(jnp.ones(4))
        assert "'None'" not in str(e.value) and "jax.lax.pmean(x, 'i')" in str(e.value)


def test_error_out_axes_mismatch():
    with pytest.raises(spmdkit.TreeMismatchError, match=r"out_axes does not match output at output"):
        spmdkit.pmap(lambda v: v, out_axes=(0, 0))(jnp.ones(4))


def test_errors_are_spmdkit_errors():
    assert issubclass(spmdkit.MappedAxisError, spmdkit.SpmdkitError)
    assert issubclass(spmdkit.AxisNameError, NameError)


# ---- replicate / unreplicate / shard -----------------------------------------


def test_replicate_unreplicate_round_trip():
    tree = {"w": np.arange(6.0).reshape(2, 3), "b": np.float32(1.5)}
    rep = spmdkit.replicate(tree)
    assert rep["w"].shape == (N, 2, 3) and rep["b"].shape == (N,)
    assert {s.device.id for s in rep["w"].addressable_shards} == set(range(N))
    for s in rep["w"].addressable_shards:
        np.testing.assert_array_equal(s.data[0], tree["w"])
    back = spmdkit.unreplicate(rep)
    np.testing.assert_array_equal(back["w"], tree["w"])
    assert float(back["b"]) == 1.5
    assert spmdkit.replicate(tree, n_devices=2)["w"].shape == (2, 2, 3)
    with pytest.raises(spmdkit.MappedAxisError, match="n_devices=9"):
        spmdkit.replicate(tree, n_devices=9)


def test_unreplicate_refuses_what_is_not_stacked_copies():
    # The pmap habit params = unreplicate(state) on a DataParallel state took each leaf's
    # first row, silently.
    state = spmdkit.DataParallel().init(lambda rng: {"w": jnp.arange(6.0).reshape(3, 2)}, 0)
    with pytest.raises(spmdkit.MappedAxisError, match=r"(?s)tree\['w'\] \(shape \(3, 2\)\) is one array held "
                                                       r"whole on \d+ devices.*Fix: use it as it is"):
        spmdkit.unreplicate(state)
    with pytest.raises(spmdkit.MappedAxisError, match=r"tree\['b'\] is a scalar"):
        spmdkit.unreplicate({"b": np.float32(1.5)})


def test_replicated_params_feed_pmap():
    params = spmdkit.replicate({"w": np.array([2.0, 3.0, 4.0], np.float32)})
    xs, _ = seed000_inputs()
    out = spmdkit.pmap(lambda x, p: convolve(x, p["w"]))(xs, params)
    assert out[0].tolist() == [11.0, 20.0, 29.0]


def test_shard_even_and_padded():
    data, mask = spmdkit.shard({"x": np.arange(16.0), "y": np.ones((16, 2))})
    assert data["x"].shape == (N, 2) and data["y"].shape == (N, 2, 2) and mask.all()
    data, mask = spmdkit.shard(np.arange(13.0), n_devices=4)
    assert data.shape == (4, 4)
    assert mask.sum() == 13 and not mask[-1, 1:].any()
    np.testing.assert_array_equal(data[mask], np.arange(13.0))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_shard_splits_a_key_per_example(impl):
    # A batch with a typed key per example (a dropout key each) was a bare TypeError from NumPy.
    keys = jax.random.split(jax.random.key(0, impl=impl), 13)
    data, mask = spmdkit.shard({"key": keys, "x": np.arange(13.0)}, n_devices=4)
    assert data["key"].shape == (4, 4) and jax.random.key_impl(data["key"]) == jax.random.key_impl(keys)
    np.testing.assert_array_equal(jax.random.key_data(data["key"][mask]), jax.random.key_data(keys))
    if impl == "threefry2x32":  # rbg's draws under vmap depend on the batch's shape (JAX's, not shard's)
        draws = spmdkit.pmap(jax.vmap(lambda k: jax.random.uniform(k)))(data["key"])
        np.testing.assert_array_equal(np.asarray(draws)[mask], jax.vmap(jax.random.uniform)(keys))


def test_shard_mask_gives_exact_mean_on_devices():
    values = np.random.default_rng(1).standard_normal(13).astype(np.float32)
    data, mask = spmdkit.shard(values, n_devices=4)

    def masked_mean(v, m):
        return jax.lax.psum(jnp.sum(v * m), "i") / jax.lax.psum(jnp.sum(m), "i")

    out = spmdkit.pmap(masked_mean, axis_name="i")(data, mask.astype(np.float32))
    np.testing.assert_allclose(out, np.full(4, values.mean()), rtol=1e-6)


def test_shard_errors():
    with pytest.raises(spmdkit.BatchSizeError) as e:
        spmdkit.shard(np.arange(13.0), n_devices=4, pad=False)
    assert "13 examples" in str(e.value) and "4 devices" in str(e.value)
    assert "12 or 16" in str(e.value)
    with pytest.raises(spmdkit.BatchSizeError, match=r"batch\['x'\] has 4, batch\['y'\] has 5"):
        spmdkit.shard({"x": np.ones(4), "y": np.ones(5)})
    with pytest.raises(spmdkit.BatchSizeError, match="is a scalar"):
        spmdkit.shard({"x": np.float32(1.0)})
    with pytest.raises(spmdkit.BatchSizeError, match="0 examples"):
        spmdkit.shard(np.ones((0, 3)))




@pytest.mark.parametrize("layout", ["one device", "2x4 mesh", "replicated"])
def test_arrays_committed_elsewhere_are_moved(layout):
    """jit refuses an argument committed to another layout; pmap semantics move it."""
    xs, ws = seed000_inputs()
    if layout == "one device":
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    else:
        mesh = spmdkit.make_mesh(x=2, y=4)
        spec = jax.P("x") if layout == "2x4 mesh" else jax.P()
        sharding = jax.NamedSharding(mesh, spec)
    out = spmdkit.pmap(convolve)(jax.device_put(xs, sharding), ws)
    np.testing.assert_array_equal(out, jax.vmap(convolve)(xs, ws))


def test_repeat_calls_keep_every_check(monkeypatch):
    """A structure seen before skips re-validation; changed sizes and kinds are still caught."""
    pf = spmdkit.pmap(lambda a, b: a + b, axis_name="i")
    validated = []
    prepare = type(pf)._prepare
    monkeypatch.setattr(type(pf), "_prepare", lambda self, *a: validated.append(1) or prepare(self, *a))
    x = np.ones((N, 3), np.float32)
    for _ in range(3):  # the later calls take the repeat path
        np.testing.assert_array_equal(pf(x, x), 2 * x)
    assert validated == [1]
    with pytest.raises(spmdkit.MappedAxisError, match="args\\[0\\] has 8 along axis 0.*args\\[1\\] has 4"):
        pf(x, x[:4])
    with pytest.raises(spmdkit.MappedAxisError, match="args\\[1\\] is float with no axes"):
        pf(x, 1.0)
    with pytest.raises(spmdkit.MappedAxisError, match="args\\[1\\] is an array of shape \\(\\)"):
        pf(x, np.float32(1.0))
    with pytest.raises(spmdkit.MappedAxisError, match="size 16 along mapped axis 0"):
        pf(np.ones((16, 3)), np.ones((16, 3)))
    # A new size is validated and compiled once, then it too takes the repeat path.
    np.testing.assert_array_equal(pf(x[:4], x[:4]), 2 * x[:4])
    np.testing.assert_array_equal(pf(x[:4], x[:4]), 2 * x[:4])
    np.testing.assert_array_equal(pf(x, x), 2 * x)
    # out_axes=None is checked on every call, not only the first of a structure.
    pick = spmdkit.pmap(lambda v, k: v * k, axis_name="i", out_axes=None)
    same, varying = np.ones((N, 2), np.float32), np.arange(2.0 * N, dtype=np.float32).reshape(N, 2)
    for _ in range(2):
        np.testing.assert_array_equal(pick(same, same), np.ones(2))
    with pytest.raises(spmdkit.ReplicationError, match="out_axes=None at output"):
        pick(varying, same)
    # An argument moved to another layout between calls is still moved back.
    out = pf(x, x)
    elsewhere = jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[3]))
    np.testing.assert_array_equal(pf(elsewhere, out), 3 * x)
