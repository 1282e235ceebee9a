"""Hardware targets for ``spmdkit plan``: peak rates, bandwidths and an alpha-beta link model.

A target file is JSON (``"format": "spmdkit-target"``, version 1), written by hand from a
datasheet or by ``spmdkit calibrate`` from measurements; all figures are per device in SI
units. ``"cpu"`` names a built-in target for this machine, its compute rate and memory
bandwidth measured in a fraction of a second.

A collective over ``n`` devices moving ``B`` bytes costs ``s(n) * alpha + w(n, B) * beta``
(ring algorithms): all-reduce ``2(n-1)`` steps and ``2(n-1)/n * B`` bytes on the wire;
all-gather (``B``: the gathered output), reduce-scatter (``B``: the input) and all-to-all
``n-1`` steps and ``(n-1)/n * B``; a collective permute one step and ``B``.

Two optional fields price what a loop of nothing but collectives does not show:
``op_overhead`` (seconds per operation a device executes) and ``collective_sync_ops``
(``{"<devices in the group>": operations}``: what each collective adds when it sits between
computation, where its devices wait for each other, in units of the step's mean time per
operation; the planner adds it per execution, loop trips included, and never overlaps it with
compute). A file without them prices neither. A third, ``cache_bandwidth`` (``[[bytes,
bytes/s], ...]``), is the rate of an elementwise operation moving that many bytes of data the
step just made; without it such bytes move at ``memory_bandwidth``. A fourth,
``transpose_bandwidth`` (the same pairs), is the rate of a transposition (a copy that moves the
minor dimension) of that many bytes; without it a transposition moves as other warm data. A link's optional ``per_operand`` (default
false) says that the runtime runs a collective of several operands as one call per operand
(gloo between processes does), so alpha is paid per operand. A link's optional ``groups``
(``{"<devices in the group>": link}``) prices collectives over groups of that size by their own
alpha-beta, where the ring's step count does not scale the link to them: what such a collective
costs between computation, its devices' waits included (no ``collective_sync_ops`` is added).
Like its alpha and beta, a link's groups under ``links`` price the kinds without an entry of their
own in ``collectives``; a group pays alpha per operand as its link does.

Example:
    >>> t = Target(name="toy", source="example", devices_per_host=8, peak_flops={"float32": 1e12},
    ...            memory_bandwidth=1e11, links={"intra_host": Link(alpha=1e-5, beta=1e-9)})
    >>> round(collective_time(t, "all_reduce", 1000, 4, "intra_host"), 9)  # 6 steps, 1500 bytes
    6.15e-05
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import json
import math
import numbers
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from spmdkit._errors import ConfigError, fix
from spmdkit._types import finite_float

FORMAT = "spmdkit-target"
VERSION = 1
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
LINKS = ("intra_host", "inter_host")
# The example targets shipped with the project (datasheet figures): a name here loads the file.
EXAMPLES_DIR = Path(__file__).resolve().parent / "targets"
# Collectives between simulated CPU devices: a rendezvous of threads, then memory copies.
# Used by the built-in "cpu" target when no calibration file is given (``spmdkit calibrate``
# measures these on the machine).
CPU_ALPHA = 2e-5
# Two processes on this machine through gloo: ~1.6 ms for 8 floats, ~30 ms for 4 MB (an all-reduce
# of two: 2 steps, 4 MB on the wire).
CPU_INTER_HOST = (8e-4, 7.5e-9)
# The computation between collectives when the cpu target measures their waits (rows, width of a
# matmul per device per trip).
SYNC_SHAPE = (64, 256)


class TargetError(ConfigError):
    """A target file or name that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class Link:
    """``alpha``: seconds per step of a ring algorithm; ``beta``: seconds per byte on the wire."""

    alpha: float
    beta: float
    # Optional: a piecewise fit by payload size, ((max_bytes or None for the rest, Link), ...);
    # ``spmdkit calibrate`` writes one where a single line misses small or large payloads.
    pieces: tuple = ()
    # Optional (default False): the runtime runs a collective of several operands (XLA combines
    # a step's gradient all-reduces into one) as one call per operand, so ``alpha`` is paid per
    # operand (gloo between processes does); False: once per collective.
    per_operand: bool = False
    # Optional: ((devices in the group, Link), ...), alpha-beta measured over a group of that
    # many devices on this link, for groups the ring's step count prices wrongly (a pair of one
    # process's devices in a multi-process CPU program costs most of what all its devices do; the
    # cpu target of a lone process times every group size, as a step between computation pays
    # it); other sizes scale from this link by the ring's steps.
    groups: tuple = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.groups, tuple) and not self.groups):
            object.__setattr__(self, "groups", _group_links(self.groups, self.per_operand))

    def at(self, nbytes: float) -> Link:
        """The (alpha, beta) for a payload of ``nbytes``: its piece, or this link without pieces."""
        for limit, piece in self.pieces:
            if limit is None or nbytes <= limit:
                return piece
        return self

    def for_group(self, n: int) -> Link:
        """The link for a group of ``n`` devices: its own measured one (:attr:`groups`), else this.

        Example:
            >>> Link(1e-4, 1e-9, groups=((2, Link(3e-4, 2e-9)),)).for_group(2).alpha
            0.0003
        """
        return next((link for size, link in self.groups if size == n), self)


_GROUP_LINKS_HOW = ("pass groups=((2, Link(alpha, beta)), ...) or {2: Link(alpha, beta)}: each group size (a whole "
                    "number >= 2) once, with a link of its own without groups.")


def _group_size(size: Any) -> int | None:
    if isinstance(size, bool):
        return None
    if isinstance(size, numbers.Integral):  # NumPy's integers too
        return int(size)
    if isinstance(size, numbers.Real) and float(size).is_integer():
        return int(size)
    return None


def _group_links(groups: Any, per_operand: bool) -> tuple:
    """``Link.groups`` as sorted ``((size, Link), ...)``, checked: a Target built in Python priced
    a group given as ``{"2": link}`` without it, and wrote a file that priced with it. A group's
    link pays alpha per operand as its link does (its own flag is replaced, so that
    ``dataclasses.replace(link, per_operand=...)`` carries its groups along)."""
    where = "Link(groups=...)"
    if groups is None:
        return ()
    try:
        pairs = [tuple(p) for p in (groups.items() if isinstance(groups, dict) else groups)]
    except TypeError:
        raise TargetError(fix(f"{where}: {groups!r} is not (group size, Link) pairs.", _GROUP_LINKS_HOW)) from None
    out: dict[int, Link] = {}
    for pair in pairs:
        size = _group_size(pair[0]) if len(pair) == 2 else None
        if size is None or size < 2 or not isinstance(pair[1], Link) or pair[1].groups:
            raise TargetError(fix(f"{where}: {pair!r} is not a group size >= 2 and a Link without groups.",
                                  _GROUP_LINKS_HOW))
        if size in out:
            raise TargetError(fix(f"{where}: the group size {size} is given twice.", _GROUP_LINKS_HOW))
        out[size] = dataclasses.replace(pair[1], per_operand=per_operand)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Target:
    """One device kind and how its devices are linked (all figures per device)."""

    name: str
    source: str
    devices_per_host: int
    peak_flops: dict[str, float]
    memory_bandwidth: float
    links: dict[str, Link]
    memory_per_device: float | None = None
    collectives: dict[str, dict[str, Link]] = field(default_factory=dict)
    measurements: list[Any] = field(default_factory=list)
    # Optional (default 0): seconds of fixed cost per operation a device executes (kernel
    # launch, thunk dispatch); small models on CPU spend much of a step there.
    op_overhead: float = 0.0
    # Optional (default none): what a collective over a group of ``n`` devices costs on top of
    # its alpha-beta time when it sits between computation, by ``n``, in units of the step's
    # mean time per operation (compute seconds / operations): every device of the group waits
    # there for the others, longer the longer their operations take (simulated CPU devices share
    # a few cores); the alpha-beta figures, measured in a loop of nothing but collectives, do
    # not see it.
    collective_sync_ops: dict[int, float] = field(default_factory=dict)
    # Optional: what ``spmdkit calibrate`` warned of when it wrote the file (a busy machine, a
    # smoke run); the planner shows them as a note.
    warnings: tuple[str, ...] = ()
    # Optional (default none: memory_bandwidth at every size): ``(bytes, bytes/s)`` pairs, the
    # rate of an elementwise operation that reads and writes ``bytes`` of data a previous
    # operation just touched, on every device at once. Small ones run from the caches, many
    # times faster than memory on a CPU; the planner prices such warm bytes by this curve.
    cache_bandwidth: tuple[tuple[float, float], ...] = ()
    # Optional (default none: no dearer than other warm data): ``(bytes, bytes/s)`` pairs, the
    # rate of a transposition (a copy that moves the minor dimension) that reads and writes
    # ``bytes``, on every device at once. On a CPU one of a few MiB runs several times slower
    # than an elementwise pass over as many bytes: each element lands on another cache line.
    # Sequence parallelism transposes activations between its layouts.
    transpose_bandwidth: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        # As a file's keys are read (_peak): the planner looks rates up by canonical names, so a
        # Target built in Python with "bf16" priced bf16 steps at the float32 rate without a word.
        if isinstance(self.peak_flops, dict):
            object.__setattr__(self, "peak_flops", _peak_names(self.peak_flops, f"Target({self.name!r})"))

    def sync_ops_for(self, n: int) -> float:
        """:attr:`collective_sync_ops` for a group of ``n`` devices: the measured figure,
        else linear in ``n - 1`` between the nearest measured sizes (beyond them, from the
        nearest alone), 0 for ``n <= 1`` or none measured.

        Example:
            >>> t = Target("t", "example", 8, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 1e-9)},
            ...            collective_sync_ops={2: 1.0, 8: 7.0})
            >>> [round(t.sync_ops_for(n), 6) for n in (1, 2, 4, 8, 16)]
            [0.0, 1.0, 3.0, 7.0, 15.0]
        """
        if n <= 1 or not self.collective_sync_ops:
            return 0.0
        if n in self.collective_sync_ops:
            return self.collective_sync_ops[n]
        sizes = sorted(self.collective_sync_ops)
        below = [s for s in sizes if s < n]
        above = [s for s in sizes if s > n]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (n - lo) / (hi - lo)
            return (1 - w) * self.collective_sync_ops[lo] + w * self.collective_sync_ops[hi]
        near = below[-1] if below else above[0]
        return self.collective_sync_ops[near] * (n - 1) / (near - 1)

    def bandwidth_for(self, nbytes: float) -> float:
        """Bytes/s of an operation that moves ``nbytes`` of warm data: :attr:`cache_bandwidth`
        interpolated in log(bytes), its nearest end beyond it, memory_bandwidth without one.
        Never below memory_bandwidth: warm data costs no more than cold (a curve's large end,
        timed on a read and a write, can read lower than a streaming read).

        Example:
            >>> t = Target("t", "example", 8, {"float32": 1e12}, 3e9, {}, cache_bandwidth=((1e4, 8e9), (1e6, 2e9)))
            >>> [t.bandwidth_for(b) / 1e9 for b in (1e3, 1e4, 1e5, 1e6, 1e8)]
            [8.0, 8.0, 5.0, 3.0, 3.0]
        """
        if not self.cache_bandwidth:
            return self.memory_bandwidth
        return max(_curve_at(self.cache_bandwidth, nbytes), self.memory_bandwidth)

    def transpose_bandwidth_for(self, nbytes: float) -> float:
        """Bytes/s of a transposition that moves ``nbytes`` of warm data:
        :attr:`transpose_bandwidth` interpolated in log(bytes), never above
        :meth:`bandwidth_for` (a transposition costs no less than an elementwise pass); that
        rate itself without a curve.

        Example:
            >>> t = Target("t", "example", 8, {"float32": 1e12}, 1e9, {}, cache_bandwidth=((1e4, 8e9), (1e6, 2e9)),
            ...            transpose_bandwidth=((1e4, 9e9), (1e6, 5e8)))
            >>> [round(t.transpose_bandwidth_for(b) / 1e9, 3) for b in (1e4, 1e5, 1e6)]  # 9 capped at 8
            [8.0, 4.75, 0.5]
        """
        warm = self.bandwidth_for(nbytes)
        if not self.transpose_bandwidth:
            return warm
        return min(_curve_at(self.transpose_bandwidth, nbytes), warm)

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype (``"float32"``, ``"bfloat16"``), else float32's."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if "float32" in self.peak_flops:
            return self.peak_flops["float32"]
        given = f"{dtype!r} nor 'float32'" if dtype != "float32" else "not 'float32'"
        raise TargetError(fix(f"target {self.name!r} gives peak_flops for {sorted(self.peak_flops)}, {given} "
                              f"(the rate a {dtype} step is priced at).",
                              f'add "float32" to its "peak_flops", or plan in a dtype it gives '
                              f'(plan(dtype={sorted(self.peak_flops)[0]!r}); the command line\'s --precision bf16 '
                              "for the lm)."))

    def link(self, kind: str, link: str) -> Link:
        per_kind = self.collectives.get(kind, {})
        if link in per_kind:
            return per_kind[link]
        if link in self.links:
            return self.links[link]
        if link == "inter_host" and "intra_host" in self.links:
            raise TargetError(fix(f"target {self.name!r} has no inter_host link, but a collective spans hosts "
                                  f"(devices_per_host={self.devices_per_host}).",
                                  'add "inter_host": {"alpha": ..., "beta": ...} to its "links", or plan for '
                                  "fewer processes (--processes).", ))
        raise TargetError(fix(f"target {self.name!r} has no {link!r} link.", f'add "{link}" to its "links".'))

    def to_json(self) -> dict[str, Any]:
        # Figures as Python floats: a Target built in Python with NumPy scalars (np.float32(67e12))
        # was written as strings, which a target file refuses when passed back.
        out: dict[str, Any] = {
            "format": FORMAT, "version": VERSION, "name": self.name, "source": self.source,
            "devices_per_host": int(self.devices_per_host),
            "peak_flops": {k: float(v) for k, v in self.peak_flops.items()},
            "memory_bandwidth": float(self.memory_bandwidth),
            "links": {k: _link_json(v) for k, v in self.links.items()},
        }
        if self.memory_per_device is not None:
            out["memory_per_device"] = float(self.memory_per_device)
        if self.collectives:
            out["collectives"] = {kind: {k: _link_json(v) for k, v in links.items()}
                                  for kind, links in self.collectives.items()}
        if self.measurements:
            out["measurements"] = list(self.measurements)
        if self.op_overhead:
            out["op_overhead"] = float(self.op_overhead)
        if self.warnings:
            out["warnings"] = list(self.warnings)
        if self.collective_sync_ops:
            out["collective_sync_ops"] = {str(n): float(s) for n, s in sorted(self.collective_sync_ops.items())}
        if self.cache_bandwidth:
            out["cache_bandwidth"] = [[float(b), float(r)] for b, r in self.cache_bandwidth]
        if self.transpose_bandwidth:
            out["transpose_bandwidth"] = [[float(b), float(r)] for b, r in self.transpose_bandwidth]
        return out


def _curve_at(curve: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """A ``(bytes, bytes/s)`` curve's rate at ``nbytes``, linear in log(bytes) between its
    points, its nearest end beyond them."""
    points = sorted(curve)
    x = math.log(max(nbytes, 1.0))
    xs = [math.log(b) for b, _ in points]
    if x <= xs[0]:
        return points[0][1]
    for (x0, (_, r0)), (x1, (_, r1)) in zip(zip(xs, points), zip(xs[1:], points[1:])):
        if x <= x1:
            return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def _link_json(v: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"alpha": float(v.alpha), "beta": float(v.beta)}
    if v.per_operand:
        out["per_operand"] = True
    if v.pieces:
        out["pieces"] = [{**({} if m is None else {"max_bytes": float(m)}), **_link_json(p)} for m, p in v.pieces]
    if v.groups:  # a group pays alpha per operand as its link does: the flag is the link's
        out["groups"] = {str(int(n)): {k: x for k, x in _link_json(g).items() if k != "per_operand"}
                         for n, g in v.groups}
    return out


def steps_and_wire(kind: str, n: int, nbytes: float) -> tuple[float, float]:
    """``(s(n), w(n, B))`` of a ring algorithm: steps and bytes on the wire per device.

    Example:
        >>> steps_and_wire("all_reduce", 4, 1000.0)
        (6, 1500.0)
        >>> steps_and_wire("all_gather", 2, 1000.0)
        (1, 500.0)
    """
    if kind not in KINDS:
        raise TargetError(fix(f"collective kind {kind!r} is not known.", f"use one of {list(KINDS)}."))
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * nbytes
    if kind == "collective_permute":
        return 1, nbytes
    return n - 1, (n - 1) / n * nbytes


def collective_time(target: Target, kind: str, nbytes: float, n: int, link: str, operands: int = 1) -> float:
    """Seconds for one collective of ``kind`` over ``n`` devices with payload ``nbytes``
    (see the module docstring for which array's bytes; all ``operands`` together), on ``link``:
    alpha once, or once per operand on a link with ``per_operand``.

    Example:
        >>> t = Target("t", "example", 8, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 0.0, per_operand=True)})
        >>> round(collective_time(t, "all_reduce", 1000, 2, "intra_host", operands=3), 9)  # 2 steps x 3 operands
        6e-05
    """
    steps, wire = steps_and_wire(kind, n, nbytes)
    if n <= 1:
        return 0.0
    base = target.link(kind, link)
    ab = base.for_group(n).at(nbytes)
    return steps * ab.alpha * (max(int(operands), 1) if base.per_operand else 1) + wire * ab.beta


# ---------------------------------------------------------------- reading
# A sensible value per field, for the fix text (SI units).
_EXAMPLES = {"alpha": "5e-6 (seconds per step)", "beta": "2e-12 (seconds per byte)",
             "memory_bandwidth": "2e12 (bytes/s)", "memory_per_device": "80e9 (bytes)",
             "op_overhead": "5e-6 (seconds per operation)", "max_bytes": "2097152 (bytes)"}


def _finite(value: Any) -> bool:
    """A JSON number that is a finite float (an integer of 400 digits is none)."""
    return finite_float(value) is not None


# The magnitudes a figure may have. A finite 1e308 seconds per step, or a rate of 1e-300/s, still
# overflows the sums and quotients of a step's price: the table printed "inf" and "nan-inf" and
# ranked by them. Real figures (FLOP/s ~1e9..1e18, beta ~1e-13..1e-6 s/B) are far inside.
_LARGEST = 1e30
_SMALLEST_RATE = 1e-30


def _in_range(value: float, positive: bool) -> bool:
    return (value >= _SMALLEST_RATE if positive else value >= 0) and value <= _LARGEST


def _number(data: dict, key: str, where: str, positive: bool = True) -> float:
    """A finite number, > 0 with ``positive`` (a rate, a size), else >= 0; within the range that
    keeps every price finite (:data:`_LARGEST`)."""
    value = data.get(key)
    bound = f"in [{_SMALLEST_RATE:g}, {_LARGEST:g}]" if positive else f"in [0, {_LARGEST:g}]"
    if not _finite(value) or not _in_range(float(value), positive):
        example = _EXAMPLES.get(key, "67e12 (FLOP/s)" if "peak_flops" in where else
                                "1.0 (operation times)" if "collective_sync_ops" in where else "a value")
        raise TargetError(fix(f"{where}: {key!r} is {value!r}, not a finite number {bound}.",
                              f'write e.g. "{key}": {example}.'))
    _check_unit(key, float(value), where)
    return float(value)


# Bounds no real device comes near, with the unit each figure is in: a datasheet's figure copied
# in its own unit ("peak_flops": {"float32": 67} for 67 TFLOPS, "alpha": 5 for 5 us) loaded, and
# every step was priced at 611 s or 70 s without a word. (key, below, above, unit, example)
_UNIT_BOUNDS = {"peak_flops": (1e6, None, "FLOP/s", "67e12 for 67 TFLOPS"),
                "memory_bandwidth": (1e6, None, "bytes/s", "3.35e12 for 3.35 TB/s"),
                "memory_per_device": (1e6, None, "bytes", "80e9 for 80 GB"),
                "alpha": (None, 1.0, "seconds", "5e-6 for 5 us"),
                "op_overhead": (None, 0.01, "seconds", "5e-6 for 5 us"),
                "beta": (None, 1e-6, "seconds per byte", "2.2e-12 for 450 GB/s")}


def _check_unit(key: str, value: float, where: str) -> None:
    kind = "peak_flops" if "peak_flops" in where else key
    if kind not in _UNIT_BOUNDS:
        return
    below, above, unit, example = _UNIT_BOUNDS[kind]
    if (below is not None and value < below) or (above is not None and value > above):
        limit = f"below {below:g}" if below is not None and value < below else f"above {above:g}"
        raise TargetError(fix(f"{where}: {key!r} is {value:g} {unit}, {limit}: no device is that "
                              f"{'slow' if kind != 'memory_per_device' else 'small'}; a figure in another unit?",
                              f'write it in {unit}: e.g. "{key}": {example}.'))


_LINK_FIELDS = ("alpha", "beta", "per_operand", "pieces", "groups")
_PIECES_HOW = ('write pieces in increasing max_bytes, each size range once, the last one without max_bytes (the '
               'rest): [{"max_bytes": 2097152, "alpha": ..., "beta": ...}, {"alpha": ..., "beta": ...}].')


def _pieces(pieces: Any, where: str) -> tuple:
    """``pieces``, checked to be ordered: :meth:`Link.at` takes the first piece whose
    ``max_bytes`` holds the payload, so a piece after a larger one, or after the one without
    ``max_bytes``, would never be used and sizes would be priced by another piece's line."""
    if not isinstance(pieces, list):
        raise TargetError(fix(f"{where}.pieces is {pieces!r}, not a list.", _PIECES_HOW))
    parsed: list = []
    for i, p in enumerate(pieces):
        at = f"{where}.pieces[{i}]"
        if isinstance(p, dict) and "groups" in p:  # a piece's groups would never be used
            raise TargetError(fix(f"{at} has groups.", "put groups on the link itself, beside its pieces."))
        piece = _link(p, at, ("max_bytes",))
        limit = None if p.get("max_bytes") is None else _number(p, "max_bytes", at)
        if parsed and (parsed[-1][0] is None or (limit is not None and limit <= parsed[-1][0])):
            before = "has no max_bytes" if parsed[-1][0] is None else f"ends at max_bytes {parsed[-1][0]:g}"
            raise TargetError(fix(f"{at} (max_bytes {'none' if limit is None else f'{limit:g}'}) comes after a piece "
                                  f"that {before}: sizes would be priced by the wrong piece, or it would never be used.",
                                  _PIECES_HOW))
        parsed.append((limit, piece))
    return tuple(parsed)


_GROUPS_HOW = ('write groups as {"<devices in the group>": {"alpha": ..., "beta": ...}}, e.g. "groups": {"2": '
               '{"alpha": 2e-4, "beta": 1e-9}}, or leave it out (every group size scales from the link by ring steps).')


def _groups(groups: Any, where: str) -> tuple:
    """``groups``: a link per group size, each a plain link (its own pieces allowed, no groups)."""
    if not isinstance(groups, dict):
        raise TargetError(fix(f"{where}.groups is {groups!r}, not an object.", _GROUPS_HOW))
    out: dict[int, tuple[str, Link]] = {}
    for key, value in groups.items():
        if not (key.isascii() and key.isdigit()) or int(key) < 2:
            raise TargetError(fix(f"{where}.groups has the key {key!r}, not a group size >= 2.", _GROUPS_HOW))
        at = f"{where}.groups[{key!r}]"
        if isinstance(value, dict) and "groups" in value:
            raise TargetError(fix(f"{at} has groups of its own.", _GROUPS_HOW))
        if isinstance(value, dict) and "per_operand" in value:
            raise TargetError(fix(f"{at} has per_operand: a group pays alpha as its link does.",
                                  f"set per_operand on {where} itself, and leave it out of its groups."))
        if int(key) in out:
            raise TargetError(fix(f"{where}.groups has the group size {int(key)} twice ({out[int(key)][0]!r} and "
                                  f"{key!r}).", _GROUPS_HOW))
        out[int(key)] = (key, _link(value, at))
    return tuple((n, link) for n, (_, link) in sorted(out.items()))


def _link(data: Any, where: str, extra: tuple[str, ...] = ()) -> Link:
    if not isinstance(data, dict):
        raise TargetError(fix(f"{where} is {data!r}, not an object.", 'write {"alpha": 5e-6, "beta": 2e-12}.'))
    # A misspelt "max_byte" made its piece the one for every size, "per_operands" was dropped: name it.
    _unknown(data, _LINK_FIELDS + extra, where, what="a link")
    parsed = _pieces(data["pieces"], where) if data.get("pieces") is not None else ()  # {}, 0, "": not a list
    groups = _groups(data["groups"], where) if "groups" in data else ()
    per_operand = data.get("per_operand", False)
    if not isinstance(per_operand, bool):
        raise TargetError(fix(f"{where}.per_operand is {per_operand!r}, not true or false.",
                              'write "per_operand": true (alpha paid per operand of a combined collective) or leave '
                              "it out."))
    return Link(alpha=_number(data, "alpha", where, positive=False), beta=_number(data, "beta", where, positive=False),
                pieces=parsed, per_operand=per_operand, groups=groups)


def _sync(data: Any, where: str) -> dict[int, float]:
    """``collective_sync_ops``: ``{"<devices in the group>": operations, ...}``; absent means none."""
    if data is None:
        return {}
    example = ('write e.g. "collective_sync_ops": {"2": 1.0, "8": 6.5} (per collective, in mean operation times, '
               "by devices in its group).")
    if not isinstance(data, dict):
        raise TargetError(fix(f"{where}: collective_sync_ops is {data!r}, not an object.", example))
    out = {}
    for key in data:
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) >= 2):  # "²" is a digit
            raise TargetError(fix(f"{where}: collective_sync_ops has the key {key!r}, not a group size >= 2.", example))
        out[int(key)] = _number(data, key, f"{where} collective_sync_ops", positive=False)
        if out[int(key)] < 0:
            raise TargetError(fix(f"{where}: collective_sync_ops[{key!r}] is {data[key]!r}, below 0.", example))
    return out


# What a target file may hold: the fields read, and what spmdkit calibrate adds for reading.
_FIELDS = ("format", "version", "name", "source", "devices_per_host", "peak_flops", "memory_bandwidth", "links",
           "memory_per_device", "collectives", "measurements", "op_overhead", "collective_sync_ops", "warnings",
           "cache_bandwidth", "transpose_bandwidth")
_NOTES = ("per_operand_ratio", "fit_quality", "compute_detail", "notes", "calibration_seconds")


def _unknown(keys: Any, known: tuple[str, ...], where: str, shown: tuple[str, ...] | None = None,
             what: str = "a target file") -> None:
    """A misspelt field would be dropped silently (a memory budget of None): name it."""
    for key in keys:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            raise TargetError(fix(f"{where}: {key!r} is not a field of {what}"
                                  + (f" (did you mean {near[0]!r}?)." if near else "."),
                                  f"use {list(shown or known)}."))


def from_json(data: Any, where: str = "target") -> Target:
    """A Target from the parsed JSON of a target file, every field checked."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TargetError(fix(f"{where} is not a target file (no \"format\": \"{FORMAT}\").",
                              "write one as spmdkit/targets/*.json do, or with spmdkit calibrate."))
    _unknown(data, _FIELDS + _NOTES, where, _FIELDS)
    if data.get("version") != VERSION:
        raise TargetError(fix(f"{where} has version {data.get('version')!r}; this spmdkit reads version {VERSION}.",
                              "write it again with this version's spmdkit calibrate."))
    peak = _peak(data.get("peak_flops"), where)
    links_in = data.get("links")
    if not isinstance(links_in, dict) or "intra_host" not in links_in:
        raise TargetError(fix(f"{where}: links is {links_in!r}, without an intra_host link.",
                              'write "links": {"intra_host": {"alpha": 5e-6, "beta": 2e-12}}.'))
    _unknown(links_in, LINKS, f"{where} links")
    links = {k: _link(v, f"{where} links.{k}") for k, v in links_in.items()}
    collectives = _collectives(data.get("collectives"), where)
    dph = data.get("devices_per_host")
    if isinstance(dph, bool) or not isinstance(dph, int) or dph < 1:
        raise TargetError(fix(f"{where}: devices_per_host is {dph!r}.", 'write e.g. "devices_per_host": 8.'))
    memory = data.get("memory_per_device")
    return Target(
        name=str(data.get("name", where)), source=str(data.get("source", "unknown")), devices_per_host=dph,
        peak_flops=peak, memory_bandwidth=_number(data, "memory_bandwidth", where),
        links=links, memory_per_device=None if memory is None else _number(data, "memory_per_device", where),
        collectives=collectives, measurements=_measurements(data.get("measurements"), where),
        op_overhead=_number(data, "op_overhead", where, positive=False) if "op_overhead" in data else 0.0,
        collective_sync_ops=_sync(data.get("collective_sync_ops"), where),
        warnings=tuple(str(w) for w in data.get("warnings") or () if isinstance(data.get("warnings"), list)),
        cache_bandwidth=_curve(data.get("cache_bandwidth"), where),
        transpose_bandwidth=_curve(data.get("transpose_bandwidth"), where, "transpose_bandwidth"),
    )


def checked_target(target: Target, where: str = "target") -> Target:
    """``target`` (built in Python) checked as a target file is: every figure a finite number
    in range and in the file's unit, every link and curve well formed. A datasheet's TFLOPS or
    microseconds typed into a ``Target`` priced every step at minutes without a word.

    Example:
        >>> t = Target("gpu", "datasheet", 8, {"float32": 67}, 3.35e12, {"intra_host": Link(5e-6, 2e-12)})
        >>> try:
        ...     checked_target(t, "plan(target=...)")
        ... except TargetError as e:
        ...     print(str(e).splitlines()[0])
        plan(target=...) peak_flops: 'float32' is 67 FLOP/s, below 1e+06: no device is that slow; a figure in another unit?
    """
    _check_python_fields(target, where)
    data = target.to_json()
    # A Target may give every kind's link under collectives and none under links (a file may not).
    bare = "intra_host" not in data["links"]
    if bare:
        data["links"]["intra_host"] = {"alpha": 0.0, "beta": 0.0}
    checked = from_json(data, where)
    return dataclasses.replace(checked, links=dict(target.links)) if bare else checked


def _check_python_fields(target: Target, where: str) -> None:
    """The fields of a Target built in Python that ``to_json`` would convert without a word
    (``devices_per_host=8.7`` as 8) or fail on with no field named."""
    def wrong(field: str, value: Any, want: str, example: str) -> TargetError:
        return TargetError(fix(f"{where}: {field} is {value!r:.60} ({type(value).__name__}), not {want}.",
                               f"pass e.g. {example}."))

    def number(field: str, value: Any, example: str) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise wrong(field, value, "a number", example)
        try:
            float(value)
        except OverflowError:  # an int of 400 digits
            raise wrong(field, value, "a number a float holds", example) from None

    def curve(field: str, value: Any) -> None:
        example = f"{field}=((32768, 30e9), (8388608, 10e9))"
        if not isinstance(value, (tuple, list)):
            raise wrong(field, value, "(bytes, bytes/s) pairs", example)
        for i, pair in enumerate(value):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise wrong(f"{field}[{i}]", pair, "a (bytes, bytes/s) pair", example)
            for x in pair:
                number(f"{field}[{i}]", x, example)

    dph = target.devices_per_host
    if isinstance(dph, bool) or not isinstance(dph, numbers.Integral) or dph < 1:
        raise wrong("devices_per_host", dph, "a whole number >= 1", "devices_per_host=8")
    if not isinstance(target.peak_flops, dict):
        raise wrong("peak_flops", target.peak_flops, "a dict of dtype names to FLOP/s", "peak_flops={'float32': 67e12}")
    for dtype, rate in target.peak_flops.items():
        number(f"peak_flops[{dtype!r}]", rate, f"peak_flops={{{dtype!r}: 67e12}}")
    number("memory_bandwidth", target.memory_bandwidth, "memory_bandwidth=3.35e12")
    if target.memory_per_device is not None:
        number("memory_per_device", target.memory_per_device, "memory_per_device=80e9")
    number("op_overhead", target.op_overhead, "op_overhead=5e-6")
    curve("cache_bandwidth", target.cache_bandwidth)
    curve("transpose_bandwidth", target.transpose_bandwidth)
    if not isinstance(target.collective_sync_ops, dict):
        raise wrong("collective_sync_ops", target.collective_sync_ops, "a dict of group sizes to operation times",
                    "collective_sync_ops={2: 0.5, 8: 1.2}")
    for size, ops in target.collective_sync_ops.items():
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 2:
            raise wrong(f"collective_sync_ops key {size!r}", size, "a group size >= 2", "collective_sync_ops={2: 0.5}")
        number(f"collective_sync_ops[{size}]", ops, f"collective_sync_ops={{{size}: 0.5}}")
    for name in ("links", "collectives"):
        if not isinstance(getattr(target, name), dict):
            raise wrong(name, getattr(target, name), "a dict", "links={'intra_host': Link(alpha=5e-6, beta=2e-12)}")
    links = [(f"links[{k!r}]", v) for k, v in target.links.items()]
    for kind, per in target.collectives.items():
        if not isinstance(per, dict):
            raise wrong(f"collectives[{kind!r}]", per, "a dict of links", "{'intra_host': Link(5e-6, 2e-12)}")
        links += [(f"collectives[{kind!r}][{k!r}]", v) for k, v in per.items()]
    for field, link in links:
        if not isinstance(link, Link):
            raise wrong(field, link, "a Link", f"{field} = Link(alpha=5e-6, beta=2e-12)")
        for piece in (link, *(p for _, p in link.pieces), *(g for _, g in link.groups)):
            number(f"{field}.alpha", piece.alpha, "Link(alpha=5e-6, beta=2e-12)")
            number(f"{field}.beta", piece.beta, "Link(alpha=5e-6, beta=2e-12)")


# Short names users write for compute dtypes (the planner's ``dtype=`` takes them too).
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32",
                 "fp64": "float64", "f64": "float64"}


def _dtype_name(key: Any) -> str | None:
    """``key`` as a canonical dtype name (aliases resolved), or None if it names no dtype."""
    import jax.numpy as jnp
    import numpy as np

    name = DTYPE_ALIASES.get(str(key), str(key))
    try:
        return np.dtype(jnp.dtype(name)).name
    except (TypeError, ValueError):
        return None


def _peak_names(flops: dict, where: str, how: str = "") -> dict:
    """``flops`` keyed by canonical dtype names (values as given); a key that names no dtype, or
    one dtype named twice, is an error (``how``: the fix's example, for a file)."""
    out: dict = {}
    for key, value in flops.items():
        name = _dtype_name(key)
        if name is None:
            raise TargetError(fix(f"{where}: peak_flops has the key {key!r}, which is no dtype name.",
                                  f"use dtype names (float32, bfloat16, float16) or aliases {sorted(DTYPE_ALIASES)}"
                                  + (f"; {how}" if how else ".")))
        if name in out:
            raise TargetError(fix(f"{where}: peak_flops gives {name} twice (as {key!r} and another name).",
                                  "keep one of them."))
        out[name] = value
    return out


def _peak(flops: Any, where: str) -> dict[str, float]:
    """``peak_flops`` keyed by canonical dtype names. The planner looks a rate up by the name
    ``bfloat16``: a file's ``"bf16"`` key was never found and bf16 steps were priced at the float32
    rate without a word (15x slower on h100x8); a key that is no dtype was never read either."""
    how = 'write e.g. "peak_flops": {"float32": 67e12, "bfloat16": 989e12}.'
    if not isinstance(flops, dict) or not flops:
        raise TargetError(fix(f"{where}: peak_flops is {flops!r}.", how))
    names = _peak_names(flops, where, how)
    # Each rate checked under the key as written (an error names what the file says).
    return {name: _number(flops, key, f"{where} peak_flops") for key, name in zip(flops, names)}


def _collectives(data: Any, where: str) -> dict[str, dict[str, Link]]:
    """``collectives``: ``{kind: {link: {alpha, beta, ...}}}``; absent means every kind uses ``links``."""
    how = f"use kinds {list(KINDS)}, each {{\"intra_host\": {{\"alpha\": ..., \"beta\": ...}}}}, or leave it out."
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise TargetError(fix(f"{where}: collectives is {data!r:.80}, not an object.", how))
    out = {}
    for kind, per_link in data.items():
        if kind not in KINDS or not isinstance(per_link, dict):
            raise TargetError(fix(f"{where}: collectives.{kind} is not a known kind with links.", how))
        _unknown(per_link, LINKS, f"{where} collectives.{kind}")
        out[kind] = {k: _link(v, f"{where} collectives.{kind}.{k}") for k, v in per_link.items()}
    return out


def _measurements(data: Any, where: str) -> list[Any]:
    """``measurements`` (calibrate's points, kept for --check): a list, or absent."""
    if data is None:
        return []
    if not isinstance(data, list):
        raise TargetError(fix(f"{where}: measurements is {data!r:.80}, not a list.",
                              "leave it as spmdkit calibrate wrote it, or remove the field."))
    return list(data)


def _curve(data: Any, where: str, key: str = "cache_bandwidth") -> tuple[tuple[float, float], ...]:
    if data is None:
        return ()
    without = {"cache_bandwidth": "memory_bandwidth at every size",
               "transpose_bandwidth": "transpositions priced as other warm data"}[key]
    how = ('write [bytes, bytes/s] pairs of finite positive numbers, one per size, e.g. '
           f'"{key}": [[65536, 15e9], [16777216, 2e9]], or leave it out ({without}).')
    if not isinstance(data, list):
        raise TargetError(fix(f"{where}: {key} is {data!r}.", how))
    for i, p in enumerate(data):
        ok = isinstance(p, list) and len(p) == 2 and all(_finite(v) and _in_range(float(v), True) for v in p)
        if not ok or float(p[0]) < 1:
            raise TargetError(fix(f"{where}: {key}[{i}] is {p!r} (in {data!r}).", how))
        if float(p[1]) < 1e6:  # GB/s (15 for 15 GB/s) would price every byte a billion times too slow
            raise TargetError(fix(f"{where}: {key}[{i}] is {p!r}: {p[1]:g} bytes/s, below 1e+06: no device is that "
                                  "slow; a figure in another unit?",
                                  f"write the rate in bytes/s: e.g. [{p[0]!r}, 15e9] for 15 GB/s."))
    sizes = [float(b) for b, _ in data]
    twice = sorted({b for b in sizes if sizes.count(b) > 1})
    if twice:
        raise TargetError(fix(f"{where}: {key} gives the size {twice[0]:g} bytes more than once.", how))
    return tuple((float(b), float(r)) for b, r in data)


def example_targets() -> dict[str, Path]:
    """The target files shipped with the project, by file stem (``h100x8``, ``tpu-v5e-16``)."""
    return {p.stem: p for p in sorted(EXAMPLES_DIR.glob("*.json"))} if EXAMPLES_DIR.is_dir() else {}


def load_target(path_or_name: str | Path, devices: int = 1) -> Target:
    """A target from a JSON file, an example's name, or ``"cpu"`` (this machine, measured now,
    its rates shared among ``devices`` simulated devices)."""
    if str(path_or_name) == "cpu":
        return cpu_target(devices)
    path = Path(path_or_name)
    if not path.is_file() and str(path_or_name) in example_targets():
        path = example_targets()[str(path_or_name)]
    if not path.is_file():
        raise TargetError(fix(f"--target {str(path_or_name)!r} is neither a file nor a known target.",
                              f"pass cpu, a target JSON file, or one of {sorted(example_targets())}."))
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TargetError(fix(f"target file {str(path)!r} cannot be read as JSON ({e}).",
                              "check the file; spmdkit/targets/ holds valid ones.")) from None
    return from_json(data, where=f"target file {str(path)!r}")


# ---------------------------------------------------------------- this machine
def _best_seconds(fn, repeats: int = 5, window: float = 0.0, clock=time.perf_counter) -> float:
    """The fastest of at least ``repeats`` calls of ``fn`` and of as many more as fit in
    ``window`` seconds."""
    import jax

    jax.block_until_ready(fn())  # compile and warm up
    best, done, began = float("inf"), 0, clock()
    while done < repeats or clock() - began < window:
        start = clock()
        jax.block_until_ready(fn())
        best = min(best, clock() - start)
        done += 1
    return best


# Seconds each figure of measure_cpu is the best over. On a shared machine a core can be taken
# away for a few milliseconds: the best of five 1.4 ms matmuls ranged 136-214 GFLOP/s from one
# call to the next (88-211 at the start of 51 plans), the best over 0.2 s 210-222.
MEASURE_WINDOW = 0.2


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of this machine's largest CPU cache level as Linux reports it, or None."""
    sizes = {}
    for index in glob.glob(os.path.join(root, "index*")):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip()
            sizes[level] = int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        except (OSError, ValueError):
            continue
    return sizes[max(sizes)] if sizes else None


def stream_bytes(cache: int | None = None) -> int:
    """Bytes :func:`measure_cpu`'s sum reads: 4x the last-level cache and at least 256 MiB, so
    memory answers it, not the cache (a 32 MiB sum read 37-98 GB/s here, with a 32 MiB L3;
    256 MiB reads 29-31), and at most 1 GiB."""
    cache = last_level_cache_bytes() if cache is None else cache
    return min(max(4 * (cache or 0), 256 * 2**20), 2**30)


def _square(x):
    return x @ x


def measure_cpu(size: int = 512) -> tuple[float, float]:
    """``(f32 FLOP/s, bytes/s)`` of this process's first CPU device: a matmul, and a sum that
    reads :func:`stream_bytes` from memory (a copy would mostly time the page faults of its
    fresh output); each the best over :data:`MEASURE_WINDOW` seconds. The sum's buffer is
    freed, and its pages given back when host memory is reused."""
    import jax
    import jax.numpy as jnp

    from spmdkit._host_memory import release_host_memory

    device = jax.local_devices(backend="cpu")[0]  # this process's own: another's cannot be written to
    a = jnp.ones((size, size), jnp.float32, device=device)
    matmul = jax.jit(_square)  # a function of the module: cpu_target's second call reuses the compiled program
    flops = 2 * size**3 / _best_seconds(lambda: matmul(a), window=MEASURE_WINDOW)
    big = jnp.ones((stream_bytes() // 4,), jnp.float32, device=device)
    total = jax.jit(jnp.sum)
    bandwidth = big.nbytes / _best_seconds(lambda: total(big), window=MEASURE_WINDOW)
    big.delete()
    release_host_memory()
    return flops, bandwidth


def _collective_program(kind: str, n: int, loops: int):
    """A program that runs ``loops`` collectives of ``kind`` over a 1-D mesh of ``n`` devices,
    each device's block of the same size before and after (nothing queues up: one dispatch)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from spmdkit._mesh import make_mesh

    mesh = make_mesh(devices=jax.local_devices()[:n], link=n)
    one = {
        "all_reduce": lambda v: jax.lax.psum(v, "link") * (1.0 / n),
        "all_gather": lambda v: jax.lax.all_gather(v[: v.shape[0] // n], "link", tiled=True),
        "reduce_scatter": lambda v: jax.numpy.tile(jax.lax.psum_scatter(v, "link", tiled=True), n) * (1.0 / n),
    }[kind]
    body = lambda a: jax.lax.fori_loop(0, loops, lambda i, v: one(v), a)  # noqa: E731
    return mesh, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("link"), out_specs=P("link"), check_vma=False))


def measure_collective(kind: str, n: int, loops: int = 20) -> Link | None:
    """Alpha-beta of ``kind`` over the first ``n`` devices of this process, from a small and a
    1 MB payload (``B`` as :func:`collective_time` takes it), or None with fewer devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    if n < 2 or len(jax.local_devices()) < n:
        return None
    mesh, program = _collective_program(kind, n, loops)
    seconds = []
    # float32 elements per device, multiples of n: all_gather and reduce_scatter split a block n ways
    sizes = (8 * n, 2**18 - 2**18 % n)
    for per_device in sizes:
        x = jax.device_put(jnp.ones((n * per_device,), jnp.float32), NamedSharding(mesh, P("link")))
        seconds.append(_best_seconds(lambda: program(x), repeats=3) / loops)
    # B: the reduced array, the gathered output, the scattered input
    steps, wire = steps_and_wire(kind, n, 4 * (sizes[1] - sizes[0]))
    return Link(alpha=seconds[0] / steps, beta=max(seconds[1] - seconds[0], 0.0) / wire)


def measure_op_overhead(n: int, loops: int = 200) -> float:
    """Seconds per operation on each of ``n`` simulated devices running at once: a loop of tiny
    matmuls (which XLA does not fuse) over a mesh of ``n``, no collective."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from spmdkit._mesh import make_mesh

    n = max(min(n, len(jax.local_devices())), 1)
    mesh = make_mesh(devices=jax.local_devices()[:n], link=n)

    def body(a):  # each trip: two dots and the loop's own compare and add
        return jax.lax.fori_loop(0, loops, lambda i, v: (v @ v) @ v * 0.5, a)

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("link"), out_specs=P("link"), check_vma=False))
    x = jax.device_put(jnp.eye(4 * n, 4, dtype=jnp.float32), NamedSharding(mesh, P("link")))
    return _best_seconds(lambda: program(x), repeats=3) / (loops * 4)


# Per-device bytes of the array :func:`measure_cache_curve` rewrites: 16 KiB (the first-level
# caches) to 16 MiB (past a typical last-level cache's share of a device).
CACHE_CURVE_BYTES = tuple(16 * 4**k * 1024 for k in range(6))
# Up to 4 MiB arrays: a 16 MiB transposition takes seconds to time, and the planner prices
# larger ones at the curve's end.
TRANSPOSE_CURVE_BYTES = CACHE_CURVE_BYTES[:5]


def measure_cache_curve(n: int, sizes: tuple[int, ...] = CACHE_CURVE_BYTES, repeats: int = 5,
                        transpose: bool = False) -> tuple[tuple[float, float], ...]:
    """:attr:`Target.cache_bandwidth` of ``n`` devices of this process running at once: a loop
    of one elementwise operation (read an array, write it) per trip, an array of each of
    ``sizes`` bytes per device; ``(bytes read and written, bytes/s per device)``, the median of
    ``repeats`` calls. A barrier between trips keeps XLA from fusing them into one pass. The
    trip's fixed cost (the same loop over 16 bytes) is taken off, at most half of a trip's time
    (a noisy empty loop must not make a rate out of nothing): the planner charges it as
    ``op_overhead``. ``transpose``: :attr:`Target.transpose_bandwidth`, each trip also
    transposing a square float32 array (a loop's carry keeps one layout, so XLA moves the data)."""
    import statistics

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from spmdkit._mesh import make_mesh

    n = max(min(n, len(jax.local_devices())), 1)
    mesh = make_mesh(devices=jax.local_devices()[:n], link=n)

    def seconds_per_trip(size: int) -> float:
        loops = max(4, min(400, int(2e8 // (size * n))))  # about 0.2 GB per call: tens of ms

        def body(v, loops=loops):
            step = (lambda v: (v * 1.0001 + 1e-3).T) if transpose else (lambda v: v * 1.0001 + 1e-3)
            trip = lambda i, v: jax.lax.optimization_barrier(step(v))  # noqa: E731
            return jax.lax.fori_loop(0, loops, trip, v)

        program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("link"), out_specs=P("link"), check_vma=False))
        side = max(math.isqrt(size // 4), 1)
        shape = (n * side, side) if transpose else (n * size // 4,)
        x = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, P("link")))
        jax.block_until_ready(program(x))
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            jax.block_until_ready(program(x))
            times.append(time.perf_counter() - started)
        x.delete()
        return statistics.median(times) / loops

    fixed = seconds_per_trip(16)
    out = []
    for size in sizes:
        trip = seconds_per_trip(size)
        out.append((2.0 * size, 2.0 * size / max(trip - fixed, trip / 2)))
    return tuple(out)


def _sync_program(n: int, group: int, loops: int, rows: int, width: int, gather: bool):
    """A loop of (a matmul on every device; a tiny all-gather over groups of ``group``, or
    without it the same arithmetic on the device's own row): ``(run, operations per trip)``,
    ``run`` blocking; the operations (without the collective only, else 0) counted in the
    compiled program as the planner counts a step's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from spmdkit._mesh import make_mesh
    from spmdkit._plan._hlo import analyse  # the planner's own count, imported late: it needs this module

    mesh = make_mesh(devices=jax.local_devices()[:n], rest=n // group, link=group)

    def trip(v, w):
        v = jnp.tanh(v @ w)
        shared = jax.lax.all_gather(v[:1], "link", tiled=True).mean(0) if gather else v[0]
        return v + 1e-3 * shared

    body = lambda x, w: jax.lax.fori_loop(0, loops, lambda i, v: trip(v, w), x)  # noqa: E731
    spec = P(("rest", "link"))
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False))
    x = jax.device_put(jnp.full((n * rows, width), 0.01, jnp.float32), NamedSharding(mesh, spec))
    w = jax.device_put(jnp.eye(width, dtype=jnp.float32), NamedSharding(mesh, P()))
    ops = 0.0 if gather else analyse(program.lower(x, w).compile().as_text(), dict(mesh.shape)).ops / loops
    run = lambda: jax.block_until_ready(program(x, w))  # noqa: E731
    run()  # compile and warm up
    return run, ops


class SyncMeasurement(NamedTuple):
    """What :func:`measure_collective_sync` saw: seconds a tiny all-gather added per trip, by
    devices in its group, and the loop's own seconds per operation without it."""

    extra: dict[int, float]
    op_seconds: float


def measure_collective_sync(n: int, loops: int = 20, rounds: int = 7, rows: int = SYNC_SHAPE[0],
                            width: int = SYNC_SHAPE[1]) -> SyncMeasurement:
    """What one tiny all-gather adds to a loop of matmuls on ``n`` simulated devices, by
    devices in its group (every divisor of ``n`` from 2 up): the loop with the collective
    minus the loop without, per trip, the median of ``rounds`` rounds in rotating order; and
    the loop's seconds per operation. Between computation every device of a group waits at
    the collective for the others, which a loop of nothing but collectives does not show.
    Nothing measured for ``n < 2``."""
    import statistics

    import jax

    n = min(n, len(jax.local_devices()))
    groups = [g for g in range(2, n + 1) if n % g == 0]
    if not groups:
        return SyncMeasurement({}, 0.0)
    cases = {0: _sync_program(n, n, loops, rows, width, gather=False)}
    cases.update({g: _sync_program(n, g, loops, rows, width, gather=True) for g in groups})
    names = list(cases)
    times: dict[int, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            cases[k][0]()
            times[k].append((time.perf_counter() - start) / loops)
    extra = {g: max(statistics.median([a - b for a, b in zip(times[g], times[0])]), 0.0) for g in groups}
    return SyncMeasurement(extra, statistics.median(times[0]) / max(cases[0][1], 1.0))


# Payloads (bytes per device, as the alpha-beta model takes them) at which a link is timed
# over its groups between computation: :func:`measure_group_links`, and over processes.
LINK_SIZES = (4096, 1 << 20)


def _timed(program: Any, args: list, loops: int):
    """``program(*args)`` compiled and warmed up, and a blocking call that returns its seconds per
    loop trip."""
    import jax

    jax.block_until_ready(program(*args))

    def run() -> float:
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        return (time.perf_counter() - start) / loops

    return run


def _interleaved(cases: dict, rounds: int = 5) -> dict:
    """The seconds of each case in each of ``rounds`` rounds in rotating order: a drift of the
    machine's load hits the small and the large payload alike (their difference is beta)."""
    names = list(cases)
    times: dict = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            times[k].append(cases[k]())
    return times


def _between_case(kind: str | None, devices: Any, group: int, nbytes: int, loops: int = 10):
    """A blocking call that returns its seconds per trip of a loop over ``devices`` (a 2-D array:
    a row per process, or one row), groups of ``group`` consecutive devices of a row: each trip
    a small matmul on every device, then the collective of ``kind`` over each group (``None``:
    the same arithmetic without it) on ``nbytes`` per device that wait for the matmul, the next
    matmul waiting for the collective, as the collectives of a step sit between its operations.
    Compiled and warmed up; every process runs the same calls in the same order."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(devices).reshape(len(devices), -1, group), ("proc", "rest", "sub"))
    if kind == "all_reduce":
        one = lambda v: jax.lax.psum(v, "sub") * (1.0 / group)  # noqa: E731
    elif kind == "all_gather":
        one = lambda v: jax.lax.all_gather(v[: v.shape[0] // group], "sub", tiled=True)  # noqa: E731
    else:
        one = lambda v: v * (1.0 / group)  # noqa: E731

    def trip(i, carry):
        h, v, w = carry
        h = jnp.tanh(h @ w + v[0] * 1e-6)
        return h, one(v + h[0, 0] * 1e-6), w

    body = lambda h, v, w: jax.lax.fori_loop(0, loops, trip, (h, v, w))[:2]  # noqa: E731
    spec = P(("proc", "rest", "sub"))
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(spec, spec),
                                    check_vma=False))
    rows, width = SYNC_SHAPE
    per = max(nbytes // 4 // group, 1) * group
    h = jax.make_array_from_callback((mesh.size * rows, width), NamedSharding(mesh, spec),
                                     lambda idx: np.full((rows, width), 0.01, np.float32))
    v = jax.make_array_from_callback((mesh.size * per,), NamedSharding(mesh, spec), lambda idx: np.ones((per,), np.float32))
    w = jax.make_array_from_callback((width, width), NamedSharding(mesh, P()), lambda idx: np.eye(width, dtype=np.float32))
    return _timed(program, [h, v, w], loops)


def _group_link(kind: str, group: int, added: tuple[float, float], whole: Link) -> Link | None:
    """The alpha-beta of ``kind`` over ``group`` devices from what it ``added`` to a trip between
    computation at the two payloads of :data:`LINK_SIZES`. None when it added nothing
    measurable at the small one (the ring's price of ``whole`` then stands); ``whole``'s beta
    when the large one did not cost more (noise: no wire is free).

    Example:
        >>> _group_link("all_reduce", 2, (4e-4, 4e-4), Link(1e-5, 2e-9)).beta  # the large payload no dearer
        2e-09
    """
    t_small, t_large = added
    if t_small <= 0:
        return None
    small, large = LINK_SIZES
    steps, wire = steps_and_wire(kind, group, large - small)
    beta = (t_large - t_small) / wire
    return Link(alpha=t_small / steps, beta=beta if beta > 0 else whole.beta)


def measure_group_links(n: int, whole: dict[str, Link], rounds: int = 5) -> dict[str, tuple]:
    """``Link.groups`` of each kind in ``whole`` (``all_reduce``, ``all_gather``: the links a loop
    of them measured over ``n`` devices of this process) for every group size that divides
    ``n``: what the collective adds between computation (:func:`_between_case`, every device
    running, each size's trip without it subtracted, the median of ``rounds`` rotated rounds)
    at the two payloads of :data:`LINK_SIZES`. A step pays that, its devices' waits for each
    other included: in one process on 8 simulated devices, at 4 KiB-1 MiB, a pair's all-reduce
    added 1.1-5.3x what the loop's link prices it at, a group of 4's 0.9-3x, all 8's 0.9-1.9x
    (the most at 4 KiB; BENCHMARKS.md, "plan"). Never below the loop's price: a group's alpha
    and beta are at least ``whole``'s (the times are differences of noisy medians, and one that
    came out a nanosecond above zero priced a 4 KiB all-reduce nearly free)."""
    import statistics

    import jax
    import numpy as np

    n = min(n, len(jax.local_devices()))
    devices = np.array(jax.local_devices()[:n]).reshape(1, n)
    sizes = [g for g in range(2, n + 1) if n % g == 0]
    cases = {(g, kind, size): _between_case(kind, devices, g, size)
             for g in sizes for size in LINK_SIZES for kind in (None, *whole)}
    seen = {k: statistics.median(v) for k, v in _interleaved(cases, rounds).items()}
    out = {}
    for kind, link in whole.items():
        own = ((g, _group_link(kind, g, tuple(seen[(g, kind, b)] - seen[(g, None, b)] for b in LINK_SIZES), link))
               for g in sizes)
        out[kind] = tuple((g, _floored(ab, link)) for g, ab in own if ab is not None)
    return out


def _floored(measured: Link, loop: Link) -> Link:
    """``measured`` (a group's link) never below ``loop``'s alpha and beta, piece by piece where
    ``loop`` has pieces (a calibrated fit over 4 KiB-64 MiB): the group's link replaces the
    loop's at its size, so a floor at the loop's overall line priced a 64 MiB all-reduce at a
    quarter of its large piece.

    Example:
        >>> loop = Link(1e-5, 1e-10, pieces=((2**21, Link(1e-5, 1e-10)), (None, Link(1e-4, 8e-10))))
        >>> [(p.alpha, p.beta) for _, p in _floored(Link(3e-5, 2e-10), loop).pieces]
        [(3e-05, 2e-10), (0.0001, 8e-10)]
    """
    floor = lambda ab: Link(max(measured.alpha, ab.alpha), max(measured.beta, ab.beta))  # noqa: E731
    return dataclasses.replace(floor(loop), pieces=tuple((limit, floor(p)) for limit, p in loop.pieces))


def _kib(nbytes: float) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:g} KiB"


def cpu_target(devices: int = 1) -> Target:
    """This machine as a target: simulated devices share its cores, so each device's rates
    are the process's measured rates divided by ``devices``; the link is an all-reduce among
    them, measured (or, with one device or too few, assumed); a collective's wait between
    computation (:attr:`Target.collective_sync_ops`) is what a tiny all-gather adds to a loop
    of matmuls beyond its alpha-beta time, in the loop's operation times. In a lone process the
    all-reduce and all-gather over each group size are also timed between computation
    (:func:`measure_group_links`): those groups are priced by that, their waits in it."""
    import platform

    import jax

    first = measure_cpu()
    n = max(int(devices), 1)
    measured = {kind: measure_collective(kind, n) for kind in ("all_reduce", "all_gather", "reduce_scatter")}
    link = measured["all_reduce"]
    overhead = measure_op_overhead(n)
    curve = measure_cache_curve(n)
    transposing = measure_cache_curve(n, TRANSPOSE_CURVE_BYTES, repeats=3, transpose=True)
    # Again, seconds later: a core taken away for longer than one window halved the GEMM rate in
    # 1 of 39 measurements; two windows apart rarely both miss.
    flops, bandwidth = (max(a, b) for a, b in zip(first, measure_cpu()))
    how = ("collectives measured (alpha s, beta s/B): " + ", ".join(
        f"{kind} {ab.alpha:.3g}, {ab.beta:.3g}" for kind, ab in measured.items() if ab) if link else
           f"link alpha {CPU_ALPHA:g} s assumed (spmdkit calibrate measures it)")
    target = Target(
        name=f"cpu ({platform.node()}, {n} simulated device(s))",
        source=f"measured at plan time on {platform.node()}, jax {jax.__version__}: f32 matmul {flops / 1e9:.1f} "
               f"GFLOP/s, read {bandwidth / 1e9:.1f} GB/s per process, divided among {n} device(s); {how}; "
               f"{overhead * 1e6:.2f} us per operation; warm elementwise data "
               + ", ".join(f"{_kib(b)} {r / 1e9:.1f}" for b, r in curve) + " GB/s per device; transposed "
               + ", ".join(f"{_kib(b)} {r / 1e9:.1f}" for b, r in transposing) + " GB/s per device",
        devices_per_host=n,
        peak_flops={"float32": flops / n},
        memory_bandwidth=bandwidth / n,
        links={"intra_host": link or Link(CPU_ALPHA, 1.0 / bandwidth), "inter_host": Link(*CPU_INTER_HOST)},
        collectives={kind: {"intra_host": ab} for kind, ab in measured.items() if ab},
        op_overhead=overhead,
        cache_bandwidth=curve,
        transpose_bandwidth=transposing,
    )
    # Over processes the planner measures the group links as that program routes them (gloo),
    # and replaces this process's.
    return with_collective_waits(target, n, groups=jax.process_count() == 1)


def with_collective_waits(target: Target, n: int, groups: bool = True) -> Target:
    """``target`` (its ``intra_host`` collectives measured in a loop of nothing but collectives
    over ``n`` devices of this process) with what they cost between computation, its source
    saying so: :attr:`Target.collective_sync_ops` (:func:`measure_collective_sync`, beyond the
    tiny all-gather's own alpha-beta time) and, with ``groups``, the all-reduce's and
    all-gather's ``Link.groups`` (:func:`measure_group_links`). ``spmdkit calibrate`` and the
    ``cpu`` target both measure these, so a calibrated file prices as ``cpu`` does."""
    seen = measure_collective_sync(n)
    if seen.extra and seen.op_seconds > 0:
        # Beyond the tiny all-gather's own alpha-beta time (its gathered output: one row per device).
        width = SYNC_SHAPE[1]
        sync = {g: max(s - collective_time(target, "all_gather", 4 * width * g, g, "intra_host"), 0.0) / seen.op_seconds
                for g, s in seen.extra.items()}
        target = dataclasses.replace(target, collective_sync_ops=sync, source=target.source + "; a collective between "
                                     "computation waits " + ", ".join(f"{s:.1f}" for s in sync.values()) + " operation "
                                     f"times ({seen.op_seconds * 1e6:.0f} us each in the measuring loop) for groups of "
                                     + ", ".join(str(g) for g in sync) + " devices")
    return _with_group_links(target, n) if groups else target


def _with_group_links(target: Target, n: int) -> Target:
    """``target`` with its measured ``intra_host`` all-reduce and all-gather links given their
    :func:`measure_group_links` (every group size of ``n`` devices, between computation), its
    source saying so; the other kinds keep their price and wait (``links`` stays without groups:
    all-to-all and collective permute, which have no entry of their own, are priced by it)."""
    loops = {kind: target.collectives[kind]["intra_host"] for kind in ("all_reduce", "all_gather")
             if "intra_host" in target.collectives.get(kind, {})}
    if not loops:
        return target
    groups = measure_group_links(n, loops)
    collectives = {**target.collectives, **{kind: {**target.collectives[kind], "intra_host": dataclasses.replace(
        loops[kind], groups=own)} for kind, own in groups.items()}}
    how = "; ".join(f"{kind} " + ", ".join(f"{g}: {ab.alpha:.3g}, {ab.beta:.3g}" for g, ab in own)
                    for kind, own in groups.items() if own)
    return dataclasses.replace(target, collectives=collectives, source=target.source + (
        f"; between computation (alpha s, beta s/B, by devices in the group: a step's waits included): {how}"
        if how else ""))


__all__ = ["LINK_SIZES", "Link", "Target", "TargetError", "checked_target", "collective_time", "cpu_target", "example_targets",
           "from_json", "load_target", "measure_cache_curve", "measure_collective", "measure_collective_sync",
           "measure_cpu", "measure_group_links", "measure_op_overhead", "steps_and_wire", "SyncMeasurement",
           "with_collective_waits"]
