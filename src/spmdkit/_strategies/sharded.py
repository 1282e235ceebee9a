"""Sharded (model-parallel) training: every leaf of the state laid out by logical rules.

The layout is derived, not written by hand: ``jax.eval_shape`` of the task's init
(with Flax's partitioning boxes) gives every parameter's shape and logical names;
the rules table turns names into mesh axes; the optimizer state inherits its
parameter's layout. The state is created directly sharded (jit with
``out_shardings``: the whole model never exists on one device), and the steps are
jitted with those shardings. Activations constrained with
``nn.with_logical_constraint`` follow the same rules.
"""

from __future__ import annotations

import difflib
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdkit._errors import ConfigError, SignatureError, fix
from spmdkit._strategies._compile import Placement, as_key, auto_mesh, check_make_state
from spmdkit._rules import AxisRules, LayoutError, ReplicationWarning, _as_tuple, check_spec
from spmdkit._tree import one_level
from spmdkit._types import MakeState


class LeafLayout(NamedTuple):
    """One array of the state: where it is and how it is split."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...] | None  # None: not annotated (or mesh names given directly)
    spec: P
    bytes: int
    bytes_per_device: int


class Layout(NamedTuple):
    leaves: list[LeafLayout]
    shardings: Any  # pytree of NamedSharding, shaped like the (unboxed) state
    abstract: Any  # pytree of ShapeDtypeStruct with those shardings: a restore target

    def replicated_fraction(self) -> float:
        total = sum(leaf.bytes for leaf in self.leaves) or 1
        return sum(leaf.bytes for leaf in self.leaves if not any(leaf.spec)) / total


def _is_box(x: Any) -> bool:
    return isinstance(x, (meta.AxisMetadata, nnx.Variable))


def is_empty_box(leaf: Any) -> bool:
    """A box around no array: optax.masked / multi_transform keep a parameter's box in the
    state of a group it is not in, around a ``MaskedNode``. Unboxed it is no leaf at all."""
    return _is_box(leaf) and not jax.tree_util.tree_leaves(leaf)


def _unboxed(leaf: Any) -> Any:
    """The array in a Flax box or NNX variable (NNX deprecates ``.value``), else ``leaf``."""
    if isinstance(leaf, nnx.Variable):
        (value,) = jax.tree_util.tree_leaves(leaf)
        return value
    return leaf.value if isinstance(leaf, meta.AxisMetadata) else leaf


def _nnx_names(variable: nnx.Variable) -> tuple | None:
    """An NNX variable's sharding names (``nnx.with_partitioning``, ``sharding_names=``), or None."""
    info = variable.get_metadata()
    names = info.get("out_sharding") or info.get("sharding") or info.get("sharding_names")
    return tuple(names) if names else None


def _nnx_spec(names: tuple, rules: AxisRules, mesh: Mesh, where: str) -> P:
    """NNX ``sharding``/``out_sharding`` names: a rule's name maps by the rule, a mesh
    axis name stands for itself, anything else is an unknown logical name."""
    out = []
    for name in names:
        if name is None or (name not in rules.mapping and name in mesh.axis_names):
            out.append(name)
        else:
            out.append(rules.mesh_axes(name, where))
    return P(*out)


def plan_layout(boxed_state: Any, rules: AxisRules, mesh: Mesh, root: str = "state") -> Layout:
    """Validate and derive the sharding of every leaf of a boxed abstract state."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(boxed_state, is_leaf=_is_box)
    planned: dict[int, tuple] = {}
    for i, (path, leaf) in shallow_first(leaves):  # an error names a parameter, not its optimizer moment
        if not is_empty_box(leaf):
            planned[i] = _plan_leaf(path, leaf, rules, mesh, root)
    rows = [planned[i] for i in sorted(planned)]  # the state's own order again
    out, shardings, abstract = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    unboxed_def = jax.tree_util.tree_structure(meta.unbox(boxed_state))
    if unboxed_def.num_leaves != len(shardings):
        raise LayoutError(f"internal: {unboxed_def.num_leaves} leaves after unboxing, {len(shardings)} planned")
    return Layout(out, jax.tree_util.tree_unflatten(unboxed_def, shardings), jax.tree_util.tree_unflatten(unboxed_def, abstract))


def shallow_first(leaves: list[tuple[Any, Any]]) -> list[tuple[int, tuple[Any, Any]]]:
    """``(index, (path, leaf))`` with the shortest paths first: a parameter's
    (``['params']['Dense_0']['kernel']``) before the optimizer moments of the same array
    (``['opt'][0].mu['Dense_0']['kernel']``), whatever the state's keys sort as."""
    return sorted(enumerate(leaves), key=lambda item: (len(item[1][0]), item[0]))


def _plan_leaf(path: Any, leaf: Any, rules: AxisRules, mesh: Mesh, root: str) -> tuple[LeafLayout, NamedSharding, Any]:
    """One leaf's layout, sharding and abstract value; a name the rules cannot place raises."""
    where = root + jax.tree_util.keystr(path)
    logical = None
    if isinstance(leaf, nn.LogicallyPartitioned):
        logical = tuple(leaf.names)
        spec = rules.spec(logical, where, dict(mesh.shape))
    elif isinstance(leaf, nn.Partitioned):
        spec = P(*leaf.names)  # with_partitioning names mesh axes directly
    elif isinstance(leaf, nnx.Variable):
        logical = _nnx_names(leaf)
        spec = P() if not logical else _nnx_spec(logical, rules, mesh, where)
    else:
        spec = P()
    value = _unboxed(leaf)
    if not hasattr(value, "shape"):  # a Python number in the state: JAX's own dtype for it
        value = jax.ShapeDtypeStruct(np.shape(value), jnp.asarray(value).dtype)
    shape = tuple(value.shape)
    check_spec(spec, shape, mesh, where, logical)
    sharding = NamedSharding(mesh, spec)
    nbytes = math.prod(shape) * _itemsize(value.dtype)
    split = math.prod(mesh.shape[a] for axes in spec for a in ((axes,) if isinstance(axes, str) else (axes or ())))
    return (LeafLayout(where, shape, str(value.dtype), logical, spec, nbytes, nbytes // split), sharding,
            jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding))


def _itemsize(dtype: Any) -> int:
    """Bytes per element, also of PRNG key arrays (a threefry key is two uint32, an rbg key four)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return dtype.itemsize
    return np.dtype(dtype).itemsize


def warn_if_mostly_replicated(layout: Layout, rules: AxisRules, mesh: Mesh) -> None:
    """Warn, naming the largest replicated arrays, when sharding was meant but did little."""
    if mesh.size == 1:
        return
    # A TrainState's .params or a dict state's ['params']; a state that keeps them under
    # another name ({"p": ...}, a tuple) lists its largest leaves, not nothing.
    params = [leaf for leaf in layout.leaves if leaf.path.startswith(("state.params", "state['params']"))]
    params = params or list(layout.leaves)
    wants_sharding = any(axes is not None for name, axes in rules.table if name != "batch")
    fraction = layout.replicated_fraction()
    if wants_sharding and fraction > 0.5:
        largest = sorted((leaf for leaf in params if not any(leaf.spec)), key=lambda l: -l.bytes)[:5]
        # Parameters all sharded, their optimizer state not: name those leaves ("parameters: ." said nothing).
        what = "parameters" if largest else "arrays"
        largest = largest or sorted((leaf for leaf in layout.leaves if not any(leaf.spec)), key=lambda l: -l.bytes)[:5]
        listing = ", ".join(f"{leaf.path} {leaf.shape} ({leaf.bytes / 2**20:.1f} MiB)" for leaf in largest)
        warnings.warn(
            f"{fraction:.0%} of the train state's memory is replicated on every device under rules "
            f"{rules.name!r} on mesh {dict(mesh.shape)}; the largest replicated {what}: {listing}. "
            "Annotate them with logical names (nn.with_logical_partitioning"
            # plain arrays have no model to annotate: Sharded's state_axes= names them
            + (", or Sharded(..., state_axes=) for plain arrays, e.g. state_axes={'w': ('embed', 'hidden')}"
               if any(leaf.logical is None for leaf in largest) else "")
            + ") or map their names to a mesh axis.",
            ReplicationWarning,
            stacklevel=3,
        )


class Sharded(Placement):
    """Parameters and optimizer state split over a mesh by logical axis rules.

    ``mesh``: a ``Mesh`` (:func:`spmdkit.make_mesh`) or a dict of axis sizes,
    ``{"data": 2, "model": 4}``. ``replicate_unknown=True`` replicates arrays whose logical names no rule maps (by
    default that is an error naming the array).

    ``rules``: a preset (``"fsdp+tp"``), an :class:`AxisRules`, Flax's own rules format
    (``(("batch", "data"), ("hidden", "model"))``; the first rule of a name wins) or a
    dict. ``init(make_state, rng)`` lays the state out from ``jax.eval_shape(make_state,
    rng)``: Flax boxes (``nn.with_logical_partitioning``, ``nn.with_partitioning``), NNX
    sharding metadata, or, for plain arrays, ``state_axes``: a pytree of logical names
    (tuples, ``None`` to replicate) shaped like the state, or like any part of it (a
    params-shaped tree also lays out the optimizer moments that mirror the params).

    Example:
        >>> import jax, jax.numpy as jnp, spmdkit
        >>> strategy = spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp",
        ...                            state_axes={"w": ("embed", "hidden")})
        >>> strategy.batch_shards
        2
        >>> state = strategy.init(lambda rng: {"w": jnp.ones((4, 8))}, jax.random.key(0))
        >>> state["w"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
        True
    """

    name = "sharded"

    def __init__(self, mesh: Mesh, rules: Any, *, batch_name: str = "batch", state_axes: Any = None,
                 replicate_unknown: bool | None = None):
        mesh = auto_mesh(mesh)
        rules = as_rules(rules)
        if replicate_unknown is not None:
            rules = AxisRules(rules.table, rules.name, replicate_unknown)
        rules.check_mesh(mesh)
        self.state_axes = _lists_as_names(state_axes)
        self.mesh = mesh
        self.rules = rules
        batch_axes = rules.mesh_axes(batch_name, "the batch")
        self._batch = NamedSharding(mesh, P(batch_axes))
        self._replicated = NamedSharding(mesh, P())
        self.layout: Layout | None = None
        self._known: dict[Any, Any] = {}  # state treedef -> shardings, from init / shardings()
        self._known_shapes: dict[Any, set[tuple]] = {}  # treedef -> the leaves' shapes laid out

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (by the rules' batch name)."""
        return _as_tuple(self._batch.spec[0])

    @property
    def batch_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "impl": "jit",
            "mesh": dict(self.mesh.shape),
            "device_count": self.mesh.size,
            "rules": self.rules.name,
            "rules_table": self.rules.mapping,  # each name's rule in effect (the first)
        }

    # ---- placement of the user's state and batches (see Placement) --------------
    def shardings(self, abstract_state: Any) -> Any:
        """Every leaf's NamedSharding from its logical names and the rules (validated)."""
        layout = self.layout_of(abstract_state)
        return layout.shardings

    def layout_of(self, abstract_state: Any) -> Layout:
        """The validated layout of a (boxed or plain) abstract state, per leaf."""
        boxed = _with_state_axes(abstract_state, self.state_axes)
        layout = plan_layout(boxed, self.rules, self.mesh)
        warn_if_mostly_replicated(layout, self.rules, self.mesh)
        treedef = jax.tree.structure(layout.shardings)
        self._known[treedef] = layout.shardings
        self._known_shapes.setdefault(treedef, set()).add(tuple(leaf.shape for leaf in layout.leaves))
        self.layout = layout  # the last layout planned, for inspection
        return layout

    def _rules(self) -> Any:
        return self.rules

    def _state_shardings(self, state: Any) -> Any:
        known = self._known.get(jax.tree.structure(state))
        if known is not None:
            return known
        leaves = jax.tree.leaves(state)
        if leaves and all(self._on_mesh(x) for x in leaves):
            return jax.tree.map(lambda x: x.sharding, state)
        self._foreign_state(state)  # another mesh's or an ensemble's state, named as such
        path, x = next(((p, x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0] if not self._on_mesh(x)),
                       (None, None))
        where = "" if path is None else (
            f": state{jax.tree_util.keystr(path)} (shape {np.shape(x)}) is "
            + (f"on {len(x.sharding.device_set)} device(s) as {type(x.sharding).__name__}"
               if isinstance(x, jax.Array) else f"a host {type(x).__name__}")
            + f", not laid out on this strategy's mesh {dict(self.mesh.shape)}")
        raise LayoutError(
            fix(f"Sharded.step/apply got a state this strategy has not laid out (nor one of its structure){where}.",
                "move it onto this strategy's layout: state = jax.device_put(state, strategy.shardings(state)); "
                "or create it with strategy.init(make_state, rng), or restore it into "
                "strategy.shardings(abstract_state) / strategy.abstract(make_state).")
        )

    def _on_mesh(self, x: Any) -> bool:
        """An array laid out on this strategy's mesh."""
        return isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh

    def _check_state(self, state: Any, leaves: list[Any]) -> None:
        # Every call (shapes only): a compiled step is cached by structure, so a state of a
        # laid-out structure but other shapes would reach a program laid out for the others.
        known = self._known_shapes.get(jax.tree.structure(state))
        if known is None or tuple(np.shape(x) for x in leaves) in known or all(self._on_mesh(x) for x in leaves):
            return
        self._foreign_state(state)  # an ensemble's state (members stacked) is named as such
        shapes = max(known)  # one laid-out version, to name a leaf that differs
        path, x, want = next(((p, x, s) for (p, x), s in zip(jax.tree_util.tree_flatten_with_path(state)[0], shapes)
                              if np.shape(x) != s))
        raise LayoutError(
            fix(f"Sharded.step/apply got a state this strategy has not laid out: state{jax.tree_util.keystr(path)} "
                f"has shape {np.shape(x)}, but this strategy laid out that leaf with shape {want}.",
                "create it with strategy.init(make_state, rng), or restore it into "
                "strategy.shardings(abstract_state) / strategy.abstract(make_state) for its shapes.")
        )

    def _batch_sharding(self, even: bool) -> NamedSharding:
        return self._batch if even else self._replicated

    # ---- layout ---------------------------------------------------------------
    def plan(self, make_state: MakeState, rng: Any = 0) -> Layout:
        """Every leaf's layout of ``make_state(rng)``'s state, validated, with its path,
        logical names and bytes per device; nothing is allocated (``jax.eval_shape``)."""
        if hasattr(rng, "init") and hasattr(rng, "update"):  # the older plan(init_fn, optimizer)
            raise SignatureError(fix(
                "Sharded.plan(make_state, rng) takes the function that builds the whole state, not "
                f"(init_fn, optimizer): its second argument is a PRNG key or seed, not {type(rng).__name__}.",
                "build the optimizer state inside make_state, e.g. plan(lambda rng: "
                "TrainState.create(apply_fn=..., params=init_fn(rng), tx=optimizer))."))
        check_make_state(make_state)
        return self.layout_of(self._abstract_boxed(make_state, as_key(rng)))

    def __repr__(self) -> str:
        return f"Sharded(mesh={dict(self.mesh.shape)}, rules={self.rules.name!r})"


def as_rules(rules: Any) -> AxisRules:
    """An AxisRules from a preset/file/inline string, Flax's rule tuples, or a dict."""
    if isinstance(rules, AxisRules):
        return rules
    if isinstance(rules, str):
        return AxisRules.load(rules)
    if isinstance(rules, dict):
        return AxisRules.from_mapping(rules)
    if isinstance(rules, (tuple, list)) and all(isinstance(r, (tuple, list)) and len(r) == 2 for r in rules):
        first: dict[str, Any] = {}
        for name, axes in rules:  # Flax tries a name's rules in order; the first is the one used
            first.setdefault(name, axes)
        return AxisRules.from_mapping(first)
    raise ConfigError(
        fix(f"rules={rules!r} is not a rules table.",
            'pass a preset ("fsdp+tp"), Flax rules ((("batch", "data"), ("hidden", "model"))), '
            'a dict {"hidden": "model"} or spmdkit.AxisRules.')
    )


def _lists_as_names(axes: Any) -> Any:
    """``["embed", "hidden"]`` read as the names ``("embed", "hidden")``: a list of strings
    (and Nones) cannot be a container of the state's parts, whose names are tuples or None.
    A lone string is one name (``"hidden"`` for a vector), not its characters."""
    if isinstance(axes, str):
        return (axes,)
    if isinstance(axes, list) and any(isinstance(n, str) for n in axes) and all(n is None or isinstance(n, str) for n in axes):
        return tuple(axes)
    if isinstance(axes, dict):
        return {k: _lists_as_names(v) for k, v in axes.items()}
    if isinstance(axes, (list, tuple)) and not _is_names(axes):
        return type(axes)(_lists_as_names(v) for v in axes) if type(axes) in (list, tuple) else axes
    return axes


def _is_names(x: Any) -> bool:
    """One array's entry of ``state_axes``: logical names, None, or a ``P`` of mesh axes (whose
    entries were each taken for a part of their own, one that fits any array)."""
    return x is None or isinstance(x, P) or (isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))


def _subtrees(tree: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """``(path, part)`` for ``tree`` and every container inside it (not the name tuples)."""
    out = [(path, tree)]
    if isinstance(tree, dict):
        items = list(tree.items())
    elif isinstance(tree, (list, tuple)) and not _is_names(tree):
        items = list(enumerate(tree))
    else:
        items = []
    for key, child in items:
        if not _is_names(child):
            out.extend(_subtrees(child, path + (key,)))
    return out


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _is_slot(x: Any) -> bool:
    """A place of the params' structure: a leaf, a box, or a masked optimizer's MaskedNode."""
    return _is_box(x) or _is_masked(x)


def _shapes(tree: Any) -> list[tuple]:
    return [tuple(getattr(leaf, "shape", ())) for leaf in jax.tree.leaves(tree, is_leaf=_is_box)]


def _check_ranks(state: Any, parts: list) -> None:
    """A part of ``state_axes`` with the structure of (a part of) the state, whose names for an
    array are not one per dimension: named by path with both ranks (rather than "matches nothing")."""
    for _, want, names, _ in parts:
        def same(x, want=want):
            return not _is_box(x) and jax.tree.structure(x, is_leaf=_is_box) == want

        for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=same)[0]:
            if not same(x):
                continue
            for (sub, leaf), n in zip(jax.tree_util.tree_flatten_with_path(x, is_leaf=_is_box)[0], names):
                shape = getattr(leaf, "shape", None)
                if n is not None and shape is not None and not _is_box(leaf) and len(n) != len(shape):
                    where = "state" + jax.tree_util.keystr((*path, *sub))
                    raise LayoutError(fix(
                        f"state_axes names {tuple(n)} ({len(n)} name(s)) for {where}, an array of rank {len(shape)} "
                        f"(shape {tuple(shape)}).",
                        f"give one logical name (or None) per dimension: {len(shape)} for {where}."))


def _rank(leaf: Any) -> int | None:
    """The rank of an array, boxed (a Flax box, an NNX Variable) or not; None for no array."""
    inner = jax.tree.leaves(leaf)
    return len(inner[0].shape) if len(inner) == 1 and hasattr(inner[0], "shape") else None


def _check_lone_names(state: Any, axes: Any) -> None:
    """``state_axes`` one array's names (``"embed"``, ``("embed", "hidden")``, a ``P``) for a
    state with several arrays of that rank that could take them (plain, or an NNX Variable
    without names): it named every one alike. One such array (beside scalars, a key, the
    model's named arrays) takes them."""
    if not _is_names(axes) or axes is None or all(n is None for n in axes):
        return  # (None, None): nothing named

    def takes(leaf: Any) -> bool:
        if isinstance(leaf, nnx.Variable):
            return _nnx_names(leaf) is None
        return not _is_box(leaf)

    arrays = [path for path, leaf in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_box)[0]
              if takes(leaf) and _rank(leaf) == len(axes)]
    if len(arrays) > 1:
        shown = ", ".join("state" + jax.tree_util.keystr(p) for p in arrays[:3]) + (", ..." if len(arrays) > 3 else "")
        raise LayoutError(fix(f"state_axes={axes!r} names one array, but the state holds {len(arrays)} of rank "
                              f"{len(axes)} ({shown}).",
                              "give state_axes the structure of the state or of its params, one tuple of names per "
                              "array, e.g. {'w': ('embed', 'hidden'), 'b': ('hidden',)}."))


def _rank_misses(x: Any, names: list) -> list[tuple[int, Any]]:
    """``(index, array)`` of each array of ``x`` whose names in ``names`` are not one per dimension."""
    leaves = jax.tree.leaves(x, is_leaf=_is_slot)
    return [(i, leaf) for i, (leaf, n) in enumerate(zip(leaves, names))
            if n is not None and not _is_slot(leaf) and hasattr(leaf, "shape") and len(n) != len(leaf.shape)]


def _check_whole_ranks(state: Any, axes: Any, part: list) -> None:
    """The whole of ``state_axes`` has the structure of a part of the state (the params) but does
    not fit it, a few of its arrays named with the wrong number of names: a typo. Its parts were
    then matched alone, and one (``head``) named another subtree of its structure (``enc``) with
    its own names without a word. The subtree it fits best (fewest misses, some names fitting)
    is named, with the ``state_axes`` path, both ranks and the fix."""
    _, want, names, _ = part
    same = lambda x: not _is_box(x) and jax.tree.structure(x, is_leaf=_is_slot) == want  # noqa: E731
    found = [(path, _rank_misses(x, names)) for path, x in
             jax.tree_util.tree_flatten_with_path(state, is_leaf=same)[0] if same(x)]
    named = sum(n is not None for n in names)
    misses = [(path, m) for path, m in found if m and len(m) < named]
    if not misses:
        return
    path, missed = min(misses, key=lambda pm: (len(pm[1]), len(pm[0])))  # the params before the moments
    where = [p for p, _ in jax.tree_util.tree_flatten_with_path(axes, is_leaf=_is_names)[0]]
    i, leaf = missed[0]
    within = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(want, list(range(len(names)))))[0][i][0]
    given = tuple(names[i])
    more = f" ({len(missed) - 1} more array(s) alike)" if len(missed) > 1 else ""
    raise LayoutError(fix(
        f"state_axes has the structure of state{jax.tree_util.keystr(path)}, but state_axes"
        f"{jax.tree_util.keystr(where[i])} names {given} ({len(given)} name(s)) for "
        f"state{jax.tree_util.keystr((*path, *within))}, an array of rank {len(leaf.shape)} (shape "
        f"{tuple(leaf.shape)}){more}.",
        f"give one logical name (or None) per dimension: {len(leaf.shape)} for "
        f"state_axes{jax.tree_util.keystr(where[i])}."))


def _with_state_axes(state: Any, axes: Any) -> Any:
    """Plain leaves boxed with the user's logical names (``state_axes``); boxed leaves kept.

    ``axes`` and each part of it (``axes["encoder"]``) are matched against the whole state
    and every subtree of the same structure whose arrays have one name per dimension: a
    params-shaped tree also names the optimizer's moments, also of an optimizer that
    covers only a part of the params. Where the whole tree matches (the params), each part
    also learns its arrays' shapes, and a part then matches only subtrees of those shapes;
    two parts that still both fit one subtree are an error. A part does not match a subtree that
    is another entry of the container holding it (``{"enc": ENC, "head": None}``: not head), and
    every array of a subtree laid out as ``axes`` needs its own entry (:func:`_check_own_entries`).
    """
    if axes is None:
        return state
    _check_names_only(axes)
    _check_lone_names(state, axes)
    parts = _axes_parts(axes)
    whole = [x for x in jax.tree.leaves(state, is_leaf=lambda x: _fits(parts[0], x)) if _fits(parts[0], x)]
    if not whole:
        _check_whole_ranks(state, axes, parts[0])
    if whole:  # the params: every part learns the shapes it names
        for part in parts[1:]:  # the whole tree itself matches by structure, wherever it fits
            part[3] = _shapes(_at(whole[0], part[0]))
    matched: dict[str, tuple] = {}  # the path of each subtree a part named: that part's path in axes

    def box(path, x, part):
        matched[jax.tree_util.keystr(path)] = part[0]
        # A Variable without names takes names only from its own entry (a part that fits it by
        # structure alone leaves it as the model has it).
        own = not part[0] or (path and _raw_key(path[-1]) == part[0][-1])
        flat, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=_is_slot)
        for (sub, leaf), n in zip(flat, part[2]):
            _check_box_agrees(leaf, n, "state" + jax.tree_util.keystr((*path, *sub)), own)
        out = [leaf if _is_slot(leaf) or n is None else nn.LogicallyPartitioned(leaf, n)
               for (_, leaf), n in zip(flat, part[2])]
        return jax.tree.unflatten(treedef, out)

    # state_axes shaped as the state itself: a None entry keeps its whole subtree as it is (the
    # params' part matched an optimizer's moments under "opt": None by their structure).
    rooted = _lays_out(state, axes)

    def visit(path, x):  # the tree, each subtree under its own key (a part is not its sibling's)
        if rooted and path:
            how, _, node = _entry_at(axes, [_raw_key(k) for k in path])
            if how == "names" and node is None:
                return x
        part = _match_part(parts, x, _raw_key(path[-1]) if path else None, axes)
        if part is not None:
            return box(path, x, part)
        if _is_box(x):  # the model's own: named by the model (checked where a part holds it)
            return x
        children, treedef = one_level(x)
        if len(children) == 1 and children[0][1] is x:  # an array
            return x
        return jax.tree_util.tree_unflatten(treedef, [visit((*path, *sub), child) for sub, child in children])

    given = state
    state = visit((), state)
    if not matched:
        _check_ranks(state, parts)
        raise _unmatched(state, axes)
    _check_own_entries(given, state, axes, matched)
    return state


def _lays_out(x: Any, axes: Any) -> bool:
    """Whether ``x`` is laid out as ``state_axes`` says (the params, their optimizer moments): a
    dict holding every top-level key of a dict ``axes``, or a list or tuple at least as long as a
    list ``axes``, its entries of the same kinds (not an optimizer's tuple of states, nor
    multi_transform's states named as the params are); a None entry stands for any subtree."""
    def kind(y: Any) -> Any:
        if _is_names(y) or _is_slot(y) or hasattr(y, "shape"):
            return "array"
        return dict if isinstance(y, dict) else type(y) if isinstance(y, (list, tuple)) else None

    if isinstance(axes, dict):
        entries = [(a, x[k]) for k, a in axes.items()] if isinstance(x, dict) and set(axes) <= set(x) else None
    elif kind(axes) in (list, tuple) and type(x) is type(axes) and len(x) >= len(axes):
        entries = list(zip(axes, x))
    else:
        entries = None
    return bool(entries) and all(a is None or kind(a) == kind(b) for a, b in entries)


def _anchors(tree: Any, axes: Any) -> list[tuple[tuple, Any]]:
    """``(path, subtree)`` of each container of ``tree`` that :func:`_lays_out` as ``axes``, the
    shallowest first (the params before their optimizer's moments)."""
    fits = lambda x: _lays_out(x, axes)  # noqa: E731
    found = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=fits)[0] if fits(x)]
    return sorted(found, key=lambda px: len(px[0]))


def _entry_at(axes: Any, keys: list) -> tuple[str, int, Any]:
    """What ``state_axes`` says along ``keys``: ``("names", depth, names)`` where it reaches names
    or None (``depth`` keys in), ``("missing", depth, container)`` where a dict lacks the key or
    a list is too short, ``("other", depth, node)`` for a container of another kind."""
    node = axes
    for depth, key in enumerate(keys):
        if _is_names(node):
            return "names", depth, node
        if isinstance(node, dict):
            if key not in node:
                return "missing", depth, node
        elif isinstance(node, (list, tuple)) and isinstance(key, int):
            if key >= len(node):
                return "missing", depth, node
        else:
            return "other", depth, node
        node = node[key]
    return "names", len(keys), node


def _check_own_entries(given: Any, boxed: Any, axes: Any, matched: dict[str, tuple]) -> None:
    """Each array of a subtree laid out as ``state_axes`` (:func:`_anchors`, one that names some
    of its arrays) takes what its own entry says. A misspelt or missing key, or a subtree under a
    None, left it to another part of the same structure, whose names it took without a word
    (head named as enc). A key missing at the top is an error only where a part matched that
    entry itself with arrays of other shapes than its own entry's (head named by enc's part; a
    copy of the params, as an EMA or a momentum, is named as they are)."""
    original = {jax.tree_util.keystr(p) for p, leaf in jax.tree_util.tree_flatten_with_path(given, is_leaf=_is_box)[0]
                if _is_box(leaf)}
    for anchor, sub in _anchors(boxed, axes):
        leaves = [(path, leaf, _entry_at(axes, [_raw_key(k) for k in path]))
                  for path, leaf in jax.tree_util.tree_flatten_with_path(sub, is_leaf=_is_box)[0]
                  if _rank(leaf) and jax.tree_util.keystr((*anchor, *path)) not in original]
        if not any(how == "names" and depth == len(path) for path, _, (how, depth, _) in leaves):
            continue  # nothing here is named by state_axes: another dict with the same keys (metrics)
        for path, leaf, (how, depth, node) in leaves:
            where = "state" + jax.tree_util.keystr((*anchor, *path))
            took = isinstance(leaf, nn.LogicallyPartitioned)
            at = "state_axes" + jax.tree_util.keystr(path[:depth])
            if how == "names" and depth < len(path) and node is None and took:
                raise LayoutError(fix(f"{at} is None, but {where} under it took the names {tuple(leaf.names)} of "
                                      "another part of the same structure.",
                                      f"give {at} the structure of its subtree, None for each array."))
            if how != "missing" or (depth == 0 and not _named_unlike_its_part(sub, path[0], matched.get(
                    jax.tree_util.keystr((*anchor, path[0]))))):
                continue
            has = sorted(map(str, node)) if isinstance(node, dict) else f"{len(node)} entr{'y' if len(node) == 1 else 'ies'}"
            raise LayoutError(fix(
                f"{at} has no entry {_raw_key(path[depth])!r} (it has {has}) for {where}"
                + (f", which took the names {tuple(leaf.names)} of another part of the same structure." if took else "."),
                f"give {at} an entry for {_raw_key(path[depth])!r}: its logical names, or None to replicate it."))


def _named_unlike_its_part(anchor: Any, entry: Any, part: tuple | None) -> bool:
    """Whether a part (its path ``part`` in ``state_axes``) named the anchor's ``entry`` whose arrays
    have other shapes than those of the part's own entry (head named by enc's part)."""
    if part is None:
        return False
    try:
        own = _at(anchor, part)
    except (KeyError, IndexError, TypeError):
        return True
    shapes = lambda x: [tuple(leaf.shape) for leaf in jax.tree.leaves(x) if hasattr(leaf, "shape")]  # noqa: E731
    return shapes(own) != shapes(anchor[_raw_key(entry)])


def _check_box_agrees(leaf: Any, names: Any, where: str, own_entry: bool = True) -> None:
    """``state_axes`` naming an array the model already names otherwise: the model's names were
    used and ``state_axes``' dropped without a word. A Variable without names, named by its own
    entry (``own_entry``; not by another entry that fits it by structure), likewise."""
    if names is None or not _is_box(leaf):
        return
    if isinstance(leaf, nn.LogicallyPartitioned):
        own, how = tuple(leaf.names), "nn.with_logical_partitioning"
    elif isinstance(leaf, nn.Partitioned):
        own, how = tuple(leaf.names), "nn.with_partitioning (mesh axes)"
    elif isinstance(leaf, nnx.Variable):
        own, how = _nnx_names(leaf), "nnx.with_partitioning"
    else:
        return
    if own is None and own_entry and any(n is not None for n in names):  # dropped: the model's box kept
        raise LayoutError(fix(f"state_axes names {tuple(names)} for {where}, a {type(leaf).__name__} of the model "
                              f"without names ({how}); state_axes names plain arrays, and the model's own "
                              "variables keep what the model gives them.",
                              f"give it its names in the model ({how}(init, {tuple(names)})), or None in "
                              "state_axes."))
    if own is not None and own != tuple(names):
        raise LayoutError(fix(f"state_axes names {tuple(names)} for {where}, which the model already names {own} "
                              f"({how}); spmdkit will not pick one.",
                              "give it the model's names in state_axes (or None there), or change the model's "
                              "annotation: state_axes names plain arrays."))


def _check_names_only(axes: Any) -> None:
    """Every leaf of ``state_axes`` a logical name or None: ``("embed", 1)`` was read as a container
    of two parts and ended in "TypeError: object of type 'int' has no len()" from inside spmdkit."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(axes, is_leaf=_is_names)[0]:
        if not _is_names(leaf):  # a P's mesh axes are named where read
            where = "state_axes" + jax.tree_util.keystr(path)
            raise LayoutError(fix(f"{where} is {leaf!r:.60} ({type(leaf).__name__}), not a logical name.",
                                  "give each array a tuple of logical names, one per dimension, each a string or "
                                  "None (replicated), e.g. ('embed', 'hidden'); None for the whole array."))


def _axes_parts(axes: Any) -> list[list]:
    """``[path, structure, names, shapes (None until learned)]`` of ``axes`` and of every part of it."""
    parts = []
    for path, sub in _subtrees(axes):
        treedef = jax.tree.structure(sub, is_leaf=_is_names)
        if treedef.num_leaves:
            parts.append([path, treedef, jax.tree.leaves(sub, is_leaf=_is_names), None])
    return parts


def _fits(part: list, x: Any) -> bool:
    if _is_box(x):
        return False
    # A masked optimizer's (optax.masked, multi_transform) moments hold a MaskedNode where a
    # parameter is not its own: a slot of the params' structure with nothing to name. Their
    # moments were left replicated, as if state_axes did not reach them.
    leaves, treedef = jax.tree.flatten(x, is_leaf=_is_slot)
    _, want, names, shapes = part
    if treedef != want or all(_is_masked(leaf) for leaf in leaves):
        return False
    return all(_is_slot(leaf) or n is None or len(n) == len(leaf.shape) for leaf, n in zip(leaves, names)) \
        and (shapes is None or all(_is_masked(leaf) or tuple(getattr(leaf, "shape", ())) == shape
                                   for leaf, shape in zip(leaves, shapes)))


def _raw_key(entry: Any) -> Any:
    """The dict key, index or attribute name of a pytree path entry."""
    for field in ("key", "idx", "name"):
        if hasattr(entry, field):
            return getattr(entry, field)
    return entry


def _a_siblings(part: list, key: Any, axes: Any) -> bool:
    """Whether a subtree under ``key`` is another entry of the container that holds ``part`` in
    ``state_axes`` (``{"enc": ENC, "head": None}``: enc's names are not head's)."""
    if not part[0] or key is None:
        return False
    parent = _at(axes, part[0][:-1])
    keys = parent.keys() if isinstance(parent, dict) else range(len(parent))
    return key != part[0][-1] and key in keys


def _match_part(parts: list[list], x: Any, key: Any = None, axes: Any = None) -> list | None:
    """The one part that fits ``x`` (under ``key`` in its parent; not a part whose sibling in
    ``axes`` that key is), None if none does; two that fit with different names: an error."""
    found = [part for part in parts if _fits(part, x) and not _a_siblings(part, key, axes)]
    if len(found) > 1 and found[0][0] != () and len({tuple(map(str, p[2])) for p in found}) > 1:
        raise LayoutError(
            fix(f"state_axes parts {[jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in p[0])) for p in found]} "
                f"both fit a part of the state with shapes {_shapes(x)}"
                + (f" (under the key {key!r})" if key is not None else "") + "; spmdkit will not guess which.",
                _misspelt(found, key, axes)
                or "give state_axes the structure of the whole state (names for every copy of the params).")
        )
    return found[0] if found else None


def _misspelt(found: list[list], key: Any, axes: Any) -> str | None:
    """The fix when the parts are entries of one dict of ``state_axes`` that has no entry ``key``
    (the state's), one of them named like it (``"haed"`` for ``"head"``): a misspelt key, whose
    part then fitted its sibling's subtree as well as its own."""
    paths = {tuple(p[0][:-1]) for p in found}
    if key is None or len(paths) != 1:
        return None
    parent = _at(axes, next(iter(paths)))
    if not isinstance(parent, dict) or key in parent:
        return None
    at = "state_axes" + "".join(f"[{k!r}]" for k in next(iter(paths)))
    close = difflib.get_close_matches(str(key), [str(p[0][-1]) for p in found], n=1, cutoff=0.5)
    how = f"rename {at}[{close[0]!r}] to {key!r}" if close else f"give {at} an entry {key!r}"
    return f"{at} has no entry {key!r} (it has {sorted(map(str, parent))}): {how}, the state's key."


def _unmatched(state: Any, axes: Any) -> LayoutError:
    lists = _none_lists(axes)
    return LayoutError(
        fix(f"state_axes (structure {jax.tree.structure(axes, is_leaf=_is_names)}) matches neither the state "
            f"nor any part of it (state structure {jax.tree.structure(state, is_leaf=_is_box)}).",
            "give state_axes the structure of the state, or of its params (a tuple of logical "
            "names per array, None to replicate)."
            + (f" state_axes{lists[0]} is a list of only None, read as a list of parts: write the "
               "names of one array as a tuple, e.g. (None, None)." if lists else ""))
    )


def _none_lists(axes: Any, path: str = "") -> list[str]:
    """Where ``axes`` holds a non-empty list of only ``None``s (names, or a list of parts?)."""
    if isinstance(axes, list) and axes and all(n is None for n in axes):
        return [path]
    items = axes.items() if isinstance(axes, dict) else enumerate(axes) if isinstance(axes, (list, tuple)) else ()
    return [p for k, v in items for p in _none_lists(v, f"{path}[{k!r}]")]
