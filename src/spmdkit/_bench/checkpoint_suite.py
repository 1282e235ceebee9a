"""``spmdkit bench --suite checkpoint``: Orbax save/restore against the raw disk.

A sharded state of >= 1 GiB (quick: 128 MiB) on 8 devices is saved through
:class:`spmdkit.Checkpointer` and restored onto a target layout; the same number of
bytes is written and read sequentially with plain file I/O in the same directory, in
the same run. Also: how long the caller is blocked by one asynchronous save (the copy
off the devices), which is what a training loop pays per checkpoint.
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

from spmdkit._bench._timing import machine
from spmdkit._checkpoint import CheckpointConfig, Checkpointer
from spmdkit._mesh import make_mesh

TARGET = 0.5  # save throughput / raw sequential write throughput


def _raw(path: Path, nbytes: int, fsync: bool) -> tuple[float, float]:
    chunk = np.random.default_rng(0).integers(0, 255, 64 * 2**20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(nbytes // len(chunk)):
            fh.write(chunk)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        while fh.read(len(chunk)):
            pass
    read = time.perf_counter() - t0
    path.unlink()
    return write, read


def run(quick: bool = False, directory: str | None = None) -> dict[str, Any]:
    gib = 2**30
    total = (128 * 2**20) if quick else gib
    mesh = make_mesh(data=2, model=-1)
    sharding = NamedSharding(mesh, P("data", "model"))
    rows_per_leaf = 4096
    leaf_bytes = rows_per_leaf * 8192 * 4  # 128 MiB
    n_leaves = max(1, total // leaf_bytes)
    make = jax.jit(lambda k: jax.random.normal(k, (rows_per_leaf, 8192), jnp.float32), out_shardings=sharding)
    state = {f"w{i}": make(jax.random.key(i)) for i in range(n_leaves)}
    jax.block_until_ready(state)
    nbytes = n_leaves * leaf_bytes
    root = Path(tempfile.mkdtemp(prefix="spmdkit-bench-ckpt-", dir=directory))
    try:
        # Median of 3: the first write into a fresh directory is often the slowest.
        plain = sorted(_raw(root / "raw.bin", nbytes, fsync=False) for _ in range(3))
        raw_write, raw_read = plain[1][0], sorted(r for _, r in plain)[1]
        raw_write_sync = sorted(_raw(root / "raw-sync.bin", nbytes, fsync=True)[0] for _ in range(3))[1]
        ckpt = Checkpointer(CheckpointConfig(str(root / "ck"), every=1, keep=3), log=lambda m: None)
        saves, blocks = [], []
        for step in (1, 2, 3):  # median of 3, like the raw figures
            t0 = time.perf_counter()
            ckpt.save(step, state, {"bench": True})
            blocks.append(time.perf_counter() - t0)
            ckpt._finish_pending()
            saves.append(time.perf_counter() - t0)
        ckpt.close()
        save, blocked = sorted(saves)[1], sorted(blocks)[1]
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("model", None))), state
        )
        ckpt = Checkpointer(CheckpointConfig(str(root / "ck")), log=lambda m: None)
        t0 = time.perf_counter()
        restored, _ = ckpt.restore(3, target)
        jax.block_until_ready(restored)
        restore = time.perf_counter() - t0
        assert np.array_equal(np.asarray(restored["w0"][:2, :4]), np.asarray(state["w0"][:2, :4]))
        ckpt.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    rows = [
        {"operation": "raw sequential write", "seconds": raw_write, "GB_per_s": gbps(raw_write), "x_raw": 1.0},
        {"operation": "raw write + fsync", "seconds": raw_write_sync, "GB_per_s": gbps(raw_write_sync),
         "x_raw": gbps(raw_write_sync) / gbps(raw_write)},
        {"operation": "spmdkit save (async, until committed)", "seconds": save, "GB_per_s": gbps(save),
         "x_raw": gbps(save) / gbps(raw_write)},
        {"operation": "  of which the caller was blocked", "seconds": blocked, "GB_per_s": gbps(blocked),
         "x_raw": gbps(blocked) / gbps(raw_write)},
        {"operation": "raw sequential read", "seconds": raw_read, "GB_per_s": gbps(raw_read), "x_raw": 1.0},
        {"operation": "spmdkit restore (resharded)", "seconds": restore, "GB_per_s": gbps(restore),
         "x_raw": gbps(restore) / gbps(raw_read)},
    ]
    ratio = gbps(save) / gbps(raw_write)
    return {
        "suite": "checkpoint",
        "machine": machine(),
        "columns": ["operation", "seconds", "GB_per_s", "x_raw"],
        "rows": rows,
        "targets": [{"name": "save throughput / raw sequential write", "value": ratio, "target": f">= {TARGET}",
                     "met": ratio >= TARGET}],
        "notes": [
            f"state: {n_leaves} arrays of {leaf_bytes // 2**20} MiB = {nbytes / gib:.2f} GiB f32, sharded "
            f"P('data', 'model') on mesh {dict(mesh.shape)}, restored onto P('model', None); directory {root.parent}",
            f"blocked per async save: {blocked:.3f} s (the copy off the devices), the rest runs in the background",
        ],
    }
