"""``spmdkit inspect``: the sharded layout and the compiled step's cost, without running it."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from rich.console import Console
from rich.table import Table

from spmdkit._console import readable_bytes, readable_flops
from spmdkit._errors import ConfigError, fix
from spmdkit._plan._hlo import analyse
from spmdkit._rules import LayoutError
from spmdkit._strategies.sharded import Sharded
from spmdkit._tasks._base import Task
from spmdkit._tree import abstract_rows


def _analysis(obj: Any) -> Any:
    return obj[0] if isinstance(obj, (list, tuple)) else obj


def layout_report(task: Task, strategy: Sharded, optimizer: optax.GradientTransformation, batch_size: int,
                  grad_accum: int = 1) -> dict[str, Any]:
    """Every parameter's layout and the compiled train step's per-device memory and flops.

    The step is lowered and compiled from abstract values only: no array of the model
    is allocated and no step runs. With ``grad_accum`` it is the step ``fit`` runs with that
    many micro-batches (``TrainConfig(grad_accum=...)``), whose activations are a micro-batch's.
    """
    from spmdkit._train._steps import task_state, task_train_step

    if isinstance(grad_accum, bool) or not isinstance(grad_accum, (int, np.integer)) or grad_accum < 1 \
            or batch_size % grad_accum:
        raise ConfigError(fix(f"grad_accum={grad_accum!r} must be a whole number >= 1 that divides batch_size="
                              f"{batch_size}: the micro-batches of a step are equal, as in fit.",
                              "pass a divisor of the batch (--grad-accum, --batch-size)."))
    make_state = task_state(task, optimizer)
    layout = strategy.plan(make_state)
    params = [leaf for leaf in layout.leaves if leaf.path.startswith("state.params")]
    others = [leaf for leaf in layout.leaves if not leaf.path.startswith("state.params")]
    # The batch asked for, not rounded up: an uneven one is compiled as fit runs it, whole on every device.
    batch = jax.tree.map(lambda x: abstract_rows(x, batch_size), task.train_data)
    step = strategy.step(task_train_step(task, optimizer, int(grad_accum)))
    compiled = step.lower(layout.abstract, batch).compile()
    mem = _analysis(compiled.memory_analysis())
    cost = _analysis(compiled.cost_analysis()) or {}
    # XLA's cost analysis counts a loop's body once: a scanned model's layers are added from the HLO
    program = analyse(compiled.as_text(), dict(strategy.mesh.shape))
    memory = {
        name: int(getattr(mem, f"{name}_size_in_bytes", 0))
        for name in ("argument", "output", "temp", "alias", "generated_code")
    }
    return {
        "task": task.name,
        **strategy.describe(),
        "batch_size": batch_size,
        "grad_accum": int(grad_accum),
        "batch_placement": _placement(batch_size, strategy.batch_shards),
        "params": [
            {
                "path": leaf.path.removeprefix("state.params"),
                "shape": list(leaf.shape),
                "dtype": leaf.dtype,
                "logical": None if leaf.logical is None else list(leaf.logical),
                "spec": str(leaf.spec),
                "bytes": leaf.bytes,
                "bytes_per_device": leaf.bytes_per_device,
            }
            for leaf in params
        ],
        "param_bytes": sum(leaf.bytes for leaf in params),
        "param_bytes_per_device": sum(leaf.bytes_per_device for leaf in params),
        "optimizer_bytes_per_device": sum(leaf.bytes_per_device for leaf in others),
        "replicated_fraction": layout.replicated_fraction(),
        "step_memory_per_device": memory,
        "step_flops_per_device": float(cost.get("flops", 0.0)) + program.extra_flops,
        "step_bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0)) + program.extra_bytes,
    }


def _placement(batch_size: int, shards: int) -> str:
    if batch_size % shards == 0:
        return f"split: {batch_size // shards} row(s) on each of {shards} batch shard(s)"
    return (f"whole on every device: {batch_size} rows do not split over {shards} batch shards, so the step "
            f"(as train runs it) computes all of them on each device; a multiple of {shards} splits")


def array_layout(strategy: Sharded, path: str) -> dict[str, Any]:
    """Which block of one state array each device holds (for ``--show PATH``)."""
    assert strategy.layout is not None
    for leaf in strategy.layout.leaves:
        if leaf.path.removeprefix("state.params") == path or leaf.path == path:
            break
    else:
        known = [leaf.path.removeprefix("state.params") for leaf in strategy.layout.leaves if leaf.path.startswith("state.params")]
        raise LayoutError(fix(f"--show {path!r}: no parameter has that path.", f"use one of {known}."))
    sharding = jax.sharding.NamedSharding(strategy.mesh, leaf.spec)
    blocks = sharding.devices_indices_map(leaf.shape)
    cells = {}
    for device, index in blocks.items():
        cells[device.id] = "[" + ", ".join(
            ":" if s.start is None and s.stop is None else f"{s.start or 0}:{s.stop if s.stop is not None else n}"
            for s, n in zip(index, leaf.shape)
        ) + "]"
    grid = np.vectorize(lambda d: cells[d.id])(strategy.mesh.devices)
    return {"path": path, "shape": list(leaf.shape), "spec": str(leaf.spec), "mesh": dict(strategy.mesh.shape),
            "grid": grid.tolist(), "device_ids": np.vectorize(lambda d: d.id)(strategy.mesh.devices).tolist()}


def print_report(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{report['task']}: rules {report['rules']!r} on mesh {report['mesh']}")
    for col in ("parameter", "shape", "logical axes", "PartitionSpec", "per device"):
        table.add_column(col, justify="right" if col == "per device" else "left")
    for p in report["params"]:
        table.add_row(p["path"], str(tuple(p["shape"])), str(p["logical"]), p["spec"], readable_bytes(p["bytes_per_device"]))
    console.print(table)
    m = report["step_memory_per_device"]
    console.print(
        f"parameters: {readable_bytes(report['param_bytes'])} in all, {readable_bytes(report['param_bytes_per_device'])} per device; "
        f"optimizer state {readable_bytes(report['optimizer_bytes_per_device'])} per device; "
        f"{report['replicated_fraction']:.0%} of the state replicated"
    )
    micro = f" in {report['grad_accum']} micro-batches" if report.get("grad_accum", 1) > 1 else ""
    console.print(
        f"compiled train step (batch {report['batch_size']}{micro}), per device: arguments {readable_bytes(m['argument'])}, "
        f"outputs {readable_bytes(m['output'])}, temporaries {readable_bytes(m['temp'])}; "
        f"{readable_flops(report['step_flops_per_device'])}, {readable_bytes(report['step_bytes_accessed_per_device'])} "
        "accessed (loop trips counted)"
    )
    console.print(f"batch {report['batch_size']}: {report['batch_placement']}", highlight=False, markup=False)


def print_array_layout(info: dict[str, Any], console: Console) -> None:
    mesh_names = list(info["mesh"])
    title = f"{info['path']} {tuple(info['shape'])} spec {info['spec']}: block held by each device"
    table = Table(title=title)
    grid, ids = info["grid"], info["device_ids"]
    if len(mesh_names) == 1:
        grid, ids = [grid], [ids]
    cols = mesh_names[1] if len(mesh_names) > 1 else mesh_names[0]
    table.add_column(f"{mesh_names[0]} \\ {cols}" if len(mesh_names) > 1 else "")
    for j in range(len(grid[0])):
        table.add_column(f"{cols}={j}")
    for i, row in enumerate(grid):
        label = f"{mesh_names[0]}={i}" if len(mesh_names) > 1 else ""
        table.add_row(label, *(f"dev {d}: {cell}" for d, cell in zip(ids[i], row)))
    console.print(table)
