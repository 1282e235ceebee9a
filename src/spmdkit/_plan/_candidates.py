"""The layouts the planner considers: mesh shapes x rules x remat policy x grad accumulation.

Each rules table names the mesh axes it uses; its meshes are the factorisations of the
device count over exactly those axes, each of size >= 2 (an axis of size 1 is another
table's layout again). The default tables are the rules presets, ``"hsdp+tp"`` among them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import product
from typing import Any, NamedTuple

from spmdkit._errors import fix
from spmdkit._rules import PRESETS, AxisRules, LayoutError, _as_tuple

DEFAULT_RULES = ("dp", "fsdp", "tp", "dp+tp", "fsdp+tp", "fsdp+sp", "hsdp+tp")
_AXIS_ORDER = ("data", "fsdp", "sequence", "model")


class Candidate(NamedTuple):
    mesh: tuple[tuple[str, int], ...]  # ordered (axis, size)
    rules: str
    remat: str
    accum: int

    @property
    def label(self) -> str:
        mesh = ",".join(f"{k}={v}" if v else k for k, v in self.mesh)  # size 0: a table no mesh fits
        extra = (f" remat={self.remat}" if self.remat != "none" else "") + (f" accum={self.accum}" if self.accum > 1 else "")
        return f"{self.rules} [{mesh}]{extra}"


# Rules tables given as dicts, by the name they are planned under (their inline form).
_GIVEN: dict[str, AxisRules] = {}


def _not_a_list_in_one_string(entry: str) -> None:
    """``rules="dp,tp"``, as ``--rules dp,tp`` is written: one entry to Python, which was refused as
    "--rules 'dp,tp' is neither a preset, a TOML file nor name=axis pairs", a flag the caller never used."""
    parts = [p.strip() for p in entry.split(",")]
    if len(parts) > 1 and all(p in PRESETS or p.endswith(".toml") for p in parts):
        raise LayoutError(fix(f"plan(rules={entry!r}) is one entry: a string is one rules table, and the commas "
                              "of the command line's --rules do not split it.",
                              f"pass the tables as a sequence: rules={tuple(parts)!r}."))


def rules_names(rules: Any) -> tuple[str, ...]:
    """``plan``'s ``rules`` as names: a lone string is one entry (not its characters); a dict
    (``{logical: mesh axis or None}``, as :class:`spmdkit.Sharded` takes) is kept under its
    inline form ``batch=data,embed=none``.

    >>> rules_names("dp"), rules_names(({"batch": "data", "embed": None},))
    (('dp',), ('batch=data,embed=none',))
    """
    if isinstance(rules, (str, Mapping, AxisRules)):
        rules = (rules,)
    if isinstance(rules, (bytes, bytearray, type)) or not isinstance(rules, Iterable):
        # Iterating these would fail with Python's own TypeError, or name a byte's value.
        kind = f"the class {rules.__name__}" if isinstance(rules, type) else type(rules).__name__
        raise LayoutError(fix(f"plan(rules={rules!r}): rules is {kind}, not a rules name, a dict or "
                              "a sequence of them.",
                              f'pass a name such as "dp", names such as ("dp", "fsdp+tp"), a dict such as '
                              f'{{"batch": "data", "hidden": "model"}} or an AxisRules instance; leave rules out for '
                              f"the default {DEFAULT_RULES}."))
    out = []
    for entry in rules:
        if isinstance(entry, Mapping):
            entry = AxisRules.from_mapping(entry)
        if isinstance(entry, AxisRules) and not entry.table:  # it was planned as " []": no axes, "8 devices cannot be split"
            raise LayoutError(fix("plan(rules=...) holds an empty rules table, which maps no logical name to a mesh axis.",
                                  'give it rules, e.g. {"batch": "data", "embed": "data"}, or drop it.'))
        if isinstance(entry, AxisRules):
            name = ",".join(f"{k}={'+'.join(_as_tuple(v)) or 'none'}" for k, v in entry.table)
            # replicate_unknown travels with the table (it was dropped: the names it was asked to
            # replicate pruned every candidate as "do not map"), and tells two tables apart.
            name += " (unknown names replicated)" if entry.replicate_unknown else ""
            _GIVEN[name] = entry
            entry = name
        if not isinstance(entry, str):
            raise LayoutError(fix(f"plan(rules=...): the entry {entry!r} is neither a rules name nor a dict.",
                                  'pass names such as ("dp", "fsdp+tp"), or dicts such as '
                                  '({"batch": "data", "hidden": "model"},).'))
        _not_a_list_in_one_string(entry)
        if entry in out:  # it would be compiled, priced and listed twice
            raise LayoutError(fix(f"plan(rules=...) lists {entry!r} twice.",
                                  f"list each rules table once: drop the second {entry!r}."))
        out.append(entry)
    if not out:
        raise LayoutError(fix("plan(rules=()) leaves no layout to compare.",
                              f'pass at least one rules name, e.g. rules=("dp", "fsdp"); the default is {DEFAULT_RULES}.'))
    return tuple(out)


def rules_table(name: str) -> AxisRules:
    """A planner rules name: a preset, a TOML file, inline pairs, or a table given as a dict."""
    if name in _GIVEN:
        return AxisRules(_GIVEN[name].table, name, _GIVEN[name].replicate_unknown)
    if name in PRESETS:
        return AxisRules.preset(name)
    return AxisRules.load(name)


def mesh_axes(rules: AxisRules) -> tuple[str, ...]:
    used = {a for _, axes in rules.table for a in _as_tuple(axes)}
    known = [a for a in _AXIS_ORDER if a in used]
    return tuple(known + sorted(used - set(known)))


def factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered ``k``-tuples of sizes >= 2 whose product is ``n`` (``()`` for k=0 and n=1)."""
    if k == 0:
        return [()] if n == 1 else []
    if k == 1:
        return [(n,)] if n >= 2 else []
    return [(d, *rest) for d in range(2, n + 1) if n % d == 0 for rest in factorisations(n // d, k - 1)]


def enumerate_candidates(n: int, rules: tuple[str, ...], remat: tuple[str, ...], accum: tuple[int, ...],
                         batch_size: int) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """``(candidates, pruned with reasons)`` before any compilation."""
    kept, pruned = [], []
    for name in rules:
        table = rules_table(name)
        axes = mesh_axes(table)
        shapes = factorisations(n, len(axes)) if n > 1 else [tuple(1 for _ in axes)]
        if not shapes:
            pruned.append((Candidate(tuple((a, 0) for a in axes), name, "none", 1),
                           f"{n} devices cannot be split over axes {list(axes)} with each axis >= 2"))
            continue
        batch_axes = _as_tuple(table.mapping.get("batch"))
        for sizes, r, a in product(shapes, remat, accum):
            cand = Candidate(tuple(zip(axes, sizes)), name, r, a)
            shards = 1
            for axis, size in cand.mesh:
                shards *= size if axis in batch_axes else 1
            if batch_size % (shards * a):
                pruned.append((cand, f"global batch {batch_size} is not divisible by {shards} batch shard(s) x "
                                     f"{a} accumulation step(s) = {shards * a}"))
                continue
            kept.append(cand)
    return kept, pruned
