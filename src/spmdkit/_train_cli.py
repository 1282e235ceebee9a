"""``spmdkit train``: resolve options (task defaults < config file < flags), run, report."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.table import Table

from spmdkit._config import build_run_config, check_keys, load_toml, strategy_options, task_options
from spmdkit._errors import NonFiniteLossError
from spmdkit._launch import ENV_RESUME
from spmdkit._strategies import get_strategy
from spmdkit._tasks import get_task, task_defaults
from spmdkit._train import fit

EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130


def resolve_options(flags: dict[str, Any]) -> dict[str, Any]:
    """Flat options: the task's defaults, overridden by the config file, then by flags."""
    flags = dict(flags)
    path = flags.pop("config", None)
    from_file = load_toml(path) if path else {}
    given = {**from_file, **check_keys(flags, "flags")}
    task_name = given.get("task", "linreg")
    defaults = dict(task_defaults(task_name))
    # A task's default length must not clash with a user-given --epochs.
    if "epochs" in given:
        defaults.pop("steps", None)
    return {**defaults, **given}


def train_from_args(args: argparse.Namespace, console: Console) -> int:
    # Flags of the process, not of the run: a resume on another machine may differ in them.
    process_flags = ("coordinator", "num_processes", "process_id", "distributed_timeout", "compile_cache")
    flags = {k: v for k, v in vars(args).items() if k not in ("command", *process_flags)}
    options = resolve_options(flags)
    if os.environ.get(ENV_RESUME) == "1" and options.get("checkpoint_dir"):
        # Restarted by spmdkit launch --max-restarts: continue the run, never start it over.
        options["resume"], options["overwrite_checkpoints"] = True, False
    run = build_run_config(options)
    task = get_task(run.task, data_dir=run.data_dir, **task_options(run))
    if run.data is not None:  # the task's model and eval set, trained on the data set in run.data
        task = dataclasses.replace(task, train_data=run.data)
    strategy = get_strategy(run.strategy, run.impl, **strategy_options(run))
    info = strategy.describe()
    console.print(
        f"training [bold]{run.task}[/] with [bold]{info['strategy']}[/] ({info['impl']}) on "
        f"{info['device_count']} device(s), mesh {info['mesh']}; output in {run.out}"
    )
    try:
        result = fit(
            task,
            strategy,
            run.optimizer.build(),
            run.train,
            out_dir=run.out,
            progress=run.progress,
            run_info=_jsonable_options(options),
            checkpoint=run.checkpoint,
            step_timeout=getattr(args, "distributed_timeout", 100),
            log=lambda message: console.print(message, highlight=False, markup=False),
        )
    except NonFiniteLossError as e:
        Console(stderr=True).print(f"[bold red]error:[/] {e}", markup=True, highlight=False)
        return EXIT_DIVERGED
    if jax.process_index() == 0:
        _print_summary(result.summary, Path(run.out), console)
    return EXIT_INTERRUPTED if result.summary["status"] == "interrupted" else 0


def _jsonable_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if isinstance(v, (str, int, float, bool)) or v is None}


def _print_summary(summary: dict[str, Any], out: Path, console: Console) -> None:
    table = Table(title=f"{summary['task']}: {summary['status']} after {summary['steps']} steps")
    table.add_column("")
    table.add_column("value", justify="right")
    keys = ["final_train_loss", "eval_loss", "eval_bits_per_byte", "eval_accuracy", "mean_member_accuracy", "ensemble_accuracy",
            "w", "b", "epochs", "examples_seen", "wall_time_s", "steps_per_sec", "params_digest"]
    for k in keys:
        if summary.get(k) is not None:
            v = summary[k]
            table.add_row(k, f"{v:.6g}" if isinstance(v, float) else str(v))
    console.print(table)
    console.print(
        f"wrote {out / 'metrics.jsonl'}, {out / 'summary.json'}, {out / 'params.npz'}, {out / 'loss.png'}"
    )
