"""Pieces of :func:`spmdkit.pmap` that need no map: axis specs, placement, checks, messages."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdkit._errors import (
    AxisNameError,
    MappedAxisError,
    MappedAxisIndexError,
    MappedAxisTypeError,
    StepOutputError,
    fix,
)
from spmdkit._tree import keystr


def _is_axis(x: Any) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def _check_axes_spec(name: str, spec: Any) -> None:
    """in_axes/out_axes: ints >= 0 or None at the leaves, checked at creation."""
    leaves = jax.tree_util.tree_flatten_with_path(spec, is_leaf=lambda x: x is None)[0]
    for path, leaf in leaves:
        where = keystr(name, path)
        if not _is_axis(leaf):
            raise MappedAxisTypeError(
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


def _check_axis_name(axis_name: Any) -> None:
    # The name becomes a mesh axis, and JAX's meshes bind only strings: an int or a tuple
    # failed deep in shard_map ("cannot select an axis to squeeze out").
    if axis_name is None or isinstance(axis_name, str):
        return
    raise AxisNameError(
        fix(
            f"axis_name={axis_name!r} (type {type(axis_name).__name__}); spmdkit.pmap names a "
            "mesh axis with it, and mesh axes are named by strings.",
            "use a string such as axis_name='batch', and the same string in psum/pmean/axis_index.",
        )
    )


def _check_devices(devices: Any) -> None:
    """``devices=``: a non-empty sequence of distinct ``jax.Device``s, or None."""
    if devices is None:
        return
    example = "e.g. devices=jax.devices()[:4]"
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise MappedAxisTypeError(
            fix(f"devices={devices!r} (type {type(devices).__name__}) is not a sequence of devices.",
                f"pass a list of jax.Device objects ({example}).")
        )
    devices = list(devices)
    for i, d in enumerate(devices):
        if not isinstance(d, jax.Device):
            raise MappedAxisTypeError(
                fix(f"devices[{i}] is {d!r} (type {type(d).__name__}), not a jax.Device.",
                    f"pass jax.Device objects, {example}.")
            )
    if not devices:
        raise MappedAxisError(fix("devices=[] gives the map no device.", f"pass at least one, {example}."))
    seen = [d for i, d in enumerate(devices) if d in devices[:i]]
    if seen:
        raise MappedAxisError(
            fix(f"devices names {seen[0]} more than once ({len(devices)} entries, "
                f"{len(set(devices))} distinct).", "list each device once.")
        )


def _check_output_leaf(where: str, leaf: Any, axis: int | None) -> None:
    """One output leaf of the mapped function, before its device axis is put back."""
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)):
        raise StepOutputError(
            fix(
                f"the mapped function returned {type(leaf).__name__} at {where}; spmdkit.pmap "
                "returns arrays only.",
                f"return arrays (or numbers) there; keep {type(leaf).__name__} values outside "
                "the mapped function, or pass them in as static_broadcasted_argnums.",
            )
        )
    rank = np.ndim(leaf)
    if axis is not None and axis > rank:
        raise MappedAxisIndexError(
            fix(
                f"out_axes puts the device axis at {axis} for {where}, which has shape "
                f"{tuple(np.shape(leaf))} per device, so the result has rank {rank + 1} and "
                f"axes 0..{rank} only.",
                f"use an out_axes of at most {rank} at {where} (0 puts the devices first).",
            )
        )


def _spec(axis_name: Hashable, axis: int | None) -> P:
    return P() if axis is None else P(*([None] * axis), axis_name)


def _signature(flat: list[Any]) -> tuple[Any, ...]:
    return tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in flat)


def _same_everywhere(x: jax.Array, names: list[Hashable]) -> jax.Array:
    """True where ``x`` has the same bits on every device of the named axes."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.iscomplexobj(x):
        x = jnp.stack([x.real, x.imag])
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    x = jax.lax.bitcast_convert_type(x, bits)
    axes = tuple(names)
    return jnp.all(jax.lax.pmax(x, axes) == jax.lax.pmin(x, axes))


def _to_global(flat: list[Any], axes: tuple[int | None, ...], compiled: Any) -> list[Any]:
    """Across processes: each process's local slices become one global array.

    ``compiled`` holds the map's shardings and ``row0``, this process's first index
    along the mapped axis (the mesh's first axis). ``jax.make_array_from_callback``
    with that offset does what ``jax.make_array_from_process_local_data`` does for this
    layout (one index per device row, each process's rows contiguous) at a third or
    less of its Python cost per call.
    """
    out = []
    count = None
    for x, sh, ax in zip(flat, compiled.shardings, axes):
        if isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            out.append(x)  # already global (a previous call's output), or being traced
            continue
        local = np.asarray(x)
        shape = local.shape
        if ax is None:
            out.append(jax.make_array_from_callback(shape, sh, lambda _, v=local: v))
            continue
        count = count or jax.process_count()
        shape = (*shape[:ax], shape[ax] * count, *shape[ax + 1 :])
        out.append(jax.make_array_from_callback(shape, sh, _local_rows(local, ax, compiled.row0)))
    return out


def _local_rows(local: np.ndarray, ax: int, row0: int):
    """The data callback of one mapped leaf: global index -> this process's slice."""

    def rows(index):
        start = (index[ax].start or 0) - row0
        return local[(*index[:ax], slice(start, start + 1), *index[ax + 1 :])]

    return rows


def _local_avals(flat: list[Any], axes: tuple[int | None, ...], n: int) -> list[Any]:
    """The arguments as one process sees them: a global array (a previous call's output,
    across processes) becomes its shape and dtype with ``n`` rows on its mapped axis."""
    out = []
    for x, ax in zip(flat, axes):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.is_fully_addressable:
            shape = x.shape if ax is None else (*x.shape[:ax], n, *x.shape[ax + 1 :])
            x = jax.ShapeDtypeStruct(shape, x.dtype)
        out.append(x)
    return out


def _move_misplaced(flat: list[Any], shardings: tuple[NamedSharding, ...]) -> list[Any] | None:
    """Leaves re-placed onto ``shardings`` where they sit on other devices; None if none do."""
    moved, changed = [], False
    for x, sh in zip(flat, shardings):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if not x.sharding.is_equivalent_to(sh, x.ndim) and (
                x.sharding.device_set != sh.device_set or len(sh.mesh.axis_names) == 1
            ):
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


def _unbound_message(name: str, bound: tuple[Any, ...]) -> str:
    if name in (None, "None"):  # jax.lax.pmean(x, None): "axis_name='None'" was the fix offered
        return fix(
            "a collective in the mapped function was given None as its axis name; a collective "
            "reduces over a named axis of the map.",
            "name the map's axis and use that name: spmdkit.pmap(f, axis_name='i') with "
            "jax.lax.pmean(x, 'i')" + (f" (this map binds axis_name={bound[-1]!r})." if bound else "."),
        )
    if not bound:
        return fix(
            f"a collective in the mapped function names axis {name!r}, but this spmdkit.pmap was "
            "created without an axis_name, so no axis can be named.",
            f"create it with spmdkit.pmap(f, axis_name={name!r}).",
        )
    shown = repr(bound[0]) if len(bound) == 1 else f"{bound!r} (nested maps)"
    return fix(
        f"a collective in the mapped function names axis {name!r}, but this spmdkit.pmap binds "
        f"only axis_name={shown}.",
        f"use {bound[-1]!r} in the collective (e.g. jax.lax.psum(x, {bound[-1]!r})), or create "
        f"the map with axis_name={name!r}.",
    )


def _argnums(name: str, value: int | Iterable[int]) -> tuple[int, ...]:
    if isinstance(value, int):
        value = (value,)
    out = tuple(sorted(set(value)))
    if any(not isinstance(i, int) or i < 0 for i in out):
        raise MappedAxisError(
            fix(
                f"{name}={value!r} must hold non-negative ints.",
                f"list the positions of the arguments, e.g. {name}=(2,).",
            )
        )
    return out
