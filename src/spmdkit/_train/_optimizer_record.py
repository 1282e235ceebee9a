"""The optimizer's constants, recorded with each checkpoint of ``fit``, to notice another
optimizer on resume.

On the command line the learning rate and the optimizer are flags, recorded and compared on
resume. From Python the optimizer is an ``optax.GradientTransformation``: a pair of functions
whose settings (learning rate, betas, weight decay, a schedule's steps) live in their closures.
A script edited between runs resumed with ``optax.adam(1e-2)`` where the run had ``1e-3``,
without a word. Reading the closures, as below, finds those numbers without running anything,
so the record does not depend on the device count or the state's layout.

The record is a list of ``[where, value]``: ``where`` a path through the transforms' functions
and their closure variables, ``value`` a constant's ``repr`` or a function's qualified name.
Arrays count by dtype, shape and CRC-32 (Python's ``hash`` of bytes changes per process).
Other objects count by their type only: their fields may hold counters that change by
themselves. Another optimizer is a warning, not an error: changing the learning rate of a
resumed run is also done on purpose.

Example:
    >>> import optax
    >>> from spmdkit._train._optimizer_record import optimizer_record, changed_constants
    >>> changed_constants(optimizer_record(optax.adam(1e-3)), optimizer_record(optax.adam(1e-2)))
    ['step_size -0.001 -> -0.01 (in scale)']
    >>> changed_constants(optimizer_record(optax.adam(1e-3)), optimizer_record(optax.sgd(1e-3)))
    ['its transforms differ (scale_by_adam then, nothing else now)']
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np

from spmdkit._crc import crc32

_MAX_ENTRIES = 2000  # an optimizer holds tens; a closure over a whole model stops here
_MAX_DEPTH = 16
_MAX_ARRAY = 1 << 20  # elements: larger arrays count by dtype and shape


def optimizer_record(optimizer: Any) -> list[list[str]]:
    """``[where, value]`` for every constant and function reachable from ``optimizer``'s
    functions (see the module's docstring)."""
    out: list[list[str]] = []
    seen: set[int] = set()

    def walk(v: Any, where: str, depth: int) -> None:
        if len(out) >= _MAX_ENTRIES or depth > _MAX_DEPTH:
            return
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            out.append([where, repr(v)])
        elif isinstance(v, np.generic):
            out.append([where, repr(v.item())])
        elif id(v) in seen:  # shared pieces (a schedule used twice) and cycles: once
            return
        elif isinstance(v, (types.ModuleType, type)):
            seen.add(id(v))
            out.append([where, getattr(v, "__qualname__", v.__name__)])
        else:
            seen.add(id(v))
            _walk_object(v, where, depth, walk, out)

    walk(optimizer, "optimizer", 0)
    return out


def _walk_object(v: Any, where: str, depth: int, walk: Any, out: list[list[str]]) -> None:
    if isinstance(v, types.FunctionType):
        out.append([where, f"function {v.__qualname__}"])
        # The factory that made the function (scale_by_adam for scale_by_adam.<locals>.update_fn)
        # names the constants in its closure: the words of a warning.
        inside = f"{where}>{v.__qualname__.split('.<locals>')[0]}"
        names = v.__code__.co_varnames
        defaults = v.__defaults__ or ()
        for name, d in zip(names[v.__code__.co_argcount - len(defaults):], defaults):
            walk(d, f"{inside}.{name}=", depth + 1)
        for name, d in sorted((v.__kwdefaults__ or {}).items()):
            walk(d, f"{inside}.{name}=", depth + 1)
        for name, cell in zip(v.__code__.co_freevars, v.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # a variable not yet bound
                continue
            walk(contents, f"{inside}.{name}", depth + 1)
    elif isinstance(v, functools.partial):
        walk(v.func, f"{where}.func", depth + 1)
        walk(v.args, f"{where}.args", depth + 1)
        walk(v.keywords, f"{where}.keywords", depth + 1)
    elif isinstance(v, (tuple, list)):
        for i, x in enumerate(v):
            walk(x, f"{where}[{i}]", depth + 1)
    elif isinstance(v, dict):
        for k in sorted(v, key=repr):
            walk(v[k], f"{where}[{k!r}]", depth + 1)
    elif hasattr(v, "shape") and hasattr(v, "dtype"):
        if int(np.prod(v.shape)) > _MAX_ARRAY:  # not read back from the devices for a record
            out.append([where, f"array {v.dtype}{list(v.shape)}"])
            return
        try:
            a = np.ascontiguousarray(np.asarray(v))
        except Exception:  # noqa: BLE001 (an array spread over other processes' devices: its type stands in)
            out.append([where, f"array {v.dtype}{list(v.shape)}"])
        else:
            out.append([where, f"array {a.dtype}{list(a.shape)} crc32 {crc32(a.tobytes()):08x}"])
    elif hasattr(v, "__wrapped__"):  # functools.wraps, jax.jit
        walk(v.__wrapped__, where, depth + 1)
    else:
        out.append([where, type(v).__qualname__])


def changed_constants(then: list[list[str]], now: list[list[str]], most: int = 3) -> list[str]:
    """What differs between two records, in words: at most ``most`` items, then a count."""
    before, after = {w: v for w, v in then}, {w: v for w, v in now}
    said, gone, new = [], set(), set()
    for w, v in after.items():
        if w not in before or before[w] == v:
            continue
        if before[w].startswith("function ") or v.startswith("function "):  # another transform in this place
            gone.add(_factory(before[w]))
            new.add(_factory(v))
        else:
            said.append(_constant_changed(w, before[w], v))
    gone |= {_factory(w) for w in before.keys() - after.keys()}
    new |= {_factory(w) for w in after.keys() - before.keys()}
    if gone or new:
        said.insert(0, f"its transforms differ ({_names(gone - new)} then, {_names(new - gone)} now)")
    unique = list(dict.fromkeys(said))  # a constant shared by init and update is said once
    return unique[:most] + ([f"{len(unique) - most} more"] if len(unique) > most else [])


def _constant_changed(where: str, then: str, now: str) -> str:
    owner, _, name = where.rpartition(">")[2].partition(".")
    return f"{name.rstrip('=') or where} {then} -> {now} (in {owner or 'the optimizer'})"


def _factory(text: str) -> str:
    """The factory named by a record's path (its last ``>`` part) or function value."""
    text = text.removeprefix("function ").rpartition(">")[2]
    return text.split(".<locals>")[0].partition(".")[0].split("[")[0]


# optax's plumbing, in every optimizer: naming it says nothing of what changed
_GLUE = {"optimizer", "chain", "named_chain", "with_extra_args_support", "init_empty_state", "identity"}


def _names(factories: set[str]) -> str:
    names = sorted(factories - _GLUE - {""})
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "") if names else "nothing else"
