"""``spmdkit bench --suite multiprocess``: two processes on two cores, against PyTorch.

Same model, global batch (512) and steps for every case; samples/s of process 0:
(a) spmdkit, 1 process using both cores; (b) spmdkit, 2 processes x 1 device via
``spmdkit launch`` (jax.distributed, gloo), with the levers one by one; (c) PyTorch,
1 process, 2 threads; (d) PyTorch DistributedDataParallel, gloo, 2 processes.
PyTorch is an optional extra (``pip install -e '.[bench]'``, torch 2.13.0 CPU); without
it the suite reports the spmdkit cases only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from spmdkit._bench._timing import machine

WORKER = [sys.executable, "-m", "spmdkit._bench.mp_worker"]
LAUNCH = [sys.executable, "-m", "spmdkit._cli", "launch", "-n", "2", "--host-devices-per-process", "1", "--"]


def _rate(cmd: list[str]) -> float | None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        line = line.removeprefix("[0] ")
        if line.startswith("{"):
            return float(json.loads(line)["samples_per_s"])
    sys.stderr.write(out.stderr[-2000:])
    return None


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def run(quick: bool = False) -> dict[str, Any]:
    steps = "10" if quick else "40"
    torch = _have_torch()
    rows, targets = [], []
    for model in ("mlp", "cnn"):
        base = ["--model", model, "--steps", steps]
        cases = {
            "(a) spmdkit, 1 process": WORKER + ["--framework", "jax", *base],
            "(b) spmdkit, 2 processes, impl jit": LAUNCH + WORKER + ["--framework", "jax", *base, "--impl", "jit"],
            "(b) default: shard_map, one packed all-reduce": LAUNCH + WORKER + ["--framework", "jax", *base],
            "(b) + shard_map + grad-accum 2": LAUNCH + WORKER + ["--framework", "jax", *base, "--impl", "shard_map", "--accum", "2"],
        }
        if torch:
            cases["(c) PyTorch, 1 process, 2 threads"] = WORKER + ["--framework", "torch", *base]
            cases["(d) PyTorch DDP, 2 processes"] = LAUNCH + WORKER + ["--framework", "torch", *base]
        rates = {name: _rate(cmd) for name, cmd in cases.items()}
        for name, rate in rates.items():
            rows.append({"model": "MLP 784-1024-1024-10" if model == "mlp" else "digits CNN", "case": name,
                         "samples_per_s": rate if rate is not None else float("nan")})
        if torch:
            best_b = max(v for k, v in rates.items() if k.startswith("(b)") and v)
            for label, ours, theirs in (
                ("(b) default / (d)", rates["(b) default: shard_map, one packed all-reduce"], rates["(d) PyTorch DDP, 2 processes"]),
                ("(b) best lever / (d)", best_b, rates["(d) PyTorch DDP, 2 processes"]),
                ("(a) / (c)", rates["(a) spmdkit, 1 process"], rates["(c) PyTorch, 1 process, 2 threads"]),
            ):
                value = (ours or 0.0) / (theirs or float("inf"))
                targets.append({"name": f"{model}: {label}", "value": value, "target": ">= 1.0", "met": value >= 1.0})
    return {
        "suite": "multiprocess",
        "machine": machine(),
        "columns": ["model", "case", "samples_per_s"],
        "rows": rows,
        "targets": targets,
        "notes": [f"global batch 512, SGD, {steps} timed steps after 5 warm-up steps, every step synced"]
        + ([] if torch else ["PyTorch is not installed: pip install -e '.[bench]' for cases (c) and (d)"]),
    }
