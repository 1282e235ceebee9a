"""Ahead-of-time ``spmdkit.pmap``: ``.lower(*args)`` -> :class:`Lowered` -> :class:`Compiled`.

Thin wrappers over JAX's own jit ``Lowered`` / ``Compiled`` of the map's
``jit(shard_map(...))``: they add what ``jax.pmap``'s do on top, argument checking
against the lowered signature (structure, shape, dtype, with the path of the
first difference) and the same output handling as a plain call.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from spmdkit._errors import SignatureError, fix
from spmdkit._pmap_parts import _move_misplaced


def _aval(x: Any) -> tuple[tuple[int, ...], Any]:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = np.result_type(x)
    return tuple(np.shape(x)), jax.dtypes.canonicalize_dtype(dtype)


class Lowered:
    """A map lowered for one signature; ``jax.stages.Lowered``'s inspection methods."""

    def __init__(self, lowered: Any, pm: Any, call: Any, compiled: Any):
        self._lowered = lowered
        self._pm = pm
        self._call = call
        self._compiled = compiled

    def __getattr__(self, name: str) -> Any:
        # Anything else jax's Lowered offers; it describes the flat argument list.
        return getattr(self._lowered, name)

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self._lowered.as_text(*args, **kwargs)

    def compiler_ir(self, *args: Any, **kwargs: Any) -> Any:
        return self._lowered.compiler_ir(*args, **kwargs)

    def cost_analysis(self) -> Any:
        return self._lowered.cost_analysis()

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Compiled:
        if compiler_options is None:
            executable = self._lowered.compile()
        else:
            executable = self._lowered.compile(compiler_options=compiler_options)
        return Compiled(executable, self._pm, self._call, self._compiled)


class Compiled:
    """A compiled map: call it with arguments of the lowered signature."""

    def __init__(self, executable: Any, pm: Any, call: Any, compiled: Any):
        self._exe = executable
        self._pm = pm
        self._call = call
        self._compiled = compiled
        self._avals = [_aval(x) for x in call.flat]

    def __getattr__(self, name: str) -> Any:
        # Anything else jax's Compiled offers; it describes the flat argument list.
        return getattr(self._exe, name)

    def as_text(self) -> str | None:
        return self._exe.as_text()

    def cost_analysis(self) -> Any:
        return self._exe.cost_analysis()

    def memory_analysis(self) -> Any:
        return self._exe.memory_analysis()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pm, call = self._pm, self._call
        dyn = args
        if pm._static:
            static_vals = tuple(args[i] for i in pm._static if i < len(args))
            # Typed: 1, 1.0 and True are equal but compile differently (see _pmap._typed).
            typed = [(type(v), v) for v in static_vals]
            if typed != [(type(v), v) for v in call.static_vals]:
                raise SignatureError(
                    fix(
                        f"static arguments {static_vals!r} differ from the ones this was lowered "
                        f"with, {call.static_vals!r}.",
                        "lower and compile again for the new static values (or call the map, "
                        "which compiles as needed).",
                    )
                )
            dyn = tuple(a for i, a in enumerate(args) if i not in pm._static)
        flat, treedef = jax.tree_util.tree_flatten((dyn, kwargs))
        if treedef != call.treedef:
            raise SignatureError(
                fix(
                    f"the arguments have structure {treedef}, but this was compiled for "
                    f"{call.treedef}.",
                    "call it with arguments of the structure it was lowered with, or call the "
                    "map itself, which compiles for each new structure.",
                )
            )
        for path, x, want in zip(call.plan.paths, flat, self._avals):
            got = _aval(x)
            if got != want:
                raise SignatureError(
                    fix(
                        f"{path} has shape {got[0]} and dtype {got[1]}, but this was compiled "
                        f"for shape {want[0]} and dtype {want[1]}.",
                        "pass an argument of the lowered shape and dtype, or lower again for "
                        "the new one.",
                    )
                )
        flat = pm._placed(self._compiled, flat, call)
        try:
            out = self._exe(*flat)
        except Exception:
            moved = _move_misplaced(flat, self._compiled.shardings)
            if moved is None:
                raise
            out = self._exe(*moved)
        return pm._finish(self._compiled, out, call)
