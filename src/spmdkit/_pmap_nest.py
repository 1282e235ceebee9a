"""How a :func:`spmdkit.pmap` called inside another one finds its place.

The outermost map owns the devices. While it traces the user's function it keeps
a frame on a per-thread stack; an inner map called during that trace reads the top
frame instead of building a mesh of its own:

- ``probe``: the outermost map compiled for a 1-D mesh, not knowing of any inner
  map. The inner map raises :class:`NestingFound`, and the outer map starts over.
- ``discover``: the outer map traces its function abstractly, as ``jax.vmap`` with
  the same axis names, to learn the name and size of every level. Each inner map
  records its level and computes with ``jax.vmap`` too.
- ``real``: the outer map has built an N-D mesh (one axis per level) and runs its
  function under ``shard_map`` manual over its own axis only; each inner map is a
  nested ``shard_map`` manual over its own axis of the same mesh, so collectives
  may name any enclosing level and outputs stay sharded over every level.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

from spmdkit._errors import AxisNameError, MappedAxisError, fix


class Level(NamedTuple):
    """One nesting level: the axis name collectives use, the mesh axis, the size."""

    user_name: Hashable | None
    mesh_name: Hashable
    size: int


class Frame(NamedTuple):
    mode: str  # "probe" | "discover" | "real"
    depth: int  # 0 for the outermost map
    chain: list[Level]  # shared by all frames of one outermost call


class NestingFound(Exception):
    """Internal: an inner map was called while its outer map traced for a 1-D mesh."""


class _State(threading.local):
    def __init__(self) -> None:  # runs once per thread, on its first use
        self.stack: list[Frame] = []


_STATE = _State()


def frames() -> list[Frame]:
    return _STATE.stack


def top() -> Frame | None:
    # On every call of every map: one attribute read, no function call inside.
    stack = _STATE.stack
    return stack[-1] if stack else None


@contextlib.contextmanager
def pushed(frame: Frame) -> Iterator[None]:
    stack = frames()
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()


def mesh_name(user_name: Hashable | None, depth: int) -> Hashable:
    """The mesh axis of a level: the user's axis name, or a private one per depth."""
    if user_name is not None:
        return user_name
    return "_spmdkit_pmap" if depth == 0 else f"_spmdkit_pmap{depth}"


def enter_level(chain: list[Level], depth: int, user_name: Hashable | None, size: int) -> Level:
    """Record (discover) or check (real) the level an inner map maps over."""
    bound = [lv.user_name for lv in chain[:depth] if lv.user_name is not None]
    if user_name is not None and user_name in bound:
        raise AxisNameError(
            fix(
                f"a nested spmdkit.pmap uses axis_name={user_name!r}, which an enclosing "
                "spmdkit.pmap already binds.",
                "give each level of nested maps its own axis_name, e.g. 'a' outside and 'b' "
                "inside.",
            )
        )
    level = Level(user_name, mesh_name(user_name, depth), size)
    if depth < len(chain):
        if chain[depth] != level:
            have = chain[depth]
            raise MappedAxisError(
                fix(
                    f"two spmdkit.pmap calls at nesting depth {depth} inside one map differ: "
                    f"axis_name={have.user_name!r} of size {have.size} and "
                    f"axis_name={user_name!r} of size {size}.",
                    "inside one outer map, give every inner map at the same depth the same "
                    "axis_name and mapped size (the devices form one mesh, one axis per depth).",
                )
            )
    else:
        chain.append(level)
    return level


def describe(chain: list[Level]) -> str:
    names = ", ".join(f"{lv.user_name!r}={lv.size}" for lv in chain)
    return f"{' x '.join(str(lv.size) for lv in chain)} (axes {names})"


def bound_names(chain: list[Level], depth: int) -> tuple[Any, ...]:
    return tuple(lv.user_name for lv in chain[: depth + 1] if lv.user_name is not None)
