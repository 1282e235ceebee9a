"""A task: what is trained. Model init + loss + data; nothing about devices."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from spmdkit._data import is_pipeline, resolve_train_data
from spmdkit._data._eval import resolve_eval_data
from spmdkit._errors import DataError, SignatureError, TaskError, fix
from spmdkit._types import LossFn, Params, Predictor


@dataclass(frozen=True)
class Task:
    """What to train: ``init(rng) -> params``, a single-device loss, and data.

    ``loss_fn(params, batch, rng) -> (loss, aux)`` returns the loss over the batch (any
    reduction: a mean, a token-weighted ``sum(w * l) / sum(w)``...) and a dict of
    metrics (e.g. ``{"accuracy": ...}``), written exactly as for one device. It always
    sees the real batch, never padding. A count-normalised loss ``sum(w * l) / sum(w)``
    returns its denominator as ``aux["loss_weight"]``: gradient accumulation and eval then
    weight each micro-batch and chunk by it (else by its rows). If it has a
    ``train`` parameter it is called with ``train=True`` in steps and ``train=False`` in
    eval (dropout off). ``eval_fn`` (same signature, no ``train``) replaces it in eval.

    A model with mutable variables (BatchNorm statistics) sets ``stateful=True``:
    ``init(rng) -> (params, model_state)`` and ``loss_fn(params, model_state, batch, rng,
    train) -> (loss, aux, new_model_state)``; the new state is kept after every step,
    checkpointed and written with the parameters. ``eval_fn(params, model_state, batch,
    rng) -> (loss, aux)``.

    Data sets are pytrees (usually dicts) of arrays sharing their leading (example)
    axis. ``train_data`` may also be a data set directory (:func:`spmdkit.write_dataset`;
    read lazily) or a pipeline of batches: a list, generator or iterator of batches, or
    a Grain ``MapDataset`` / ``IterDataset`` / ``DataLoader`` (``num_train`` is then None).
    ``eval_data`` takes the same, except that a pipeline must be finite and start over
    each time it is iterated (eval reads the whole set every ``eval_every`` steps); its
    last batch may be short. With several processes each reads only its rows of an
    eval set of arrays or a directory, and a pipeline yields each process's share.
    ``report(params)`` may add entries to the summary. ``defaults`` holds option
    values the task trains well with (``lr``, ``steps``...); flags and config files
    override them. ``predictor`` (classifiers) tells an ensemble how to average its
    members' probabilities and score the average. Each function's signature is checked
    when the task is made: one that cannot take what spmdkit calls it with is a
    :class:`spmdkit.SignatureError` then, not after training.

    Example:
        >>> import jax.numpy as jnp, numpy as np, spmdkit
        >>> x = np.linspace(-1, 1, 64, dtype=np.float32)
        >>> task = spmdkit.Task(
        ...     name="line",
        ...     init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
        ...     loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
        ...     train_data={"x": x, "y": 3 * x + 1},
        ... )
        >>> task.num_train
        64
    """

    name: str
    init: Callable[[jax.Array], Params]
    loss_fn: LossFn
    train_data: Any
    eval_data: Any = None
    report: Callable[[Params], dict[str, Any]] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    predictor: Predictor | None = None
    eval_fn: Callable[..., Any] | None = None
    stateful: bool = False

    def __post_init__(self) -> None:
        if not callable(self.init) or not callable(self.loss_fn):
            raise DataError(
                fix(
                    f"task {self.name!r}: init and loss_fn must be callables.",
                    "pass init=lambda rng: params and loss_fn=lambda params, batch, rng: (loss, aux).",
                )
            )
        self._check_signatures()
        train = resolve_train_data(self.train_data)
        if not is_pipeline(train):
            train = _as_numpy(train)
            check_examples(train, "train_data")
        object.__setattr__(self, "train_data", train)
        if self.eval_data is not None:
            object.__setattr__(self, "eval_data", resolve_eval_data(self.eval_data))
            if not is_pipeline(self.eval_data):
                check_examples(self.eval_data, "eval_data")

    def _check_signatures(self) -> None:
        """Each function takes what it will be called with: a report of the wrong shape
        was otherwise found only after the whole run had trained."""
        state = ("params", "model_state") if self.stateful else ("params",)
        loss_example = ("lambda params, model_state, batch, rng, train: (loss, {}, new_model_state)" if self.stateful
                        else "lambda params, batch, rng: (loss, {})")
        calls = [("init", self.init, ("rng",), "lambda rng: model.init(rng, x)"),
                 ("loss_fn", self.loss_fn, (*state, "batch", "rng"), loss_example)]
        if self.eval_fn is not None:
            calls.append(("eval_fn", self.eval_fn, (*state, "batch", "rng"), f"lambda {', '.join(state)}, batch, rng: (loss, {{}})"))
        if self.report is not None:
            if not callable(self.report):
                raise SignatureError(fix(f"task {self.name!r}: report is {type(self.report).__name__}, not a function.",
                                         "pass report=lambda params: {'w': float(params['w'])}, or leave it out."))
            calls.append(("report", self.report, ("params",), "lambda params: {'w': float(params['w'])}"))
        for name, fn, args, example in calls:
            train = {"train": True} if name == "loss_fn" and (self.stateful or _takes(fn, "train")) else {}
            try:
                inspect.signature(fn).bind(*args, **train)
            except TypeError:
                given = ", ".join([*args, *(f"{k}=..." for k in train)])
                raise SignatureError(fix(f"task {self.name!r}: spmdkit calls {name}({given}), which "
                                         f"{name}{inspect.signature(fn)} does not take.",
                                         f"pass {name}={example}"
                                         + (" (stateful=True: the model state comes second)." if self.stateful else "."))) from None
            except ValueError:
                pass  # no signature to read (a builtin): calling it will tell

    # ---- the task's functions in one shape, whatever form the user wrote them in ----
    def variables(self, rng: jax.Array) -> tuple[Params, Any]:
        """``(params, model_state)``; ``model_state`` is None for a stateless task."""
        out = self.init(rng)
        if not self.stateful:
            return out, None
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                fix(f"task {self.name!r} is stateful, so init(rng) must return (params, model_state); it "
                    f"returned {type(out).__name__}.",
                    "return e.g. (variables['params'], {'batch_stats': variables['batch_stats']}), "
                    "or set stateful=False.")
            )
        return out

    def train_loss(self, params: Params, model_state: Any, batch: Any, rng: jax.Array) -> tuple[Any, dict, Any]:
        """``(loss, aux, new model_state)`` of a training step."""
        train = {"train": True} if _takes(self.loss_fn, "train") or self.stateful else {}
        if self.stateful:
            out = self.loss_fn(params, model_state, batch, rng, **train)
            if not (isinstance(out, tuple) and len(out) == 3):
                raise TypeError(
                    fix(f"task {self.name!r} is stateful, so loss_fn must return (loss, aux, "
                        f"new_model_state); it returned {_describe(out)}.",
                        "return the loss, a dict of metrics and the updated model state.")
                )
            loss, aux = _loss_and_aux(out[:2], "loss_fn", self.name)
            return loss, aux, out[2]
        loss, aux = _loss_and_aux(self.loss_fn(params, batch, rng, **train), "loss_fn", self.name)
        return loss, aux, model_state

    def eval_loss(self, params: Params, model_state: Any, batch: Any, rng: jax.Array) -> tuple[Any, dict]:
        """``(loss, aux)`` in eval mode: ``eval_fn``, or ``loss_fn`` with ``train=False``."""
        state_args = (params, model_state) if self.stateful else (params,)
        if self.eval_fn is not None:
            return _loss_and_aux(self.eval_fn(*state_args, batch, rng), "eval_fn", self.name)
        if self.stateful:
            return _loss_and_aux(self.loss_fn(params, model_state, batch, rng, train=False)[:2], "loss_fn", self.name)
        train = {"train": False} if _takes(self.loss_fn, "train") else {}
        return _loss_and_aux(self.loss_fn(params, batch, rng, **train), "loss_fn", self.name)

    @property
    def num_train(self) -> int | None:
        """Examples in the training set; None for a pipeline (its length is its own)."""
        return None if is_pipeline(self.train_data) else num_examples(self.train_data)

    @property
    def num_eval(self) -> int | None:
        """Examples in the eval set; None for a pipeline (counted when it is read)."""
        if self.eval_data is None:
            return 0
        return None if is_pipeline(self.eval_data) else num_examples(self.eval_data)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())


def _describe(out: Any) -> str:
    if isinstance(out, tuple):
        return f"a tuple of {len(out)}"
    return f"{type(out).__name__} with shape {getattr(out, 'shape', '?')}"


# aux's key for a loss's denominator over its batch (the sum of weights, or of tokens):
# gradient accumulation and eval weight each micro-batch's and chunk's means by it, not by
# its rows, so a count-normalised loss sum(w * l) / sum(w) gets the whole batch's value.
LOSS_WEIGHT = "loss_weight"


def _loss_and_aux(out: Any, fn: str, task: str) -> tuple[Any, dict]:
    """A loss function's result as ``(scalar loss, {name: value})``; a bare scalar is a loss."""
    if hasattr(out, "shape") and not isinstance(out, tuple):
        loss, aux = out, {}
    elif isinstance(out, tuple) and len(out) == 2:
        loss, aux = out
    else:
        raise TaskError(
            fix(f"task {task!r}: {fn} returned {_describe(out)}; it must return the loss (a scalar) "
                "or (loss, {metric: value}).", "return loss, {} (or loss, {'accuracy': acc}).")
        )
    if getattr(loss, "shape", ()) != ():
        raise TaskError(
            fix(f"task {task!r}: {fn} returned a loss of shape {loss.shape}; the loss must be a scalar.",
                "reduce it over the batch, e.g. jnp.mean(per_example).")
        )
    if not isinstance(aux, Mapping):
        raise TaskError(
            fix(f"task {task!r}: {fn} returned aux of type {type(aux).__name__}; aux must be a dict of "
                "metrics.", "return loss, {'accuracy': acc} (or loss, {}).")
        )
    if LOSS_WEIGHT in aux and getattr(aux[LOSS_WEIGHT], "shape", ()) != ():
        raise TaskError(
            fix(f"task {task!r}: {fn} returned aux[{LOSS_WEIGHT!r}] of shape {aux[LOSS_WEIGHT].shape}; it is the "
                "loss's denominator over the batch (a scalar) that weights micro-batches and eval chunks.",
                f"return e.g. {{{LOSS_WEIGHT!r}: jnp.sum(w)}} for a loss sum(w * l) / sum(w).")
        )
    for name, value in aux.items():  # the mean over the eval set weighs each chunk's scalar by its rows
        if isinstance(value, Mapping) or np.shape(value) != ():
            shape = "is a dict" if isinstance(value, Mapping) else f"has shape {tuple(np.shape(value))}"
            raise TaskError(
                fix(f"task {task!r}: {fn}'s metric aux[{name!r}] {shape}; metrics are scalar means over the batch.",
                    f"return one scalar per key, e.g. aux['{name}_{next(iter(value), 'x')}'] = jnp.mean(...)"
                    if isinstance(value, Mapping) else f"return jnp.mean(...) for {name!r}.")
            )
    return loss, dict(aux)


def _as_numpy(data: Any) -> Any:
    return jax.tree.map(np.asarray, data)


def num_examples(data: Any) -> int:
    return int(jax.tree_util.tree_leaves(data)[0].shape[0])


def _in_a_list(path: tuple, x: Any) -> int | None:
    """Where in ``path`` the outermost list or tuple holding ``x`` sits, when ``x`` is a bare value."""
    if np.ndim(x) != 0 or not any(isinstance(k, jax.tree_util.SequenceKey) for k in path):
        return None
    return next(i for i, k in enumerate(path) if isinstance(k, jax.tree_util.SequenceKey))


def check_examples(data: Any, name: str) -> int:
    """Every leaf an array with the same number of examples; returns that number."""
    leaves = jax.tree_util.tree_flatten_with_path(data)[0]
    if not leaves:
        raise DataError(fix(f"{name} holds no arrays.", f"pass e.g. {name}={{'x': x, 'y': y}}."))
    sizes = []
    for path, x in leaves:
        where = name + jax.tree_util.keystr(path)
        listed = _in_a_list(path, x)
        if listed is not None:
            # Else "train_data['x'][0][0] is a scalar": a list is a pytree, each value a leaf.
            held, rest = name + jax.tree_util.keystr(path[:listed]), path[listed:]
            if all(isinstance(k, jax.tree_util.SequenceKey) for k in rest):
                raise DataError(fix(f"{held} is a Python list or tuple of values; spmdkit reads a list as a pytree "
                                    "node, each value a leaf of its own, not as an array.",
                                    f"pass np.asarray({held}) (one array per leaf, examples along axis 0)."))
            raise DataError(fix(f"{held} is a Python list or tuple of per-example records ({held}"
                                f"{jax.tree_util.keystr(rest)} is one value); spmdkit reads a list as a pytree node, "
                                "not as rows.",
                                f"stack the records per field: {{k: np.stack([r[k] for r in rows]) for k in rows[0]}} "
                                f"with rows = {held}."))
        if x.ndim == 0:
            raise DataError(
                fix(f"{where} is a scalar; every leaf needs a leading example axis.", f"reshape {where}.")
            )
        if not np.dtype(x.dtype).isnative:  # else a TaskError blamed loss_fn ("not a valid dtype for JAX")
            raise DataError(fix(f"{where} has dtype {np.dtype(x.dtype).str}, whose byte order is not this machine's; "
                                "JAX takes arrays in native byte order only.",
                                "convert it with x.astype(x.dtype.newbyteorder('=')) (the same values); a data set "
                                "directory: write it again with spmdkit.write_dataset, which stores native order."))
        sizes.append((where, x.shape[0]))
    first, n = sizes[0]
    for where, m in sizes[1:]:
        if m != n:
            raise DataError(
                fix(
                    f"{name} has arrays of different lengths: {first} has {n} examples, "
                    f"{where} has {m}.",
                    "give every array of a data set the same number of examples along axis 0.",
                )
            )
    if n == 0:
        raise DataError(fix(f"{name} has 0 examples.", "pass at least one example."))
    return n
