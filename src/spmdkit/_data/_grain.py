"""A Grain ``MapDataset`` of global batches read from an on-disk data set, one read per leaf.

``MapDataset.source(DatasetSource(dir)).shuffle(seed).batch(B)`` works, but Grain then
shuffles, reads and stacks one example at a time (hundreds of small reads and Python
calls per batch). :func:`grain_batches` makes the batch the unit instead: batch ``k``
is the examples of ``fit``'s own order for ``k`` (a function of seed and epoch only,
the order ``fit`` uses for arrays), read with one fancy index per leaf. With several
processes each process's dataset yields only its rows of every global batch, and the
order does not depend on the process count, so a checkpoint resumes on any number of
processes.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import numpy as np

from spmdkit._errors import ConfigError, DataError, fix


def grain_batches(data: str | os.PathLike | Any, batch_size: int, *, seed: int = 0, drop_remainder: bool = True,
                  process_index: int | None = None, process_count: int | None = None) -> Any:
    """A ``grain.MapDataset`` of this process's rows of every global batch of an on-disk data set.

    ``data`` is a data set directory (:func:`write_dataset`) or a :class:`DatasetSource`.
    Element ``k`` is global batch ``k`` in the order ``fit`` gives the same data as
    arrays with ``TrainConfig(seed=seed, drop_remainder=drop_remainder)`` (``fit``'s own
    default keeps an epoch's short last batch, this one's drops it; reshuffled each epoch; indices past the
    first epoch continue into the next, as Grain's do); with P processes (JAX's, unless
    given) process p gets rows ``[p * batch_size / P, (p + 1) * batch_size / P)``. Pass
    it as a task's ``train_data``: ``fit`` reads batch ``k`` by index, so nothing but the
    step needs saving, and a checkpoint resumes on any process count. Further Grain
    transformations (``.map``) apply per batch; ``TrainConfig(prefetch=N)`` overlaps the
    reads with the steps.

    Grain's own ``MapDataset.source(DatasetSource(dir)).shuffle(seed).batch(B)`` gives
    batches too, but reads, shuffles and stacks one example at a time; this reads one
    slice per leaf per batch. The example is on ``spmdkit._data._grain_dataset.DatasetBatches``
    (it runs where Grain is installed).
    """
    try:
        from spmdkit._data._grain_dataset import DatasetBatches
    except ImportError:
        raise DataError(fix("grain_batches needs Grain, which is not installed.",
                            "pip install grain (Python >= 3.12; in a checkout of spmdkit: pip install -e '.[grain]'), or train from the data set directory "
                            "itself (train_data=DIR; --data DIR), which reads the same order through memory maps."),
                        ) from None
    import jax

    from spmdkit._data._format import DatasetSource

    _check_whole("batch_size", batch_size, "e.g. batch_size=32 (--batch-size 32)")
    _check_whole("seed", seed, "e.g. seed=0, the TrainConfig(seed=...) of the run")
    batch_size, seed = int(batch_size), int(seed)
    source = data if isinstance(data, DatasetSource) else DatasetSource(data)
    p = jax.process_index() if process_index is None else int(process_index)
    count = jax.process_count() if process_count is None else int(process_count)
    if not 0 <= p < count:
        raise ConfigError(fix(f"grain_batches: process_index={p} with process_count={count}.",
                              f"pass a process_index from 0 to {count - 1} (or neither: JAX's are used)."))
    if batch_size <= 0 or batch_size % count:
        raise ConfigError(fix(f"grain_batches: batch_size={batch_size} over {count} process(es) (this is process {p}): "
                              "each process reads batch_size / processes rows of every global batch.",
                              f"use a batch_size that is a positive multiple of {count} (--batch-size)."))
    if batch_size > len(source) and drop_remainder:
        raise ConfigError(fix(f"grain_batches: batch_size={batch_size} is larger than {source} ({len(source)} "
                              "examples), so no batch is whole.", f"use batch_size={len(source)} or less."))
    return DatasetBatches(source, batch_size, seed, drop_remainder, p, count)


def _check_whole(name: str, value: Any, example: str) -> None:
    """A whole number, not a bool: a string batch size or a None seed was a bare TypeError from
    deep inside (or, for True, a batch of 1)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):  # np.int64 is fine
        raise ConfigError(fix(f"grain_batches: {name}={value!r} ({type(value).__name__}) is not a whole number.",
                              f"{example}."))
