"""Time a psum within one process and across processes, one array against 16 (BENCHMARKS.md,
"plan over 2 processes"): where a multi-process XLA:CPU program routes its collectives.

    spmdkit launch -n 2 --host-devices-per-process 4 -- python tools/psum_routes.py
    JAX_NUM_CPU_DEVICES=4 python tools/psum_routes.py      # the same psum in one process
    JAX_NUM_CPU_DEVICES=8 python tools/psum_routes.py

Mesh ``(proc, local)`` over every device; each case is a ``fori_loop`` of 10 psums per call,
timed in ``ROUNDS`` (5) rotated rounds, the median per psum printed by process 0.
"""

import os
import statistics
import time

import spmdkit

if os.environ.get("SPMDKIT_COORDINATOR"):
    spmdkit.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

LOOPS = 10
processes = jax.process_count()
mesh = Mesh(np.array(jax.devices()).reshape(processes, -1), ("proc", "local"))
spec = P(("proc", "local"))


def program(axes, parts):
    one = lambda vs: [v * 0.5 for v in jax.lax.psum(vs, axes)]  # noqa: E731
    body = lambda *xs: tuple(jax.lax.fori_loop(0, LOOPS, lambda i, vs: one(vs), list(xs)))  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * parts, out_specs=(spec,) * parts,
                                 check_vma=False))


axes_cases = [("local",), ("proc",), ("proc", "local")] if processes > 1 else [("local",)]
cases = []
for nbytes in (4096, 4 << 20):
    for axes in axes_cases:
        for parts in (1, 16):
            per = nbytes // 4 // parts
            xs = [jax.make_array_from_callback((mesh.size * per,), NamedSharding(mesh, spec),
                                               lambda idx, per=per: np.ones((per,), np.float32)) for _ in range(parts)]
            f = program(axes, parts)
            jax.block_until_ready(f(*xs))  # compile and warm up
            cases.append(((nbytes, axes, parts), f, xs))
times = {key: [] for key, _, _ in cases}
for r in range(int(os.environ.get("ROUNDS", 5))):
    for key, f, xs in cases[r % len(cases):] + cases[: r % len(cases)]:
        start = time.perf_counter()
        jax.block_until_ready(f(*xs))
        times[key].append((time.perf_counter() - start) / LOOPS)
if jax.process_index() == 0:
    for (nbytes, axes, parts), ts in times.items():
        print(f"{processes} process(es), {jax.device_count()} devices: psum over {'+'.join(axes)} of {nbytes} bytes "
              f"per device in {parts} array(s): median {statistics.median(ts) * 1e3:.3f} ms, min {min(ts) * 1e3:.3f}")
