"""Strategies: where state and batches live on the mesh. One module each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

from spmdkit._errors import ConfigError, fix
from spmdkit._strategies._base import Predictor, Strategy, TrainState
from spmdkit._strategies.data import IMPLS, DataParallel
from spmdkit._strategies.ensemble import Ensemble, MembersMismatchError
from spmdkit._strategies.single import Single


@dataclass(frozen=True)
class StrategyOptions:
    """What the command line can say about a strategy; each factory takes what it needs."""

    impl: str = "jit"
    members: int | None = None  # ensemble size; None: one per device
    bagging: bool = False


# name -> factory(options); adding a strategy is adding a module and a line here.
STRATEGIES: dict[str, Callable[[StrategyOptions], Strategy]] = {
    "single": lambda o: Single(),
    "data": lambda o: DataParallel(impl=o.impl),
    "ensemble": lambda o: Ensemble(
        members=jax.device_count() if o.members is None else o.members, bagging=o.bagging
    ),
}


def get_strategy(name: str, impl: str = "jit", *, members: int | None = None, bagging: bool = False) -> Strategy:
    """A strategy by name, as ``spmdkit train --strategy NAME`` builds it."""
    if name not in STRATEGIES:
        raise ConfigError(
            fix(f"strategy={name!r} is not known.", f"choose one of {sorted(STRATEGIES)}.")
        )
    return STRATEGIES[name](StrategyOptions(impl=impl, members=members, bagging=bagging))


__all__ = [
    "IMPLS",
    "STRATEGIES",
    "DataParallel",
    "Ensemble",
    "MembersMismatchError",
    "Predictor",
    "Single",
    "Strategy",
    "StrategyOptions",
    "TrainState",
    "get_strategy",
]
