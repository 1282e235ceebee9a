"""``spmdkit bench --suite pmap``: spmdkit.pmap vs jax.pmap vs jit(vmap).

The same function and inputs go to three implementations; each call is synced
(block_until_ready) so the XLA:CPU collective deadlock cannot build up and so the
time is the time to a usable result. Inputs are given two ways: device-resident
(already where each implementation keeps its outputs, the steady state of a loop)
and host numpy arrays (the seeds' style: every call transfers them).

Nested maps (2 x n/2 devices): ``jax.pmap`` cannot nest, so its row is the way a
``jax.pmap`` user writes a 2-D layout, ``jax.pmap`` outside and ``jax.vmap`` inside.
The multi-process case starts 2 processes x 1 device (``spmdkit launch``) running
this module as a worker; process 0 reports its times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit._bench._timing import LoadMeter, case_row, geomean, machine, measure, ratio, record, rotations, target
from spmdkit._bench.report import collect
from spmdkit._demo import convolve
from spmdkit._pmap import pmap as spmd_pmap

TARGET = 1.0  # spmdkit.pmap time / jax.pmap time


def _workloads(n: int, quick: bool) -> dict[str, tuple[Callable[..., Any], Callable[..., Any], tuple]]:
    """name -> (per-device f with axis 'i', equivalent batched f, host inputs)."""
    rng = np.random.default_rng(0)
    size = 64 if quick else 256
    mats = rng.standard_normal((n, size, size), dtype=np.float32)
    xs = np.arange(5 * n, dtype=np.float32).reshape(n, 5)
    ws = np.tile(np.array([2.0, 3.0, 4.0], np.float32), (n, 1))
    return {
        "convolve (seed 000)": (convolve, jax.vmap(convolve), (xs, ws)),
        f"matmul {size}": (
            lambda a: a @ a,
            lambda a: a @ a,
            (mats,),
        ),
        "x / psum(x)": (
            lambda x: x / jax.lax.psum(x, "i"),
            lambda x: x / jnp.sum(x, axis=0, keepdims=True),
            (rng.random((n, 1024), dtype=np.float32) + 1.0,),
        ),
    }


def _nested_workloads(n: int) -> dict[str, dict[str, tuple[Callable[..., Any], tuple]]]:
    """name -> impl -> (callable, host inputs). The nested maps take [2, n/2, ...];
    jax.pmap, which cannot nest, maps the same math over all n devices flat, the inner
    axis as groups of n/2 (axis_index_groups), on the inputs reshaped to [n, ...]."""
    rng = np.random.default_rng(1)
    x = rng.random((2, n // 2, 1024), dtype=np.float32) + 1.0
    groups = [list(range(g * (n // 2), (g + 1) * (n // 2))) for g in range(2)]

    def f(v):
        return v / jax.lax.psum(v, ("a", "b")) + jax.lax.pmean(v, "b")

    def flat(v):
        return v / jax.lax.psum(v, "i") + jax.lax.pmean(v, "i", axis_index_groups=groups)

    return {
        "nested 2 x n/2: v / psum(a, b) + pmean(b)": {
            "spmdkit.pmap": (spmd_pmap(spmd_pmap(f, axis_name="b"), axis_name="a"), (x,)),
            "jax.pmap": (jax.pmap(flat, axis_name="i"), (x.reshape(n, -1),)),
            "jit(vmap)": (jax.jit(jax.vmap(jax.vmap(f, axis_name="b"), axis_name="a")), (x,)),
        }
    }


def _all_workloads(n: int, quick: bool):
    for name, (f, batched, host_args) in _workloads(n, quick).items():
        impls = {
            "spmdkit.pmap": spmd_pmap(f, axis_name="i"),
            "jax.pmap": jax.pmap(f, axis_name="i"),
            "jit(vmap)": jax.jit(batched),
        }
        yield name, {k: (fn, host_args) for k, fn in impls.items()}
    if n >= 2 and n % 2 == 0:
        yield from _nested_workloads(n).items()


def _rows(times: dict[str, Any], name: str, inputs: str) -> list[dict[str, Any]]:
    rows = []
    for impl in times["cases"]:
        c = case_row(times, impl, scale=1e6)
        rp = ratio(times, impl, "jax.pmap")
        # The multi-process case has no one-device baseline.
        rv = ratio(times, impl, "jit(vmap)") if "jit(vmap)" in times["cases"] else {"median": float("nan")}
        rows.append({
            "workload": name, "inputs": inputs, "impl": impl, "median_us": c["median"],
            "iqr_pct": c["iqr_pct"], "min_us": c["min"], "max_us": c["max"],
            "x_jax_pmap": rp["median"], "x_jit_vmap": rv["median"],
            "flag": ",".join(sorted(set(c["flag"].split(",") + rp["flags"]) - {""})),
        })
    return rows


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    rounds = rounds or (5 if quick else 9)
    n = jax.local_device_count()
    rows: list[dict[str, Any]] = []
    runs: dict[str, dict[str, Any]] = {}
    ours: list[dict[str, Any]] = []  # spmdkit.pmap / jax.pmap per workload and inputs
    for name, impls in _all_workloads(n, quick):
        ref_fn, ref_args = impls["jit(vmap)"]
        reference = np.asarray(ref_fn(*ref_args))
        for inputs in ("device", "host"):
            cases = {}
            for impl, (fn, host_args) in impls.items():
                out = fn(*host_args)
                np.testing.assert_allclose(
                    np.asarray(out).reshape(reference.shape), reference, rtol=2e-5, atol=1e-4
                )
                # Device inputs: placed as this implementation lays out its own
                # outputs, so a call moves no data (the steady state of a loop).
                args = (
                    tuple(jax.device_put(a, out.sharding) for a in host_args)
                    if inputs == "device"
                    else host_args
                )
                cases[impl] = (lambda fn=fn, args=args: jax.block_until_ready(fn(*args)))
            times = measure(cases, rounds=rounds)
            runs[f"{name}, {inputs} inputs"] = times
            rows += _rows(times, name, inputs)
            ours.append(ratio(times, "spmdkit.pmap", "jax.pmap"))
    notes = []
    mp = _multiprocess(quick, rounds)
    if mp:
        rows += mp["rows"]
        ours.append(mp["ratio"])
    else:
        notes.append("multi-process case did not run (see stderr)")
    geo = geomean(ours)
    report = {
        "suite": "pmap",
        "machine": machine(),
        "columns": ["workload", "inputs", "impl", "median_us", "iqr_pct", "min_us", "max_us", "x_jax_pmap",
                    "x_jit_vmap", "flag"],
        "rows": rows,
        "targets": [target("spmdkit.pmap / jax.pmap (geometric mean over workloads and inputs of paired ratios)",
                           geo, "<=", TARGET)],
        "notes": notes,
    }
    return collect(report, runs)


MP_LAUNCH = [sys.executable, "-P", "-m", "spmdkit._cli", "launch", "-n", "2", "--host-devices-per-process", "1", "--"]


def _multiprocess(quick: bool, rounds: int) -> dict[str, Any] | None:
    """2 processes x 1 device: x / psum(x) across processes; process 0's rows and ratio."""
    cmd = MP_LAUNCH + [sys.executable, "-P", "-W", "ignore::RuntimeWarning", "-m",
                       "spmdkit._bench.pmap_suite", "--worker", "--rounds", str(rounds)] + (["--quick"] if quick else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMDKIT_", "JAX_", "XLA_"))}
    # Its own session: on a timeout the launcher and both workers die together (SIGKILL:
    # JAX catches SIGTERM once jax.distributed is up).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120 if quick else 600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        sys.stderr.write("pmap bench: the multi-process case timed out\n")
        return None
    for line in stdout.splitlines():
        line = line.removeprefix("[0] ")
        if line.startswith('{"rows"'):
            return json.loads(line)
    sys.stderr.write(stderr[-2000:])
    return None


def _worker(quick: bool, rounds: int) -> None:
    from spmdkit._launch import initialize_distributed

    initialize_distributed()
    size = 1024 if quick else 1 << 16
    local = np.random.default_rng(jax.process_index()).random((jax.local_device_count(), size), dtype=np.float32) + 1
    f = lambda x: x / jax.lax.psum(x, "i")  # noqa: E731
    impls = {"spmdkit.pmap": spmd_pmap(f, axis_name="i"), "jax.pmap": jax.pmap(f, axis_name="i")}
    outs = {k: fn(local) for k, fn in impls.items()}
    np.testing.assert_allclose(
        outs["spmdkit.pmap"].addressable_data(0), outs["jax.pmap"].addressable_data(0), rtol=1e-6
    )
    # Fixed call counts: every process must make the same calls, or a collective
    # waits forever for its peer (measure() sizes rounds by each process's clock).
    calls = 5 if quick else 50
    samples: dict[str, list[float | None]] = {k: [] for k in impls}
    order = rotations(list(impls), rounds)
    meter = LoadMeter()
    for round_order in order:
        for k in round_order:
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(impls[k](local))
            samples[k].append((time.perf_counter() - t0) / calls)
    during = meter.stop()
    times = record(samples, order, {"before": during, "during": during, "after": during})
    name = f"2 processes x 1 device: x / psum(x), [{size}] per device"
    if jax.process_index() == 0:
        r = ratio(times, "spmdkit.pmap", "jax.pmap")
        rows = _rows(times, name, "host")
        print(json.dumps({"rows": rows, "ratio": r}), flush=True)


def overhead(calls: int = 2000, rounds: int = 7) -> dict[str, float] | None:
    """Per-call Python overhead in microseconds: each map's time per call of ``x + 1``
    on ``[n, 4]`` minus the time of the jitted program spmdkit.pmap runs (fed a
    placed argument), from the fastest rounds and as the median of paired rounds,
    rounds rotating. No collective, so under ``spmdkit launch`` every process times
    only its own dispatch. It survives a busy machine far better than the suite's
    ratios: the work timed is the same few microseconds of Python in every case."""
    n = jax.local_device_count()
    host = np.ones((n, 4), np.float32)
    sp, jp = spmd_pmap(lambda x: x + 1, axis_name="i"), jax.pmap(lambda x: x + 1, axis_name="i")
    placed = sp(host)  # where spmdkit.pmap puts its argument: the raw program's input
    raw = next(iter(sp._plans.values())).by_size[n].jitted
    cases = {
        "raw jit": (raw, placed),
        "spmdkit.pmap, host": (sp, host),
        "jax.pmap, host": (jp, host),
        "spmdkit.pmap, device": (sp, placed),
        "jax.pmap, device": (jp, jp(host)),  # its own output: local to this process
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for fn, arg in cases.values():
        for _ in range(20):
            jax.block_until_ready(fn(arg))
    for order in rotations(list(cases), rounds):  # fixed counts: no process waits for another
        for k in order:
            fn, arg = cases[k]
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                jax.block_until_ready(fn(arg))
            samples[k].append((time.perf_counter_ns() - t0) / calls / 1e3)
    # Load only ever adds time: each case's fastest round is its least disturbed one.
    out = {"raw jit (us)": min(samples["raw jit"])}
    for k in list(cases)[1:]:
        out[f"{k}: overhead (us)"] = min(samples[k]) - min(samples["raw jit"])
        out[f"{k}: overhead, median of paired rounds (us)"] = float(
            np.median(np.subtract(samples[k], samples["raw jit"])))
    return out if jax.process_index() == 0 else None


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker("--quick" in sys.argv, int(sys.argv[sys.argv.index("--rounds") + 1]))
    elif "--overhead" in sys.argv:
        # python -m spmdkit._bench.pmap_suite --overhead [calls rounds]; across processes:
        # spmdkit launch -n 2 --host-devices-per-process 1 -- python -m ... --overhead
        from spmdkit._devices import host_devices_from_env, use_host_devices
        from spmdkit._launch import initialize_distributed

        if host_devices_from_env():  # spmdkit launch --host-devices-per-process N sets it
            use_host_devices(host_devices_from_env())
        initialize_distributed()  # a single process unless started by spmdkit launch
        nums = [int(a) for a in sys.argv[1:] if a.isdigit()]
        result = overhead(*nums)
        if result is not None:
            print(json.dumps({"processes": jax.process_count(), "devices": jax.device_count(),
                              "jax": jax.__version__, **{k: round(v, 1) for k, v in result.items()}}))
