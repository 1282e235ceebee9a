"""Check a user's Task before anything is traced, compiled or run.

Every check is abstract (``jax.eval_shape``: no FLOPs, no device memory), so a
wrong return type, a parameter of the wrong dtype or data that are not numbers are
named, with the fix, in milliseconds instead of as a JAX error from deep inside a
compiled step.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from spmdkit._data import is_pipeline
from spmdkit._errors import DataError, TaskError, fix
from spmdkit._tasks._base import Task
from spmdkit._train._hooks import ROW_FIELDS
from spmdkit._tree import abstract_rows


def _unbox(tree: Any) -> Any:
    # Flax's partitioning metadata (nn.Partitioned) wraps arrays; the loss sees them bare.
    boxed = lambda x: hasattr(x, "unbox") and callable(x.unbox)  # noqa: E731
    return jax.tree.map(lambda x: x.unbox() if boxed(x) else x, tree, is_leaf=boxed)


def _check_data(task: Task) -> None:
    for split, data in (("train_data", task.train_data), ("eval_data", task.eval_data)):
        if data is None or is_pipeline(data):  # a pipeline: checked per batch
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(data)[0]:
            kind = np.asarray(leaf).dtype.kind
            if kind not in "biufc":
                raise TaskError(fix(
                    f"task {task.name!r}: {split}{jax.tree_util.keystr(path)} has dtype "
                    f"{np.asarray(leaf).dtype} ({'strings' if kind in 'USO' else 'not numbers'}); "
                    "JAX trains on numeric arrays.",
                    "encode it as numbers first (e.g. token ids or one-hot floats)."))


def _train_kw(task: Task) -> dict[str, Any]:
    try:
        parameters = inspect.signature(task.loss_fn).parameters
    except (TypeError, ValueError):
        return {}
    return {"train": True} if "train" in parameters else {}


def _abstract_params(task: Task) -> Any:
    try:
        params = _unbox(jax.eval_shape(lambda k: task.variables(k)[0], jax.random.key(0)))
    except Exception as e:
        raise TaskError(fix(f"task {task.name!r}: init(rng) failed: {type(e).__name__}: {str(e)[:300]}",
                            "init takes one PRNG key and returns the parameter pytree.")) from None
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        raise TaskError(fix(f"task {task.name!r}: init(rng) returned {params!r}, which holds no arrays.",
                            "return the parameters, e.g. {'w': jnp.zeros(3)}."))
    for path, leaf in leaves:
        if not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact):
            raise TaskError(fix(
                f"task {task.name!r}: init(rng) returned parameter params{jax.tree_util.keystr(path)} of dtype "
                f"{leaf.dtype}; gradients need floating-point parameters.",
                "create it as a float, e.g. jnp.zeros(shape, jnp.float32) or jnp.asarray(x, float)."))
    return params


def validate_task(task: Task, batch_size: int, example: Any = None) -> None:
    """Raise :class:`TaskError` if ``task`` cannot be trained as written; trace nothing real.

    Example:
        >>> import jax.numpy as jnp, numpy as np, spmdkit
        >>> task = spmdkit.Task(name="t", init=lambda rng: {"w": jnp.zeros(())},
        ...                     loss_fn=lambda p, b, rng: jnp.mean(p["w"] * b["x"]),
        ...                     train_data={"x": np.ones(8, np.float32)})
        >>> validate_task(task, 4)
        Traceback (most recent call last):
        ...
        spmdkit._errors.TaskError: task 't': loss_fn returned a bare array of shape (); spmdkit needs a tuple (loss, aux).
          Fix: return a pair: return loss, {} (or return loss, {"accuracy": acc}).
    """
    # As the strategies trace it: an NNX model whose variables carry sharding annotations
    # (nnx.with_partitioning) needs a mesh to create them eagerly, and spmdkit lays them out itself.
    with nnx.use_eager_sharding(False):
        _validate(task, batch_size, example)


def _named(task: Task, out: Any) -> Any:
    """``out`` once its metrics' names are strings: an int key among them ({0: ..., "mae": ...})
    failed in JAX's sorting of the dict's keys, an error that named neither the metrics nor why."""
    aux = out[1] if isinstance(out, tuple) and len(out) >= 2 else None

    def walk(tree: Any, path: str) -> None:
        if not isinstance(tree, Mapping):
            return
        for key, value in tree.items():
            if not isinstance(key, str):
                raise TaskError(fix(
                    f"task {task.name!r}: loss_fn's metrics (its aux) have a key {key!r} ({type(key).__name__}) at "
                    f"aux{path}: metric names are strings, the columns of metrics.jsonl.",
                    f"name it with a string, e.g. {f'class_{key}'!r}: ... in place of {key!r}: ..."))
            walk(value, f"{path}[{key!r}]")

    walk(aux, "")
    return out


def _validate(task: Task, batch_size: int, example: Any) -> None:
    _check_data(task)
    params = _abstract_params(task)
    if example is None:  # ``example``: the abstract first batch (a pipeline's, read by the loop)
        n = min(batch_size, task.num_train)
        example = jax.tree.map(lambda x: abstract_rows(x, n), task.train_data)
    batch, n = example, jax.tree.leaves(example)[0].shape[0]
    try:
        if task.stateful:
            model_state = jax.eval_shape(lambda k: task.variables(k)[1], jax.random.key(0))
            out = jax.eval_shape(lambda p, s, b, k: _named(task, task.loss_fn(p, s, b, k, train=True)), params,
                                 model_state, batch, jax.random.key(0))
        else:
            out = jax.eval_shape(lambda p, b, k: _named(task, task.loss_fn(p, b, k, **_train_kw(task))), params,
                                 batch, jax.random.key(0))
    except TaskError:
        raise
    except Exception as e:
        # The call as spmdkit made it: a stateful task's loss takes the model state and train too.
        call, check = (("loss_fn(params, model_state, batch, rng, train=True)",
                        "params, model_state = task.variables(jax.random.key(0)); "
                        "task.loss_fn(params, model_state, batch, key, train=True)") if task.stateful else
                       ("loss_fn(params, batch, rng)", "task.loss_fn(task.init(jax.random.key(0)), batch, key)"))
        raise TaskError(fix(
            f"task {task.name!r}: {call} failed on a batch of {n}: {type(e).__name__}: {str(e)[:400]}",
            f"check it on one device first: {check}.")) from None
    if task.stateful:
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TaskError(fix(f"task {task.name!r} is stateful: loss_fn must return (loss, aux, new_model_state).",
                                "return loss, {}, new_model_state."))
        out = out[:2]
    if not (isinstance(out, tuple) and len(out) == 2):
        what = (f"a bare array of shape {tuple(out.shape)}" if hasattr(out, "shape")
                else f"a {type(out).__name__} of {len(out)}" if isinstance(out, (list, tuple)) else repr(out)[:80])
        raise TaskError(fix(f"task {task.name!r}: loss_fn returned {what}; spmdkit needs a tuple (loss, aux).",
                            'return a pair: return loss, {} (or return loss, {"accuracy": acc}).'))
    loss, aux = out
    if not hasattr(loss, "shape") or loss.shape != () or not jax.numpy.issubdtype(loss.dtype, jax.numpy.floating):
        shape = getattr(loss, "shape", None)
        raise TaskError(fix(
            f"task {task.name!r}: loss_fn's loss has shape {shape} and dtype {getattr(loss, 'dtype', type(loss))}; "
            "it must be a float scalar (the mean over the batch).",
            "return jnp.mean(per_example_losses), not the per-example array."))
    if not isinstance(aux, Mapping):
        raise TaskError(fix(f"task {task.name!r}: loss_fn's aux is a {type(aux).__name__}; it must be a dict of "
                            "scalar metrics.", 'return loss, {} or loss, {"accuracy": acc}.'))
    _check_metric_names(task, aux, "loss_fn")
    for name, value in aux.items():
        if getattr(value, "shape", None) != ():
            raise TaskError(fix(
                f"task {task.name!r}: metric aux[{name!r}] has shape {getattr(value, 'shape', type(value))}; "
                "metrics are scalar means over the batch.", f"return jnp.mean(...) for {name!r}."))
    eval_batch = _eval_example(task, batch_size)
    _check_eval(task, params, eval_batch)
    _check_predictor(task, params, eval_batch)


def _eval_example(task: Task, batch_size: int) -> Any:
    """An abstract eval batch: of the eval arrays, or a pipeline's first batch (an eval pipeline
    starts over each time it is iterated, so reading one costs the eval nothing but the read).
    Unchecked, a pipeline that did not fit the model failed at the first eval, after the steps,
    with the loss's raw KeyError and no summary or parameters written. None when there is no
    eval set or the first batch's leaves are not arrays (evaluation names them)."""
    if task.eval_data is None:
        return None
    if not is_pipeline(task.eval_data):
        n = min(batch_size, task.num_eval)
        return jax.tree.map(lambda x: abstract_rows(x, n), task.eval_data)
    first = _first_eval_batch(task.eval_data)
    try:
        leaves, treedef = jax.tree.flatten(first)
        shapes = [jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))
                  for x in leaves]
    except Exception:  # noqa: BLE001 - leaves that are not arrays: the eval's own checks name them
        return None
    if not leaves or any(s.ndim == 0 or s.dtype.kind not in "biufc" for s in shapes):
        return None
    return jax.tree.unflatten(treedef, shapes)


def per_example_scores(scores: Any, rows: int, where: str) -> None:
    """Raise :class:`TaskError` unless ``scores`` (a predictor's ``score`` output, concrete or
    abstract) holds one value per example: the ensemble metrics sum them and divide by the eval
    set's size, so a mean returned here came out divided by the rows, silently (0.06 for 0.83)."""
    if not isinstance(scores, Mapping):
        raise TaskError(fix(f"{where}: predictor.score returned a {type(scores).__name__}; it must be a "
                            "dict of per-example values.", "return e.g. {'accuracy': (argmax(probs, -1) == label)}."))
    for name, value in scores.items():
        if tuple(np.shape(value)) != (rows,):
            raise TaskError(fix(
                f"{where}: predictor.score's {name!r} has shape {tuple(np.shape(value))} on a batch of "
                f"{rows}; it must give one value per example, shape ({rows},) (spmdkit averages them over the eval set).",
                f"return the per-example values for {name!r}, without the mean: e.g. "
                "(jnp.argmax(probs, -1) == batch['label']).astype(jnp.float32)."))


def _first_eval_batch(data: Any) -> Any:
    """The first batch of an eval pipeline; one that is empty or fails to read is named now, not
    at the first eval after the steps (a Grain loader's workers without absl's flags parsed, a
    missing file)."""
    try:
        return next(iter(data))
    except StopIteration:
        raise DataError(fix("eval_data yielded no batch.", "pass an eval set with at least one example.")) from None
    except Exception as e:
        raise DataError(fix(f"eval_data raised {type(e).__name__} reading its first batch (read before training, "
                            f"to check it fits the model): {e}", "fix the eval pipeline.")) from e


def _check_predictor(task: Task, params: Any, batch: Any) -> None:
    """A predictor's score gives one value per example (abstractly, before training)."""
    if task.predictor is None or batch is None:
        return
    n = jax.tree.leaves(batch)[0].shape[0]
    try:
        scores = jax.eval_shape(lambda p, b: task.predictor.score(task.predictor.predict(p, b), b), params, batch)
    except Exception as e:
        raise TaskError(fix(f"task {task.name!r}: predictor.score(predictor.predict(params, batch), batch) failed on "
                            f"an eval batch of {n}: {type(e).__name__}: {str(e)[:300]}",
                            "predict returns probabilities [B, C]; score returns {metric: per-example values [B]}."
                            )) from None
    per_example_scores(scores, n, f"task {task.name!r}")


def _check_metric_names(task: Task, aux: Mapping[str, Any], fn: str) -> None:
    """fit reports the loss as "loss" and writes rows with ``ROW_FIELDS``: a metric of one of
    those names replaced the value there (or was replaced), silently."""
    reserved = sorted(set(aux) & {"loss", *ROW_FIELDS})
    if reserved:
        raise TaskError(fix(
            f"task {task.name!r}: {fn}'s aux has metric(s) {reserved}, names fit gives the loss and the fields of "
            f"every metrics row ('loss', {', '.join(map(repr, ROW_FIELDS))}); one of the two values would be lost.",
            f"rename them in aux, e.g. {reserved[0]!r} -> 'my_{reserved[0]}'."))


def _check_eval(task: Task, params: Any, batch: Any) -> None:
    """The eval set fits the model (abstractly), so a mismatch is named before training,
    not at the first eval. A pipeline's later batches are checked against its first as read."""
    if batch is None:
        return
    model_state = jax.eval_shape(lambda k: task.variables(k)[1], jax.random.key(0)) if task.stateful else None
    try:
        _, aux = jax.eval_shape(lambda p, s, b, k: task.eval_loss(p, s, b, k), params, model_state, batch,
                                jax.random.key(0))
    except TaskError:  # it ran, and returned what spmdkit cannot take: its own message and fix
        raise
    except Exception as e:
        raise TaskError(fix(
            f"task {task.name!r}: {'eval_fn' if task.eval_fn else 'loss_fn'} fails on eval_data, whose examples "
            f"are {_shapes(batch)} (training examples: "
            f"{_shapes(task.train_data) if task.num_train else 'from a pipeline'}): {type(e).__name__}: {str(e)[:300]}",
            "give eval_data the leaves and per-example shapes of train_data (the model evaluates what it trains on)."
        )) from None
    if isinstance(aux, Mapping):
        _check_metric_names(task, aux, "eval_fn" if task.eval_fn else "loss_fn")


def _shapes(tree: Any) -> str:
    return ", ".join(f"{jax.tree_util.keystr(p)} {tuple(np.shape(x)[1:])}" for p, x in
                     jax.tree_util.tree_flatten_with_path(tree)[0])
