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

import json
from typing import Any

import jax
import numpy as np

from spmdkit._errors import ConfigError, SpmdkitError, fix


class PlanRunError(SpmdkitError, RuntimeError):
    """The processes that measure a plan failed or timed out."""

    exit_code = 4  # the CLI's code for a lost peer process


def check_processes(processes: int | None, measure: int, running: int | None = None) -> int:
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
        raise ConfigError(fix(f"plan(processes={processes}, measure={measure}) in a single process: measuring "
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


def from_process_0(value: Any) -> Any:
    """Process 0's JSON-able ``value`` on every process, as JSON reads it back (tuples
    become lists); every process must call it. The value itself in a lone process."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    raw = json.dumps(value, default=_plain).encode() if jax.process_index() == 0 else b""
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array([len(raw)], np.int32)))[0])
    buf = np.zeros(1 << max(8, (size - 1).bit_length()), np.uint8)  # few sizes: few compilations
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8)
    return json.loads(bytes(got[:size]).decode())


def check_same(value: Any) -> None:
    """Raise unless ``value`` (JSON-able) is the same on every process; every process must call it."""
    if jax.process_count() == 1:
        return
    import hashlib

    from spmdkit._data._feed import gather_json

    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=_plain).encode()).hexdigest()
    every = gather_json(digest)
    if len(set(every)) > 1:
        differ = [i for i, d in enumerate(every) if d != every[0]]
        raise PlanRunError(fix(f"the plan differs between processes 0 and {differ} (spmdkit sends process 0's plan to "
                               "all and takes each measurement over all: this is a bug of spmdkit).",
                               "report it with the command; meanwhile plan with --processes 1."))


def slowest(times: list[float], memory: Any) -> tuple[list[float], Any]:
    """Each step's time as the largest over the processes (a step is done when all are), and
    the largest memory figure; every process must call it. Unchanged in a lone process."""
    if jax.process_count() == 1:
        return times, memory
    from spmdkit._data._feed import gather_json

    every = gather_json([list(map(float, times)), memory])
    steps = [max(t[i] for t, _ in every) for i in range(len(times))]
    figures = [m for _, m in every if m is not None]
    return steps, (max(figures) if figures else None)


def agreed_target(target: Any) -> Any:
    """The hardware target every process prices with: a name or file loaded (``cpu``: measured
    by every process at once, over its own devices), then process 0's on all. ``target`` as
    given in a lone process."""
    from spmdkit._target import Target, from_json, load_target

    if jax.process_count() == 1:
        return target  # the planner loads it for this process's devices
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("spmdkit plan: measure the target")  # all measure under one load
    if not isinstance(target, Target):
        target = load_target(target, jax.local_device_count())
    return from_json(from_process_0(target.to_json()), where="process 0's target")


__all__ = ["PlanRunError", "agreed_target", "check_device_order", "check_processes", "check_same", "from_process_0",
           "slowest"]
