"""``spmdkit plan``: the command line of the planner, for the built-in ``lm`` and ``mlp``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from spmdkit._argtypes import path_arg
from spmdkit._atomic import replace_whole
from spmdkit._config import TASK_FLAGS, check_task_flags
from spmdkit._console import finite_or_null
from spmdkit._errors import ConfigError, SpmdkitError, fix, unwritable, wrong_output_path
from spmdkit._process import end_soon
from spmdkit._tasks.lm import REMAT

# Set by a ``plan --processes P --measure K`` for the processes it starts: process 0 writes the plan there,
# and the priced plan before measuring (ENV_PLAN_RANKED), which the command shows if the processes die.
ENV_PLAN_RESULT = "SPMDKIT_PLAN_RESULT"
ENV_PLAN_RANKED = "SPMDKIT_PLAN_RANKED"
_ENV_STRIP = ("SPMDKIT_COORDINATOR", "SPMDKIT_NUM_PROCESSES", "SPMDKIT_PROCESS_ID", "SPMDKIT_HOST_DEVICES")

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


_POWER = {"K": "10^3 bytes", "M": "10^6 bytes", "G": "10^9 bytes", "T": "10^12 bytes", "Ki": "2^10 bytes",
          "Mi": "2^20 bytes", "Gi": "2^30 bytes", "Ti": "2^40 bytes"}


def parse_bytes(text: str) -> float:
    """``"16e9"``, ``"16GB"``, ``"512MiB"`` -> bytes."""
    m = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m and m.group(2).lower() in ("k", "m", "g", "t"):
        unit = m.group(2).upper()
        raise argparse.ArgumentTypeError(f"{text!r} could mean {m.group(1)}{unit}B ({_POWER[unit]}) or "
                                         f"{m.group(1)}{unit}iB ({_POWER[unit + 'i']}): write one of those")
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes like 16e9, 16GB or 512MiB, got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not 0 < value < math.inf:  # 1e400 reads as inf: refused here, not later as plan(memory_per_device=inf)
        raise argparse.ArgumentTypeError(f"expected a finite budget > 0 bytes like 16GB or 512MiB, got {text!r}")
    return value


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _remat_list(text: str) -> tuple[str, ...]:
    """``--remat-options``: lm's remat policies. A misspelt one reached the planner as "step_for('ful', 1)
    raised ConfigError ... make step_for build a step for every remat policy", naming a function the
    command line user never wrote."""
    values = _names(text)
    wrong = [v for v in values if v not in REMAT]
    if wrong or not values:
        raise argparse.ArgumentTypeError(f"{wrong[0] if wrong else text!r} is not a remat policy: give some of "
                                         f"{','.join(REMAT)} separated by commas (e.g. none,full)")
    return values


def _rules_list(text: str) -> tuple[str, ...]:
    """``--rules``: names separated by commas, where neighbouring ``logical=axis`` pairs form one
    inline table (``dp,batch=data,hidden=model`` is two entries); ``;`` separates two inline tables.

    >>> _rules_list("dp,batch=data,hidden=model,tp"), _rules_list("batch=data;batch=data,hidden=model")
    (('dp', 'batch=data,hidden=model', 'tp'), ('batch=data', 'batch=data,hidden=model'))
    """
    out: list[str] = []
    for group in text.split(";"):
        pairs: list[str] = []
        for part in _names(group):
            if "=" in part:
                pairs.append(part)
                continue
            if pairs:
                out.append(",".join(pairs))
                pairs = []
            out.append(part)
        if pairs:
            out.append(",".join(pairs))
    if not out:
        # The planner's own error then spoke of plan(rules=()), a Python call this user never wrote.
        raise argparse.ArgumentTypeError(f"expected rules separated by commas (presets, TOML files, logical=axis "
                                         f"pairs), got {text!r}: e.g. --rules dp,fsdp+tp")
    return tuple(out)


def _measure_count(text: str) -> int | str:
    """``--measure``: a count of candidates, or ``all``."""
    if text.strip().lower() == "all":
        return "all"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count of candidates nor 'all' "
                                         "(e.g. --measure 6, or --measure all)") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, got {text!r}")
    return values


def add_plan_parser(sub: Any, common: argparse.ArgumentParser, positive_int: Any, lm_options: Any) -> None:
    from spmdkit._plan._candidates import DEFAULT_RULES

    p = sub.add_parser(
        "plan", parents=[common],
        help="rank mesh x rules x remat x accumulation for a model on N devices, with reasons",
        description="Compiles (never runs) every candidate layout on N simulated devices, counts its memory per "
        "device, reads the collectives of the compiled program, prices the step on a hardware target and prints "
        "the ranking, the memory/time Pareto frontier and why the winner wins.")
    p.add_argument("--task", choices=("lm", "mlp"), default="lm", help="the model (lm)")
    p.add_argument("--devices", type=positive_int, required=True, metavar="N", help="devices to plan for")
    p.add_argument("--processes", type=positive_int, default=None, metavar="P",
                   help="processes (hosts) the devices are spread over: collectives across them use the target's "
                   "inter_host link; with --measure the command starts P processes of N/P devices each and "
                   "measures over them (default: the processes running, 1 unless under spmdkit launch)")
    p.add_argument("--memory-per-device", type=parse_bytes, metavar="BYTES",
                   help="budget per device, e.g. 16GB or 512MiB (default: the target's memory_per_device)")
    p.add_argument("--target", default="cpu", metavar="cpu|FILE",
                   help="cpu (this machine, measured now), a target JSON file (spmdkit calibrate writes one), "
                   "or h100x8 / tpu-v5e-16 (datasheet examples) (cpu)")
    p.add_argument("--rules", type=_rules_list, default=DEFAULT_RULES, metavar="LIST",
                   help="rules to try, comma-separated: presets, hsdp+tp, TOML files, inline logical=axis pairs "
                   f"(neighbouring pairs form one table; ';' separates two) ({','.join(DEFAULT_RULES)})")
    p.add_argument("--remat-options", type=_remat_list, default=None, metavar="LIST",
                   help="lm: remat policies to try, e.g. none,dots,full (default: --remat, else none)")
    p.add_argument("--grad-accum", type=_ints, default=(1,), metavar="LIST",
                   help="accumulation steps to try at the same global batch, e.g. 1,2,4 (1)")
    p.add_argument("--batch-size", type=positive_int, help="global batch (the task's)")
    p.add_argument("--measure", type=_measure_count, default=0, metavar="K|all",
                   help="also run the K best (all: every candidate) for real and compare (0)")
    p.add_argument("--measure-steps", type=positive_int, default=3, metavar="S",
                   help="--measure: timed steps per candidate per round (3)")
    p.add_argument("--measure-rounds", type=positive_int, default=14, metavar="R",
                   help="--measure: rounds in which the candidates take turns (14: candidates 3-5%% apart "
                   "need many rounds; steps within a round share its load)")
    p.add_argument("--measure-timeout", type=positive_int, default=1800, metavar="S",
                   help="--measure with --processes P > 1: seconds before every process is killed (1800)")
    p.add_argument("--json", type=path_arg, metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--png", type=path_arg, metavar="FILE", help="also draw the memory/time frontier as a PNG")
    p.add_argument("--layers", type=positive_int, help="mlp, lm: number of layers (mlp 4, lm 2)")
    p.add_argument("--depth", type=positive_int, help="mlp: hidden width (512)")
    p.add_argument("--embed", type=positive_int, help="mlp: input/output width (128)")
    # Not train's default (1000000): plan reads only what a batch needs (_text_bytes).
    lm_options(p, "lm: training bytes read (default: enough for a batch, max(batch-size x (seq-len + 1) x 2, "
                  "20000); held out: a tenth)")


def _lm_sizes(args: argparse.Namespace) -> dict[str, Any]:
    # scan_unroll too: the rolled and unrolled programs keep different activations (their memory fits differ).
    return {k: getattr(args, k) for k in ("layers", "d_model", "heads", "seq_len", "precision", "scan_unroll")
            if getattr(args, k)}


def _lm(args: argparse.Namespace, batch_size: int):
    import optax

    from spmdkit._plan._memory import lm_activations
    from spmdkit._tasks import lm
    from spmdkit._train._steps import task_state, task_train_step

    sizes = _lm_sizes(args)
    cfg = lm.LMConfig(**sizes)
    task = lm.make(**sizes, text_dir=args.text_dir, text_bytes=_text_bytes(args, cfg.seq_len, batch_size))
    optimizer = optax.adamw(lm.DEFAULTS["lr"])

    def step_for(remat: str, accum: int):
        _, init, loss_fn = lm.lm_functions(lm.LMConfig(**sizes, remat=remat))
        return task_train_step(dataclasses.replace(task, init=init, loss_fn=loss_fn), optimizer, accum)

    activations = lm_activations(cfg, batch_size)
    remat = args.remat_options or ((args.remat,) if args.remat else ("none",))
    dtype = "bfloat16" if cfg.precision == "bf16" else "float32"
    return task, task_state(task, optimizer), step_for, activations, remat, dtype


def _text_bytes(args: argparse.Namespace, seq_len: int, batch_size: int) -> int:
    """--text-bytes, else enough text for one global batch: the planner needs shapes, --measure a real batch."""
    return args.text_bytes or max(batch_size * (seq_len + 1) * 2, 20_000)


def _mlp(args: argparse.Namespace, batch_size: int):
    import optax

    from spmdkit._plan._memory import mlp_activations
    from spmdkit._tasks import mlp
    from spmdkit._train._steps import task_state, task_train_step

    sizes = {k: getattr(args, k) for k in ("layers", "depth", "embed") if getattr(args, k)}
    task = mlp.make(**sizes, num_train=512, num_eval=64)
    optimizer = optax.adam(mlp.DEFAULTS["lr"])
    return (task, task_state(task, optimizer), (lambda remat, accum: task_train_step(task, optimizer, accum)),
            mlp_activations(batch_size, **sizes))


class PlanFileError(SpmdkitError, OSError):
    """``--json`` or ``--png`` cannot be written: a path that cannot be one (exit code 2, bad
    input), or a place that refuses the write (5, an I/O failure)."""

    exit_code = 5  # the CLI's code for an I/O failure; check_out sets 2 for a wrong path


def check_out(path: str | None, flag: str) -> None:
    """An output file, checked writable before minutes of planning."""
    if path == "-":  # read as stdout by other tools; it wrote a file named "-" beside the printed table
        raise ConfigError(fix(f"{flag} '-': the plan's table is what goes to stdout, so {flag} takes a file name.",
                              f"write it to a file, e.g. {flag} plan.{flag[2:]} (or {flag} /dev/stdout to mix "
                              "it into the table's output)."))
    problem = None if path is None else unwritable(path, f"{flag} {path!r}", f"{flag} plan.{flag[2:]}")
    if problem:
        error = PlanFileError(fix(*problem))
        if wrong_output_path(path):  # a directory, a missing folder, a file in the way: bad input
            error.exit_code = 2
        raise error


def _check_task_options(args: argparse.Namespace) -> None:
    """The task takes every model option given (as train checks): the planner builds each model
    from its own sizes, so another task's would be dropped without a word."""
    offered = [k for k in TASK_FLAGS if hasattr(args, k)]
    check_task_flags(args.task, [k for k in offered if getattr(args, k) is not None], offered)


def _check_args(args: argparse.Namespace) -> None:
    """Flag errors found before any process starts or any JAX work."""
    _check_task_options(args)
    check_out(args.json, "--json")
    check_out(args.png, "--png")
    if args.json and args.png and os.path.realpath(args.json) == os.path.realpath(args.png):
        # the PNG was written over the JSON (or the other way round), one of them lost without a word
        raise ConfigError(fix(f"--json and --png name the same file {args.json!r}: the second would replace the first.",
                              "give each its own name, e.g. --json plan.json --png plan.png."))
    if args.measure != "all" and args.measure < 0:
        raise ConfigError(fix(f"--measure {args.measure}: the number of candidates to run cannot be negative.",
                              "pass --measure K with K >= 1, --measure all, or leave it out (0: price only)."))
    if args.processes is not None and args.devices % args.processes:
        raise ConfigError(fix(f"--devices {args.devices} do not split evenly over --processes {args.processes}.",
                              f"give --devices a multiple of {args.processes} (e.g. --devices "
                              f"{args.processes * max(args.devices // args.processes, 1)}), or --processes a divisor "
                              f"of {args.devices}."))


def _running_processes() -> int:
    import jax

    # Only a process that joined a job can be one of several; asking JAX otherwise would
    # start its backend before this command starts the processes that measure.
    return jax.process_count() if jax.distributed.is_initialized() else 1


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Any:
    """SIGTERM (a batch scheduler's time limit, ``kill``) stops a plan as Ctrl-C does, noted in
    the list yielded: the ranking and the rounds measured so far shown and written. It ended
    the process where it fell, the rounds lost. SIGTERM goes to whatever handles SIGINT then
    (several processes measuring: noted, every process stopping at the same point)."""
    term: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield term
        return

    def handler(signum: int, frame: Any) -> None:
        if term:  # a scheduler signals every process, and the launcher passes it on: one is the stop
            return
        term.append(signum)
        current = signal.getsignal(signal.SIGINT)
        from spmdkit._plan._processes import _INTERRUPT

        if getattr(current, "seen", False) or _INTERRUPT:  # a Ctrl-C is stopping it already: a second stop, raised
            return  # while the rounds are summarised, lost them and the table
        if callable(current):
            current(signal.SIGINT, frame)
        else:  # SIGINT ignored or not Python's: stop here
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield term
    finally:
        # None: a handler not set from Python, which cannot be put back; the default ends the process.
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    _check_args(args)
    running = _running_processes()
    with _sigterm_as_ctrl_c() as term:
        try:
            if running == 1 and (args.processes or 1) > 1 and args.measure:
                return _relaunch(args, console, term)
            return _plan_here(args, console, running, term)
        except KeyboardInterrupt:
            if not term:
                raise  # Ctrl-C: main() says "interrupted", exit code 130
            sys.stderr.write("spmdkit: terminated (SIGTERM)\n")
            return end_soon(143, "SIGTERM")  # the shell's code for a SIGTERM


def _plan_here(args: argparse.Namespace, console: Console, running: int, term: list[int]) -> int:
    """The plan in this process (one of several under ``spmdkit launch``, or alone)."""
    import jax

    from spmdkit._plan import plan
    from spmdkit._plan._report import MeasureFailed, MeasureInterrupted
    from spmdkit._tasks import task_defaults

    if running > 1 and args.processes not in (None, running):
        raise ConfigError(fix(f"--processes {args.processes}, but this is one of {running} processes.",
                              f"pass --processes {running}, or leave --processes out."))
    if jax.device_count() != args.devices:
        raise ConfigError(fix(f"--devices {args.devices}, but {'the' if running > 1 else 'this'} "
                              f"{'processes have' if running > 1 else 'process has'} {jax.device_count()} device(s).",
                              f"leave --host-devices out (plan simulates --devices), or give --host-devices {args.devices}."
                              if running == 1 else f"start each process with {args.devices // running} device(s) "
                              f"(spmdkit launch -n {running} --host-devices-per-process {args.devices // running})."))
    lead = jax.process_index() == 0  # several processes: process 0 alone prints and writes
    batch_size = args.batch_size or task_defaults(args.task)["batch_size"]
    if args.task == "lm":
        task, make_state, step_for, activations, remat, dtype = _lm(args, batch_size)
    else:
        if args.remat_options and tuple(args.remat_options) != ("none",):
            raise ConfigError(fix("--remat-options is an option of --task lm.", "drop it for --task mlp."))
        task, make_state, step_for, activations = _mlp(args, batch_size)
        remat, dtype = ("none",), "float32"
    rows = jax.tree.leaves(task.train_data)[0].shape[0]
    if rows < batch_size:
        more = ""
        if args.task == "lm":  # windows of seq_len bytes: fewer than --text-bytes allows means the corpus ran out
            seq_len = jax.tree.leaves(task.train_data)[0].shape[1] - 1
            wanted = _text_bytes(args, seq_len, batch_size)
            more = (f", or more text in --text-dir (its training files hold about {rows * seq_len} bytes, all of "
                    "them read)" if (rows + 1) * seq_len < wanted else " (or more --text-bytes)")
        raise ConfigError(fix(f"--batch-size {batch_size}: the task's training set has only {rows} examples.",
                              f"give a smaller --batch-size{more}."))
    batch = jax.tree.map(lambda x: x[:batch_size], task.train_data)
    try:
        result = plan(make_state, None, batch, memory_per_device=args.memory_per_device, target=args.target,
                      rules=args.rules, remat=tuple(remat), accum=args.grad_accum, step_for=step_for,
                      processes=args.processes, dtype=dtype, activations=activations, measure=args.measure,
                      measure_steps=args.measure_steps, measure_rounds=args.measure_rounds,
                      progress=_progress(console) if lead else None, on_ranked=_save_ranked(args, console) if lead else None)
    except MeasureFailed as failed:  # the ranking, shown and written, then the error (main() prints it)
        if failed.plan is not None and lead:
            failed.plan.update(task=args.task, model=_model(args))
            _write(failed.plan, args, console)
        raise
    except MeasureInterrupted as stop:
        # Ctrl-C while measuring lost the compiled and priced plan to a traceback: show and write
        # what there is (the ranking, the whole rounds measured), then exit as interrupted.
        if stop.plan is None:
            raise
        stop.plan.update(task=args.task, model=_model(args))
        how = "terminated (SIGTERM)" if term else "interrupted"
        if lead:
            _write(stop.plan, args, console)
            console.print(f"{how}: {stop}" + ("" if stop.measured else " (nothing measured: the ranking above "
                          "is the prediction alone)"), highlight=False)
        # In a group, JAX's exit may wait for a peer: leave within end_soon's grace (nothing alone).
        return end_soon(143, "SIGTERM") if term else end_soon(130, "Ctrl-C")  # the shell's codes
    result.update(task=args.task, model=_model(args))
    if lead:
        _write(result, args, console)
    return _exit_code(result)


def _model(args: argparse.Namespace) -> dict[str, Any]:
    """The model the plan is for, every size resolved (the flags given, else the task's defaults),
    so that a saved plan says what it planned."""
    import inspect

    from spmdkit._tasks import lm, mlp, task_defaults

    if args.task == "lm":
        cfg = lm.LMConfig(**_lm_sizes(args))
        sizes = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "remat"}  # remat: a candidate's
        # The corpus (a relative --text-dir means nothing from another directory; None: the standard
        # library's source) and the most bytes read from it (a smaller corpus gives fewer).
        text_dir = os.path.abspath(args.text_dir) if args.text_dir else None
        batch_size = args.batch_size or task_defaults("lm")["batch_size"]
        return {**sizes, "scan_unroll": cfg.unroll, "text_dir": text_dir,
                "text_bytes": _text_bytes(args, cfg.seq_len, batch_size)}
    return {k: getattr(args, k) or inspect.signature(mlp.make).parameters[k].default for k in ("layers", "depth", "embed")}


def _save_ranked(args: argparse.Namespace, console: Console) -> Callable[[dict[str, Any]], None]:
    """Before measuring: the priced plan to --json and --png, and to the file of the command that
    started these processes. Measuring may take minutes; a process killed meanwhile (SIGKILL, out of
    memory, a Ctrl-C while a candidate compiles in several processes) left nothing of the ranking.
    A FIFO or device is left for the final write (its reader takes one document); a file that
    cannot be written now is said and measuring goes on (the final write tries again)."""

    def save(result: dict[str, Any]) -> None:
        result.update(task=args.task, model=_model(args))
        written = []
        for path, flag, write in _outputs(result, args):
            if os.path.exists(path) and not os.path.isfile(path):
                continue
            try:
                write_whole(path, flag, write)
                written.append(path)
            except PlanFileError as e:
                console.print(f"warning: the ranking was not saved before measuring: {e}", highlight=False,
                              markup=False)
        if os.environ.get(ENV_PLAN_RANKED):
            write_whole(os.environ[ENV_PLAN_RANKED], "the plan's ranking file", _dump(result, None))
        if written:
            console.print(f"wrote {' and '.join(written)}: the ranking, written again with the measurements",
                          highlight=False, markup=False)

    return save


def _exit_code(result: dict[str, Any]) -> int:
    """0, or 2 (bad input) when no candidate fits: the devices, batch, model sizes or budget given
    admit no layout, which the plan's "why" says how to change; 1 is a crash's code."""
    return 0 if any(r["status"] == "ok" for r in result["candidates"]) else 2


def _progress(console: Console) -> Callable[[str], None]:
    """The planner's progress lines: "[i/n] label" as each candidate compiles, then what it measures."""
    return lambda s: console.print(f"compiling {s}" if s.startswith("[") else s, highlight=False, markup=False)


def write_whole(path: str, flag: str, write: Callable[[str], None]) -> None:
    """``write(tmp)``, then renamed over ``path`` (:func:`replace_whole`); a failure names ``flag``."""
    try:
        replace_whole(path, write)
    except OSError as e:
        raise PlanFileError(fix(f"{flag} {path!r} cannot be written: {e.strerror or e}.",
                                "free disk space or pass another path.")) from None


def _dump(result: dict[str, Any], indent: int | None) -> Callable[[str], None]:
    text = json.dumps(finite_or_null(result), indent=indent, default=str, allow_nan=False)
    return lambda tmp: Path(tmp).write_text(text)


def _outputs(result: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, str, Callable[[str], None]]]:
    """(path, flag, write) for each of --json and --png given."""
    from spmdkit._plan import save_png

    out: list[tuple[str, str, Callable[[str], None]]] = []
    if args.json:
        out.append((args.json, "--json", _dump(result, 2)))
    if args.png:
        out.append((args.png, "--png", lambda tmp: save_png(result, tmp)))
    return out


def _write(result: dict[str, Any], args: argparse.Namespace, console: Console) -> None:
    from spmdkit._plan import print_plan

    if os.environ.get(ENV_PLAN_RANKED):  # from here on this process reports: the command must not show it again
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.environ[ENV_PLAN_RANKED])
    print_plan(result, console)
    for path, flag, write in _outputs(result, args):
        write_whole(path, flag, write)
        console.print(f"wrote {path}", highlight=False)
    if os.environ.get(ENV_PLAN_RESULT):  # the command that started these processes reads it
        write_whole(os.environ[ENV_PLAN_RESULT], "the plan's result file", _dump(result, None))


def _pump(stream: Any, sink: Any, keep: deque | None) -> None:
    """Process 0's lines to ``sink`` without their ``[0] `` prefix (every line, when ``keep`` is given, kept)."""
    for line in iter(stream.readline, ""):
        if keep is not None:
            keep.append(line)
        elif line.startswith("[0] [Gloo] "):  # gloo's word on every connection it makes
            continue
        elif line.startswith("[0] "):
            sink.write(line[4:])
            sink.flush()
        elif not re.match(r"\[\d+\] ", line):  # the other processes print nothing but noise
            sink.write(line)
            sink.flush()


def _relaunch(args: argparse.Namespace, console: Console, term: list[int] = ()) -> int:
    """This command again, in ``--processes`` processes of ``--devices / --processes`` devices each
    under ``spmdkit launch``; process 0's output shown here. A hard ``--measure-timeout``: then the
    launcher is killed with SIGKILL, and its processes with it (they die with the launcher)."""
    per = args.devices // args.processes
    given = list(getattr(args, "raw_argv", sys.argv[1:]))
    argv = [*given, "--host-devices", str(per)]  # the last one given counts
    launcher = [sys.executable, "-P", "-m", "spmdkit._cli", "launch", "-n", str(args.processes),
                "--host-devices-per-process", str(per), "--", sys.executable, "-P", "-m", "spmdkit._cli", *argv]
    console.print(f"measuring over {args.processes} processes x {per} devices: spmdkit launch -n {args.processes} "
                  f"--host-devices-per-process {per} -- spmdkit {' '.join(given)}", highlight=False, markup=False)
    from spmdkit._launch import _die_with_parent

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="spmdkit-plan-") as tmp:
        done, ranked = os.path.join(tmp, "plan.json"), os.path.join(tmp, "ranked.json")
        env = {k: v for k, v in os.environ.items() if k not in _ENV_STRIP}
        env[ENV_PLAN_RESULT], env[ENV_PLAN_RANKED] = done, ranked
        # Not a session of its own: a SIGKILL to this command's process group reaches the launcher;
        # one to this command alone reaches it through PR_SET_PDEATHSIG (it ran on unbounded).
        proc = subprocess.Popen(launcher, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                preexec_fn=_die_with_parent)
        errors: deque = deque(maxlen=200)
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, None), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, None, errors), daemon=True)]
        for t in pumps:
            t.start()
        try:
            how = ("terminated" if term else "interrupted") if _wait_launcher(proc, args, term) else "done"
        except subprocess.TimeoutExpired:
            how = "timeout"
        except KeyboardInterrupt:  # a second Ctrl-C: stop at once
            how = "stopped"
        finally:
            if proc.poll() is None:
                proc.kill()  # the launcher; its processes get SIGKILL when it dies
                proc.wait()
            for t in pumps:
                t.join(timeout=10)
        if how in ("interrupted", "terminated"):  # which processes the launcher had to kill, in its own words
            sys.stderr.writelines(line for line in errors if line.startswith("spmdkit launch: "))
        result, ranking = _read_json(done), _read_json(ranked)
    saved = [p for p in (args.json, args.png) if p and os.path.isfile(p) and os.path.getmtime(p) >= started - 1]
    return _outcome(result, ranking, how, proc.returncode, list(errors), args, console, saved)


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


_STOPPED = {"done": "the processes stopped", "timeout": "the processes were killed at --measure-timeout",
            "interrupted": "interrupted (Ctrl-C)", "stopped": "interrupted (Ctrl-C twice)",
            "terminated": "terminated (SIGTERM)"}


def _outcome(result: dict[str, Any] | None, ranking: dict[str, Any] | None, how: str, code: int,
             errors: list[str], args: argparse.Namespace, console: Console, saved: list[str] = ()) -> int:
    """The exit code of a ``plan`` run in several processes. ``result``: process 0's plan, which it
    printed and wrote; ``ranking``: the priced plan it saved before measuring, removed once it
    reports. Without either, process 0 is reporting or did: nothing more to show. ``how`` the
    launcher ended: ``done``, ``timeout`` (--measure-timeout), ``interrupted`` (Ctrl-C),
    ``terminated`` (SIGTERM), ``stopped`` (Ctrl-C twice); ``saved``: the --json/--png files holding the ranking."""
    from spmdkit._plan import print_plan
    from spmdkit._plan._processes import PlanRunError

    shown = result is None and ranking is not None
    if shown:
        print_plan(ranking, console)
        where = f" (in {' and '.join(saved)})" if saved else ""
        console.print(f"nothing measured: {_STOPPED[how]} before process 0 reported; the ranking above{where} is the "
                      "prediction alone", highlight=False, markup=False)
    if how == "timeout":
        raise PlanRunError(fix(f"the {args.processes} processes measuring the plan did not finish in "
                               f"{args.measure_timeout} s; killed.",
                               "measure fewer candidates (--measure, --rules), fewer --measure-steps or "
                               "--measure-rounds, or raise --measure-timeout."))
    if how == "done" and code == 143 and result is None and not shown:
        # The launcher alone was sent SIGTERM (not this command), nothing shown: its code, said.
        sys.stderr.write("spmdkit: terminated (SIGTERM)\n")
        return 143
    if how in ("interrupted", "stopped", "terminated") or code in (130, 143):  # 143: the launcher or a process
        if result is None and not shown:  # was sent SIGTERM. Nothing printed: main() (or cmd_plan) says so
            raise KeyboardInterrupt
        return 143 if how == "terminated" or code == 143 else 130
    if result is not None:
        return _exit_code(result)
    _raise_failure(code, errors, args.processes)
    return code  # not reached


def _wait_launcher(proc: subprocess.Popen, args: argparse.Namespace, term: list[int] = ()) -> bool:
    """Wait for the launcher, up to ``--measure-timeout``; True after a Ctrl-C (or a SIGTERM, noted in ``term``).

    Ctrl-C: SIGINT to the launcher (again, when the terminal sent one to the whole group), which
    forwards it to the processes (they do not share this terminal's process group), gives them
    5 s to stop, process 0 printing the rounds measured so far, then kills and names the rest.
    A SIGTERM is passed on as a SIGTERM, which the processes take as a Ctrl-C (the launcher
    waits longer for them: a preemption notice). A second Ctrl-C stops at once (the caller
    kills the launcher).
    """
    try:
        proc.wait(timeout=args.measure_timeout)
        return False
    except KeyboardInterrupt:
        pass
    from spmdkit._launch import SIGTERM_WAIT_S, STOP_GRACE_S

    proc.send_signal(signal.SIGTERM if term else signal.SIGINT)
    try:  # the launcher's grace, then its SIGKILL and the last output read: well within this bound
        proc.wait(timeout=(SIGTERM_WAIT_S if term else 0.0) + STOP_GRACE_S + 30)
    except subprocess.TimeoutExpired:
        pass  # the caller kills the launcher, and its processes with it
    return True


def _raise_failure(code: int, lines: list[str], processes: int) -> None:
    """A process's own error as this command's (bad input: exit code 2), else the failure with
    the first error a process reported (before the others' noise at losing it) and the last
    lines the processes wrote."""
    from spmdkit._plan._processes import PlanRunError

    split = [re.match(r"(?:\[(\d+)\] )?(.*)", line, re.S).groups() for line in lines]  # (process or None, text)
    mine = [text for _, text in split]
    first = next((who for who, text in split if text.startswith("error: ")), None)
    error = ""
    if first is not None:  # the first process to report an error, its lines from there
        ours = [text for who, text in split if who == first]
        error = "".join(ours[next(i for i, text in enumerate(ours) if text.startswith("error: ")):])
    if code == 2 and error:
        raise ConfigError(error.strip()[len("error: "):])
    # A process that died by a signal is the cause; its peers' errors at losing it are the symptom.
    died = next((m for m in (re.match(r"spmdkit launch: (process \d+) was killed by signal (\d+)", t) for t in mine)
                 if m), None)
    head = died.string.strip() if died else "".join(error.splitlines(keepends=True)[:15]).rstrip()
    shown = {line.strip() for line in head.splitlines()}
    rest = "".join(t for t in mine[-15:] if t.strip() not in shown).rstrip()  # the last lines, the head not again
    tail = head + ("\n...\n" + rest if rest else "") if head else rest
    if died and died.group(2) in ("9", "15"):  # SIGKILL, SIGTERM: the out-of-memory killer, a kill, a scheduler
        how = "a process was killed from outside (out of memory? a kill command?): run again"
    elif died:
        how = f"{died.group(1)} crashed (signal {died.group(2)}): see its output above; run again"
    else:
        how = f"check that {processes} processes can join here (spmdkit launch -n {processes} -- spmdkit devices)"
    raise PlanRunError(fix(f"the {processes} processes measuring the plan failed (exit code {code}):\n{tail}",
                           f"{how}, or leave --measure out to price only."))
