"""A task: what is trained. Model init + loss + data; nothing about devices."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from spmdkit._errors import DataError, fix
from spmdkit._types import LossFn, Params, Predictor


@dataclass(frozen=True)
class Task:
    """What to train: ``init(rng) -> params``, a single-device loss, and data.

    ``loss_fn(params, batch, rng) -> (loss, aux)`` returns the *mean* loss over the
    batch and a dict of mean metrics (e.g. ``{"accuracy": ...}``), written exactly as
    for one device. Data sets are pytrees (usually dicts) of arrays sharing their
    leading (example) axis. ``report(params)`` may add entries to the summary.
    ``defaults`` holds option values the task trains well with (``lr``, ``steps``...);
    flags and config files override them. ``predictor`` (classifiers) tells an
    ensemble how to average its members' probabilities and score the average.

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

    def __post_init__(self) -> None:
        if not callable(self.init) or not callable(self.loss_fn):
            raise DataError(
                fix(
                    f"task {self.name!r}: init and loss_fn must be callables.",
                    "pass init=lambda rng: params and loss_fn=lambda params, batch, rng: (loss, aux).",
                )
            )
        object.__setattr__(self, "train_data", _as_numpy(self.train_data))
        check_examples(self.train_data, "train_data")
        if self.eval_data is not None:
            object.__setattr__(self, "eval_data", _as_numpy(self.eval_data))
            check_examples(self.eval_data, "eval_data")

    @property
    def num_train(self) -> int:
        return num_examples(self.train_data)

    @property
    def num_eval(self) -> int:
        return 0 if self.eval_data is None else num_examples(self.eval_data)


def _as_numpy(data: Any) -> Any:
    return jax.tree.map(np.asarray, data)


def num_examples(data: Any) -> int:
    return int(jax.tree_util.tree_leaves(data)[0].shape[0])


def check_examples(data: Any, name: str) -> int:
    """Every leaf an array with the same number of examples; returns that number."""
    leaves = jax.tree_util.tree_flatten_with_path(data)[0]
    if not leaves:
        raise DataError(fix(f"{name} holds no arrays.", f"pass e.g. {name}={{'x': x, 'y': y}}."))
    sizes = []
    for path, x in leaves:
        where = name + jax.tree_util.keystr(path)
        if x.ndim == 0:
            raise DataError(
                fix(f"{where} is a scalar; every leaf needs a leading example axis.", f"reshape {where}.")
            )
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
