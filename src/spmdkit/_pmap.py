"""``jax.pmap`` semantics on ``jax.jit`` + ``jax.shard_map``.

The mapped axis of every argument is split one slice per device over a 1-D mesh
of the first ``n`` local devices (``n`` = the mapped size), the user's function
runs once per device on its slice (the mapped axis squeezed away, as in pmap),
and collectives name the mesh axis. Outputs stay on the devices, sharded along
the mapped axis, so one parallel map can consume another's output without the
data leaving the devices.

Validation happens in Python before anything is traced, and again only when the
call's structure changes: a call whose pytree structure and mapped size were seen
before costs one dict look-up and one shape check per mapped leaf on top of the
jitted function.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdkit._errors import (
    AxisNameError,
    BatchSizeError,
    MappedAxisError,
    SpmdkitError,
    fix,
)
from spmdkit._tree import broadcast_prefix, keystr

F = TypeVar("F", bound=Callable[..., Any])

# The mesh axis used when the caller gives no axis_name: collectives cannot name
# it, exactly as with jax.pmap(f) without axis_name.
_ANONYMOUS_AXIS = "_spmdkit_pmap"
_UNBOUND = re.compile(r"unbound axis name: ([^\s.]+)")


def _is_axis(x: Any) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def _check_axes_spec(name: str, spec: Any) -> None:
    """in_axes/out_axes: ints >= 0 or None at the leaves, checked at creation."""
    leaves = jax.tree_util.tree_flatten_with_path(spec, is_leaf=lambda x: x is None)[0]
    for path, leaf in leaves:
        where = keystr(name, path)
        if not _is_axis(leaf):
            raise MappedAxisError(
                fix(
                    f"{where} is {leaf!r} (type {type(leaf).__name__}); spmdkit.pmap takes an int "
                    "or None at each leaf of in_axes/out_axes.",
                    f"use an axis index (0 maps the leading axis) or None (broadcast) at {where}.",
                )
            )
        if leaf is not None and leaf < 0:
            raise MappedAxisError(
                fix(
                    f"{where} is {leaf}; like jax.pmap, spmdkit.pmap takes non-negative axes.",
                    f"count the axis from the front (for an array of rank r, axis {leaf} is "
                    f"r{leaf}).",
                )
            )


def _spec(axis_name: Hashable, axis: int | None) -> P:
    return P() if axis is None else P(*([None] * axis), axis_name)


class _Plan(NamedTuple):
    """What one call structure (pytree def + static args) compiles to."""

    axes: tuple[int | None, ...]  # one per flat dynamic leaf
    paths: tuple[str, ...]  # printable path per flat leaf
    mapped: tuple[int, ...]  # indices of flat leaves with a mapped axis
    by_size: dict[int, _Compiled]  # mapped size -> jitted shard_map


class _Compiled(NamedTuple):
    run: Callable[..., Any]  # jit(shard_map(per-device f)) over flat leaves
    shardings: tuple[NamedSharding, ...]  # where each flat leaf must live


class _ParallelMap:
    """The callable returned by :func:`pmap`."""

    def __init__(self, f, axis_name, in_axes, out_axes, static_broadcasted_argnums):
        self._f = f
        self._axis_name = axis_name
        self._mesh_axis = _ANONYMOUS_AXIS if axis_name is None else axis_name
        self._in_axes = in_axes
        self._out_axes = out_axes
        self._static = static_broadcasted_argnums
        self._plans: dict[Any, _Plan] = {}
        functools.update_wrapper(self, f)

    # ---- per call -------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        static_vals: tuple[Any, ...] = ()
        dyn_args = args
        if self._static:
            if max(self._static) >= len(args):
                raise MappedAxisError(
                    fix(
                        f"static_broadcasted_argnums={self._static} but the function was called "
                        f"with {len(args)} positional argument(s).",
                        "pass every static argument positionally.",
                    )
                )
            static_vals = tuple(args[i] for i in self._static)
            dyn_args = tuple(a for i, a in enumerate(args) if i not in self._static)
        flat, treedef = jax.tree_util.tree_flatten((dyn_args, kwargs))
        key = (treedef, static_vals)
        try:
            plan = self._plans.get(key)
        except TypeError:
            raise MappedAxisError(
                fix(
                    f"a static argument (positions {self._static}) is not hashable: "
                    f"{[type(v).__name__ for v in static_vals]}.",
                    "pass hashable values (tuples, not lists or arrays) as static arguments, or "
                    "drop their index from static_broadcasted_argnums.",
                )
            ) from None
        if plan is None:
            plan = self._plan(args, dyn_args, kwargs)
            self._plans[key] = plan
        n = self._mapped_size(plan, flat)
        compiled = plan.by_size.get(n)
        if compiled is None:
            compiled = plan.by_size[n] = self._compile(plan, treedef, static_vals, n)
        try:
            return compiled.run(*flat)
        except SpmdkitError:
            raise
        except Exception:
            # jit refuses (or trips over) an array committed to another layout: one
            # device, or another mesh. pmap moves such arrays; so do we, on this slow
            # path only, and let any other error through unchanged.
            moved = _move_misplaced(flat, compiled.shardings)
            if moved is None:
                raise
            return compiled.run(*moved)

    def _mapped_size(self, plan: _Plan, flat: list[Any]) -> int:
        n = None
        first = None
        for i in plan.mapped:
            x, ax = flat[i], plan.axes[i]
            shape = getattr(x, "shape", None)
            if shape is None or len(shape) <= ax:
                what = (
                    f"{type(x).__name__} with no axes"
                    if shape is None
                    else f"an array of shape {tuple(shape)}"
                )
                raise MappedAxisError(
                    fix(
                        f"{plan.paths[i]} is {what}, so it has no axis {ax} to map over "
                        f"(in_axes gives {ax} there).",
                        f"give {plan.paths[i]} a device axis at position {ax} (spmdkit.shard(x) "
                        "adds a leading one), or use in_axes=None there to broadcast it to every "
                        "device.",
                    )
                )
            size = shape[ax]
            if n is None:
                n, first = size, i
            elif size != n:
                raise MappedAxisError(
                    fix(
                        "mapped axes have different sizes: "
                        f"{plan.paths[first]} has {n} along axis {plan.axes[first]}, "
                        f"{plan.paths[i]} has {size} along axis {ax}.",
                        "every mapped argument needs the same size along its mapped axis (one "
                        "slice per device); reshape them alike, or broadcast an argument with "
                        "in_axes=None.",
                    )
                )
        if n is None:
            raise MappedAxisError(
                fix(
                    "no argument has a mapped axis (in_axes is None everywhere or there are no "
                    "array arguments), so the number of devices is unknown.",
                    "map at least one argument (in_axes=0 for an array with a leading device axis).",
                )
            )
        available = jax.local_device_count()
        if n > available or n < 1:
            raise MappedAxisError(
                fix(
                    f"{plan.paths[first]} has size {n} along mapped axis {plan.axes[first]}, "
                    f"but {available} local device(s) are available"
                    + (" and a mapped axis of size 0 maps to no device." if n < 1 else "."),
                    f"reshape it to [{available}, per_device, ...] with spmdkit.shard(x), or "
                    f"simulate more devices: spmdkit.use_host_devices({max(n, 1)}) before any "
                    f"JAX work (CLI: --host-devices {max(n, 1)}, env: "
                    f"SPMDKIT_HOST_DEVICES={max(n, 1)}).",
                )
            )
        return n

    # ---- once per call structure --------------------------------------------
    def _plan(self, args, dyn_args, kwargs) -> _Plan:
        in_axes = self._in_axes
        if isinstance(in_axes, list):
            in_axes = tuple(in_axes)
        if isinstance(in_axes, tuple):
            if len(in_axes) != len(args):
                raise MappedAxisError(
                    fix(
                        f"in_axes has {len(in_axes)} entries but the function was called with "
                        f"{len(args)} positional argument(s).",
                        "give one in_axes entry per positional argument (None for broadcast and "
                        "for static arguments), or a single int/None for all of them.",
                    )
                )
            if self._static:
                in_axes = tuple(a for i, a in enumerate(in_axes) if i not in self._static)
        example = "e.g. in_axes=(0, None) maps the first argument and broadcasts the second"
        common = dict(prefix_name="in_axes", is_prefix_leaf=_is_axis, example=example)
        arg_pairs = broadcast_prefix(in_axes, tuple(dyn_args), tree_name="args", **common)
        # Keyword arguments are always mapped along their leading axis, as in jax.pmap.
        kw_pairs = broadcast_prefix(0, kwargs, tree_name="kwargs", **common)
        axes = tuple(ax for _, ax in arg_pairs + kw_pairs)
        paths = tuple(keystr("args", p) for p, _ in arg_pairs) + tuple(
            keystr("kwargs", p) for p, _ in kw_pairs
        )
        mapped = tuple(i for i, ax in enumerate(axes) if ax is not None)
        return _Plan(axes=axes, paths=paths, mapped=mapped, by_size={})

    def _compile(self, plan: _Plan, treedef, static_vals, n: int) -> _Compiled:
        axis = self._mesh_axis
        mesh = Mesh(np.array(jax.local_devices()[:n]), (axis,))
        in_specs = tuple(_spec(axis, ax) for ax in plan.axes)
        out_specs = jax.tree.map(
            functools.partial(_spec, axis), self._out_axes, is_leaf=lambda x: x is None
        )
        f, static, axes, out_axes = self._f, self._static, plan.axes, self._out_axes
        axis_name = self._axis_name

        def per_device(*flat):
            leaves = [x if ax is None else jax.lax.squeeze(x, (ax,)) for x, ax in zip(flat, axes)]
            dyn_args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            call_args = _merge_static(dyn_args, static, static_vals)
            try:
                out = f(*call_args, **kwargs)
            except NameError as e:
                m = _UNBOUND.search(str(e))
                if m is None:
                    raise
                raise AxisNameError(_unbound_message(m.group(1), axis_name)) from None
            pairs = broadcast_prefix(
                out_axes,
                out,
                prefix_name="out_axes",
                tree_name="output",
                is_prefix_leaf=_is_axis,
                example="e.g. out_axes=(0, None) for a function returning (per_device, replicated)",
            )
            out_leaves, out_def = jax.tree_util.tree_flatten(out)
            out_leaves = [
                x if ax is None else jax.lax.expand_dims(x, (ax,))
                for x, (_, ax) in zip(out_leaves, pairs)
            ]
            return jax.tree_util.tree_unflatten(out_def, out_leaves)

        # check_vma=False keeps pmap's semantics: the gradient with respect to a
        # broadcast (in_axes=None) argument is per device, not already summed
        # across devices (see shared/jax-facts.md on the N-times-too-large grads).
        mapped = jax.shard_map(
            per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
        return _Compiled(jax.jit(mapped, in_shardings=shardings), shardings)

    def __repr__(self) -> str:
        return f"spmdkit.pmap({getattr(self._f, '__name__', self._f)!r}, axis_name={self._axis_name!r})"


def _move_misplaced(flat: list[Any], shardings: tuple[NamedSharding, ...]) -> list[Any] | None:
    """Leaves re-placed onto ``shardings`` where they sit elsewhere; None if none do."""
    moved, changed = [], False
    for x, sh in zip(flat, shardings):
        if isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(sh, x.ndim):
            x, changed = jax.device_put(x, sh), True
        moved.append(x)
    return moved if changed else None


def _merge_static(dyn_args, static, static_vals):
    if not static:
        return dyn_args
    out, dyn, st = [], iter(dyn_args), dict(zip(static, static_vals))
    for i in range(len(dyn_args) + len(static)):
        out.append(st[i] if i in st else next(dyn))
    return tuple(out)


def _unbound_message(name: str, bound: Hashable | None) -> str:
    if bound is None:
        return fix(
            f"a collective in the mapped function names axis {name!r}, but this spmdkit.pmap was "
            "created without an axis_name, so no axis can be named.",
            f"create it with spmdkit.pmap(f, axis_name={name!r}).",
        )
    return fix(
        f"a collective in the mapped function names axis {name!r}, but this spmdkit.pmap binds "
        f"only axis_name={bound!r}.",
        f"use {bound!r} in the collective (e.g. jax.lax.psum(x, {bound!r})), or create the map "
        f"with axis_name={name!r}.",
    )


def pmap(
    f: F,
    axis_name: Hashable | None = None,
    in_axes: Any = 0,
    out_axes: Any = 0,
    static_broadcasted_argnums: int | Iterable[int] = (),
) -> F:
    """Map ``f`` over devices with ``jax.pmap`` semantics, built on jit + shard_map.

    The mapped axis (``in_axes``, the leading one by default) is split one slice per
    device; ``f`` sees one slice with that axis removed. A mapped size below the
    local device count uses that many devices; above it is an error. ``in_axes=None``
    broadcasts an argument to every device. Collectives (``jax.lax.psum``, ``pmean``,
    ``all_gather``, ``axis_index``) name ``axis_name``. Compiled once per input
    signature; outputs stay sharded on the devices.

    Example:
        >>> import jax, jax.numpy as jnp, spmdkit
        >>> n = jax.local_device_count()
        >>> total = spmdkit.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
        >>> total(jnp.ones(n)).tolist() == [float(n)] * n
        True
    """
    if not callable(f):
        raise SpmdkitError(f"spmdkit.pmap: f must be callable, got {type(f).__name__}.")
    try:
        hash(axis_name)
    except TypeError:
        raise AxisNameError(
            fix(f"axis_name={axis_name!r} is not hashable.", "use a string such as 'batch'.")
        ) from None
    if isinstance(static_broadcasted_argnums, int):
        static_broadcasted_argnums = (static_broadcasted_argnums,)
    static = tuple(sorted(set(static_broadcasted_argnums)))
    if any(not isinstance(i, int) or i < 0 for i in static):
        raise MappedAxisError(
            fix(
                f"static_broadcasted_argnums={static_broadcasted_argnums!r} must hold "
                "non-negative ints.",
                "list the positions of the static arguments, e.g. static_broadcasted_argnums=(2,).",
            )
        )
    _check_axes_spec("in_axes", in_axes)
    _check_axes_spec("out_axes", out_axes)
    # The seeds write `pmap(f)(x)` inline, over and over; like jax.pmap, the same
    # (f, axes) must reuse its compiled code rather than build a new map each time.
    try:
        key = (f, axis_name, _freeze(in_axes), _freeze(out_axes), static)
        hash(key)
    except TypeError:
        return _ParallelMap(f, axis_name, in_axes, out_axes, static)  # type: ignore[return-value]
    made = _MAPS.pop(key, None) or _ParallelMap(f, axis_name, in_axes, out_axes, static)
    _MAPS[key] = made  # re-inserted: the dict's order is least recently used first
    if len(_MAPS) > _MAX_MAPS:
        del _MAPS[next(iter(_MAPS))]
    return made  # type: ignore[return-value]


_MAPS: dict[Any, _ParallelMap] = {}
_MAX_MAPS = 256


def _freeze(spec: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=lambda x: x is None)
    return treedef, tuple(leaves)


# ---- host-side helpers ----------------------------------------------------------


def _device_count(n_devices: int | None) -> int:
    available = jax.local_device_count()
    if n_devices is None:
        return available
    if not isinstance(n_devices, int) or not 1 <= n_devices <= available:
        raise MappedAxisError(
            fix(
                f"n_devices={n_devices!r}, but {available} local device(s) are available.",
                f"pass an int from 1 to {available}, or None for all of them.",
            )
        )
    return n_devices


def replicate(tree: Any, n_devices: int | None = None) -> Any:
    """Stack a copy of every leaf on each device: leaf shape ``s`` -> ``[n, *s]``.

    The result is sharded one copy per device, the layout ``pmap(f, in_axes=0)``
    expects (the seed's ``flax.jax_utils.replicate``).

    Example:
        >>> import jax, numpy as np, spmdkit
        >>> r = spmdkit.replicate({"w": np.ones(3)})
        >>> r["w"].shape == (jax.local_device_count(), 3)
        True
    """
    n = _device_count(n_devices)
    devices = jax.local_devices()[:n]
    sharding = NamedSharding(Mesh(np.array(devices), ("replica",)), P("replica"))

    def put(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        shards = [jax.device_put(x[None], d) for d in devices]
        return jax.make_array_from_single_device_arrays((n, *x.shape), sharding, shards)

    return jax.tree.map(put, tree)


def unreplicate(tree: Any) -> Any:
    """Take device 0's copy of every leaf: the inverse of :func:`replicate`.

    Example:
        >>> import numpy as np, spmdkit
        >>> spmdkit.unreplicate(spmdkit.replicate({"w": np.ones(3)}))["w"].shape
        (3,)
    """
    return jax.tree.map(lambda x: x[0], tree)


class ShardedBatch(NamedTuple):
    """A host batch reshaped to ``[n_devices, per_device, ...]``, with its mask.

    ``mask[d, j]`` is True where row ``j`` of device ``d`` is a real example and
    False where :func:`shard` padded; ``sum(loss * mask) / sum(mask)`` is the exact
    mean over the real examples.
    """

    data: Any
    mask: np.ndarray


def shard(batch: Any, n_devices: int | None = None, *, pad: bool = True) -> ShardedBatch:
    """Reshape every leaf of a host batch from ``[B, ...]`` to ``[n, ceil(B/n), ...]``.

    When ``B`` is not divisible by ``n`` the batch is padded with zeros at the end
    and the returned mask marks the real rows; with ``pad=False`` that is an error.

    Example:
        >>> import numpy as np, spmdkit
        >>> data, mask = spmdkit.shard(np.arange(10.0), n_devices=4)
        >>> data.shape, int(mask.sum())
        ((4, 3), 10)
    """
    n = _device_count(n_devices)
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise BatchSizeError(
            fix("spmdkit.shard got a batch with no arrays.", "pass an array or a pytree of arrays.")
        )
    sizes = []
    for path, x in leaves:
        shape = np.shape(x)
        if len(shape) == 0:
            raise BatchSizeError(
                fix(
                    f"batch{jax.tree_util.keystr(path)} is a scalar; it has no batch axis to split.",
                    "give every leaf a leading batch axis.",
                )
            )
        sizes.append((path, shape[0]))
    first_path, size = sizes[0]
    for path, s in sizes[1:]:
        if s != size:
            raise BatchSizeError(
                fix(
                    "leaves of the batch have different leading sizes: "
                    f"batch{jax.tree_util.keystr(first_path)} has {size}, "
                    f"batch{jax.tree_util.keystr(path)} has {s}.",
                    "give every leaf the same number of examples along axis 0.",
                )
            )
    if size == 0:
        raise BatchSizeError(fix("the batch has 0 examples.", "pass at least one example."))
    per = -(-size // n)
    padding = per * n - size
    if padding and not pad:
        raise BatchSizeError(
            fix(
                f"a batch of {size} examples does not split evenly over {n} devices "
                f"({size} = {n} x {size // n} + {size % n}).",
                f"use a batch size divisible by {n} (e.g. {size - size % n or n} or {per * n}), "
                "or call shard(batch, pad=True) and weight the loss with the returned mask.",
            )
        )

    def reshape(x):
        x = np.asarray(x)
        if padding:
            x = np.concatenate([x, np.zeros((padding, *x.shape[1:]), x.dtype)])
        return x.reshape(n, per, *x.shape[1:])

    mask = (np.arange(per * n) < size).reshape(n, per)
    return ShardedBatch(jax.tree.map(reshape, batch), mask)


__all__ = ["pmap", "replicate", "unreplicate", "shard", "ShardedBatch"]
