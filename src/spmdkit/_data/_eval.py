"""What evaluation reads: the whole eval set once, in chunks, each process only its rows.

The eval set takes the inputs training takes: arrays (in memory or the memory maps of
:func:`load_dataset`), a data set directory, or a finite, re-iterable pipeline of
batches (a list, a Grain dataset or loader). :func:`eval_chunks` yields ``(rows,
batch)`` for every chunk; the caller weights each chunk's means by its rows, so the
result is the mean over the whole set, whatever the chunking.

- Arrays: chunks of ``batch_size`` rows, rounded down to a multiple of the batch axis'
  ``shards`` so they split over the devices. The last chunk is split in two: the rows
  that split evenly, and fewer than ``shards`` rows that every device holds whole.
  The chunking depends on ``shards`` only, so 1 process x 8 devices and 2 x 4 evaluate
  the same chunks. With several processes each reads only the rows its devices hold
  (plus the few tail rows every device holds), and the global chunk is assembled with
  ``jax.make_array_from_process_local_data``.
- A pipeline: with several processes each yields its own rows of the eval set (e.g.
  Grain sharded by JAX process). The processes agree batch by batch on how many rows
  each holds (a small all-gather); equal shares that split over the devices are
  assembled in place, anything else (an uneven last batch, one process's pipeline
  ending a batch earlier) is gathered whole, so no row is dropped or counted twice.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from spmdkit._data import _feed
from spmdkit._data._errors import BatchError
from spmdkit._errors import DataError, fix
from spmdkit._process import allgather

ShardingFor = Callable[[bool], Any]


def resolve_eval_data(data: Any, name: str = "eval_data") -> Any:
    """``data`` as evaluation reads it: a data set directory opened (memory maps), a
    pipeline checked to be re-iterable and finite, arrays as numpy."""
    from spmdkit._data._format import load_dataset

    if isinstance(data, (str, os.PathLike)):  # CRC-32s checked, as for train_data
        return load_dataset(data, verify=True)
    if not _feed.is_pipeline(data):
        return jax.tree.map(np.asarray, data)
    if hasattr(data, "__next__"):
        raise DataError(fix(
            f"{name} is a one-shot iterator ({type(data).__name__}); evaluation reads the whole eval set every "
            "eval_every steps and at the end of the run, so it must start over each time.",
            f"pass a list of batches, a Grain dataset or loader, an object whose __iter__ starts over, arrays, or a "
            f"data set directory ({name}=DIR; --eval-data DIR)."))
    if hasattr(data, "__len__") and len(data) >= sys.maxsize:
        raise DataError(fix(f"{name} has no end (its length is {len(data)}: repeated forever?); evaluation reads "
                            "the whole eval set.", "pass a finite pipeline (no .repeat()), or arrays."))
    endless = _endless_grain(data)
    if endless:
        raise DataError(fix(f"{name} has no end ({endless}); evaluation reads the whole eval set, so it would "
                            "never finish.",
                            "pass a finite pipeline (no .repeat(); a sampler with num_epochs=1), or arrays."))
    return data


def _endless_grain(data: Any, depth: int = 0) -> str | None:
    """Why a Grain pipeline never ends (a loader whose sampler repeats forever, an
    ``IterDataset`` over a ``.repeat()``ed dataset), or None. Grain's iterators have no
    length, so without this an endless eval set runs forever instead of failing."""
    if depth > 64 or not type(data).__module__.startswith("grain"):
        return None
    sampler = getattr(data, "_sampler", None)
    if sampler is not None and hasattr(sampler, "_num_epochs") and sampler._num_epochs is None:
        return f"its sampler {type(sampler).__name__} has num_epochs=None: it repeats forever"
    if hasattr(data, "__len__"):  # a MapDataset: a finite length bounds it, whatever its parents
        return f"{type(data).__name__} of length {len(data)}" if len(data) >= sys.maxsize else None
    if any(word in type(data).__name__ for word in ("Limit", "Take", "Slice")):
        return None  # cut to a finite number of elements
    for parent in getattr(data, "parents", ()) or ():
        why = _endless_grain(parent, depth + 1)
        if why:
            return f"{type(data).__name__} over a {why}" if depth == 0 and "over a" not in why else why
    return None


def eval_chunks(data: Any, batch_size: int, shards: int = 1, sharding_for: ShardingFor | None = None,
                name: str = "eval_data") -> Iterator[tuple[int, Any]]:
    """``(rows, batch)`` for every chunk of ``data`` (see the module's docstring).

    ``sharding_for(even)`` is where the strategy puts an eval batch (whose rows split
    over the ``shards`` devices of the batch axis, or not); without it, or in one
    process, every chunk is a host batch.

    Example:
        >>> import numpy as np
        >>> [rows for rows, _ in eval_chunks({"x": np.zeros(45)}, 16, shards=8)]
        [16, 16, 8, 5]
    """
    if _feed.is_pipeline(data):
        return _pipeline_chunks(data, shards, sharding_for, name)
    return _array_chunks(data, batch_size, shards, sharding_for)


def chunk_bounds(n: int, batch_size: int, shards: int = 1) -> list[tuple[int, int]]:
    """``[lo, hi)`` of every chunk of ``n`` rows: at most ``batch_size`` (a multiple of
    ``shards`` when it can be), and a last piece of fewer than ``shards`` rows."""
    size = min(batch_size, n)
    if size >= shards > 1:
        size -= size % shards
    bounds = []
    for lo in range(0, n, size):
        hi = min(lo + size, n)
        cut = hi - (hi - lo) % shards
        bounds += [(lo, cut), (cut, hi)] if lo < cut < hi else [(lo, hi)]
    return bounds


def _array_chunks(data: Any, batch_size: int, shards: int, sharding_for: ShardingFor | None
                  ) -> Iterator[tuple[int, Any]]:
    for lo, hi in chunk_bounds(_feed.num_rows(data), batch_size, shards):
        rows, idx = hi - lo, np.arange(lo, hi)
        if jax.process_count() > 1 and sharding_for is not None:
            sharding = sharding_for(rows % shards == 0)
            block = _feed.local_block(sharding, (rows,))
            if block is not None:  # this process reads only the rows its devices hold
                local = jax.tree.map(lambda x: _feed.take_rows(x, idx[block[0]: block[1]]), data)
                yield rows, _feed.assemble(local, rows, sharding)
                continue
        yield rows, jax.tree.map(lambda x: _feed.take_rows(x, idx), data)


class _Checked:
    """Each batch of a pipeline against the first: the same leaves, per-example shapes
    and dtypes; the rows may differ (an epoch's last batch is often short)."""

    def __init__(self, name: str):
        self.name, self.first = name, None

    def __call__(self, batch: Any, k: int) -> tuple[int, Any]:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
        leaves = [(p, x if isinstance(x, jax.Array) else np.asarray(x)) for p, x in leaves]
        if not leaves:
            raise BatchError(fix(f"{self.name} batch {k} holds no arrays (it is {type(batch).__name__}).",
                                 "yield dicts of arrays, e.g. {'x': x[i:i+B], 'y': y[i:i+B]}."))
        if self.first is None:
            self.first = (treedef, [(jax.tree_util.keystr(p), x.shape[1:], x.dtype) for p, x in leaves])
        want_tree, spec = self.first
        if treedef != want_tree:
            raise BatchError(fix(f"{self.name}: batch {k} has structure {treedef}; the first batch had {want_tree}.",
                                 "yield batches of one structure (same keys)."))
        rows = None
        for (p, x), (where, shape, dtype) in zip(leaves, spec):
            if not _feed.is_numeric(x.dtype) or x.ndim == 0 or x.shape[1:] != shape or x.dtype != dtype:
                raise BatchError(fix(
                    f"{self.name}: batch {k}{where} has shape {x.shape} dtype {x.dtype}; the first batch had "
                    f"shape (rows, {', '.join(map(str, shape))}) dtype {dtype}.",
                    "yield batches whose leaves differ only in their rows (numbers, one structure)."))
            if rows is not None and x.shape[0] != rows:
                raise BatchError(fix(f"{self.name}: batch {k}{where} has {x.shape[0]} rows, its other leaves {rows}.",
                                     "give every leaf of a batch the same leading size."))
            rows = x.shape[0]
        return rows, jax.tree_util.tree_unflatten(treedef, [x for _, x in leaves])


_END = object()


def _read(data: Any, name: str) -> Iterator[Any]:
    """The batches of an eval pipeline. The pipeline's own error (a reader that failed) is a
    DataError naming the batch: raw, it ended the run with no summary or parameters written,
    where the training pipeline's is kept."""
    k = 0
    try:
        for batch in data:
            yield batch
            k += 1
    except DataError:
        raise
    except Exception as e:
        raise DataError(fix(f"{name} raised {type(e).__name__} reading eval batch {k}: {e}",
                            "fix the pipeline; the steps trained are kept (summary, params, the last checkpoint), "
                            "and --resume (CheckpointConfig(resume=True)) continues from the last checkpoint.")) from e


def _pipeline_chunks(data: Any, shards: int, sharding_for: ShardingFor | None, name: str
                     ) -> Iterator[tuple[int, Any]]:
    check, batches = _Checked(name), _read(data, name)
    for k in range(sys.maxsize):
        batch = next(batches, _END)
        # A None batch is named as one (it holds no arrays), not taken for the end of the set.
        rows, batch = check(batch, k) if batch is not _END else (-1, None)
        if jax.process_count() == 1:
            if batch is None:
                if k == 0:
                    raise DataError(fix(f"{name} yielded no batch.", "pass an eval set with at least one example."))
                return
            yield rows, batch
            continue
        together = _global_batch(rows, batch, check, shards, sharding_for, name, k)
        if together is None:
            return
        yield together


def _global_batch(rows: int, batch: Any, check: _Checked, shards: int, sharding_for: ShardingFor | None, name: str,
                  k: int) -> tuple[int, Any] | None:
    """This process's rows of batch ``k`` (``rows`` -1: its pipeline has ended) and every
    other process's as one global batch; None once every pipeline has ended."""
    counts = np.asarray(allgather(np.array([rows, check.first is not None], np.int64),
                                  f"{name}'s batch {k} row counts"))
    counts = counts.reshape(jax.process_count(), 2)
    have = np.maximum(counts[:, 0], 0)
    if not have.any():
        if k == 0:
            raise DataError(fix(f"{name} yielded no batch in any process.", "pass an eval set with examples."))
        return None
    if not counts[:, 1].all():  # every process raises alike: no peer is left waiting in a collective
        empty = [int(p) for p in np.flatnonzero(counts[:, 1] == 0)]
        raise DataError(fix(f"{name}: process(es) {empty} yielded no batch while the others did.",
                            "give every process a share of the eval set (e.g. Grain's ShardByJaxProcess), or "
                            "pass arrays or a data set directory, which spmdkit splits itself."))
    total = int(have.sum())
    if (have == have[0]).all() and total % shards == 0 and sharding_for is not None:
        return total, _feed.assemble(batch, total, sharding_for(True))
    # Uneven shares: gathered whole (rows padded to the longest share, then cut), every process the same batch.
    treedef, spec = check.first
    most = int(have.max())
    mine = [np.zeros((most, *shape), dtype) for _, shape, dtype in spec]
    if batch is not None:
        for buf, x in zip(mine, jax.tree.leaves(batch)):
            buf[: rows] = np.asarray(x)
    gathered = allgather(mine, f"{name}'s batch {k}")
    leaves = [np.concatenate([np.asarray(g)[p, : have[p]] for p in range(len(have))]) for g in gathered]
    return total, jax.tree_util.tree_unflatten(treedef, leaves)
