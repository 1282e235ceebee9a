"""``spmdkit bench --suite checkpoint``: Orbax save/restore against the raw disk.

A sharded state of >= 1 GiB (quick: 128 MiB) on 8 devices is saved through
:class:`spmdkit.Checkpointer` and restored onto a target layout; the same number of
bytes is written and read sequentially with plain file I/O in the same directory. The
five operations (raw write, raw write + fsync, save, raw read, resharded restore) are
the cases of interleaved rounds, so each ratio pairs a save with a raw write of the same
round. Also: how long the caller is blocked by one asynchronous save (the copy off the
devices), which is what a training loop pays per checkpoint, and each operation's CPU
seconds (all of this process's threads), which a busy machine disturbs less than the
wall time.

A save is durable when it is committed (TensorStore fsyncs every file, the manifest is
fsynced), so the save/raw-write target compares it with a plain write that is *not*
fsynced, the stricter bar; the ratio to the fsynced write is given beside it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdkit._bench._timing import inverse, machine, measure, ratio, target
from spmdkit._bench.report import collect
from spmdkit._checkpoint import CheckpointConfig, Checkpointer
from spmdkit._mesh import make_mesh

TARGET = 0.5  # save throughput / raw sequential write throughput
TARGET_RESTORE = 0.5  # resharded restore throughput / raw sequential read throughput


CHUNK = 64 * 2**20


def _write(path: Path, nbytes: int, fsync: bool) -> float:
    chunk = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(max(1, nbytes // len(chunk))):
            fh.write(chunk)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    return time.perf_counter() - t0


class _Clock:
    """Wall and CPU seconds (all threads of this process) of a timed region, CPU kept per case."""

    def __init__(self) -> None:
        self.cpu: dict[str, list[float]] = {}

    def time(self, name: str, fn) -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        self.cpu.setdefault(name, []).append(time.process_time() - c0)
        return seconds


def _raw_cases(root: Path, nbytes: int, clock: _Clock) -> dict[str, Any]:
    """Self-timed raw I/O cases; each cleans up after itself, set-up is not timed."""
    path = root / "raw.bin"

    def write(name: str, fsync: bool):
        def case() -> float:
            seconds = clock.time(name, lambda: _write(path, nbytes, fsync))
            path.unlink()
            return seconds

        return case

    def read() -> float:
        _write(path, nbytes, fsync=False)  # untimed: the file a read needs

        def read_all() -> None:
            with open(path, "rb") as fh:
                while fh.read(CHUNK):
                    pass

        seconds = clock.time("raw sequential read", read_all)
        path.unlink()
        return seconds

    return {"raw sequential write": write("raw sequential write", False),
            "raw write + fsync": write("raw write + fsync", True), "raw sequential read": read}


def _ckpt_cases(root: Path, state: Any, target: Any, blocked: list[float],
                clock: _Clock) -> tuple[dict[str, Any], Any]:
    """Self-timed save (until committed) and resharded restore of the latest saved step."""
    ckpt = Checkpointer(CheckpointConfig(str(root / "ck"), every=1, keep=3), log=lambda m: None)
    steps = iter(range(1, 10**6))
    latest = [0]
    save_name, restore_name = "spmdkit save (async, until committed)", "spmdkit restore (resharded)"

    def save() -> float:
        step = next(steps)

        def save_and_commit() -> None:
            t0 = time.perf_counter()
            ckpt.save(step, state, {"bench": True})
            blocked.append(time.perf_counter() - t0)
            ckpt._finish_pending()

        seconds = clock.time(save_name, save_and_commit)
        # Untimed: the older step's deletion runs after the commit (as it overlaps training in
        # a run), but here it must not slow the next case down.
        ckpt._deleted()
        latest[0] = step
        return seconds

    def restore() -> float:
        if not latest[0]:
            save()
        out: list[Any] = []
        seconds = clock.time(restore_name, lambda: out.append(jax.block_until_ready(ckpt.restore(latest[0], target)[0])))
        first = next(iter(state))
        assert np.array_equal(np.asarray(out[0][first][:2, :4]), np.asarray(state[first][:2, :4]))
        return seconds

    return {save_name: save, restore_name: restore}, ckpt


def _state(total: int) -> tuple[Any, dict[str, jax.Array], Any, int]:
    """About ``total`` bytes of f32 arrays of 128 MiB, sharded over (data, model), and the layout
    a restore reshards them to: (mesh, state, target layout, bytes per array)."""
    mesh = make_mesh(data=2, model=-1)
    sharding = NamedSharding(mesh, P("data", "model"))
    rows_per_leaf = 4096
    leaf_bytes = rows_per_leaf * 8192 * 4  # 128 MiB
    n_leaves = max(1, total // leaf_bytes)
    make = jax.jit(lambda k: jax.random.normal(k, (rows_per_leaf, 8192), jnp.float32), out_shardings=sharding)
    state = {f"w{i}": make(jax.random.key(i)) for i in range(n_leaves)}
    jax.block_until_ready(state)
    target_layout = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("model", None))), state
    )
    return mesh, state, target_layout, leaf_bytes


def run(quick: bool = False, directory: str | None = None, rounds: int | None = None) -> dict[str, Any]:
    gib = 2**30
    total = (128 * 2**20) if quick else gib
    mesh, state, target_layout, leaf_bytes = _state(total)
    n_leaves = len(state)
    nbytes = n_leaves * leaf_bytes
    root = Path(tempfile.mkdtemp(prefix="spmdkit-bench-ckpt-", dir=directory))
    blocked: list[float] = []
    clock = _Clock()
    try:
        ckpt_cases, ckpt = _ckpt_cases(root, state, target_layout, blocked, clock)
        cases = {**_raw_cases(root, nbytes, clock), **ckpt_cases}
        # Rounds rotate the order, so no case always runs right after the page cache was
        # filled (or flushed) by the same neighbour.
        times = measure(cases, rounds=rounds or 5, warmup=1, self_timed=True)
        ckpt.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    write, read = "raw sequential write", "raw sequential read"
    rows = []
    for name, base in ((write, write), ("raw write + fsync", write), ("spmdkit save (async, until committed)", write),
                       (read, read), ("spmdkit restore (resharded)", read)):
        c, r = times["cases"][name], inverse(ratio(times, name, base))
        cpu = sorted(clock.cpu[name][-len(c["times"]):])  # the timed rounds, not the warm-up
        rows.append({"operation": name, "seconds": c["median"], "iqr_pct": 100 * c["iqr_rel"],
                     "GB_per_s": gbps(c["median"]), "x_raw": r["median"], "cpu_s": cpu[len(cpu) // 2],
                     "flag": ",".join(sorted(set(c["flags"]) | set(r["flags"])))})
    block = sorted(blocked)[len(blocked) // 2]
    rows.insert(3, {"operation": "  of which the caller was blocked", "seconds": block, "iqr_pct": float("nan"),
                    "GB_per_s": gbps(block), "x_raw": gbps(block) / gbps(times["cases"][write]["median"]),
                    "cpu_s": float("nan"), "flag": ""})
    save_r = inverse(ratio(times, "spmdkit save (async, until committed)", write))
    restore_r = inverse(ratio(times, "spmdkit restore (resharded)", read))
    save_fsync = inverse(ratio(times, "spmdkit save (async, until committed)", "raw write + fsync"))
    report = {
        "suite": "checkpoint",
        "machine": machine(),
        "columns": ["operation", "seconds", "iqr_pct", "GB_per_s", "x_raw", "cpu_s", "flag"],
        "rows": rows,
        "targets": [
            target("save throughput / raw sequential write (paired per round)", save_r, ">=", TARGET),
            target("resharded restore throughput / raw sequential read (paired per round)", restore_r, ">=",
                   TARGET_RESTORE),
        ],
        "notes": [
            f"state: {n_leaves} arrays of {leaf_bytes // 2**20} MiB = {nbytes / gib:.2f} GiB f32, sharded "
            f"P('data', 'model') on mesh {dict(mesh.shape)}, restored onto P('model', None); directory {root.parent}",
            f"blocked per async save: {block:.3f} s (median; the copy off the devices), the rest runs in the background",
            f"save throughput / raw write + fsync (the same durability as a committed save; paired per round): "
            f"{save_fsync['median']:.3f} [IQR {save_fsync['q1']:.3f}-{save_fsync['q3']:.3f}]",
            "cpu_s: CPU seconds of this process (all threads) per operation, median; restore and save use "
            "up to 4 threads, the raw cases one",
        ],
    }
    return collect(report, {"checkpoint": times})
