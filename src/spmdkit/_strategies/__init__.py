"""Strategies: where state and batches live on the mesh. One module each."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import jax

from spmdkit._errors import ConfigError, MeshError, fix
from spmdkit._strategies._base import Predictor, Strategy, TrainState
from spmdkit._strategies.data import IMPLS, DataParallel
from spmdkit._strategies.ensemble import Ensemble, MembersMismatchError
from spmdkit._strategies.sharded import Layout, LeafLayout, Sharded, as_rules
from spmdkit._strategies.single import Single


@dataclass(frozen=True)
class StrategyOptions:
    """What the command line (and :func:`get_strategy`) can say about a strategy; each factory takes what it needs."""

    impl: str = "auto"
    members: int | None = None  # ensemble size; None: one per device
    bagging: bool = False
    # "data=2,model=4"; from Python also {"data": 2, "model": 4} or a Mesh. None: the strategy's default
    mesh: Any = None
    # preset, TOML file or "batch=data,hidden=model"; from Python also a dict, Flax's rule tuples or AxisRules
    rules: Any = None
    replicate_unknown: bool = False


def _mesh(given: Any, default: dict[str, int]):
    from jax.sharding import Mesh

    from spmdkit._mesh import make_mesh
    from spmdkit._rules import parse_mesh

    if isinstance(given, Mesh):
        return given
    if isinstance(given, Mapping):
        return make_mesh(**given)
    if isinstance(given, str) and not given.strip():  # taken as not given, the preset's mesh, without a word
        raise MeshError(fix(f"mesh={given!r} names no mesh axes.",
                            "pass mesh='data=2,model=4', or leave mesh out for the rules' preset mesh."))
    if given is None or isinstance(given, str):
        return make_mesh(**(parse_mesh(given) if given else default))
    raise MeshError(fix(f"mesh={given!r} is not a mesh.",
                        "pass mesh='data=2,model=4', {'data': 2, 'model': 4} or spmdkit.make_mesh(data=2, model=4)."))


def _sharded(o: StrategyOptions) -> Sharded:
    from spmdkit._rules import DEFAULT_MESH, AxisRules, LayoutError

    if isinstance(o.rules, str) and not o.rules.strip():  # taken as not given, the dp preset, without a word
        raise LayoutError(fix(f"rules={o.rules!r} names no rules.", "pass a preset (rules='fsdp+tp'), a TOML file "
                              "or logical=axis pairs, or leave rules out for 'dp'."))
    rules = o.rules or "dp"
    rules = AxisRules.load(rules, o.replicate_unknown) if isinstance(rules, str) else as_rules(rules)
    return Sharded(_mesh(o.mesh, DEFAULT_MESH.get(rules.name, {"data": -1})), rules,
                   replicate_unknown=o.replicate_unknown or None)


# name -> factory(options); adding a strategy is adding a module and a line here.
STRATEGIES: dict[str, Callable[[StrategyOptions], Strategy]] = {
    "single": lambda o: Single(),
    "data": lambda o: DataParallel(_mesh(o.mesh, {"data": -1}), impl=o.impl),
    "sharded": _sharded,
    "ensemble": lambda o: Ensemble(
        members=jax.device_count() if o.members is None else o.members, bagging=o.bagging
    ),
}


# The options each strategy takes; any other option given a non-default value is an error.
ACCEPTS: dict[str, tuple[str, ...]] = {
    "single": (),
    "data": ("impl", "mesh"),
    "sharded": ("mesh", "rules", "replicate_unknown"),
    "ensemble": ("members", "bagging"),
}


def get_strategy(name: str, impl: str = "auto", **options) -> Strategy:
    """A strategy by name, as ``spmdkit train --strategy NAME`` builds it.

    ``options`` are the fields of :class:`StrategyOptions` (members, mesh, rules...);
    one the strategy does not take is an error, not silently ignored. ``mesh`` is
    ``"data=2,model=4"``, ``{"data": 2, "model": 4}`` or a ``Mesh``; ``rules`` a preset
    name, a TOML file, ``"batch=data,hidden=model"``, a dict, Flax's rule tuples or
    :class:`spmdkit.AxisRules`.

    Example:
        >>> import spmdkit
        >>> spmdkit.get_strategy("data", members=4)
        Traceback (most recent call last):
        ...
        spmdkit._errors.ConfigError: get_strategy('data', members=4): strategy 'data' does not take members.
          Fix: drop members; strategy 'data' takes impl, mesh.
    """
    if name not in STRATEGIES:
        raise ConfigError(
            fix(f"strategy={name!r} is not known.", f"choose one of {sorted(STRATEGIES)}.")
        )
    known = {f.name for f in fields(StrategyOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(fix(f"get_strategy({name!r}): unknown option(s) {unknown}.", f"use only {sorted(known)}."))
    chosen = StrategyOptions(impl=impl, **options)
    defaults = StrategyOptions()
    given = {f.name: getattr(chosen, f.name) for f in fields(StrategyOptions)
             if getattr(chosen, f.name) != getattr(defaults, f.name)}
    wrong = [k for k in given if k not in ACCEPTS[name]]
    if wrong:
        call = ", ".join([repr(name)] + [f"{k}={v!r}" for k, v in given.items()])
        takes = ", ".join(ACCEPTS[name]) or "no options"
        raise ConfigError(
            fix(f"get_strategy({call}): strategy {name!r} does not take {', '.join(wrong)}.",
                f"drop {', '.join(wrong)}; strategy {name!r} takes {takes}.")
        )
    return STRATEGIES[name](chosen)


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
    "ACCEPTS",
    "TrainState",
    "get_strategy",
]
