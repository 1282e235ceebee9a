"""Conformance: the same small programs through spmdkit.pmap and jax.pmap.

Each case is a function of the map (``impl``) that returns outputs; the two agree
when their pytree structures, dtypes and values match, or when both raise and
spmdkit's error is an instance of the built-in exception jax.pmap raises.
``DIFFERENT`` lists the cases where spmdkit differs on purpose, with the reason;
those are checked to differ exactly that way. The README quotes the counts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmdkit

N = 8
rng = np.random.default_rng(0)
X = rng.standard_normal((N, 3)).astype(np.float32)
M = rng.standard_normal((N, N, 2)).astype(np.float32)
W = rng.standard_normal(3).astype(np.float32)


class Pair(NamedTuple):
    a: Any
    b: Any


def _ring(n):
    return [(j, (j + 1) % n) for j in range(n)]


def _loss(w, x):
    return jnp.sum((x @ w) ** 2)


CASES: dict[str, Callable[[Callable], Any]] = {
    # ---- argument structures
    "one array": lambda p: p(lambda x: x * 2)(X),
    "tuple of arrays": lambda p: p(lambda t: (t[0] + t[1], t[0]))((X, X)),
    "dict pytree": lambda p: p(lambda d: {"s": d["a"] + d["b"]["c"]})({"a": X, "b": {"c": X}}),
    "nested list": lambda p: p(lambda l: [l[0][0] * l[1]])([[X], X]),
    "namedtuple": lambda p: p(lambda t: Pair(t.b, t.a))(Pair(X, X * 2)),
    "keyword arguments": lambda p: p(lambda x, *, y: x - y)(X, y=X * 3),
    "python scalar broadcast": lambda p: p(lambda x, s: x * s, in_axes=(0, None))(X, 2.5),
    "static argument": lambda p: p(lambda x, k: x * k, static_broadcasted_argnums=1)(X, 3),
    "several static": lambda p: p(lambda a, x, b: x * a + b, static_broadcasted_argnums=(0, 2))(2, X, 1),
    "empty output tuple": lambda p: p(lambda x: (x, ()))(X),
    # ---- in_axes / out_axes
    "in_axes=1": lambda p: p(lambda x: x * 2, in_axes=1)(X.T),
    "in_axes (0, None)": lambda p: p(lambda x, w: x @ w, in_axes=(0, None))(X, W),
    "in_axes dict prefix": lambda p: p(lambda d: d["x"] * d["w"], in_axes=({"x": 0, "w": None},))(
        {"x": X, "w": W}
    ),
    "out_axes=1": lambda p: p(lambda x: x * 2, out_axes=1)(X),
    "out_axes=None of psum": lambda p: p(lambda x: jax.lax.psum(x, "i"), "i", out_axes=None)(X),
    "out_axes (0, None)": lambda p: p(lambda x: (x, jax.lax.pmax(x, "i")), "i", out_axes=(0, None))(X),
    "out_axes dict prefix": lambda p: p(lambda x: {"a": x, "b": x[None]}, out_axes={"a": 0, "b": 1})(X),
    "three devices": lambda p: p(lambda x: jax.lax.psum(x, "i"), "i")(X[:3]),
    "one device": lambda p: p(lambda x: jax.lax.psum(x, "i"), "i")(X[:1]),
    "in and out axis 2": lambda p: p(lambda m: m * 2, in_axes=2, out_axes=2)(M.transpose(1, 2, 0)),
    # ---- collectives
    "psum": lambda p: p(lambda x: jax.lax.psum(x, "i"), "i")(X),
    "pmean": lambda p: p(lambda x: jax.lax.pmean(x, "i"), "i")(X),
    "pmax pmin": lambda p: p(lambda x: (jax.lax.pmax(x, "i"), jax.lax.pmin(x, "i")), "i")(X),
    "all_gather": lambda p: p(lambda x: jax.lax.all_gather(x, "i"), "i")(X),
    "all_gather tiled": lambda p: p(lambda x: jax.lax.all_gather(x, "i", tiled=True), "i")(X),
    "all_to_all": lambda p: p(lambda m: jax.lax.all_to_all(m, "i", 0, 0), "i")(M),
    "all_to_all axes 1": lambda p: p(lambda m: jax.lax.all_to_all(m, "i", 0, 1), "i")(M),
    "ppermute ring": lambda p: p(lambda x: jax.lax.ppermute(x, "i", _ring(N)), "i")(X),
    "ppermute partial": lambda p: p(lambda x: jax.lax.ppermute(x, "i", [(0, 3), (5, 1)]), "i")(X),
    "pshuffle": lambda p: p(lambda x: jax.lax.pshuffle(x, "i", list(range(N - 1, -1, -1))), "i")(X),
    "axis_index": lambda p: p(lambda x: x * jax.lax.axis_index("i"), "i")(X),
    "pswapaxes": lambda p: p(lambda m: jax.lax.pswapaxes(m, "i", 0), "i")(M),
    "psum_scatter": lambda p: p(lambda m: jax.lax.psum_scatter(m, "i"), "i")(M),
    "psum_scatter tiled": lambda p: p(lambda m: jax.lax.psum_scatter(m, "i", tiled=True), "i")(M),
    "psum of a tree": lambda p: p(lambda x: jax.lax.psum({"a": x, "b": 2 * x}, "i"), "i")(X),
    "axis size via psum(1)": lambda p: p(lambda x: x * jax.lax.psum(1, "i"), "i")(X),
    # ---- gradients of collectives
    "grad of psum": lambda p: p(jax.grad(lambda x: jnp.sum(jax.lax.psum(x, "i") ** 2)), "i")(X),
    "grad broadcast param": lambda p: p(jax.grad(_loss), "i", in_axes=(None, 0))(W, X),
    "grad then pmean": lambda p: p(
        lambda w, x: jax.lax.pmean(jax.grad(_loss)(w, x), "i"), "i", in_axes=(None, 0)
    )(W, X),
    "grad of all_gather": lambda p: p(jax.grad(lambda x: jnp.sum(jax.lax.all_gather(x, "i") ** 3)), "i")(X),
    "grad of ppermute": lambda p: p(
        jax.grad(lambda x: jnp.sum(jax.lax.ppermute(x, "i", _ring(N)) * jnp.arange(3.0))), "i"
    )(X),
    "grad of all_to_all": lambda p: p(jax.grad(lambda m: jnp.sum(jax.lax.all_to_all(m, "i", 0, 0) ** 2)), "i")(M),
    "value_and_grad pmean": lambda p: p(
        lambda w, x: jax.lax.pmean(jax.value_and_grad(_loss)(w, x), "i"), "i", in_axes=(None, 0)
    )(W, X),
    "grad around the map": lambda p: jax.grad(lambda x: jnp.sum(p(lambda v: jnp.sin(v) * 2)(x)))(X),
    "grad around, psum inside": lambda p: jax.grad(lambda x: jnp.sum(p(lambda v: jax.lax.psum(v, "i") ** 2, "i")(x)))(X),
    # ---- transformations
    "vmap inside": lambda p: p(jax.vmap(lambda r: r.sum()))(M),
    "vmap outside": lambda p: jax.vmap(p(lambda x: jax.lax.psum(x, "i"), "i"), in_axes=1)(M),
    "jit inside": lambda p: p(jax.jit(lambda x: x @ x.T))(M),
    "jit outside": lambda p: jax.jit(lambda x: p(lambda v: jax.lax.pmean(v, "i"), "i")(x) + 1)(X),
    "scan with psum": lambda p: p(
        lambda x: jax.lax.scan(lambda c, r: (c + jax.lax.psum(r, "i"), c), 0.0, x)[0], "i"
    )(X),
    "cond on axis_index": lambda p: p(
        lambda x: jax.lax.cond(jax.lax.axis_index("i") % 2 == 0, lambda v: v, lambda v: -v, x), "i"
    )(X),
    # ---- PRNG keys
    "raw keys split": lambda p: p(lambda k: jax.random.normal(k, (3,)))(jax.random.split(jax.random.PRNGKey(0), N)),
    "typed keys split": lambda p: p(lambda k: jax.random.uniform(k, (2,)))(jax.random.split(jax.random.key(1), N)),
    "key returned": lambda p: p(lambda k: jax.random.split(k)[0])(jax.random.split(jax.random.key(2), N)),
    "broadcast key fold_in": lambda p: p(
        lambda k, x: jax.random.normal(jax.random.fold_in(k, jax.lax.axis_index("i")), (3,)) + x,
        "i", in_axes=(None, 0),
    )(jax.random.key(3), X),
    # ---- dtypes
    "int32 psum": lambda p: p(lambda x: jax.lax.psum(x, "i"), "i")(np.arange(N * 2, dtype=np.int32).reshape(N, 2)),
    "uint8": lambda p: p(lambda x: x + 1)(np.arange(N, dtype=np.uint8)),
    "bool": lambda p: p(lambda x: ~x)(np.arange(N) % 2 == 0),
    "float16 pmean": lambda p: p(lambda x: jax.lax.pmean(x, "i"), "i")(X.astype(np.float16)),
    "bfloat16": lambda p: p(lambda x: x * 2)(X.astype(jnp.bfloat16)),
    "complex64 psum": lambda p: p(lambda x: jax.lax.psum(x * 1j, "i"), "i")(X.astype(np.complex64)),
    "weak-typed scalar out": lambda p: p(lambda x: x.sum() * 0 + 1.0)(X),
    # ---- errors
    "error: size above devices": lambda p: p(lambda v: v)(np.ones((16, 3))),
    "error: in_axes tree": lambda p: p(lambda a: a, in_axes=({"w": 0, "b": None},))({"w": X, "c": X}),
    "error: in_axes length": lambda p: p(lambda a, b: a, in_axes=(0, 0, None))(X, X),
    "error: nothing mapped": lambda p: p(lambda a: a, in_axes=None)(X),
    "error: axis beyond rank": lambda p: p(lambda a: a, in_axes=2)(X),
    "error: bad in_axes leaf": lambda p: p(lambda a, b: a, in_axes=(0, "x"))(X, X),
    "error: bad out_axes leaf": lambda p: p(lambda a: a, out_axes=1.5)(X),
    "error: unbound axis": lambda p: p(lambda v: jax.lax.psum(v, "j"), "i")(X),
    "error: out_axes tree": lambda p: p(lambda v: v, out_axes=(0, 0))(X),
    "error: static unhashable": lambda p: p(lambda a, b: a, static_broadcasted_argnums=1)(X, [1]),
    "error: static missing": lambda p: p(lambda a, b: a, static_broadcasted_argnums=1)(X),
    "error: axis_size": lambda p: p(lambda v: v, axis_size=4)(X[:3]),
    "error: not callable": lambda p: p(3),
    "error: sizes differ": lambda p: p(lambda a, b: a)(X, X[:4]),
    # ---- where spmdkit differs on purpose (see DIFFERENT)
    "out_axes=None of a varying value": lambda p: p(lambda x: x * 2, out_axes=None)(X),
    "nested maps": lambda p: p(p(lambda v: jax.lax.psum(v, "b"), "b"), "a")(X.reshape(2, 4, 3)),
    "committed to one device": lambda p: p(lambda x: x * 2)(
        jax.device_put(X, jax.sharding.SingleDeviceSharding(jax.devices()[3]))
    ),
    "committed to another mesh": lambda p: p(lambda x: x * 2)(
        jax.device_put(X, jax.NamedSharding(spmdkit.make_mesh(x=2, y=4), jax.P("x")))
    ),
}

# case -> (why, what jax.pmap does, what spmdkit.pmap does)
DIFFERENT = {
    "out_axes=None of a varying value": (
        "jax.pmap silently returns device 0's copy; spmdkit raises ReplicationError naming the output",
        "value", spmdkit.ReplicationError,
    ),
    "nested maps": (
        "jax.pmap refuses nested maps (ValueError about the context mesh); spmdkit runs them on a 2-D mesh",
        ValueError, "value",
    ),
    "committed to one device": (
        "jax.pmap refuses an argument committed to another layout; spmdkit moves it",
        ValueError, "value",
    ),
    "committed to another mesh": (
        "jax.pmap refuses an argument committed to another layout; spmdkit moves it",
        ValueError, "value",
    ),
}


def outcome(impl, name):
    try:
        return "value", CASES[name](impl)
    except Exception as e:  # noqa: BLE001 - the error is the outcome being compared
        return "error", e


def _plain(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return ("key", np.asarray(jax.random.key_data(x)))
    return np.asarray(x)


def builtin_class(e: BaseException) -> type:
    return next(c for c in type(e).__mro__ if c.__module__ == "builtins")


def agree(theirs, ours) -> str | None:
    """None when the two outcomes agree, else why not."""
    if theirs[0] != ours[0]:
        return f"jax.pmap gave {theirs[0]} {theirs[1]!r:.300}, spmdkit gave {ours[0]} {ours[1]!r:.300}"
    if theirs[0] == "error":
        want = builtin_class(theirs[1])
        if not isinstance(ours[1], want) or not isinstance(ours[1], spmdkit.SpmdkitError):
            return f"jax.pmap raised {want.__name__}, spmdkit raised {type(ours[1]).__mro__}"
        return None
    t_leaves, t_def = jax.tree.flatten(theirs[1])
    o_leaves, o_def = jax.tree.flatten(ours[1])
    if t_def != o_def:
        return f"structures differ: {t_def} vs {o_def}"
    for t, o in zip(t_leaves, o_leaves):
        t, o = _plain(t), _plain(o)
        if isinstance(t, tuple) != isinstance(o, tuple):
            return "one is a PRNG key, the other not"
        if isinstance(t, tuple):
            t, o = t[1], o[1]
        if t.dtype != o.dtype or t.shape != o.shape:
            return f"{t.dtype}{t.shape} vs {o.dtype}{o.shape}"
        tol = 1e-2 if t.dtype in (np.float16, jnp.bfloat16) else 1e-5
        if not np.allclose(t.astype(np.complex128), o.astype(np.complex128), rtol=tol, atol=tol):
            return f"values differ: {t!r:.200} vs {o!r:.200}"
    return None


@pytest.mark.parametrize("name", sorted(set(CASES) - set(DIFFERENT)))
def test_agrees_with_jax_pmap(name):
    problem = agree(outcome(jax.pmap, name), outcome(spmdkit.pmap, name))
    assert problem is None, problem


@pytest.mark.parametrize("name", sorted(DIFFERENT))
def test_differs_on_purpose(name):
    _, jax_does, we_do = DIFFERENT[name]
    for impl, expected in ((jax.pmap, jax_does), (spmdkit.pmap, we_do)):
        kind, value = outcome(impl, name)
        if expected == "value":
            assert kind == "value", value
        else:
            assert kind == "error" and isinstance(value, expected), value


def test_nested_and_moved_values_are_right():
    """Where spmdkit differs, its values are the vmap reference."""
    kind, out = outcome(spmdkit.pmap, "nested maps")
    ref = jax.vmap(jax.vmap(lambda v: jax.lax.psum(v, "b"), axis_name="b"), axis_name="a")(X.reshape(2, 4, 3))
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    for name in ("committed to one device", "committed to another mesh"):
        np.testing.assert_array_equal(outcome(spmdkit.pmap, name)[1], X * 2)


def test_readme_quotes_the_counts():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    m = re.search(r"(\d+) conformance cases: (\d+) agree with `jax.pmap`, (\d+) differ on purpose", readme)
    assert m, "README should quote the conformance counts"
    assert tuple(map(int, m.groups())) == (len(CASES), len(CASES) - len(DIFFERENT), len(DIFFERENT))
