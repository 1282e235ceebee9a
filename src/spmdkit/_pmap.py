"""``jax.pmap`` semantics on ``jax.jit`` + ``jax.shard_map``.

The mapped axis of every argument is split one slice per device over a mesh of
the first ``n`` devices (``n`` = the mapped size), the user's function runs once
per device on its slice (the mapped axis squeezed away, as in pmap), and
collectives name the mesh axis. Outputs stay on the devices, sharded along the
mapped axis, so one parallel map can consume another's output without the data
leaving the devices.

A map called while another traces its function is nested (see ``_pmap_nest``):
the outermost map lays the devices out as an N-D mesh, one axis per level, and
each level is a ``shard_map`` manual over its own axis.

Validation happens in Python before anything is traced, and again only when the
call's structure changes: a call whose pytree structure and mapped size were seen
before (see ``_Fast``) costs one flatten, one dict look-up and one shape check per
mapped leaf on top of the jitted function (across processes, plus assembling each
host argument into a global array).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdkit import _pmap_nest as nest
from spmdkit._errors import (
    AxisNameError,
    MappedAxisError,
    MappedAxisIndexError,
    MappedAxisTypeError,
    ReplicationError,
    SignatureError,
    SpmdkitError,
    fix,
)
from spmdkit._pmap_host import ShardedBatch, replicate, shard, unreplicate
from spmdkit._pmap_lower import Lowered
from spmdkit._pmap_parts import (
    _argnums,
    _check_axes_spec,
    _check_axis_name,
    _check_devices,
    _check_output_leaf,
    _is_axis,
    _local_avals,
    _merge_static,
    _move_misplaced,
    _same_everywhere,
    _signature,
    _spec,
    _to_global,
    _unbound_message,
)
from spmdkit._tree import bad_dtype, broadcast_prefix, keystr

F = TypeVar("F", bound=Callable[..., Any])

_UNBOUND = re.compile(r"unbound axis name: ([^\s.]+)")


class _Plan(NamedTuple):
    """What one call structure (pytree def + static args) compiles to."""

    axes: tuple[int | None, ...]  # one per flat dynamic leaf
    paths: tuple[str, ...]  # printable path per flat leaf
    mapped: tuple[int, ...]  # indices of flat leaves with a mapped axis
    donated: tuple[int, ...]  # indices of flat leaves to donate
    by_size: dict[Any, _Compiled]  # mapped size -> jitted shard_map (see _Compiled.nested)


class _Compiled(NamedTuple):
    jitted: Any  # jit(shard_map(per-device f)) over flat leaves
    shardings: tuple[NamedSharding, ...]  # where each flat leaf is put when moved
    checked: list[str] | None  # paths of out_axes=None outputs (filled while tracing), or None
    mesh: Mesh
    spans_processes: bool = False  # arguments are local slices of global arrays
    nested: bool = False  # nested maps: the mesh depends on the shapes inside, so
    # by_size[n] only marks that; the code lives at by_size[(n, shapes and dtypes)]
    row0: int = 0  # across processes: this process's first index on the mesh's first axis


class _Fast(NamedTuple):
    """A call structure seen and validated before: what a repeat call needs, nothing more."""

    plan: _Plan
    compiled: _Compiled
    n: int  # local mapped size it was validated (and compiled) for
    mapped: tuple[tuple[int, int], ...]  # (flat leaf index, mapped axis) per mapped leaf
    spans: bool  # across processes: host slices are assembled into global arrays
    sig: tuple[Any, ...] | None  # nested maps: the shapes and dtypes the mesh was built for


class _Call(NamedTuple):
    plan: _Plan
    flat: list[Any]
    treedef: Any
    static_vals: tuple[Any, ...]
    n: int


class _ParallelMap:
    """The callable returned by :func:`pmap`."""

    def __init__(self, f, axis_name, in_axes, out_axes, static, devices, backend, axis_size, donate):
        self._f = f
        self._axis_name = axis_name
        self._in_axes = in_axes
        self._out_axes = out_axes
        self._static = static
        self._devices = None if devices is None else tuple(devices)
        self._backend = backend
        self._axis_size = axis_size
        self._donate = donate
        self._plans: dict[Any, _Plan] = {}
        # pytree def (and static arguments, if any) -> _Fast (see __call__).
        self._fast: dict[Any, _Fast] = {}
        # updated=(): wrapping another map must not copy its state (its __dict__) over ours.
        functools.update_wrapper(self, f, updated=())

    # ---- per call -------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        frame = nest.top()
        if frame is not None:
            return self._call_nested(frame, args, kwargs)
        static_vals: tuple[Any, ...] = ()
        dyn_args = args
        if self._static:
            if self._static[-1] >= len(args):  # too few arguments: the checked path says so
                return self._call_checked(self._prepare(args, kwargs))
            static_vals = tuple(args[i] for i in self._static)
            dyn_args = tuple(a for i, a in enumerate(args) if i not in self._static)
        flat, treedef = jax.tree_util.tree_flatten((dyn_args, kwargs))
        try:
            fast = self._fast.get((treedef, _typed(static_vals)) if self._static else treedef)
        except TypeError:  # an unhashable static argument: the checked path says so
            fast = None
        if fast is None or not _still_fits(flat, fast):
            return self._call_checked(self._prepare(args, kwargs, (flat, treedef)))
        # A structure validated before, mapped sizes unchanged: nothing left to check
        # (devices, axis_size and in_axes depend on nothing else), so straight to jit.
        placed = _to_global(flat, fast.plan.axes, fast.compiled) if fast.spans else flat
        compiled = fast.compiled
        try:
            out = compiled.jitted(*placed)
        except Exception as e:
            call = _Call(fast.plan, flat, treedef, static_vals, fast.n)
            out, compiled = self._recover(call, compiled, placed, e)
            if compiled is not fast.compiled:  # the function nests after all: validate again
                self._fast.pop((treedef, _typed(static_vals)) if self._static else treedef, None)
        if compiled.checked is None:
            return out
        return self._finish(compiled, out, _Call(fast.plan, flat, treedef, static_vals, fast.n))

    def _call_checked(self, call: _Call) -> Any:
        """The validating path: the first call of a structure, or one whose sizes changed."""
        compiled = self._compiled(call)
        out, compiled = self._run(call, compiled, self._placed(compiled, call.flat, call))
        out = self._finish(compiled, out, call)
        key = (call.treedef, _typed(call.static_vals)) if self._static else call.treedef
        self._fast[key] = _Fast(
            call.plan, compiled, call.n, tuple((i, call.plan.axes[i]) for i in call.plan.mapped),
            compiled.spans_processes, _signature(call.flat) if compiled.nested else None,
        )
        return out

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Trace and lower for these arguments, like ``jax.pmap(f).lower``."""
        if nest.top() is not None:
            raise MappedAxisError(
                fix("spmdkit.pmap(...).lower was called inside another map's trace.",
                    "lower the outermost map instead.")
            )
        call = self._prepare(args, kwargs)
        compiled = self._compiled(call)
        flat = self._placed(compiled, call.flat, call)
        try:
            lowered = compiled.jitted.lower(*flat)
        except nest.NestingFound:
            compiled = self._nested_for(call)
            lowered = compiled.jitted.lower(*flat)
        return Lowered(lowered, self, call, compiled)

    def _prepare(self, args, kwargs, flattened=None) -> _Call:
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
        flat, treedef = flattened or jax.tree_util.tree_flatten((dyn_args, kwargs))
        key = (treedef, _typed(static_vals))
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
            plan = self._plans[key] = self._plan(args, dyn_args, kwargs)
        return _Call(plan, flat, treedef, static_vals, self._mapped_size(plan, flat))

    def _placed(self, compiled: _Compiled, flat: list[Any], call: _Call) -> list[Any]:
        if not compiled.spans_processes:
            return flat
        return _to_global(flat, call.plan.axes, compiled)

    def _compiled(self, call: _Call) -> _Compiled:
        compiled = call.plan.by_size.get(call.n)
        if compiled is None:
            compiled = call.plan.by_size[call.n] = self._compile(call)
        if compiled.nested:
            key = (call.n, _signature(call.flat))
            compiled = call.plan.by_size.get(key) or self._nested_for(call)
        return compiled

    def _nested_for(self, call: _Call) -> _Compiled:
        compiled = call.plan.by_size[(call.n, _signature(call.flat))] = self._compile_nested(call)
        call.plan.by_size[call.n] = compiled
        return compiled

    def _run(self, call: _Call, compiled: _Compiled, flat: list[Any]) -> tuple[Any, _Compiled]:
        """The outputs, and the code that made them (nested if an inner map showed up)."""
        try:
            return compiled.jitted(*flat), compiled
        except Exception as e:
            return self._recover(call, compiled, flat, e)

    def _recover(self, call: _Call, compiled: _Compiled, flat: list[Any], error: Exception):
        """After jit raised: nest, move misplaced arguments, or re-raise ``error``."""
        if isinstance(error, nest.NestingFound):
            nested = self._nested_for(call)  # placed anew: its mesh is not the 1-D one
            return self._run(call, nested, self._placed(nested, call.flat, call))
        if isinstance(error, SpmdkitError):
            raise error
        if isinstance(error, TypeError):
            _check_dtypes(call)
        # jit refuses (or trips over) an array committed to another layout: one
        # device, or another mesh. pmap moves such arrays; so do we, on this slow
        # path only, and let any other error through unchanged.
        moved = _move_misplaced(flat, compiled.shardings)
        if moved is None:
            raise error
        return compiled.jitted(*moved), compiled

    def _finish(self, compiled: _Compiled, out: Any, call: _Call) -> Any:
        if compiled.checked is None:
            return out
        out, same = out
        if isinstance(same, jax.core.Tracer):
            # Under an enclosing trace no value can be read: check statically that
            # no out_axes=None output depends on the device (jax.vmap's rule).
            bad = [p for i, p in enumerate(compiled.checked) if self._varies(call, i)]
        else:
            same = np.asarray(same.addressable_data(0))
            bad = [p for p, ok in zip(compiled.checked, same) if not ok]
        if bad:
            raise ReplicationError(
                fix(
                    f"out_axes=None at {', '.join(bad)}, but that value differs between the "
                    f"{compiled.mesh.size} devices, so there is no single copy to return.",
                    (f"reduce it across devices first (jax.lax.pmean / psum over {self._axis_name!r}), "
                     if self._axis_name is not None else
                     # the map binds no name to reduce over: say how to give it one
                     "reduce it across devices first: name the axis, spmdkit.pmap(f, axis_name='i', ...), and "
                     "return jax.lax.pmean(x, 'i') (or psum), ")
                    + "or return it per device with out_axes=0 there.",
                )
            )
        return out

    def _varies(self, call: _Call, which: int) -> bool:
        """Whether the ``which``-th out_axes=None output depends on the mapped axis."""
        chain = [nest.Level(self._axis_name, nest.mesh_name(self._axis_name, 0), call.n)]
        body = self._body(call, chain, 0, "discover", None)

        def pick(*flat):
            out = body(*flat)
            pairs = broadcast_prefix(self._out_axes, out, prefix_name="out_axes",
                                     tree_name="output", is_prefix_leaf=_is_axis, example="")
            leaves = jax.tree_util.tree_leaves(out)
            return [x for x, (_, ax) in zip(leaves, pairs) if ax is None][which]

        try:
            jax.eval_shape(jax.vmap(pick, in_axes=call.plan.axes, out_axes=None,
                                    axis_name=chain[0].mesh_name, axis_size=call.n), *call.flat)
        except ValueError as e:
            if "out_axes" in str(e):
                return True
            raise
        except NotImplementedError as e:
            _no_groups_in_vmap(e, "out_axes=None under an enclosing jax.jit (or other trace) is checked by tracing "
                               "the function with jax.vmap, where no value can be read",
                               "call the map outside jax.jit, where the check reads the values, or return that "
                               "output with out_axes=0 and take its row 0")
        return False

    def _mapped_size(self, plan: _Plan, flat: list[Any]) -> int:
        n = first = None
        for i in plan.mapped:
            x, ax = flat[i], plan.axes[i]
            shape = getattr(x, "shape", None)
            if shape is None or len(shape) <= ax:
                what = (
                    f"{type(x).__name__} with no axes"
                    if shape is None
                    else f"an array of shape {tuple(shape)}"
                )
                error = MappedAxisError if not shape else MappedAxisIndexError
                raise error(
                    fix(
                        f"{plan.paths[i]} is {what}, so it has no axis {ax} to map over "
                        f"(in_axes gives {ax} there).",
                        f"give {plan.paths[i]} a device axis at position {ax} (spmdkit.shard(x) "
                        "adds a leading one), or use in_axes=None there to broadcast it to every "
                        "device.",
                    )
                )
            size = shape[ax]
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.is_fully_addressable:
                size //= jax.process_count()  # a global array from a previous call: count local rows
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
        if self._axis_size is not None and n != self._axis_size:
            raise MappedAxisError(
                fix(
                    f"axis_size={self._axis_size}, but {plan.paths[first]} has size {n} along "
                    f"mapped axis {plan.axes[first]}.",
                    f"pass arguments of size {self._axis_size} along the mapped axis, or drop "
                    "axis_size.",
                )
            )
        if nest.top() is None:
            self._check_fits(plan, first, n)
        return n

    def _check_fits(self, plan: _Plan, first: int, n: int) -> None:
        available = len(self._pool(local=True))
        if 1 <= n <= available:
            return
        where = "device(s) were given with devices=" if self._devices else "local device(s) are available"
        if self._devices is not None and 1 <= n <= len(jax.local_devices(backend=self._backend)):
            # The machine has enough: devices= is what limits the map.
            remedy = (f"pass as many devices as the mapped size in devices= (e.g. "
                      f"devices=jax.local_devices()[:{n}]), or map a smaller leading axis: reshape it to "
                      f"[{available}, per_device, ...]: x, mask = spmdkit.shard(x, {available}) (mask marks the real rows).")
        else:
            remedy = (f"reshape it to [{available}, per_device, ...]: x, mask = spmdkit.shard(x) (mask marks the real "
                      "rows), or "
                      f"simulate more devices: spmdkit.use_host_devices({max(n, 1)}) before any "
                      f"JAX work (the spmdkit command: --host-devices {max(n, 1)} or "
                      # Only the command (and spmdkit.initialize) reads the variable: set for a
                      # plain script, it changed nothing and the same error came back.
                      f"SPMDKIT_HOST_DEVICES={max(n, 1)}, which a plain Python script does not read).")
        raise MappedAxisError(
            fix(
                f"{plan.paths[first]} has size {n} along mapped axis {plan.axes[first]}, "
                f"but {available} {where}"
                + (" and a mapped axis of size 0 maps to no device." if n < 1 else "."),
                remedy,
            )
        )

    def _pool(self, local: bool) -> list[Any]:
        """Devices this map may use: devices=, or this process's (local) / every process's."""
        if self._devices is not None:
            return [d for d in self._devices if not local or d.process_index == jax.process_index()]
        return list(jax.local_devices(backend=self._backend) if local else jax.devices(self._backend))

    def _mesh_devices(self, count: int) -> np.ndarray:
        """The first ``count`` devices of each process, process by process (pmap's order)."""
        pool = self._pool(local=False)
        if jax.process_count() == 1:
            return np.array(pool[:count])
        out = []
        for p in sorted({d.process_index for d in pool}):
            out += [d for d in pool if d.process_index == p][:count]
        return np.array(out)

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
        # Donated positions count every positional argument; static ones hold no buffer.
        dyn_pos = [i for i in range(len(args)) if i not in self._static]
        donated = tuple(
            j
            for j, ((path, _), _) in enumerate(zip(arg_pairs, axes))
            if dyn_pos[path[0].idx] in self._donate
        )
        return _Plan(axes=axes, paths=paths, mapped=mapped, donated=donated, by_size={})

    def _body(self, call: _Call, chain: list[nest.Level], depth: int, mode: str, checked):
        """The per-device function over flat leaves (squeezed in, expanded out)."""
        f, static, axes, out_axes = self._f, self._static, call.plan.axes, self._out_axes
        treedef, static_vals = call.treedef, call.static_vals
        names = [lv.mesh_name for lv in chain[: depth + 1]]
        bound = nest.bound_names(chain, depth)

        def per_device(*flat):
            if mode != "discover":
                flat = [x if ax is None else jax.lax.squeeze(x, (ax,)) for x, ax in zip(flat, axes)]
            dyn_args, kwargs = jax.tree_util.tree_unflatten(treedef, list(flat))
            call_args = _merge_static(dyn_args, static, static_vals)
            with nest.pushed(nest.Frame(mode, depth, chain)):
                try:
                    out = f(*call_args, **kwargs)
                except NameError as e:
                    m = _UNBOUND.search(str(e))
                    if m is None:
                        raise
                    raise AxisNameError(_unbound_message(m.group(1), bound)) from None
            pairs = broadcast_prefix(
                out_axes,
                out,
                prefix_name="out_axes",
                tree_name="output",
                is_prefix_leaf=_is_axis,
                example="e.g. out_axes=(0, None) for a function returning (per_device, replicated)",
            )
            for (path, ax), leaf in zip(pairs, jax.tree_util.tree_leaves(out)):
                _check_output_leaf(keystr("output", path), leaf, ax)
            if mode == "discover":
                return out
            out_leaves, out_def = jax.tree_util.tree_flatten(out)
            result = jax.tree_util.tree_unflatten(
                out_def,
                [
                    x if ax is None else jax.lax.expand_dims(x, (ax,))
                    for x, (_, ax) in zip(out_leaves, pairs)
                ],
            )
            if checked is None:
                return result
            checked[:] = [keystr("output", p) for p, ax in pairs if ax is None]
            flags = [_same_everywhere(x, names) for x, (_, ax) in zip(out_leaves, pairs) if ax is None]
            return result, jnp.stack(flags) if flags else jnp.ones((0,), bool)

        return per_device

    def _out_specs(self, name: Hashable, checked) -> Any:
        specs = jax.tree.map(functools.partial(_spec, name), self._out_axes, is_leaf=lambda x: x is None)
        return specs if checked is None else (specs, P())

    def _has_none_out(self) -> bool:
        leaves = jax.tree_util.tree_leaves(self._out_axes, is_leaf=lambda x: x is None)
        return any(ax is None for ax in leaves)

    def _compile(self, call: _Call) -> _Compiled:
        """A 1-D mesh; an inner map met while tracing raises NestingFound (see _run)."""
        level = nest.Level(self._axis_name, nest.mesh_name(self._axis_name, 0), call.n)
        mesh = Mesh(self._mesh_devices(call.n), (level.mesh_name,))
        checked = [] if self._has_none_out() else None
        in_specs = tuple(_spec(level.mesh_name, ax) for ax in call.plan.axes)
        # check_vma=False keeps pmap's semantics: the gradient with respect to a
        # broadcast (in_axes=None) argument is per device, not already summed
        # across devices (see the README on N-times-too-large gradients).
        mapped = jax.shard_map(
            self._body(call, [level], 0, "probe", checked),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=self._out_specs(level.mesh_name, checked),
            check_vma=False,
        )
        shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
        jitted = jax.jit(mapped, in_shardings=shardings, donate_argnums=call.plan.donated)
        spans, row0 = _own_rows(mesh)
        return _Compiled(jitted, shardings, checked, mesh, spans_processes=spans, row0=row0)

    def _compile_nested(self, call: _Call) -> _Compiled:
        """An N-D mesh, one axis per nesting level, learnt by tracing with jax.vmap."""
        chain = [nest.Level(self._axis_name, nest.mesh_name(self._axis_name, 0), call.n)]
        discover = self._body(call, chain, 0, "discover", None)
        try:
            jax.eval_shape(
                # out_axes=0: this trace only learns the levels; out_axes=None is checked later.
                jax.vmap(discover, in_axes=call.plan.axes, out_axes=0,
                         axis_name=chain[0].mesh_name, axis_size=call.n),
                *_local_avals(call.flat, call.plan.axes, call.n),
            )
        except NotImplementedError as e:
            _no_groups_in_vmap(e, "nested spmdkit.pmap calls learn their levels by tracing the function with "
                               "jax.vmap", "make each group a nesting level of its own (an inner spmdkit.pmap over "
                               "the group's devices, whose psum over that inner axis is the group's sum), or map "
                               "once with spmdkit.pmap and pass axis_index_groups there")
        sizes = [lv.size for lv in chain]
        total = int(np.prod(sizes))
        available = len(self._pool(local=True))
        if total > available:
            raise MappedAxisError(
                fix(
                    f"nested spmdkit.pmap calls need {nest.describe(chain)} = {total} devices, "
                    f"but {available} are available.",
                    f"make the mapped sizes multiply to at most {available}, or simulate more "
                    f"devices: spmdkit.use_host_devices({total}) before any JAX work.",
                )
            )
        names = tuple(lv.mesh_name for lv in chain)
        mesh = Mesh(self._mesh_devices(total).reshape(-1, *sizes[1:]), names)
        checked = [] if self._has_none_out() else None
        in_specs = tuple(_spec(names[0], ax) for ax in call.plan.axes)
        mapped = jax.shard_map(
            self._body(call, chain, 0, "real", checked),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=self._out_specs(names[0], checked),
            axis_names={names[0]},
            check_vma=False,
        )
        # No in_shardings: an argument already sharded over the inner axes too (the
        # output of the previous nested call) is consumed where it is.
        jitted = jax.jit(mapped, donate_argnums=call.plan.donated)
        shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
        # Across processes the outer axis spans them (each process holds its own rows of
        # it, every inner level within the process), as jax.pmap's one axis does.
        spans, row0 = _own_rows(mesh)
        return _Compiled(jitted, shardings, checked, mesh, spans_processes=spans, nested=True, row0=row0)

    def _call_nested(self, frame: nest.Frame, args, kwargs) -> Any:
        """Called while an outer map traces: map over the next axis of its mesh."""
        if frame.mode == "probe":
            raise nest.NestingFound()
        if self._devices is not None:
            raise MappedAxisError(
                fix(
                    "a nested spmdkit.pmap was created with devices=; the outermost map owns "
                    "the devices.",
                    "pass devices= to the outermost spmdkit.pmap only.",
                )
            )
        call = self._prepare(args, kwargs)
        depth = frame.depth + 1
        level = nest.enter_level(frame.chain, depth, self._axis_name, call.n)
        if frame.mode == "discover":
            body = self._body(call, frame.chain, depth, "discover", None)
            batched = jax.vmap(body, in_axes=call.plan.axes, out_axes=self._out_axes,
                               axis_name=level.mesh_name, axis_size=call.n)
            try:
                return batched(*call.flat)
            except ValueError as e:
                if "out_axes" not in str(e) or isinstance(e, SpmdkitError):
                    raise
                raise ReplicationError(
                    fix(
                        f"a nested spmdkit.pmap (axis_name={self._axis_name!r}) has out_axes=None "
                        "on an output that differs between its devices.",
                        "reduce it across the inner axis first (jax.lax.pmean / psum), or "
                        "return it per device with out_axes=0 there.",
                    )
                ) from None
        in_specs = tuple(_spec(level.mesh_name, ax) for ax in call.plan.axes)
        mapped = jax.shard_map(
            self._body(call, frame.chain, depth, "real", None),
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=in_specs,
            out_specs=self._out_specs(level.mesh_name, None),
            axis_names={level.mesh_name},
            check_vma=False,
        )
        return mapped(*call.flat)

    def __repr__(self) -> str:
        return f"spmdkit.pmap({getattr(self._f, '__name__', self._f)!r}, axis_name={self._axis_name!r})"


def pmap(
    f: F,
    axis_name: Hashable | None = None,
    in_axes: Any = 0,
    out_axes: Any = 0,
    static_broadcasted_argnums: int | Iterable[int] = (),
    *,
    devices: Sequence[Any] | None = None,
    backend: str | None = None,
    axis_size: int | None = None,
    donate_argnums: int | Iterable[int] = (),
) -> F:
    """Map ``f`` over devices with ``jax.pmap`` semantics, built on jit + shard_map.

    The mapped axis (``in_axes``, the leading one by default) is split one slice per
    device; ``f`` sees one slice with that axis removed. A mapped size below the
    device count uses that many devices; above it is an error. ``in_axes=None``
    broadcasts an argument to every device. Collectives (``jax.lax.psum``, ``pmean``,
    ``all_gather``, ``axis_index``) name ``axis_name``. Compiled once per input
    signature; outputs stay sharded on the devices. ``out_axes=None`` returns one
    copy of a value that must be the same on every device (checked). A map called
    inside another map's function nests: the devices form one mesh, one axis per
    level. ``devices``, ``backend``, ``axis_size`` and ``donate_argnums`` mean what
    they mean for ``jax.pmap``; ``.lower(*args)`` gives a ``Lowered``.

    Example:
        >>> import jax, jax.numpy as jnp, spmdkit
        >>> n = jax.local_device_count()
        >>> total = spmdkit.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
        >>> total(jnp.ones(n)).tolist() == [float(n)] * n
        True
    """
    if not callable(f):
        raise SignatureError(
            fix(f"spmdkit.pmap: f must be callable, got {type(f).__name__}.",
                "pass the function to map: spmdkit.pmap(step, axis_name='batch').")
        )
    try:
        hash(axis_name)
    except TypeError:
        raise AxisNameError(
            fix(f"axis_name={axis_name!r} is not hashable.", "use a string such as 'batch'.")
        ) from None
    _check_axis_name(axis_name)
    _check_devices(devices)
    static = _argnums("static_broadcasted_argnums", static_broadcasted_argnums)
    donate = _argnums("donate_argnums", donate_argnums)
    if set(static) & set(donate):
        raise MappedAxisError(
            fix(
                f"argument(s) {sorted(set(static) & set(donate))} are both static and donated.",
                "a static argument holds no device buffer to donate: drop it from donate_argnums.",
            )
        )
    if axis_size is not None and (not isinstance(axis_size, int) or axis_size < 1):
        raise MappedAxisError(fix(f"axis_size={axis_size!r}.", "pass a positive int, or None."))
    _check_axes_spec("in_axes", in_axes)
    _check_axes_spec("out_axes", out_axes)
    made_args = (f, axis_name, in_axes, out_axes, static, devices, backend, axis_size, donate)
    # The seeds write `pmap(f)(x)` inline, over and over; like jax.pmap, the same
    # (f, axes) must reuse its compiled code rather than build a new map each time.
    try:
        key = (f, axis_name, _freeze(in_axes), _freeze(out_axes), static,
               None if devices is None else tuple(devices), backend, axis_size, donate)
        hash(key)
    except TypeError:
        return _ParallelMap(*made_args)  # type: ignore[return-value]
    made = _MAPS.pop(key, None) or _ParallelMap(*made_args)
    _MAPS[key] = made  # re-inserted: the dict's order is least recently used first
    if len(_MAPS) > _MAX_MAPS:
        del _MAPS[next(iter(_MAPS))]
    return made  # type: ignore[return-value]


_MAPS: dict[Any, _ParallelMap] = {}
_MAX_MAPS = 256


def _own_rows(mesh: Mesh) -> tuple[bool, int]:
    """Whether ``mesh`` spans processes, and this process's first index on its first axis.

    Each process's devices are contiguous along the first axis (see _mesh_devices)."""
    me = jax.process_index()
    devices = list(mesh.devices.flat)
    if all(d.process_index == me for d in devices):
        return False, 0
    first = next(i for i, d in enumerate(devices) if d.process_index == me)
    return True, first // (len(devices) // mesh.devices.shape[0])


def _still_fits(flat: list[Any], fast: _Fast) -> bool:
    """Whether every mapped leaf still has the size ``fast`` was validated for (and, for
    nested maps, every leaf its shape and dtype: they decide the mesh)."""
    if fast.sig is not None and _signature(flat) != fast.sig:
        return False
    n = fast.n
    try:
        for i, ax in fast.mapped:
            if flat[i].shape[ax] != n:
                x = flat[i]
                # Across processes, a previous call's output is global: n rows per process.
                if not (fast.spans and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                        and not x.is_fully_addressable and x.shape[ax] == n * jax.process_count()):
                    return False
    except (AttributeError, IndexError, TypeError):
        return False  # not an array, or too few axes: the checked path says what is wrong
    return True


def _typed(static_vals: tuple[Any, ...]) -> tuple[Any, ...]:
    """Static arguments as cache keys: ``1``, ``1.0`` and ``True`` are equal and hash alike
    but trace to different programs (int, float, ``flag is True``), so each is keyed with
    its type, as jax.jit does."""
    return tuple((type(v), v) for v in static_vals)


def _check_dtypes(call: _Call) -> None:
    """After jit raised a TypeError: name an argument JAX cannot hold (strings, objects)."""
    for i, x in enumerate(call.flat):
        dtype = bad_dtype(x)
        if dtype is not None:
            what = f"has numpy dtype {dtype} (shape {np.shape(x)})"
        elif isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)) or hasattr(
                x, "__jax_array__"):
            continue
        else:
            what = f"is a {type(x).__name__}, not an array"
        raise MappedAxisTypeError(
            fix(f"{call.plan.paths[i]} {what}; arguments go to the devices, which hold numbers and bools only.",
                f"drop {call.plan.paths[i]} from the arguments (keep it on the host, or make it static with "
                "static_broadcasted_argnums), or encode it as integers (e.g. np.unique(values, "
                "return_inverse=True)[1]).")
        )


def _freeze(spec: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=lambda x: x is None)
    return treedef, tuple(leaves)


def _no_groups_in_vmap(error: NotImplementedError, why: str, remedy: str) -> None:
    """Name ``axis_index_groups`` when jax.vmap refused it (its raw error names neither the map nor a fix)."""
    if "axis_index_groups" not in str(error):
        raise error
    raise MappedAxisError(fix(f"a collective with axis_index_groups cannot run here: {why}, and jax.vmap has no "
                              "axis_index_groups.", remedy + ".")) from None


__all__ = ["pmap", "replicate", "unreplicate", "shard", "ShardedBatch"]
