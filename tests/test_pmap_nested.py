"""Nested spmdkit.pmap: one mesh axis per level, results equal to nested jax.vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spmdkit


def nested(f, *names, **kwargs):
    """spmdkit.pmap(...(spmdkit.pmap(f, names[-1]))..., names[0])."""
    for name in reversed(names):
        f = spmdkit.pmap(f, axis_name=name, **kwargs)
    return f


def vmapped(f, *names):
    for name in reversed(names):
        f = jax.vmap(f, axis_name=name)
    return f


def test_issue_case_sum_over_inner_axis():
    x = jnp.arange(24.0).reshape(2, 4, 3)
    out = nested(lambda v: jax.lax.psum(v, "b"), "a", "b")(x)
    assert out[0, 0].tolist() == [18.0, 22.0, 26.0]
    assert out[1, 3].tolist() == [66.0, 70.0, 74.0]


COLLECTIVES = {
    "psum b": lambda v: jax.lax.psum(v, "b"),
    "psum a": lambda v: jax.lax.psum(v, "a"),
    "psum ab": lambda v: jax.lax.psum(v, ("a", "b")),
    "pmean ab": lambda v: jax.lax.pmean(v, ("a", "b")),
    "all_gather b": lambda v: jax.lax.all_gather(v, "b"),
    "all_gather a": lambda v: jax.lax.all_gather(v, "a"),
    "axis_index": lambda v: v * jax.lax.axis_index("a") + jax.lax.axis_index("b"),
    "pmax a": lambda v: jax.lax.pmax(v, "a"),
}


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8), (8, 1), (2, 2)])
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_nested_equals_vmap_of_vmap(shape, name):
    x = np.random.default_rng(0).standard_normal((*shape, 3)).astype(np.float32)
    f = COLLECTIVES[name]
    out = nested(f, "a", "b")(x)
    np.testing.assert_allclose(out, vmapped(f, "a", "b")(x), rtol=1e-5, atol=1e-5)


def test_outputs_stay_sharded_over_both_axes_and_feed_the_next_map():
    x = jnp.arange(24.0).reshape(2, 4, 3)
    step = nested(lambda v: v / jax.lax.psum(v, ("a", "b")), "a", "b")
    out = step(x)
    assert out.sharding.spec == jax.P("a", "b")
    assert len(out.sharding.device_set) == 8
    with jax.transfer_guard("disallow"):
        again = step(out)
        again.block_until_ready()
    np.testing.assert_allclose(again, vmapped(lambda v: v / jax.lax.psum(v, ("a", "b")), "a", "b")(out), rtol=1e-6)


def test_outer_function_works_around_the_inner_map():
    """Work and collectives over "a" outside the inner map, in_axes/out_axes inside."""
    inner = spmdkit.pmap(
        lambda v, s: jax.lax.psum(v * s, "b"), axis_name="b", in_axes=(1, None), out_axes=1
    )

    def outer(v):  # v: [3, 4]
        scale = jax.lax.psum(jnp.float32(1.0), "a")
        return inner(v, scale) + jax.lax.pmean(v, "a")

    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    ref_inner = jax.vmap(lambda v, s: jax.lax.psum(v * s, "b"), (1, None), 1, axis_name="b")

    def ref_outer(v):
        return ref_inner(v, jax.lax.psum(jnp.float32(1.0), "a")) + jax.lax.pmean(v, "a")

    out = spmdkit.pmap(outer, axis_name="a")(x)
    np.testing.assert_allclose(out, jax.vmap(ref_outer, axis_name="a")(x), rtol=1e-5)


def test_three_levels():
    def f(v):
        return jax.lax.psum(v, ("a", "c")) * (1 + jax.lax.axis_index("b"))

    x = np.arange(2 * 2 * 2 * 3, dtype=np.float32).reshape(2, 2, 2, 3)
    out = nested(f, "a", "b", "c")(x)
    np.testing.assert_array_equal(out, vmapped(f, "a", "b", "c")(x))
    assert out.sharding.spec == jax.P("a", "b", "c")


def test_anonymous_levels_and_gradients():
    x = np.arange(8.0, dtype=np.float32).reshape(2, 4)
    out = spmdkit.pmap(spmdkit.pmap(lambda v: v * 2))(x)
    np.testing.assert_array_equal(out, x * 2)

    def loss(w, v):
        return jax.lax.psum(jnp.sum((w * v) ** 2), ("a", "b"))

    grads = nested(lambda v: jax.grad(loss)(jnp.float32(1.5), v), "a", "b")(x)
    np.testing.assert_allclose(grads, vmapped(lambda v: jax.grad(loss)(jnp.float32(1.5), v), "a", "b")(x))


def test_nested_inside_jit():
    x = jnp.arange(24.0).reshape(2, 4, 3)
    f = jax.jit(lambda v: nested(lambda u: jax.lax.psum(u, "b"), "a", "b")(v) + 1)
    np.testing.assert_array_equal(f(x), vmapped(lambda u: jax.lax.psum(u, "b"), "a", "b")(x) + 1)


def test_error_nested_needs_more_devices():
    with pytest.raises(spmdkit.MappedAxisError) as e:
        nested(lambda v: v, "a", "b")(np.ones((4, 4, 1)))
    msg = str(e.value)
    assert "4 x 4" in msg and "16 devices" in msg and "8 are available" in msg
    assert isinstance(e.value, ValueError)


def test_error_same_axis_name_twice():
    with pytest.raises(spmdkit.AxisNameError, match="axis_name='a', which an enclosing"):
        nested(lambda v: v, "a", "a")(np.ones((2, 4)))


def test_error_unknown_name_lists_every_bound_level():
    with pytest.raises(spmdkit.AxisNameError) as e:
        nested(lambda v: jax.lax.psum(v, "z"), "a", "b")(np.ones((2, 4)))
    assert "names axis 'z'" in str(e.value) and "('a', 'b')" in str(e.value)


def test_error_inner_maps_of_different_sizes():
    inner2 = spmdkit.pmap(lambda v: v, axis_name="b")

    def outer(v, w):
        return inner2(v), inner2(w)

    with pytest.raises(spmdkit.MappedAxisError, match="size 4 and axis_name='b' of size 2"):
        spmdkit.pmap(outer, axis_name="a")(np.ones((2, 4)), np.ones((2, 2)))


def test_error_devices_on_an_inner_map():
    inner = spmdkit.pmap(lambda v: v, axis_name="b", devices=jax.devices()[:4])
    with pytest.raises(spmdkit.MappedAxisError, match="outermost map owns the devices"):
        spmdkit.pmap(inner, axis_name="a")(np.ones((2, 4)))


def test_inner_out_axes_none_is_checked():
    inner_ok = spmdkit.pmap(lambda v: jax.lax.psum(v, "b"), "b", out_axes=None)
    out = spmdkit.pmap(inner_ok, "a")(np.arange(8.0).reshape(2, 4))
    np.testing.assert_array_equal(out, [6.0, 22.0])
    inner_bad = spmdkit.pmap(lambda v: v * 2, "b", out_axes=None)
    with pytest.raises(spmdkit.ReplicationError, match="axis_name='b'"):
        spmdkit.pmap(inner_bad, "a")(np.arange(8.0).reshape(2, 4))


def test_grad_and_vmap_around_nested_maps_and_out_axes():
    x = jnp.arange(24.0).reshape(2, 4, 3)

    def f(v):
        return jnp.sin(v) * jax.lax.psum(v, ("a", "b"))

    ours, ref = nested(f, "a", "b"), vmapped(f, "a", "b")
    np.testing.assert_allclose(
        jax.grad(lambda v: ours(v).sum())(x), jax.grad(lambda v: ref(v).sum())(x), rtol=1e-5
    )
    xs = jnp.stack([x, x + 1])
    np.testing.assert_allclose(jax.vmap(ours)(xs), jax.vmap(ref)(xs), rtol=1e-5)
    moved = spmdkit.pmap(spmdkit.pmap(f, "b", out_axes=1), "a", out_axes=1)(x)
    ref_moved = jax.vmap(jax.vmap(f, axis_name="b", out_axes=1), axis_name="a", out_axes=1)(x)
    np.testing.assert_allclose(moved, ref_moved, rtol=1e-5)
    assert moved.sharding.spec == jax.P(None, "a", "b")

INNER = {
    "psum ab - x": lambda x, y: jax.lax.psum(x, ("a", "b")) - x + y,
    "pmean b * y": lambda x, y: jax.lax.pmean(x, "b") * y,
    "all_gather a": lambda x, y: jax.lax.all_gather(x, "a").sum(0) + y,
    "axis_index": lambda x, y: x * jax.lax.axis_index("b") + jax.lax.axis_index("a") + y,
}


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from([(2, 4), (4, 2), (2, 2), (2, 3), (1, 8)]),
    x_axis=st.integers(0, 1),
    y_mapped=st.booleans(),
    out_axis=st.integers(0, 1),
    name=st.sampled_from(sorted(INNER)),
)
def test_property_nested_equals_vmap_of_vmap(shape, x_axis, y_mapped, out_axis, name):
    """Inner in_axes/out_axes vary; the outer maps the leading axis."""
    a, b = shape
    rng = np.random.default_rng(a * 10 + b)
    inner_x = [2, 2]
    inner_x.insert(x_axis, b)  # x per outer slice: b at x_axis
    x = rng.standard_normal((a, *inner_x)).astype(np.float32)
    y = rng.standard_normal((a, b, 2, 2) if y_mapped else (a, 2, 2)).astype(np.float32)
    in_axes = (x_axis, 0 if y_mapped else None)
    f = INNER[name]
    ours = spmdkit.pmap(
        spmdkit.pmap(f, "b", in_axes=in_axes, out_axes=out_axis), "a"
    )(x, y)
    ref = jax.vmap(jax.vmap(f, in_axes=in_axes, out_axes=out_axis, axis_name="b"), axis_name="a")(x, y)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_outer_out_axes_none_is_checked_on_the_first_call():
    x = np.arange(8.0).reshape(2, 4)
    bad = spmdkit.pmap(spmdkit.pmap(lambda v: v, "b"), "a", out_axes=None)
    for _ in range(2):  # the first call discovers the nesting; both must check
        with pytest.raises(spmdkit.ReplicationError, match="out_axes=None at output"):
            bad(x)
    good = spmdkit.pmap(spmdkit.pmap(lambda v: jax.lax.psum(v, "a"), "b"), "a", out_axes=None)
    np.testing.assert_array_equal(good(x), x.sum(0))


def test_repeat_calls_follow_shape_changes():
    """Repeat calls skip validation; a new inner size (same outer size) builds a new mesh."""
    f = nested(lambda v: jax.lax.psum(v, ("a", "b")), "a", "b")
    ref = vmapped(lambda v: jax.lax.psum(v, ("a", "b")), "a", "b")
    for shape in [(2, 4, 3), (2, 4, 3), (2, 2, 3), (2, 2, 3), (4, 2, 3), (2, 4, 3), (2, 4, 5)]:
        x = jnp.arange(float(np.prod(shape))).reshape(shape)
        out = f(x)
        np.testing.assert_allclose(out, ref(x), err_msg=str(shape))
        assert out.sharding.mesh.devices.shape == shape[:2]
    with pytest.raises(spmdkit.MappedAxisError, match="need 4 x 4"):
        f(jnp.ones((4, 4, 3)))
    np.testing.assert_allclose(f(x), ref(x))
