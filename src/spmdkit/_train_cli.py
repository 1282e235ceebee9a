"""``spmdkit train``: resolve options (task defaults < config file < flags), run, report."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from spmdkit._config import (
    DATA_OPTIONS,
    OptimizerConfig,
    RunConfig,
    build_run_config,
    check_keys,
    load_toml,
    strategy_options,
    task_options,
    unused_optimizer_options,
)
from spmdkit._console import stderr_console
from spmdkit._data import is_pipeline, load_dataset
from spmdkit._data._errors import DatasetLayoutError
from spmdkit._data._splits import check_splits_match, data_splits, eval_split
from spmdkit._errors import ConfigError, DataError, NonFiniteLossError, fix
from spmdkit._launch import ENV_RESUME
from spmdkit._strategies import get_strategy
from spmdkit._tasks import TASKS, Task, get_task, lm, task_defaults
from spmdkit._train import fit

EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130


def resolve_options(flags: dict[str, Any]) -> dict[str, Any]:
    """Flat options: the task's defaults, overridden by the config file, then by flags."""
    flags = dict(flags)
    path = flags.pop("config", None)
    from_file = load_toml(path) if path else {}
    flags = check_keys(flags, "flags")
    # The run's length is one choice written either way: --epochs overrides a file's steps (and
    # --steps its epochs), as any flag overrides the file, where both together were refused.
    for flag, other in (("epochs", "steps"), ("steps", "epochs")):
        if flags.get(flag) is not None and flags.get(other) is None:
            from_file.pop(other, None)
    given = {**from_file, **flags}
    task_name = given.get("task", "linreg")
    defaults = dict(task_defaults(task_name))
    # A task's default length must not clash with a user-given --epochs.
    if "epochs" in given:
        defaults.pop("steps", None)
    # digits' default momentum is its SGD's: with --optimizer adam it is not asked for, so not refused.
    optimizer = given.get("optimizer", defaults.get("optimizer", OptimizerConfig.name))
    for key in unused_optimizer_options(optimizer, defaults):
        defaults.pop(key)
    return {**defaults, **given}


def train_from_args(args: argparse.Namespace, console: Console) -> int:
    # Flags of the process, not of the run: a resume on another machine may differ in them.
    process_flags = ("coordinator", "num_processes", "process_id", "distributed_timeout", "compile_cache",
                     "no_compile_cache")
    flags = {k: v for k, v in vars(args).items() if k not in ("command", *process_flags)}
    options = resolve_options(flags)
    if os.environ.get(ENV_RESUME) == "1" and options.get("checkpoint_dir"):
        # Restarted by spmdkit launch --max-restarts: continue the run, never start it over.
        options["resume"], options["overwrite_checkpoints"] = True, False
    run = build_run_config(options)
    task = build_task(run)
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
        stderr_console().print(f"[bold red]error:[/] {e}", markup=True, highlight=False)
        return EXIT_DIVERGED
    if jax.process_index() == 0:
        _print_summary(result.summary, Path(run.out), console)
    return EXIT_INTERRUPTED if result.summary["status"] == "interrupted" else 0


def build_task(run: RunConfig) -> Task:
    """The task to train: its own data, or ``--data DIR`` (with its held-out split
    ``DIR/eval``, or ``--eval-data DIR2``, or else the task's own eval set)."""
    _check_outputs_outside_text(run)
    task = _build_task(run)
    classes = getattr(TASKS[run.task], "NUM_CLASSES", None)
    if classes is not None and (run.data is not None or run.eval_data is not None):
        for name, data in (("--data", task.train_data), ("--eval-data" if run.eval_data else "--data", task.eval_data)):
            _check_labels(data, classes, name, run)
    return task


def _check_outputs_outside_text(run: RunConfig) -> None:
    """lm reads every non-hidden file under --text-dir: a run's --out or --checkpoint-dir inside it
    (`--text-dir .` with the default --out runs/latest) made the previous run's metrics, parameters
    and checkpoints training text without a word, and the corpus changed from run to run."""
    if run.task != "lm" or run.text_dir is None:
        return
    folders = lm.text_folders(run.text_dir)
    for flag, path in (("--out", run.out), ("--checkpoint-dir", run.checkpoint.directory if run.checkpoint else None)):
        if path is None:
            continue
        where = Path(path).resolve()
        there = where  # the deepest part that exists: the rest is created by this run
        while not there.exists() and there != there.parent:
            there = there.parent
        if str(there) not in folders or any(part.startswith(".") for part in where.relative_to(there).parts):
            continue  # not a folder the corpus enters, or hidden below one (the corpus skips it)
        raise ConfigError(fix(f"{flag} {path} is inside --text-dir {run.text_dir}: lm reads every non-hidden file "
                              "there, so this run's files (metrics, parameters, checkpoints) would become training "
                              "text, different at every run.",
                              f"pass a {flag} outside --text-dir (or one whose name starts with '.', which the corpus "
                              "skips), or a --text-dir that holds only the text."))


def _check_labels(data: Any, classes: int, flag: str, run: RunConfig) -> None:
    """A classifier's labels are class ids its model has outputs for: labels 0..49 for the 10-class
    CNN made the loss NaN at step 1, reported as a diverged run ("lower the learning rate")."""
    if not isinstance(data, dict) or "label" not in data:
        return
    label = np.asarray(data["label"])  # one int per example: read whole even from a large data set
    if label.size and (label.dtype.kind not in "iu" or label.min() < 0 or label.max() >= classes):
        held = f"dtype {label.dtype}, values {label.min()} to {label.max()}"
        raise DataError(fix(f"{flag} {getattr(run, flag[2:].replace('-', '_'))}: leaf ['label'] holds {held}; --task "
                            f"{run.task} classifies into {classes} classes, ids 0 to {classes - 1} of an integer dtype.",
                            f"write the labels as integers 0 to {classes - 1} (e.g. np.unique(y, return_inverse=True)[1])."))


def _build_task(run: RunConfig) -> Task:
    options = task_options(run)
    if run.data is None and run.eval_data is None:
        return get_task(run.task, data_dir=run.data_dir, **options)
    if run.data is None:
        task = get_task(run.task, data_dir=run.data_dir, **options)
        held_out = load_dataset(eval_split(run.eval_data), verify=run.verify_data)
        _check_eval(task.train_data, held_out, f"--task {run.task}'s training set", f"--eval-data {run.eval_data}", run)
        return dataclasses.replace(task, eval_data=held_out)
    train_dir, eval_dir = data_splits(run.data, run.eval_data, run.task)
    if eval_dir is not None:
        _check_no_text_options(run, train_dir, eval_dir)
    train = load_dataset(train_dir, verify=run.verify_data)
    module = TASKS[run.task]
    if eval_dir is not None:
        held_out = load_dataset(eval_dir, verify=run.verify_data)
        _check_eval(train, held_out, f"the training split {train_dir}",
                    f"--eval-data {eval_dir}" if run.eval_data else f"the eval split {eval_dir}", run)
        if hasattr(module, "from_data") and not options:  # the model alone: the task's own files are not read
            return module.from_data(train, held_out)
        task = get_task(run.task, data_dir=run.data_dir, **options)
        _check_task_reads(task, train, train_dir, run)
        return dataclasses.replace(task, train_data=train, eval_data=held_out)
    if getattr(module, "NEEDS_DATA_DIR", False) and run.data_dir is None:
        raise DataError(fix(
            f"--data {run.data} is a single data set (no eval split), and --task {run.task}'s own eval set needs "
            "--data-dir.",
            f"write the data set with its held-out split: spmdkit data write {run.data} --task {run.task} "
            f"--data-dir RAW --overwrite (DIR/train and DIR/eval); or pass --eval-data DIR2, or --data-dir RAW."))
    task = get_task(run.task, data_dir=run.data_dir, **options)
    _check_task_reads(task, train, train_dir, run)
    if task.eval_data is not None and not is_pipeline(task.eval_data):
        _check_eval(train, task.eval_data, f"the training set {train_dir}", f"--task {run.task}'s own eval set", run)
    return dataclasses.replace(task, train_data=train)


def _check_no_text_options(run: RunConfig, train_dir: Any, eval_dir: Any) -> None:
    """--text-dir and --text-bytes choose lm's own text; with a data set for training and
    for eval they chose nothing, yet the run's summary recorded them as its corpus."""
    given = [f"--{k.replace('_', '-')} {v}" for k, v in (("text_dir", run.text_dir), ("text_bytes", run.text_bytes))
             if v is not None]
    if given:
        raise ConfigError(fix(f"{' and '.join(given)} would not be used: the examples come from --data {run.data} "
                              f"({train_dir} for training, {eval_dir} for eval), not from lm's own text.",
                              f"drop {' and '.join(g.split()[0] for g in given)} (the text went into the data set "
                              "when it was written: spmdkit data write DIR --task lm --text-dir ...), or drop --data."))


def _check_task_reads(task: Task, train: Any, train_dir: Any, run: RunConfig) -> None:
    """The data set holds the leaves the task's own training data hold (its model reads them
    by name); otherwise its loss would fail at the first batch with a bare KeyError."""
    if task.train_data is None or is_pipeline(task.train_data):
        return

    def keys(tree: Any) -> list[str]:
        return sorted(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])

    want, got = keys(task.train_data), keys(train)
    if want != got:
        named = ", ".join(k.strip("[]'") for k in want)
        raise DatasetLayoutError(fix(
            f"--data {train_dir} holds leaves {', '.join(got)}; --task {run.task} reads {', '.join(want)}.",
            f"write the data set with the task's leaves (spmdkit data write DIR --task {run.task}, or --npz with "
            f"arrays named {named}), or train the task this data set was written for (--task)."))
    _check_example_shapes(task.train_data, train, train_dir, run)


def _check_example_shapes(own: Any, train: Any, train_dir: Any, run: RunConfig) -> None:
    """The data set's examples have the shapes the task, with this run's options, builds its model
    for: --task lm --seq-len 16 on windows of 65 bytes failed in loss_fn with "incompatible shapes
    for broadcasting (4, 64, 16), (1, 16, 16)", blamed on the loss."""
    flat_own = dict((jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(own)[0])
    for path, x in jax.tree_util.tree_flatten_with_path(train)[0]:
        key = jax.tree_util.keystr(path)
        want, got = tuple(np.shape(flat_own[key])[1:]), tuple(np.shape(x)[1:])
        if want != got:
            given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in task_options(run).items()) or "its defaults"
            options = "pass the model options the data set was written for, or " if task_options(run) else ""
            if run.task == "lm" and key == "['tokens']" and len(got) == 1 and got[0] > 1:
                # its windows are seq_len + 1 bytes: the flag's value is read off the shape
                options = f"pass --seq-len {got[0] - 1} (the data set's windows are seq_len + 1 bytes), or "
            raise DatasetLayoutError(fix(
                f"--data {train_dir}: each example of {key} has shape {got}; --task {run.task} with {given} reads "
                f"examples of shape {want}.", f"{options}write it again with examples of shape {want}."))


def _check_eval(train: Any, held_out: Any, train_name: str, eval_name: str, run: RunConfig) -> None:
    check_splits_match(train, held_out, train_name, eval_name,
                       f"write both splits from one source: spmdkit data write DIR --task {run.task} --overwrite, "
                       "then --data DIR; or pass --eval-data DIR2 holding the training set's leaves.")


def _jsonable_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options a checkpoint and summary.json record; data paths made absolute, so a resume
    from another working directory with the same relative --data is seen to read other data."""
    out = {k: v for k, v in options.items() if isinstance(v, (str, int, float, bool)) or v is None}
    for k in DATA_OPTIONS:
        if isinstance(out.get(k), str) and out[k]:
            out[k] = os.path.abspath(out[k])
    return out


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
    # The files there, not "wrote": a resume of a complete run leaves them as they were.
    names = [n for n in ("metrics.jsonl", "summary.json", "params.npz", "loss.png", "ensemble.png") if (out / n).is_file()]
    console.print(f"{out}: {', '.join(names) or 'no files'}")
