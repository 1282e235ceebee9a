"""Batches read and put on the devices ahead of the step that needs them.

A background thread runs the feed (host work: reading, shuffling, checking) and
places each batch (``jax.device_put`` / ``jax.make_array_from_process_local_data``:
transfers, no collective), keeping at most ``size`` batches ready. Steps still run on
the main thread, which blocks on every step, so the rule that XLA:CPU must not queue
many collective steps is kept: the thread never dispatches a computation.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

_DONE = object()


def to_devices(batch: Any, sharding_for: Callable[[bool], Any] | None, shards: int) -> Any:
    """A host batch on the devices where the step expects it (global arrays are kept)."""
    leaves = jax.tree.leaves(batch)
    if sharding_for is None or all(isinstance(x, jax.Array) for x in leaves) or jax.process_count() > 1:
        return batch
    rows = int(leaves[0].shape[0])
    return jax.device_put(batch, sharding_for(rows % shards == 0))


class Prefetch:
    """Iterate ``source`` (``(epoch, batch)`` pairs) ``size`` batches ahead, in a thread.

    An error in the thread is raised by the ``next`` that would have returned its batch.
    ``close()`` stops the thread (``fit`` calls it however the run ends).

    Example:
        >>> with Prefetch(iter([(0, 1), (0, 2)]), size=2) as batches:
        ...     list(batches)
        [(0, 1), (0, 2)]
    """

    def __init__(self, source: Iterator[tuple[int, Any]], size: int = 2, place: Callable[[Any], Any] | None = None):
        self._source, self._place = source, place or (lambda b: b)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, size))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spmdkit-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for epoch, batch in self._source:
                if not self._put((epoch, self._place(batch))):
                    return
            self._put(_DONE)
        except BaseException as e:  # handed to the consumer, raised where the batch was wanted
            self._put(e)

    def __iter__(self) -> Prefetch:
        return self

    def __next__(self) -> tuple[int, Any]:
        item = self._queue.get()
        if item is _DONE:
            self._put(_DONE)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
