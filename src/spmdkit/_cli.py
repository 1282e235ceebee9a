"""The ``spmdkit`` command line: parses, sets up devices, calls the Python API.

Nothing here touches a JAX backend before ``--host-devices`` is applied: the
device count of a process is fixed by its first JAX operation.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import select
import shlex
import signal
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from spmdkit import __version__
from spmdkit._argtypes import nonblank_arg, path_arg
from spmdkit._console import StdoutConsole, short_warnings, stderr_console
from spmdkit._devices import (
    ENV_HOST_DEVICES,
    MAX_HOST_DEVICES,
    backend_failure,
    check_host_device_count,
    device_table,
    host_devices_from_env,
    model_parallel_suggestion,
    suggest_mesh,
    use_host_devices,
)
from spmdkit._cache import (ENV_COMPILE_CACHE, cache_dir_from_env, default_cache_dir, enable_compile_cache,
                            enable_default_cache)
from spmdkit._errors import EXIT_CHECK_FAILED, SpmdkitError
from spmdkit._host_memory import _apply as _reuse_host_memory
from spmdkit._host_memory import host_memory
from spmdkit._process import end_soon

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of the output left (`| head`; the shell's code for it)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _scan_unroll(text: str) -> int:
    """``--scan-unroll``: layers per iteration of the lm's scan; 0 or less has no loop form to name."""
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}: pass --scan-unroll 1 for a rolled loop over the layers, or "
                                         "--scan-unroll N with N = --layers for no loop") from None


def _restart_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        # -1 used to be taken as 0 without a word: a user asking for "no limit" got no restarts.
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}: pass --max-restarts 0 for no "
                                         "restarts, or --max-restarts N to restart up to N times")
    return value


def _host_device_count(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_HOST_DEVICES:
        # Simulated devices share this machine's cores; XLA sets up each at start and stalls on many.
        raise argparse.ArgumentTypeError(f"expected at most {MAX_HOST_DEVICES} simulated devices (they share this "
                                         f"machine's {os.cpu_count()} core(s)), got {value}")
    return value


def _host_devices_help() -> str:
    """--host-devices' defaults in the order ``_host_devices`` tries them (it said only the environment,
    else what JAX finds: bench, demo, inspect and calibrate run on 8 unless told otherwise)."""
    by_count: dict[int, list[str]] = {}
    for command, n in sorted(_DEFAULT_DEVICES.items()):
        by_count.setdefault(n, []).append(command)
    fixed = ", ".join(f"{n} for {', '.join(commands)}" for n, commands in sorted(by_count.items()))
    return (f"simulate N CPU devices (not for launch: see its --host-devices-per-process). Default: train's "
            f"host-devices in --config, plan's --devices, else ${ENV_HOST_DEVICES}, else {fixed}, else what JAX "
            "finds (1 device on a machine without GPU or TPU)")


def _device_options(default: object) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--host-devices",
        type=_host_device_count,
        metavar="N",
        default=default,
        help=_host_devices_help(),
    )
    common.add_argument(
        "--compile-cache",
        type=path_arg,
        metavar="DIR",
        default=default,
        help=f"keep compiled programs in DIR for the next start (default: ${ENV_COMPILE_CACHE}, else "
        f"{default_cache_dir()}; on for train, demo, inspect and plan, off for bench unless given)",
    )
    common.add_argument(
        "--no-compile-cache",
        action="store_true",
        default=default,
        help="compile everything afresh and write nothing to the compile cache",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spmdkit",
        description="Write a step for one device; run it on many.",
        parents=[_device_options(None)],
    )
    # SUPPRESS: a subcommand's unset flag must not overwrite `spmdkit --host-devices N CMD`.
    common = _device_options(argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"spmdkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("devices", parents=[common], help="list devices and suggest a mesh")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser(
        "demo",
        parents=[common],
        help="parallel evaluation and data-parallel training on 8 simulated devices",
        description="On 8 simulated CPU devices (or --host-devices N): seed 000's convolve "
        "with spmdkit.pmap, then a short data-parallel run of the digits CNN; prints what it did.",
    )
    p.add_argument("--out", type=path_arg, default="runs/demo", metavar="DIR", help="where the run writes (runs/demo)")
    p.add_argument("--steps", type=_positive_int, default=120,
                   help="training steps (120); from 60 on the demo also checks test accuracy > 50%%")

    _add_train_parser(sub, common)
    _add_data_parser(sub, common)
    _add_inspect_parser(sub, common)
    from spmdkit._plan_cli import add_plan_parser

    add_plan_parser(sub, common, _positive_int, _add_lm_options)
    from spmdkit._calibrate_cli import add_calibrate_parser

    add_calibrate_parser(sub)
    _add_launch_parser(sub)
    p = sub.add_parser("sample", parents=[common], help="generate text with a --task lm checkpoint")
    p.add_argument("--checkpoint-dir", type=path_arg, required=True, metavar="DIR", help="the --checkpoint-dir of a --task lm run")
    p.add_argument("--prompt", default="", help="text to continue (default: a newline)")
    p.add_argument("--length", type=_positive_int, default=200, help="bytes to generate (200)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: the most likely byte (greedy); > 0: sample (0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (0)")
    p.add_argument("--step", type=int, help="which checkpoint step (default: the newest)")
    p = sub.add_parser("checkpoints", parents=[common], help="list the checkpoints in a directory")
    p.add_argument("directory", type=path_arg, help="a --checkpoint-dir")
    p.add_argument("--verify", action="store_true", help="compare every file's CRC-32 with the step's manifest "
                   f"(exit {EXIT_CHECK_FAILED} if a step is damaged or incomplete)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    _add_bench_parser(sub, common)
    return parser


def _add_bench_parser(sub, common: argparse.ArgumentParser) -> None:
    from spmdkit._bench import SUITES

    p = sub.add_parser("bench", parents=[common], help="run a benchmark suite (8 devices by default)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--suite", choices=sorted(SUITES), help="which suite")
    which.add_argument("--all", action="store_true", help="every suite, one after another (--json/--markdown name directories)")
    which.add_argument("--compare", type=path_arg, nargs=2, metavar="DIR", help="compare the targets of two --all --json directories (agree within 10%%? exit 0 if so, 6 if not)")
    p.add_argument("--json", type=path_arg, metavar="PATH", help="also write the figures as JSON to PATH (with --all: a directory, one SUITE.json each)")
    p.add_argument("--markdown", type=path_arg, metavar="PATH", help="also write the figures as Markdown to PATH (with --all: a directory, one SUITE.md each)")
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer rounds (smoke run, not figures)")
    p.add_argument("--rounds", type=_positive_int, metavar="R", help="interleaved timing rounds per case (figures need >= 5)")
    from spmdkit._bench.multiprocess_suite import LEVERS

    p.add_argument("--levers", metavar="LIST", help="multiprocess: also sweep these levers, comma-separated, or 'all' "
                   f"({', '.join(LEVERS)}; see BENCHMARKS.md)")
    p.add_argument("--torch-python", type=path_arg, metavar="PATH", help="multiprocess: run the PyTorch cases with this Python "
                   "(an env with torch; default $SPMDKIT_TORCH_PYTHON, else this Python if it has torch)")


def _add_launch_parser(sub) -> None:
    from spmdkit._launch import SIGTERM_WAIT_S, STOP_GRACE_S

    p = sub.add_parser(
        "launch",
        help="run a command in P local processes joined by jax.distributed",
        description="Starts P copies of COMMAND with a coordinator on 127.0.0.1 and a free port; "
        "output lines are prefixed with the process index; if one process fails, the others are "
        f"stopped (SIGTERM, SIGKILL {STOP_GRACE_S:g} s later) and launch exits with its code (128 + N if signal N "
        "killed it).",
        epilog=f"Signals: SIGTERM to launch (a preemption notice: spmdkit train saves a checkpoint) is forwarded "
        f"to every process, which get {SIGTERM_WAIT_S:g} s to end, then SIGTERM again and SIGKILL {STOP_GRACE_S:g} s "
        f"later ({SIGTERM_WAIT_S + STOP_GRACE_S:g} s in all); launch exits 143. SIGINT (Ctrl-C) is forwarded too, "
        f"SIGKILL {STOP_GRACE_S:g} s later; launch exits 130. Each process killed is named. A second signal to "
        "launch meanwhile neither shortens nor repeats this.",
    )
    p.add_argument("-n", "--processes", type=_positive_int, required=True, help="number of processes")
    p.add_argument("--host-devices-per-process", type=_host_device_count, metavar="D", help="simulated CPU devices each")
    p.add_argument("--max-restarts", type=_restart_count, default=0, metavar="N",
                   help="when a process fails, restart all from the last good checkpoint up to N times (0)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command, after --")
    _add_refused_launch_options(p)


def _add_refused_launch_options(p: argparse.ArgumentParser) -> None:
    """The device and cache flags, hidden, on launch: given to the launcher, they reached no launched
    process without a word (and ``launch --host-devices N`` was taken as ``--host-devices-per-process
    N``, N devices each, not in all); parsed here, ``_refuse_launch_options`` names the right place."""
    p.add_argument("--host-devices", type=_host_device_count, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--compile-cache", type=path_arg, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--no-compile-cache", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _refuse_launch_options(args: argparse.Namespace) -> None:
    """``spmdkit --host-devices N launch ...`` and the cache flags set up no JAX in the launcher, and the
    launched command line is the user's own: an error that says where each flag takes effect."""
    from spmdkit._errors import ConfigError, fix

    p, n = args.processes, getattr(args, "host_devices", None)
    if n is not None:
        each = f"for {n} devices in all, {n // p} in each process" if n % p == 0 else "for D devices in each process"
        per = f"{n // p}" if n % p == 0 else "D"
        raise ConfigError(fix(f"--host-devices {n} is not an option of spmdkit launch: the launched processes "
                              "would not see it.",
                              f"{each}: spmdkit launch -n {p} --host-devices-per-process {per} -- ...; or put it "
                              f"after -- on the launched command, for {n} in each process: spmdkit launch -n {p} -- "
                              f"spmdkit train --host-devices {n}."))
    cache, off = getattr(args, "compile_cache", None), getattr(args, "no_compile_cache", None)
    if cache is not None or off:
        flag = f"--compile-cache {shlex.quote(cache)}" if cache is not None else "--no-compile-cache"
        env = f"{ENV_COMPILE_CACHE}={shlex.quote(cache) if cache is not None else 'off'}"
        raise ConfigError(fix(f"{flag} is not an option of spmdkit launch: the launched processes would not see it.",
                              f"put it after -- on the launched command (spmdkit launch -n {p} -- spmdkit train "
                              f"{flag}), or set {env} in the environment, which every process inherits."))


def _add_layout_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", type=nonblank_arg, metavar="AXES", help="mesh, e.g. data=2,model=4 (default: the rules' preset mesh)")
    p.add_argument("--rules", type=nonblank_arg, metavar="RULES", help="sharded: dp, fsdp, tp, dp+tp, fsdp+tp, fsdp+sp, a TOML file, or batch=data,hidden=model")
    p.add_argument("--replicate-unknown", action="store_true", help="sharded: replicate logical names with no rule")


def _add_mlp_options(p: argparse.ArgumentParser, scan_default: object = argparse.SUPPRESS) -> None:
    p.add_argument("--layers", type=_positive_int, help="mlp, lm: number of layers (mlp 4, lm 2)")
    p.add_argument("--depth", type=_positive_int, help="mlp: hidden width (512)")
    p.add_argument("--embed", type=_positive_int, help="mlp: input/output width (128)")
    p.add_argument("--no-scan", dest="scan", action="store_false", default=scan_default,
                   help="mlp: a Python loop over layers, not nn.scan")
    _add_lm_options(p)


def _add_lm_options(p: argparse.ArgumentParser,
                    text_bytes_help: str = "lm: training bytes read (1000000; held out: a tenth)") -> None:
    from spmdkit._tasks.lm import REMAT

    p.add_argument("--d-model", type=_positive_int, help="lm: model width (64)")
    p.add_argument("--heads", type=_positive_int, help="lm: attention heads; must divide --d-model (4)")
    p.add_argument("--seq-len", type=_positive_int, help="lm: bytes per example (64)")
    p.add_argument("--precision", choices=("f32", "bf16"), help="lm: compute dtype; parameters and optimizer "
                   "state stay float32 (f32)")
    p.add_argument("--remat", nargs="?", const="full", choices=REMAT,
                   help="lm: recompute each layer in the backward pass (full), all but its matmuls (dots) (none)")
    p.add_argument("--scan-unroll", type=_scan_unroll, metavar="N", help="lm: layers per iteration of the scan's "
                   "loop: 1 rolls it (remat then saves memory on every jax), --layers unrolls it (default: unrolled "
                   "up to 8 layers, rolled from 9)")
    p.add_argument("--text-dir", type=path_arg, metavar="DIR", help="lm: train on every file under DIR (default: the "
                   "standard library's *.py files)")
    p.add_argument("--text-bytes", type=_positive_int, help=text_bytes_help)


def _add_train_parser(sub, common: argparse.ArgumentParser) -> None:
    from spmdkit._strategies import IMPLS, STRATEGIES
    from spmdkit._tasks import TASKS

    p = sub.add_parser(
        "train",
        parents=[common],
        help="train a task with a strategy; writes metrics, summary, params and plots",
        description="Train a built-in task. Option values come from the task's defaults, then "
        "--config FILE (flat TOML whose keys mirror these flags), then the flags themselves.",
        argument_default=argparse.SUPPRESS,  # so we know which flags were given
    )
    p.add_argument("--config", type=path_arg, metavar="FILE", action=_Once,
                   help="TOML file of options (keys mirror the flags); one file")
    p.add_argument("--task", choices=sorted(TASKS), help="what to train (default: linreg)")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), help="where it runs (default: data)")
    p.add_argument("--impl", choices=IMPLS, help="data-parallel implementation (auto = jit: the whole step compiled with NamedSharding)")
    p.add_argument("--members", type=_positive_int, help="ensemble size (default: one per device)")
    p.add_argument("--bagging", action="store_true", help="ensemble: each member its own data order")
    p.add_argument("--data-dir", type=path_arg, metavar="DIR", help="where --task mnist finds its files")
    p.add_argument("--data", type=path_arg, metavar="DIR", help="train on this data set directory (spmdkit data write) instead of "
                   "the task's training set, and evaluate on its held-out split DIR/eval if it has one")
    p.add_argument("--eval-data", type=path_arg, metavar="DIR", help="evaluate on this data set directory instead (same leaves as "
                   "the training set)")
    p.add_argument("--verify-data", dest="verify_data", action="store_true",
                   help="check every --data/--eval-data file's CRC-32 before training (the default; overrides "
                   "verify-data = false in a --config file)")
    p.add_argument("--no-verify-data", dest="verify_data", action="store_false",
                   help="--data/--eval-data: skip the CRC-32 check of every file before training (by default the "
                   "data set is read once to check it)")
    p.add_argument("--prefetch", type=int, metavar="N", help="batches read and placed ahead of the step (2; 0: none)")
    _add_layout_options(p)
    _add_mlp_options(p)
    p.add_argument("--steps", type=_positive_int, help="optimizer steps (default: the task's)")
    p.add_argument("--epochs", type=_positive_int, help="passes over the training set, instead of --steps")
    p.add_argument("--batch-size", type=int, help="global batch size, all devices together")
    p.add_argument("--optimizer", help="sgd, adam or adamw (default: the task's)")
    p.add_argument("--lr", type=float, help="learning rate (default: the task's)")
    p.add_argument("--momentum", type=float, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay")
    p.add_argument("--seed", type=int, help="seed of init, data order and step randomness (default 0)")
    p.add_argument("--eval-every", type=_positive_int, help="steps between evals (default: each epoch)")
    p.add_argument("--eval-batch-size", type=_positive_int, help="examples per eval batch (default 256)")
    p.add_argument("--log-every", type=_positive_int, help="steps per metrics line (default 1)")
    p.add_argument("--drop-remainder", action="store_true", help="skip each epoch's last partial batch")
    p.add_argument("--grad-accum", type=_positive_int, help="micro-batches per optimizer step (1)")
    p.add_argument("--out", type=path_arg, metavar="DIR", help="output directory (default runs/latest)")
    p.add_argument("--checkpoint-dir", type=path_arg, metavar="DIR", help="save checkpoints (Orbax) in DIR")
    p.add_argument("--checkpoint-every", type=_positive_int, help="steps between checkpoints (100)")
    p.add_argument("--keep", type=_positive_int, help="checkpoints to keep (3)")
    p.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint")
    p.add_argument("--overwrite-checkpoints", action="store_true",
                   help="a fresh run may replace the checkpoints another run left in --checkpoint-dir")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    _add_negations(p)
    g = p.add_argument_group("several processes (jax.distributed; spmdkit launch sets these for you)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordination service")
    g.add_argument("--num-processes", type=_positive_int, help="processes in the job")
    g.add_argument("--process-id", type=int, help="this process's index, 0..N-1")
    g.add_argument("--distributed-timeout", type=_positive_int, default=100, metavar="S",
                   help="seconds without a finished step (or a heartbeat) before a process counts as dead or hung and all exit (100)")


class _Once(argparse.Action):
    """A flag given at most once: ``--config a.toml --config b.toml`` took b alone, silently."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} is given twice ({getattr(namespace, self.dest)} and {values}); "
                         "it takes one file: merge the two into one, or give the second one's values as flags")
        setattr(namespace, self.dest, values)


def _add_negations(p: argparse.ArgumentParser) -> None:
    """The other side of each on/off option, so that a flag overrides a --config file's
    value either way (``resume = true`` in the file, ``--no-resume`` for one fresh run)."""
    g = p.add_argument_group("turning off what a --config file turned on (or on, for --progress)")
    for key in ("bagging", "replicate_unknown", "drop_remainder", "resume", "overwrite_checkpoints"):
        g.add_argument(f"--no-{key.replace('_', '-')}", dest=key, action="store_false")
    g.add_argument("--progress", dest="progress", action="store_true")


def _add_data_parser(sub, common: argparse.ArgumentParser) -> None:
    from spmdkit._tasks import TASKS

    p = sub.add_parser("data", parents=[common], help="write or check an on-disk data set (--data DIR)")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    # The verbs take the common flags too: `spmdkit data check --host-devices 2 DIR` was refused
    # (unrecognized arguments), although every command takes them after its name.
    w = verbs.add_parser("write", parents=[common], help="write a data set directory from a task's data or an .npz of arrays")
    w.add_argument("out", type=path_arg, metavar="DIR", help="the directory to write")
    source = w.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", choices=sorted(TASKS), help="a built-in task's data (digits, mnist...)")
    source.add_argument("--npz", type=path_arg, metavar="FILE", help="arrays from an .npz file, one leaf per array name")
    w.add_argument("--split", choices=("train", "eval"), help="write only this split of --task, as a single data "
                   "set in DIR (default: both, as DIR/train and DIR/eval)")
    w.add_argument("--data-dir", type=path_arg, metavar="DIR", help="where --task mnist finds its files")
    # lm's data are windows of its own corpus: without these only the stdlib at --seq-len 64 could be written
    w.add_argument("--text-dir", type=path_arg, metavar="DIR", help="--task lm: every file under DIR (default: the stdlib's *.py)")
    w.add_argument("--seq-len", type=_positive_int, help="--task lm: bytes per example (64; train with the same)")
    w.add_argument("--text-bytes", type=_positive_int, help="--task lm: training bytes read (1000000)")
    w.add_argument("--overwrite", action="store_true", help="replace an existing data set in DIR")
    c = verbs.add_parser("check", parents=[common], help="check a data set directory (sizes, shapes, dtypes; --verify: CRC-32)")
    c.add_argument("directory", type=path_arg, metavar="DIR")
    c.add_argument("--verify", action="store_true", help="also read every file and compare its CRC-32")


def _add_inspect_parser(sub, common: argparse.ArgumentParser) -> None:
    from spmdkit._tasks import TASKS

    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="show a sharded layout and the compiled step's memory and flops, without running",
        description="Derives every parameter's layout from the task's logical axis names and the "
        "rules, validates it, and compiles (but does not run) one train step on 8 simulated devices "
        "(or --host-devices N).",
    )
    p.add_argument("--task", choices=sorted(TASKS), default="mlp", help="the model (default mlp)")
    _add_layout_options(p)
    _add_mlp_options(p, scan_default=None)
    p.add_argument("--batch-size", type=_positive_int, help="global batch of the compiled step (the task's)")
    p.add_argument("--grad-accum", type=_positive_int, default=1,
                   help="micro-batches per step, as train's --grad-accum (1): the step train runs with it")
    p.add_argument("--optimizer", default=None, help="sgd, adam or adamw (the task's)")
    p.add_argument("--data-dir", type=path_arg, metavar="DIR", help="for --task mnist")
    p.add_argument("--show", metavar="PATH", help="also draw how one parameter is split, e.g. \"['ScanDotReluDot_0']['W1']\"")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


# Commands that run on 8 simulated devices unless told otherwise: they are about
# showing or measuring many devices on a machine that has one CPU.
_DEFAULT_DEVICES = {"demo": 8, "bench": 8, "inspect": 8}
_DEFAULT_DEVICES["calibrate"] = 8  # the intra_host link: a mesh of 8 simulated devices
# Commands that keep compiled programs for the next start unless told otherwise (bench
# does not: it measures compilation too).
_CACHED_COMMANDS = {"train", "demo", "inspect", "plan"}


def _compile_cache_choice(args: argparse.Namespace) -> str | bool | None:
    """A DIR, False (--no-compile-cache) or None; both flags together are an error, not the last one winning."""
    choice, off = getattr(args, "compile_cache", None), getattr(args, "no_compile_cache", None)
    if choice is not None and off:
        from spmdkit._errors import ConfigError, fix

        raise ConfigError(fix(f"--compile-cache {choice} and --no-compile-cache were both given.",
                              f"keep --compile-cache {choice} to use that directory, or --no-compile-cache to "
                              "compile afresh."))
    return False if off else choice


def _setup_compile_cache(args: argparse.Namespace) -> None:
    choice = _compile_cache_choice(args)
    asked = choice is not None
    if choice is None:
        choice = cache_dir_from_env()
        asked = choice is not None
    if choice is False or (not asked and args.command not in _CACHED_COMMANDS):
        return
    try:
        enable_compile_cache(choice) if asked else enable_default_cache()
    except SpmdkitError as e:
        if asked:
            raise
        # The default directory is a convenience: without it, everything still runs.
        stderr_console().print(f"warning: running without the compile cache: {e}", markup=False)


def _host_devices(args: argparse.Namespace) -> int | None:
    """The simulated device count asked for: a flag, the --config file, plan's --devices, the environment."""
    n = getattr(args, "host_devices", None)
    if n is None and getattr(args, "config", None):
        from spmdkit._config import load_toml

        n = load_toml(args.config).get("host_devices")
        if n is not None:
            check_host_device_count(n, f"host-devices = {n} in --config {args.config}")
    # plan's --devices counts every process's devices: under spmdkit launch each simulates its share.
    under_launch = bool(os.environ.get("SPMDKIT_COORDINATOR")) and host_devices_from_env() is not None
    if n is None and not under_launch and getattr(args, "devices", None):
        n = args.devices
        check_host_device_count(n, f"--devices {n}")
    return n or host_devices_from_env() or _DEFAULT_DEVICES.get(args.command)


def _setup_devices(args: argparse.Namespace) -> None:
    if args.command == "launch":
        _refuse_launch_options(args)
    n = _host_devices(args)
    if args.command == "launch":
        return  # the launcher runs no JAX itself; its children set up their own devices
    if n is not None:
        use_host_devices(n)
    _setup_compile_cache(args)
    from spmdkit._launch import initialize_distributed

    initialize_distributed(
        getattr(args, "coordinator", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        getattr(args, "distributed_timeout", 100),
    )


def _cmd_devices(args: argparse.Namespace, console: Console) -> int:
    import jax

    rows, host = device_table(), host_memory()
    per_process = dict(sorted(Counter(r["process_index"] for r in rows).items()))
    n = len(rows)
    info = {
        "devices": rows,
        "device_count": n,
        "devices_per_process": per_process,
        "process_count": jax.process_count(),
        "suggested_mesh": suggest_mesh(n),
        "suggested_model_parallel_mesh": model_parallel_suggestion(n),
        "host_memory": dataclasses.asdict(host),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    table = Table(title=f"{n} device(s), {jax.process_count()} process(es)")
    for col in ("id", "platform", "kind", "process"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["id"]), r["platform"], r["kind"], str(r["process_index"]))
    console.print(table)
    console.print("devices per process: " + ", ".join(f"{k}: {v}" for k, v in per_process.items()))
    console.print(f"host memory: {host}", markup=False)
    fmt = lambda m: ", ".join(f"{k}={v}" for k, v in m.items())  # noqa: E731
    console.print(
        f"suggested mesh: spmdkit.make_mesh({fmt(info['suggested_mesh'])})  (data parallel)"
    )
    if info["suggested_model_parallel_mesh"]:
        console.print(
            f"  with model parallelism: "
            f"spmdkit.make_mesh({fmt(info['suggested_model_parallel_mesh'])})"
        )
    return 0


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._demo import run_demo

    # A demo whose results are off is a check that did not pass, not a crash (exit 1).
    return 0 if run_demo(console, out=args.out, steps=args.steps)["ok"] else EXIT_CHECK_FAILED


def _run_suite(name: str, args: argparse.Namespace) -> dict:
    import inspect

    from spmdkit._bench import SUITES

    fn = SUITES[name]
    options = {"quick": args.quick, "rounds": args.rounds, "levers": args.levers, "torch_python": args.torch_python}
    accepted = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in options.items() if k in accepted and (k == "quick" or v is not None)})


def _read_bench_report(path: str) -> tuple[dict, str | None]:
    """A SUITE.json of ``spmdkit bench --json``, or what is wrong with the file: unreadable, not
    JSON (cut short, damaged), or JSON of another kind (no suite name, targets without values)."""
    try:
        with open(path, "rb") as fh:
            report = json.loads(fh.read())
    except OSError as e:
        return {}, f"cannot read it ({e.strerror or e})"
    except json.JSONDecodeError as e:
        return {}, f"not JSON, damaged or cut short ({e.msg}: line {e.lineno} column {e.colno})"
    except ValueError as e:  # not UTF-8 text
        return {}, f"not JSON ({e})"
    if not isinstance(report, dict) or not isinstance(report.get("suite"), str):
        kind = "an object" if isinstance(report, dict) else f"a JSON {type(report).__name__}"
        return {}, f"not a spmdkit bench report ({kind} without a \"suite\" name)"
    targets, rows = report.get("targets", []), report.get("rows", [])
    numbers = (int, float)
    if not isinstance(targets, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("value"), numbers)
            and not isinstance(t.get("value"), bool) for t in targets):
        return {}, "not a spmdkit bench report (its \"targets\" are not a list of {\"name\", \"value\"})"
    if not isinstance(rows, list) or not all(isinstance(r, (dict, list)) for r in rows):
        return {}, "not a spmdkit bench report (its \"rows\" are not a list of rows)"
    return report, None


def _compare_bench(dirs: list[str], console: Console) -> int:
    """Exit 0 when two runs agree on every comparable target they share, 6 when one differs, 2 on bad input."""
    import glob
    import os

    from spmdkit._bench.report import AGREEMENT, compare

    runs = []
    for d in dirs:
        files = sorted(glob.glob(os.path.join(glob.escape(d), "*.json")))
        if not files:
            stderr_console().print(f"[red]error:[/] no SUITE.json files in {escape(repr(d))}: write them with "
                                   f"spmdkit bench --all --json {escape(shlex.quote(d))}")
            return 2
        run = {}
        for f in files:
            report, problem = _read_bench_report(f)
            if problem:
                # One line, not a traceback from deep in the comparison: which file, and what is wrong with it.
                # On stderr, as every other error: a script reading the table from stdout does not get it.
                stderr_console().print(Text("error: ", style="red") + Text(
                    f"--compare: {f}: {problem}; write it again with spmdkit bench --all --json {shlex.quote(d)}"))
                return 2
            run[os.path.basename(f)[:-5]] = report
        runs.append(run)
    rows = compare(*runs)
    table = Table(title=f"targets of {dirs[0]} vs {dirs[1]} (agree: within {AGREEMENT:.0%})")
    for col in ("suite", "target", "first", "second", "diff", "agree"):
        table.add_column(col, justify="left" if col in ("suite", "target") else "right")
    for r in rows:
        table.add_row(r["suite"], Text(r["target"]), f"{r['first']:.3f}", f"{r['second']:.3f}", f"{r['diff']:.1%}",
                      {True: "yes", False: "[red]NO[/]", None: "n/a"}[r["agree"]])
    console.print(table)
    for r in rows:
        if r["note"]:
            console.print(f"{r['suite']}: {r['target']}: {r['note']}", highlight=False, markup=False)
    judged = [r for r in rows if r["agree"] is not None]
    return 0 if judged and all(r["agree"] for r in judged) else EXIT_CHECK_FAILED


class BenchFileError(SpmdkitError, OSError):
    """``bench --json``/``--markdown`` cannot be written: a file where a directory belongs, a
    missing directory (exit code 2, bad input), no permission, a full disk (5, an I/O failure)."""

    exit_code = 5  # the CLI's code for an I/O failure (README, exit codes)


# A path that cannot be one (a file where a directory belongs, a directory missing): bad input.
_WRONG_PATH = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.ENOENT)


def _bench_outputs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """``(flag, path, extension)`` of each report file asked for (with --all: a directory)."""
    asked = (("--json", args.json, "json"), ("--markdown", args.markdown, "md"))
    return [(flag, path, ext) for flag, path, ext in asked if path]


def _bench_file_error(flag: str, given: str, what: str, e: OSError, is_dir: bool) -> BenchFileError:
    if is_dir:
        remedy = f"pass a directory you can write to (made if missing), e.g. {flag} bench-out"
    else:
        remedy = f"pass a file in a directory you can write to, e.g. {flag} bench.{'json' if flag == '--json' else 'md'}"
    # One line, as the bench's other errors: the OS's reason is the diagnosis.
    error = BenchFileError(f"{flag} {shlex.quote(given)}: cannot {what}: {e.strerror or e}. Fix: {remedy}")
    if e.errno in _WRONG_PATH:
        error.exit_code = 2
    return error


def _check_bench_outputs(args: argparse.Namespace) -> None:
    """Make each --all directory and write a probe where each report goes, before any suite runs:
    a bad path used to be found only after minutes of benchmarking, and their figures were lost."""
    import tempfile

    for flag, path, _ in _bench_outputs(args):
        what = "make it a directory" if args.all else "write it"
        try:
            if args.all:
                os.makedirs(path, exist_ok=True)
                what = "write in it"
            elif os.path.isdir(path):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            fd, probe = tempfile.mkstemp(dir=path if args.all else os.path.dirname(os.path.abspath(path)),
                                         prefix=".spmdkit-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise _bench_file_error(flag, path, what, e, args.all) from None


def _write_bench_outputs(name: str, report: dict, args: argparse.Namespace, console: Console) -> None:
    from spmdkit._atomic import replace_text
    from spmdkit._bench.report import to_markdown

    render = {"json": lambda r: json.dumps(r, indent=2), "md": to_markdown}
    for flag, given, ext in _bench_outputs(args):
        path = os.path.join(given, f"{name}.{ext}") if args.all else given
        try:
            # Whole or not at all: a full disk or Ctrl-C mid-write leaves the previous report.
            replace_text(path, render[ext](report))
        except OSError as e:
            raise _bench_file_error(flag, given, f"write {path}" if args.all else "write it", e, args.all) from None
        console.print(f"wrote {path}")


def _check_bench_options(args: argparse.Namespace, console: Console) -> bool:
    """Whether --levers and --torch-python fit the suite (else says why)."""
    if args.levers and args.suite not in (None, "multiprocess"):
        console.print("[red]error:[/] --levers is an option of --suite multiprocess (or --all)")
        return False
    if args.levers:
        from spmdkit._bench.multiprocess_suite import check_levers

        try:
            check_levers(args.levers)
        except ValueError as e:
            console.print(f"[red]error:[/] {e}")
            return False
    from spmdkit._bench._torch import TORCH_PYTHON_ENV

    # The variable too: a bad one was a traceback after the suites before it had run.
    named = args.torch_python or (os.environ.get(TORCH_PYTHON_ENV) if args.suite in (None, "multiprocess") else None)
    if named:
        from spmdkit._bench.multiprocess_suite import torch_interpreter

        if args.suite not in (None, "multiprocess"):
            console.print("[red]error:[/] --torch-python is an option of --suite multiprocess (or --all)")
            return False
        try:
            torch_interpreter(args.torch_python)
        except ValueError as e:
            console.print(f"[red]error:[/] {e}")
            return False
    return True


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._bench import SUITES
    from spmdkit._bench.report import print_report

    if args.compare:
        return _compare_bench(args.compare, console)
    if not _check_bench_options(args, console):
        return 2
    _check_bench_outputs(args)
    names = sorted(SUITES) if args.all else [args.suite]
    failed = []
    for name in names:
        try:
            report = _run_suite(name, args)
        except Exception as exc:  # one broken suite must not lose the figures of the others
            if not args.all:
                raise
            console.print(f"[red]suite {name} failed:[/] {type(exc).__name__}: {exc}")
            failed.append(name)
            continue
        print_report(report, console)
        _write_bench_outputs(name, report, args, console)
    if failed:
        console.print(f"[red]failed suites: {', '.join(failed)}[/]")
    return 1 if failed else 0


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._train_cli import train_from_args

    return train_from_args(args, console)


def _cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._config import OptimizerConfig, check_task_flags
    from spmdkit._inspect import array_layout, layout_report, print_array_layout, print_report
    from spmdkit._strategies import get_strategy
    from spmdkit._tasks import get_task, task_defaults

    options = {k: getattr(args, k, None) for k in ("layers", "depth", "embed", "scan", "d_model", "heads",
                                                  "seq_len", "precision", "remat", "scan_unroll", "text_dir",
                                                  "text_bytes")}
    # As train and plan do: another task's option named by its flag, not by get_task's keyword.
    check_task_flags(args.task, [k for k, v in options.items() if v is not None], list(options))
    task = get_task(args.task, data_dir=args.data_dir, **options)
    strategy = get_strategy("sharded", mesh=args.mesh, rules=args.rules, replicate_unknown=args.replicate_unknown)
    defaults = task_defaults(args.task)
    optimizer = OptimizerConfig(name=args.optimizer or defaults.get("optimizer", "sgd"), lr=defaults.get("lr", 0.01)).build()
    report = layout_report(task, strategy, optimizer, args.batch_size or defaults.get("batch_size", 32), args.grad_accum)
    shown = array_layout(strategy, args.show) if args.show else None
    if args.json:
        print(json.dumps({**report, **({"show": shown} if shown else {})}, indent=2))
        return 0
    print_report(report, console)
    if shown:
        print_array_layout(shown, console)
    return 0


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._plan_cli import cmd_plan

    return cmd_plan(args, console)


def _cmd_checkpoints(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._checkpoint import describe_directory

    rows = describe_directory(args.directory, verify=args.verify)
    # An incomplete step (its save cut short before the manifest) is one a restore refuses too; an
    # interrupted save's temporary directory is no step at all (nothing restores it).
    damaged = args.verify and any(r["status"].startswith(("damaged", "incomplete")) and not r.get("temporary")
                                  for r in rows)  # a step being saved now ("being saved") is neither
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_CHECK_FAILED if damaged else 0
    table = Table(title=f"checkpoints in {args.directory}")
    for col in ("step", "size", "status", "task", "strategy", "mesh", "written", "config"):
        table.add_column(col)
    # The options that shape the run; paths and switches are left to --json.
    shown = ("task", "strategy", "steps", "epochs", "batch_size", "optimizer", "lr", "members", "rules", "seed")
    for r in rows:
        config = r.get("config") or {}
        table.add_row(
            str(r["step"]), f"{r['bytes'] / 2**20:.2f} MiB", r["status"],
            # A step of a user's own loop records none of these: blank, not "None".
            *("" if r.get(k) is None else str(r[k]) for k in ("task", "strategy", "mesh")),
            "" if r.get("written") is None else str(r["written"])[:19],
            " ".join(f"{k}={config[k]}" for k in shown if k in config and k not in ("task", "strategy")),
        )
    console.print(table)
    if not rows:
        console.print("no checkpoints")
    return EXIT_CHECK_FAILED if damaged else 0


def _cmd_sample(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._sample import sample

    # The model's vocabulary is bytes: the prompt goes in as the bytes typed (os.fsencode keeps any
    # that are not UTF-8) and the output comes out as the bytes generated. Decoding with
    # errors="replace" printed U+FFFD for every byte that was not UTF-8, so piped output was not the
    # sample; a prompt of such bytes was a UnicodeEncodeError traceback.
    # Each byte is written as it comes: a long sample shows as it grows, and a Ctrl-C (exit 130) keeps
    # what came before it (printed at the end, it was all lost). The prompt goes first, once the model
    # has loaded, so an error about the checkpoint prints nothing on stdout.
    prompt = os.fsencode(args.prompt)
    out = sys.stdout.buffer
    pending = [prompt]

    def write(generated: bytes) -> None:
        out.write(b"".join(pending) + generated)
        pending.clear()
        out.flush()
        if _CTRL_C.seen:  # a Ctrl-C that JAX's garbage collection swallowed
            raise KeyboardInterrupt

    sys.stdout.flush()
    try:
        sample(args.checkpoint_dir, prompt, args.length, args.temperature, args.seed, args.step, stream=write)
    except KeyboardInterrupt:
        if not pending:  # what was printed ends its line: the shell's prompt starts a line of its own
            out.write(b"\n")
            out.flush()
        raise
    write(b"\n")
    return 0


def _cmd_launch(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._launch import launch

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return launch(cmd, args.processes, args.host_devices_per_process, max_restarts=args.max_restarts)


def _cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._calibrate_cli import run_calibrate

    return run_calibrate(args, console)


def _cmd_data(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._data import load_dataset, write_dataset

    from spmdkit._data._splits import check_splits_match, data_splits, is_split_dir, write_splits

    if args.verb == "check":
        import jax

        splits = data_splits(args.directory) if is_split_dir(args.directory) else (args.directory,)
        sets = [load_dataset(d, verify=args.verify) for d in splits]
        for d, data in zip(splits, sets):
            for path, x in jax.tree_util.tree_flatten_with_path(data)[0]:
                where = f"{d}: " if len(splits) == 2 else ""
                console.print(f"{where}{jax.tree_util.keystr(path)}: shape {x.shape} dtype {x.dtype}", highlight=False)
        if len(sets) == 2:
            check_splits_match(*sets, str(splits[0]), str(splits[1]),
                               f"write both splits again: spmdkit data write {args.directory} --task NAME --overwrite.")
        # Without --verify only sizes, shapes and dtypes are read: "intact" said so of a file with a
        # flipped byte, which --verify (and train --data) then refused.
        console.print(f"{args.directory}: intact (CRC-32 verified)" if args.verify else
                      f"{args.directory}: sizes, shapes and dtypes as the manifest says; contents not checked "
                      "(--verify reads every file and checks its CRC-32)", highlight=False)
        return 0
    seq = f" --seq-len {args.seq_len}" if args.seq_len else ""  # the model must read windows of that length
    if args.npz:
        from spmdkit._errors import NPZ_DAMAGE, DataError, fix, open_npz

        try:
            with open_npz(args.npz) as f:
                arrays = {k: f[k] for k in f.files}
        except NPZ_DAMAGE as e:
            raise DataError(fix(f"--npz {args.npz}: the file is damaged (truncated or corrupt: {e}).",
                                "write it again with numpy.savez(path, name=array, ...), or pass an intact copy.")) from None
        except (OSError, ValueError) as e:
            raise DataError(fix(f"--npz {args.npz}: cannot be read as an .npz of arrays ({e}).",
                                "pass a file written by numpy.savez(path, name=array, ...).")) from None
    else:
        from spmdkit._tasks import get_task

        lm_options = {k: getattr(args, k) for k in ("text_dir", "seq_len", "text_bytes")}
        task = get_task(args.task, data_dir=args.data_dir, **lm_options)  # another task refuses them by name
        if args.split is None and task.eval_data is not None:
            out = write_splits(args.out, task.train_data, task.eval_data, overwrite=args.overwrite)
            console.print(f"wrote {out / 'train'} ({task.num_train} examples) and {out / 'eval'} ({task.num_eval}): "
                          f"train and evaluate with spmdkit train --task {args.task} --data {shlex.quote(str(out))}{seq}",
                          highlight=False)
            return 0
        arrays = task.eval_data if args.split == "eval" else task.train_data
    out = write_dataset(args.out, arrays, overwrite=args.overwrite)
    # quoted: the command is printed to be pasted, and a path with a space (or quote) split in two
    console.print(f"wrote {out}: train with spmdkit train --task {args.task or 'NAME'} --data {shlex.quote(str(out))}{seq}",
                  highlight=False)
    return 0


_COMMANDS = {
    "data": _cmd_data,
    "launch": _cmd_launch,
    "calibrate": _cmd_calibrate,
    "checkpoints": _cmd_checkpoints,
    "inspect": _cmd_inspect,
    "plan": _cmd_plan,
    "devices": _cmd_devices,
    "demo": _cmd_demo,
    "bench": _cmd_bench,
    "train": _cmd_train,
    "sample": _cmd_sample,
}


class _CtrlC:
    """While a command runs, SIGINT raises KeyboardInterrupt as Python's own handler does, and is
    noted. A KeyboardInterrupt raised inside a garbage-collection callback (JAX has one) is printed
    as "Exception ignored" and lost: `spmdkit sample` then ran to its end and exited 0. A command
    polls ``seen`` at its safe points; ``main`` ends with 130 when it was seen and the command
    returned 0. An ignored SIGINT (`cmd &` in a script) stays ignored."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self) -> _CtrlC:
        self.seen = False
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


_CTRL_C = _CtrlC()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``spmdkit`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "plan":  # plan --processes P --measure K starts itself again in P processes
        args.raw_argv = list(sys.argv[1:] if argv is None else argv)
    # Tables are for reading in logs too: do not fold them to 80 columns off a terminal.
    console = StdoutConsole(width=None if sys.stdout.isatty() else 120)
    try:
        with _CTRL_C:
            # Before any JAX work: XLA's threads take their malloc arenas when its backends start.
            _reuse_host_memory(strict=False)
            _setup_devices(args)
            with short_warnings():
                code = _COMMANDS[args.command](args, console)
        # A command that handled the Ctrl-C itself (plan --measure prints the rounds so far) returns
        # its own code; one that ended as if nothing happened had the interrupt swallowed.
        return _exit_on_signal(_interrupted() if _CTRL_C.seen and code == 0 else code, argv is None)
    except SpmdkitError as e:
        stderr_console().print(Text("error: ", style="bold red") + Text(str(e)))
        code = getattr(e, "exit_code", 2)  # 2: bad input; I/O failures carry their own (see README)
        end_soon(code)  # in a group, peers may wait for this process in a collective
        return _exit_on_signal(code, argv is None)
    except KeyboardInterrupt:
        # Ctrl-C is the user's own act, not a bug: one line, not a traceback, and the shell's code.
        return _interrupted()
    except BrokenPipeError:
        if not _reader_left():  # another pipe (a worker process's): a bug to see
            raise
        # In a process group, JAX's exit would otherwise wait for peers still waiting for this one.
        return end_soon(EXIT_BROKEN_PIPE, "the reader of its output left")
    except (RuntimeError, AssertionError) as e:  # after SpmdkitError: some of ours are RuntimeErrors
        err = backend_failure(e)  # JAX_PLATFORMS names a platform this machine lacks
        if err is None:
            raise
        stderr_console().print(Text("error: ", style="bold red") + Text(str(err)))
        return 2


def _exit_on_signal(code: int, program: bool) -> int:
    """The command is over and its exit code known; what is left is the interpreter's exit (JAX's
    clean-up, about a second after a training run). A SIGINT or SIGTERM there (a Ctrl-C or a
    preemption notice just too late) raised a KeyboardInterrupt traceback from JAX's exit handler,
    or ended the process as killed (130 or 143) after a run whose files said it completed. A lone
    process now ignores both from here (Python's own handlers are reset to the default when the
    interpreter finalizes, so only an ignored signal keeps the code); a process of a group keeps the
    default, since its exit may wait for a peer that never comes. Only as the program itself
    (``program``: ``main()`` of the console script or ``python -m spmdkit``, which read sys.argv):
    a Python caller of ``main([...])`` (a test, a notebook) goes on after it, and its later
    children inherited SIGINT ignored, so that a Ctrl-C no longer reached them."""
    from spmdkit._process import _JOINED

    if program and not _JOINED and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL):
                signal.signal(sig, signal.SIG_IGN)
    return code


def _reader_left() -> bool:
    """Whether stdout is a pipe whose reader has gone (`spmdkit sample --length 100000 | head -c 100`,
    `spmdkit checkpoints DIR --json | head`): then stdout is pointed at /dev/null, so the flush at exit
    raises no second BrokenPipeError. That was a traceback and exit 1, 'a bug: please report'."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
        if gone:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return gone
    except (OSError, ValueError, AttributeError):  # stdout closed or replaced by an object with no file
        return False


def _interrupted() -> int:
    """Ctrl-C: one line on stderr and exit code 130 (the shell's for SIGINT), through end_soon: in a
    process group, JAX's exit would otherwise wait for peers still waiting for this one."""
    try:
        sys.stderr.write("spmdkit: interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr gone (a closed pipe): the exit code still says it
        pass
    return end_soon(130, "Ctrl-C")


if __name__ == "__main__":
    sys.exit(main())
