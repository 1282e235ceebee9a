"""The step transform every strategy shares: ``init``, ``step``, ``apply``, ``shardings``.

A user writes ``make_state(rng)``, ``train_step(state, batch)`` and ``fn(state, batch)``
for one device. A strategy says where the state and the batch live (a few small hooks);
this module compiles the user's functions once per input signature with those
shardings, places host or device batches (an uneven one whole on every device, or for a
``rowwise`` apply padded with its last row and split), checks what the user's functions
return while tracing, and gives the model a mesh to constrain its activations against.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax import nnx
from flax.core import meta
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from spmdkit._cache import off_for_several_processes
from spmdkit._errors import (AxisNameError, BatchSizeError, DonatedStateError, MeshError, SignatureError, SpmdkitError,
                             StepOutputError, TreeMismatchError, fix)
from spmdkit._mesh import make_mesh
from spmdkit._strategies._agree import check_same_batch, check_same_key, check_same_state
from spmdkit._rules import AxisRules, LayoutError
from spmdkit._tree import bad_dtype, tree_difference
from spmdkit._types import ApplyFn, Batch, MakeState, State, TrainStepFn

# How JAX reports a constraint naming a mesh axis the context mesh lacks (0.10 and 0.12).
_MISSING_AXIS = re.compile(r"Resource axis: (\w+) of (.*) is not found in mesh")


def auto_mesh(mesh: Any, argument: str = "mesh") -> Mesh:
    """``mesh`` with every axis ``Auto``: meshes from ``jax.make_mesh`` (``Explicit`` axes)
    are accepted and re-declared, since spmdkit places arrays by sharding propagation. A
    dict ``{"data": 2, "model": 4}`` is built over every device, as :func:`make_mesh` does."""
    if isinstance(mesh, Mapping) and all(isinstance(k, str) for k in mesh):
        return make_mesh(**mesh)
    if not isinstance(mesh, Mesh):
        raise MeshError(
            fix(f"{argument}={mesh!r} is not a jax.sharding.Mesh or a dict of axis sizes.",
                "build one with spmdkit.make_mesh(data=-1, ...), or pass {'data': 2, 'model': 4}.")
        )
    types = getattr(mesh, "axis_types", None)
    if types is None or all(t == AxisType.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def as_key(rng: Any, argument: str = "rng") -> jax.Array:
    """A PRNG key from a key array, a raw ``PRNGKey`` or an int seed."""
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return jax.random.key(int(rng))
    shape, dtype = np.shape(rng), getattr(rng, "dtype", None)
    if dtype is not None and (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or (shape == (2,) and dtype == np.uint32)):
        return rng
    raise SignatureError(
        fix(f"{argument} must be a PRNG key (jax.random.key(0)) or an int seed, not {type(rng).__name__} "
            f"with shape {shape}.", f"pass {argument}=jax.random.key(0).")
    )


def batch_rows(batch: Batch, argument: str = "batch") -> int:
    """The number of examples of a batch: every leaf's leading axis, all equal."""
    # Fast path (every call of a step): arrays whose leading sizes agree.
    shapes = [getattr(x, "shape", None) for x in jax.tree.leaves(batch)]
    if shapes and all(shapes) and len({shape[0] for shape in shapes}) == 1:
        return shapes[0][0]
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise BatchSizeError(fix(f"{argument} holds no arrays.", f"pass e.g. {argument}={{'x': x, 'y': y}}."))
    first, n = None, None
    for path, x in leaves:
        where = argument + jax.tree_util.keystr(path)
        shape = np.shape(x)
        if not shape:
            raise BatchSizeError(
                fix(f"{where} is a scalar; every leaf of a batch needs a leading example axis, which is "
                    "what the strategy splits over the devices.",
                    "keep constants in the state or close over them; pass per-example arrays [B, ...].")
            )
        if n is None:
            first, n = where, shape[0]
        elif shape[0] != n:
            raise BatchSizeError(
                fix(f"{argument} has leaves with different numbers of examples: {first} has {n}, "
                    f"{where} has {shape[0]}.", "give every leaf of a batch the same leading size.")
            )
    return n


def place(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """Host or device arrays onto ``sharding``; arrays already there are not touched.

    With several processes every process holds the same global host batch and hands
    JAX only the rows its devices hold.
    """
    leaves = jax.tree.leaves(tree)
    if all(isinstance(x, jax.Array) and x.sharding == sharding for x in leaves):
        return tree
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    from spmdkit._strategies._base import put_global

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)
        return put_global(np.asarray(x), sharding)

    return jax.tree.map(one, tree)


def unbox_tree(tree: Any) -> Any:
    """Flax partitioning boxes removed; layout metadata is read from the abstract state."""
    return meta.unbox(tree)


def with_size1_axes(mesh: Mesh, extra_axes: tuple[str, ...]) -> Mesh:
    """``mesh`` with size-1 axes ``extra_axes`` appended (the same devices)."""
    if not extra_axes:
        return mesh
    names = tuple(mesh.axis_names) + tuple(extra_axes)
    devices = mesh.devices.reshape(*mesh.devices.shape, *(1 for _ in extra_axes))
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


# A user's own jax.jit inside their step is cached by JAX's trace context, which knows the
# mesh but not Flax's rules nor spmdkit's check: reused under another strategy's rules, the
# trace made under the first rules was replayed (their constraints, their check or none).
# Its value, the rules and whether they are checked, is part of every jit cache key.
# Both supported JAX versions (0.10.2, 0.12) have make_user_context; a JAX without it keeps
# that reuse (the constraints of whichever rules traced the inner function first).
_RULES_IN_CACHE_KEY = jax.make_user_context(None) if hasattr(jax, "make_user_context") else None


class TraceContext:
    """What the user's function is traced under: the mesh (so ``with_sharding_constraint``
    resolves), the logical axis rules (``nn.with_logical_constraint``; a name they do not map
    is a ``LayoutError``, see :func:`_install_checks`) and NNX's eager sharding off
    (spmdkit places variables itself, from their metadata).

    ``extra_axes`` are size-1 mesh axes a model constrains over that the strategy's mesh
    lacks (``P('data', 'model')`` on a data-parallel mesh): sharding over a size-1 axis
    is replication, so the model runs unchanged.
    """

    def __init__(self, mesh: Mesh, rules: AxisRules | None = None, extra_axes: tuple[str, ...] = (),
                 check: bool = True):
        self._abstract = with_size1_axes(mesh, extra_axes).abstract_mesh
        self._mesh_shape = dict(mesh.shape)
        self._rules = rules
        self._check = check
        self._entered: list[list[Any]] = []  # re-entrant: each trace enters fresh contexts

    def __enter__(self):
        contexts = [jax.sharding.use_abstract_mesh(self._abstract), nnx.use_eager_sharding(False)]
        if self._rules is not None:
            if _RULES_IN_CACHE_KEY is not None:
                contexts.append(_RULES_IN_CACHE_KEY((self._rules, self._check)))
            contexts.append(nn.logical_axis_rules(self._rules.flax_rules()))
            if self._check:
                _check_constraints()
                contexts.append(_setting(_CHECKED_RULES, (self._rules, self._mesh_shape)))
        for c in contexts:
            c.__enter__()
        self._entered.append(contexts)

    def __exit__(self, *exc):
        for c in reversed(self._entered.pop()):
            c.__exit__(*exc)


# The rules of the trace under way, whose activation constraints are checked, and its mesh's
# axis sizes (a mesh axis name written where a logical name belongs is named as such).
_CHECKED_RULES: contextvars.ContextVar[tuple[AxisRules, dict[str, int]] | None] = contextvars.ContextVar(
    "spmdkit_rules", default=None)
# Inside a parameter's unboxing: its names are spmdkit's to check, with the parameter's path.
_UNBOXING: contextvars.ContextVar[bool] = contextvars.ContextVar("spmdkit_unboxing", default=False)
# Inside a constraint whose user asked that unmapped names constrain nothing (fallback=NO_CONSTRAINT).
_UNCONSTRAINED_OK: contextvars.ContextVar[bool] = contextvars.ContextVar("spmdkit_no_constraint", default=False)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value: Any = True):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def _check_constraints() -> None:
    """Make Flax's mapping of logical names to mesh axes check them against spmdkit's rules
    (see :func:`_install_checks`)."""
    from flax.linen import spmd

    _install_checks(spmd)


def _install_checks(spmd: Any) -> bool:
    """Patch Flax's ``spmd`` module so that its logical constraints are checked; False if it
    lacks a function the check needs (that Flax then runs unchecked) or is patched already.

    Flax maps a name that no rule lists to ``None``: ``nn.with_logical_constraint(x, ("batch",
    "length"))`` under rules without ``length`` silently replicated that dimension of the
    activation. The check sits in Flax's private ``_logical_to_mesh_axes`` that every
    logical constraint goes through; it checks only inside spmdkit's traces, only the rules
    spmdkit set (a user's own ``rules=`` argument or ``nn.logical_axis_rules`` context is theirs),
    not while Flax unboxes a parameter (spmdkit's layout names an unmapped parameter by its
    path), and not under ``fallback=RulesFallback.NO_CONSTRAINT``, whose user asked that an
    unmapped name constrain nothing (Flax's ``_with_sharding_constraint_one_fallback`` is the
    one place that knows the fallback: without it such a call could not be told apart, and
    refusing it would break a valid program, so nothing is checked).
    """
    original = getattr(spmd, "_logical_to_mesh_axes", None)
    one_fallback = getattr(spmd, "_with_sharding_constraint_one_fallback", None)
    fallbacks = getattr(spmd, "RulesFallback", None)
    boxed = getattr(spmd, "LogicallyPartitioned", None)
    if (original is None or one_fallback is None or boxed is None or getattr(fallbacks, "NO_CONSTRAINT", None) is None
            or getattr(original, "_spmdkit_checked", False)):
        return False
    unbox = boxed.unbox

    def checked(array_dim_names, rules=None):
        checking = _CHECKED_RULES.get()
        if checking is not None and array_dim_names is not None and not _UNBOXING.get() and not _UNCONSTRAINED_OK.get():
            ours, mesh_shape = checking
            # the rules in force: a rules= argument, else the innermost nn.logical_axis_rules,
            # which may be the user's own context inside their step
            in_force = spmd.get_logical_axis_rules() if rules is None else rules
            if tuple(map(tuple, in_force)) == tuple(map(tuple, ours.flax_rules())):
                ours.check_constraint(array_dim_names, mesh_shape)
        return original(array_dim_names, rules)

    def constrained_one(*args, **kwargs):
        fallback = kwargs.get("fallback", args[2] if len(args) > 2 else None)
        if fallback != fallbacks.NO_CONSTRAINT:
            return one_fallback(*args, **kwargs)
        with _setting(_UNCONSTRAINED_OK):
            return one_fallback(*args, **kwargs)

    def unbox_parameter(self, *args, **kwargs):
        with _setting(_UNBOXING):
            return unbox(self, *args, **kwargs)

    checked._spmdkit_checked = True  # type: ignore[attr-defined]
    boxed.unbox = unbox_parameter
    spmd._with_sharding_constraint_one_fallback = constrained_one
    spmd._logical_to_mesh_axes = checked
    return True


def missing_axis(error: Exception) -> str | None:
    """The mesh axis a sharding constraint named that the context mesh lacks, if that was it."""
    found = _MISSING_AXIS.search(str(error))
    return None if found is None else found.group(1)


def logical_name_as_mesh_axis(error: Exception, axis: str, rules: AxisRules, mesh: Mesh) -> LayoutError:
    """The error for ``jax.lax.with_sharding_constraint(x, P('batch', None))`` written with a
    logical name: taken as a missing mesh axis, it became a size-1 axis, so the dimension
    was silently replicated where the rules shard it."""
    found = _MISSING_AXIS.search(str(error))
    spec = found.group(2) if found else f"P({axis!r}, ...)"
    names = re.sub(r"^(P|PartitionSpec)(?=\()", "", spec)
    names = names if "," in names else names[:-1] + ",)"
    axes = rules.mapping[axis]
    target = "None (replicated)" if axes is None else f"mesh axis {axes!r}" if isinstance(axes, str) else f"mesh axes {axes!r}"
    return LayoutError(fix(
        f"a sharding constraint jax.lax.with_sharding_constraint(x, {spec}) names {axis!r}, a logical name "
        f"of rules {rules.name!r} (which map it to {target}), not an axis of the mesh {dict(mesh.shape)}: "
        f"with_sharding_constraint takes mesh axis names, and {axis!r} would have been a size-1 axis, "
        "leaving that dimension replicated.",
        f"constrain by logical names with nn.with_logical_constraint(x, {names}), or write {axes!r} in place "
        f"of {axis!r} (what the rules map it to)."))


# The spec may hold tuples (a name mapped to several mesh axes) and, for a concrete mesh, a memory kind.
_RANK_TOO_LOW = re.compile(r"spec=(P\((?:[^()]|\([^()]*\))*\))(?:, memory_kind=\w+)?\)? is only valid for values of "
                           r"rank at least (\d+), but was applied to a value of rank (\d+)")


def constraint_of_other_rank(error: Exception) -> LayoutError | None:
    """Flax's raw ValueError for a sharding constraint with more names than its value has
    dimensions, with its usual cause: ``nn.DenseGeneral(features=(heads, kv), kernel_init=
    nn.with_logical_partitioning(..., ('embed', 'heads', 'kv')))`` constrains the kernel while it
    is still 2-D, before its reshape (under ``jax.set_mesh``, which spmdkit traces in)."""
    found = _RANK_TOO_LOW.search(str(error))
    if found is None:
        return None
    spec, rank, got = found.groups()
    in_dense_general = any(code.co_name == "kernel_init_wrap" for code in _frames(error.__traceback__))
    cause = (" Flax's nn.DenseGeneral with several features (or axes) applies its kernel's logical names before "
             "it reshapes the kernel to their rank." if in_dense_general else "")
    return LayoutError(fix(
        f"a sharding constraint {spec} (rank {rank}) was applied to a value of rank {got} while tracing "
        f"(JAX's with_sharding_constraint refused it).{cause}",
        "give the layer names of the value's own rank: an nn.Dense(heads * kv) with 2 names, then a reshape "
        "(the reshaped activation constrained with nn.with_logical_constraint), or a DenseGeneral of one feature "
        "axis." if in_dense_general else "give the constraint as many names as its value has dimensions."))


def _frames(tb: Any) -> list[Any]:
    """The code objects of a traceback, outermost first."""
    out = []
    while tb is not None:
        out.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return out


def _arrays_only(make_state: MakeState) -> MakeState:
    """``make_state`` whose state is checked while tracing: a string or an object in it made
    jax fail with a message of its own (no path under an ensemble's vmap)."""

    def make(rng: jax.Array) -> State:
        state = make_state(rng)
        found = non_array_leaf(state)
        if found is not None:
            path, x = found
            raise StepOutputError(fix(
                f"make_state returned {type(x).__name__} {x!r:.40} at state{path}; a "
                "state holds arrays only (it is placed on devices and checkpointed).",
                "keep it outside the state (a closure, your config), or in a field the pytree does not "
                "carry (flax.struct.field(pytree_node=False))."))
        return state

    return make


def non_array_leaf(state: Any, is_leaf: Callable[[Any], bool] | None = None,
                   value: Callable[[Any], Any] = lambda leaf: leaf) -> tuple[str, Any] | None:
    """``(path, value)`` of the first leaf of ``state`` that is neither an array of numbers nor a number
    (``is_leaf``/``value``: stop at layout boxes and look inside them), or None."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_leaf)[0]:
        x = value(leaf)
        # a numpy array of strings or objects too: JAX refused it without naming make_state
        if not isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)) or bad_dtype(x) is not None:
            return jax.tree_util.keystr(path), x
    return None


def check_callable(fn: Any, argument: str, signature: str) -> None:
    if not callable(fn):
        raise SignatureError(fix(f"{argument} must be a function {signature}, not {type(fn).__name__}.",
                            f"pass {argument}=a function {signature}."))


def check_make_state(make_state: Any) -> None:
    """``make_state`` a function of one argument, the key: checked before tracing, since a
    wrong arity otherwise fails inside ``jax.eval_shape`` with Python's bare TypeError."""
    check_callable(make_state, "make_state", "rng -> state")
    try:
        signature = inspect.signature(make_state)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): calling it will tell
    try:
        signature.bind(0)
    except TypeError:
        name = getattr(make_state, "__name__", type(make_state).__name__)
        raise SignatureError(fix(f"make_state must take one argument, the PRNG key (it builds the state from it); "
                                 f"{name}{signature} does not.",
                                 "pass make_state=lambda rng: {...}, e.g. lambda rng: model.init(rng, x).")) from None


def check_state_batch(fn: Any, argument: str, signature: str) -> None:
    """``fn`` a function called as ``fn(state, batch)``: checked when the step is built, since a
    step written like a Task's ``loss_fn(params, batch, rng)`` failed inside the trace with
    Python's bare TypeError (``missing 1 required positional argument: 'rng'``)."""
    check_callable(fn, argument, signature)
    try:
        # A decorator's own signature first: functools.wraps around f(params, batch, rng) that
        # supplies the key is (state, batch) itself, though __wrapped__ says otherwise.
        outer = inspect.signature(fn, follow_wrapped=False)
        if _takes_two(outer) and not _only_varargs(outer):
            return
        found = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): calling it will tell
    if not _takes_two(found):
        name = getattr(fn, "__name__", type(fn).__name__)
        raise SignatureError(fix(
            f"{argument} must take two arguments, the state and the batch, as the strategy calls it "
            f"{argument}(state, batch); {name}{found} does not.",
            "write it as def f(state, batch): ...; keep a PRNG key in the state and split it in the step "
            "(key, sub = jax.random.split(state['key'])), and bind other values beforehand "
            "(functools.partial(f, config=...)).")) from None


def _takes_two(sig: inspect.Signature) -> bool:
    try:
        sig.bind(0, 0)
        return True
    except TypeError:
        return False


def _only_varargs(sig: inspect.Signature) -> bool:
    """(*args, **kwargs): a wrapper that says nothing of what it passes on (jax.checkpoint)."""
    return all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values())


class Placement:
    """``init``/``step``/``apply``/``shardings``, on top of a strategy's placement hooks.

    A strategy sets ``self.mesh`` and implements:

    - ``_make(make_state)``: ``rng -> state`` for the whole strategy (ensembles vmap),
      layout metadata (Flax boxes) kept;
    - ``shardings(abstract_state)``: the public layout of every leaf;
    - ``_state_shardings(state)``: the shardings of a state (a prefix tree is fine);
    - ``_batch_sharding(even)``: where a batch goes; ``even`` says whether its rows
      split over ``batch_shards``;
    - ``_lift(fn, kind)``: the user's function over the whole state (ensembles map
      it over members); ``kind`` is ``"step"`` or ``"apply"``;
    - ``_rules()``: the logical axis rules (``AxisRules``) the user's functions are traced under, or None.
    """

    mesh: Mesh
    batch_shards: int
    # Outputs of apply carry the examples on this axis (ensembles: 1, after the members).
    _row_axis = 0

    # ---- hooks ------------------------------------------------------------------
    def _make(self, make_state: MakeState) -> Callable[[jax.Array], State]:
        return make_state

    def _init_key(self, rng: jax.Array) -> jax.Array:
        return rng

    def _lift(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        return fn

    def _rules(self) -> Any:
        return None

    def _aux_sharding(self) -> Any:
        # One process: wherever XLA leaves it. Several: replicated, so every process can read it.
        return None if jax.process_count() == 1 else NamedSharding(self.mesh, P())

    def _after_init(self, state: State) -> State:
        return state

    def _batch_sharding_for(self, kind: str, even: bool) -> Any:
        return self._batch_sharding(even)

    def _check_state(self, state: State, leaves: list[Any]) -> None:
        """Refuse a state this strategy cannot run, before tracing (ensembles: member axis)."""

    def _check_batch(self, kind: str, rows: int, batch: Batch) -> None:
        """Refuse a batch of a layout this strategy does not take (bagging: one share per member)."""

    def _check_step_output(self, state: State) -> None:
        """After a step: refuse a new state that undid what ``init`` set up (ensembles: the
        members' own hyperparameters)."""

    def _check_new_state(self, state: State) -> None:
        """Before the first trace of a state's structure: an ensemble's state is named here,
        where tracing would fail inside the user's function on its stacked shapes."""
        if _stacked(state, self.mesh) is not None:
            self._foreign_state(state)

    def _foreign_state(self, state: State) -> None:
        """After jit refused the state's layout: if every leaf is split along a leading axis
        of one size over a 1-D mesh that is not ours, it is an ensemble's state; say so."""
        stacked = _stacked(state, self.mesh)
        if stacked is None:
            self._other_layout(state)
            return
        path, x = stacked
        k, axis = x.shape[0], x.sharding.mesh.axis_names[0]
        if axis == "replica":  # spmdkit.replicate's axis: pmap's layout, one copy per device
            raise LayoutError(fix(
                f"state{jax.tree_util.keystr(path)} has shape {x.shape}: one copy per device, as "
                f"spmdkit.replicate lays out a state for pmap; {type(self).__name__} takes the state itself.",
                "pass spmdkit.unreplicate(state) (or the state before replicate)."))
        raise LayoutError(
            fix(f"state{jax.tree_util.keystr(path)} has shape {x.shape}, split along its leading axis over mesh "
                f"axis {axis!r} ({dict(x.sharding.mesh.shape)}), as is every leaf: this is an ensemble's state "
                f"({k} members stacked on a leading member axis), which {type(self).__name__} does not run.",
                "run it with the ensemble that made it (ensemble.step / ensemble.apply), or take one member: "
                "jax.tree.map(lambda x: x[i], state).")
        )

    def _other_layout(self, state: State) -> None:
        """A state laid out on another mesh (a Sharded strategy's, another device set): name
        the first such leaf, its mesh and spec, and how to move it."""
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            sh = getattr(x, "sharding", None)
            if isinstance(sh, NamedSharding) and sh.mesh != self.mesh:
                raise LayoutError(fix(
                    f"state{jax.tree_util.keystr(path)} (shape {np.shape(x)}) is laid out on another mesh "
                    f"({dict(sh.mesh.shape)}, spec {sh.spec}) than {type(self).__name__}'s "
                    f"({dict(self.mesh.shape)}): another strategy placed it.",
                    "move it onto this strategy's layout: state = jax.device_put(state, strategy.shardings(state)), "
                    "or build it with strategy.init (a checkpoint restores onto any layout)."))

    # ---- shared machinery -------------------------------------------------------
    def _context(self, check: bool = True) -> TraceContext:
        return TraceContext(self.mesh, self._rules(), getattr(self, "_extra_axes", ()), check)

    def _traced(self, run: Callable[[], Any]) -> Any:
        """Run (and so trace) a compiled call; if a sharding constraint names a mesh axis
        the mesh lacks, add it as a size-1 axis and trace again (see TraceContext), unless
        the name is one of the rules' logical names (a LayoutError)."""
        while True:
            try:
                return run()
            except ValueError as e:
                other_rank = constraint_of_other_rank(e)
                if other_rank is not None:
                    raise other_rank from None
                axis = missing_axis(e)
                extra = getattr(self, "_extra_axes", ())
                if axis is None or axis in extra or axis in self.mesh.axis_names:
                    raise
                rules = self._rules()
                if rules is not None and axis in rules.mapping:
                    raise logical_name_as_mesh_axis(e, axis, rules, self.mesh) from None
                self._extra_axes = extra + (axis,)

    def _abstract_boxed(self, make: Callable[[jax.Array], State], rng: jax.Array) -> State:
        """Shapes of the state, Flax/NNX layout metadata kept; nothing is allocated."""

        def run():
            # Activations are not checked here: the layout that follows names an unmapped
            # parameter by its path, and the step's trace checks the activations.
            with self._context(check=False):
                return jax.eval_shape(make, rng)

        return self._traced(run)

    def init(self, make_state: MakeState, rng: Any, *, unbox: bool = False) -> State:
        """The initial state from ``make_state(rng)`` (written for one device), created
        directly where this strategy keeps it.

        ``make_state`` may return any pytree: a dict, a Flax ``TrainState`` (subclass),
        the state of ``nnx.split``, several optimizers' states. The state is what
        ``jax.jit(make_state)`` returns, Flax partitioning boxes (``nn.Partitioned``)
        included; ``unbox=True`` removes them (``flax.core.meta.unbox``), their layout
        still applied.
        """
        check_make_state(make_state)
        rng = as_key(rng)
        check_same_key(rng, self.mesh, f"{type(self).__name__}.init")
        rng = self._init_key(rng)
        make = self._make(_arrays_only(make_state))
        shardings = self.shardings(check_same_state(lambda: self._abstract_boxed(make, rng), self.mesh,
                                                    f"{type(self).__name__}.init"))
        strip = unbox_tree if unbox else (lambda tree: tree)

        def build():
            cache = self.__dict__.setdefault("_init_cache", {})
            key = (make_state, unbox, getattr(self, "_extra_axes", ()), tuple(jax.tree.leaves(shardings)))
            if key in cache:  # one compile per make_state, whatever the key
                jitted, treedef = cache[key]
                return jax.tree.unflatten(treedef[-1], jitted(rng))
            context, treedef = self._context(), []

            # Leaves, not the tree, leave jit: a state's static fields (a Flax TrainState's
            # ``tx`` built inside make_state) differ between traces, so trees would not match.
            # A box holds its array as its one leaf, so boxed and unboxed leaves line up.
            def traced(key):
                with context:
                    leaves, structure = jax.tree.flatten(strip(make(key)))
                treedef.append(structure)
                return leaves

            jitted = jax.jit(traced, out_shardings=jax.tree.leaves(shardings))
            leaves = jitted(rng)
            cache[key] = (jitted, treedef)
            return jax.tree.unflatten(treedef[-1], leaves)

        return self._after_init(self._traced(build))

    def abstract(self, make_state: MakeState, rng: Any = 0, *, unbox: bool = False) -> State:
        """The state's shapes and dtypes with this strategy's shardings, allocating nothing:
        the target a checkpoint restores into (the structure ``init`` returns)."""
        check_make_state(make_state)
        boxed = self._abstract_boxed(self._make(_arrays_only(make_state)), self._init_key(as_key(rng)))
        shardings = jax.tree.leaves(self.shardings(boxed))
        tree = unbox_tree(boxed) if unbox else boxed
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
                                            for x, sh in zip(leaves, shardings)])

    def step(self, train_step: TrainStepFn, *, donate: bool = False) -> Callable[[State, Batch], tuple[State, Any]]:
        """``train_step(state, batch) -> (state, aux)``, written for one device, compiled
        for this strategy: ``step(state, batch)`` takes the *global* batch (host or device
        arrays) and computes what ``jax.jit(train_step)`` computes on one device.

        ``donate=True`` lets the new state reuse the old state's memory: the old state
        must not be used afterwards (passing it again raises ``DonatedStateError``).

        The returned state must have the structure, shapes and dtypes of the state passed
        in (it is the next step's input), and ``aux`` arrays or numbers only; both are
        checked while tracing, at no cost per step.
        """
        check_state_batch(train_step, "train_step", "(state, batch) -> (state, aux)")
        return self._compiled(train_step, "step", donate)

    def _compiled(self, fn: Callable[..., Any], kind: str, donate: bool, rowwise: bool = False) -> CompiledStep:
        """One CompiledStep per function: ``strategy.step(f)(...)`` written inline in a loop
        compiles once."""
        cache = self.__dict__.setdefault("_compiled_fns", {})
        key = (fn, kind, donate, rowwise)
        if key not in cache:
            cache[key] = CompiledStep(self, fn, kind, donate, rowwise)
        return cache[key]

    def evaluate(self, fn: Callable[[State, Batch], Any]) -> Callable[[State, Batch], Any]:
        """``fn(state, batch) -> values`` (metrics of any shape), compiled like ``step``:
        the program ``jax.jit(fn)`` runs on one device, on the exact global batch
        (nothing padded), without returning a state. Ensembles: one value per member."""
        check_state_batch(fn, "fn", "(state, batch) -> values")
        return self._compiled(fn, "eval", False)

    def apply(self, fn: ApplyFn, *, rowwise: bool | str = False) -> Callable[[State, Batch], Any]:
        """``fn(state, batch) -> per-example outputs [B, ...]`` for any batch size B, exactly B
        rows back.

        By default ``fn`` sees the exact batch, never padding rows, so it may mix rows (batch
        statistics, a softmax over the batch): a B that does not split over the devices
        runs whole on every device, like ``step`` (exact, not parallel).

        ``rowwise=True`` declares that ``fn`` treats rows independently (row i of the output
        depends only on row i of the batch: a forward pass in inference mode). An uneven
        batch is then padded up to a multiple of the devices by repeating its last row
        (not zeros, so a function that divides by row values stays finite), run split
        over the devices, and the padding rows are dropped.

        Warning: ``rowwise=True`` on a function that mixes rows (a softmax over the batch,
        a batch mean or std, BatchNorm in training mode) gives silently wrong rows, but only
        for batches that do not split evenly: tests with even batch sizes never reveal it.
        Test the declaration once with an uneven batch against the default (exact) apply,
        or pass ``rowwise="check"``: it runs both on every uneven batch and raises
        ``BatchSizeError`` if they differ (a debugging aid: twice the work).

        Example:
            >>> import jax, jax.numpy as jnp, numpy as np, spmdkit
            >>> strategy = spmdkit.DataParallel()
            >>> state = strategy.init(lambda rng: {"w": jnp.full((3,), 2.0)}, 0)
            >>> predict = strategy.apply(lambda s, b: b["x"] @ s["w"], rowwise=True)
            >>> predict(state, {"x": np.ones((5, 3), np.float32)}).shape   # 5 rows on 8 devices
            (5,)
        """
        check_state_batch(fn, "fn", "(state, batch) -> outputs [B, ...]")
        if rowwise == "check":
            return _RowwiseCheck(self._compiled(fn, "apply", False, True), self._compiled(fn, "apply", False, False))
        if not isinstance(rowwise, bool):
            raise SignatureError(fix(f"rowwise={rowwise!r} must be True, False or \"check\".",
                                "pass rowwise=True only if fn treats every row of the batch on its own."))
        return self._compiled(fn, "apply", False, rowwise)


class _RowwiseCheck:
    """``apply(fn, rowwise="check")``: the padded, split path checked against the exact one."""

    def __init__(self, rowwise: CompiledStep, exact: CompiledStep):
        self.rowwise, self.exact = rowwise, exact
        self.__wrapped__ = exact.fn

    def __call__(self, state: State, batch: Batch) -> Any:
        out = self.rowwise(state, batch)
        n, shards = batch_rows(batch), self.exact.strategy.batch_shards
        if n % shards == 0:
            return out  # nothing padded: both paths are one program
        want = self.exact(state, batch)
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(out)[0], jax.tree.leaves(want)):
            a, b = np.asarray(a), np.asarray(b)
            if not np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True):
                err = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                raise BatchSizeError(
                    fix(f"apply(fn, rowwise=\"check\"): on a batch of {n} rows (padded to a multiple of "
                        f"{shards}), output{jax.tree_util.keystr(path)} differs from the exact apply by up to "
                        f"{err:.3g}: fn mixes rows (a softmax over the batch, batch statistics), so "
                        "rowwise=True would give wrong rows for uneven batches.",
                        "use the default apply(fn) (exact for any batch), or make fn treat rows independently.")
                )
        return out


_CALLS = {"step": "step(train_step)", "eval": "evaluate(fn)", "apply": "apply(fn)"}


class CompiledStep:
    """What ``strategy.step`` / ``strategy.apply`` return; compiled once per signature."""

    def __init__(self, strategy: Placement, fn: Callable[..., Any], kind: str, donate: bool, rowwise: bool = False):
        self.strategy = strategy
        self.fn = fn
        self.kind = kind
        self.donate = donate
        self.rowwise = rowwise
        self._compiled: dict[Any, Any] = {}
        self._agreed = False  # the processes' batches compared (at the first call)
        self.__wrapped__ = fn

    def _build(self, state: State, even: bool, keep: int | None = None):
        """The jitted program; ``keep``: a padded apply's real rows, cut inside the program
        (one dispatch less than slicing the sharded output afterwards)."""
        s = self.strategy
        state_sh = s._state_shardings(state)
        batch_sh = s._batch_sharding_for(self.kind, even)
        lifted = s._lift(_checked(self.fn, self.kind), self.kind)
        context = s._context()
        # On a mesh of two or more axes, XLA:CPU before jax 0.12.1 mis-partitions an unevenly split
        # gather or scatter (see _split_evenly): an even batch meets it too, as a grad_accum micro-batch (24
        # rows, 4 micro-batches of 6 over data=4) or a constraint on another dimension.
        several_axes = sum(size > 1 for size in dict(getattr(s.mesh, "shape", {})).values()) > 1
        rewrite = UNEVEN_CONSTRAINTS_MISCOMPILE and (several_axes or not even)
        if UNEVEN_CONSTRAINTS_MISCOMPILE and several_axes:
            _warn_old_xla(s.mesh)
        if jax.process_count() > 1:  # a job joined by the script's own jax.distributed.initialize
            off_for_several_processes(jax.process_count(), stacklevel=6)  # the caller of step(...)(state, batch)

        def run(state, batch):
            with context:
                out = _split_evenly(lifted)(state, batch) if rewrite else lifted(state, batch)
            if keep is None:
                return out
            _check_per_example(out, batch_rows(batch), s._row_axis, padded_from=keep)
            return jax.tree.map(lambda x: jax.lax.slice_in_dim(x, 0, keep, axis=s._row_axis), out)

        out = (state_sh, s._aux_sharding()) if self.kind == "step" else s._aux_sharding()
        return jax.jit(run, in_shardings=(state_sh, batch_sh), out_shardings=out,
                       donate_argnums=(0,) if self.donate else ())

    def _check_rows(self, rows: int, batch: Batch) -> None:
        """A train step on no examples: its mean loss and gradients are NaN, and the state became
        NaN without a word (an empty last piece of a data pipeline). An apply or eval may take none."""
        if rows == 0 and self.kind == "step":
            path, x = jax.tree_util.tree_flatten_with_path(batch)[0][0]
            raise BatchSizeError(fix(f"{type(self.strategy).__name__}.step(train_step)(state, batch): batch"
                                     f"{jax.tree_util.keystr(path)} has shape {tuple(np.shape(x))}, no examples: a "
                                     "mean over them is NaN and would become the new state.",
                                     "skip empty batches (an empty last piece of a data set), or drop_remainder "
                                     "in the pipeline."))

    def lower(self, state: State, batch: Batch) -> Any:
        """The program ``self(state, batch)`` runs, lowered (``jax.stages.Lowered``: read
        ``.compile().memory_analysis()`` or ``cost_analysis()``); ``state`` and ``batch``
        may be ``jax.ShapeDtypeStruct``s (``strategy.abstract``), nothing runs."""
        s = self.strategy
        rows = batch_rows(batch)
        self._check_rows(rows, batch)
        s._check_batch(self.kind, rows, batch)
        even, keep, placed = rows % s.batch_shards == 0, None, rows
        if not even and self.rowwise:
            # as __call__ runs it: padded to a multiple of the data axis and split, the padding cut
            # (lowered as given, it was the whole-batch program, which never runs here)
            placed, keep, even = -(-rows // s.batch_shards) * s.batch_shards, rows, True
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((placed, *np.shape(x)[1:]), x.dtype), batch)
        return s._traced(lambda: self._build(state, even, keep).lower(state, shapes))

    def __call__(self, state: State, batch: Batch):
        s = self.strategy
        n = batch_rows(batch)
        self._check_rows(n, batch)
        s._check_batch(self.kind, n, batch)
        if not self._agreed:
            # At the first call only, which every process makes: a check at each new batch
            # signature would run only in a process that saw one, and wait for the others forever.
            check_same_batch(batch, s.mesh, f"{type(s).__name__}.{_CALLS[self.kind]}(state, batch)")
            self._agreed = True
        even = n % s.batch_shards == 0
        rows, given = n, batch
        if not even and self.rowwise:
            # Rows are independent (the caller says so): pad, run split, drop the padding.
            rows, even = -(-n // s.batch_shards) * s.batch_shards, True
            batch = pad_rows(batch, n, rows)
        # Otherwise an uneven global batch is placed whole on every device: the program is
        # the same single-device program, so the result is exact (only less parallel).
        try:
            placed = place(batch, s._batch_sharding_for(self.kind, even))
        except TypeError:
            check_batch_dtypes(given)
            raise
        leaves, treedef = jax.tree.flatten(state)
        if self.donate:
            _DONATING[0] = True
        if _DONATING[0]:  # only a donating step deletes a state's arrays: others pay nothing
            _check_not_deleted(state, leaves)
        s._check_state(state, leaves)

        keep = n if rows != n else None

        def run():
            k = (treedef, even, getattr(s, "_extra_axes", ()), keep)
            if k not in self._compiled:
                s._check_new_state(state)
                self._compiled[k] = self._build(state, even, keep)
            return self._compiled[k](state, placed)

        try:
            out = s._traced(run)
        except (TypeError, ValueError) as e:
            if not isinstance(e, SpmdkitError):
                # jit refuses a state committed to another layout: say whose it looks like.
                if "does not match the sharding" in str(e):
                    s._foreign_state(state)
                # New shapes of a structure compiled before trace again, unchecked: an ensemble's
                # stacked state failed inside the user's step (a dot of (3,) and (4,)), unnamed.
                s._check_new_state(state)
            raise
        if self.kind == "apply":
            _check_per_example(out, n, s._row_axis)
        if self.kind == "step":
            s._check_step_output(out[0])
        return out


# XLA:CPU of jax 0.10.2 to 0.12.0.1 computes the gradient of a gather (a scatter) wrong when a
# sharding constraint splits its rows unevenly on a mesh of two or more axes (_split_evenly); jax
# 0.12.1 computes it right (tests/test_step.py checks this flag against the installed jax). The
# flag holds on every backend: dropping a constraint changes no result, so it errs on the safe side.
UNEVEN_CONSTRAINTS_MISCOMPILE = jax.__version_info__ < (0, 12, 1)
_WARNED_OLD_XLA = [False]


def _warn_old_xla(mesh: Any) -> None:
    """Once per process: on those versions XLA:CPU also splits a batch unevenly where no
    constraint asks for it (a step that slices its rows, tok[1:]), and a gather or scatter over
    those rows comes out wrong, silently; _split_evenly cannot reach that. It warns for any step on
    such a mesh: whether a step slices its rows is not something spmdkit can see. Only Python 3.11
    still installs such a jax (pyproject requires 0.12.1 elsewhere)."""
    devices = getattr(mesh, "devices", None)
    if _WARNED_OLD_XLA[0] or devices is None or {d.platform for d in np.ravel(devices)} != {"cpu"}:
        return
    _WARNED_OLD_XLA[0] = True
    warnings.warn(
        f"jax {jax.__version__}: on a CPU mesh of two or more axes ({dict(mesh.shape)}), XLA of this "
        "version computes a gather's gradient or a scatter-add wrong, without an error, when the step "
        "slices the batch's rows to a count the data axis does not divide (tok[1:] of 16 rows on data=4, "
        "then an embedding lookup or counts.at[y[1:]].add(1)). Fix: jax >= 0.12.1 (Python >= 3.12: pip "
        "install -U 'jax>=0.12.1'), a mesh of one axis, or replicate the slice in the step: "
        "jax.lax.with_sharding_constraint(tok[1:], jax.sharding.PartitionSpec()). README: 'Uneven batches'.",
        RuntimeWarning, stacklevel=6)  # the caller of step(...)(state, batch) or .lower


def _split_evenly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose sharding constraints split every dimension evenly: a dimension that the mesh
    axes of its constraint do not divide is left unconstrained (replicated) instead.

    An uneven batch runs whole on every device, but the model's own activation constraints
    (``nn.with_logical_constraint(x, ("batch", ...))``, ``with_sharding_constraint(x, P("data"))``)
    still split its 13 rows over a ``data`` axis of 4 inside the program; so do a ``grad_accum``
    micro-batch's 6 rows of an even batch of 24. XLA:CPU (jax 0.10.2 to 0.12.0.1) then computes a
    gather's gradient wrong when the mesh has a second axis (the embedding lookup of a transformer
    under ``data=4, model=2``: its gradient off by more than its own size), silently. A constraint
    only places values, so dropping it changes no result. Used only where
    ``UNEVEN_CONSTRAINTS_MISCOMPILE`` holds.
    """
    from jax.extend import core as jcore

    def even(sharding: Any, shape: tuple[int, ...]) -> Any:
        if not isinstance(sharding, NamedSharding):
            return sharding
        sizes = dict(sharding.mesh.shape)
        spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
        new = []
        for dim, axes in zip(shape, spec):
            names = (() if axes is None or axes is P.UNCONSTRAINED else (axes,) if isinstance(axes, str)
                     else tuple(axes))
            split = int(np.prod([sizes.get(a, 1) for a in names]))
            new.append(None if names and dim % split else axes)
        if new == spec:
            return sharding
        return NamedSharding(sharding.mesh, P(*new), memory_kind=sharding.memory_kind)

    def in_jaxpr(jaxpr: Any) -> Any:
        eqns, changed = [], False
        for eqn in jaxpr.eqns:
            params = {k: sub(v) for k, v in eqn.params.items()}
            if eqn.primitive.name == "sharding_constraint":
                params["sharding"] = even(params["sharding"], tuple(eqn.invars[0].aval.shape))
            if any(params[k] is not v for k, v in eqn.params.items()):
                eqn, changed = eqn.replace(params=params), True
            eqns.append(eqn)
        return jaxpr.replace(eqns=eqns) if changed else jaxpr

    def sub(value: Any) -> Any:
        if isinstance(value, jcore.ClosedJaxpr):
            inner = in_jaxpr(value.jaxpr)
            return value if inner is value.jaxpr else jcore.ClosedJaxpr(inner, value.consts)
        if isinstance(value, jcore.Jaxpr):
            return in_jaxpr(value)
        if isinstance(value, tuple) and any(isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)) for v in value):
            new = tuple(sub(v) for v in value)
            if all(a is b for a, b in zip(new, value)):
                return value
            # a named tuple stays one: custom_linear_solve's and custom_root's jaxprs are read by
            # field (jaxprs.solve), and a plain tuple failed with AttributeError
            return type(value)(*new) if hasattr(value, "_fields") else new
        return value

    def run(*args: Any) -> Any:
        # Traced once (a function with side effects while tracing sees one trace, as before).
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = jcore.jaxpr_as_fun(sub(closed))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return run


def _stacked(state: State, mesh: Mesh) -> tuple[Any, jax.Array] | None:
    """The first leaf of ``state`` if every leaf is split along a leading axis of one size over
    a 1-D mesh other than ``mesh`` (an ensemble's layout, or spmdkit.replicate's), else None."""
    found = []
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        sh = getattr(x, "sharding", None)
        if not (isinstance(sh, NamedSharding) and sh.mesh != mesh and len(sh.mesh.axis_names) == 1
                and np.ndim(x) and sh.spec and sh.spec[0] == sh.mesh.axis_names[0]):
            return None
        found.append((path, x))
    if not found or len({x.shape[0] for _, x in found}) != 1:
        return None
    return found[0]


def pad_rows(batch: Batch, n: int, rows: int) -> Batch:
    """``batch`` grown from ``n`` to ``rows`` examples by repeating its last row: a padding
    row is a real example, so a function that divides by row values stays finite."""

    def one(x):
        if isinstance(x, jax.Array):
            return jax.numpy.concatenate([x, jax.numpy.repeat(x[-1:], rows - n, axis=0)])
        x = np.asarray(x)
        return np.concatenate([x, np.repeat(x[-1:], rows - n, axis=0)])

    return jax.tree.map(one, batch)


_DONATING = [False]  # has any step of this process been built with donate=True and called?


def _check_not_deleted(state: State, leaves: list[Any]) -> None:
    """Refuse a state whose arrays were deleted (donated): JAX would raise, or crash."""
    for x in leaves:
        if isinstance(x, jax.Array) and x.is_deleted():
            break
    else:
        return
    path = next(p for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
                if isinstance(x, jax.Array) and x.is_deleted())
    raise DonatedStateError(
        fix(f"state{jax.tree_util.keystr(path)} has been deleted: this state was donated to an earlier "
            "call of a step built with strategy.step(train_step, donate=True), which reused its memory for "
            "the state it returned.",
            "use the state that call returned (state, aux = step(state, batch)), never the one passed in; "
            "or build the step with donate=False to keep the old state usable.")
    )


def _check_values(tree: Any, what: str, name: str) -> None:
    """Every leaf an array or a number: strings and objects cannot leave a compiled step."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)) and bad_dtype(x) is None:
            continue
        kind = f"numpy dtype {x.dtype}" if bad_dtype(x) is not None else f"type {type(x).__name__}"
        raise StepOutputError(
            fix(f"{name!r} returned {what}{jax.tree_util.keystr(path)} = {x!r} of {kind}; "
                "only arrays and numbers can leave a compiled step.",
                f"return arrays (e.g. jnp.asarray(value)); keep strings and other Python objects out of "
                f"{what} (build them from the returned arrays after the call).")
        )


def check_batch_dtypes(batch: Batch) -> None:
    """A leaf JAX cannot hold (strings, objects), named: after placing a step's batch failed, or
    before ``spmdkit.plan`` reads the batch's shapes."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        dtype = bad_dtype(x)
        if dtype is not None:
            where = "batch" + jax.tree_util.keystr(path)
            raise SignatureError(
                fix(f"{where} has numpy dtype {dtype} (shape {x.shape}); a batch reaches the devices, which "
                    "hold numbers and bools only.",
                    f"drop {where} from the batch (keep it on the host beside the call), or encode it as "
                    "integers (e.g. ids = np.unique(values, return_inverse=True)[1]).")
            )


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else jax.numpy.result_type(x)


def _check_same_types(before: State, after: State, name: str) -> None:
    """Each returned state leaf has the shape and dtype it came in with (checked on the
    traced values: a changed one would recompile every step or silently change precision)."""
    old = jax.tree_util.tree_flatten_with_path(before)[0]
    for (path, x), y in zip(old, jax.tree.leaves(after)):
        a, b = (np.shape(x), _dtype(x)), (np.shape(y), _dtype(y))
        if a != b:
            # a PRNG key is no number type: new.astype(key<fry>) is no code to run
            keys = [jax.dtypes.issubdtype(t, jax.dtypes.prng_key) for t in (a[1], b[1])]
            how = (f"jax.random.wrap_key_data(new{_impl_argument(x)}) turns key data back into a key"
                   if keys == [True, False]
                   else "jax.random.key_data(new) is a key's raw uint32 data" if keys == [False, True]
                   else "one key as it came in: index or split it before the return, and keep its impl"
                   if keys == [True, True] else f"new.astype({a[1]})")
            raise StepOutputError(
                fix(f"train_step {name!r} returned state{jax.tree_util.keystr(path)} with shape {b[0]} and "
                    f"dtype {b[1]}, but got it with shape {a[0]} and dtype {a[1]}. The returned state is the "
                    "next step's input: a changed shape recompiles every step, a changed dtype silently "
                    "changes precision.",
                    f"return that leaf with its input shape and dtype (e.g. {how}), or create it "
                    "with that dtype in make_state.")
            )


def _impl_argument(key: Any) -> str:
    """``, impl='rbg'`` for a key of another impl than the default one wrap_key_data assumes."""
    try:
        impl = str(jax.random.key_impl(key))
    except (TypeError, ValueError):
        return ""
    default = str(jax.random.key_impl(jax.random.key(0)))
    return "" if impl == default else f", impl={impl!r}"


def _call(fn: Callable[..., Any], state: State, batch: Batch, what: str) -> Any:
    """``fn(state, batch)``; a collective over a named axis in it (a pmap-style ``pmean(g, "data")``)
    is named in spmdkit's terms: JAX's NameError said to "call psum under jax.shard_map"."""
    try:
        return fn(state, batch)
    except NameError as e:
        m = re.search(r"unbound axis name: ([^\s.]+)", str(e))
        if m is None or isinstance(e, SpmdkitError):
            raise
        raise AxisNameError(fix(
            f"{what} calls a collective over axis {m.group(1)!r} (jax.lax.pmean, psum, all_gather, ...), but a "
            "strategy compiles it as one program over the global batch, where no axis is bound.",
            "remove the collective: the function sees the whole batch, so its mean over the batch already is the "
            "mean over every device (the strategy adds the communication); for code written per device, "
            "use spmdkit.pmap.")) from e


def _checked(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """The user's function with its outputs checked while tracing (errors in their terms)."""
    name = getattr(fn, "__name__", "fn")

    def step(state, batch):
        out = _call(fn, state, batch, f"train_step {name!r}")
        if not (isinstance(out, tuple) and len(out) == 2):
            raise StepOutputError(
                fix(f"train_step {name!r} returned {type(out).__name__}; it must return (state, aux).",
                    "return the new state and anything else (metrics; {} if nothing): return state, {}.")
            )
        before, after = jax.tree.structure(state), jax.tree.structure(out[0])
        if before != after:
            raise TreeMismatchError(
                fix(f"train_step {name!r} returned a state whose structure differs from the state it got: "
                    f"{tree_difference(state, out[0])}.",
                    "return a state of the same structure (same keys, same fields): the step's output is "
                    "the next step's input.")
            )
        _check_values(out[0], "state", name)
        _check_same_types(state, out[0], name)
        _check_values(out[1], "aux", name)
        return out

    def other(state, batch):
        out = _call(fn, state, batch, f"{kind} function {name!r}")
        _check_values(out, "output", name)
        return out

    return step if kind == "step" else other


def _check_per_example(out: Any, n: int, axis: int, padded_from: int | None = None) -> None:
    """Every output leaf of ``apply`` has the batch's ``n`` examples on ``axis``."""
    if all(np.ndim(x) > axis and x.shape[axis] == n for x in jax.tree.leaves(out)):
        return

    def one(path, x):
        if np.ndim(x) <= axis or x.shape[axis] != n:
            raise BatchSizeError(
                fix(f"apply's fn returned output{jax.tree_util.keystr(path)} with shape {np.shape(x)}, "
                    f"but a batch of {n} rows went in"
                    + (f" ({padded_from} rows padded to {n} by rowwise=True)" if padded_from is not None else "")
                    + "; apply needs per-example outputs with the examples "
                    f"on axis {axis}.",
                    "return per-example values (e.g. logits [B, C]); reduce them after apply, or use "
                    "strategy.evaluate for batch-wide values.")
            )

    jax.tree_util.tree_map_with_path(one, out)
