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
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit._bench._timing import interleaved, machine
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


def run(quick: bool = False) -> dict[str, Any]:
    n = jax.local_device_count()
    rows = []
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
            times = interleaved(cases, rounds=5 if quick else 9)
            base = times["jax.pmap"]["median"]
            vmap_t = times["jit(vmap)"]["median"]
            for impl, t in times.items():
                rows.append(
                    {
                        "workload": name,
                        "inputs": inputs,
                        "impl": impl,
                        "median_us": t["median"] * 1e6,
                        "min_us": t["min"] * 1e6,
                        "x_jax_pmap": t["median"] / base,
                        "x_jit_vmap": t["median"] / vmap_t,
                    }
                )
    notes = []
    mp_rows = _multiprocess(quick)
    if mp_rows:
        rows += mp_rows
    else:
        notes.append("multi-process case did not run (see stderr)")
    ours = [r["x_jax_pmap"] for r in rows if r["impl"] == "spmdkit.pmap"]
    geo = float(np.exp(np.mean(np.log(ours))))
    return {
        "suite": "pmap",
        "machine": machine(),
        "columns": ["workload", "inputs", "impl", "median_us", "min_us", "x_jax_pmap", "x_jit_vmap"],
        "rows": rows,
        "targets": [
            {
                "name": "spmdkit.pmap / jax.pmap (geometric mean over workloads and inputs)",
                "value": geo,
                "target": f"<= {TARGET}",
                "met": geo <= TARGET,
            }
        ],
        "notes": notes,
    }


MP_LAUNCH = [sys.executable, "-m", "spmdkit._cli", "launch", "-n", "2", "--host-devices-per-process", "1", "--"]


def _multiprocess(quick: bool) -> list[dict[str, Any]]:
    """2 processes x 1 device: x / psum(x) across processes; process 0's rows."""
    cmd = MP_LAUNCH + [sys.executable, "-W", "ignore::RuntimeWarning", "-m",
                       "spmdkit._bench.pmap_suite", "--worker"] + (["--quick"] if quick else [])
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
        return []
    for line in stdout.splitlines():
        line = line.removeprefix("[0] ")
        if line.startswith("[{"):
            return json.loads(line)
    sys.stderr.write(stderr[-2000:])
    return []


def _worker(quick: bool) -> None:
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
    # waits forever for its peer (interleaved() sizes rounds by each process's clock).
    calls, rounds = (5, 3) if quick else (50, 9)
    samples: dict[str, list[float]] = {k: [] for k in impls}
    for r in range(rounds):
        for k in list(impls)[r % 2 :] + list(impls)[: r % 2]:
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(impls[k](local))
            samples[k].append((time.perf_counter() - t0) / calls)
    times = {k: {"median": statistics.median(v), "min": min(v)} for k, v in samples.items()}
    base = times["jax.pmap"]["median"]
    name = f"2 processes x 1 device: x / psum(x), [{size}] per device"
    rows = [
        {"workload": name, "inputs": "host", "impl": k, "median_us": t["median"] * 1e6,
         "min_us": t["min"] * 1e6, "x_jax_pmap": t["median"] / base, "x_jit_vmap": float("nan")}
        for k, t in times.items()
    ]
    if jax.process_index() == 0:
        print(json.dumps(rows), flush=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker("--quick" in sys.argv)
