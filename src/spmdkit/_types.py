"""Shared types: the signatures of the functions users hand to spmdkit.

The ground floor of the house: tasks, strategies and the loop import these, and
this module imports nothing of spmdkit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

State = Any  # any pytree: a dict, a flax TrainState (subclass), nnx state, several optimizers
Batch = Any  # a pytree of arrays sharing their leading (example) axis
Aux = Any  # whatever a step returns next to the state (metrics, per-example values)
Params = Any

# make_state(rng) -> the initial state, written for one device (one ensemble member)
MakeState = Callable[[jax.Array], State]
# train_step(state, batch) -> (new state, aux): the single-device program on the global batch
TrainStepFn = Callable[[State, Batch], tuple[State, Aux]]
# apply_fn(state, batch) -> per-example outputs, every leaf [B, ...]
ApplyFn = Callable[[State, Batch], Any]
# loss_fn(params, batch, rng) -> (mean loss over the batch, {name: mean metric})
LossFn = Callable[[Params, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


class TrainState(NamedTuple):
    """The state ``fit`` trains: everything carried from one step to the next.

    ``model_state`` holds a model's mutable variables (BatchNorm statistics; None when it
    has none); ``rng`` the raw bits (``jax.random.key_data``) of the key the per-step
    randomness is drawn from (step s uses ``fold_in(key, s)``), so a resumed run draws
    what an uninterrupted one would.
    """

    step: jax.Array
    params: Params
    opt_state: Any
    model_state: Any = None
    rng: Any = None


class Predictor(NamedTuple):
    """How to combine models' outputs (ensembles): class probabilities and their scores.

    ``predict(params, batch) -> probabilities [B, C]``;
    ``score(probabilities, batch) -> {metric: per-example values [B]}``.
    """

    predict: Callable[[Params, Batch], jax.Array]
    score: Callable[[jax.Array, Batch], dict[str, jax.Array]]


def whole_number(value: object) -> int | None:
    """``value`` as an int if it is an integer, Python's or NumPy's (a sweep over
    ``np.arange`` gives ``np.int64``), not a bool; else None.

    >>> whole_number(np.int64(8)), whole_number(8.0), whole_number(True)
    (8, None, None)
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def finite_float(value: object) -> float | None:
    """``value`` as a float if it is a finite real number (not a bool), else None.

    >>> finite_float(10**400), finite_float(True), finite_float("0.1"), finite_float(3)
    (None, None, None, 3.0)
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None  # NumPy's numbers count: a sweep over np.logspace gives np.float32/64
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        return None
    return number if math.isfinite(number) else None
