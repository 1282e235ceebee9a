"""``spmdkit bench --suite startup``: what the persistent compile cache saves at start-up.

Time from process start to the end of the first training step (``first_step_s`` in
summary.json: interpreter start-up, imports, data, init and compilation included), for a
first start with an empty cache and a second start that finds the first one's programs.
Each round uses a fresh cache directory; the workloads take turns in a rotating order
(BENCHMARKS.md "Method"; a first and a second start stay together in a round, since the
second needs the first one's cache), and each ratio pairs the two starts of one round.
The floor is the time to start Python and import spmdkit, which no cache can save.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from spmdkit._bench._timing import LoadMeter, idle_load, machine, ratio, record, rotations, target
from spmdkit._bench.report import collect

CLI = [sys.executable, "-P", "-m", "spmdkit._cli"]  # -P as the console script: not the working directory's modules
WORKLOADS = {
    "digits, data-parallel, 8 devices": ["--host-devices", "8", "train", "--task", "digits", "--strategy", "data"],
    "mlp, sharded dp+tp 2x4, 8 devices": ["--host-devices", "8", "train", "--task", "mlp", "--strategy", "sharded",
                                          "--rules", "dp+tp", "--mesh", "data=2,model=4"],
}
TARGET = 0.5


def _first_step_s(args: list[str], cache: str, out: str) -> tuple[float, float]:
    """(process start -> end of step 1, fit() entered -> end of step 1), in seconds."""
    cmd = [*CLI, "--compile-cache", cache, *args, "--steps", "2", "--no-progress", "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    return float(summary["first_step_s"]), float(summary["first_step_in_fit_s"])


def _import_floor_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-P", "-c", "import spmdkit._cli"], check=True, timeout=300)
    return time.perf_counter() - t0


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    rounds = rounds or (2 if quick else 5)
    names = list(WORKLOADS)
    times: dict[str, list[float | None]] = {"import floor": []}
    for name in names:
        for kind in ("first start", "second start", "first start, in fit", "second start, in fit"):
            times[f"{name}: {kind}"] = []
    order = []
    before = idle_load()
    meter = LoadMeter()
    with tempfile.TemporaryDirectory(prefix="spmdkit-bench-startup-") as tmp:
        # A second start needs the first start's cache: the pair stays together within a
        # round, and the workloads (and the floor) take turns in a rotating order.
        for turn in rotations(["import floor", *names], rounds):
            order.append([])
            for i, name in enumerate(turn):
                if name == "import floor":
                    times[name].append(_import_floor_s())
                    order[-1].append(name)
                    continue
                cache, out = os.path.join(tmp, f"cache-{len(order)}-{i}"), os.path.join(tmp, f"out-{len(order)}-{i}")
                for kind in ("first start", "second start"):
                    whole, in_fit = _first_step_s(WORKLOADS[name], cache, out)
                    times[f"{name}: {kind}"].append(whole)
                    times[f"{name}: {kind}, in fit"].append(in_fit)
                    order[-1].append(f"{name}: {kind}")
    run_record = record(times, order, {"before": before, "during": meter.stop(), "after": idle_load()})
    rows, targets = [], []
    floor = run_record["cases"]["import floor"]
    for name in names:
        first, second = f"{name}: first start", f"{name}: second start"
        r = ratio(run_record, second, first)
        r_fit = ratio(run_record, f"{second}, in fit", f"{first}, in fit")
        rows.append({
            "workload": name,
            "first start (s)": run_record["cases"][first]["median"],
            "second start (s)": run_record["cases"][second]["median"],
            "second / first": r["median"],
            "ratio IQR": f"{r['q1']:.2f}-{r['q3']:.2f}",
            "import floor (s)": floor["median"],
            "in fit: first (s)": run_record["cases"][f"{first}, in fit"]["median"],
            "in fit: second (s)": run_record["cases"][f"{second}, in fit"]["median"],
            "in fit: second / first": r_fit["median"],
            "flag": ",".join(sorted(set(r["flags"]) | set(run_record["cases"][second]["flags"]))),
        })
        targets.append(target(f"second start / first start, {name} (paired per round)", r, "<=", TARGET))
    notes = [
        f"{rounds} rounds, each with a fresh cache directory, workloads in rotating order; medians, "
        "ratios paired per round (IQR shown).",
        "time from process start to the end of step 1 (summary.json first_step_s); the import floor is "
        "`python -c 'import spmdkit._cli'`, which a cache cannot shorten. The target is on this whole-process "
        "ratio. `in fit` is the part after the imports: from entering fit() (data, init, compiling, step 1) "
        "to the end of step 1 (summary.json first_step_in_fit_s), where the cache does its work.",
    ]
    report = {
        "suite": "startup",
        "machine": machine(),
        "columns": list(rows[0]),
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }
    return collect(report, {"startup": run_record})
