"""The planner over several processes (``jax.distributed``): one plan, the same on every process.

Every process compiles the same candidates over the global devices, so they agree on the
ranking only if they price with the same target: the ``cpu`` target is measured by each
process at once (the load a run of all of them puts on the machine) and process 0's figures
are used by all. The plan itself is then process 0's, sent to every process, so that all run
the same candidates in the same order when measuring (a process that ran another candidate
would wait forever in its collectives). A measured step is done when every process is done
with it: each step's time is the largest over the processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import statistics
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from spmdkit._errors import ConfigError, ProcessMismatchError, SpmdkitError, first_line, fix
from spmdkit._process import broadcast, gather_json, sync
from spmdkit._target import LINK_SIZES, _between_case, _group_link, _interleaved, _timed


class PlanRunError(SpmdkitError, RuntimeError):
    """The processes that measure a plan failed or timed out."""

    exit_code = 4  # the CLI's code for a lost peer process


def check_processes(processes: int | None, measure: int | str, running: int | None = None) -> int:
    """The process count to plan for: ``processes``, which must match the processes running
    when there are several; several given to a lone process price only (``measure=0``).

    >>> check_processes(None, 2, running=1), check_processes(2, 0, running=1), check_processes(2, 3, running=2)
    (1, 2, 2)
    """
    running = jax.process_count() if running is None else running
    if processes is None:
        return running
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ConfigError(fix(f"plan(processes={processes!r}): need a whole number >= 1.",
                              "pass e.g. processes=2, or leave it out (the processes running)."))
    if running > 1 and processes != running:
        raise ConfigError(fix(f"plan(processes={processes}), but this is one of {running} processes "
                              f"(jax.process_count() == {running}).",
                              f"pass processes={running}, or leave processes out."))
    if running == 1 and processes > 1 and measure:
        raise ConfigError(fix(f"plan(processes={processes}, measure={measure!r}) in a single process: measuring "
                              f"over {processes} processes needs them running.",
                              f"start the script in {processes} processes (spmdkit launch -n {processes} "
                              "--host-devices-per-process N -- python script.py, which calls "
                              "spmdkit.initialize() first), or pass measure=0 to price the layouts only."))
    return processes


def check_device_order() -> None:
    """The cost model takes mesh positions ``[p * k, (p + 1) * k)`` for process ``p``'s ``k``
    devices (every mesh is built over ``jax.devices()`` in order); say so if JAX orders them otherwise."""
    owners = [d.process_index for d in jax.devices()]
    if owners != sorted(owners) or len(set(owners.count(p) for p in set(owners))) != 1:
        raise PlanRunError(fix(f"jax.devices() does not list each process's devices together and equally many "
                               f"(process of each device: {owners}); the plan would price collectives across "
                               "processes as within one.", "give every process the same number of devices."))


def _plain(x: Any) -> Any:
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    return str(x)


def check_same_arguments(arguments: dict[str, Any]) -> None:
    """Every process called ``plan`` with the same ``arguments`` (JSON-able): each gets process
    0's plan, so another process's own rules or batch would be dropped without a word. Every
    process must call it."""
    if jax.process_count() == 1:
        return
    from spmdkit._process import disagreement
    from spmdkit._strategies._agree import first_difference

    plain = json.loads(json.dumps(arguments, sort_keys=True, default=_plain))
    every = disagreement(json.dumps(plain, sort_keys=True).encode(), lambda: plain, "spmdkit.plan: its arguments")
    if every is None:
        return
    p = next(i for i, a in enumerate(every) if a != every[0])
    key = next(k for k in every[0] if every[0][k] != every[p].get(k))
    a, b = every[0][key], every[p][key]
    if isinstance(a, dict) and isinstance(b, dict):  # state_axes by path: the first path where they differ
        path = next(k for k in [*a, *b] if a.get(k) != b.get(k))
        first, other, key = a.get(path, "nothing"), b.get(path, "nothing"), f"{key}{path}"
    else:
        first, other = first_difference(a, b, "state" if key == "make_state" else key)
    if key == "make_state":
        raise ProcessMismatchError(fix(
            f"plan(make_state=...) builds another state in process {p} than in process 0: {first} in process 0, "
            f"{other} in process {p}. Every process returns process 0's plan, and measuring would wait for ever "
            "in steps whose collectives do not match.", "make every process build the same state (the same model, "
            "sizes and optimizer)."))
    raise ProcessMismatchError(fix(
        f"plan({key}=...) differs between processes: process 0 gave {first}, process {p} gave "
        f"{other}. Every process returns process 0's plan, so process {p}'s {key} would be dropped.",
        f"pass every process the same {key}."))


def from_process_0(value: Any) -> Any:
    """Process 0's JSON-able ``value`` on every process, as JSON reads it back (tuples
    become lists); every process must call it. The value itself in a lone process."""
    if jax.process_count() == 1:
        return value
    raw = json.dumps(value, default=_plain).encode() if jax.process_index() == 0 else b""
    size = int(np.asarray(broadcast(np.array([len(raw)], np.int32), "the size of the plan's arguments"))[0])
    buf = np.zeros(1 << max(8, (size - 1).bit_length()), np.uint8)  # few sizes: few compilations
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    got = np.asarray(broadcast(buf, "the plan's arguments")).astype(np.uint8)
    return json.loads(bytes(got[:size]).decode())


def check_same(value: Any) -> None:
    """Raise unless ``value`` (JSON-able) is the same on every process; every process must call it."""
    if jax.process_count() == 1:
        return
    import hashlib

    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=_plain).encode()).hexdigest()
    every = gather_json(digest, "a digest of the plan's arguments")
    if len(set(every)) > 1:
        differ = [i for i, d in enumerate(every) if d != every[0]]
        raise PlanRunError(fix(f"the plan differs between processes 0 and {differ} (spmdkit sends process 0's plan to "
                               "all and takes each measurement over all: this is a bug of spmdkit).",
                               "report it with the command; meanwhile plan with --processes 1."))


# Ctrl-C noted while several processes measure (see interrupts_agreed); acted on in slowest().
_INTERRUPT: list[int] = []


@contextlib.contextmanager
def interrupts_agreed() -> Iterator[None]:
    """While several processes measure: a first SIGINT is noted, and every process raises
    ``KeyboardInterrupt`` at the same point, the next :func:`slowest` (which every process calls).

    Raised where the signal fell, one process left between two collectives while the others
    waited for it in the next one until they were killed, process 0 often among them: nothing
    measured was printed. A second SIGINT raises at once. In a lone process (nothing to agree),
    outside the main thread, or with SIGINT ignored, nothing changes.
    """
    if (jax.process_count() == 1 or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) == signal.SIG_IGN):
        yield
        return

    def note(signum, frame):
        if _INTERRUPT:
            raise KeyboardInterrupt
        _INTERRUPT.append(signum)

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _INTERRUPT.clear()


def slowest(times: list[float], memory: Any, failed: BaseException | None = None) -> tuple[list[float], Any]:
    """Each step's time as the largest over the processes (a step is done when all are), and
    the largest memory figure; every process must call it. Unchanged in a lone process.
    Raises ``KeyboardInterrupt`` in every process when any noted a Ctrl-C (:func:`interrupts_agreed`),
    and when a process's step failed (``failed``), that error there and :class:`StepFailedElsewhere`
    in the others: alone, the others ran on into the next step's collectives and waited for it
    until JAX's shutdown barrier aborted them all, 5 minutes on."""
    if jax.process_count() == 1:
        if failed is not None:
            raise failed
        return times, memory
    said = None if failed is None else f"{type(failed).__name__}: {first_line(failed)}"
    every = gather_json([list(map(float, times)), memory, bool(_INTERRUPT), said], "the measured step times")
    if any(asked for _, _, asked, _ in every):
        raise KeyboardInterrupt
    if failed is not None:
        raise failed
    for i, (_, _, _, other) in enumerate(every):
        if other is not None:
            raise StepFailedElsewhere(f"process {i}'s step failed: {other}")
    steps = [max(t[i] for t, _, _, _ in every) for i in range(len(times))]
    figures = [m for _, m, _, _ in every if m is not None]
    return steps, (max(figures) if figures else None)


class StepFailedElsewhere(RuntimeError):
    """Another process's step failed while this one's ran: raised here too, at the same point."""


def agreed_target(target: Any) -> Any:
    """The hardware target every process prices with: a name or file loaded (``cpu``: measured
    by every process at once, over its own devices, then its links as this program routes them:
    :func:`with_process_links`), then process 0's on all. ``target`` as given in a lone process."""
    from spmdkit._target import Target, from_json, load_target

    if jax.process_count() == 1:
        return target  # the planner loads it for this process's devices
    sync("spmdkit plan: measure the target", "before measuring the target")  # all measure under one load
    measure_links = isinstance(target, str) and target == "cpu"
    if not isinstance(target, Target):
        target = load_target(target, jax.local_device_count())
    if measure_links:
        target = with_process_links(target)
    return from_json(from_process_0(target.to_json()), where="process 0's target")


# The operands of the combined all-reduce that tells whether alpha is paid per operand.
LINK_OPERANDS = 8
# Alpha is paid per operand when each extra array of a combined all-reduce costs more than this
# share of a one-array call (gloo between processes: ~1-1.6; an in-process call: well below).
PER_OPERAND_RATIO = 0.5


def _link_program(kind: str, axis: str, group: int, parts: int, loops: int):
    """``loops`` collectives of ``kind`` over mesh axis ``axis`` (``proc``: across processes,
    ``local``: within each) of a ``(processes, local devices)`` mesh over every device, on
    ``parts`` arrays at once; each device's blocks keep their size (one dispatch per call)."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("proc", "local"))
    if kind == "all_reduce":
        one = lambda vs: [v * (1.0 / group) for v in jax.lax.psum(vs, axis)]  # noqa: E731
    else:  # all_gather: the gathered output is the block
        one = lambda vs: [jax.lax.all_gather(v[: v.shape[0] // group], axis, tiled=True) for v in vs]  # noqa: E731
    spec = P(("proc", "local"))
    body = lambda *xs: tuple(jax.lax.fori_loop(0, loops, lambda i, vs: one(vs), list(xs)))  # noqa: E731
    return mesh, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * parts, out_specs=(spec,) * parts,
                                       check_vma=False))


def _link_case(kind: str, axis: str, group: int, nbytes: int, parts: int = 1, loops: int = 10):
    """A blocking call that returns its seconds per collective of ``kind`` over ``axis``,
    ``nbytes`` per device in ``parts`` arrays; compiled and warmed up (every process runs the
    same calls in the same order)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh, program = _link_program(kind, axis, group, parts, loops)
    per = max(nbytes // 4 // parts // group, 1) * group
    sharding = NamedSharding(mesh, P(("proc", "local")))
    xs = [jax.make_array_from_callback((mesh.size * per,), sharding, lambda idx: np.ones((per,), np.float32))
          for _ in range(parts)]
    return _timed(program, xs, loops)


def _operand_ratio(one: list[float], many: list[float]) -> float:
    """What each extra array of a :data:`LINK_OPERANDS`-array all-reduce costs, as a share of a
    one-array call: the median over rounds of each round's pair (the two ran seconds apart)."""
    return statistics.median((m - o) / (LINK_OPERANDS - 1) / o if o > 0 else 0.0 for o, m in zip(one, many))


def measure_process_links(kinds: tuple[str, ...] = ("all_reduce", "all_gather")) -> dict[str, Any]:
    """The links of this multi-process program as its runtime routes them, measured now by every
    process at once (every process must call it): ``{"links": {link: Link}, "collectives":
    {kind: {link: Link}}, "per_operand_ratio": r}``. ``inter_host``: a group of one device per
    process (mesh axis across processes); ``intra_host``: the devices of one process, which a
    multi-process XLA:CPU program may run through the same inter-process library (gloo), not
    the in-process path a lone process uses. Alpha-beta of each from two payloads
    (:data:`LINK_SIZES`); ``per_operand`` on every link when an all-reduce of
    :data:`LINK_OPERANDS` small arrays costs more than half a small one's time per extra array
    on both links (``r``: that extra over the one-array time, paired round by round, the
    smaller of the two links'). Each smaller group of a process's devices (2 of 4) gets its own
    ``intra_host`` link (``Link.groups``), timed between computation (:func:`spmdkit._target._between_case`):
    as a step runs them, such a pair costs most of what the whole process's group does (a bare
    loop of them sometimes shows it, sometimes a fifth), where the ring's step count prices it
    at a third. All cases interleaved."""
    from spmdkit._target import Link, steps_and_wire

    local = jax.local_device_count()
    groups = {"inter_host": ("proc", jax.process_count()), "intra_host": ("local", local)}
    groups = {k: v for k, v in groups.items() if v[1] > 1}
    subgroups = [g for g in range(2, local) if local % g == 0]
    rows = np.array(jax.devices()).reshape(jax.process_count(), local)  # a row per process
    small, large = LINK_SIZES
    cases = {}
    for link, (axis, group) in groups.items():
        cases[(link, "operands")] = _link_case("all_reduce", axis, group, small, parts=LINK_OPERANDS)
        for kind in kinds:
            for size in (small, large):
                cases[(link, kind, size)] = _link_case(kind, axis, group, size)
    for group in subgroups:
        for size in (small, large):
            cases[("sub", group, None, size)] = _between_case(None, rows, group, size)
            for kind in kinds:
                cases[("sub", group, kind, size)] = _between_case(kind, rows, group, size)
    rounds = _interleaved(cases)
    seen = {k: statistics.median(v) for k, v in rounds.items()}
    # Both links run through one library: a real cost per operand shows on both. The larger of
    # the two once read 0.63 (0.0-0.3 otherwise) and priced a 17-operand all-reduce at 4x.
    ratio = min((_operand_ratio(rounds[(link, "all_reduce", small)], rounds[(link, "operands")]) for link in groups),
                default=0.0)
    per_operand = ratio > PER_OPERAND_RATIO
    fitted: dict[str, dict[str, Link]] = {kind: {} for kind in kinds}
    for kind in kinds:
        for link, (axis, group) in groups.items():
            t_small, t_large = seen[(link, kind, small)], seen[(link, kind, large)]
            steps, wire = steps_and_wire(kind, group, large - small)
            fitted[kind][link] = Link(alpha=t_small / steps, beta=max(t_large - t_small, 0.0) / wire,
                                      per_operand=per_operand)
        whole = fitted[kind].get("intra_host")
        if whole is not None and subgroups:
            own = {g: _subgroup_link(seen, kind, g, whole) for g in subgroups}
            fitted[kind]["intra_host"] = dataclasses.replace(
                whole, groups=tuple((g, link) for g, link in own.items() if link is not None))
    base = fitted.get("all_reduce") or next(iter(fitted.values()), {})
    return {"links": dict(base), "collectives": fitted, "per_operand_ratio": ratio}


def _subgroup_link(seen: dict, kind: str, group: int, whole: Any) -> Any:
    """The alpha-beta of ``kind`` over ``group`` devices of one process from its between-computation
    cases (:func:`spmdkit._target._group_link`; ``whole``: the process's whole group)."""
    added = tuple(seen[("sub", group, kind, size)] - seen[("sub", group, None, size)] for size in LINK_SIZES)
    return _group_link(kind, group, added, whole)


def links_note(target: Any, source: str) -> str:
    """Where the links that price collectives over several processes come from, and which of
    them is a guess: ``target`` as passed to the planner, ``source`` the loaded target's.

    >>> links_note("cpu", "measured at plan time")[:60]
    'priced without running the processes: inter_host is a fixed '
    """
    if "links measured at plan start" in source:
        return ("measured at plan start in the running processes, as their runtime routes them (see the target's "
                "source)")
    if isinstance(target, str) and target == "cpu":
        return ("priced without running the processes: inter_host is a fixed guess (0.8 ms + 7.5 ns/B per ring step, "
                "alpha once per collective) and intra_host is measured within one process, where a multi-process "
                "program on CPU runs it through the inter-process library too (alpha per operand); pass --target FILE "
                "(spmdkit calibrate measures inter_host) or --measure K (measures both links in the processes)")
    return ("the target's links as written, not measured in a multi-process program (a link's per_operand says "
            "whether alpha is paid per operand)")


def _link_text(name: str, link: Any) -> str:
    """A measured link for the target's source line, with its sub-groups' links."""
    groups = "".join(f" (over {g} of a process's devices, between computation: {sub.alpha:.3g} s + {sub.beta:.3g} s/B)"
                     for g, sub in link.groups)
    return f"{name} {link.alpha:.3g} s + {link.beta:.3g} s/B{groups}"


def with_process_links(target: Any) -> Any:
    """``target`` with the links :func:`measure_process_links` measures in this multi-process
    program (every process must call it), its source saying so; unchanged in a lone process."""
    if jax.process_count() == 1:
        return target
    seen = measure_process_links()
    links = {**target.links, **seen["links"]}
    collectives = {kind: {**target.collectives.get(kind, {}), **per} for kind, per in seen["collectives"].items()}
    for kind in set(target.collectives) - set(collectives):  # a kind not measured over processes: the base links
        collectives[kind] = {k: v for k, v in target.collectives[kind].items() if k not in seen["links"]}
    how = "; ".join(f"{kind} " + ", ".join(_link_text(link, ab) for link, ab in per.items())
                    for kind, per in seen["collectives"].items())
    note = (f"; links measured at plan start in this {jax.process_count()}-process program ({how}); alpha paid "
            f"{'per operand' if seen['links'] and next(iter(seen['links'].values())).per_operand else 'once'} "
            f"(an all-reduce of {LINK_OPERANDS} arrays: {seen['per_operand_ratio']:.2f} of a one-array time per "
            "extra array)")
    return dataclasses.replace(target, links=links, collectives=collectives, source=target.source + note)


__all__ = ["PER_OPERAND_RATIO", "PlanRunError", "agreed_target", "check_device_order", "check_processes", "check_same", "from_process_0",
           "interrupts_agreed", "links_note", "measure_process_links", "slowest", "with_process_links"]
