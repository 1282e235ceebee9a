"""What every strategy shares: the contract and placement helpers.

A strategy decides where a state and the batches live on the devices and compiles the
user's functions (``_compile.Placement``); it knows nothing of tasks, losses or
optimizers. The loop calls only what :class:`Strategy` lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit._process import allgather
from spmdkit._types import Batch, Predictor, TrainState  # noqa: F401 (re-exported)


class Strategy(Protocol):
    """Where a state and batches live on a mesh, and the user's functions compiled there.

    A strategy knows nothing of tasks, losses or optimizers: placement and compilation
    only. ``fit`` uses only this contract (and, for an :class:`Ensemble`, its members).
    """

    name: str

    @property
    def batch_shards(self) -> int:
        """How many pieces a global batch is split into (a batch that does not divide
        evenly is run whole on every device, exactly)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Mesh shape, device count and implementation, for summaries."""
        ...

    def init(self, make_state: Callable[[jax.Array], Any], rng: Any) -> Any:
        """``make_state(rng)`` (any pytree) created directly where this strategy keeps it."""
        ...

    def shardings(self, abstract_state: Any) -> Any:
        """Where each leaf of a state lives: the restore target of a checkpoint."""
        ...

    def abstract(self, make_state: Callable[[jax.Array], Any], rng: Any = 0) -> Any:
        """``ShapeDtypeStruct``s of the state with :meth:`shardings`, nothing allocated."""
        ...

    def step(self, train_step: Callable[[Any, Batch], tuple[Any, Any]], *, donate: bool = False) -> Callable[..., Any]:
        """``train_step(state, batch) -> (state, aux)`` on the global batch, compiled."""
        ...

    def evaluate(self, fn: Callable[[Any, Batch], Any]) -> Callable[..., Any]:
        """``fn(state, batch) -> values`` on the exact global batch, compiled."""
        ...

    def apply(self, fn: Callable[[Any, Batch], Any]) -> Callable[..., Any]:
        """Per-example ``fn(state, batch) -> [B, ...]`` on any batch size."""
        ...


def run_key(key: jax.Array) -> jax.Array:
    """The raw bits of a model's per-step key, derived from its init key (so ensemble
    members, initialised from different keys, also draw different dropout masks)."""
    return jax.random.key_data(jax.random.fold_in(key, 0x5EED))


def micro_batches(tree: Any, accum: int) -> Any:
    """``[B, ...]`` -> ``[accum, B/accum, ...]``; micro-batch k takes rows k, k+accum, ...

    Interleaved rather than in blocks so that, when B is split over devices in
    contiguous blocks, every device holds an equal share of every micro-batch.
    """
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 0, 1), tree)


def put_global(tree: Any, sharding: Any) -> Any:
    """Host arrays onto a sharding; with several processes each fills only its own shards.

    Every process holds the same host batch (the data order is a function of the seed),
    and supplies the slices of the global array that its devices hold.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: _process_local(x, sharding), tree)


def _process_local(x: np.ndarray, sharding: Any) -> jax.Array:
    """Hand JAX only the rows this process's devices hold (its slice of the batch)."""
    blocks = sharding.addressable_devices_indices_map(x.shape).values()
    starts = [b[0].start or 0 for b in blocks] if x.ndim else [0]
    stops = [x.shape[0] if b[0].stop is None else b[0].stop for b in blocks] if x.ndim else [0]
    lo, hi = min(starts), max(stops)
    if x.ndim and sum(stop - start for start, stop in set(zip(starts, stops))) == hi - lo:
        return jax.make_array_from_process_local_data(sharding, x[lo:hi], x.shape)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(tree: Any) -> Any:
    """Arrays as numpy on this host, also arrays spread over other processes' devices."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(allgather(x, "an array spread over the processes' devices", tiled=True))
        return np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x)

    return jax.tree.map(one, tree)
