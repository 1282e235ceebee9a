"""spmdkit.pmap's jax.pmap surface: out_axes=None checking, keywords, lower/compile, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdkit

N = 8


# ---- out_axes=None is checked ---------------------------------------------------


def test_out_axes_none_on_a_varying_value_is_an_error():
    with pytest.raises(spmdkit.ReplicationError) as e:
        spmdkit.pmap(lambda a: a * 2, out_axes=None)(np.arange(24.0).reshape(8, 3))
    msg = str(e.value)
    assert "out_axes=None at output" in msg and "8 devices" in msg and "pmean" in msg
    assert isinstance(e.value, ValueError)
    # This map has no axis_name: "pmean over the axis name" named none to reduce over. The fix
    # says how to give it one; applied as written, it returns the one copy.
    assert "spmdkit.pmap(f, axis_name='i', ...), and return jax.lax.pmean(x, 'i')" in msg
    out = spmdkit.pmap(lambda a: jax.lax.pmean(a * 2, "i"), axis_name="i", out_axes=None)(np.arange(24.0).reshape(8, 3))
    np.testing.assert_allclose(np.asarray(out), np.arange(24.0).reshape(8, 3).mean(0) * 2)
    with pytest.raises(spmdkit.ReplicationError, match=r"pmean / psum over 'i'\)"):  # a named map: its name
        spmdkit.pmap(lambda a: a * 2, axis_name="i", out_axes=None)(np.arange(24.0).reshape(8, 3))


def test_out_axes_none_names_the_output_path():
    def f(v):
        return v, {"mean": jax.lax.pmean(v, "i"), "bad": v + 1}

    with pytest.raises(spmdkit.ReplicationError) as e:
        spmdkit.pmap(f, "i", out_axes=(0, None))(np.arange(4.0))
    assert "output[1]['bad']" in str(e.value) and "'mean'" not in str(e.value)


def test_grad_without_pmean_is_caught():
    """pmap semantics: the gradient of a broadcast argument is per device."""

    def step(w, x):
        return jax.grad(lambda q: jnp.sum(q * x))(w)

    x = np.arange(24.0, dtype=np.float32).reshape(8, 3)
    with pytest.raises(spmdkit.ReplicationError):
        spmdkit.pmap(step, "i", in_axes=(None, 0), out_axes=None)(jnp.ones(3), x)
    fixed = spmdkit.pmap(
        lambda w, x: jax.lax.pmean(step(w, x), "i"), "i", in_axes=(None, 0), out_axes=None
    )(jnp.ones(3), x)
    np.testing.assert_allclose(fixed, x.mean(0))


@pytest.mark.parametrize(
    "make",
    [
        lambda v: jax.lax.psum(v, "i"),
        lambda v: jax.lax.psum(v, "i").astype(jnp.int8),
        lambda v: jax.lax.psum(v, "i") > 3,
        lambda v: jax.lax.psum(v, "i") * (1 + 2j),
        lambda v: jnp.float32(jnp.nan) + jax.lax.psum(v, "i"),
        lambda v: jax.random.key(7),
        lambda v: jnp.zeros((0, 3)),
    ],
    ids=["float", "int8", "bool", "complex", "nan", "prng key", "empty"],
)
def test_out_axes_none_accepts_replicated_values_of_every_dtype(make):
    out = spmdkit.pmap(make, "i", out_axes=None)(np.arange(4.0, dtype=np.float32))
    ref = jax.pmap(make, "i", out_axes=None)(np.arange(4.0, dtype=np.float32))
    if jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key):
        out, ref = jax.random.key_data(out), jax.random.key_data(ref)
    np.testing.assert_array_equal(out, ref)


def test_out_axes_none_int_that_differs_is_caught():
    with pytest.raises(spmdkit.ReplicationError):
        spmdkit.pmap(lambda v: jax.lax.axis_index("i"), "i", out_axes=None)(np.ones(4))


# ---- devices=, backend=, axis_size=, donate_argnums= ----------------------------


@pytest.mark.parametrize("size", [4, 3])
def test_devices_like_jax_pmap(size):
    devices = jax.devices()[2:6]
    x = np.arange(size * 2.0).reshape(size, 2)
    ours = spmdkit.pmap(lambda v: jax.lax.psum(v, "i"), "i", devices=devices)(x)
    ref = jax.pmap(lambda v: jax.lax.psum(v, "i"), "i", devices=devices)(x)
    np.testing.assert_array_equal(ours, ref)
    assert ours.sharding.device_set == ref.sharding.device_set == set(devices[:size])


def test_devices_fewer_than_mapped_size_is_an_error():
    with pytest.raises(spmdkit.MappedAxisError, match="4 device\\(s\\) were given with devices="):
        spmdkit.pmap(lambda v: v, devices=jax.devices()[:4])(np.ones((6, 2)))


def test_backend_and_axis_size():
    out = spmdkit.pmap(lambda v: v + 1, backend="cpu", axis_size=4)(np.zeros((4, 2)))
    np.testing.assert_array_equal(out, np.ones((4, 2)))
    with pytest.raises(spmdkit.MappedAxisError, match="axis_size=4, but args\\[0\\] has size 3"):
        spmdkit.pmap(lambda v: v, axis_size=4)(np.ones((3, 2)))


def test_donate_argnums_like_jax_pmap():
    for impl in (jax.pmap, spmdkit.pmap):
        x = impl(lambda v: v)(np.ones((N, 2)))
        kept = impl(lambda v: v)(np.ones((N, 2)))
        out = impl(lambda a, b: a + b, donate_argnums=0)(x, kept)
        np.testing.assert_array_equal(out, np.full((N, 2), 2.0))
        assert x.is_deleted() and not kept.is_deleted()
    with pytest.raises(spmdkit.MappedAxisError, match="both static and donated"):
        spmdkit.pmap(lambda a: a, static_broadcasted_argnums=0, donate_argnums=0)


def test_keywords_match_jax_pmap_signature():
    import inspect

    ours = inspect.signature(spmdkit.pmap).parameters
    theirs = inspect.signature(jax.pmap).parameters
    assert set(theirs) - {"fun"} <= set(ours)


# ---- lower / compile ------------------------------------------------------------


def test_lower_and_compile():
    f = spmdkit.pmap(lambda a, b: jax.lax.psum(a @ b, "i"), "i", in_axes=(0, None))
    a, b = np.ones((N, 4, 4), np.float32), np.ones((4, 4), np.float32)
    lowered = f.lower(a, b)
    assert "all_reduce" in lowered.as_text() or "all-reduce" in lowered.as_text()
    assert lowered.compiler_ir() is not None
    lowered.cost_analysis()  # available before compiling, as in jax
    compiled = lowered.compile()
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    assert costs["flops"] > 0
    assert "all-reduce" in compiled.as_text()
    np.testing.assert_array_equal(compiled(a, b), f(a, b))
    with_options = lowered.compile(compiler_options={"xla_cpu_enable_fast_math": False})
    np.testing.assert_array_equal(with_options(a, b), f(a, b))


def test_compiled_rejects_another_signature():
    compiled = spmdkit.pmap(lambda x: {"y": x["w"] * 2}).lower({"w": np.ones((N, 3), np.float32)}).compile()
    with pytest.raises(spmdkit.SignatureError, match=r"args\[0\]\['w'\] has shape \(8, 4\)") as e:
        compiled({"w": np.ones((N, 4), np.float32)})
    assert isinstance(e.value, TypeError)
    with pytest.raises(spmdkit.SignatureError, match="dtype int32"):
        compiled({"w": np.ones((N, 3), np.int32)})
    with pytest.raises(spmdkit.SignatureError, match="structure"):
        compiled({"v": np.ones((N, 3), np.float32)})


def test_lower_nested_and_out_axes_none():
    f = spmdkit.pmap(spmdkit.pmap(lambda v: jax.lax.psum(v, ("a", "b")), "b"), "a", out_axes=None)
    x = np.ones((2, 4, 3), np.float32)
    compiled = f.lower(x).compile()
    np.testing.assert_array_equal(compiled(x), np.full((4, 3), 8.0))
    g = spmdkit.pmap(lambda v: v, "i", out_axes=None).lower(np.arange(4.0)).compile()
    with pytest.raises(spmdkit.ReplicationError):
        g(np.arange(4.0))


# ---- every error is also the built-in exception jax.pmap raises -------------------

MISTAKES = {
    "mapped size above devices": (lambda p: p(lambda v: v)(np.ones((16, 3)))),
    "in_axes tree mismatch": (
        lambda p: p(lambda a: a, in_axes=({"w": 0, "b": None},))({"w": np.ones(4), "c": np.ones(4)})
    ),
    "in_axes length": (lambda p: p(lambda a, b: a, in_axes=(0, 0, None))(np.ones(4), np.ones(4))),
    "scalar argument": (lambda p: p(lambda a: a)(1.0)),
    "axis beyond rank": (lambda p: p(lambda a: a, in_axes=2)(np.ones((4, 4)))),
    "nothing mapped": (lambda p: p(lambda a: a, in_axes=None)(np.ones(4))),
    "string in in_axes": (lambda p: p(lambda a, b: a, in_axes=(0, "x"))(np.ones(4), np.ones(4))),
    "float in out_axes": (lambda p: p(lambda a: {"a": a}, out_axes={"a": 1.5})(np.ones(4))),
    "unhashable static": (
        lambda p: p(lambda a, b: a, static_broadcasted_argnums=(1,))(np.ones(4), [2.0])
    ),
    "missing static": (lambda p: p(lambda a, b: a, static_broadcasted_argnums=(1,))(np.ones(4))),
    "unbound axis name": (lambda p: p(lambda v: jax.lax.psum(v, "j"), axis_name="i")(np.ones(4))),
    "out_axes tree mismatch": (lambda p: p(lambda v: v, out_axes=(0, 0))(np.ones(4))),
    "not callable": (lambda p: p(3)),
    "axis_size mismatch": (lambda p: p(lambda v: v, axis_size=4)(np.ones((3, 2)))),
    "mapped sizes differ": (lambda p: p(lambda a, b: a)(np.ones((4, 2)), np.ones((2, 3)))),
    "out_axes beyond rank": (lambda p: p(lambda v: v, out_axes=2)(np.ones((4, 3)))),
    "devices an int": (lambda p: p(lambda v: v, devices=4)(np.ones(4))),
    "returns a string": (lambda p: p(lambda v: "done")(np.ones(4))),
}


def builtin_class(e: BaseException) -> type:
    return next(c for c in type(e).__mro__ if c.__module__ == "builtins")


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_errors_are_the_builtin_jax_pmap_raises(name):
    with pytest.raises(Exception) as theirs:
        MISTAKES[name](jax.pmap)
    with pytest.raises(spmdkit.SpmdkitError) as ours:
        MISTAKES[name](spmdkit.pmap)
    assert isinstance(ours.value, builtin_class(theirs.value)), (ours.value, theirs.value)
    assert "Fix:" in str(ours.value)


def test_out_axes_none_checked_under_jit_too():
    bad = jax.jit(lambda x: spmdkit.pmap(lambda a: a * 2, out_axes=None)(x))
    with pytest.raises(spmdkit.ReplicationError, match="out_axes=None at output"):
        bad(np.arange(24.0).reshape(8, 3))
    good = jax.jit(lambda x: spmdkit.pmap(lambda a: jax.lax.pmean(a, "i"), "i", out_axes=None)(x))
    np.testing.assert_allclose(good(np.arange(24.0).reshape(8, 3)), np.arange(24.0).reshape(8, 3).mean(0))
    grad_step = jax.jit(
        lambda w, x: spmdkit.pmap(
            lambda w, x: jax.grad(lambda q: jnp.sum(q * x))(w), "i", in_axes=(None, 0), out_axes=None
        )(w, x)
    )
    with pytest.raises(spmdkit.ReplicationError):
        grad_step(jnp.ones(3), np.ones((8, 3)))


def test_lower_with_static_arguments_and_keywords():
    f = spmdkit.pmap(lambda x, k, *, y: x * k + y, static_broadcasted_argnums=1)
    x = np.ones((N, 2), np.float32)
    compiled = f.lower(x, 3, y=x).compile()
    np.testing.assert_array_equal(compiled(x, 3, y=x), np.full((N, 2), 4.0))
    with pytest.raises(spmdkit.SignatureError, match="static arguments"):
        compiled(x, 4, y=x)


@pytest.mark.parametrize("kwargs, fn, match", [
    # jax.pmap fails deep in shard_map ("cannot select an axis to squeeze out") for these two.
    ({"axis_name": 0}, lambda v: jax.lax.psum(v, 0), r"axis_name=0 \(type int\).*strings"),
    ({"axis_name": ("a",)}, lambda v: v, r"axis_name=\('a',\) \(type tuple\)"),
    # jax.pmap: AttributeError 'str' object has no attribute 'process_index'; AssertionError.
    ({"devices": ["cpu:0"]}, lambda v: v, r"devices\[0\] is 'cpu:0' \(type str\), not a jax.Device"),
    ({"devices": "dup"}, lambda v: v, r"more than once \(2 entries, 1 distinct\)"),
    ({"devices": []}, lambda v: v, r"devices=\[\] gives the map no device"),
    ({"out_axes": {"a": 0, "b": 1}}, lambda v: {"a": v, "b": v.sum()},
     r"out_axes puts the device axis at 1 for output\['b'\], which has shape \(\) per device"),
    ({}, lambda v: (v, object()), r"returned object at output\[1\]"),
])
def test_argument_mistakes_jax_pmap_raises_raw_are_named(kwargs, fn, match):
    if kwargs.get("devices") == "dup":
        kwargs = {"devices": [jax.devices()[0]] * 2}
    with pytest.raises(spmdkit.SpmdkitError, match=f"(?s){match}.*Fix:"):
        spmdkit.pmap(fn, **kwargs)(np.ones((2, 3)))


def test_axis_index_groups_where_the_map_traces_with_vmap_is_named_not_a_raw_not_implemented_error():
    """Eagerly (and under jit with out_axes=0) a grouped psum runs; out_axes=None under jit and a
    nested map are traced with jax.vmap, which has no axis_index_groups: JAX's raw
    NotImplementedError ("Please open a feature request!") named neither the map nor a fix."""
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    f = lambda a: jax.lax.psum(jax.lax.psum(a, "i", axis_index_groups=groups), "i") / 4  # noqa: E731
    x = np.arange(8, dtype=np.float32)
    assert float(spmdkit.pmap(f, axis_name="i", out_axes=None)(x)) == 28.0
    np.testing.assert_allclose(jax.jit(spmdkit.pmap(f, axis_name="i"))(x), np.full(8, 28.0))
    with pytest.raises(spmdkit.MappedAxisError, match=r"(?s)axis_index_groups.*out_axes=None under an enclosing "
                       r"jax.jit.*Fix: call the map outside jax.jit"):
        jax.jit(spmdkit.pmap(f, axis_name="i", out_axes=None))(x)
    inner = lambda v: spmdkit.pmap(lambda q: jax.lax.psum(q, "b", axis_index_groups=[[0, 1], [2, 3]]),  # noqa: E731
                                   axis_name="b")(v)
    with pytest.raises(spmdkit.MappedAxisError, match=r"(?s)nested spmdkit.pmap calls learn their levels.*Fix: make "
                       "each group a nesting level"):
        spmdkit.pmap(inner, axis_name="a")(x.reshape(2, 4))
