"""The measurements of ``spmdkit calibrate``: collectives, GEMM rate, memory bandwidth.

Shared by the calibrating process (simulated devices, ``intra_host``) and by the two
processes of :mod:`spmdkit._calibrate_worker` (``inter_host``), which must issue the
same programs in the same order: every choice that shapes the sequence of collectives
(repetitions per call, rounds, order) is made by process 0 and broadcast.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdkit._bench._timing import measure
from spmdkit._process import broadcast

PROBES = 3  # timed calls of the probe's last length; their median sets the repetitions
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


def pair_case(run: Callable[[int], Any], reps: int, barrier: Callable[[], Any], *,
              clock: Callable[[], float] = time.perf_counter) -> tuple[Callable[[], float], list[tuple[float, float]]]:
    """A self-timed case for :func:`~spmdkit._bench._timing.measure` and the list of its raw times.

    Each call of the case times one call of ``run(reps)`` and one of ``run(2 * reps)``
    (collectives in a compiled loop), each right after ``barrier()``, and returns their
    difference over ``reps``: seconds per collective with no fixed cost per call in it.
    A time / reps figure holds, spread over the reps, the dispatch and, between two
    processes, the wait of the first collective for the peer that is still in Python
    (process 0 starts its clock while process 1 may still be in Python or descheduled).
    The barrier makes that wait short, the difference removes what is left. Which call goes first alternates, so neither pays
    for following the other. ``raw`` gets the (t(reps), t(2 reps)) pair of every call,
    warm-up calls included (first).

    Example (a fake clock: 1 ms of fixed cost per call, 10 us per collective):
        >>> now = [0.0]
        >>> def run(k):
        ...     now[0] += 1e-3 + k * 1e-5
        >>> case, raw = pair_case(run, 8, lambda: None, clock=lambda: now[0])
        >>> round(case(), 12), round(raw[0][0] / 8, 12)  # per collective; time / reps is 13.5x off
        (1e-05, 0.000135)
    """
    raw: list[tuple[float, float]] = []

    def timed(k: int) -> float:
        barrier()
        t0 = clock()
        run(k)
        return clock() - t0

    def case() -> float:
        if len(raw) % 2:
            t2 = timed(2 * reps)
            t1 = timed(reps)
        else:
            t1 = timed(reps)
            t2 = timed(2 * reps)
        raw.append((t1, t2))
        return (t2 - t1) / reps

    return case, raw


def per_collective(raw: Sequence[tuple[float, float]], reps: int) -> dict[str, Any]:
    """The figures of one case from its per-round ``(t(reps), t(2 reps))`` pairs.

    ``seconds``: the median over rounds of (t(2r) - t(r)) / r. The median of the paired
    differences, not the difference of the minima: minima taken separately need a quiet
    round for each call and mix rounds (their difference even came out negative), while a
    pair shares its round's conditions and the median drops the rounds a burst of load
    hit. Under heavy load (load average 10-18 on 2 cores) the noise is per collective,
    not per call, and the difference of two calls doubles it: there t(r) / r reproduced
    better (0.09-2.1x between two runs vs 0.02-7x); ``spmdkit calibrate --check`` prints
    how each of the three reproduces, for an idle machine to decide.
    ``min_diff``: (min t(2r) - min t(r)) / r, kept for comparison; ``fixed_seconds``: the
    median fixed cost per call (2 t(r) - t(2r)): dispatch plus the wait for the peer;
    ``single_seconds``: median t(r) / r, what one timed call per round would report;
    ``iqr_rel``: the differences' interquartile range over ``seconds``.
    A median difference <= 0 (noise larger than r collectives) falls back to
    t(2r) / 2r, an upper bound, with the flag ``fixed-cost``.

    Example:
        >>> fig = per_collective([(1.1e-3, 1.2e-3), (1.0e-3, 1.1e-3), (1.5e-3, 1.7e-3)], reps=10)
        >>> round(fig["seconds"], 9), round(fig["fixed_seconds"], 9), fig["flags"]
        (1e-05, 0.001, [])
    """
    if not raw:
        return {"seconds": float("nan"), "flags": ["failed"]}
    t1 = [a for a, _ in raw]
    t2 = [b for _, b in raw]
    diffs = [(b - a) / reps for a, b in raw]
    med = statistics.median(diffs)
    flags: list[str] = []
    if not med > 0:
        med = statistics.median(t2) / (2 * reps)
        flags.append("fixed-cost")
    q = statistics.quantiles(diffs, n=4, method="inclusive") if len(diffs) > 1 else [diffs[0]] * 3
    return {"seconds": med, "iqr_rel": (q[2] - q[0]) / med, "min_diff": (min(t2) - min(t1)) / reps,
            "fixed_seconds": statistics.median(2 * a - b for a, b in raw),
            "single_seconds": statistics.median(t1) / reps, "diffs": diffs, "flags": flags}


def _barrier(mesh: Mesh) -> Callable[[], Any]:
    """A one-element psum over every device of ``mesh``, waited for: all processes leave it together."""
    from jax import lax

    names = ("rest", "group")
    spec = P(names)
    fn = jax.jit(jax.shard_map(lambda v: lax.psum(v, names), mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=False))
    x = _filled(mesh, 1)
    return lambda: jax.block_until_ready(fn(x))


def choose_reps(run: Callable[[int], Any], barrier: Callable[[], Any], target_s: float, *,
                agree: Callable[[bool], bool] = bool, probes: int = PROBES,
                clock: Callable[[], float] = time.perf_counter) -> int:
    """Repetitions that make one call of ``run(reps)`` last about ``target_s``.

    Doubles ``k`` from 1 until a call of ``run(k)`` lasts ``target_s``, times ``probes``
    calls of that ``k`` in all and takes their median over ``k``; every call right after
    ``barrier()``, as :func:`pair_case` times them. The fixed cost of a call stays in the
    figure, spread over ``k`` collectives: a few percent of a call that long. ``agree``
    turns process 0's "long enough" into every process's (a broadcast between processes):
    the calls are collectives, and the processes must issue the same ones.

    The pick is only as steady as a call of ``target_s`` is: between two processes here
    one payload got 3 repetitions in one run and 30 in the next (a small collective there runs
    in one of two regimes, 0.15-0.3 ms or 1-1.6 ms at 4 KiB, the slow one while gloo's event
    loop busy-polls on one of the two shared cores), which is why
    ``spmdkit calibrate --check`` replays the calibration's own. The difference of a call
    of 1 and one of 8 that this replaces picked as widely, and took 28 collectives at
    64 MiB where this takes 4 (the whole calibration: 6 minutes instead of 8).

    Example (a fake clock: 2 ms of fixed cost per call, 0.5 ms per collective):
        >>> now = [0.0]
        >>> def run(k):
        ...     now[0] += 2e-3 + k * 5e-4
        >>> choose_reps(run, lambda: None, 0.01, clock=lambda: now[0])  # 16 in 10 ms; not 10 / 2.5 = 4
        16
    """
    def timed(k: int) -> float:
        barrier()
        t0 = clock()
        run(k)
        return clock() - t0

    run(1)  # compile and warm
    k, times = 1, [timed(1)]
    while k < MAX_REPS and not agree(times[-1] >= target_s):
        k = min(MAX_REPS, 2 * k)
        times = [timed(k)]
    times += [timed(k) for _ in range(probes - 1)]
    per = statistics.median(times) / k
    return int(min(MAX_REPS, max(1, round(target_s / max(per, 1e-9)))))


def _looped(fn: Callable, x: jax.Array, mesh: Mesh) -> Callable[[int], Any]:
    """``run(k)``: ``k`` collectives of ``fn`` on ``x`` in one call, waited for; each loop count
    becomes a device array once, so a timed call transfers nothing."""
    loops: dict[int, jax.Array] = {}

    def run(k: int) -> Any:
        if k not in loops:
            loops[k] = _replicated_int(mesh, k)
        return jax.block_until_ready(fn(x, loops[k]))

    return run


def _agree(flag: bool) -> bool:
    """Process 0's ``flag`` in every process."""
    return bool(np.asarray(broadcast(np.asarray(flag, np.bool_), "its choice while choosing repetitions")))


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
    reps: dict[tuple[str, int], int] | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Time every kind at every payload size over mesh axes of ``group_sizes`` devices.

    For a group size n the devices form a (len(devices) / n, n) mesh and the collective
    runs over its second axis: every device takes part, in len(devices) / n groups at
    once, as in a step that reduces over one axis of a larger mesh. Cases of one (n, size)
    are interleaved (the house timing method), each timed by :func:`pair_case` and
    summarised by :func:`per_collective`. ``reps`` fixes the repetitions per
    ``(kind, bytes)`` (``spmdkit calibrate --check`` replays a calibration's own); the
    others are chosen by a probe so that a call of ``reps`` lasts about ``target_s / 2``.
    ``spmdkit calibrate`` and ``--check`` both measure through this function, with the
    same kinds and warm-up. Returns the measured points and warnings.
    """
    points: list[dict[str, Any]] = []
    warnings: list[str] = []
    count = len(devices)
    meshes = {n: Mesh(np.asarray(devices, dtype=object).reshape(count // n, n), ("rest", "group")) for n in group_sizes}
    programs = {n: {kind: _program(kind, meshes[n], n) for kind in kinds} for n in group_sizes}
    barriers = {n: _barrier(meshes[n]) for n in group_sizes}
    for n in group_sizes:
        _settle(programs[n], meshes[n], n, min(sizes), target_s)
    # Sizes outer, axis sizes inner: the machine's drift hits the axis sizes of one payload alike.
    for nbytes in sizes:
        for n in group_sizes:
            mesh, e = meshes[n], _elements(nbytes, n)
            full = _filled(mesh, e)
            part = _filled(mesh, e // n) if "all_gather" in kinds else None
            inputs = {kind: part if kind == "all_gather" else full for kind in kinds}
            runs = {k: _looped(programs[n][k], inputs[k], mesh) for k in kinds}  # the probe's and the rounds'
            fixed = [(reps or {}).get((k, e * 4)) for k in kinds]
            chosen = [r or choose_reps(runs[k], barriers[n], target_s / 2, agree=_agree) for k, r in zip(kinds, fixed)]
            # Both processes of an inter-host run must loop the same number of times.
            chosen = [int(r) for r in np.asarray(broadcast(np.asarray(chosen, np.int32), "the repetitions to measure"))]
            cases, raws = {}, {}
            for k, r in zip(kinds, chosen):
                cases[k], raws[k] = pair_case(runs[k], r, barriers[n])
            result = measure(cases, rounds=rounds, warmup=1, self_timed=True, idle_seconds=0.05)
            for k, r in zip(kinds, chosen):
                c, fig = result["cases"][k], per_collective(raws[k][1:], r)  # [1:]: the warm-up call
                points.append({"kind": k, "link": link, "n": n, "bytes": e * 4, "seconds": fig["seconds"],
                               "iqr_rel": fig.get("iqr_rel"), "min_seconds": fig.get("min_diff"),
                               "fixed_seconds": fig.get("fixed_seconds"), "single_seconds": fig.get("single_seconds"),
                               "reps": r, "rounds": rounds, "flags": c["flags"] + fig["flags"],
                               "raw": raws[k][1:]})
                if fig["flags"]:
                    warnings.append(f"{link} n={n} {e * 4} B: {k}: t(2 x {r} reps) - t({r} reps) <= 0 in most rounds "
                                    "(noise per call above the time of the reps); the figure is an upper bound")
            warnings += [f"{link} n={n} {e * 4} B: {w}" for w in result["warnings"]]
            log(f"{link}: n={n}, {e * 4} B: "
                + ", ".join(f"{p['kind']} {p['seconds'] * 1e6:.0f} us" for p in points[-len(kinds):]))
            del full, part, inputs, runs, cases
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
