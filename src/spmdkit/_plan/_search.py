"""Compile every candidate ahead of time and price it: memory, collectives, step time."""

from __future__ import annotations

import difflib
import math
import re
import time
import warnings
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import linen as nn
from flax import nnx

from spmdkit._console import readable_bytes
from spmdkit._errors import ConfigError, SignatureError, SpmdkitError, StepOutputError, fix
from spmdkit._mesh import make_mesh
from spmdkit._plan._candidates import DEFAULT_RULES, Candidate, enumerate_candidates, rules_table
from spmdkit._plan._cost import collective_costs, compute_time, parameter_gathers, step_time, transposition_time
from spmdkit._plan._hlo import analyse
from spmdkit._plan._memory import analytic_bytes, compiled_bytes, param_leaves
from spmdkit._rules import _PARAMETER, PRESETS, AxisRules, LayoutError, ReplicationWarning, _as_tuple
from spmdkit._strategies._compile import as_key, non_array_leaf
from spmdkit._strategies.sharded import (Sharded, _is_box, _itemsize, _lists_as_names, _nnx_names, _unboxed, _with_state_axes,
                                         is_empty_box, shallow_first)
from spmdkit._target import DTYPE_ALIASES, Target, TargetError, load_target
from spmdkit._tree import abstract_rows

# A replicated parameter is flagged when it holds at least this share of the parameters.
LARGE_SHARE = 0.05


def _abstract(batch: Any) -> Any:
    return jax.tree.map(abstract_rows, batch)


class StateLeafError(SpmdkitError, TypeError):
    """``make_state`` returned something that is not an array (JAX raises TypeError for it)."""


def _arrays_only(make_state: Callable) -> Callable:
    """``make_state`` whose every leaf must be an array (or a number): anything else is named by
    path before JAX's own error, which names neither ``make_state`` nor the fix."""
    def checked(rng: Any) -> Any:
        state = make_state(rng)
        if not jax.tree.leaves(state):
            # Nothing to lay out: every candidate was then pruned (or raised) as "Sharded.step/apply
            # got a state this strategy has not laid out", which named neither make_state nor the fix.
            raise StateLeafError(fix(
                f"make_state returned {state!r:.80}, which holds no arrays: there is no state to lay out.",
                "return the state the step carries, e.g. {'params': params, 'opt': opt.init(params)} "
                "(a function that builds it but forgot `return`?)."))
        # an empty box (a masked optimizer group's) is looked into: it holds nothing
        found = non_array_leaf(state, lambda x: _is_box(x) and not is_empty_box(x), _unboxed)
        if found is not None:
            path, value = found
            of = f" of dtype {value.dtype}" if isinstance(value, (np.ndarray, np.generic)) else ""
            raise StateLeafError(fix(
                f"make_state returned a value of type {type(value).__name__}{of} at state{path}, not an array of "
                "numbers: the state a step carries holds arrays of numbers (or bools) only.",
                "return it as an array (jnp.asarray(...)), or keep it out of the state (a constant the step "
                "closes over, or static configuration)."))
        return state

    return checked


class NamedLeaf(NamedTuple):
    """An annotated leaf of the state: its path, shape, bytes and names. ``direct``: an NNX
    variable's names, where a name the rules do not map and the mesh has stands for that mesh
    axis itself (as :class:`spmdkit.Sharded` reads them); a Flax logical name is always a rule's."""
    path: str
    shape: tuple
    bytes: int
    names: tuple
    direct: bool = False
    written: bool = False  # nn.with_partitioning: the names are mesh axes, used as written (no rules)


def abstract_state(make_state: Callable, rng: Any) -> Any:
    """``make_state``'s state as shapes, its annotations kept (Flax boxes, NNX variables)."""
    probe = Sharded(make_mesh(devices=jax.devices()[:1], data=1), AxisRules((), "probe", True))
    return probe._abstract_boxed(_arrays_only(make_state), as_key(rng))


def logical_leaves(make_state: Callable, rng: Any, state_axes: Any = None) -> list[NamedLeaf]:
    """Every leaf annotated with logical names (Flax boxes, ``state_axes``, NNX ``sharding``
    metadata); rules do not matter."""
    boxed = _with_state_axes(abstract_state(make_state, rng), _lists_as_names(state_axes))
    out = []
    # Shortest paths first: a reason names the parameter, not its optimizer moment.
    for _, (path, leaf) in shallow_first(jax.tree_util.tree_flatten_with_path(boxed, is_leaf=_is_box)[0]):
        where = "state" + jax.tree_util.keystr(path)
        if is_empty_box(leaf):
            continue
        written = False
        if isinstance(leaf, nn.LogicallyPartitioned):
            value, names, direct = leaf.value, tuple(leaf.names), False
        elif isinstance(leaf, nn.Partitioned):  # a Flax model's nn.with_partitioning: mesh axes, not logical names
            value, names, direct, written = leaf.value, tuple(leaf.names), True, True
        elif isinstance(leaf, nnx.Variable) and (names := _nnx_names(leaf)):
            value, direct = _unboxed(leaf), True
        else:
            continue
        nbytes = math.prod(value.shape) * _itemsize(value.dtype)
        out.append(NamedLeaf(where, tuple(value.shape), nbytes, tuple(names), direct, written))
    return out


def _axes(leaf: NamedLeaf, name: str, table: dict[str, Any], mesh_axes: Collection[str]) -> tuple[str, ...] | None:
    """The mesh axes ``name`` of ``leaf`` maps to under a rules ``table``; None when unmapped."""
    if leaf.written:  # as Sharded places them: the mesh's axes of those names, whatever the rules say
        return tuple(a for a in _as_tuple(name) if a in mesh_axes)
    if name in table:
        return _as_tuple(table[name])
    return (name,) if leaf.direct and name in mesh_axes else None


def conflicts(leaves: list[NamedLeaf], rules: AxisRules, mesh_axes: Collection[str] = ()) -> list[dict[str, Any]]:
    """Arrays in which two logical names map to one mesh axis (that axis cannot split both)."""
    found = []
    table = rules.mapping
    for leaf in leaves:
        seen: dict[str, str] = {}
        for name in leaf.names:
            for axis in (_axes(leaf, name, table, mesh_axes) or ()) if name is not None else ():
                if axis in seen:
                    found.append({"path": leaf.path, "names": [seen[axis], name], "axis": axis})
                seen.setdefault(axis, name)
    return found


def idle_axes(leaves: list[NamedLeaf], rules: AxisRules, mesh: dict[str, int]) -> list[str]:
    """Mesh axes (of size > 1) that the rules map from no name of the parameters or the batch:
    the devices along them would repeat each other's work (an axis for another model's names)."""
    # A plain state without names too: only the batch can use an axis then, and a candidate
    # whose axis splits nothing was ranked beside plain data parallelism as if it differed.
    table = rules.mapping
    used = set(_as_tuple(table.get("batch")))
    for leaf in leaves:
        for name in leaf.names:
            used.update((_axes(leaf, name, table, mesh) or ()) if name is not None else ())
    return [axis for axis, size in mesh.items() if size > 1 and axis not in used]


def unmapped_names(leaves: list[NamedLeaf], rules: AxisRules, mesh_axes: Collection[str] = ()) -> list[tuple[str, str]]:
    """``(path, name)`` of every logical name of the state that ``rules`` do not map (nor, for
    an NNX variable, a mesh axis of that name)."""
    if rules.replicate_unknown:
        return []
    table = rules.mapping
    return [(leaf.path, name) for leaf in leaves for name in leaf.names
            if name is not None and _axes(leaf, name, table, mesh_axes) is None]


def replicated(layout: Any, mesh_size: int, rules: AxisRules) -> list[dict[str, Any]]:
    """Large parameters every device holds whole, under rules that shard parameters (data
    parallelism replicates them by design)."""
    params = param_leaves(layout)
    total = sum(leaf.bytes for leaf in params) or 1
    if mesh_size == 1 or not any(axes is not None for name, axes in rules.table if name != "batch"):
        return []
    left = [leaf for leaf in params if not any(leaf.spec)]
    large = [leaf for leaf in left if leaf.bytes >= LARGE_SHARE * total]
    if not large and sum(leaf.bytes for leaf in left) > 0.5 * total:
        # 24 blocks' weights, each 4% of the parameters and all replicated, flagged none of them:
        # most of the memory replicated names the largest, as Sharded's ReplicationWarning does.
        large = sorted(left, key=lambda leaf: -leaf.bytes)[:5]
    return [{"path": leaf.path, "shape": list(leaf.shape), "logical": list(leaf.logical or ()), "bytes": leaf.bytes}
            for leaf in large]


def _rules_problem(cand: Candidate, leaves: list[tuple], rules: AxisRules) -> tuple[list[dict[str, Any]], str | None]:
    """The candidate's rule conflicts, and why to prune it before compiling (None: compile it):
    two logical names on one mesh axis, a logical name the rules do not map, or a mesh axis that
    splits nothing (with the rule keys no array uses, when the table is the user's own)."""
    clash = conflicts(leaves, rules, dict(cand.mesh))
    if clash:
        first = clash[0]
        return clash, (f"rules map logical names {first['names']} of {first['path']} "
                       f"both to mesh axis {first['axis']!r}" + (f" (and {len(clash) - 1} more)" if len(clash) > 1 else ""))
    named = _misplaced_axis(leaves, rules, dict(cand.mesh))
    if named:
        return clash, named
    unmapped = unmapped_names(leaves, rules, dict(cand.mesh))
    if unmapped:
        path, name = unmapped[0]
        nnx_leaf = any(leaf.path == path and leaf.direct for leaf in leaves)
        mesh = f" and mesh {dict(cand.mesh)} has no axis of that name" if nnx_leaf else ""
        # Every name left unmapped, and a rule key no array uses that is close to one (a rules file's
        # "hiddn"): the first name alone hid a typo behind another missing rule ('layer').
        names = {n for leaf in leaves for n in leaf.names if isinstance(n, str)}
        spare = [k for k in rules.mapping if k not in names]
        typos = {n: close[0] for n in dict.fromkeys(n for _, n in unmapped)
                 if (close := difflib.get_close_matches(n, spare, 1, 0.75))}
        more = sorted({n for _, n in unmapped} - {name})
        return clash, (f"{path} has {'sharding' if nnx_leaf else 'logical'} name {name!r}, which rules {cand.rules!r} "
                       f"do not map (they map {sorted(rules.mapping)}){mesh}"
                       + (f"; nor do they map {more}" if more else "")
                       + "".join(f"; rule {k!r} maps no array's name: meant {n!r}?" for n, k in typos.items())
                       + ": add a rule for it or correct the name")
    idle = idle_axes(leaves, rules, dict(cand.mesh))
    if idle:
        names = {n for leaf in leaves for n in leaf.names if n is not None} | {"batch"}
        # A table of the user's own (not a preset, written for many models) with a key no array uses: likely a typo.
        unused = [] if cand.rules in PRESETS else [
            k for k, axes in rules.table if idle[0] in _as_tuple(axes) and k not in names]
        typo = (f"; rule(s) {unused} map to it, but no array of the state has such a logical name (it has "
                f"{sorted(names)}): a typo?" if unused else "")
        return clash, (f"mesh axis {idle[0]!r} splits nothing: no parameter's logical "
                       f"name nor the batch maps to it under rules {cand.rules!r} (only activations could use it){typo}")
    return clash, None


def _misplaced_axis(leaves: list[NamedLeaf], rules: AxisRules, mesh: dict[str, int]) -> str | None:
    """A mesh axis where the candidate cannot take it, said as :class:`spmdkit.Sharded` says it:
    ``nn.with_partitioning``'s axis that the mesh lacks (a typo "modle" was dropped, and the
    candidate pruned as "mesh axis 'model' splits nothing"), or a mesh axis written as a Flax
    logical name or in ``state_axes`` (reported as a logical name the rules do not map)."""
    for leaf in leaves:
        if leaf.written:
            for dim, name in enumerate(leaf.names):
                missing = [a for a in _as_tuple(name) if a not in mesh]
                if missing:
                    return (f"{leaf.path}: dimension {dim} is sharded over mesh axis {missing[0]!r} "
                            f"(nn.with_partitioning), but the mesh has axes {list(mesh)}")
        elif not leaf.direct and any(isinstance(n, str) and n in mesh and n not in rules.mapping for n in leaf.names):
            error = rules._mesh_axes_as_logical(leaf.names, mesh, leaf.path, _PARAMETER)
            return str(error).splitlines()[0]
    return None


def evaluate(cand: Candidate, make_state: Callable, train_step: Callable, batch: Any, target: Target,
             budget: float | None, devices_per_host: int, dtype: str, rng: Any,
             leaves: list[tuple], activations: Callable[[Candidate, int, int], Any] | None,
             state_axes: Any = None) -> dict[str, Any]:
    """One candidate compiled (never run) and priced; ``status`` ok, pruned or over_budget."""
    rules = rules_table(cand.rules)
    row: dict[str, Any] = {"label": cand.label, "mesh": dict(cand.mesh), "rules": cand.rules, "remat": cand.remat,
                           "accum": cand.accum, "status": "ok", "reason": None}
    clash, reason = _rules_problem(cand, leaves, rules)
    row["conflicts"] = clash
    if reason:
        return {**row, "status": "pruned", "reason": reason}
    try:
        strategy = Sharded(make_mesh(**dict(cand.mesh)), rules, state_axes=state_axes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplicationWarning)
            layout = strategy.plan(make_state, rng)
        started = time.perf_counter()
        compiled = strategy.step(train_step).lower(layout.abstract, batch).compile()
        row["compile_s"] = time.perf_counter() - started
    except SpmdkitError as e:
        return {**row, "status": "pruned", "reason": str(e).splitlines()[0], "_error": e}
    except Exception as e:  # noqa: BLE001 - one layout JAX or XLA refuses must not end the plan
        return {**row, "status": "pruned", "reason": f"does not compile: {type(e).__name__}: "
                f"{gist(e, 300)}", "_error": e}
    row["replicated"] = replicated(layout, strategy.mesh.size, rules)
    program = analyse(compiled.as_text(), dict(strategy.mesh.shape))
    ops_priced = program.kernels
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    flops = float(cost.get("flops", 0.0)) + program.extra_flops
    accessed = float(cost.get("bytes accessed", 0.0)) + program.extra_bytes
    # the step's mean time per operation: what a collective's wait between computation is counted in
    op_seconds = (compute_time(flops, accessed, target, dtype, program.ops, ops_priced) / program.ops
                  if program.ops else 0.0)
    comms = collective_costs(program, target, devices_per_host, op_seconds, strategy.batch_axes,
                             parameter_gathers(param_leaves(layout), dict(strategy.mesh.shape), strategy.batch_axes))
    transposed = transposition_time(target, dtype, ops_priced)
    act = _activation_bytes(activations, cand, strategy) if activations else None
    analytic = analytic_bytes(layout, batch, strategy.batch_shards, act, cand.accum)
    measured = compiled_bytes(compiled)
    memory = max(analytic["total"], measured["total"])
    row.update({
        "memory": {"per_device": memory, "analytic": analytic, "compiled": measured,
                   "margin": analytic["total"] / measured["total"] - 1 if measured["total"] else None},
        "flops": flops, "bytes_accessed": accessed, "unknown_loops": program.unknown_loops,
        "collectives": comms, "ops": program.ops, "transposed_s": transposed,
        **step_time(flops, accessed, sum(c["seconds"] for c in comms), target, dtype, program.ops,
                    sum(c["sync_seconds"] for c in comms), ops_priced,
                    sum(c["seconds"] for c in comms if c["prefetched"])),
    })
    if budget is not None and memory > budget:
        need, have = readable_bytes(memory), readable_bytes(budget)
        if need == have:  # "needs 64.6 KiB, over the budget of 64.6 KiB": the bytes say why
            need, have = f"{need} ({memory:,.0f} B)", f"{have} ({budget:,.0f} B)"
        row.update(status="over_budget", reason=f"needs {need} per device, over the budget of {have}")
    return row


def gist(error: BaseException, limit: int) -> str:
    """The first line of ``error``, its start and end when longer than ``limit``: JAX's sharding
    errors put what is wrong last ("... is only valid for values of rank at least 3, but was applied
    to a value of rank 2"), after two meshes' reprs that the first 300 characters were spent on.

    >>> gist(ValueError("a" * 20 + " the cause"), 24)
    'aaaaaaaaa ...  the cause'
    """
    line = (str(error).strip().splitlines() or [""])[0]
    if len(line) <= limit:
        return line
    half = (limit - 5) // 2
    return f"{line[:half]} ... {line[len(line) - (limit - 5 - half):]}"


def _steps(step_for: Callable, candidates: list[Candidate]) -> dict[tuple[str, int], Callable]:
    """Every ``step_for(remat, accum)`` the candidates need, built before any compiles: one that
    raised or returned no step surfaced only when its candidates came up, minutes of compiling
    in, and a raise escaped as the user's bare error without the call that made it."""
    steps: dict[tuple[str, int], Callable] = {}
    for cand in candidates:
        if (cand.remat, cand.accum) not in steps:
            steps[cand.remat, cand.accum] = _step_of(step_for, cand)
    return steps


def _step_of(step_for: Callable, cand: Candidate) -> Callable:
    try:
        step = step_for(cand.remat, cand.accum)
    except Exception as e:
        raise PlanStepError(fix(f"step_for({cand.remat!r}, {cand.accum!r}) raised {type(e).__name__}: "
                                f"{gist(e, 300)}",
                                "make step_for build a step for every remat policy and accumulation count listed, or "
                                "leave that one out of remat= / accum=; its traceback is the cause below.")) from e
    if not callable(step):
        raise SignatureError(fix(f"step_for({cand.remat!r}, {cand.accum!r}) returned {type(step).__name__}, "
                                 "not a train step.",
                                 "return the step function for that remat policy and accumulation, "
                                 "e.g. step_for=lambda remat, accum: make_train_step(remat=remat, accum=accum)."))
    return step


def _activation_bytes(activations: Callable, cand: Candidate, strategy: Any) -> int | dict[str, int]:
    """``activations``' count for ``cand``: bytes, or a dict of named parts in bytes."""
    act = activations(cand, strategy.batch_shards, strategy.mesh.size)
    parts = act.values() if isinstance(act, dict) else [act]
    numbers = all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                  and math.isfinite(v) for v in parts)
    if not numbers or (isinstance(act, dict) and not all(isinstance(k, str) for k in act)) or sum(parts) < 0:
        raise StepOutputError(fix(f"activations({cand.label}, {strategy.batch_shards}, {strategy.mesh.size}) returned "
                                  f"{act!r:.80}; plan adds it to the per-device memory as bytes.",
                                  "return a byte count >= 0 (an int), or a dict of named counts such as "
                                  "{'saved': 2**20, 'working': 2**18}."))
    return act


class PlanStepError(SpmdkitError, RuntimeError):
    """Every candidate failed to compile with the same error: the user's step or state, not a layout."""


def _alike(errors: list[BaseException]) -> bool:
    first = _without_layout(str(errors[0]))
    return all(type(e) is type(errors[0]) and _without_layout(str(e)) == first for e in errors[1:])


# What JAX writes of the layout into an error: the one error of a step (Flax's DenseGeneral
# constraining its flat kernel with 3 names) read as a different error per mesh, so the plan
# was "no candidate fits" without the traceback that locates it.
_LAYOUT_REPRS = ("AbstractMesh(", "Mesh(", "NamedSharding(", "PartitionSpec(", "P(")


def _without_layout(text: str) -> str:
    """``text`` with the meshes, shardings and specs it names cut out (their parentheses balanced),
    and the addresses of objects.

    >>> _without_layout("x NamedSharding(mesh=AbstractMesh('data': 8), spec=P('data', None)) is rank 2")
    'x NamedSharding(…) is rank 2'
    >>> _without_layout("aux['m'] = <object object at 0x7fbd347225b0>")
    "aux['m'] = <object object at 0x…>"
    """
    out, i = [], 0
    while i < len(text):
        at_repr = (i == 0 or not text[i - 1].isalnum()) and any(text.startswith(r, i) for r in _LAYOUT_REPRS)
        if not at_repr:
            out.append(text[i])
            i += 1
            continue
        opening = text.index("(", i)
        depth, j = 0, opening
        while j < len(text):
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        out.append(text[i:opening] + "(…)")
        i = j + 1
    # an object's address ("<object object at 0x7f...>" in aux, traced anew for every candidate)
    return re.sub(r" at 0x[0-9a-fA-F]+", " at 0x…", "".join(out))


def _raise_common_failure(results: list[dict[str, Any]]) -> None:
    """Drop the failures kept by :func:`evaluate`; when no candidate compiled and every one that
    was tried failed alike, raise that failure (spmdkit's own as it is, else with the user's
    traceback as the cause) instead of a plan of nothing but pruned layouts."""
    tried = [r for r in results if r["status"] != "pruned" or "_error" in r]  # compiled, or failed to
    errors = [r.pop("_error") for r in results if "_error" in r]
    # One failure alone may be its layout's (two heads over a model axis of 7): it stays that
    # candidate's reason. Two layouts failing alike point at the step or the state.
    if len(errors) < 2 or any(r["status"] == "ok" for r in results):
        return
    if len(errors) < len(tried) or not _alike(errors):
        # Some layouts the rules could not take (a LayoutError: a dimension the mesh cannot split)
        # and the others all failing alike in the step: the plan said "no candidate fits" and
        # pointed at the model's sizes, while the step itself was broken for every layout it reached.
        errors = [e for e in errors if not isinstance(e, LayoutError)]
        if len(errors) < 2 or not _alike(errors):
            return
    first = errors[0]
    if isinstance(first, SpmdkitError):
        raise first
    others = (f" of {len(tried)}; the other {len(tried) - len(errors)} the rules could not lay out"
              if len(errors) < len(tried) else "")
    raise PlanStepError(fix(f"every candidate ({len(errors)}{others}) failed to compile with the same error, so it is the "
                            f"step or the state, not a layout: {type(first).__name__}: "
                            f"{gist(first, 500)}",
                            "run train_step(make_state(rng), batch) once without spmdkit to debug it; its traceback "
                            "is the cause below.")) from first


def _check_hosts(target: Target, n: int, devices_per_host: int, processes: int) -> None:
    """Devices on more than one host need the target's inter_host link. Found at the first
    collective, after compiling, it said "plan for fewer processes" to a run of one process whose
    target (a file calibrated on 2 devices) holds fewer devices per host than it plans for.

    Devices over several hosts fill whole hosts: 8 over hosts of 3 was priced as hosts of 3, 3
    and 2, a machine no cluster is, with no word."""
    _check_inter_host(target, n, devices_per_host, processes)
    if n > devices_per_host and n % devices_per_host:
        whole = n // devices_per_host
        raise TargetError(fix(f"target {target.name!r} has {devices_per_host} devices per host, which {n} devices do not "
                              f"fill: {n} = {devices_per_host} x {whole} + {n % devices_per_host}.",
                              f"plan for a whole number of hosts ({devices_per_host * whole} or "
                              f"{devices_per_host * (whole + 1)} devices), or, for hosts of another size, a target "
                              'file of your own with their "devices_per_host" (spmdkit calibrate writes one; '
                              "README, Planning)."))


def _check_inter_host(target: Target, n: int, devices_per_host: int, processes: int) -> None:
    """More devices than a host holds need the target's inter_host link."""
    if devices_per_host >= n or "inter_host" in target.links or any(
            "inter_host" in per for per in target.collectives.values()):
        return
    if processes > 1:
        how = f"plan for one process (leave --processes {processes} out)"
    else:
        how = (f"raise its devices_per_host to {n} if one host holds them (a file from spmdkit calibrate: run it with "
               f"--devices {n}), or plan for at most {target.devices_per_host} devices")
    raise TargetError(fix(f"target {target.name!r} has no inter_host link, but {n} devices span "
                          f"{-(-n // devices_per_host)} hosts of {devices_per_host} (its devices_per_host is "
                          f"{target.devices_per_host}).",
                          f'add "inter_host": {{"alpha": ..., "beta": ...}} to its "links", or {how}.'))


def compute_dtype(dtype: Any, target: Target) -> str:
    """``dtype`` as the name the target's ``peak_flops`` uses: an alias resolved, and an error for
    a name that is no dtype (it would be priced at the float32 peak without a word)."""
    name = DTYPE_ALIASES.get(str(dtype), str(dtype))
    if name in target.peak_flops:
        return name
    try:
        name = np.dtype(jax.numpy.dtype(name)).name
    except (TypeError, ValueError):
        raise ConfigError(fix(f"plan(dtype={dtype!r}) is not a dtype name; target {target.name!r} gives peak FLOP/s "
                              f"for {sorted(target.peak_flops)}.",
                              f"pass one of {sorted(target.peak_flops)} (or a JAX dtype name such as \"bfloat16\"; "
                              f"aliases {sorted(DTYPE_ALIASES)}).")) from None
    target.flops_for(name)  # a target without this dtype's rate nor float32's: said before anything compiles
    return name


def plan(make_state: Callable, train_step: Callable | None, batch: Any, *, memory_per_device: float | None = None,
         target: str | Target = "cpu", rules: tuple[str, ...] = DEFAULT_RULES, remat: tuple[str, ...] = ("none",),
         accum: tuple[int, ...] = (1,), step_for: Callable[[str, int], Callable] | None = None,
         processes: int = 1, dtype: str = "float32", rng: Any = 0,
         activations: Callable[[Candidate, int, int], Any] | None = None, state_axes: Any = None,
         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every layout of ``make_state``'s state and ``train_step`` on this process's devices,
    compiled ahead of time and priced against ``target``; nothing runs.

    ``batch``: the global batch (arrays or ``jax.ShapeDtypeStruct``). ``step_for(remat,
    accum) -> train_step`` builds the step for each remat policy and accumulation count
    when ``remat``/``accum`` list more than the defaults. Returns the plan as a dict (see
    :func:`spmdkit.plan`).
    """
    for name, given in (("remat", remat), ("accum", accum)):
        if not tuple(given):
            raise ConfigError(fix(f"plan({name}={given!r}) leaves no candidate to compare.",
                                  f"leave {name} out (the default: {name}={('none',) if name == 'remat' else (1,)}) "
                                  "or list at least one."))
    if step_for is None and (tuple(remat) != ("none",) or tuple(accum) != (1,)):
        raise ConfigError(fix(f"plan(remat={remat!r}, accum={accum!r}) needs step_for: spmdkit cannot change "
                              "the remat policy or the accumulation of a train_step it did not build.",
                              "pass step_for=lambda remat, accum: my_train_step(...), or leave remat and accum out."))
    if step_for is None and train_step is None:
        raise ConfigError(fix("plan() got neither train_step nor step_for.", "pass train_step=my_step."))
    if step_for is not None and train_step is not None:  # train_step was ignored without a word
        raise ConfigError(fix("plan() got both train_step and step_for: every candidate's step comes from "
                              "step_for(remat, accum), so train_step would not be used.",
                              "pass train_step=None with step_for, or leave step_for out."))
    n = jax.device_count()
    if processes < 1 or n % processes:
        raise ConfigError(fix(f"plan(processes={processes}): {n} devices do not split evenly into that many processes.",
                              f"use a divisor of {n}."))
    target = load_target(target, n) if not isinstance(target, Target) else target
    dtype = compute_dtype(dtype, target)
    devices_per_host = n // processes if processes > 1 else min(target.devices_per_host, n) or n
    _check_hosts(target, n, devices_per_host, processes)
    if n == 1 < target.devices_per_host:
        # A script run without simulated devices planned "h100x8" for the one CPU device, every
        # candidate data=1 and no collective, without a word.
        warnings.warn(fix("plan compiles every candidate on jax.device_count() = 1 device, where a host of the target "
                          f"{target.name!r} has {target.devices_per_host}: every candidate is a layout over 1 device "
                          "(data=1), with no collective to compare.",
                          f"to plan for {target.devices_per_host} devices on this machine, call "
                          f"spmdkit.use_host_devices({target.devices_per_host}) before JAX starts (the command: "
                          f"--devices {target.devices_per_host})."), UserWarning, stacklevel=3)
    budget = memory_per_device if memory_per_device is not None else target.memory_per_device
    abstract_batch = _abstract(batch)
    rows_in_batch = jax.tree.leaves(abstract_batch)[0].shape[0]
    candidates, early = enumerate_candidates(n, tuple(rules), tuple(remat), tuple(accum), rows_in_batch)
    leaves = logical_leaves(make_state, rng, state_axes)
    results = [{"label": c.label, "mesh": dict(c.mesh), "rules": c.rules, "remat": c.remat, "accum": c.accum,
                "status": "pruned", "reason": why} for c, why in early]
    steps = _steps(step_for, candidates) if step_for else {}
    for i, cand in enumerate(candidates):
        if progress:
            progress(f"[{i + 1}/{len(candidates)}] {cand.label}")
        step = steps[cand.remat, cand.accum] if step_for else train_step
        results.append(evaluate(cand, make_state, step, abstract_batch, target, budget, devices_per_host, dtype,
                                rng, leaves, activations, state_axes))
    _raise_common_failure(results)
    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: r["step_s"])
    for rank, r in enumerate(ok, 1):
        r["rank"] = rank
    # "file": the figures it priced with, as a target file: --target that file prices the same way.
    about = {"name": target.name, "source": target.source, "file": target.to_json()}
    if target.warnings:
        about["warnings"] = list(target.warnings)
    return {"target": about, "devices": n, "processes": processes,
            "devices_per_host": devices_per_host, "memory_budget": budget, "global_batch": rows_in_batch,
            "dtype": dtype, "candidates": ok + [r for r in results if r["status"] != "ok"]}
