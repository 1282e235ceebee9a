"""``spmdkit bench --suite pmap``: spmdkit.pmap vs jax.pmap vs jit(vmap).

The same function and inputs go to three implementations; each call is synced
(block_until_ready) so the XLA:CPU collective deadlock cannot build up and so the
time is the time to a usable result. Inputs are given two ways: device-resident
(already where each implementation keeps its outputs, the steady state of a loop)
and host numpy arrays (the seeds' style: every call transfers them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def run(quick: bool = False) -> dict[str, Any]:
    n = jax.local_device_count()
    rows = []
    for name, (f, batched, host_args) in _workloads(n, quick).items():
        impls = {
            "spmdkit.pmap": spmd_pmap(f, axis_name="i"),
            "jax.pmap": jax.pmap(f, axis_name="i"),
            "jit(vmap)": jax.jit(batched),
        }
        reference = np.asarray(impls["jit(vmap)"](*host_args))
        for inputs in ("device", "host"):
            cases = {}
            for impl, fn in impls.items():
                out = fn(*host_args)
                np.testing.assert_allclose(np.asarray(out), reference, rtol=2e-5, atol=1e-4)
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
    }
