"""``spmdkit plan``: which mesh and rules for a model on some devices, chosen with reasons.

Every candidate layout (mesh shape x rules x remat x accumulation) of the user's
``make_state`` and ``train_step`` is compiled ahead of time for the devices of every
process (nothing runs), its per-device memory counted, the collectives of the compiled program
read from its HLO, and its step time priced against a hardware target (``"cpu"``: this
machine; or a target file: peak FLOP/s, memory bandwidth, alpha-beta links).
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from spmdkit._errors import BatchSizeError, ConfigError, SignatureError, SpmdkitError, fix
from spmdkit._plan._candidates import DEFAULT_RULES, Candidate, rules_names, rules_table
from spmdkit._plan._drift import watched
from spmdkit._plan._report import (MeasureFailed, MeasureInterrupted, explain, measure as _measure, pareto, print_plan, save_png,
                                   spearman, time_steps)
from spmdkit._plan._processes import (agreed_target, check_device_order, check_processes, check_same, interrupts_agreed,
                                      check_same_arguments, from_process_0, links_note, slowest)
from spmdkit._plan._search import plan as _plan
from spmdkit._strategies._agree import batch_signature
from spmdkit._strategies._base import put_global
from spmdkit._strategies._compile import (batch_rows, check_batch_dtypes, check_callable, check_make_state,
                                         check_state_batch)
from spmdkit._strategies.sharded import Sharded
from spmdkit._target import Target, checked_target


def _host(x: Any) -> Any:
    """A batch leaf as arrays to place: zeros for a shape; with several processes, on the host
    (each process hands its devices' rows to JAX)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # per-example keys: np.zeros cannot make those
            impl = x.dtype._impl
            return jax.random.wrap_key_data(np.zeros((*x.shape, *impl.key_shape), np.uint32), impl=impl)
        return np.zeros(x.shape, x.dtype)
    return np.asarray(x) if jax.process_count() > 1 else x


def _preparer(make_state: Callable, train_step: Callable | None, step_for: Callable | None, batch: Any,
              rng: Any, state_axes: Any) -> Callable[[dict[str, Any]], tuple[Callable[[int], list[float]], int, str]]:
    from spmdkit._mesh import make_mesh
    from spmdkit._plan._memory import compiled_bytes

    def prepare(row: dict[str, Any]) -> tuple[Callable[[int], list[float]], int, str]:
        strategy = Sharded(make_mesh(**row["mesh"]), rules_table(row["rules"]), state_axes=state_axes)
        fn = step_for(row["remat"], row["accum"]) if step_for else train_step
        state = strategy.init(make_state, rng, unbox=True)
        real = jax.tree.map(_host, batch)
        # Placed once, as a prefetched batch is; with several processes each fills its own shards.
        real = put_global(real, strategy._batch_sharding(True))
        step = strategy.step(fn)
        failed = _steps_agreed(step, state, real, 2)[1]  # compile and warm up
        stats = jax.local_devices()[0].memory_stats() or {}
        memory = stats.get("peak_bytes_in_use")
        source = "device allocator peak"
        if memory is None:  # XLA:CPU keeps no memory statistics: the program that ran, as compiled
            memory = compiled_bytes(step.lower(state, real).compile())["total"]
            source = "compiled (XLA:CPU keeps no allocator statistics)"
        memory = slowest([], memory, failed)[1]  # the largest over the processes

        def run(steps: int) -> list[float]:  # each step as long as its slowest process took
            times, failed = _steps_agreed(step, state, real, steps)
            return slowest(times, None, failed)[0]

        return run, memory, source

    return prepare


def _steps_agreed(step: Callable, state: Any, batch: Any, steps: int) -> tuple[list[float], BaseException | None]:
    """:func:`time_steps`, and with several processes each step run even after one failed, the
    first failure returned: the other processes run every step's collectives, and wait in them
    for this one (:func:`slowest` then raises it in all)."""
    if jax.process_count() == 1:
        return time_steps(step, state, batch, steps), None
    times, failed = [], None
    for _ in range(steps):
        try:
            times += time_steps(step, state, batch, 1)
        except (KeyboardInterrupt, SpmdkitError):
            raise
        except Exception as e:  # a callback's or the runtime's error: its collectives ran
            failed = failed or e
            times.append(0.0)
    return times, failed


def _state_signature(make_state: Callable, rng: Any) -> Any:
    """``[path, shape, dtype]`` of every leaf of ``make_state``'s state, abstractly; its error's
    name when it fails (the same in every process: the plan then raises it in each)."""
    from spmdkit._plan._search import abstract_state
    from spmdkit._strategies._agree import signature_or_error

    return signature_or_error(lambda: abstract_state(make_state, rng), "make_state")


def _axes_signature(state_axes: Any) -> Any:
    """``state_axes`` as ``{path: names}``, compared across processes: its ``str`` held a static
    field's function address (a TrainState-shaped ``state_axes``), another in every process."""
    from jax.sharding import PartitionSpec

    names = lambda x: x is None or isinstance(x, (tuple, PartitionSpec))  # noqa: E731
    return {jax.tree_util.keystr(path): repr(x) for path, x in
            jax.tree_util.tree_flatten_with_path(state_axes, is_leaf=names)[0]}


def _whole(name: str, value: Any, least: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ConfigError(fix(f"plan({name}={value!r}): need a whole number >= {least}.", hint))


def _budget(memory_per_device: Any) -> Any:
    """``"512MiB"``, ``"16GB"`` as bytes, as ``--memory-per-device`` reads them: the command line's
    form was refused from Python as "need a finite number of bytes"."""
    if not isinstance(memory_per_device, str):
        return memory_per_device
    import argparse

    from spmdkit._plan_cli import parse_bytes  # here: the command line's module imports this one

    try:
        return parse_bytes(memory_per_device)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(fix(f"plan(memory_per_device={memory_per_device!r}): {e}.",
                              "pass bytes as a number (16e9) or a string such as '16GB' or '512MiB', or leave it "
                              "out (the target's memory_per_device, else no budget).")) from None


def _check_args(memory_per_device: Any, accum: Any, measure: Any, measure_steps: Any, measure_rounds: Any,
                remat: tuple = ()) -> None:
    """The numbers ``plan`` takes, checked before anything is traced or compiled."""
    if memory_per_device is not None and (
            isinstance(memory_per_device, bool) or not isinstance(memory_per_device, (int, float, np.number))
            or not np.isfinite(memory_per_device) or memory_per_device <= 0):
        raise ConfigError(fix(f"plan(memory_per_device={memory_per_device!r}): need a finite number of bytes > 0.",
                              "pass e.g. memory_per_device=16e9 (16 GB per device), or leave it out (the target's "
                              "memory_per_device, else no budget)."))
    if measure != "all":
        _whole("measure", measure, 0, "pass measure=K (K >= 1: run the K best), measure=\"all\" (every ranked "
               "candidate) or measure=0 (price only).")
    _whole("measure_steps", measure_steps, 1, "pass e.g. measure_steps=3 (timed steps per candidate per round).")
    _whole("measure_rounds", measure_rounds, 1, "pass e.g. measure_rounds=14 (rounds the candidates take turns in).")
    for a in tuple(accum):
        _whole("accum", a, 1, f"pass accumulation counts >= 1, e.g. accum=(1, 2) (got {tuple(accum)!r}).")
    _once("remat", remat, "--remat-options")
    _once("accum", accum, "--grad-accum")


def _once(name: str, values: tuple, flag: str) -> None:
    """A value listed twice compiled the same candidate twice and ranked both (dp [data=2] at
    ranks 1 to 4 for --remat-options none,none --grad-accum 1,1); rules listed twice are an error too."""
    twice = [v for i, v in enumerate(values) if v in values[:i]]
    if twice:
        raise ConfigError(fix(f"plan({name}={tuple(values)!r}) ({flag}) lists {twice[0]!r} twice.",
                              f"list each once, e.g. {name}={tuple(dict.fromkeys(values))!r} "
                              f"({flag} {','.join(str(v) for v in dict.fromkeys(values))})."))


# What plan calls each callback with, and a callback of that shape.
_CALLS = {
    "step_for": (("none", 1), "step_for=lambda remat, accum: make_train_step(remat=remat, accum=accum)"),
    "activations": ((None, 1, 1), "activations=lambda candidate, batch_shards, mesh_size: 2**20"),
    "progress": (("",), "progress=print"),
    "on_ranked": (({},), "on_ranked=lambda plan: Path('plan.json').write_text(json.dumps(plan))"),
}


def _check_arity(fn: Callable, name: str) -> None:
    if name not in _CALLS:
        return
    args, example = _CALLS[name]
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        raise SignatureError(fix(f"plan calls {name} with {len(args)} argument(s), which "
                                 f"{getattr(fn, '__name__', name)}{inspect.signature(fn)} does not take.",
                                 f"pass {example}.")) from None
    except ValueError:
        pass  # no signature to read (a builtin): calling it will tell


def _check_inputs(make_state: Any, train_step: Any, batch: Any, target: Any, **callbacks: Any) -> None:
    """The functions, batch and target ``plan`` takes, checked before anything is traced."""
    check_make_state(make_state)
    # As every strategy's step(train_step) checks it: a loss_fn(params, batch, rng) was each
    # candidate's reason, and with one candidate a "pruned" line instead of the error.
    if train_step is not None:  # None: step_for builds the steps
        check_state_batch(train_step, "train_step", "(state, batch) -> (state, aux)")
    for name, fn in callbacks.items():
        if fn is not None:
            check_callable(fn, name, "(see spmdkit.plan)")
            _check_arity(fn, name)
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise BatchSizeError(fix(f"plan(batch={batch!r:.60}) holds no arrays.",
                                 "pass the global batch: arrays or jax.ShapeDtypeStruct, e.g. {'x': np.zeros((256, 784))}."))
    for path, x in leaves:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")) or not np.shape(x):
            raise BatchSizeError(fix(f"plan: batch{jax.tree_util.keystr(path)} is {type(x).__name__} {x!r:.40}, "
                                     "not an array with an example axis.",
                                     "pass arrays (np.asarray(...)) or jax.ShapeDtypeStruct((rows, ...), dtype)."))
        if np.shape(x)[0] == 0:  # every mesh "splits" 0 rows: a plan of empty steps, ranked as if real
            raise BatchSizeError(fix(f"plan: batch{jax.tree_util.keystr(path)} has shape {tuple(np.shape(x))}: no examples.",
                                     "pass the global batch a step trains on, e.g. {'x': np.zeros((256, 784))}."))
    # Strings or objects ended in JAX's raw "Dtype <U1 is not a valid JAX array type" from inside the plan.
    check_batch_dtypes(batch)
    # Leaves of other lengths were each candidate's reason (one candidate: a plan of "no candidate
    # fits"), after the budget hint had counted the first leaf's rows as the batch.
    batch_rows(batch, "batch")
    if not isinstance(target, (str, os.PathLike, Target)):
        raise ConfigError(fix(f"plan(target={target!r:.60}): a name ('cpu', 'h100x8'), a target file or a Target.",
                              "pass target='cpu', target='my_target.json' or spmdkit.load_target(path)."))


def plan(make_state: Callable, train_step: Callable | None, batch: Any, *, memory_per_device: float | None = None,
         target: str | Target = "cpu", rules: tuple[str, ...] = DEFAULT_RULES, remat: tuple[str, ...] = ("none",),
         accum: tuple[int, ...] = (1,), step_for: Callable[[str, int], Callable] | None = None,
         processes: int | None = None, dtype: str = "float32", rng: Any = 0, measure: int | str = 0, measure_steps: int = 3,
         measure_rounds: int = 14,
         activations: Callable[[Candidate, int, int], int | dict[str, int]] | None = None,
         state_axes: Any = None, progress: Callable[[str], None] | None = None,
         on_ranked: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Rank the sharded layouts of ``make_state``/``train_step`` on the devices of every process.

    Candidates are the factorisations of ``jax.device_count()`` over the mesh axes each
    rules table names (``rules``: presets, ``"hsdp+tp"``, TOML files), times ``remat``
    and ``accum`` (which need ``step_for(remat, accum) -> train_step``, given instead of ``train_step``:
    pass ``train_step=None``). ``batch`` is the
    global batch (arrays or ``jax.ShapeDtypeStruct``); ``state_axes`` names the dimensions
    of a plain (unannotated) state's arrays, as for :class:`spmdkit.Sharded`;
    ``activations(candidate, batch_shards, mesh_size)`` gives your step's activation memory per
    device, in bytes or as a dict of named parts in bytes, for the analytic count (without it
    only the compiled figure sees them). A rules entry is a
    name (a preset, ``"hsdp+tp"``, a TOML file, inline ``"batch=data,hidden=model"``) or a dict
    ``{logical name: mesh axis or None}`` as :class:`spmdkit.Sharded` takes; a lone string is one
    entry. ``dtype`` is the compute dtype whose peak rate prices the FLOPs (``"float32"``,
    ``"bfloat16"``, any JAX dtype name; aliases ``"bf16"``, ``"fp16"``, ``"fp32"``); a dtype the
    target gives no peak for is priced at its float32 peak. Each is compiled, never run,
    unless ``measure=K`` (or ``"all"``): then the K best (or every ranked candidate) run, taking turns ``measure_rounds`` times
    ``measure_steps`` steps each, and the plan gains ``"measured"`` (predicted vs measured, Spearman rank correlation, and
    ``reproducibility``: the measurement's order in one half of its rounds against the other's).

    ``target``: ``"cpu"`` (this machine, measured at start), a target file or example's name, or
    a :class:`spmdkit.Target`, whose figures are checked as a file's are (a ``TargetError``
    names a figure in another unit, such as ``{"float32": 67}`` for 67 TFLOPS).

    ``processes``: the hosts the devices are spread over; collectives whose devices span
    them are priced with the target's ``inter_host`` link. Default: the processes running
    (``jax.process_count()``). In a lone process a larger count prices only (``measure=0``);
    under ``jax.distributed`` (a script started by ``spmdkit launch``, which calls
    :func:`spmdkit.initialize` first) every process calls ``plan`` with the same arguments
    and batch, the candidates compile for the global devices, ``measure=K`` runs them in
    every process (each step's time: the slowest process's), and every process gets the same
    dict: process 0's plan (its target, its compile times).

    Returns a dict: ``candidates`` (ranked ``ok`` ones first, each with ``step_s``, its
    range ``step_s_overlapped``..``step_s_serial``, ``memory``, ``collectives``, flags
    ``replicated``/``conflicts``; then ``pruned`` and ``over_budget`` ones with a
    ``reason``), ``frontier`` (memory vs time Pareto labels) and ``why`` (lines).

    ``on_ranked(plan)``, with ``measure``: called on every process with the priced plan (the
    dict above, without ``"measured"``) before the measurement starts, which may take
    minutes: save it there (as ``spmdkit plan --json`` does), and a run killed while measuring
    still leaves its ranking. Not called when no candidate is ranked (nothing to measure); an
    exception it raises stops the plan there.

    Example (``plan`` compiles on ``jax.device_count()`` devices, whatever the target: a script
    on a one-device machine sets the count first)::

        >>> import spmdkit
        >>> spmdkit.use_host_devices(8)   # first, before any JAX operation
        >>> import jax, jax.numpy as jnp
        >>> make_state = lambda rng: {"w": jnp.zeros((16, 32))}
        >>> step = lambda s, b: ({"w": s["w"] - 0.1 * b["x"].T @ (b["x"] @ s["w"])}, {})
        >>> result = spmdkit.plan(make_state, step, {"x": jnp.ones((16, 16))}, rules=("dp",),
        ...                       target="h100x8")
        >>> result["candidates"][0]["label"], result["candidates"][0]["collectives"][0]["kind"]
        ('dp [data=8]', 'all_reduce')
    """
    # A lone value is one entry (a string would otherwise be iterated by character).
    remat = (remat,) if isinstance(remat, str) else tuple(remat)
    accum = (accum,) if isinstance(accum, (int, np.integer)) else tuple(accum)
    memory_per_device = _budget(memory_per_device)
    _check_args(memory_per_device, accum, measure, measure_steps, measure_rounds, remat)
    _check_inputs(make_state, train_step, batch, target, step_for=step_for, progress=progress, activations=activations,
                  on_ranked=on_ranked)
    if isinstance(target, Target):  # as a target file is read: a datasheet's TFLOPS typed in priced steps at minutes
        target = checked_target(target, f"plan(target=Target({target.name!r}))")
    rules = rules_names(rules)
    processes = check_processes(processes, measure)
    if jax.process_count() > 1:
        # The state and its names too: other shapes or axes in one process hung its measurement
        # for ever (its steps' collectives never met), or were planned as process 0's.
        check_same_arguments({"rules": rules, "remat": remat, "accum": accum, "memory_per_device": memory_per_device,
                              "dtype": dtype, "measure": measure, "measure_steps": measure_steps,
                              "measure_rounds": measure_rounds, "batch": batch_signature(batch),
                              "make_state": _state_signature(make_state, rng), "state_axes": _axes_signature(state_axes)})
        check_device_order()
        target = agreed_target(target)
    result = _plan(make_state, train_step, batch, memory_per_device=memory_per_device, target=target, rules=rules,
                   remat=remat, accum=accum, step_for=step_for, processes=processes, dtype=dtype, rng=rng,
                   activations=activations, state_axes=state_axes, progress=progress)
    if processes > 1:
        result["target"]["links_note"] = links_note(target, result["target"]["source"])
    result["frontier"] = [r["label"] for r in pareto(result["candidates"])]
    result["why"] = explain(result)
    result = from_process_0(result)  # several processes: all measure process 0's ranking, in its order
    ranked = any(r["status"] == "ok" for r in result["candidates"])
    if measure:
        if on_ranked is not None and ranked:
            on_ranked(copy.deepcopy(result))  # the caller may keep or change it; measuring adds to ours
        if progress and ranked:  # minutes may pass before the table: say what runs and how to stop it
            progress(f"measuring {'every' if measure == 'all' else f'the {measure} best'} candidate(s): "
                     f"{measure_rounds} round(s) of {measure_steps} step(s) each (Ctrl-C stops and shows the rounds "
                     "done)")
        try:
            with interrupts_agreed():  # several processes stop at the same point, so process 0 can report
                prepare = _preparer(make_state, train_step, step_for, batch, rng, state_axes)
                run = lambda: _measure(result, measure, prepare, measure_steps, rounds=measure_rounds)  # noqa: E731
                # Over processes the links are timed as that program routes them, not by this probe.
                result["measured"] = (watched(result["target"], jax.device_count(), measure_rounds, run)
                                      if jax.process_count() == 1 else run())
        except MeasureFailed as failed:  # a step that failed when run: the priced plan travels with it
            failed.plan = result
            raise
        except MeasureInterrupted as stop:  # Ctrl-C: the priced plan and the whole rounds travel with it
            if stop.measured is not None:
                result["measured"] = {**stop.measured, "processes": jax.process_count()}
            stop.plan = result
            raise
        result["measured"]["processes"] = jax.process_count()
    check_same(result)  # several processes: every one returns the same plan
    return result


__all__ = ["plan", "print_plan", "save_png", "spearman", "pareto", "explain", "Candidate", "DEFAULT_RULES"]
