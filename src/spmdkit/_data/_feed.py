"""What ``fit`` trains from: arrays (in memory or memory-mapped) or a pipeline of batches.

Two kinds of input, one contract (``Feed``): ``batches(start)`` yields ``(epoch,
batch)`` from global batch ``start`` on, and ``state(step)`` is the JSON that resumes
it after ``step`` batches.

- Arrays (a pytree of arrays sharing axis 0, e.g. :func:`load_dataset`'s memory
  maps): spmdkit shuffles and batches them; the order is a function of the seed and
  the epoch only, so it is the same on any number of devices or processes, and
  resuming needs nothing but the count of global batches consumed. With several
  processes each reads only the rows of each global batch that its devices hold.
- A pipeline: any iterable of batches (a list, a generator, an iterator, a Grain
  ``MapDataset``/``IterDataset``/``DataLoader``). Each yields this process's rows of
  every global batch (``batch_size / process_count`` rows; with one process, the
  global batch), as a Grain loader sharded by JAX process does. A random-access one
  (a Grain ``MapDataset``) is read by global batch number; an iterator's state
  (``get_state``) is saved per process, every process's gathered into the checkpoint.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from spmdkit._crc import crc32
from spmdkit._data._errors import BatchError, DataExhaustedError
from spmdkit._errors import ConfigError, DataError, fix
from spmdkit._process import gather_json
from spmdkit._tree import abstract_rows

ShardingFor = Callable[[bool], Any]  # even -> where a global batch goes (the strategy's choice)


def is_pipeline(data: Any) -> bool:
    """True for an iterable of batches; False for a pytree of arrays (or None)."""
    if data is None or isinstance(data, (np.ndarray, jax.Array, Mapping, tuple, str, bytes, os.PathLike)):
        return False
    return isinstance(data, list) or hasattr(data, "__next__") or hasattr(data, "__iter__")


def resolve_train_data(data: Any) -> Any:
    """``data`` as ``fit`` reads it: a data set directory opened (memory maps), a pipeline
    kept as it is, anything else left to the array checks; a function is an error."""
    from spmdkit._data._format import load_dataset

    if isinstance(data, (str, os.PathLike)):  # checked as `spmdkit train --data` checks it: a swapped file trained silently
        return load_dataset(data, verify=True)
    if callable(data) and not is_pipeline(data) and not hasattr(data, "shape"):
        name = getattr(data, "__name__", type(data).__name__)
        raise DataError(fix(f"train_data is the function {name!r}; spmdkit does not guess how to call it.",
                            f"pass what it returns: train_data={name}() (an iterable of batches), or the arrays."))
    return data


def num_rows(tree: Any) -> int:
    return int(np.shape(jax.tree.leaves(tree)[0])[0])


def local_block(sharding: Any, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The rows ``[lo, hi)`` of a global array of ``shape`` that this process's devices
    hold, or None if they are not one contiguous block."""
    blocks = sharding.addressable_devices_indices_map(shape).values()
    spans = {(b[0].start or 0, shape[0] if b[0].stop is None else b[0].stop) for b in blocks}
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    return (lo, hi) if sum(e - s for s, e in spans) == hi - lo or len(spans) == 1 else None


def own_copy(batch: Any) -> Any:
    """``batch`` with its host arrays copied (JAX arrays are immutable: kept)."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else np.array(x, copy=True), batch)


def take_rows(x: Any, idx: np.ndarray) -> np.ndarray:
    """Rows ``idx`` of one leaf (a memory map pages in only those rows)."""
    return np.asarray(x[idx])


def assemble(local: Any, rows: int, sharding: Any) -> Any:
    """This process's rows of every leaf -> global arrays of ``rows`` rows (no collective)."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, x, (rows, *np.shape(x)[1:])), local)


def is_numeric(dtype: Any) -> bool:
    """A dtype JAX trains on: NumPy's numbers, and ml_dtypes' floats (bfloat16, float8), which
    NumPy files under kind "V" (a pipeline yielding bfloat16 images was refused as not numeric).

    >>> is_numeric(np.dtype("int8")), is_numeric(jax.numpy.bfloat16), is_numeric(np.dtype("U3"))
    (True, True, False)
    """
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or jax.dtypes.issubdtype(dtype, np.floating)


def share_digest(batch: Any) -> list[Any]:
    """``[CRC-32 of the batch's bytes, whether its rows differ]``: two processes yielding the same
    share of every global batch train on each example twice; a batch whose rows are all alike
    (zeros in a smoke test) cannot tell that apart from a split one.

    >>> share_digest({"x": np.zeros((2, 3), np.float32)}), share_digest({"x": np.eye(2, dtype=np.float32)})
    (['a3c1ca20', False], ['c22429db', True])
    """
    crc, differ = 0, False
    for x in jax.tree.leaves(batch):
        rows = np.ascontiguousarray(np.asarray(x)).view(np.uint8).reshape(np.shape(x)[0], -1)
        crc = crc32(rows.reshape(-1), crc)
        differ = differ or bool((rows != rows[:1]).any())
    return [f"{crc:08x}", differ]


def arrays_digest(tree: Any) -> str | None:
    """The CRC-32 of a pytree's array bytes when every leaf is a numpy array in memory, else
    None (a pipeline, a data set directory: its files are checksummed when loaded). A list of
    batches is in memory too: resumed with other batches it trained on them without a word.

    >>> arrays_digest({"x": np.zeros(3, np.float32)}), arrays_digest("data/eval")
    ('7bd5c66f', None)
    """
    if isinstance(tree, (str, bytes, os.PathLike)) or (is_pipeline(tree) and not isinstance(tree, list)):
        return None  # flattened, a pipeline would be a leaf: JAX warns of that, and will refuse it
    if isinstance(tree, list) and jax.process_count() > 1:
        return None  # each process's list holds its own share: no digest of the whole to compare
    leaves = jax.tree.leaves(tree)
    if not leaves or not all(type(x) is np.ndarray and not x.dtype.hasobject for x in leaves):
        return None
    crc = 0
    for x in leaves:
        crc = crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8), crc)
    return f"{crc:08x}"


class ArrayFeed:
    """Shuffled batches of arrays; every process reads only its devices' rows."""

    kind = "arrays"

    def __init__(self, data: Any, batch_size: int, seed: int, drop_remainder: bool, streams: int = 1,
                 sharding_for: ShardingFor | None = None, shards: int = 1):
        self.data, self.batch_size, self.seed, self.streams = data, batch_size, seed, streams
        self.sharding_for, self.shards = sharding_for, shards
        self.num_examples = num_rows(data)
        stop = self.num_examples - self.num_examples % batch_size if drop_remainder else self.num_examples
        self._stop = stop
        self.steps_per_epoch = len(range(0, stop, batch_size))
        self._orders: dict[tuple[int, int | None], np.ndarray] = {}

    def example(self) -> Any:
        n = min(self.batch_size, self.num_examples)
        return jax.tree.map(lambda x: abstract_rows(x, n), self.data)

    def indices(self, k: int, stream: int | None = None) -> tuple[int, np.ndarray]:
        """``(epoch, example indices)`` of global batch ``k``: a function of seed and epoch only."""
        epoch, pos = divmod(k, self.steps_per_epoch)
        key = (epoch, stream)
        if key not in self._orders:
            entropy = [self.seed, epoch] if stream is None else [self.seed, epoch, stream]
            self._orders = {key: np.random.default_rng(entropy).permutation(self.num_examples)}
        start = pos * self.batch_size
        return epoch, self._orders[key][start : min(start + self.batch_size, self._stop)]

    def _read(self, idx: np.ndarray) -> Any:
        if jax.process_count() > 1 and self.sharding_for is not None:
            sharding = self.sharding_for(len(idx) % self.shards == 0)
            block = local_block(sharding, (len(idx),))
            if block is not None:  # this process reads only the rows its devices hold
                local = jax.tree.map(lambda x: take_rows(x, idx[block[0] : block[1]]), self.data)
                return assemble(local, len(idx), sharding)
        return jax.tree.map(lambda x: take_rows(x, idx), self.data)

    def batches(self, start: int) -> Iterator[tuple[int, Any]]:
        for k in itertools.count(start):
            if self.streams == 1:
                epoch, idx = self.indices(k)
                yield epoch, self._read(idx)
            else:  # independent orders stacked on a leading axis (bagged ensemble members)
                parts = [self.indices(k, m) for m in range(self.streams)]
                yield parts[0][0], jax.tree.map(lambda *xs: np.stack(xs),
                                                *(jax.tree.map(lambda x: take_rows(x, i), self.data) for _, i in parts))

    def state(self, step: int) -> dict[str, Any]:
        digest = self.digest()
        return {"kind": self.kind, "examples": self.num_examples, "batches": step,
                **({"crc32": digest} if digest is not None else {})}

    def digest(self) -> str | None:
        """The CRC-32 of the training arrays' bytes, when they are all in memory (a data set
        directory's memory maps are not read whole for it: their files are checksummed when
        loaded), else None. Computed once."""
        if not hasattr(self, "_digest"):
            self._digest = arrays_digest(self.data)
        return self._digest

    def resume(self, saved: dict[str, Any] | None) -> None:
        if saved is None:
            return
        if saved.get("kind") != self.kind or saved.get("examples") != self.num_examples:
            raise ConfigError(fix(
                f"the checkpoint was written training from {saved.get('kind')} with {saved.get('examples')} examples; "
                f"this run trains from {self.kind} with {self.num_examples}: the data order would differ.",
                "resume with the same training data, or start a new run in another checkpoint directory."))
        # The same number of examples with other bytes (a file of --text-dir edited, the standard
        # library of another Python, a corpus past --text-bytes grown) was resumed without a word,
        # and the run was no longer the one it claimed to continue. Older checkpoints hold no digest.
        then, now = saved.get("crc32"), self.digest()
        if then is not None and now is not None and then != now:
            raise ConfigError(fix(
                f"the checkpoint was written training on other data: {self.num_examples} examples as now, but their "
                f"bytes differ (CRC-32 {then} then, {now} now): the training data changed since (a file under "
                "--text-dir or --data edited, another data set at the path, another Python's standard library).",
                "resume with the training data the run started with, or start a new run in another checkpoint "
                "directory."))


class PipelineFeed:
    """A user's iterable of batches, checked batch by batch, restarted each epoch if it can be."""

    kind = "pipeline"
    _KEEP = 64  # iterator states remembered (a checkpoint is saved a few steps after its step ran)

    def __init__(self, source: Any, batch_size: int, sharding_for: ShardingFor | None = None, shards: int = 1,
                 name: str = "train_data"):
        self.source, self.batch_size, self.name = source, batch_size, name
        self.sharding_for, self.shards = sharding_for, shards
        self.processes = jax.process_count()
        if batch_size % self.processes:
            raise ConfigError(fix(f"batch_size={batch_size} does not split over {self.processes} processes; each "
                                  f"process's pipeline yields batch_size / {self.processes} rows.",
                                  f"use a multiple of {self.processes} (--batch-size)."))
        self.rows = batch_size // self.processes
        self.one_shot = hasattr(source, "__next__")
        self.indexable = not self.one_shot and hasattr(source, "__getitem__") and hasattr(source, "__len__")
        self.num_examples = None
        self.steps_per_epoch = len(source) if self.indexable else None
        # A random-access pipeline whose global order spmdkit fixes (grain_batches): batch k is the same
        # global batch on any number of processes, so a checkpoint resumes on any.
        self.order = getattr(source, "spmdkit_order", None) if self.indexable else None
        if self.steps_per_epoch == 0:
            raise DataError(fix(f"{name} is empty.", "pass a pipeline that yields at least one batch."))
        self._first: tuple[Any, Any] | None = None  # (treedef, [(path, shape, dtype)])
        self.first_share: list[Any] | None = None  # [CRC-32, rows differ] of this process's first batch
        self._pending: list[Any] = []  # a peeked batch not yet trained on
        self._it: Any = None
        self._saved: dict[str, Any] | None = None
        self._states: dict[int, Any] = {}
        self._epoch_start = 0
        # Set when a thread reads ahead (prefetch): a pipeline that refills one buffer and yields
        # it again overwrote the batches waiting in the queue (or on the devices, which may share
        # a NumPy array's memory on CPU), and the run trained on other rows without a word.
        self.copy_batches = False

    # ---- checking -----------------------------------------------------------
    def _expected(self) -> str:
        if self.processes == 1:
            return f"batch_size={self.batch_size} rows"
        return (f"batch_size / processes = {self.batch_size} / {self.processes} = {self.rows} rows (each process's "
                "pipeline yields its share of the global batch)")

    def _describe_first(self, batch: Any) -> tuple[Any, list[tuple[str, tuple, np.dtype]]]:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
        if not leaves:
            raise BatchError(fix(f"{self.name}'s first batch holds no arrays (it is {type(batch).__name__}).",
                                 "yield dicts of arrays, e.g. {'x': x[i:i+B], 'y': y[i:i+B]}."))
        spec = []
        for path, x in leaves:
            where = f"{self.name} batch{jax.tree_util.keystr(path)}"
            if isinstance(x, (int, float, complex, bool)) and path:  # a Python list is a pytree, not rows
                raise BatchError(fix(f"{where} is a Python {type(x).__name__}, not an array: the batch holds "
                                     "Python lists, whose every number JAX sees as a separate leaf.",
                                     "yield NumPy arrays (np.asarray(rows)) for every leaf."))
            x = np.asarray(x) if not isinstance(x, jax.Array) else x
            if not is_numeric(x.dtype):
                raise BatchError(fix(f"{where} has dtype {x.dtype}; JAX trains on numeric arrays.",
                                     "yield numbers (token ids, one-hot floats)."))
            if x.ndim == 0 or x.shape[0] != self.rows:
                raise BatchError(fix(f"{where} has shape {x.shape}; its leading (batch) axis must hold "
                                     f"{self._expected()}.{self._list_of_arrays(batch)}",
                                     f"yield batches of {self.rows} rows, or set batch_size to what the pipeline "
                                     "yields (--batch-size)."))
            spec.append((jax.tree_util.keystr(path), x.shape, x.dtype))
        return treedef, spec

    def _list_of_arrays(self, batch: Any) -> str:
        """A hint when the "pipeline" is a list of bare arrays: [x, y] meant as the data, each array
        read as one batch of all the examples."""
        if isinstance(self.source, list) and hasattr(batch, "shape") and len(self.source) <= 16:
            return (f" {self.name} is a list, which spmdkit reads as a pipeline of batches, and its first item is "
                    f"a bare array: if the list holds the data's arrays ([x, y]), pass them as a tuple (x, y) or a "
                    "dict {'x': x, 'y': y}, which spmdkit shuffles and batches.")
        return ""

    def _check(self, batch: Any, k: int) -> Any:
        if self._first is None:
            self._first = self._describe_first(batch)
        treedef, spec = self._first
        leaves, got = jax.tree_util.tree_flatten(batch)
        if got != treedef:
            raise BatchError(fix(f"{self.name}: batch {k} has structure {got}; the first batch had {treedef}.",
                                 "yield batches of one structure (same keys) for the whole run."))
        out = []
        for (where, shape, dtype), x in zip(spec, leaves):
            x = x if isinstance(x, jax.Array) else np.asarray(x)
            if x.shape != shape or x.dtype != dtype:
                what, remedy = _what_changed(x, shape, dtype)
                raise BatchError(fix(f"{self.name}: batch {k}{where} has shape {x.shape} dtype {x.dtype}; the first "
                                     f"batch had shape {shape} dtype {dtype} ({what}).", remedy))
            out.append(x)
        return jax.tree.unflatten(treedef, out)

    def example(self) -> Any:
        if self._first is None:
            try:
                first = self._read_first()
            except (BatchError, DataError):
                raise
            except Exception as e:  # the user's reader failed at once: named as at any later batch
                last = "" if not self.indexable or self.steps_per_epoch < 2 else \
                    f" (or batch {self.steps_per_epoch - 1}, its last, read to check its size)"
                raise DataError(fix(f"{self.name} raised {type(e).__name__} reading its first batch{last}: {e}",
                                    "fix the pipeline (it failed before any step ran).")) from e
            self._pending = [] if self.indexable else [first]  # not lost: trained on first
        _, spec = self._first
        shapes = [jax.ShapeDtypeStruct((self.batch_size, *s[1:]), jax.dtypes.canonicalize_dtype(d)) for _, s, d in spec]
        return jax.tree.unflatten(self._first[0], shapes)

    def _read_first(self) -> Any:
        if self.indexable:
            first = self._check(self.source[0], 0)
            last = self.steps_per_epoch - 1
            if last > 0:  # a short last batch of an epoch (drop_remainder=False) found now, not epochs later
                self._check(self.source[last], last)
        else:
            self._it = iter(self.source)
            try:
                first = self._check(next(self._it), 0)
            except StopIteration:
                raise DataError(fix(f"{self.name} yielded no batch at all.", "pass a pipeline with data.")) from None
        if self._shares_split():
            self.first_share = share_digest(first)
        return first

    def _shares_split(self) -> bool:
        """Whether each process's batch is rows of the global batch that no other process gives
        (its devices' rows), as against every process giving the whole batch (an ensemble's)."""
        if self.processes == 1 or self.sharding_for is None or self.batch_size % self.shards:
            return False
        block = local_block(self.sharding_for(True), (self.batch_size,))
        return block is not None and block[1] - block[0] < self.batch_size

    # ---- reading --------------------------------------------------------------
    def _raw(self, start: int) -> Iterator[tuple[int, Any]]:
        """``(epoch, batch)`` from global batch ``start``, unchecked."""
        if self.indexable:
            n = self.steps_per_epoch
            grain_like = hasattr(self.source, "to_iter_dataset")  # Grain: later epochs re-shuffled by index
            for k in itertools.count(start):
                yield k // n, self.source[k] if grain_like else self.source[k % n]
        saved = self._saved or {}
        mine = (saved.get("iterators") or {}).get(str(jax.process_index())) if "iterators" in saved else saved
        if start and (mine or {}).get("iterator") is not None and saved.get("batches") == start:
            it = iter(self.source)
            if hasattr(it, "set_state"):  # a Grain iterator: restored, nothing re-read
                state = mine["iterator"]
                it.set_state(state["bytes"].encode() if isinstance(state, dict) and set(state) == {"bytes"} else state)
                yield from self._stream(it, int(mine.get("epoch", 0)), start, int(mine.get("epoch_start", 0)))
                return
        if start and self.one_shot:
            raise DataExhaustedError(fix(
                f"{self.name} is a one-shot iterator: a resumed run cannot rewind it to batch {start}.",
                "pass a re-iterable pipeline (a list, a Grain dataset or loader) so the run can resume."))
        # Without a saved state: read again from the beginning and skip what was trained on.
        it = self._it if self._it is not None and not start else iter(self.source)
        yield from itertools.islice(self._stream(it, 0, 0, 0), start, None)

    def _stream(self, it: Any, epoch: int, k: int, epoch_start: int) -> Iterator[tuple[int, Any]]:
        self._epoch_start = epoch_start
        while True:
            try:
                batch = self._pending.pop() if self._pending else next(it)
            except StopIteration:
                if self.one_shot:
                    raise DataExhaustedError(fix(
                        f"{self.name} is a one-shot iterator and ended after {k} batches; the run needs more "
                        "(steps / epochs).",
                        "pass a re-iterable (a list, a Grain dataset or loader, or an object whose __iter__ "
                        "starts over: it is restarted each epoch), an endless iterator, or fewer steps "
                        "(TrainConfig(steps=...); --steps).")) from None
                if self._epoch_start == k:
                    raise DataError(fix(f"{self.name} yielded no batch in epoch {epoch + 1}.",
                                        "pass a pipeline that yields the same batches each time it is iterated."))
                epoch, self._epoch_start, it = epoch + 1, k, iter(self.source)
                continue
            k += 1
            if hasattr(it, "get_state"):
                self._remember(k, epoch, it.get_state())
            yield epoch, batch

    def _remember(self, k: int, epoch: int, state: Any) -> None:
        if isinstance(state, bytes):
            state = {"bytes": state.decode()}
        self._states[k] = {"epoch": epoch, "epoch_start": self._epoch_start, "iterator": state}
        self._states.pop(k - self._KEEP, None)

    def _place(self, batch: Any) -> Any:
        if self.processes == 1 or self.sharding_for is None:
            return batch
        if self.batch_size % self.shards:
            raise ConfigError(fix(f"batch_size={self.batch_size} does not split over the {self.shards} devices of "
                                  "the batch axis; with several processes each pipeline yields a share.",
                                  f"use a multiple of {self.shards} (--batch-size)."))
        return assemble(batch, self.batch_size, self.sharding_for(True))

    def batches(self, start: int) -> Iterator[tuple[int, Any]]:
        if start:
            self._pending, self._it = [], None
        raw = self._raw(start)
        for k in itertools.count(start):
            try:
                epoch, batch = next(raw)
            except StopIteration:
                return
            except DataError:
                raise
            except Exception as e:  # the user's pipeline failed: a DataError, so fit still keeps what it trained
                raise DataError(fix(
                    f"{self.name} raised {type(e).__name__} reading batch {k}: {e}",
                    "fix the pipeline, then resume with --resume (CheckpointConfig(resume=True)): a single process "
                    "saves a last checkpoint, summary and params here; with several, the last periodic checkpoint "
                    "is where the run resumes.")) from e
            batch = self._check(batch, k)
            yield epoch, self._place(own_copy(batch) if self.copy_batches else batch)

    def state(self, step: int) -> dict[str, Any]:
        """The data position after ``step`` batches. With several processes every process calls it
        at the same step (a checkpoint is saved by all): each one's iterator state is gathered,
        keyed by process index, into the metadata process 0 writes."""
        order = {} if self.order is None else {"order": self.order}
        if (digest := self.digest()) is not None:
            order["crc32"] = digest
        head = {"kind": self.kind, "batches": step, "processes": self.processes, **order}
        if self.processes == 1 or self.indexable:  # one process, or read by global position: nothing per process
            return {**head, **self._states.get(step, {})}
        states = gather_json(self._states.get(step), "the data pipelines' positions for a checkpoint")
        return {**head, "iterators": {str(p): s for p, s in enumerate(states)}}

    def digest(self) -> str | None:
        """The CRC-32 of a list of in-memory batches (computed once), else None."""
        if not hasattr(self, "_digest"):
            self._digest = arrays_digest(self.source) if isinstance(self.source, list) else None
        return self._digest

    def _check_same_batches(self, saved: dict[str, Any] | None) -> None:
        then, now = (saved or {}).get("crc32"), self.digest()
        if then is not None and now is not None and then != now:
            raise ConfigError(fix(
                f"the checkpoint was written training on a list of {len(self.source)} batches whose bytes differ "
                f"from this run's (CRC-32 {then} then, {now} now): the training data changed since.",
                "resume with the batches the run started with, or start a new run in another checkpoint directory."))

    def _check_same_rows(self, saved_order: dict[str, Any] | None) -> None:
        """A grain_batches data set written again with other rows (the same count) resumed without a
        word: its order holds only the count, so the run trained on other data than it claimed to continue."""
        then, now = (saved_order or {}).get("crc32"), (self.order or {}).get("crc32")
        if then is not None and now is not None and then != now:
            raise ConfigError(fix(
                f"the checkpoint was written reading {saved_order.get('examples')} examples through grain_batches whose "
                f"data set differs from this run's (manifest CRC-32 {then} then, {now} now): the data set was "
                "written again since, or another one is at the path.",
                "resume with the data set the run started with, or start a new run in another checkpoint directory."))

    def resume(self, saved: dict[str, Any] | None) -> None:
        if saved is not None and saved.get("kind") != self.kind:
            raise ConfigError(fix(f"the checkpoint was written training from {saved.get('kind')}; this run trains "
                                  "from a pipeline: the data order would differ.",
                                  "resume with the same training data, or start a new run elsewhere."))
        saved_order = (saved or {}).get("order")
        self._check_same_rows(saved_order)
        self._check_same_batches(saved)
        if saved_order is not None and _without_crc(saved_order) != _without_crc(self.order):
            raise ConfigError(fix(
                f"the checkpoint was written reading {saved_order}; this run's pipeline reads "
                f"{self.order or 'another pipeline'}: the data order would differ.",
                "resume with the same grain_batches arguments (data set, batch_size, seed, drop_remainder), or "
                "start a new run elsewhere."))
        then = (saved or {}).get("processes", self.processes)
        if then != self.processes and saved_order is None:
            raise ConfigError(fix(
                f"the checkpoint was written by {then} process(es) reading their own shares of a pipeline; this run "
                f"has {self.processes}: each process's pipeline (and its saved iterator state) would yield other "
                "rows, so the data order would differ from the run's.",
                f"resume with {then} process(es); or read the data with spmdkit.grain_batches(DIR, batch_size) "
                "(a Grain MapDataset whose global order spmdkit fixes) or from arrays or an on-disk data set "
                "(--data DIR), whose order is the same on any number of processes."))
        self._saved = saved


def _what_changed(x: Any, shape: tuple, dtype: Any) -> tuple[str, str]:
    """What differs from the first batch, and its fix. Every change was called "a ragged batch?"
    with the fix to drop the epoch's last batch, also a dtype that changed (int32 labels, then
    int64) and a per-example shape that did."""
    if x.shape[1:] != shape[1:]:
        return "another per-example shape", "yield one per-example shape for the whole run (crop, pad or resize)."
    if x.shape != shape:
        return "a ragged batch?", ("yield equal batches (drop or pad the last one of an epoch, e.g. Grain's "
                                   "batch(..., drop_remainder=True)).")
    return "another dtype", (f"yield one dtype per leaf for the whole run (cast in the pipeline: "
                             f"x.astype(np.{np.dtype(dtype).name})).")


def _without_crc(order: dict[str, Any] | None) -> dict[str, Any] | None:
    """An order without its data set digest (checked on its own; a checkpoint may predate it)."""
    return None if order is None else {k: v for k, v in order.items() if k != "crc32"}


def open_feed(data: Any, batch_size: int, seed: int, drop_remainder: bool, strategy: Any = None) -> ArrayFeed | PipelineFeed:
    """The feed for ``data`` (arrays or a pipeline), reading for ``strategy``'s batch layout."""
    sharding_for = None
    if strategy is not None and hasattr(strategy, "_batch_sharding_for"):
        sharding_for = lambda even: strategy._batch_sharding_for("step", even)  # noqa: E731
    shards = getattr(strategy, "batch_shards", 1)
    streams = getattr(strategy, "data_streams", 1)
    if is_pipeline(data):
        if streams != 1:
            raise ConfigError(fix(f"a bagged ensemble draws {streams} independent orders of the data; a pipeline "
                                  "yields one.", "pass the training data as arrays or a data set directory "
                                  "(train_data=DIR; --data DIR), or turn bagging off."))
        return PipelineFeed(data, batch_size, sharding_for, shards)
    return ArrayFeed(data, batch_size, seed, drop_remainder, streams, sharding_for, shards)
