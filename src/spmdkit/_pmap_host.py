"""Host-side helpers around :func:`spmdkit.pmap`: replicate, unreplicate, shard."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdkit._errors import BatchSizeError, MappedAxisError, fix


def _device_count(n_devices: int | None) -> int:
    available = jax.local_device_count()
    if n_devices is None:
        return available
    if not isinstance(n_devices, int) or not 1 <= n_devices <= available:
        raise MappedAxisError(
            fix(
                f"n_devices={n_devices!r}, but {available} local device(s) are available.",
                f"pass an int from 1 to {available}, or None for all of them.",
            )
        )
    return n_devices


def replicate(tree: Any, n_devices: int | None = None) -> Any:
    """Stack a copy of every leaf on each device: leaf shape ``s`` -> ``[n, *s]``.

    The result is sharded one copy per device, the layout ``pmap(f, in_axes=0)``
    expects (the seed's ``flax.jax_utils.replicate``).

    Example:
        >>> import jax, numpy as np, spmdkit
        >>> r = spmdkit.replicate({"w": np.ones(3)})
        >>> r["w"].shape == (jax.local_device_count(), 3)
        True
    """
    n = _device_count(n_devices)
    devices = jax.local_devices()[:n]
    sharding = NamedSharding(Mesh(np.array(devices), ("replica",)), P("replica"))

    def put(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        shards = [jax.device_put(x[None], d) for d in devices]
        return jax.make_array_from_single_device_arrays((n, *x.shape), sharding, shards)

    return jax.tree.map(put, tree)


def unreplicate(tree: Any) -> Any:
    """Take device 0's copy of every leaf: the inverse of :func:`replicate`.

    Example:
        >>> import numpy as np, spmdkit
        >>> spmdkit.unreplicate(spmdkit.replicate({"w": np.ones(3)}))["w"].shape
        (3,)
    """
    def first(path, x):
        where = f"tree{jax.tree_util.keystr(path)}"
        if np.ndim(x) == 0:
            raise MappedAxisError(fix(f"unreplicate: {where} is a scalar, with no replica axis to take copy 0 of.",
                                      "pass what spmdkit.replicate (or a pmap with out_axes=0) returned."))
        sharding = getattr(x, "sharding", None)
        if sharding is not None and len(sharding.device_set) > 1 and sharding.is_fully_replicated:
            # A DataParallel or Sharded state is one copy already: x[0] would be its first row.
            raise MappedAxisError(fix(
                f"unreplicate: {where} (shape {x.shape}) is one array held whole on {len(sharding.device_set)} "
                "devices, not stacked copies: taking copy 0 would take its first row.",
                "use it as it is (jax.device_get(tree) for host copies); unreplicate is for what "
                "spmdkit.replicate or a pmap returned."))
        return x[0]

    return jax.tree_util.tree_map_with_path(first, tree)


class ShardedBatch(NamedTuple):
    """A host batch reshaped to ``[n_devices, per_device, ...]``, with its mask.

    ``mask[d, j]`` is True where row ``j`` of device ``d`` is a real example and
    False where :func:`shard` padded; ``sum(loss * mask) / sum(mask)`` is the exact
    mean over the real examples.
    """

    data: Any
    mask: np.ndarray


def _leading_size(batch: Any) -> int:
    """The examples of every leaf of ``batch`` (axis 0), alike for all; else a BatchSizeError naming the leaf."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise BatchSizeError(
            fix("spmdkit.shard got a batch with no arrays.", "pass an array or a pytree of arrays.")
        )
    sizes = []
    for path, x in leaves:
        shape = np.shape(x)
        if len(shape) == 0:
            raise BatchSizeError(
                fix(
                    f"batch{jax.tree_util.keystr(path)} is a scalar; it has no batch axis to split.",
                    "give every leaf a leading batch axis.",
                )
            )
        sizes.append((path, shape[0]))
    first_path, size = sizes[0]
    for path, s in sizes[1:]:
        if s != size:
            raise BatchSizeError(
                fix(
                    "leaves of the batch have different leading sizes: "
                    f"batch{jax.tree_util.keystr(first_path)} has {size}, "
                    f"batch{jax.tree_util.keystr(path)} has {s}.",
                    "give every leaf the same number of examples along axis 0.",
                )
            )
    if size == 0:
        raise BatchSizeError(fix("the batch has 0 examples.", "pass at least one example."))
    return size


def shard(batch: Any, n_devices: int | None = None, *, pad: bool = True) -> ShardedBatch:
    """Reshape every leaf of a host batch from ``[B, ...]`` to ``[n, ceil(B/n), ...]``.

    When ``B`` is not divisible by ``n`` the batch is padded with zeros at the end
    and the returned mask marks the real rows; with ``pad=False`` that is an error.

    Example:
        >>> import numpy as np, spmdkit
        >>> data, mask = spmdkit.shard(np.arange(10.0), n_devices=4)
        >>> data.shape, int(mask.sum())
        ((4, 3), 10)
    """
    n = _device_count(n_devices)
    size = _leading_size(batch)
    per = -(-size // n)
    padding = per * n - size
    if padding and not pad:
        raise BatchSizeError(
            fix(
                f"a batch of {size} examples does not split evenly over {n} devices "
                f"({size} = {n} x {size // n} + {size % n}).",
                f"use a batch size divisible by {n} (e.g. {size - size % n or n} or {per * n}), "
                "or call shard(batch, pad=True) and weight the loss with the returned mask.",
            )
        )

    def reshape(x):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            # Typed PRNG keys (a key per example) have no NumPy form: split their data, padded
            # with all-zero keys, and wrap it again with the same implementation.
            data = reshape(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        x = np.asarray(x)
        if padding:
            x = np.concatenate([x, np.zeros((padding, *x.shape[1:]), x.dtype)])
        return x.reshape(n, per, *x.shape[1:])

    mask = (np.arange(per * n) < size).reshape(n, per)
    return ShardedBatch(jax.tree.map(reshape, batch), mask)


