"""The measurements of ``spmdkit calibrate``: collectives, GEMM rate, memory bandwidth.

Shared by the calibrating process (simulated devices, ``intra_host``) and by the two
processes of :mod:`spmdkit._calibrate_worker` (``inter_host``), which must issue the
same programs in the same order: every choice that shapes the sequence of collectives
(repetitions per call, rounds, order) is made by process 0 and broadcast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdkit._bench._timing import measure

PROBE_REPS = 8  # the probe times 1 and PROBE_REPS repetitions: the difference has no dispatch in it
MAX_REPS = 4096


def _body(kind: str, axis: str, n: int) -> Callable:
    """One device's program: ``reps`` collectives in a loop, each fed by the last one's result.

    Writing one element of the result back into the input makes every iteration depend
    on the previous one (nothing is hoisted out of the loop) at the cost of one element.
    """
    from jax import lax

    def once(_, x):
        if kind == "all_reduce":
            head = lax.psum(x, axis)[:1] * (1.0 / n)
        elif kind == "all_gather":
            head = lax.all_gather(x, axis, tiled=True)[:1]
        elif kind == "reduce_scatter":
            head = lax.psum_scatter(x, axis, tiled=True)[:1] * (1.0 / n)
        else:
            head = lax.all_to_all(x, axis, 0, 0, tiled=True)[:1]
        return lax.dynamic_update_slice(x, head.astype(x.dtype), (0,))

    def body(x, reps):
        return lax.fori_loop(0, reps, once, x)

    return body


def _program(kind: str, mesh: Mesh, n: int) -> Callable:
    spec = P(("rest", "group"))
    mapped = jax.shard_map(_body(kind, "group", n), mesh=mesh, in_specs=(spec, P()), out_specs=spec,
                           check_vma=False)
    return jax.jit(mapped)


def _elements(nbytes: int, n: int) -> int:
    """f32 elements per device for a payload of ``nbytes``: a multiple of n, at least n."""
    return max(n, (nbytes // 4) // n * n)


def _replicated_int(mesh: Mesh, value: int) -> jax.Array:
    return jax.make_array_from_callback((), NamedSharding(mesh, P()), lambda _: np.int32(value))


def _filled(mesh: Mesh, per_device: int) -> jax.Array:
    count = mesh.devices.size
    sharding = NamedSharding(mesh, P(("rest", "group")))
    return jax.jit(lambda: jnp.full((count * per_device,), 1.0, jnp.float32), out_shardings=sharding)()


def _timed_call(fn: Callable, x: jax.Array, reps_arr: jax.Array, reps: int) -> Callable[[], float]:
    def case() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, reps_arr))  # every call synced: the CPU collective rule
        return (time.perf_counter() - t0) / reps

    return case


def _choose_reps(fn: Callable, x: jax.Array, mesh: Mesh, target_s: float) -> int:
    """Repetitions that make one call last about ``target_s`` (this process's view)."""
    one, many = _replicated_int(mesh, 1), _replicated_int(mesh, PROBE_REPS)
    jax.block_until_ready(fn(x, one))  # compile and warm
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x, one))
    t1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x, many))
    tk = time.perf_counter() - t0
    per = (tk - t1) / (PROBE_REPS - 1)
    if per <= 0:
        per = tk / PROBE_REPS
    return int(min(MAX_REPS, max(1, round(target_s / max(per, 1e-9)))))


def _settle(programs: dict[str, Callable], mesh: Mesh, n: int, nbytes: int, target_s: float) -> None:
    """Run every program for a while before timing: the first collectives between processes
    pay for connections and buffers (measured: the first size 4-10x slower than later ones)."""
    e = _elements(nbytes, n)
    x = {kind: _filled(mesh, e // n if kind == "all_gather" else e) for kind in programs}
    reps = _replicated_int(mesh, 16)
    for _ in range(max(3, int(0.1 / target_s))):
        for kind, fn in programs.items():
            jax.block_until_ready(fn(x[kind], reps))


def measure_collectives(
    devices: Sequence[jax.Device],
    group_sizes: Sequence[int],
    sizes: Sequence[int],
    kinds: Sequence[str],
    link: str,
    *,
    rounds: int,
    target_s: float,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Time every kind at every payload size over mesh axes of ``group_sizes`` devices.

    For a group size n the devices form a (len(devices) / n, n) mesh and the collective
    runs over its second axis: every device takes part, in len(devices) / n groups at
    once, as in a step that reduces over one axis of a larger mesh. Cases of one (n, size)
    are interleaved (the house timing method); returns the measured points and warnings.
    """
    points: list[dict[str, Any]] = []
    warnings: list[str] = []
    count = len(devices)
    meshes = {n: Mesh(np.asarray(devices, dtype=object).reshape(count // n, n), ("rest", "group")) for n in group_sizes}
    programs = {n: {kind: _program(kind, meshes[n], n) for kind in kinds} for n in group_sizes}
    for n in group_sizes:
        _settle(programs[n], meshes[n], n, min(sizes), target_s)
    # Sizes outer, axis sizes inner: the machine's drift hits the axis sizes of one payload alike.
    for nbytes in sizes:
        for n in group_sizes:
            mesh, e = meshes[n], _elements(nbytes, n)
            full = _filled(mesh, e)
            part = _filled(mesh, e // n) if "all_gather" in kinds else None
            inputs = {kind: part if kind == "all_gather" else full for kind in kinds}
            reps = [_choose_reps(programs[n][k], inputs[k], mesh, target_s) for k in kinds]
            # Both processes of an inter-host run must loop the same number of times.
            reps = [int(r) for r in np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(reps, np.int32)))]
            cases = {k: _timed_call(programs[n][k], inputs[k], _replicated_int(mesh, r), r) for k, r in zip(kinds, reps)}
            run = measure(cases, rounds=rounds, warmup=1, self_timed=True, idle_seconds=0.05)
            for k, r in zip(kinds, reps):
                c = run["cases"][k]
                points.append({"kind": k, "link": link, "n": n, "bytes": e * 4, "seconds": c["median"],
                               "iqr_rel": c.get("iqr_rel"), "min_seconds": c.get("min"), "reps": r, "rounds": rounds,
                               "flags": c["flags"]})
            warnings += [f"{link} n={n} {e * 4} B: {w}" for w in run["warnings"]]
            log(f"{link}: n={n}, {e * 4} B: "
                + ", ".join(f"{k} {run['cases'][k]['median'] * 1e6:.0f} us" for k in kinds))
            del full, part, inputs, cases
    return points, warnings


def measure_compute(devices: Sequence[jax.Device], *, quick: bool, rounds: int) -> dict[str, Any]:
    """Per-device GEMM rate (float32, bfloat16) and memory bandwidth, all devices at once.

    Every device multiplies its own m x m matrices (or streams its own buffer) at the
    same time, so on simulated devices the figure is the machine's rate shared by N
    devices: what each device of an N-device program gets.
    """
    count = len(devices)
    mesh = Mesh(np.asarray(devices, dtype=object), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    m = 256 if quick else 1024
    stream = (4 if quick else 32) * 1024 * 1024 // 4  # f32 elements per device
    arrays = {
        "float32": jax.jit(lambda: jnp.ones((count, m, m), jnp.float32), out_shardings=sharding)(),
        "bfloat16": jax.jit(lambda: jnp.ones((count, m, m), jnp.bfloat16), out_shardings=sharding)(),
        "stream": jax.jit(lambda: jnp.ones((count, stream), jnp.float32), out_shardings=sharding)(),
    }
    matmul = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a))
    scale = jax.jit(lambda a: a * 2.0)  # reads and writes every byte once
    cases = {
        "float32": lambda: jax.block_until_ready(matmul(arrays["float32"])),
        "bfloat16": lambda: jax.block_until_ready(matmul(arrays["bfloat16"])),
        "stream": lambda: jax.block_until_ready(scale(arrays["stream"])),
    }
    run = measure(cases, rounds=rounds, warmup=1, round_seconds=0.05 if quick else 0.2, idle_seconds=0.05)
    t = {k: run["cases"][k]["median"] for k in cases}
    return {
        "peak_flops": {"float32": 2 * m**3 / t["float32"], "bfloat16": 2 * m**3 / t["bfloat16"]},
        "memory_bandwidth": 2 * stream * 4 / t["stream"],
        "detail": {"gemm_m": m, "stream_bytes_per_device": stream * 4, "devices_at_once": count,
                   "seconds": t, "flags": {k: run["cases"][k]["flags"] for k in cases}},
        "warnings": [f"compute: {w}" for w in run["warnings"]],
    }
