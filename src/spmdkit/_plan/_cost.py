"""The cost model: compute from FLOPs and bytes (a roofline per operation), collectives from the
target's alpha-beta links, plus each collective's wait between computation (the target's
``collective_sync_ops``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from spmdkit._plan._hlo import Collective, Kernel, Program
from spmdkit._rules import _as_tuple
from spmdkit._strategies.sharded import _itemsize
from spmdkit._target import Target, collective_time


def link_of(collective: Collective, devices_per_host: int) -> str:
    """``intra_host`` when every group's devices sit on one host (consecutive device indices)."""
    for group in collective.groups:
        if len({i // devices_per_host for i in group}) > 1:
            return "inter_host"
    return "intra_host"


def compute_time(flops: float, bytes_accessed: float, target: Target, dtype: str, ops: int = 0,
                 kernels: Sequence[Kernel] = ()) -> float:
    """A roofline (the slower of FLOPs and memory traffic) plus the target's fixed cost per operation.

    With ``kernels`` (:func:`spmdkit._plan._hlo.kernels`) the roofline is taken per operation
    and summed: a device runs its operations one after another, so a memory-bound one (an
    elementwise fusion over a residual stream that tensor parallelism leaves whole) adds its
    time to the matmuls' instead of hiding under the program's total FLOPs. An operation
    without matmuls reads and writes its cold bytes (the step's inputs and outputs) at the
    target's memory bandwidth and the rest, which an operation just made, at
    :meth:`Target.bandwidth_for` its size: a CPU's caches hold small ones; the part a
    transposition moves (``Kernel.strided``) at :meth:`Target.transpose_bandwidth_for` its
    size. Without kernels, one roofline over the program's totals.

    Example:
        >>> from spmdkit._plan._hlo import Kernel
        >>> t = Target("t", "example", 1, {"float32": 1e12}, 1e9, {}, cache_bandwidth=((1e3, 4e9), (1e9, 1e9)))
        >>> warm, cold = Kernel(0.0, 1000, 1), Kernel(0.0, 1000, 1, cold=1000)
        >>> [round(compute_time(0, 0, t, "float32", kernels=[k]) * 1e9) for k in (warm, cold)]  # ns
        [250, 1000]
        >>> slow = Target("t", "example", 1, {"float32": 1e12}, 1e9, {}, cache_bandwidth=((1e3, 4e9), (1e9, 1e9)),
        ...               transpose_bandwidth=((1e3, 1e9),))
        >>> round(compute_time(0, 0, slow, "float32", kernels=[Kernel(0.0, 1000, 1, strided=1000)]) * 1e9)  # transposed
        1000
    """
    if kernels:
        peak, bandwidth = target.flops_for(dtype), target.memory_bandwidth
        total = 0.0
        for k in kernels:
            if k.flops > 0:
                total += k.count * max(k.flops / peak, k.bytes / bandwidth)
            else:
                total += k.count * _elementwise_time(k, target)
        return total + ops * target.op_overhead
    return max(flops / target.flops_for(dtype), bytes_accessed / target.memory_bandwidth) + ops * target.op_overhead


def _elementwise_time(k: Kernel, target: Target) -> float:
    """One operation without matmuls: cold bytes at memory bandwidth, warm ones at
    :meth:`Target.bandwidth_for` its size, and what a transposition moves (cold or warm: the
    step's own state transposed counts) at :meth:`Target.transpose_bandwidth_for` that size,
    never faster than the operation's other bytes, so the price never drops below the one
    without the curve (a target without it prices as before)."""
    plain = k.cold / target.memory_bandwidth + (k.bytes - k.cold) / target.bandwidth_for(k.bytes)
    moved = min(k.strided, k.bytes) if target.transpose_bandwidth else 0
    if not moved:
        return plain
    rest = k.bytes - moved
    cold = min(k.cold, rest)
    rate = min(target.transpose_bandwidth_for(moved), target.bandwidth_for(k.bytes))
    priced = cold / target.memory_bandwidth + (rest - cold) / target.bandwidth_for(k.bytes) + moved / rate
    return max(priced, plain)


def transposition_time(target: Target, dtype: str, kernels: Sequence[Kernel]) -> float:
    """What the transpositions of ``kernels`` (``Kernel.strided``) add to :func:`compute_time`
    over pricing their bytes as other warm data: the reason sequence parallelism's layouts run
    slower on a CPU than their FLOPs say. 0 for a target without ``transpose_bandwidth``.

    Example:
        >>> t = Target("t", "example", 1, {"float32": 1e12}, 1e9, {}, cache_bandwidth=((1e3, 4e9),),
        ...            transpose_bandwidth=((1e3, 1e9),))
        >>> round(transposition_time(t, "float32", [Kernel(0.0, 1000, 1, strided=1000)]) * 1e9)  # 1000 - 250 ns
        750
    """
    moving = [k for k in kernels if k.strided]  # the others cost the same either way
    if not target.transpose_bandwidth or not moving:
        return 0.0
    plain = dataclasses.replace(target, transpose_bandwidth=())
    return compute_time(0, 0, target, dtype, 0, moving) - compute_time(0, 0, plain, dtype, 0, moving)


def collective_costs(program: Program, target: Target, devices_per_host: int, op_seconds: float = 0.0,
                     batch_axes: Collection[str] = (), parameter_gathers: Collection[int] = ()
                     ) -> list[dict[str, Any]]:
    """Each collective of ``program`` priced per step (``count`` executions, loop trips
    included): ``seconds`` is its alpha-beta time plus ``sync_seconds``, the wait of its group's
    devices for each other at every execution, ``Target.sync_ops_for(group)`` times
    ``op_seconds`` (the step's mean time per operation), none for a group priced by its own
    link (``Link.groups``: timed between computation, the waits are in it). ``prefetched``: FSDP's gather of a
    parameter, an all-gather over mesh axes that split the batch (``batch_axes``) whose size is
    a parameter's gathered whole, or one layer's of a stacked one, or 2-4 of those concatenated
    (``parameter_gathers``, bytes; see :func:`parameter_gathers`): it needs nothing the step
    computes, so it can run while the step computes. An all-gather of something the step
    computed (logits for a contrastive loss) is not one, unless its size happens to be such a
    size under a layout that splits parameters over the batch's axes (the HLO is not traced)."""
    out = []
    for c in program.collectives:
        link = link_of(c, devices_per_host)
        each = collective_time(target, c.kind, c.bytes, c.group_size, link, c.operands)
        base = target.link(c.kind, link)
        # A group's own link is timed between computation, its waits in it (Link.groups).
        sync = 0.0 if base.for_group(c.group_size) is not base else target.sync_ops_for(c.group_size) * op_seconds
        out.append({"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes, "group_size": c.group_size,
                    "count": c.count, "operands": c.operands, "link": link, "seconds": (each + sync) * c.count,
                    "sync_seconds": sync * c.count,
                    "prefetched": (c.kind == "all_gather" and bool(c.axes) and set(c.axes) <= set(batch_axes)
                                   and _of_parameters(c.bytes, parameter_gathers))})
    return out


def _of_parameters(nbytes: int, sizes: Collection[int]) -> bool:
    """Whether ``nbytes`` is a parameter gather's size, or 2-4 of one size side by side (XLA
    gathers the query, key and value weights concatenated for one product)."""
    return any(nbytes == k * size for size in sizes for k in (1, 2, 3, 4))


def parameter_gathers(leaves: Iterable[Any], mesh: Mapping[str, int], batch_axes: Collection[str]) -> set[int]:
    """Bytes of the parameters ``leaves`` (``LeafLayout``: shape, dtype, spec) gathered whole
    over ``batch_axes`` (still split over the others), and of one layer of each (its first
    dimension dropped: a scanned stack is gathered a layer at a time); also at 2 bytes an
    element for float32 ones (mixed precision may gather them cast). Only parameters the
    layout splits over ``batch_axes``.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> from spmdkit._strategies.sharded import LeafLayout
        >>> w = LeafLayout("w", (4, 256, 1024), "float32", None, P(None, "data", "model"), 0, 0)
        >>> sorted(parameter_gathers([w], {"data": 8, "model": 2}, ("data",)))  # whole over data, split over model
        [262144, 524288, 1048576, 2097152]
    """
    batch = set(batch_axes)
    out: set[int] = set()
    for leaf in leaves:
        spec = [_as_tuple(axes) for axes in leaf.spec] + [()] * (len(leaf.shape) - len(leaf.spec))
        if not any(batch & set(axes) for axes in spec):
            continue
        dims = [n // math.prod(mesh.get(a, 1) for a in axes if a not in batch) for n, axes in zip(leaf.shape, spec)]
        itemsize = _itemsize(leaf.dtype)
        for item in {itemsize, 2} if itemsize == 4 else {itemsize}:
            out.add(math.prod(dims) * item)
            if len(dims) > 1:
                out.add(math.prod(dims[1:]) * item)
    return out


def step_time(flops: float, bytes_accessed: float, comm_seconds: float, target: Target, dtype: str,
              ops: int = 0, sync_seconds: float = 0.0, kernels: Sequence[Kernel] = (),
              prefetched_seconds: float = 0.0) -> dict[str, float]:
    """Compute time (:func:`compute_time`) and the step's range ``[overlapped, not overlapped]``
    with the collectives. ``comm_seconds`` includes ``sync_seconds`` (the collectives' waits)
    and ``prefetched_seconds``, the parameter gathers (waits included), which need nothing the
    step computes: at the low end they run while it computes. Every other collective takes
    what a computation made and feeds the next (an activation's all-reduce, the gradients'
    reduction), so it adds to compute at both ends.

    Example:
        >>> cpu = Target("t", "example", 1, {"float32": 1e12}, 1e11, {}, op_overhead=1e-3)
        >>> t = step_time(0, 0, 0.004, cpu, "float32", ops=10, prefetched_seconds=0.003)  # 10 ms of compute
        >>> round(t["step_s_overlapped"], 6), round(t["step_s_serial"], 6)
        (0.011, 0.014)
    """
    compute = compute_time(flops, bytes_accessed, target, dtype, ops, kernels)
    low = max(compute, prefetched_seconds) + comm_seconds - prefetched_seconds
    high = compute + comm_seconds
    return {"compute_s": compute, "comm_s": comm_seconds, "sync_s": sync_seconds, "prefetched_s": prefetched_seconds,
            "step_s_overlapped": low, "step_s_serial": high, "step_s": math.sqrt(low * high) if low > 0 else high}
