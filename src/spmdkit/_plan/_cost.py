"""The cost model: compute from FLOPs and bytes (a roofline per operation), collectives from the
target's alpha-beta links, plus each collective's wait between computation (the target's
``collective_sync_ops``)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from spmdkit._plan._hlo import Collective, Program
from spmdkit._target import Target, collective_time


def link_of(collective: Collective, devices_per_host: int) -> str:
    """``intra_host`` when every group's devices sit on one host (consecutive device indices)."""
    for group in collective.groups:
        if len({i // devices_per_host for i in group}) > 1:
            return "inter_host"
    return "intra_host"


def compute_time(flops: float, bytes_accessed: float, target: Target, dtype: str, ops: int = 0,
                 kernels: Sequence[tuple[float, float, int]] = ()) -> float:
    """A roofline (the slower of FLOPs and memory traffic) plus the target's fixed cost per operation.

    With ``kernels`` (``(FLOPs, bytes, executions)`` of each operation, :func:`spmdkit._plan._hlo.kernels`)
    the roofline is taken per operation and summed: a device runs its operations one after
    another, so a memory-bound one (an elementwise fusion over a residual stream that tensor
    parallelism leaves whole) adds its time to the matmuls' instead of hiding under the
    program's total FLOPs. Without, one roofline over the program's totals."""
    if kernels:
        peak, bandwidth = target.flops_for(dtype), target.memory_bandwidth
        return sum(n * max(f / peak, b / bandwidth) for f, b, n in kernels) + ops * target.op_overhead
    return max(flops / target.flops_for(dtype), bytes_accessed / target.memory_bandwidth) + ops * target.op_overhead


def collective_costs(program: Program, target: Target, devices_per_host: int,
                     op_seconds: float = 0.0, parameter_axes: Collection[str] = ()) -> list[dict[str, Any]]:
    """Each collective of ``program`` priced per step (``count`` executions, loop trips
    included): ``seconds`` is its alpha-beta time plus ``sync_seconds``, the wait of its group's
    devices for each other at every execution, ``Target.sync_ops_for(group)`` times
    ``op_seconds`` (the step's mean time per operation). ``prefetched``: an all-gather over
    mesh axes that split the batch (``parameter_axes``), which is how FSDP gathers parameters:
    it needs nothing the step computes, so it can run while the step computes."""
    out = []
    for c in program.collectives:
        link = link_of(c, devices_per_host)
        each = collective_time(target, c.kind, c.bytes, c.group_size, link, c.operands)
        sync = target.sync_ops_for(c.group_size) * op_seconds
        out.append({"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes, "group_size": c.group_size,
                    "count": c.count, "operands": c.operands, "link": link, "seconds": (each + sync) * c.count,
                    "sync_seconds": sync * c.count,
                    "prefetched": c.kind == "all_gather" and bool(c.axes) and set(c.axes) <= set(parameter_axes)})
    return out


def step_time(flops: float, bytes_accessed: float, comm_seconds: float, target: Target, dtype: str,
              ops: int = 0, sync_seconds: float = 0.0, kernels: Sequence[tuple[float, float, int]] = (),
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
