"""Strategies: where state and batches live on the mesh. One module each."""

from __future__ import annotations

from collections.abc import Callable

from spmdkit._errors import ConfigError, fix
from spmdkit._strategies._base import Strategy, TrainState
from spmdkit._strategies.data import IMPLS, DataParallel
from spmdkit._strategies.single import Single

# name -> factory(impl) ; adding a strategy is adding a module and a line here.
STRATEGIES: dict[str, Callable[[str], Strategy]] = {
    "single": lambda impl: Single(),
    "data": lambda impl: DataParallel(impl=impl),
}


def get_strategy(name: str, impl: str = "jit") -> Strategy:
    if name not in STRATEGIES:
        raise ConfigError(
            fix(f"strategy={name!r} is not known.", f"choose one of {sorted(STRATEGIES)}.")
        )
    return STRATEGIES[name](impl)


__all__ = ["IMPLS", "STRATEGIES", "DataParallel", "Single", "Strategy", "TrainState", "get_strategy"]
