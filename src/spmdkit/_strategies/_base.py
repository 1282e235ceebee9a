"""What every strategy shares: the contract, placement helpers, and the loss-based path.

A strategy decides where a state and the batches live on the devices and compiles the
user's functions (``_compile.Placement``); it knows nothing of the task. The loop calls
only what :class:`Strategy` lists. The functions below ``init_train_state`` serve the
older loss-based methods (``init_state``/``train_step``/``eval_step``), which the
benchmarks and ``spmdkit inspect`` still call; ``fit`` does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta

from spmdkit._types import Batch, LossFn, Params, Predictor, TrainState  # noqa: F401 (re-exported)

# step(state, batch, mask or None, rng) -> (new state, {name: scalar})
StepFn = Callable[..., tuple["TrainState", dict[str, jax.Array]]]
# eval(params, batch, mask or None, rng) -> {"count": n, "loss": sum, name: sum, ...}
EvalFn = Callable[..., dict[str, jax.Array]]


class Strategy(Protocol):
    """Where a state and batches live on a mesh, and the user's functions compiled there.

    A strategy knows nothing of tasks, losses or optimizers. ``fit`` uses only this
    contract (plus ``summarize``/``member_params`` where an ensemble has them).
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


def init_train_state(init_fn: Callable[[jax.Array], Params], optimizer: optax.GradientTransformation, key: jax.Array) -> TrainState:
    """One model's fresh state, with Flax partitioning boxes removed.

    Strategies jit it with ``init_fn`` and ``optimizer`` static, so the same task and
    optimizer compile once, whatever the key. Layout metadata (``nn.with_partitioning``)
    is read from the boxed abstract state (:func:`boxed_abstract_state`), not kept in
    the arrays.
    """
    params = meta.unbox(init_fn(key))
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), None, run_key(key))


def run_key(key: jax.Array) -> jax.Array:
    """The raw bits of a model's per-step key, derived from its init key (so ensemble
    members, initialised from different keys, also draw different dropout masks)."""
    return jax.random.key_data(jax.random.fold_in(key, 0x5EED))


def boxed_abstract_state(init_fn: Callable[[jax.Array], Params], optimizer: optax.GradientTransformation) -> TrainState:
    """Shapes of the train state with Flax's partitioning boxes kept (no memory used)."""

    def boxed(key):
        params = init_fn(key)
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), None, run_key(key))

    return jax.eval_shape(boxed, jax.random.key(0))


def micro_batches(tree: Any, accum: int) -> Any:
    """``[B, ...]`` -> ``[accum, B/accum, ...]``; micro-batch k takes rows k, k+accum, ...

    Interleaved rather than in blocks so that, when B is split over devices in
    contiguous blocks, every device holds an equal share of every micro-batch.
    """
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 0, 1), tree)


def accumulated_sum_grads(loss_fn: LossFn, accum: int):
    """``(params, batch, mask, rng) -> (gradient of the loss SUM, (loss sum, aux sums, count))``
    over ``accum`` micro-batches in a ``lax.scan``: the activations of one micro-batch at a
    time, one gradient for the whole batch (and so one all-reduce per step)."""

    def sum_grads(params, batch, mask, rng):
        def objective(p):
            s, a, c = masked_sums(loss_fn, p, batch, mask, rng)
            return s, (s, a, c)

        return jax.grad(objective, has_aux=True)(params)

    def run(params, batch, mask, rng):
        parts = (micro_batches(batch, accum), None if mask is None else micro_batches(mask, accum), jnp.arange(accum))
        zero = jax.eval_shape(sum_grads, params, jax.tree.map(lambda x: x[0], parts[0]),
                              None if mask is None else parts[1][0], rng)
        init = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zero)

        def body(total, part):
            b, m, i = part
            out = sum_grads(params, b, m, jax.random.fold_in(rng, i))
            return jax.tree.map(jnp.add, total, out), None

        return jax.lax.scan(body, init, parts)[0]

    return run


def update_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, grads_and_sums=None, accum: int = 1):
    """The pure train step ``(state, batch, mask, rng) -> (state, metrics)``.

    ``grads_and_sums(params, batch, mask, rng)`` defaults to the gradient of the
    masked global mean; the shard_map implementation passes its own. With ``accum > 1``
    the batch is processed as that many micro-batches (gradient accumulation).
    """

    def global_mean(params, batch, mask, rng):
        def objective(p):
            s, a, c = masked_sums(loss_fn, p, batch, mask, rng)
            return s / c, (s, a, c)

        return jax.grad(objective, has_aux=True)(params)

    def accumulated_mean(params, batch, mask, rng):
        grads, (s, a, c) = accumulated_sum_grads(loss_fn, accum)(params, batch, mask, rng)
        return jax.tree.map(lambda g: g / c, grads), (s, a, c)

    grads_and_sums = grads_and_sums or (accumulated_mean if accum > 1 else global_mean)

    def step(state: TrainState, batch, mask, rng):
        grads, sums = grads_and_sums(state.params, batch, mask, rng)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state._replace(step=state.step + 1, params=params, opt_state=opt_state), as_metrics(*sums)

    return step


def eval_sums(loss_fn: LossFn):
    """The pure eval step ``(params, batch, mask, rng) -> sums`` over the real examples."""

    def evaluate(params, batch, mask, rng):
        return as_sums(*masked_sums(loss_fn, params, batch, mask, rng))

    return evaluate


def with_sharding(shapes: Any, sharding: Any) -> Any:
    """ShapeDtypeStructs of ``shapes`` placed by ``sharding`` (one, or a matching tree)."""
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, sharding)


def place_batch(batch: Batch, size: int | None, shards: int, sharding: Any) -> tuple[Batch, jax.Array | None]:
    """Pad a host batch to ``size`` rounded up to ``shards`` rows, then place it."""
    n = jax.tree_util.tree_leaves(batch)[0].shape[0]
    batch, mask = pad_batch(batch, padded_size(max(n, size or n), shards))
    return put_global(batch, sharding), None if mask is None else put_global(mask, sharding)


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
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x)

    return jax.tree.map(one, tree)


class OneModel:
    """The Strategy methods of strategies that train a single model (data, sharded)."""

    def host_params(self, state: TrainState) -> Params:
        return to_host(state.params)

    def member_params(self, params: Params) -> list[Params]:
        return [params]

    def summarize(self, eval_metrics: dict[str, Any]) -> dict[str, Any]:
        return {}


def padded_size(size: int, shards: int) -> int:
    return -(-size // shards) * shards


def pad_batch(batch: Batch, size: int) -> tuple[Batch, np.ndarray | None]:
    """Zero-pad every leaf to ``size`` rows; the mask is None when nothing was padded."""
    n = jax.tree_util.tree_leaves(batch)[0].shape[0]
    if n == size:
        return batch, None
    pad = lambda x: np.concatenate([x, np.zeros((size - n, *x.shape[1:]), x.dtype)])  # noqa: E731
    return jax.tree.map(pad, batch), np.arange(size) < n


def masked_sums(loss_fn: LossFn, params: Params, batch: Batch, mask: jax.Array | None, rng: jax.Array):
    """``(loss sum, {metric: sum}, example count)`` over the real examples of a batch.

    Without a mask the user's ``loss_fn`` sees the whole batch, exactly as on one
    device. With a mask (a padded batch) it is applied to each example alone
    (``vmap`` over batches of one, example ``i`` with ``fold_in(rng, i)``) and the
    padded rows are weighted 0: exact for any loss that is a mean of per-example
    terms, which is what makes the mean of an uneven batch right.
    """
    if mask is None:
        count = jax.tree_util.tree_leaves(batch)[0].shape[0]
        loss, aux = loss_fn(params, batch, rng)
        return loss * count, jax.tree.map(lambda a: a * count, aux), jnp.float32(count)

    def one(example, i):
        return loss_fn(params, jax.tree.map(lambda x: x[None], example), jax.random.fold_in(rng, i))

    n = mask.shape[0]
    losses, aux = jax.vmap(one)(batch, jnp.arange(n))
    w = mask.astype(losses.dtype)
    return jnp.sum(losses * w), jax.tree.map(lambda a: jnp.sum(a * w), aux), jnp.sum(w)


def as_metrics(loss_sum, aux_sums, count) -> dict[str, jax.Array]:
    return {"loss": loss_sum / count, **{k: v / count for k, v in aux_sums.items()}}


def as_sums(loss_sum, aux_sums, count) -> dict[str, jax.Array]:
    return {"count": count, "loss": loss_sum, **aux_sums}
