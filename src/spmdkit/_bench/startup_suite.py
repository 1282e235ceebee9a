"""``spmdkit bench --suite startup``: what the persistent compile cache saves at start-up.

Time from process start to the end of the first training step (``first_step_s`` in
summary.json: interpreter start-up, imports, data, init and compilation included), for a
first start with an empty cache and a second start that finds the first one's programs.
Each round uses a fresh cache directory; the workloads take turns in a rotating order.
The floor is the time to start Python and import spmdkit, which no cache can save.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from spmdkit._bench._timing import machine

CLI = [sys.executable, "-m", "spmdkit._cli"]
WORKLOADS = {
    "digits, data-parallel, 8 devices": ["--host-devices", "8", "train", "--task", "digits", "--strategy", "data"],
    "mlp, sharded dp+tp 2x4, 8 devices": ["--host-devices", "8", "train", "--task", "mlp", "--strategy", "sharded",
                                          "--rules", "dp+tp", "--mesh", "data=2,model=4"],
}
TARGET = 0.5


def _first_step_s(args: list[str], cache: str, out: str) -> float:
    cmd = [*CLI, "--compile-cache", cache, *args, "--steps", "2", "--no-progress", "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json")) as fh:
        return float(json.load(fh)["first_step_s"])


def _import_floor_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import spmdkit._cli"], check=True, timeout=300)
    return time.perf_counter() - t0


def _spread(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "iqr": q[2] - q[0], "min": min(xs), "max": max(xs)}


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 2 if quick else 5
    load_before = os.getloadavg()
    samples: dict[str, dict[str, list[float]]] = {w: {"cold": [], "warm": [], "ratio": []} for w in WORKLOADS}
    floor: list[float] = []
    names = list(WORKLOADS)
    with tempfile.TemporaryDirectory(prefix="spmdkit-bench-startup-") as tmp:
        for r in range(rounds):
            floor.append(_import_floor_s())
            for i, name in enumerate(names[r % len(names):] + names[: r % len(names)]):
                cache, out = os.path.join(tmp, f"cache-{r}-{i}"), os.path.join(tmp, f"out-{r}-{i}")
                cold = _first_step_s(WORKLOADS[name], cache, out)
                warm = _first_step_s(WORKLOADS[name], cache, out)
                s = samples[name]
                s["cold"].append(cold)
                s["warm"].append(warm)
                s["ratio"].append(warm / cold)
    load_after = os.getloadavg()
    rows, targets = [], []
    floor_s = _spread(floor)
    for name, s in samples.items():
        cold, warm, ratio = _spread(s["cold"]), _spread(s["warm"]), _spread(s["ratio"])
        rows.append({
            "workload": name,
            "first start (s)": cold["median"],
            "second start (s)": warm["median"],
            "second / first": ratio["median"],
            "ratio min-max": f"{ratio['min']:.2f}-{ratio['max']:.2f}",
            "import floor (s)": floor_s["median"],
        })
        targets.append({"name": f"second start / first start, {name}", "value": ratio["median"],
                        "target": f"<= {TARGET}", "met": ratio["median"] <= TARGET})
    notes = [
        f"{rounds} rounds, each with a fresh cache directory, workloads in rotating order; medians, "
        "per-round ratios (min-max shown).",
        f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}"
        + (": the machine was busy, figures are doubtful" if max(load_before[0], load_after[0]) > 1.0 else "."),
        "time from process start to the end of step 1 (summary.json first_step_s); the import floor is "
        "`python -c 'import spmdkit._cli'`, which a cache cannot shorten.",
    ]
    return {
        "suite": "startup",
        "machine": machine(),
        "columns": list(rows[0]),
        "rows": rows,
        "targets": targets,
        "notes": notes,
        "raw": samples,
    }
