"""What a compiled program does, read from its HLO text: collectives, loop counts, matmul FLOPs.

XLA's ``cost_analysis`` counts the body of a ``while`` loop once, whatever its trip count:
a model scanned over 24 layers reports the FLOPs of one. The text of the compiled program
says how often each computation runs (``known_trip_count`` of a loop, the calls of
fusions), so the planner counts matmul FLOPs, bytes and collectives with those
multiplicities. Replica groups come in three spellings (explicit ``{{0,1},{2,3}}``, iota
``[2,4]<=[8]T(1,0)``, and ``mesh['a'=2,'b'=4] {'b'}``), all read as device groups and
named by the mesh axes along which their devices differ.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Collection
from typing import Any, NamedTuple

import numpy as np

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
             "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e8m0fnu": 1,
             "f4e2m1fn": 1, "s2": 1, "u2": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
KINDS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
         "all-to-all": "all_to_all", "collective-permute": "collective_permute"}


class Collective(NamedTuple):
    """One collective of the program: ``count`` executions per step of ``bytes`` each."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, collective_permute
    bytes: int  # the payload the alpha-beta model takes (see spmdkit._target)
    group_size: int
    axes: tuple[str, ...]  # mesh axes its groups span
    count: int
    groups: tuple[tuple[int, ...], ...]  # device indices (positions in mesh.devices.flat)
    name: str
    operands: int = 1  # arrays it moves at once (XLA combines a step's gradient all-reduces into one)


class Program(NamedTuple):
    collectives: list[Collective]
    dot_flops: float  # matmul FLOPs with loop counts (per device)
    extra_flops: float  # matmul FLOPs XLA's cost_analysis leaves out (loop bodies counted once)
    extra_bytes: float  # likewise for bytes accessed
    unknown_loops: int  # loops without a known trip count (counted once)
    ops: int = 0  # operations (kernels) one device executes per step, loop trips included
    kernels: tuple = ()  # a Kernel for each kind of operation: see :func:`kernels`


class Kernel(NamedTuple):
    """Operations of one kind a device executes per step: their matmul FLOPs and bytes read
    and written, each; how many; and ``cold``, the part of the bytes that the step's inputs
    and outputs are (the state and the batch, read or written in memory: the previous step
    touched them a whole step ago), the rest being data an operation of this step just made."""

    flops: float
    bytes: int
    count: int
    cold: int = 0
    # Bytes of it that a transposition moves (read and written): a copy into another layout
    # whose contiguous runs are shorter than a cache line touches a new line for every few
    # elements, several times slower on a CPU than an elementwise pass (see :func:`transposed`).
    strided: int = 0


def shape_bytes(text: str) -> int:
    """Bytes of an HLO type (``f32[4,16]{1,0}`` or a tuple of them)."""
    return sum(_ITEMSIZE.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _SHAPE.findall(text))


def _dims(text: str) -> list[int]:
    m = _SHAPE.search(text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


_LAYOUT = re.compile(r"^\s*[a-z]+[0-9a-z]*\[([0-9,]*)\](?:\{([0-9,]*))?")
CACHE_LINE = 64  # bytes: a transposition whose contiguous runs are shorter pays a line per run


def _dims_and_order(text: str) -> tuple[list[int], list[int]] | None:
    """An array type's dimensions and its layout's minor-to-major order (row-major when the
    type gives none); None for a tuple or a scalar."""
    m = _LAYOUT.match(text)
    if not m:
        return None
    dims = [int(d) for d in m.group(1).split(",") if d]
    order = [int(d) for d in m.group(2).split(",") if d] if m.group(2) else list(range(len(dims)))[::-1]
    return (dims, order) if len(order) == len(dims) else None


def contiguous_run(out_type: str, in_type: str, perm: list[int]) -> int | None:
    """Elements a copy from ``in_type`` to ``out_type`` (output dimension ``i`` is input
    dimension ``perm[i]``) moves in one contiguous run: the product of the output's minor
    dimensions, as long as the input keeps them minor in the same order (dimensions of size
    1 aside). The whole array: no data moves out of order (a bitcast); 1: every element
    lands away from its neighbour. None when the types do not say.

    Example:
        >>> contiguous_run("f32[512,8,64]{2,1,0}", "f32[512,8,64]{0,2,1}", [0, 1, 2])  # the minor dim changes
        1
        >>> contiguous_run("f32[8,4,64,16]{3,2,1,0}", "f32[8,64,4,16]{3,2,1,0}", [0, 2, 1, 3])  # heads to front
        16
        >>> contiguous_run("f32[512,8,64]{0,2,1}", "f32[8,64,512]{2,1,0}", [2, 0, 1])  # a relabelling
        262144
    """
    out, src = _dims_and_order(out_type), _dims_and_order(in_type)
    if out is None or src is None or len(out[0]) != len(src[0]) or len(perm) != len(out[0]):
        return None
    (dims, order), (in_dims, in_order) = out, src
    out_minor = [d for d in order if dims[d] != 1]
    in_minor = [d for d in in_order if in_dims[d] != 1]
    run = 1
    for o, i in zip(out_minor, in_minor):
        if perm[o] != i:
            return run
        run *= dims[o]
    return run


def transposed(ins: _Instr, shapes: dict[str, str]) -> int:
    """Bytes a ``copy`` or ``transpose`` reads and writes out of order (its runs shorter than
    :data:`CACHE_LINE`), 0 when it moves whole lines or changes no layout."""
    if ins.op not in ("copy", "transpose") or not ins.operands:
        return 0
    ranked = _dims_and_order(ins.type)
    if ranked is None or len(ranked[0]) < 2:
        return 0
    perm = list(range(len(ranked[0])))
    if ins.op == "transpose":
        m = re.search(r"dimensions=\{([0-9,]*)\}", ins.attrs)
        perm = [int(d) for d in m.group(1).split(",") if d] if m else []
    run = contiguous_run(ins.type, shapes.get(ins.operands[0], ""), perm)
    out = shape_bytes(ins.type)
    itemsize = out // max(math.prod(ranked[0]), 1)
    return 2 * out if run is not None and run * itemsize < CACHE_LINE else 0


def _split_type(rest: str) -> tuple[str, str]:
    """``"(f32[2], s32[]) tuple(...)"`` -> (type, the rest from the op name on)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    typ, _, tail = rest.partition(" ")
    return typ, tail


class _Instr(NamedTuple):
    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str


def _operands(tail: str, known: Collection[str]) -> tuple[list[str], str]:
    depth, i = 0, tail.index("(")
    for j in range(i, len(tail)):
        depth += tail[j] == "("
        depth -= tail[j] == ")"
        if depth == 0:
            inner, attrs = tail[i + 1: j], tail[j + 1:]
            if "%" in inner:
                return re.findall(r"%([\w.\-]+)", inner), attrs
            # Printed without sigils ("f32[4]{0} x, y"): each operand's last word, if it names a
            # value defined above (a literal such as constant(0)'s is not one).
            words = [part.split()[-1] for part in _top_level(inner) if part.split()]
            return [w for w in words if w in known], attrs
    return [], tail


def _top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets: ``"f32[2,3]{1,0} a, b"`` -> two parts."""
    parts, depth, start = [], 0, 0
    for k, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:k])
            start = k + 1
    return parts + [text[start:]]


def parse(text: str) -> tuple[dict[str, list[_Instr]], dict[str, dict[str, str]], str]:
    """``(computations: name -> instructions, shapes: computation -> {value: type}, entry)``;
    each computation's ``ROOT`` instruction is its last."""
    comps: dict[str, list[_Instr]] = {}
    shapes: dict[str, dict[str, str]] = {}
    roots: dict[str, _Instr] = {}
    entry, current = "", None
    for line in text.splitlines():
        if not line.strip():
            continue
        head = _HEADER.match(line) if not line.startswith(" ") else None
        if head:
            current = head.group(2)
            comps[current], shapes[current] = [], {}
            if head.group(1):
                entry = current
            for pname, ptype in re.findall(r"([\w.\-]+):\s*((?:\([^)]*\))|[^,()]+(?:\{[^}]*\})?)", head.group(3)):
                shapes[current][pname] = ptype
            continue
        if current is None or line.strip() == "}":
            continue
        m = _INSTR.match(line)
        if not m or "(" not in m.group(2):
            continue
        typ, tail = _split_type(m.group(2))
        op = tail.split("(", 1)[0].strip()
        operands, attrs = _operands(tail, shapes[current])
        if op == "parameter":  # its number, which the fusion's operand of that position feeds
            attrs = "number=" + tail.split("(", 1)[1].split(")", 1)[0].strip() + attrs
        comps[current].append(_Instr(m.group(1), typ, op, operands, attrs))
        shapes[current][m.group(1)] = typ
        if line.lstrip().startswith("ROOT "):
            roots[current] = comps[current][-1]
    for name, root in roots.items():  # XLA prints it last, unless unused instructions follow it
        comps[name].remove(root)
        comps[name].append(root)
    return comps, shapes, entry


def _trip_count(attrs: str) -> int | None:
    m = re.search(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)', attrs)
    return int(m.group(1)) if m else None


def multiplicities(comps: dict[str, list[_Instr]], entry: str) -> tuple[dict[str, int], dict[str, int], set[str], int]:
    """How often each computation runs per call of ``entry``: ``(true, as XLA's cost analysis
    counts (loops once), fused computations, loops of unknown trip count)``."""
    true: dict[str, int] = defaultdict(int)
    once: dict[str, int] = defaultdict(int)
    fused: set[str] = set()
    unknown = 0

    def visit(comp: str, n_true: int, n_once: int, depth: int = 0) -> None:
        nonlocal unknown
        if comp not in comps or depth > 50:
            return
        true[comp] += n_true
        once[comp] += n_once
        for ins in comps[comp]:
            if ins.op == "while":
                body = re.search(r"body=%?([\w.\-]+)", ins.attrs)
                trips = _trip_count(ins.attrs)
                if trips is None:
                    unknown += 1
                if body:
                    visit(body.group(1), n_true * (trips or 1), n_once, depth + 1)
                continue
            # a call's to_apply runs once per call (XLA:CPU wraps some loops in one); any other
            # to_apply (a reduce's, a scatter's) is part of its operation
            callees = re.findall(r"\bcalls=%?([\w.\-]+)", ins.attrs)
            if ins.op == "call":
                callees += re.findall(r"\bto_apply=%?([\w.\-]+)", ins.attrs)
            for callee in callees:
                if ins.op == "fusion":
                    fused.add(callee)
                visit(callee, n_true, n_once, depth + 1)
            # every branch is counted as if it ran: the planner cannot know which one does
            branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
            named = re.findall(r"\b(?:true|false)_computation=%?([\w.\-]+)", ins.attrs)
            for callee in (re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []) + named:
                visit(callee, n_true, n_once, depth + 1)

    visit(entry, 1, 1)
    return dict(true), dict(once), fused, unknown


def _matmul_flops(ins: _Instr, shapes: dict[str, str]) -> float:
    """FLOPs of a dot or a convolution (a matmul per output element), else 0."""
    if ins.op == "dot":
        return _dot_flops(ins, shapes)
    if ins.op == "convolution":
        return _conv_flops(ins, shapes)
    return 0.0


def _conv_flops(ins: _Instr, shapes: dict[str, str]) -> float:
    """Each output element sums its window over the kernel's input features, and only window
    positions on real input count: not padding, not the holes of an input dilation (a
    transposed convolution's stride), as XLA's own cost analysis counts them."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not labels or len(ins.operands) < 2:
        return 0.0
    lhs, rhs, out = (_dims(shapes.get(ins.operands[0], "")), _dims(shapes.get(ins.operands[1], "")),
                     _dims(ins.type))
    names = labels.groups()
    if [len(n) for n in names] != [len(lhs), len(rhs), len(out)] or "i" not in names[1]:
        return 0.0
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1))) if window else {}
    spatial = sorted(c for c in names[2] if c.isdigit())

    def field(key: str, d: int, default: str) -> str:
        values = fields.get(key, "").split("x")
        return values[d] if d < len(values) and values[d] else default

    hits = 1
    for d, label in enumerate(spatial):
        n, k, o = lhs[names[0].index(label)], rhs[names[1].index(label)], out[names[2].index(label)]
        stride, dilate, rhs_dilate = (int(field(key, d, "1")) for key in ("stride", "lhs_dilate", "rhs_dilate"))
        low = int(field("pad", d, "0_0").split("_")[0])
        at = np.arange(o)[:, None] * stride + np.arange(k)[None, :] * rhs_dilate - low  # in the dilated input
        hits *= int(((at >= 0) & (at <= (n - 1) * dilate) & (at % max(dilate, 1) == 0)).sum())
    per_output = math.prod(out[names[2].index(c)] for c in names[2] if not c.isdigit())
    return 2.0 * per_output * rhs[names[1].index("i")] * hits


def _dot_flops(ins: _Instr, shapes: dict[str, str]) -> float:
    out = math.prod(_dims(ins.type)) if _dims(ins.type) or "[]" in ins.type else 0
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
    lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
    k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d and int(d) < len(lhs)) if contracting else 1
    return 2.0 * out * k


_NO_TRAFFIC = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast", "after-all", "while", "call",
               "conditional", "partition-id", "replica-id"}


_IN_PLACE = ("dynamic-update-slice", "scatter")
_SLICES = ("dynamic-slice", "slice", "gather")  # read a part of their operand 0


def _number(ins: _Instr) -> int | None:
    """A parameter instruction's number (its place among the computation's arguments)."""
    found = re.match(r"number=(\d+)", ins.attrs) if ins.op == "parameter" else None
    return int(found.group(1)) if found else None


def _fused_body(ins: _Instr, comps: dict[str, list[_Instr]]) -> tuple[str, list[_Instr]]:
    """A fusion's computation: ``(name, instructions)``, ``("", [])`` if it names none."""
    callee = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
    return (callee.group(1), comps.get(callee.group(1), [])) if callee else ("", [])


def _through_views(ins: _Instr | None, by_name: dict[str, _Instr]) -> _Instr | None:
    """The instruction a value comes from, seen back through bitcasts and get-tuple-elements
    (as far as ``by_name`` knows them)."""
    views = ("bitcast", "get-tuple-element")
    while ins is not None and ins.op in views and ins.operands and ins.operands[0] in by_name:
        ins = by_name[ins.operands[0]]
    return ins


class _Moves(NamedTuple):
    """What one operation moves: bytes read of each operand, bytes written, and how many of the
    bytes read are slices at a run-time offset (a loop's layer of a stacked array)."""

    reads: list[int]
    written: int
    sliced: int = 0

    @property
    def total(self) -> int:
        return sum(self.reads) + self.written


def _traffic(ins: _Instr, shapes: dict[str, str], comps: dict[str, list[_Instr]]) -> int:
    """Bytes an instruction reads and writes (:func:`_moves`)."""
    return _moves(ins, shapes, comps).total


def _moves(ins: _Instr, shapes: dict[str, str], comps: dict[str, list[_Instr]]) -> _Moves:
    """An operation reads its operands and writes its output, except: a slice (static, dynamic,
    a gather) reads only the part it takes, also inside a fusion (a scan's trip reads its layer,
    not the stack); an update in place (a dynamic-update-slice or scatter, or a fusion whose
    root updates a buffer the fusion is given, as a scan writing its layer's row) reads and
    writes its other operands' bytes and whatever parts of the buffer it slices, not the whole
    buffer. A fusion that updates a buffer it computes ((x * 2).at[3].set(row)), or that reads
    the buffer whole, moves all of it; so does an optimizer's ``mu * b1 + g``, whose output
    has an operand's type."""
    reads = [shape_bytes(shapes.get(x, "")) for x in ins.operands]
    out = shape_bytes(ins.type)
    if ins.op in _SLICES and reads:
        return _Moves([min(out, reads[0])] + reads[1:], out, out if ins.op == "dynamic-slice" else 0)
    if ins.op in _IN_PLACE and reads:
        return _in_place(reads, out, 0, None) or _Moves(reads, out)
    if ins.op != "fusion":
        return _Moves(reads, out)
    _, body = _fused_body(ins, comps)
    parts = _parameter_parts(body)
    sliced = 0
    for i, (nbytes, dynamic) in parts.items():
        if i < len(reads) and nbytes < reads[i]:
            reads[i], sliced = nbytes, sliced + (nbytes if dynamic else 0)
    updated = _updated_parameter(body)
    if updated is not None and updated < len(reads):
        return _in_place(reads, out, updated, parts) or _Moves(reads, out, sliced)
    return _Moves(reads, out, sliced)


def _in_place(reads: list[int], out: int, buffer: int, parts: dict[int, tuple[int, bool]] | None) -> _Moves | None:
    """The update of operand ``buffer`` in place, if its other operands are smaller than it (else
    it is no cheaper than a rewrite). In a fusion (``parts`` of :func:`_parameter_parts`, None
    for a bare operation) the buffer must be read only through slices, if at all."""
    if parts is not None and buffer not in parts:
        return None
    others = sum(b for i, b in enumerate(reads) if i != buffer)
    if others >= out:
        return None
    taken, dynamic = parts[buffer] if parts is not None else (0, False)
    moved = [b if i != buffer else taken for i, b in enumerate(reads)]
    return _Moves(moved, others, taken if dynamic else 0)


def _parameter_parts(body: list[_Instr]) -> dict[int, tuple[int, bool]]:
    """The fused computation's parameters (by number) that it reads only through slices (seen
    through bitcasts), or that its root updates in place: ``(bytes the slices read, whether
    any is at a run-time offset)``. A parameter read whole by any operation is left out."""
    users: dict[str, list[_Instr]] = defaultdict(list)
    for ins in body:
        for name in ins.operands:
            users[name].append(ins)
    root = body[-1] if body else None

    def read(name: str) -> tuple[int, bool] | None:
        total, dynamic = 0, False
        for user in users[name]:
            if user.op in _SLICES and user.operands[0] == name and name not in user.operands[1:]:
                total, dynamic = total + shape_bytes(user.type), dynamic or user.op == "dynamic-slice"
            elif user is root and user.op in _IN_PLACE and user.operands[0] == name and name not in user.operands[1:]:
                continue
            elif user.op == "bitcast":
                inner = read(user.name)
                if inner is None:
                    return None
                total, dynamic = total + inner[0], dynamic or inner[1]
            else:
                return None
        return (total, dynamic) if users[name] else None

    out = {}
    for ins in body:
        number = _number(ins)
        part = read(ins.name) if number is not None else None
        if part is not None:
            out[number] = part
    return out


def _updated_parameter(body: list[_Instr]) -> int | None:
    """The number of the parameter a fused computation's root updates in place (operand 0 of a
    dynamic-update-slice or scatter, seen through bitcasts), else None: a root that updates a
    buffer the fusion computes writes all of it."""
    if not body or body[-1].op not in _IN_PLACE or not body[-1].operands:
        return None
    by_name = {i.name: i for i in body}
    source = _through_views(by_name.get(body[-1].operands[0]), by_name)
    return _number(source) if source is not None else None


def groups_of(attrs: str, n_devices: int) -> list[list[int]] | None:
    """The device groups of a collective's ``replica_groups`` (or permute pairs), or None."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        return _mesh_groups(m.group(1), m.group(2))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = np.transpose(ids, [int(p) for p in m.group(4).split(",")])
        return ids.reshape(g, s).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:
        groups = [[int(i) for i in grp.split(",") if i] for grp in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        return groups or [list(range(n_devices))]
    m = re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:
        return [[int(i) for i in pair.split(",")] for pair in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    return None


def _mesh_groups(mesh: str, chosen: str) -> list[list[int]]:
    """The device groups of ``replica_groups=mesh[<mesh>] {<chosen>}``: each chosen mesh axis
    whole (``'data'``), or a sub-axis of it (``'data':(2)4``: the factor of size 4 below a
    more major factor of 2, as a step that reshapes its batch into micro-batches splits the
    batch's axis).

    Example:
        >>> _mesh_groups("'data'=2,'model'=4", "'model'")
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> _mesh_groups("'data'=8", "'data':(1)2")  # the major factor 2 of data: devices 4 apart
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    """
    sizes = {name: int(size) for name, size in re.findall(r"'?(\w+)'?=(\d+)", mesh)}
    picks = [(name, (int(pre), int(size)) if size else None)
             for name, pre, size in re.findall(r"'?(\w+)'?(?::\((\d+)\)(\d+))?", chosen)]
    # Each axis split at the bounds of its chosen sub-axes, major to minor: ((axis, lo, hi), ...)
    # a factor of hi / lo, lo the product of the more major factors.
    dims = []
    for name, n in sizes.items():
        bounds = sorted({1, n} | {b for pick, sub in picks if pick == name and sub for b in (sub[0], sub[0] * sub[1])})
        dims += [(name, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    ids = np.arange(math.prod(sizes.values())).reshape([hi // lo for _, lo, hi in dims] or [1])
    last = [i for name, sub in picks for i, (axis, lo, hi) in enumerate(dims)
            if axis == name and (sub is None or (lo >= sub[0] and hi <= sub[0] * sub[1]))]
    moved = np.transpose(ids, [i for i in range(len(dims)) if i not in last] + last)
    return moved.reshape(-1, math.prod(dims[i][2] // dims[i][1] for i in last)).tolist()


def axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group differ."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    total = math.prod(sizes)
    varying: set[int] = set()
    for group in groups:
        coords = [np.unravel_index(i, sizes) for i in group if i < total]
        for a in range(len(names)):
            if len({c[a] for c in coords}) > 1:
                varying.add(a)
    return tuple(names[a] for a in sorted(varying))


def _payload(ins: _Instr, kind: str, shapes: dict[str, str]) -> int:
    if kind == "reduce_scatter":  # the model's B is the input's bytes
        return sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
    if ins.op.endswith("-start") and ins.type.startswith("("):
        parts = _SHAPE.findall(ins.type)  # (inputs..., outputs...): the gathered output is the largest
        return max((_ITEMSIZE.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in parts), default=0)
    return shape_bytes(ins.type)


def analyse(text: str, mesh_shape: dict[str, int]) -> Program:
    """The collectives (with axes and counts), matmul FLOPs and cost-analysis corrections."""
    comps, shapes, entry = parse(text)
    true, once, fused, unknown = multiplicities(comps, entry)
    n_devices = math.prod(mesh_shape.values())
    found: dict[tuple, list[Any]] = {}
    dot_flops = extra_flops = extra_bytes = 0.0
    ops = 0
    for comp, instrs in comps.items():
        t, o = true.get(comp, 0), once.get(comp, 0)
        for ins in instrs:
            if ins.op in ("dot", "convolution"):
                f = _matmul_flops(ins, shapes[comp])
                dot_flops += t * f
                extra_flops += (t - o) * f
            if comp not in fused and ins.op not in _NO_TRAFFIC and not ins.op.endswith("-done"):
                ops += t
                traffic = _traffic(ins, shapes[comp], comps)
                extra_bytes += (t - o) * traffic
            base = ins.op[: -len("-start")] if ins.op.endswith("-start") else ins.op
            if base not in KINDS or t == 0:
                continue
            kind = KINDS[base]
            groups = groups_of(ins.attrs, n_devices) or [list(range(n_devices))]
            size = max(len(g) for g in groups) if kind != "collective_permute" else 2
            axes = axes_of(groups, mesh_shape)
            nbytes = _payload(ins, kind, shapes[comp])
            key = (kind, nbytes, size, axes, max(len(ins.operands), 1))
            entry_ = found.setdefault(key, [0, groups, ins.name])
            entry_[0] += t
    collectives = [Collective(k[0], k[1], k[2], k[3], v[0], tuple(tuple(g) for g in v[1]), v[2], k[4])
                   for k, v in found.items()]
    collectives.sort(key=lambda c: -c.bytes * c.count)
    return Program(collectives, dot_flops, extra_flops, extra_bytes, unknown, ops,
                   tuple(_kernels(comps, shapes, true, fused, entry)))


def kernels(text: str) -> list[Kernel]:
    """Every operation one device executes per step (:class:`Kernel`), loop trips counted; a
    fusion is one operation (its matmuls' FLOPs, its operands' and output's bytes);
    collectives are left out (the target's links price them). Equal ones are merged, so the
    list stays short for a program unrolled over many layers. :func:`analyse` gives the same
    list as ``Program.kernels`` from its own parse."""
    comps, shapes, entry = parse(text)
    true, _, fused, _ = multiplicities(comps, entry)
    return _kernels(comps, shapes, true, fused, entry)


def _step_io(instrs: list[_Instr]) -> tuple[set[str], dict[str, int]]:
    """The entry's values that are the step's inputs (its parameters, and views of them) and
    the operations that write its outputs, with the bytes they write there: the root's
    operands (or the root), followed back through views (bitcast, get-tuple-element) to the
    operation that wrote them. A copy of a parameter is a new buffer, warm to its readers."""
    inputs = set()
    for ins in instrs:
        if ins.op == "parameter" or (ins.op in ("bitcast", "get-tuple-element") and ins.operands
                                     and ins.operands[0] in inputs):
            inputs.add(ins.name)
    if not instrs:
        return inputs, {}
    by_name = {i.name: i for i in instrs}
    root = instrs[-1]
    ends = [by_name[o] for o in root.operands if o in by_name] if root.op == "tuple" else [root]
    outputs: dict[str, int] = defaultdict(int)
    for end in ends:
        outputs[_through_views(end, by_name).name] += shape_bytes(end.type)
    return inputs, dict(outputs)


def _kernels(comps: dict[str, list[_Instr]], shapes: dict[str, dict[str, str]], true: dict[str, int],
             fused: set[str], entry: str) -> list[Kernel]:
    merged: dict[tuple[float, int, int], int] = defaultdict(int)
    inputs, outputs = _step_io(comps.get(entry, []))
    for comp, instrs in comps.items():
        t = true.get(comp, 0)
        if comp in fused or t == 0:
            continue
        for ins in instrs:
            base = ins.op[: -len("-start")] if ins.op.endswith("-start") else ins.op
            if ins.op in _NO_TRAFFIC or ins.op.endswith("-done") or base in KINDS:
                continue
            flops, strided = _matmul_flops(ins, shapes[comp]), transposed(ins, shapes[comp])
            if ins.op == "fusion":
                callee, inner = _fused_body(ins, comps)
                flops = sum(_matmul_flops(j, shapes[callee]) for j in inner)
                strided = sum(transposed(j, shapes[callee]) for j in inner)
            moves = _moves(ins, shapes[comp], comps)
            # a slice at a run-time offset (a loop's layer of a stacked array) was last touched
            # a whole loop ago, or is the step's input: cold wherever it runs
            cold = moves.sliced
            if comp == entry:
                cold += sum(b for x, b in zip(ins.operands, moves.reads) if x in inputs)
                cold += min(outputs.get(ins.name, 0), moves.written)
            # a fusion computes only its output's elements, in its output's order: a transposition
            # there moves at most what it writes and as much read across lines, not the whole of an
            # intermediate it slices or concatenates (a lone copy moves exactly that much)
            strided = min(strided, 2 * moves.written, moves.total)
            merged[(flops, moves.total, min(cold, moves.total), strided)] += t
    return [Kernel(f, b, n, c, s) for (f, b, c, s), n in merged.items()]
