"""Ensembles: K independently initialised models, members spread over a mesh axis.

Every leaf of the train state carries a leading member axis of size K, sharded over
the ``member`` mesh axis: each device holds K/d members and steps them in one program
(``member_loop``: unrolled, ``lax.map`` or ``vmap``). Members share the batch or, with
``bagging``, each draws its own order of the data (``data_streams``). ``apply`` returns
every member's outputs; combining them (a mean of probabilities) is the caller's line.

Beyond the Strategy contract an ensemble has members: ``data_streams``,
``member_params`` and ``summarize`` are what ``fit`` asks of an :class:`Ensemble`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdkit._errors import BatchSizeError, ConfigError, MeshError, SignatureError, fix
from spmdkit._strategies._compile import Placement, auto_mesh, unbox_tree, with_size1_axes
from spmdkit._types import Params, whole_number


MEMBER_LOOPS = ("unroll", "map", "vmap")


def over_members(fn: Callable[..., Any], in_axes: tuple[int | None, ...], how: str) -> Callable[..., Any]:
    """Apply ``fn`` to each member a device holds (args with in_axes 0 are per member).

    ``vmap`` vectorises the members into one computation; ``map`` runs them one
    after another in a ``lax.map`` loop; ``unroll`` writes them out as independent
    computations that XLA may schedule side by side. Which is fastest depends on the
    model: a vmapped CNN becomes a grouped convolution, slow on XLA:CPU (see
    BENCHMARKS.md).
    """
    if how == "vmap":
        return jax.vmap(fn, in_axes=in_axes)

    def run(*args):
        mapped = [a for a, ax in zip(args, in_axes) if ax == 0]

        def call(sliced):
            it = iter(sliced)
            return fn(*[next(it) if ax == 0 else a for a, ax in zip(args, in_axes)])

        if how == "map":
            return jax.lax.map(call, mapped)
        count = jax.tree.leaves(mapped)[0].shape[0]
        outs = [call(jax.tree.map(lambda x, i=i: x[i], mapped)) for i in range(count)]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

    return run


def placement(members: int, devices: int) -> int:
    """How many devices K members use: the largest divisor of K that is <= devices."""
    return max(d for d in range(1, min(members, devices) + 1) if members % d == 0)


_INJECT_STATES = tuple(
    cls for cls in (getattr(optax, "InjectHyperparamsState", None), getattr(optax, "InjectStatefulHyperparamsState", None))
    if cls is not None
)


def _g(values: np.ndarray) -> str:
    return ", ".join(f"{v:g}" for v in values.ravel().tolist())


def _member_devices(members: int, devs: list[jax.Device]) -> list[jax.Device]:
    """The devices K members use: the largest divisor of K the devices take, spread evenly over
    the processes the devices belong to (the first of them on one process left the others'
    devices out of the program, which then failed with bare Python errors)."""
    by_process: dict[int, list[jax.Device]] = {}
    for d in devs:
        by_process.setdefault(d.process_index, []).append(d)
    procs = len(by_process)
    if procs == 1:
        used = placement(members, len(devs))
        _warn_idle(members, len(devs), used)
        return devs[:used]
    least = min(len(v) for v in by_process.values())
    fits = [d for d in range(procs, procs * least + 1, procs) if members % d == 0]
    if not fits:
        raise ConfigError(fix(
            f"Ensemble(members={members}) over {procs} processes: the members must be spread evenly over every "
            f"process's devices ({least} each), so their number must have a divisor that is a multiple of {procs} "
            f"and at most {procs * least}.",
            f"use members={procs * least} (one per device), {2 * procs * least}, or another multiple of {procs} "
            "(--members)."))
    used = max(fits)
    _warn_idle(members, len(devs), used)
    return [d for group in by_process.values() for d in group[: used // procs]]


def _check_holds_this_process(mesh: Mesh, members: int) -> None:
    if jax.process_count() > 1 and not any(d.process_index == jax.process_index() for d in mesh.devices.flat):
        raise ConfigError(fix(
            f"Ensemble(members={members}): its mesh holds no device of this process ({jax.process_index()}), "
            "so this process has no part in the program it runs.",
            "give every process a mesh or devices= with devices of its own (jax.local_devices() for a per-process "
            "ensemble), or leave both out for spmdkit's placement over every process."))


def _warn_idle(members: int, devices: int, used: int) -> None:
    """Say so when K members leave devices idle that a nearby K would have used."""
    if used >= min(members, devices):
        return
    near = sorted({devices * max(1, members // devices), devices * (members // devices + 1)})
    warnings.warn(
        f"Ensemble(members={members}) on {devices} devices: {members} members split evenly over only {used} of "
        f"them ({members // used} each), so {devices - used} devices stay idle. Use members="
        f"{' or '.join(map(str, near))} (--members) to use all {devices}, or, from Python, pass devices= a list "
        f"of {used} to say this is meant.", stacklevel=4)


def _check_hyperparams(hyperparams: Any, members: int) -> dict[str, list[float]]:
    """``{name: one value per member}``, validated before anything is built."""
    if hyperparams is None:
        return {}
    if not isinstance(hyperparams, dict):
        raise ConfigError(fix(f"hyperparams={hyperparams!r} is not a dict.",
                              'pass hyperparams={"learning_rate": [0.1, 0.01, ...]}, one value per member.'))
    out = {}
    for name, values in hyperparams.items():
        values = list(np.ravel(values)) if np.ndim(values) else None
        if values is None or len(values) != members:
            raise ConfigError(
                fix(f"hyperparams[{name!r}] has {0 if values is None else len(values)} value(s) for "
                    f"members={members}.", f"give exactly {members} values, one per member.")
            )
        out[name] = values
    return out


class MembersMismatchError(ConfigError):
    """A state's member count differs from the ensemble's."""


def _split_on_members(state: Any, axis: str) -> bool:
    """Every leaf an array split along its leading axis over mesh axis ``axis`` and nothing else:
    the layout an ensemble of that member axis gives its state."""
    leaves = jax.tree.leaves(state)
    return bool(leaves) and all(
        isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.ndim and x.sharding.spec
        and x.sharding.spec[0] == axis and not any(x.sharding.spec[1:]) for x in leaves)


class Ensemble(Placement):
    """K models trained at once, K/d per device on a 1-D ``member`` mesh.

    ``members`` may exceed the device count (K/d members per device, vectorised) or
    be smaller (a sub-mesh of K devices). By default K members use the largest
    number of devices that divides K; pass ``mesh`` to choose, in which case its
    ``axis`` size must divide K.

    ``init(make_state, rng)`` makes member m from ``jax.random.split(rng, K)[m]``;
    ``step(train_step)`` runs the user's single-device step for every member on the
    same global batch (the aux values get a leading member axis), and ``apply(fn)``
    returns ``[K, B, ...]``: combining the members (a mean of probabilities, say) is
    the caller's line of code. ``hyperparams={"learning_rate": [...]}`` gives each
    member its own value of an ``optax.inject_hyperparams`` hyperparameter.

    A state without a leading member axis of size K raises ``MembersMismatchError``, as
    does one laid out by another strategy (device arrays not split over the member axis).
    A host (numpy) or uncommitted state carries no layout, so one model whose every leaf
    happens to start with K rows (``{"w": eye(K), "b": zeros(K)}``) cannot be told from K
    members and is run as K members: build ensemble states with ``init``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, spmdkit
        >>> ens = spmdkit.Ensemble(members=4)
        >>> state = ens.init(lambda rng: {"w": jax.random.normal(rng, (3,))}, jax.random.key(0))
        >>> state["w"].shape
        (4, 3)
        >>> predict = ens.apply(lambda s, b: b["x"] @ s["w"])
        >>> predict(state, {"x": jnp.ones((5, 3))}).shape
        (4, 5)
        >>> ens = spmdkit.Ensemble(members=16)
        >>> ens.describe()["members_per_device"] * ens.describe()["device_count"]
        16
    """

    name = "ensemble"

    def __init__(
        self,
        members: int,
        *,
        mesh: Mesh | None = None,
        devices: Sequence[jax.Device] | None = None,
        bagging: bool = False,
        axis: str = "member",
        member_loop: str = "unroll",
        hyperparams: dict[str, Sequence[float]] | None = None,
    ):
        if whole_number(members) is None or members < 1:
            raise ConfigError(
                fix(f"members={members!r}: an ensemble needs a whole number of members >= 1.", "e.g. members=8.")
            )
        members = int(members)  # np.int64 from a sweep counts too
        if mesh is None:
            devs = list(jax.devices() if devices is None else devices)
            if not devs or not all(isinstance(d, jax.Device) for d in devs):
                raise MeshError(fix(f"Ensemble(devices={devices!r:.60}): a non-empty list of jax.Device.",
                                    "pass e.g. devices=jax.devices()[:4], or leave it out for all of them."))
            mesh = Mesh(np.array(_member_devices(members, devs)), (axis,))
        else:
            mesh = auto_mesh(mesh)
        _check_holds_this_process(mesh, members)
        if axis not in mesh.axis_names:
            raise MeshError(
                fix(f"the mesh has axes {list(mesh.axis_names)}, not the member axis {axis!r}.", "pass axis= one of them.")
            )
        d = mesh.shape[axis]
        if members % d:
            raise ConfigError(
                fix(
                    f"members={members} cannot be placed on the {d} devices of mesh axis {axis!r}: "
                    f"{members} is not a multiple of {d}, so the devices would hold unequal numbers "
                    "of members.",
                    f"use a multiple of {d} members (e.g. {d}, {2 * d}), or a mesh whose {axis!r} "
                    f"axis divides {members} (e.g. {placement(members, d)} devices); "
                    "without a mesh spmdkit picks one itself.",
                )
            )
        if member_loop not in MEMBER_LOOPS:
            raise ConfigError(
                fix(f"member_loop={member_loop!r} is not known.", f"choose one of {list(MEMBER_LOOPS)}.")
            )
        self.hyperparams = _check_hyperparams(hyperparams, members)
        self.member_loop = member_loop
        self.members = members
        self.mesh = mesh
        self.axis = axis
        self.bagging = bagging
        self.data_streams = members if bagging else 1
        self._per_member = NamedSharding(mesh, P(axis))
        self._replicated = NamedSharding(mesh, P())

    @property
    def batch_shards(self) -> int:
        return 1  # every device sees the whole batch: members, not examples, are split

    def describe(self) -> dict[str, Any]:
        d = self.mesh.shape[self.axis]
        return {
            "strategy": self.name,
            "impl": "shard_map+vmap",
            "mesh": dict(self.mesh.shape),
            "device_count": self.mesh.size,
            "members": self.members,
            "members_per_device": self.members // d,
            "bagging": self.bagging,
            "member_loop": self.member_loop,
        }

    # ---- placement of the user's state and batches (see Placement) --------------
    _row_axis = 1  # apply's outputs are [K, B, ...]

    def shardings(self, abstract_state: Any) -> Any:
        """Every leaf split over the member axis (its leading axis is the member)."""
        state = unbox_tree(abstract_state)
        self._check_members(state)
        return jax.tree.map(lambda _: self._per_member, state)

    def _make(self, make_state: Callable[[jax.Array], Any]) -> Callable[[jax.Array], Any]:
        return jax.vmap(make_state)

    def _init_key(self, rng: jax.Array) -> jax.Array:
        return self.member_keys(rng)

    def _after_init(self, state: Any) -> Any:
        return self._with_hyperparams(state) if self.hyperparams else state

    def _state_shardings(self, state: Any) -> Any:
        self._check_members(state)
        return self._per_member

    def _batch_sharding(self, even: bool) -> NamedSharding:
        return self._replicated  # every member sees the whole batch

    def _aux_sharding(self) -> NamedSharding:
        return self._replicated

    def _batch_sharding_for(self, kind: str, even: bool) -> NamedSharding:
        # Bagging: a step's batch is [K, b, ...], member m's own rows.
        return self._per_member if kind == "step" and self.bagging else self._replicated

    def _check_batch(self, kind: str, rows: int, batch: Any) -> None:
        if kind != "step" or not self.bagging:
            return
        k = self.members
        flat = [(jax.tree_util.keystr(p), np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]]
        where, shape = next(((w, sh) for w, sh in flat if len(sh) < 2), flat[0])
        if rows != k or len(shape) < 2:
            # An ordinary [B, ...] batch would be read as K rows of one example each: wrong, silently.
            raise BatchSizeError(fix(
                f"batch{where} has shape {shape}, but Ensemble(members={k}, bagging=True) steps on one share "
                f"per member: every batch leaf [{k}, b, ...], member m training on rows [m].",
                f"stack the members' own batches (spmdkit.fit does, from members' own data orders), or reshape a "
                f"global batch of {k} x b rows: jax.tree.map(lambda x: x.reshape({k}, -1, *x.shape[1:]), batch)."))

    def _lift(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        axis, own = self.axis, kind == "step" and self.bagging
        local = over_members(fn, (0, 0 if own else None), self.member_loop)
        out = (P(axis), P(axis)) if kind == "step" else P(axis)
        in_specs = (P(axis), P(axis) if own else P())
        # Manual over the members only: a model's sharding constraints (with_sharding_constraint
        # over 'data', 'model'...) name size-1 axes appended to the mesh (see TraceContext), so
        # inside a member they constrain nothing and the model runs unchanged.
        mesh = with_size1_axes(self.mesh, getattr(self, "_extra_axes", ()))
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out, check_vma=False, axis_names={axis})

    def _with_hyperparams(self, state: Any) -> Any:
        """Member m's value of each named hyperparameter written into the optimizer state."""
        found = []
        self._check_one_injected(state)

        def set_values(node):
            if not isinstance(node, _INJECT_STATES):
                return node
            missing = set(self.hyperparams) - set(node.hyperparams)
            if missing:
                raise ConfigError(
                    fix(f"hyperparams names {sorted(missing)}, but the optimizer's injected "
                        f"hyperparameters are {sorted(node.hyperparams)}.",
                        "use those names, or inject the ones you vary: optax.inject_hyperparams(optax.adam)(learning_rate=...).")
                )
            found.append(node)
            values = dict(node.hyperparams)
            for name, per_member in self.hyperparams.items():
                dtype = np.asarray(values[name]).dtype
                values[name] = jax.device_put(np.asarray(per_member, dtype), self._per_member)
            return node._replace(hyperparams=values)

        state = jax.tree.map(set_values, state, is_leaf=lambda x: isinstance(x, _INJECT_STATES))
        if not found:
            raise ConfigError(
                fix(f"hyperparams={sorted(self.hyperparams)} were given, but the state holds no "
                    "optax.inject_hyperparams optimizer state to write them into.",
                    "build the optimizer as optax.inject_hyperparams(optax.sgd)(learning_rate=0.1) "
                    "so its hyperparameters live in the state.")
            )
        self._unchecked_hyperparams = True  # until the first step shows the optimizer keeps them
        return state

    def _check_one_injected(self, state: Any) -> None:
        """Two injected optimizers (two groups of optax.multi_transform) that both hold a
        named hyperparameter: writing both would silently replace the other group's value."""
        nodes = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, _INJECT_STATES))[0]
        hits = [(jax.tree_util.keystr(p), n) for p, n in nodes
                if isinstance(n, _INJECT_STATES) and set(self.hyperparams) & set(n.hyperparams)]
        if len(hits) > 1:
            named = sorted(set(self.hyperparams) & set().union(*(n.hyperparams for _, n in hits)))
            raise ConfigError(fix(
                f"hyperparams {named}: {len(hits)} injected optimizer states hold them, at "
                f"{', '.join('state' + p for p, _ in hits)}; spmdkit will not overwrite each group's own value.",
                "inject only the optimizer whose value the members vary (build the others without "
                "optax.inject_hyperparams, e.g. optax.sgd(0.5)), so one state holds it."))

    def _check_step_output(self, state: Any) -> None:
        if not getattr(self, "_unchecked_hyperparams", False):
            return
        self._unchecked_hyperparams = False
        for node in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, _INJECT_STATES)):
            if not isinstance(node, _INJECT_STATES):
                continue
            for name, per_member in self.hyperparams.items():
                if name not in node.hyperparams:
                    continue
                now = np.asarray(jax.device_get(node.hyperparams[name]))
                want = np.asarray(per_member, now.dtype)
                if now.shape != want.shape or not np.array_equal(now, want):
                    raise ConfigError(fix(
                        f"hyperparams[{name!r}]: the members' values [{_g(want)}] were replaced by the optimizer "
                        f"in the first step (now [{_g(now)}]): its {name} is a schedule, which optax "
                        "evaluates at every step, so every member trained at the schedule's value.",
                        f"inject a number, not a schedule (optax.inject_hyperparams(optax.sgd)({name}=0.1)) and "
                        f"vary it per member; for a schedule per member, scale the updates: optax.chain(the "
                        f"optimizer with the schedule, optax.inject_hyperparams(optax.scale)(step_size=1.0)) "
                        f"with hyperparams={{'step_size': [...]}}."))

    def _check_state(self, state: Any, leaves: list[Any]) -> None:
        # Every call (cheap: leading sizes only): a single model's state may share the
        # structure of the ensemble's, so a check per structure would let it through.
        k = self.members
        for x in leaves:
            shape = getattr(x, "shape", None)
            if shape is None:
                shape = np.shape(x)
            if not shape or shape[0] != k:
                self._no_member_axis(state)

    def _check_new_state(self, state: Any) -> None:
        """Stacked states are this strategy's own: ``_check_state`` compares their member count."""

    def _no_member_axis(self, state: Any) -> None:
        leads = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(state)}
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            shape = np.shape(leaf)
            if shape and shape[0] == self.members:
                continue
            lead = f"its leading size is {shape[0]}" if shape else "it is a scalar"
            other = next(iter(leads)) if len(leads) == 1 else None
            if other is not None and _split_on_members(state, self.axis):  # another ensemble's state, not one model's
                raise MembersMismatchError(fix(
                    f"state{jax.tree_util.keystr(path)} has shape {shape}: the state is an ensemble of {other} "
                    f"members (every leaf split along a leading axis of {other}), not of {self.members}.",
                    f"run it with Ensemble(members={other}); for {self.members} members, build the state with "
                    f"Ensemble(members={self.members}).init(make_state, rng)"
                    + (f", or take members from it: jax.tree.map(lambda x: x[:{self.members}], state)."
                       if other > self.members else ".")))
            raise MembersMismatchError(
                fix(f"state{jax.tree_util.keystr(path)} has shape {shape}: the state has no member axis of "
                    f"size {self.members} ({lead}). Ensemble(members={self.members}) keeps its members' states "
                    "stacked on a leading axis; this looks like one model's state.",
                    f"build it with ensemble.init(make_state, rng) (member m from "
                    f"jax.random.split(rng, {self.members})[m]), or stack {self.members} single-model states "
                    "onto the ensemble's devices: ensemble.place_state(jax.tree.map(lambda *xs: jnp.stack(xs), "
                    "*states)).")
            )

    def _foreign_state(self, state: Any) -> None:
        # After jit refused the state's layout. Committed arrays not split along their
        # leading axis were laid out by another strategy: one model's state, even where
        # every leaf's leading size happens to be K.
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            sh = getattr(x, "sharding", None)
            if not isinstance(x, jax.Array) or not x.committed or (
                    isinstance(sh, NamedSharding) and sh.spec and sh.spec[0] is not None):
                continue
            raise MembersMismatchError(
                fix(f"state{jax.tree_util.keystr(path)} (shape {x.shape}) is laid out by another strategy "
                    f"({sh}): not split over the member axis, so it is one model's state, not the "
                    f"{self.members} members' states Ensemble(members={self.members}) keeps stacked on a "
                    "leading axis.",
                    f"build it with ensemble.init(make_state, rng), or stack {self.members} single-model "
                    "states onto the ensemble's devices: ensemble.place_state(jax.tree.map(lambda *xs: "
                    "jnp.stack(xs), *states)) (stacked alone, states placed by a strategy stay on its devices); "
                    "an ensemble's state restored elsewhere goes back with ensemble.place_state(state).")
            )

    def _check_members(self, state: Any) -> None:
        treedef = jax.tree.structure(state)
        if treedef in getattr(self, "_checked", ()):
            return
        self._check_leading(state)
        self._checked = getattr(self, "_checked", ()) + (treedef,)

    # ---- placement ------------------------------------------------------------
    def member_keys(self, rng: jax.Array) -> jax.Array:
        """Member m is initialised with ``member_keys(rng)[m]``."""
        if np.shape(rng) not in ((), (2,)) or (np.shape(rng) == (2,) and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)):
            raise SignatureError(fix(
                f"Ensemble.init: rng has shape {np.shape(rng)}; it takes one key (or seed) and splits it into "
                f"the {self.members} members' keys itself.", "pass one key: ensemble.init(make_state, jax.random.key(0))."))
        return jax.random.split(rng, self.members)

    def place_state(self, state: Any) -> Any:
        """Put an existing (e.g. restored) state on the mesh, checking its member count."""
        self._check_leading(state)
        return jax.device_put(state, self._per_member)

    def _check_leading(self, state: Any) -> None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            shape = np.shape(leaf)
            if not shape or shape[0] != self.members:
                where = "state" + jax.tree_util.keystr(path)
                raise MembersMismatchError(
                    fix(
                        f"{where} has shape {shape}, so it holds "
                        f"{shape[0] if shape else 'no'} member(s), but this ensemble has "
                        f"members={self.members}.",
                        f"use members={shape[0] if shape else '?'} to continue that ensemble, or start "
                        "a new one instead of restoring.",
                    )
                )

    def member_params(self, params: Params) -> list[Params]:
        """Stacked ``[K, ...]`` parameters as K single-model pytrees."""
        return [jax.tree.map(lambda x, m=m: x[m], params) for m in range(self.members)]

    def summarize(self, eval_metrics: dict[str, Any]) -> dict[str, Any]:
        """The members' and the ensemble's accuracy from an eval row, for a run's summary."""
        out: dict[str, Any] = {"members": self.members}
        if "member_accuracy" in eval_metrics:
            members = eval_metrics["member_accuracy"]
            out["member_accuracy"] = members
            out["mean_member_accuracy"] = float(np.mean(members))
        if "ensemble_accuracy" in eval_metrics:
            out["ensemble_accuracy"] = eval_metrics["ensemble_accuracy"]
            if "member_accuracy" in eval_metrics:
                out["ensemble_gain"] = out["ensemble_accuracy"] - out["mean_member_accuracy"]
        return out

    def __repr__(self) -> str:
        return f"Ensemble(members={self.members}, mesh={dict(self.mesh.shape)}, bagging={self.bagging})"
