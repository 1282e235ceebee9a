"""The training loop: a short loop over ``strategy.step`` and its hooks.

It knows neither the task's insides nor the strategy's: the task's loss and the
optimizer become a single-device step (``_steps``), the strategy compiles and places
it, and eval, metrics, checkpoints and the NaN guard are hooks (``_hooks``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from spmdkit._checkpoint import CheckpointConfig, Checkpointer, CheckpointSaveError
from spmdkit._config import TrainConfig, changed_options
from spmdkit._errors import ConfigError, NonFiniteLossError, fix
from spmdkit._data import ArrayFeed, DataError, Prefetch, open_feed, to_devices
from spmdkit._process import process_age_s
from spmdkit._strategies._base import Strategy, TrainState, to_host
from spmdkit._tasks._base import Task, num_examples
from spmdkit._train import _artifacts as art
from spmdkit._train._hooks import (
    CheckpointHook,
    EvalHook,
    MetricsHook,
    NaNGuard,
    ProgressHook,
    StepInfo,
    run_hooks,
    to_python,
    with_member_means,
)
from spmdkit._train._guards import KnownGood, state_is_finite
from spmdkit._train._preempt import Preemption
from spmdkit._train._steps import task_eval_step, task_state, task_train_step
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
    The order is :class:`spmdkit._data.ArrayFeed`'s, which ``fit`` reads from.
    """
    feed = ArrayFeed(data, batch_size, seed, drop_remainder)
    for k in itertools.count(start_step):
        epoch, idx = feed.indices(k, stream)
        yield epoch, jax.tree.map(lambda x: x[idx], data)


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


def _check_resumable(meta: dict[str, Any], config: TrainConfig, task: str, run_info: dict[str, Any] | None = None,
                     total: int | None = None) -> None:
    """A resumed run must see the same data order and hyperparameters, or it is not the same run."""
    if total is not None and int(meta["step"]) > total:
        raise ConfigError(fix(
            f"the newest checkpoint is at step {meta['step']}, already past this run's {total} steps: there is "
            f"nothing to train, and its parameters are not those of step {total}.",
            f"pass --steps {meta['step']} or more (TrainConfig(steps=...)) to continue that run, or start a new "
            "run in another --checkpoint-dir."))
    changed = changed_options((meta.get("config") or {}), run_info) if run_info and meta.get("config") else []
    if changed:
        flag, then, now = changed[0]
        raise ConfigError(fix(
            f"the checkpoint at step {meta.get('step')} was written with {flag} {then}, this run has {flag} {now}"
            + "".join(f", {f} {a} -> {b}" for f, a, b in changed[1:])
            + "; resuming would not continue the same run.",
            f"resume with {flag} {then}, or start a new run with {flag} {now} in another --checkpoint-dir."))
    for name, now in (("task", task), ("seed", config.seed), ("batch_size", config.batch_size),
                      ("drop_remainder", config.drop_remainder)):
        then = meta.get(name)
        if then is not None and then != now:
            raise ConfigError(
                fix(
                    f"the checkpoint at step {meta.get('step')} was written with {name}={then!r}, this run has "
                    f"{name}={now!r}; resuming would not continue the same run.",
                    f"resume with {name}={then!r}, or start a new run in another checkpoint directory "
                    "(CheckpointConfig(directory); --checkpoint-dir).",
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
    members = strategy.member_params(params) if hasattr(strategy, "member_params") else [params]
    reports = [task.report(p) for p in members]
    return reports[0] if len(reports) == 1 else {"member_reports": reports}


def evaluate_task(state: Any, data: Any, batch_size: int, eval_step: Callable[..., Any],
                  predict: Callable[..., Any] | None = None, predictor: Any = None) -> dict[str, Any]:
    """Means over a whole data set, in chunks of ``batch_size`` (the last one as it is).

    ``eval_step(state, chunk)`` returns the chunk's means; they are weighted by the
    chunk's rows. With ``predict`` (an ensemble's ``apply`` of the predictor) the mean
    of the members' probabilities is scored as ``ensemble_<metric>``.
    """
    n = num_examples(data)
    size = min(batch_size, n)
    totals: dict[str, Any] = {}
    for start in range(0, n, size):
        chunk = jax.tree.map(lambda x: x[start : start + size], data)
        rows = num_examples(chunk)
        for k, v in jax.device_get(eval_step(state, chunk)).items():
            totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64) * rows
        if predict is not None:
            probs = np.mean(np.asarray(jax.device_get(predict(state, chunk))), axis=0)  # members' mean
            for name, v in predictor.score(probs, chunk).items():
                totals[f"ensemble_{name}"] = totals.get(f"ensemble_{name}", 0.0) + float(np.sum(v))
    return with_member_means(to_python({k: v / n for k, v in totals.items()}))


class _Plan(NamedTuple):
    batch_size: int
    steps_per_epoch: int
    total: int
    eval_every: int


def _plan(task: Task, strategy: Any, config: TrainConfig) -> _Plan:
    """The run's length and sizes, validated before anything is built."""
    bs = config.batch_size
    if bs > task.num_train:
        raise ConfigError(
            fix(f"batch_size={bs} is larger than the training set of task {task.name!r} ({task.num_train} examples).",
                f"use batch_size={task.num_train} or less (--batch-size).")
        )
    ga = config.grad_accum
    if bs % ga:
        # Only fixes the data allow: a batch of at most num_train rows, or a divisor of this batch.
        sizes = [m for m in (bs - bs % ga, bs - bs % ga + ga) if 0 < m <= task.num_train]
        divisor = max(d for d in range(1, ga) if bs % d == 0)
        options = ([f"batch_size={sizes[0]}"] if sizes else []) + [f"grad_accum={divisor}"]
        raise ConfigError(
            fix(f"batch_size={bs} is not a multiple of grad_accum={ga}: the micro-batches of a step must be "
                f"equal{'' if sizes else f', and no multiple of {ga} fits the {task.num_train} examples'}.",
                f"use {' or '.join(options)} (--batch-size, --grad-accum).")
        )
    shards = getattr(strategy, "batch_shards", 1)
    if bs % shards:
        warnings.warn(
            f"batch_size={bs} does not split over the {shards} devices of the batch axis: every step runs the "
            f"whole batch on every device (exact, not parallel). Use a multiple of {shards}.", stacklevel=3)
    per_epoch = task.num_train // bs if config.drop_remainder else math.ceil(task.num_train / bs)
    total = config.steps if config.steps is not None else config.epochs * per_epoch
    return _Plan(bs, per_epoch, total, config.eval_every or per_epoch)


def _pipeline_plan(task: Task, strategy: Any, config: TrainConfig, feed: Any) -> _Plan:
    """The plan of a run from a pipeline: its length is its own (``steps_per_epoch`` None: unknown)."""
    bs, per_epoch = config.batch_size, feed.steps_per_epoch
    if per_epoch is None and config.steps is None:
        raise ConfigError(fix(f"task {task.name!r} trains from a pipeline of unknown length, so epochs={config.epochs} "
                              "cannot be counted.", "give the run's length in steps (TrainConfig(steps=...); --steps)."))
    if bs % config.grad_accum:
        raise ConfigError(fix(f"batch_size={bs} is not a multiple of grad_accum={config.grad_accum}: the micro-batches "
                              "of a step must be equal.", "change one of them (--batch-size, --grad-accum)."))
    shards = getattr(strategy, "batch_shards", 1)
    if bs % shards:
        warnings.warn(
            f"batch_size={bs} does not split over the {shards} devices of the batch axis: every step runs the "
            f"whole batch on every device (exact, not parallel). Use a multiple of {shards}.", stacklevel=3)
    total = config.steps if config.steps is not None else config.epochs * per_epoch
    return _Plan(bs, per_epoch or total, total, config.eval_every or per_epoch or total)


def _start(strategy: Any, make_state: Callable[..., Any], key: jax.Array, checkpoint: CheckpointConfig | None,
           ckpt: Checkpointer | None, config: TrainConfig, task: Task, log: Callable[[str], None],
           run_info: dict[str, Any] | None = None, total: int | None = None) -> tuple[Any, int]:
    """The initial state and the steps already done: fresh, or the newest intact checkpoint."""
    if ckpt is not None and checkpoint.resume:
        target = strategy.abstract(make_state, key, unbox=True)
        restored = ckpt.restore_latest(target, members=getattr(strategy, "members", None))
        if restored is not None:
            state, meta = restored
            _check_resumable(meta, config, task.name, run_info, total)
            log(f"checkpoints: resumed from step {int(meta['step'])} in {ckpt.directory}")
            return state, int(meta["step"])
        log(f"checkpoints: nothing to resume in {ckpt.directory}; starting from step 0")
    return strategy.init(make_state, key, unbox=True), 0


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

    The task's loss and the optimizer become a single-device ``train_step(state,
    batch)`` that runs through ``strategy.step``, like any user's step; eval, metrics,
    checkpoints and the NaN guard are hooks (``spmdkit._train._hooks``). The data order,
    initialisation and per-step randomness depend only on ``config.seed``, so the same
    config on 1 or 8 devices gives the same result. The loop waits for every step to
    finish before the next (XLA:CPU deadlocks when many collective steps are queued).
    With ``out_dir`` it writes ``metrics.jsonl`` (as it goes), ``summary.json``,
    ``params.npz`` (with a stateful task, ``{"params", "model_state"}``) and ``loss.png``.
    ``task.train_data`` may be arrays, a data set directory or a pipeline of batches
    (a list, generator, iterator, Grain dataset or loader; see ``spmdkit._data``); with
    ``config.prefetch`` batches are read and placed that many steps ahead by a thread.
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
    entered = time.perf_counter()  # for first_step_in_fit_s: start-up inside fit, imports excluded
    feed = open_feed(task.train_data, config.batch_size, config.seed, config.drop_remainder, strategy)
    plan = _plan(task, strategy, config) if task.num_train is not None else _pipeline_plan(task, strategy, config, feed)
    validate_task(task, config.batch_size, feed.example())
    out = None if out_dir is None else Path(out_dir)
    # With several processes (jax.distributed) every one trains; process 0 alone writes.
    primary = jax.process_index() == 0
    if out is not None and primary:
        art.prepare_out_dir(out)
    init_key, _, eval_key = jax.random.split(jax.random.key(config.seed), 3)
    make_state = task_state(task, optimizer)
    ckpt = None if checkpoint is None else Checkpointer(checkpoint, log=log).claim()
    try:
        state, done = _start(strategy, make_state, init_key, checkpoint, ckpt, config, task, log, run_info, plan.total)
        if done:  # the data position saved with that state (older checkpoints: none)
            feed.resume(ckpt.meta(done).get("data"))
    except BaseException:
        if ckpt is not None:
            ckpt.abandon()  # a refused resume leaves the directory unlocked
        raise
    start_step = done
    step = strategy.step(task_train_step(task, optimizer, config.grad_accum))

    # A resumed run keeps the history up to its checkpoint and drops what came after.
    history: list[dict[str, Any]] = _previous_history(out, done) if done else []
    writer = art.MetricsWriter(None if out is None or not primary else out / "metrics.jsonl")
    for row in history:
        writer.write(row)

    def record(row: dict[str, Any]) -> None:
        history.append(row)
        writer.write(row)
        if bar is not None and row["split"] == "train":
            bar.show(row)

    bar = ProgressHook(plan.total, f"{task.name} / {strategy.name}", start=done) if progress and primary else None
    known = KnownGood(state, done)  # checkpoints wait until their state's loss is seen finite
    hooks = _hooks(task, strategy, config, plan, record, eval_key, ckpt, checkpoint, run_info, known, feed)
    metrics, evaluator = hooks[0], next((h for h in hooks if isinstance(h, EvalHook)), None)
    guard = NaNGuard(hint="lower the learning rate (optimizer=; --lr on the command line), or check the data "
                          "for NaN/inf. The parameters of the last finite loss are kept"
                          + (f" in {out / 'params.npz'}." if out else "."))
    status, failure, info = "completed", None, None
    batches = _feed_batches(feed, strategy, config, done)
    t0, t_first, first_step_s = time.perf_counter(), None, None
    watch = StepWatchdog(step_timeout) if step_timeout and jax.process_count() > 1 else contextlib.nullcontext(None)
    try:
        with _StopRequest() as stop, Preemption() as preempt, (bar or contextlib.nullcontext()), watch as dog:
            for i in range(start_step, plan.total):
                epoch, host_batch = next(batches)
                if dog is not None:
                    dog.started(i + 1)
                new_state, aux = step(state, host_batch)
                jax.block_until_ready(new_state)  # queued collective steps deadlock XLA:CPU
                candidate = StepInfo(i + 1, epoch, new_state, to_python(aux))
                try:
                    guard(candidate)
                except NonFiniteLossError as e:
                    # The loss of step k comes from the state after k - 1 updates: keep the one before.
                    status, failure = "diverged", e
                    state, done = known.state, known.step
                    known.drop()
                    break
                due = known.confirm(state, done)  # this loss came from `state`: it is good
                if due is not None and ckpt is not None:
                    try:
                        ckpt.save(*due)
                        ckpt_hook(hooks).saved_at = due[0]
                    except CheckpointSaveError as e:
                        status, failure = "failed", e
                        break
                state, done, info = new_state, i + 1, candidate
                if dog is not None:
                    dog.finished(done)
                if t_first is None:  # excludes compilation from steps/s
                    t_first, first_step_s = time.perf_counter(), process_age_s()  # start-up cost
                metrics.add(info)
                run_hooks(hooks + ([bar] if bar else []), info)
                if done == plan.total:  # the last step always logs and evaluates
                    for hook in (metrics, evaluator):
                        if hook is not None and done % hook.every:
                            hook(info)
                if stop.requested:
                    status = "interrupted"
                    break
                if preempt.reached(done):
                    status = "preempted"
                    break
            # Every process probes or none does (a probe is a collective step): an interrupt is per process.
            agreed = ("completed", "preempted") + (("interrupted",) if jax.process_count() == 1 else ())
            # A one-shot iterator of the user's is not read past the run's last batch.
            if status in agreed and done > start_step and (ckpt is not None or out is not None) \
                    and not getattr(feed, "one_shot", False):
                state, done, status, failure = _confirm_final(step, batches, guard, known, state, done, status)
    except KeyboardInterrupt:
        status = "interrupted"
    except DataError as e:  # bad data mid-run: the last good state is still saved and summarised
        status, failure = "failed", e
    finally:
        if isinstance(batches, Prefetch):
            batches.close()
    elapsed = time.perf_counter() - t0
    if status == "interrupted" and evaluator is not None and done and evaluator.last_step != done:
        evaluator(StepInfo(done, 0, state, {}))  # so an interrupted run still reports where it got
    writer.close()
    final = StepInfo(done, 0, state, {}) if done > start_step else None
    if ckpt is not None:
        # A diverged or non-finite state is never saved: the last checkpoint stays the last good one.
        try:
            # A run ended by bad data still saves its last good state; a failed save does not retry.
            if status != "diverged" and not isinstance(failure, CheckpointSaveError) and final is not None and done != ckpt_hook(hooks).saved_at \
                    and state_is_finite(state):
                ckpt.save(done, state, ckpt_hook(hooks).meta(final))
            ckpt.close()
        except CheckpointSaveError as e:
            status, failure = "failed", failure or e
            ckpt.abandon()
    eval_seconds = evaluator.seconds if evaluator is not None else 0.0
    train_seconds = None if t_first is None else time.perf_counter() - t_first - eval_seconds
    params = to_host(state.params)
    summary = _summary(task, strategy, config, plan, status, done, start_step, history, metrics.last_row,
                       params, elapsed, train_seconds, ckpt, run_info)
    summary["first_step_s"] = None if first_step_s is None else round(first_step_s, 3)
    summary["first_step_in_fit_s"] = None if t_first is None else round(t_first - entered, 3)
    if failure is not None:
        summary["error"] = str(failure).splitlines()[0]
    if out is not None and primary:
        saved = params if state.model_state is None else {"params": params, "model_state": to_host(state.model_state)}
        _write_artifacts(out, saved, summary, history, task)
    if failure is not None:
        raise failure
    return FitResult(state, params, summary, history)


def _confirm_final(step, batches, guard, known, state, done, status):
    """The last state is kept (saved, written) only if known good, like every checkpoint: the
    loss the next step would compute from it is finite. Otherwise the run diverged at its end
    and the newest known-good state is kept instead."""
    try:
        epoch, host_batch = next(batches)
    except (StopIteration, DataError):  # a pipeline that ends with the run: only the leaves can be checked
        return state, done, status, None
    probe = step(state, host_batch)
    jax.block_until_ready(probe)  # queued collective steps deadlock XLA:CPU
    try:
        guard(StepInfo(done + 1, epoch, state, to_python(probe[1])))
    except NonFiniteLossError as e:
        return known.state, known.step, "diverged", e
    known.confirm(state, done)
    return state, done, status, None


def _feed_batches(feed: Any, strategy: Any, config: TrainConfig, start: int) -> Any:
    """``(epoch, batch)`` from global batch ``start``; ``config.prefetch`` of them read and
    placed ahead by a thread (placement only: the steps stay on this thread, synced)."""
    batches = feed.batches(start)
    if not config.prefetch:
        return batches
    sharding_for = getattr(strategy, "_batch_sharding_for", None)
    place = None if sharding_for is None else (
        lambda b: to_devices(b, lambda even: sharding_for("step", even), getattr(strategy, "batch_shards", 1)))
    return Prefetch(batches, config.prefetch, place)


def ckpt_hook(hooks: list[Any]) -> CheckpointHook:
    return next(h for h in hooks if isinstance(h, CheckpointHook))


def _hooks(task, strategy, config, plan, record, eval_key, ckpt, checkpoint, run_info, known=None,
           feed=None) -> list[Any]:
    """fit's hooks: metrics rows first, then eval, then checkpoints."""
    hooks: list[Any] = [MetricsHook(record, every=config.log_every)]
    if task.eval_data is not None:
        eval_step = strategy.evaluate(task_eval_step(task, eval_key))
        ensemble = task.predictor is not None and getattr(strategy, "members", None)
        predict = strategy.apply(lambda s, b: task.predictor.predict(s.params, b)) if ensemble else None

        def run_eval(state):
            return evaluate_task(state, task.eval_data, config.eval_batch_size, eval_step, predict, task.predictor)

        hooks.append(EvalHook(run_eval, record, every=plan.eval_every))
    if ckpt is not None:
        def meta(info: StepInfo) -> dict[str, Any]:
            return {"task": task.name, "seed": config.seed, "batch_size": config.batch_size,
                    "drop_remainder": config.drop_remainder, "grad_accum": config.grad_accum,
                    "epoch": info.step // plan.steps_per_epoch if not info.metrics else info.epoch,
                    "strategy": strategy.describe(), "config": run_info or {},
                    "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    **({"data": feed.state(info.step)} if feed is not None else {})}

        hooks.append(CheckpointHook(ckpt, checkpoint.every, meta, known=known))
    return hooks


def _summary(task, strategy, config, plan, status, done, start_step, history, last_train, params, elapsed,
             train_seconds, ckpt, run_info) -> dict[str, Any]:
    last_train = {k: v for k, v in (last_train or {}).items() if k not in ("split", "step", "epoch", "steps_per_sec", "elapsed_s")}
    eval_row = next((r for r in reversed(history) if r["split"] == "eval"), None)
    return {
        "task": task.name,
        "status": status,
        **strategy.describe(),
        "steps": done,
        "steps_planned": plan.total,
        "epochs": done / plan.steps_per_epoch,
        "batch_size": plan.batch_size,
        "seed": config.seed,
        "final_train_loss": last_train.get("loss"),
        "final_train_metrics": last_train,
        "eval_loss": None if eval_row is None else eval_row["loss"],
        **({f"eval_{k}": v for k, v in eval_row.items() if k not in ("split", "step", "loss")} if eval_row else {}),
        "wall_time_s": elapsed,
        "steps_per_sec": (done - 1) / train_seconds if train_seconds and done > 1 else None,
        "params_digest": art.params_digest(params),
        **({"resumed_from_step": start_step, "checkpoint_dir": str(ckpt.directory), "checkpoint_steps": ckpt.steps(),
            "checkpoint_blocked_s": ckpt.blocked} if ckpt is not None else {}),
        "param_count": art.param_count(params),
        **_task_report(task, strategy, params),
        **(strategy.summarize(eval_row or {}) if hasattr(strategy, "summarize") else {}),
        **({"config": run_info} if run_info else {}),
    }


def _write_artifacts(out: Path, params: Any, summary: dict[str, Any], history: list[dict[str, Any]], task: Task) -> None:
    art.save_params(out / "params.npz", params)
    art.write_json(out / "summary.json", summary)
    if history:
        title = f"{task.name}, {summary['strategy']}, {summary['device_count']} device(s)"
        art.plot_history(history, out / "loss.png", title)
        if any("member_accuracy" in r for r in history):
            art.plot_members(history, out / "ensemble.png", title)
