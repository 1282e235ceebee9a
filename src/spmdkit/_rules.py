"""Logical axis rules: the vocabulary that maps a model's axis names to mesh axes.

A model names its array dimensions logically (``batch``, ``embed``, ``hidden``,
``layer``); a rules table says which mesh axis, if any, shards each name. Rules are
data: presets, a ``--rules`` string or a TOML file of ``logical = "mesh-axis"``
pairs. Changing the layout never means touching the model. An unknown logical name
is an error (never a silent replication) unless the caller opts into replication.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from jax.sharding import Mesh, PartitionSpec as P

from spmdkit._errors import SpmdkitError, fix

MeshAxes = str | tuple[str, ...] | None


class LayoutError(SpmdkitError, ValueError):
    """Rules, mesh and parameters do not fit together; the message names the leaf."""


class ReplicationWarning(UserWarning):
    """Most of the state's memory is fully replicated on every device."""


def _norm(value: Any, where: str) -> MeshAxes:
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    if isinstance(value, str) and not value.replace("-", "_").isidentifier():
        # As the command line's pairs are checked: "" replicated the name without a word (an
        # unfinished edit, hidden = "" in a rules file), and "data,model" made one mesh axis of that name.
        raise LayoutError(fix(f"{where}: {value!r} names no mesh axis.",
                              'write a mesh axis name ("model"), a list of them (["data", "fsdp"]), or "none" '
                              "(None in a dict) to replicate."))
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        for axis in value:
            _norm(axis, where)
        return tuple(value) if len(value) != 1 else value[0]
    raise LayoutError(
        fix(f"{where}: {value!r} is not a mesh axis.", 'write a mesh axis name ("model"), a list of them, or "none".')
    )


def _check_rules_file(data: dict[str, Any], spec: str) -> None:
    """A TOML rules file's top level is the table. An empty file made one candidate excluded for
    "4 devices cannot be split over axes []"; a ``[rules]`` section was "rule 'rules': {...} is
    not a mesh axis", naming neither the file nor the section."""
    how = 'write one line per logical name at the top level of the file: batch = "data", hidden = "model".'
    if not data:
        raise LayoutError(fix(f"rules file {spec!r} has no rules.", how))
    for key, value in data.items():
        if isinstance(value, dict):
            raise LayoutError(fix(f"rules file {spec!r}: [{key}] is a section; the rules are read from the top level "
                                  "only.", f"remove the [{key}] line: {how}"))


def _inline_pair(part: str, spec: str) -> tuple[str, str]:
    """One ``logical=axis`` of an inline table. An empty side, a second ``=`` or a space in the
    axis was taken as written: ``hidden=`` replicated hidden without a word and
    ``batch=data=model`` made a mesh axis named "data=model" (candidates ``[data=model=4]``)."""
    k, eq, v = (x.strip() for x in part.partition("="))
    if not eq or not k:
        name, axis = k or "hidden", (v if eq and v else "model")  # "=data" lacks the logical name, not the axis
        raise LayoutError(fix(f"rules {spec!r}: {part.strip()!r} is not logical=axis; a bare name would silently "
                              "mean nothing.", f"write {name}={axis} to shard it, or {name}=none to replicate it."))
    if not v or not v.replace("-", "_").isidentifier():
        raise LayoutError(fix(f"rules {spec!r}: {part.strip()!r} maps {k!r} to {v!r}, which is no mesh axis name.",
                              f"write {k}=model to shard it, or {k}=none to replicate it (pairs are separated by "
                              "commas; a name over two axes needs a TOML file: name = [\"data\", \"fsdp\"])."))
    return k, v


def _inline_pairs(spec: str) -> dict[str, str]:
    """``batch=data,hidden=model`` as a dict, each logical name once."""
    pairs: dict[str, str] = {}
    for part in spec.split(","):
        k, v = _inline_pair(part, spec)
        if k in pairs:
            raise LayoutError(fix(f"rules {spec!r}: {k!r} is given twice.", "give each logical name once."))
        pairs[k] = v
    return pairs


@dataclass(frozen=True)
class AxisRules:
    """An ordered table ``logical name -> mesh axis (or axes, or None)``.

    Example:
        >>> rules = AxisRules.preset("dp+tp")
        >>> rules.spec(("batch", "hidden"))
        P('data', 'model')
    """

    table: tuple[tuple[str, MeshAxes], ...]
    name: str = "custom"
    replicate_unknown: bool = False

    def __post_init__(self) -> None:
        table = self.table
        if isinstance(table, Mapping):  # AxisRules({"batch": "data"}) reads as the table it says
            table = tuple(table.items())
        entries = []
        for entry in table if isinstance(table, (tuple, list)) else [table]:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)):
                raise LayoutError(fix(f"AxisRules: {entry!r} is not a rule (logical name, mesh axes).",
                                      'pass a dict {"batch": "data", "hidden": "model"} or pairs (("batch", "data"),).'))
            axes = _norm(entry[1], f"rule {entry[0]!r}")
            if len(set(_as_tuple(axes))) != len(_as_tuple(axes)):
                raise LayoutError(fix(f"rule {entry[0]!r} -> {axes!r} names a mesh axis twice.",
                                      f"name each axis once, e.g. {entry[0]!r}: {_as_tuple(axes)[0]!r}."))
            entries.append((entry[0], axes))
        object.__setattr__(self, "table", tuple(entries))
        if not isinstance(self.replicate_unknown, bool):
            raise LayoutError(fix(f"AxisRules(replicate_unknown={self.replicate_unknown!r}) must be True or False.",
                                  "e.g. replicate_unknown=True (--replicate-unknown)."))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], name: str = "custom", replicate_unknown: bool = False) -> AxisRules:
        if not isinstance(mapping, Mapping):
            raise LayoutError(fix(f"AxisRules.from_mapping({mapping!r:.80}): needs a dict of logical name -> mesh axes.",
                                  'e.g. {"batch": "data", "hidden": "model"}; for pairs use spmdkit.AxisRules(pairs).'))
        for k in mapping:
            if not isinstance(k, str):  # str(k) made {1: "data"} a rule for the name "1", matching nothing
                raise LayoutError(fix(f"rules: the key {k!r} ({type(k).__name__}) is not a logical name.",
                                      'key the rules by the names the model uses, e.g. {"batch": "data"}.'))
        return cls(tuple((k, _norm(v, f"rule {k!r}")) for k, v in mapping.items()), name, replicate_unknown)

    @classmethod
    def preset(cls, name: str) -> AxisRules:
        if name not in PRESETS:
            raise LayoutError(fix(f"rules preset {name!r} is not known.", f"choose one of {sorted(PRESETS)}, or pass a TOML file."))
        return cls.from_mapping(PRESETS[name], name=name)

    @classmethod
    def load(cls, spec: str, replicate_unknown: bool = False) -> AxisRules:
        """A preset name, a TOML file path, or inline ``batch=data,hidden=model``."""
        if not isinstance(spec, (str, os.PathLike)):
            raise LayoutError(fix(f"AxisRules.load({spec!r}): a preset name, a TOML file or 'name=axis,...' text.",
                                  f"e.g. AxisRules.load('fsdp+tp'); presets: {sorted(PRESETS)}; a dict: "
                                  "AxisRules.from_mapping(d)."))
        spec = os.fspath(spec)
        if spec in PRESETS:
            rules = cls.preset(spec)
        elif spec.endswith(".toml") or Path(spec).is_file():
            path = Path(spec)
            if not path.is_file():
                raise LayoutError(fix(f"rules file {spec!r} does not exist.", f"check the path, or use a preset: {sorted(PRESETS)}."))
            try:
                data = tomllib.loads(path.read_text())
            except tomllib.TOMLDecodeError as e:
                raise LayoutError(fix(f"rules file {spec!r} is not valid TOML: {e}.", 'write lines like hidden = "model".')) from None
            _check_rules_file(data, spec)
            rules = cls.from_mapping(data, name=path.name)
        elif "=" in spec:
            rules = cls.from_mapping(_inline_pairs(spec), name=spec)
        else:
            # Named as rules, not --rules: Sharded(mesh, "fsdp_tp") and plan(rules=...) get it too.
            near = difflib.get_close_matches(spec, PRESETS, n=1, cutoff=0.6)
            raise LayoutError(
                fix(f"rules {spec!r} is neither a preset, a TOML file nor name=axis pairs"
                    + (f" (did you mean the preset {near[0]!r}?)." if near else "."),
                    f"use one of {sorted(PRESETS)}, a file rules.toml, or batch=data,hidden=model.")
            )
        return AxisRules(rules.table, rules.name, replicate_unknown)

    @property
    def mapping(self) -> dict[str, MeshAxes]:
        """Each name's first rule, the one Flax's ``logical_axis_rules`` applies to activations
        (``dict(table)`` took the last: parameters laid out by one rule, activations by another)."""
        first: dict[str, MeshAxes] = {}
        for name, axes in self.table:
            first.setdefault(name, axes)
        return first

    def flax_rules(self) -> tuple[tuple[str, MeshAxes], ...]:
        """The table in the form ``nn.logical_axis_rules`` takes."""
        return self.table

    def check_mesh(self, mesh: Mesh) -> None:
        """Every mesh axis a rule names exists in ``mesh``."""
        names = set(mesh.axis_names)
        for logical, axes in self.table:
            for axis in _as_tuple(axes):
                if axis not in names:
                    raise LayoutError(
                        fix(
                            f"rule {logical!r} -> {axis!r} (rules {self.name!r}) names mesh axis {axis!r}, "
                            f"but the mesh has axes {list(mesh.axis_names)} ({dict(mesh.shape)}).",
                            f"add the axis to the mesh (spmdkit.make_mesh(..., {axis}=N); CLI: add {axis}=N to --mesh), "
                            f"or map {logical!r} to one of {list(mesh.axis_names)} or None.",
                        )
                    )

    def mesh_axes(self, logical: str, where: str) -> MeshAxes:
        table = self.mapping
        if logical not in table:
            if self.replicate_unknown:
                return None
            raise LayoutError(
                fix(
                    f"{where} has logical axis {logical!r}, which rules {self.name!r} do not map "
                    f"(they map {sorted(table)}). spmdkit does not silently replicate it.",
                    f'add a rule for it (e.g. ("{logical}", "model"), or ("{logical}", None) to replicate; '
                    f'in a rules file {logical} = "none"), or pass replicate_unknown=True to Sharded '
                    "(CLI: --replicate-unknown).",
                )
            )
        return table[logical]

    def check_constraint(self, names: Any, mesh_shape: Mapping[str, int] | None = None) -> None:
        """Every logical name of an activation constraint (``nn.with_logical_constraint(x,
        names)``) is mapped: Flax puts ``None`` (replicated) where no rule names one.
        ``mesh_shape``: the mesh's axis sizes, to name a mesh axis written in place of a logical
        name (an error also under ``replicate_unknown``: it meant a sharding, not a replica).

            >>> AxisRules.from_mapping({"batch": "data"}).check_constraint(("batch", None))
        """
        where = f"an activation constraint nn.with_logical_constraint(x, {tuple(names)!r})"
        self._check_names(tuple(names), mesh_shape, where, _CONSTRAINT)

    def _check_names(self, names: tuple, mesh_shape: Mapping[str, int] | None, where: str,
                     calls: tuple[str, str]) -> None:
        for name in names:
            if not isinstance(name, str) or name in self.mapping:
                continue
            if mesh_shape is not None and name in mesh_shape:
                raise self._mesh_axes_as_logical(names, mesh_shape, where, calls)
            if not self.replicate_unknown:
                self.mesh_axes(name, where)

    def _logical_names_of(self, axis: str) -> list[str]:
        """The logical names the rules map to mesh axis ``axis``: to it alone first, then with others."""
        alone = [name for name, axes in self.mapping.items() if axes == axis]
        return alone + [name for name, axes in self.mapping.items() if axes != axis and axis in _as_tuple(axes)]

    def _mesh_axes_as_logical(self, names: tuple, mesh_shape: Mapping[str, int], where: str,
                              calls: tuple[str, str]) -> LayoutError:
        """``nn.with_logical_constraint(x, ('data', 'model'))``: mesh axes where logical names belong.
        ``calls``: how to write the names as logical names, and as mesh axes (``{}``: the names)."""
        axes = [n for n in names if isinstance(n, str) and n in mesh_shape and n not in self.mapping]
        found = {axis: self._logical_names_of(axis) for axis in axes}
        listed = "; ".join(f"{axis!r} (size {mesh_shape[axis]}): " + (", ".join(map(repr, logical)) if logical else
                                                                        "no logical name maps to it")
                           for axis, logical in found.items())

        def as_logical(n: Any) -> str:  # n rewritten as a logical name, where the rules have one for it
            if n not in found:
                return repr(n)
            return repr(found[n][0]) if found[n] else f"<a logical name for {n!r}>"

        rewritten = ", ".join(map(as_logical, names)) + ("," if len(names) == 1 else "")
        unmapped = [axis for axis, logical in found.items() if not logical]
        direct = tuple(self.mapping[n] if isinstance(n, str) and n in self.mapping else n for n in names)
        logical_call, mesh_call = calls
        return LayoutError(fix(
            f"{where} names mesh axes {axes} of the mesh {dict(mesh_shape)} where logical names belong: rules "
            f"{self.name!r} map logical names to mesh axes, and map none of {axes}. The logical names the "
            f"rules map to them: {listed}."
            + (" replicate_unknown replicates logical names that no rule maps, not a mesh axis's name: that "
               "meant a sharding." if self.replicate_unknown else ""),
            f"write the logical names: {logical_call.format(f'({rewritten})')}"
            + (f", after adding a rule that maps a logical name to {unmapped}" if unmapped else "")
            + f"; or, to name mesh axes directly, {mesh_call.format(f'P{direct!r}')}."))

    def spec(self, logical: tuple[str | None, ...], where: str = "array",
             mesh_shape: Mapping[str, int] | None = None) -> P:
        """The mesh PartitionSpec of an array with these logical dimension names (``mesh_shape``:
        the mesh's axis sizes, to name a mesh axis written in place of a logical name)."""
        self._check_names(tuple(logical), mesh_shape, where, _PARAMETER)
        return P(*(None if name is None else self.mesh_axes(name, where) for name in logical))


# How to write a constraint's or a parameter's names as logical names, and as mesh axes.
_CONSTRAINT = ("nn.with_logical_constraint(x, {})", "jax.lax.with_sharding_constraint(x, {})")
_PARAMETER = ("nn.with_logical_partitioning(init_fn, {})", "nn.with_partitioning(init_fn, {})")


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def check_spec(spec: P, shape: tuple[int, ...], mesh: Mesh, where: str, logical: tuple | None = None) -> None:
    """A mesh axis at most once per spec, every sharded dimension divisible by its axes."""
    seen: dict[str, int] = {}
    names = list(mesh.axis_names)
    if len(spec) > len(shape):
        raise LayoutError(fix(f"{where}: spec {spec} has {len(spec)} entries for an array of shape {shape}.",
                              "give one logical name per dimension."))
    for dim, axes in enumerate(spec):
        for axis in _as_tuple(axes):
            if axis not in names:
                raise LayoutError(
                    fix(f"{where}: dimension {dim} is sharded over mesh axis {axis!r}, but the mesh has "
                        f"axes {names}.", f"shard it over one of {names} or none.")
                )
            if axis in seen:
                by = "" if logical is None else f" (logical {logical[seen[axis]]!r} and {logical[dim]!r})"
                raise LayoutError(
                    fix(
                        f"{where}: mesh axis {axis!r} is used twice in spec {spec}, for dimensions "
                        f"{seen[axis]} and {dim}{by}; an axis can split only one dimension.",
                        "map one of those logical names to another mesh axis or to none.",
                    )
                )
            seen[axis] = dim
        size = 1
        for axis in _as_tuple(axes):
            size *= mesh.shape[axis]
        if size > 1 and shape[dim] % size:
            # The logical name, when the parameter has one: "map its logical name to none" did not
            # say which, and the command line's user was given no flag.
            name = logical[dim] if logical is not None and dim < len(logical) else None
            named = "" if name is None else f" (logical {name!r})"
            to_none = ("its logical name to none" if name is None
                       else f"{name!r} to none (a rules entry {name}=none; a dict {{{name!r}: None}})")
            raise LayoutError(
                fix(
                    f"{where}: dimension {dim}{named} has size {shape[dim]}, which mesh axes "
                    f"{_as_tuple(axes)} (size {size}) cannot split evenly.",
                    f"make that dimension a multiple of {size}, use a mesh axis whose size divides "
                    f"{shape[dim]}, or map {to_none}. CLI: a --mesh whose {'/'.join(_as_tuple(axes))} size "
                    f"divides {shape[dim]} (--task lm: --heads a multiple of the model axis), or --rules that "
                    "map it to none.",
                )
            )


# Complete over the vocabulary of the built-in models (batch, embed, hidden, layer for
# mlp; length, heads, kv, mlp, vocab, layers for lm): a name that is left unsharded is
# written as None, so nothing falls through. Tensor parallelism splits the lm's
# attention heads, MLP width and vocabulary over "model", like the mlp's hidden width.
_UNSHARDED_LM = {"length": None, "kv": None, "layers": None}
_TP_LM = {"heads": "model", "mlp": "model", "vocab": "model"}
_NO_TP_LM = {"heads": None, "mlp": None, "vocab": None}
_PRESETS: dict[str, dict[str, MeshAxes]] = {
    "dp": {"batch": "data", "embed": None, "hidden": None, "layer": None, **_UNSHARDED_LM, **_NO_TP_LM},
    "fsdp": {"batch": "data", "embed": "data", "hidden": None, "layer": None, **_UNSHARDED_LM, **_NO_TP_LM},
    "tp": {"batch": None, "embed": None, "hidden": "model", "layer": None, **_UNSHARDED_LM, **_TP_LM},
    "dp+tp": {"batch": "data", "embed": None, "hidden": "model", "layer": None, **_UNSHARDED_LM, **_TP_LM},
    "fsdp+tp": {"batch": "data", "embed": "data", "hidden": "model", "layer": None, **_UNSHARDED_LM, **_TP_LM},
    # Sequence parallel: the lm's activations split along the sequence over "model" (and
    # the position embedding with them), parameters FSDP-style over "data".
    "fsdp+sp": {"batch": "data", "embed": "data", "hidden": None, "layer": None, **_UNSHARDED_LM, **_NO_TP_LM,
                "length": "model"},
    # Hybrid sharded data parallelism with tensor parallelism: the batch over "data" and "fsdp",
    # parameters over "fsdp" only (replicated across "data", as across hosts), heads/MLP/vocab over "model".
    "hsdp+tp": {"batch": ("data", "fsdp"), "embed": "fsdp", "hidden": "model", "layer": None, **_UNSHARDED_LM,
                **_TP_LM},
}

# Read-only: a user's edit of a preset (PRESETS["dp"]["hidden"] = "model") changed it for every
# later user of the preset in the process. Build a table from one instead: {**PRESETS["dp"], ...}.
PRESETS: Mapping[str, Mapping[str, MeshAxes]] = MappingProxyType(
    {name: MappingProxyType(table) for name, table in _PRESETS.items()})

# The mesh each preset runs on when --mesh is not given (-1: the rest of the devices).
DEFAULT_MESH: dict[str, dict[str, int]] = {
    "dp": {"data": -1},
    "fsdp": {"data": -1},
    "tp": {"model": -1},
    "dp+tp": {"data": 2, "model": -1},
    "fsdp+tp": {"data": 2, "model": -1},
    "fsdp+sp": {"data": 2, "model": -1},
    "hsdp+tp": {"data": 2, "fsdp": -1, "model": 2},
}


def parse_mesh(text: str) -> dict[str, int]:
    """``data=2,model=4`` -> ``{"data": 2, "model": 4}`` (order kept; one -1 allowed)."""
    out: dict[str, int] = {}
    seen: set[str] = set()
    for part in text.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        try:
            value = int(size)
        except ValueError:
            raise LayoutError(fix(f"--mesh {text!r}: {part!r} is not name=size.", "write e.g. --mesh data=2,model=4.")) from None
        if not name.isidentifier():
            raise LayoutError(fix(f"--mesh {text!r}: {name!r} is not an axis name.", "write e.g. --mesh data=2,model=4."))
        if name in seen:
            raise LayoutError(fix(f"--mesh {text!r}: axis {name!r} is given twice.",
                                  "name each axis once, e.g. --mesh data=2,model=4."))
        seen.add(name)
        out[name] = value
    return out
