"""The training loop: steps, eval, metrics, artifacts, stop rules.

It knows neither the task's insides nor the strategy's: it asks the strategy to
place state and batches and to compile the steps, and the task for data and loss.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from spmdkit._checkpoint import CheckpointConfig, Checkpointer, CheckpointSaveError
from spmdkit._config import TrainConfig
from spmdkit._errors import ConfigError, NonFiniteLossError, fix
from spmdkit._process import process_age_s
from spmdkit._strategies._base import Strategy, TrainState, padded_size
from spmdkit._tasks._base import Task, num_examples
from spmdkit._train import _artifacts as art
from spmdkit._train._guards import KnownGood, state_is_finite
from spmdkit._train._preempt import Preemption
from spmdkit._train._validate import validate_task
from spmdkit._train._watchdog import StepWatchdog


class FitResult(NamedTuple):
    """What :func:`fit` returns: the final state, host parameters, summary, history."""

    state: TrainState
    params: Any
    summary: dict[str, Any]
    history: list[dict[str, Any]]


def iterate_batches(
    data: Any, batch_size: int, seed: int, drop_remainder: bool, stream: int | None = None, start_step: int = 0
) -> Iterator[tuple[int, Any]]:
    """``(epoch, host batch)`` forever; the order depends only on ``seed``, epoch and ``stream``.

    ``stream`` numbers independent orders of the same data (bagged ensemble members);
    ``start_step`` skips that many batches (a resumed run continues where it stopped).
    """
    n = num_examples(data)
    stop = n - n % batch_size if drop_remainder else n
    per_epoch = len(range(0, stop, batch_size))
    epoch, skip = divmod(start_step, per_epoch)
    while True:
        entropy = [seed, epoch] if stream is None else [seed, epoch, stream]
        order = np.random.default_rng(entropy).permutation(n)
        for start in range(skip * batch_size, stop, batch_size):
            idx = order[start : start + batch_size]
            yield epoch, jax.tree.map(lambda x: x[idx], data)
        epoch, skip = epoch + 1, 0


def to_python(values: dict[str, Any]) -> dict[str, Any]:
    """Scalars to float, per-member arrays to lists: what JSON lines and plots take."""
    out = {}
    for k, v in jax.device_get(values).items():
        a = np.asarray(v, np.float64)
        out[k] = float(a) if a.ndim == 0 else a.tolist()
    return out


def evaluate(strategy: Strategy, eval_fn, params, data: Any, batch_size: int, rng: jax.Array) -> dict[str, Any]:
    """Exact means over a whole data set, in fixed-size (padded, masked) chunks."""
    n = num_examples(data)
    size = min(batch_size, n)
    totals: dict[str, np.ndarray] = {}
    for start in range(0, n, size):
        chunk = jax.tree.map(lambda x: x[start : start + size], data)
        batch, mask = strategy.put_batch(chunk, size=size, shared=True)
        for k, v in jax.device_get(eval_fn(params, batch, mask, rng)).items():
            totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)
    count = totals.pop("count")
    return to_python({k: v / count for k, v in totals.items()})


class _StopRequest:
    """First Ctrl-C: finish the current step, then stop. Second: stop at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _batches(data: Any, batch_size: int, config: TrainConfig, streams: int, start: int) -> Iterator[tuple[int, Any]]:
    """One stream of batches, or ``streams`` independent ones stacked on a leading axis."""
    if streams == 1:
        yield from iterate_batches(data, batch_size, config.seed, config.drop_remainder, start_step=start)
        return
    its = [
        iterate_batches(data, batch_size, config.seed, config.drop_remainder, stream=m, start_step=start)
        for m in range(streams)
    ]
    for parts in zip(*its):
        # Partial batches line up: every stream has the same epoch length.
        yield parts[0][0], jax.tree.map(lambda *xs: np.stack(xs), *(b for _, b in parts))


def _check_resumable(meta: dict[str, Any], config: TrainConfig, task: str) -> None:
    """A resumed run must see the same data order, or it is not the same run."""
    for name, now in (("task", task), ("seed", config.seed), ("batch_size", config.batch_size),
                      ("drop_remainder", config.drop_remainder)):
        then = meta.get(name)
        if then is not None and then != now:
            raise ConfigError(
                fix(
                    f"the checkpoint at step {meta.get('step')} was written with {name}={then!r}, this run has "
                    f"{name}={now!r}; resuming would not continue the same run.",
                    f"resume with {name}={then!r}, or start a new run in another --checkpoint-dir.",
                )
            )


def _previous_history(out: Path | None, upto: int) -> list[dict[str, Any]]:
    if out is None or not (out / "metrics.jsonl").exists():
        return []
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            break  # a line cut short by a crash
        if row.get("step", 0) <= upto:
            rows.append(row)
    return rows


def _task_report(task: Task, strategy: Strategy, params: Any) -> dict[str, Any]:
    if task.report is None:
        return {}
    reports = [task.report(p) for p in strategy.member_params(params)]
    return reports[0] if len(reports) == 1 else {"member_reports": reports}


def _progress(enabled: bool, total: int, title: str):
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(f"[bold]{title}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} steps/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    )


def fit(
    task: Task,
    strategy: Strategy,
    optimizer: optax.GradientTransformation,
    config: TrainConfig = TrainConfig(),
    *,
    out_dir: str | Path | None = None,
    progress: bool = True,
    run_info: dict[str, Any] | None = None,
    checkpoint: CheckpointConfig | None = None,
    log: Callable[[str], None] = print,
    step_timeout: float | None = 100.0,
) -> FitResult:
    """Train ``task`` with ``strategy`` and ``optimizer`` for ``config.steps`` (or epochs).

    The data order, initialisation and per-step randomness depend only on
    ``config.seed``, so the same config on 1 or 8 devices gives the same result.
    The loop waits for every step to finish before the next (XLA:CPU deadlocks
    when many collective steps are queued). With ``out_dir`` it writes
    ``metrics.jsonl`` (as it goes), ``summary.json``, ``params.npz`` and ``loss.png``.
    With ``checkpoint`` it saves every ``checkpoint.every`` steps (asynchronously) and
    at the end, and with ``checkpoint.resume`` continues from the newest intact step,
    exactly as if it had never stopped. Across several processes, a step that does not
    finish within ``step_timeout`` seconds (a dead or hung peer) ends every process with
    an error naming the processes that fell behind.

    Example:
        >>> import jax.numpy as jnp, numpy as np, optax, spmdkit
        >>> x = np.linspace(-1, 1, 64, dtype=np.float32)
        >>> task = spmdkit.Task(
        ...     name="line",
        ...     init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
        ...     loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
        ...     train_data={"x": x, "y": 3 * x + 1},
        ... )
        >>> result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.3),
        ...                      spmdkit.TrainConfig(steps=200, batch_size=16), progress=False)
        >>> round(float(result.params["w"]), 2), round(float(result.params["b"]), 2)
        (3.0, 1.0)
    """
    n_train = task.num_train
    bs = config.batch_size
    if bs > n_train:
        raise ConfigError(
            fix(
                f"batch_size={bs} is larger than the training set of task {task.name!r} "
                f"({n_train} examples).",
                f"use --batch-size {n_train} or less.",
            )
        )
    steps_per_epoch = n_train // bs if config.drop_remainder else math.ceil(n_train / bs)
    total = config.steps if config.steps is not None else config.epochs * steps_per_epoch
    eval_every = config.eval_every or steps_per_epoch
    out = None if out_dir is None else Path(out_dir)
    # With several processes (jax.distributed) every one trains; process 0 alone writes.
    primary = jax.process_index() == 0
    progress = progress and primary
    validate_task(task, config.batch_size)
    if out is not None and primary:
        art.prepare_out_dir(out)

    key = jax.random.key(config.seed)
    init_key, step_key, eval_key = jax.random.split(key, 3)
    ckpt = None if checkpoint is None else Checkpointer(checkpoint, log=log).claim()
    restored = None
    if ckpt is not None and checkpoint.resume:
        target = strategy.abstract_state(task.init, optimizer)
        restored = ckpt.restore_latest(target, members=strategy.describe().get("members"))
        if restored is None:
            log(f"checkpoints: nothing to resume in {ckpt.directory}; starting from step 0")
    if restored is not None:
        state, meta = restored
        _check_resumable(meta, config, task.name)
        done = int(meta["step"])
        log(f"checkpoints: resumed from step {done} in {ckpt.directory}")
    else:
        state = strategy.init_state(task.init, optimizer, init_key)
        done = 0
    step_fn = strategy.train_step(task.loss_fn, optimizer, accum=config.grad_accum)
    # Every batch has one shape (one compile): padded to split over the micro-batches and devices.
    step_size = padded_size(bs, config.grad_accum * strategy.batch_shards)
    eval_fn = strategy.eval_step(task.loss_fn, task.predictor)
    batches = _batches(task.train_data, bs, config, strategy.data_streams, start=done)
    start_step = done

    # A resumed run keeps the history up to its checkpoint and drops what came after.
    history: list[dict[str, Any]] = _previous_history(out, done) if done else []
    writer = art.MetricsWriter(None if out is None or not primary else out / "metrics.jsonl")
    for row in history:
        writer.write(row)
    status, failure = "completed", None
    known = KnownGood(state, done)  # checkpoints wait until their state's loss is seen finite
    saved_at = done

    def position(epoch: int) -> dict[str, Any]:
        return {
            "task": task.name,
            "seed": config.seed,
            "batch_size": bs,
            "drop_remainder": config.drop_remainder,
            "grad_accum": config.grad_accum,
            "epoch": epoch,
            "strategy": strategy.describe(),
            "config": run_info or {},
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    last_train: dict[str, float] = {}
    window: dict[str, float] = {}
    window_steps, window_start = 0, time.perf_counter()
    t0 = time.perf_counter()
    t_first = None  # end of the first step: excludes compilation from steps/s
    first_step_s = None  # process start to the end of the first step (start-up cost)
    eval_seconds = 0.0  # excluded from steps/s as well

    def record(row: dict[str, Any]) -> None:
        history.append(row)
        writer.write(row)

    def run_eval(params, at_step: int) -> None:
        nonlocal eval_seconds
        if task.eval_data is None:
            return
        started = time.perf_counter()
        means = evaluate(strategy, eval_fn, params, task.eval_data, config.eval_batch_size, eval_key)
        record({"split": "eval", "step": at_step, **means})
        eval_seconds += time.perf_counter() - started

    title = f"{task.name} / {strategy.name}"
    try:
        watch = (
            StepWatchdog(step_timeout)
            if step_timeout and jax.process_count() > 1
            else contextlib.nullcontext(None)
        )
        with _StopRequest() as stop, Preemption() as preempt, _progress(progress, total, title) as bar, watch as dog:
            bar_task = bar.add_task(title, total=total, loss="-", rate="-") if bar else None
            if bar is not None:
                bar.update(bar_task, completed=done)
            for step in range(start_step, total):
                epoch, host_batch = next(batches)
                batch, mask = strategy.put_batch(host_batch, size=step_size)
                if dog is not None:
                    dog.started(step + 1)
                new_state, metrics = step_fn(state, batch, mask, jax.random.fold_in(step_key, step))
                # Block every step: queued collective steps deadlock XLA:CPU.
                jax.block_until_ready(new_state)
                values = to_python(metrics)
                if not math.isfinite(values["loss"]):
                    status = "diverged"
                    failure = NonFiniteLossError(
                        fix(
                            f"the training loss became {values['loss']} at step {step + 1} "
                            f"(epoch {epoch + 1}). The last finite loss was "
                            f"{last_train.get('loss', float('nan')):.6g} at step {step}; the "
                            "parameters that produced it are kept"
                            + (f" in {out / 'params.npz'}." if out else "."),
                            "lower the learning rate (--lr), or check the data for NaN/inf.",
                        ),
                        step=step + 1,
                        loss=values["loss"],
                    )
                    state, done = known.state, known.step
                    known.drop()
                    break
                due = known.confirm(state, done)
                if due is not None and ckpt is not None:
                    try:
                        ckpt.save(*due)
                        saved_at = due[0]
                    except CheckpointSaveError as e:
                        status, failure = "failed", e
                        break
                state, done = new_state, step + 1
                if dog is not None:
                    dog.finished(done)
                last_train = values
                if t_first is None:
                    t_first = time.perf_counter()
                    first_step_s = process_age_s()
                for k, v in values.items():
                    window[k] = window.get(k, 0.0) + np.asarray(v)
                window_steps += 1
                if done % config.log_every == 0 or done == total:
                    now = time.perf_counter()
                    rate = window_steps / max(now - window_start, 1e-9)
                    record(
                        {
                            "split": "train",
                            "step": done,
                            "epoch": epoch + 1,
                            **to_python({k: v / window_steps for k, v in window.items()}),
                            "steps_per_sec": rate,
                            "elapsed_s": now - t0,
                        }
                    )
                    window, window_steps, window_start = {}, 0, now
                    if bar is not None:
                        bar.update(bar_task, loss=f"{values['loss']:.4g}", rate=f"{rate:.1f}")
                if bar is not None:
                    bar.update(bar_task, completed=done)
                if done % eval_every == 0 or done == total:
                    run_eval(state.params, done)
                if ckpt is not None and done % checkpoint.every == 0:
                    known.hold(done, state, position(epoch))
                if stop.requested:
                    status = "interrupted"
                    break
                if preempt.reached(done):
                    status = "preempted"
                    break
    except KeyboardInterrupt:
        status = "interrupted"
    elapsed = time.perf_counter() - t0
    train_seconds = None if t_first is None else time.perf_counter() - t_first - eval_seconds
    if status == "interrupted" and done and history[-1]["split"] != "eval":
        run_eval(state.params, done)  # so an interrupted run still reports where it got
    writer.close()
    if ckpt is not None:
        # A diverged state is never saved: the last checkpoint stays the last good one.
        try:
            if status not in ("diverged", "failed") and done > saved_at and state_is_finite(state):
                ckpt.save(done, state, position(done // steps_per_epoch))
            ckpt.close()
        except CheckpointSaveError as e:
            status, failure = "failed", failure or e
            ckpt.abandon()
    params = strategy.host_params(state)
    eval_row = next((r for r in reversed(history) if r["split"] == "eval"), None)
    summary: dict[str, Any] = {
        "task": task.name,
        "status": status,
        **({"error": str(failure).splitlines()[0]} if failure is not None else {}),
        **strategy.describe(),
        "steps": done,
        "steps_planned": total,
        "epochs": done / steps_per_epoch,
        "batch_size": bs,
        "seed": config.seed,
        "final_train_loss": last_train.get("loss"),
        "final_train_metrics": last_train,
        "eval_loss": None if eval_row is None else eval_row["loss"],
        **(
            {f"eval_{k}": v for k, v in eval_row.items() if k not in ("split", "step", "loss")}
            if eval_row
            else {}
        ),
        "wall_time_s": elapsed,
        "first_step_s": first_step_s,
        "steps_per_sec": (done - 1) / train_seconds if train_seconds and done > 1 else None,
        "params_digest": art.params_digest(params),
        **(
            {
                "resumed_from_step": start_step,
                "checkpoint_dir": str(ckpt.directory),
                "checkpoint_steps": ckpt.steps(),
                "checkpoint_blocked_s": ckpt.blocked,
            }
            if ckpt is not None
            else {}
        ),
        "param_count": art.param_count(params),
        **_task_report(task, strategy, params),
        **strategy.summarize(eval_row or {}),
        **({"config": run_info} if run_info else {}),
    }
    if out is not None and primary:
        art.save_params(out / "params.npz", params)
        art.write_json(out / "summary.json", summary)
        if history:
            title = f"{task.name}, {summary['strategy']}, {summary['device_count']} device(s)"
            art.plot_history(history, out / "loss.png", title)
            if any("member_accuracy" in r for r in history):
                art.plot_members(history, out / "ensemble.png", title)
    if failure is not None:
        raise failure
    return FitResult(state, params, summary, history)
