"""A Task's loss and an optimizer as the functions a strategy compiles.

``fit`` is one user of ``strategy.step`` among others: it turns the task into
``make_state(rng)``, ``train_step(state, batch)`` and ``eval_step(state, batch)``,
single-device functions like any user's, and hands them to the strategy.

The loss always sees the real batch: an uneven global batch is not padded (the
strategy runs it whole, see ``Placement``), so a loss normalised by a count taken from
the batch (``sum(w * l) / sum(w)``) or a model with batch statistics is exact on a
partial batch, never 0/0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from spmdkit._errors import ConfigError, fix
from spmdkit._strategies._base import micro_batches, run_key
from spmdkit._tasks._base import LOSS_WEIGHT, Task
from spmdkit._types import Batch, TrainState


def task_state(task: Task, optimizer: optax.GradientTransformation) -> Callable[[jax.Array], TrainState]:
    """``make_state(rng)`` of the state ``fit`` trains: the task's parameters (and model
    state), the optimizer's state, step 0 and the run's key. Flax partitioning boxes are
    kept for the strategy's layout. Its abstract state is the target that a checkpoint of
    ``fit`` restores into, from Python:

    Example:
        >>> import optax, spmdkit
        >>> task, optimizer = spmdkit.get_task("linreg"), optax.sgd(0.1)
        >>> target = spmdkit.Single().abstract(spmdkit.task_state(task, optimizer), unbox=True)
        >>> sorted(target.params), target.step.shape
        (['bias', 'weight'], ())
        >>> # state, meta = spmdkit.Checkpointer(spmdkit.CheckpointConfig(run_dir)).restore(step, target)
    """

    def make_state(rng: jax.Array) -> TrainState:
        params, model_state = task.variables(rng)
        opt_state = optimizer.init(params)
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, model_state, run_key(rng))

    return make_state


def _grads(task: Task, params: Any, model_state: Any, batch: Batch, rng: jax.Array):
    def objective(p):
        loss, aux, new_state = task.train_loss(p, model_state, batch, rng)
        return loss, (loss, aux, new_state)

    return jax.grad(objective, has_aux=True)(params)


def _accumulated(task: Task, params: Any, model_state: Any, batch: Batch, rng: jax.Array, accum: int):
    """Mean gradient of ``accum`` equal micro-batches in a ``lax.scan`` (one at a time in
    memory); the model state (BatchNorm statistics) passes from one to the next. A loss
    that reports its denominator (``aux["loss_weight"]``) has each micro-batch weighted by
    it, which makes ``sum(w * l) / sum(w)`` the whole batch's; any other, by its rows."""
    parts = (micro_batches(batch, accum), jnp.arange(accum))
    first = jax.tree.map(lambda x: x[0], parts[0])
    shapes = jax.eval_shape(lambda: _grads(task, params, model_state, first, rng))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[0], shapes[1][0], shapes[1][1]))
    weighted = LOSS_WEIGHT in shapes[1][1]

    def body(carry, part):
        total, state = carry
        micro, i = part
        grads, (loss, aux, state) = _grads(task, params, state, micro, jax.random.fold_in(rng, i))
        if weighted:
            grads, loss, aux = _times_weight((grads, loss, aux), aux[LOSS_WEIGHT])
        return (jax.tree.map(jnp.add, total, (grads, loss, aux)), state), None

    (total, new_state), _ = jax.lax.scan(body, (zeros, model_state), parts)
    if weighted:
        grads, loss, aux = total
        weight = aux[LOSS_WEIGHT]
        grads, loss, aux = jax.tree.map(lambda t: (t / jnp.maximum(weight, 1e-30)).astype(t.dtype), (grads, loss, aux))
        return grads, (loss, {**aux, LOSS_WEIGHT: weight}, new_state)
    grads, loss, aux = jax.tree.map(lambda t: t / accum, total)
    return grads, (loss, aux, new_state)


def _times_weight(tree: Any, weight: jax.Array) -> Any:
    """Every leaf times the micro-batch's weight; all zeros for a weight of 0, whose means
    are 0/0 in the user's loss and must not turn the whole step's sums to NaN."""
    grads, loss, aux = tree
    scale = lambda t: jnp.where(weight > 0, t * weight, 0).astype(t.dtype)  # noqa: E731
    return jax.tree.map(scale, grads), scale(loss), {k: v if k == LOSS_WEIGHT else scale(v) for k, v in aux.items()}


def task_train_step(task: Task, optimizer: optax.GradientTransformation, accum: int = 1):
    """``train_step(state, batch) -> (state, {"loss": ..., metric: ...})`` for one device.

    With ``accum > 1`` a batch whose size is a multiple of ``accum`` is processed as that
    many micro-batches (rows k, k+accum, ...: every device holds a share of each); any
    other batch (an epoch's last) in one piece, which is the same gradient.
    """

    takes_value = _takes_extra_args(optimizer)

    def train_step(state: TrainState, batch: Batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        rows = jax.tree.leaves(batch)[0].shape[0]
        if accum > 1 and rows % accum == 0:
            grads, (loss, aux, model_state) = _accumulated(task, state.params, state.model_state, batch, rng, accum)
        else:
            grads, (loss, aux, model_state) = _grads(task, state.params, state.model_state, batch, rng)
        updates, opt_state = _update(optimizer, grads, state, {"value": loss} if takes_value else {})
        new = state._replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                             opt_state=opt_state, model_state=model_state)
        return new, {"loss": loss, **aux}

    return train_step


def _takes_extra_args(optimizer: Any) -> bool:
    """Whether ``update`` takes optax's extra arguments (``**extra_args``): then it gets the
    loss as ``value``, which ``reduce_on_plateau`` needs and the others ignore."""
    try:
        params = inspect.signature(optimizer.update).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _update(optimizer: Any, grads: Any, state: TrainState, extra: dict[str, Any]) -> tuple[Any, Any]:
    try:
        return optimizer.update(grads, state.opt_state, state.params, **extra)
    except TypeError as e:
        if "keyword-only argument" not in str(e):
            raise
        raise ConfigError(fix(
            f"the optimizer's update needs more than fit gives it ({e}): fit calls "
            "update(grads, opt_state, params, value=loss).",
            "for L-BFGS and other optimizers that evaluate the loss again, write your own train_step "
            "(it may call the loss as often as it likes) and run it with strategy.step.")) from None


def task_eval_step(task: Task, rng: jax.Array):
    """``eval_step(state, batch) -> {"loss": ..., metric: ...}``: means over the batch, eval mode."""
    key_data = jax.random.key_data(rng)

    def eval_step(state: TrainState, batch: Batch):
        loss, aux = task.eval_loss(state.params, state.model_state, batch, jax.random.wrap_key_data(key_data))
        return {"loss": loss, **aux}

    return eval_step
