"""What an all-reduce over each group shape of a 2-process mesh adds to a loop, between
computation and in a bare loop (BENCHMARKS.md, "plan", runs s and t): why a pair of one
process's devices is priced by its own link.

    spmdkit launch -n 2 --host-devices-per-process 4 -- python tools/subgroup_collectives.py
    ROWS=1 spmdkit launch ...   # payload ROWS x 256 floats per device (default 128: 128 KiB)

The mesh is (proc=2, a=2, b=2) over 2 processes x 4 devices. Each case is a loop of 20 trips:
between computation, a (ROWS x 256) @ (256 x 256) matmul per device then the psum (each
waiting for the other); bare, the psum alone. Process 0 prints, per group shape, what the
psum added per trip over the same loop without it (the median of ``ROUNDS`` rotated rounds,
each round's time the slower process's).
"""

import os
import statistics
import time

import spmdkit

if os.environ.get("SPMDKIT_COORDINATOR"):
    spmdkit.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from spmdkit._process import gather_json  # noqa: E402

ROWS = int(os.environ.get("ROWS", 128))
ROUNDS = int(os.environ.get("ROUNDS", 9))
WIDTH, LOOPS = 256, 20
GROUPS = {  # name: mesh axes of the psum
    "pair in a process (b, adjacent)": ("b",),
    "pair in a process (a, strided)": ("a",),
    "a process's 4 devices": ("a", "b"),
    "pair across processes": ("proc",),
    "4 across processes (2 each)": ("proc", "b"),
    "all 8": ("proc", "a", "b"),
}


def program(mesh, axes, compute):
    spec = P(("proc", "a", "b"))

    def body(x, w):
        def trip(i, v):
            if compute:
                v = jnp.tanh(v @ w)
            return jax.lax.psum(v, axes) * 0.5 if axes else v * 0.5 + 1e-3

        return jax.lax.fori_loop(0, LOOPS, trip, x)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False))


def main():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("proc", "a", "b"))
    spec = NamedSharding(mesh, P(("proc", "a", "b")))
    x = jax.make_array_from_callback((8 * ROWS, WIDTH), spec, lambda i: np.full((ROWS, WIDTH), 0.01, np.float32))
    w = jax.make_array_from_callback((WIDTH, WIDTH), NamedSharding(mesh, P()),
                                     lambda i: np.eye(WIDTH, dtype=np.float32))
    cases = {(name, compute): program(mesh, axes, compute)
             for name, axes in [("none", ()), *GROUPS.items()] for compute in (True, False)}
    for f in cases.values():
        jax.block_until_ready(f(x, w))  # compile and warm up
    names = list(cases)
    times = {k: [] for k in names}
    for r in range(ROUNDS):
        for k in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            jax.block_until_ready(cases[k](x, w))
            times[k].append((time.perf_counter() - start) / LOOPS)
    every = gather_json([[times[k] for k in names]], "the probe's times")
    if jax.process_index() != 0:
        return
    slow = {k: [max(e[0][i][r] for e in every) for r in range(ROUNDS)] for i, k in enumerate(names)}
    med = {k: statistics.median(v) for k, v in slow.items()}
    print(f"{ROWS * WIDTH * 4} B per device; microseconds a psum adds per trip (the slower process)")
    print(f"{'group':34s} {'between computation':>20s} {'bare loop':>10s}")
    for name in GROUPS:
        between = med[(name, True)] - med[("none", True)]
        bare = med[(name, False)] - med[("none", False)]
        print(f"{name:34s} {between * 1e6:20.0f} {bare * 1e6:10.0f}")


if __name__ == "__main__":
    main()
