"""Strategies: where state and batches live on the mesh. One module each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

from spmdkit._errors import ConfigError, fix
from spmdkit._strategies._base import Predictor, Strategy, TrainState
from spmdkit._strategies.data import IMPLS, DataParallel
from spmdkit._strategies.ensemble import Ensemble, MembersMismatchError
from spmdkit._strategies.sharded import Layout, LeafLayout, Sharded
from spmdkit._strategies.single import Single


@dataclass(frozen=True)
class StrategyOptions:
    """What the command line can say about a strategy; each factory takes what it needs."""

    impl: str = "auto"
    members: int | None = None  # ensemble size; None: one per device
    bagging: bool = False
    mesh: str | None = None  # "data=2,model=4"; None: the strategy's default
    rules: str | None = None  # preset, TOML file or "batch=data,hidden=model"
    replicate_unknown: bool = False


def _mesh(text: str | None, default: dict[str, int]):
    from spmdkit._mesh import make_mesh
    from spmdkit._rules import parse_mesh

    return make_mesh(**(parse_mesh(text) if text else default))


def _sharded(o: StrategyOptions) -> Sharded:
    from spmdkit._rules import DEFAULT_MESH, AxisRules

    rules = AxisRules.load(o.rules or "dp", replicate_unknown=o.replicate_unknown)
    return Sharded(_mesh(o.mesh, DEFAULT_MESH.get(rules.name, {"data": -1})), rules)


# name -> factory(options); adding a strategy is adding a module and a line here.
STRATEGIES: dict[str, Callable[[StrategyOptions], Strategy]] = {
    "single": lambda o: Single(),
    "data": lambda o: DataParallel(_mesh(o.mesh, {"data": -1}), impl=o.impl),
    "sharded": _sharded,
    "ensemble": lambda o: Ensemble(
        members=jax.device_count() if o.members is None else o.members, bagging=o.bagging
    ),
}


def get_strategy(name: str, impl: str = "auto", **options) -> Strategy:
    """A strategy by name, as ``spmdkit train --strategy NAME`` builds it.

    ``options`` are the fields of :class:`StrategyOptions` (members, mesh, rules...).
    """
    if name not in STRATEGIES:
        raise ConfigError(
            fix(f"strategy={name!r} is not known.", f"choose one of {sorted(STRATEGIES)}.")
        )
    return STRATEGIES[name](StrategyOptions(impl=impl, **options))


__all__ = [
    "IMPLS",
    "STRATEGIES",
    "DataParallel",
    "Ensemble",
    "Layout",
    "LeafLayout",
    "MembersMismatchError",
    "Predictor",
    "Sharded",
    "Single",
    "Strategy",
    "StrategyOptions",
    "TrainState",
    "get_strategy",
]
