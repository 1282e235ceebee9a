"""The training loop: a short loop over ``strategy.step`` and its hooks.

It knows neither the task's insides nor the strategy's: the task's loss and the
optimizer become a single-device step (``_steps``), the strategy compiles and places
it, and eval, metrics, checkpoints and the NaN guard are hooks (``_hooks``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import reprlib
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
import optax

from spmdkit._host_memory import DEFAULTS_WHY, HostMemory, host_memory, release_host_memory
from spmdkit._checkpoint import CheckpointConfig, CheckpointError, Checkpointer, CheckpointSaveError, check_savable
from spmdkit._config import EXAMPLE_OPTIONS, SHAPE_OPTIONS, TrainConfig, changed_options, differing_options, moved_data
from spmdkit._data import ArrayFeed, DataError, Prefetch, open_feed, to_devices
from spmdkit._data._eval import eval_chunks, resolve_eval_data
from spmdkit._data._feed import arrays_digest
from spmdkit._errors import ConfigError, NonFiniteLossError, PeerLostError, fix
from spmdkit._process import gather_json, guarded, process_age_s, wait_ready
from spmdkit._strategies._agree import check_distinct_shares, check_same_data, check_same_settings, spans_processes
from spmdkit._strategies._base import Strategy, TrainState, to_host
from spmdkit._strategies.ensemble import Ensemble
from spmdkit._tasks._base import LOSS_WEIGHT, Task
from spmdkit._train import _artifacts as art
from spmdkit._train._hooks import (
    EvalHook,
    Hook,
    MetricsHook,
    NaNGuard,
    ProgressHook,
    StepInfo,
    run_hooks,
    to_python,
    with_member_means,
)
from spmdkit._train._guards import KnownGood, state_is_finite
from spmdkit._train._optimizer_record import changed_constants, optimizer_record
from spmdkit._train._preempt import Preemption
from spmdkit._train._steps import task_eval_step, task_state, task_train_step
from spmdkit._train._validate import per_example_scores, validate_task
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


class _StopRequest:
    """First Ctrl-C: finish the current step, then stop. Second: stop at once.

    With several processes a Ctrl-C may reach one of them only (``kill -INT`` of one pid, a
    terminal attached to one host): stopping that one alone left the others waiting for it in
    their next step, and it waiting for them in its final save, until the distributed timeout
    (exit 4, a native crash dump). The first Ctrl-C is then made a preemption notice (SIGTERM to
    this process, which JAX's preemption service hears), so that every process stops at one
    agreed step and saves it together, as ``Preemption`` does for a SIGTERM.
    """

    def __init__(self, log: Callable[[str], None] = print) -> None:
        self.requested = False
        self._previous = None
        self._multi = jax.process_count() > 1
        self._log = log

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self._multi:
            self._log("Ctrl-C: every process stops at one step agreed with the others, saves it and writes its files "
                      "(a second Ctrl-C stops this process at once; the others then wait for it until "
                      "--distributed-timeout)")
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self):
        # An ignored SIGINT stays ignored: `cmd &` in a script sets it so that the terminal's
        # Ctrl-C, meant for the foreground job, does not reach this one.
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        if threading.current_thread() is threading.main_thread() and not ignored:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _check_resumable(meta: dict[str, Any], config: TrainConfig, task: str, run_info: dict[str, Any] | None = None,
                     total: int | None = None, bagging: bool | None = None) -> None:
    """A resumed run must see the same data order and hyperparameters, or it is not the same run."""
    if total is not None and int(meta["step"]) > total:
        raise ConfigError(fix(
            f"the newest checkpoint is at step {meta['step']}, already past this run's {total} steps: there is "
            f"nothing to train, and its parameters are not those of step {total}.",
            f"pass --steps {meta['step']} or more (TrainConfig(steps=...)) to continue that run, or start a new "
            "run in another --checkpoint-dir."))
    changed = changed_options((meta.get("config") or {}), run_info) if run_info and meta.get("config") else []
    for flag, then, now in moved_data(meta.get("config") or {}, run_info or {}) if meta.get("config") else []:
        warnings.warn(f"the checkpoint at step {meta.get('step')} was written with {_place(flag, then)}, this run has "
                      f"{_place(flag, now)}: resuming on the assumption that it is the same data (moved). If it is "
                      "not, start a new run in another --checkpoint-dir.", RuntimeWarning, stacklevel=4)
    if changed:
        flag, then, now = changed[0]
        raise ConfigError(fix(
            f"the checkpoint at step {meta.get('step')} was written with {flag} {then}, this run has {flag} {now}"
            + "".join(f", {f} {a} -> {b}" for f, a, b in changed[1:])
            + "; resuming would not continue the same run.",
            f"resume with {flag} {then}, or start a new run with {flag} {now} in another --checkpoint-dir."))
    for name, now in (("task", task), ("seed", config.seed), ("batch_size", config.batch_size),
                      ("drop_remainder", config.drop_remainder), ("grad_accum", config.grad_accum),
                      ("bagging", bagging)):
        then = (meta.get("strategy") or {}).get(name) if name == "bagging" else meta.get(name)
        if then is not None and now is not None and then != now:  # bagging None: not an ensemble
            raise ConfigError(
                fix(
                    f"the checkpoint at step {meta.get('step')} was written with {name}={then!r}, this run has "
                    f"{name}={now!r}; resuming would not continue the same run.",
                    f"resume with {name}={then!r}, or start a new run in another checkpoint directory "
                    "(CheckpointConfig(directory); --checkpoint-dir).",
                )
            )


def _place(flag: str, path: Any) -> str:
    """A data location as a user gave it: ``--text-dir DIR``, or ``no --text-dir`` (not ``--text-dir None``)."""
    if path is not None:
        return f"{flag} {path}"
    return "no --text-dir (the standard library's sources)" if flag == "--text-dir" else f"no {flag}"

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
    members = strategy.member_params(params) if isinstance(strategy, Ensemble) else [params]
    try:
        reports = [task.report(p) for p in members]
        wrong = next((r for r in reports if not isinstance(r, Mapping)), None)
        if wrong is not None:
            raise TypeError(f"it returned {type(wrong).__name__}, not a dict")
    except Exception as e:  # the user's code, after the whole run: the run's files must still be written
        warnings.warn(f"task {task.name!r}: report(params) failed after training ({type(e).__name__}: {e}); "
                      "the summary is written without it. Fix: return a dict of numbers or arrays, e.g. "
                      "{'w_norm': float(jnp.linalg.norm(params['w']))}.", RuntimeWarning, stacklevel=2)
        return {"report_error": f"{type(e).__name__}: {e}"}
    return reports[0] if len(reports) == 1 else {"member_reports": reports}


def evaluate_task(state: Any, data: Any, batch_size: int, eval_step: Callable[..., Any],
                  predict: Callable[..., Any] | None = None, predictor: Any = None, *,
                  strategy: Any = None, on_chunk: Callable[[], None] | None = None) -> dict[str, Any]:
    """Means over a whole eval set: arrays, a data set directory or a finite pipeline.

    Arrays are read in chunks of ``batch_size`` (see :func:`spmdkit._data.eval_chunks`:
    with several processes each reads only its rows); a pipeline's batches are its own.
    ``eval_step(state, chunk)`` returns the chunk's means; they are weighted by the
    chunk's rows (or by its ``loss_weight``, a count-normalised loss's denominator, when
    the loss reports one), so none is dropped or counted twice. ``strategy`` (by default
    ``eval_step``'s) says where chunks go. With ``predict`` (an ensemble's ``apply`` of
    the predictor) the mean of the members' probabilities is scored as ``ensemble_<metric>``.
    ``on_chunk()`` runs after each chunk's values are on the host (``fit``: the step watchdog's
    ``progressed``, so a long eval of many chunks is not taken for a hung job).
    """
    strategy = strategy if strategy is not None else getattr(eval_step, "strategy", None)
    where = getattr(strategy, "_batch_sharding_for", None)
    sharding_for = None if where is None else (lambda even: where("eval", even))
    totals: dict[str, Any] = {}
    scored: dict[str, float] = {}
    n = weight = 0
    weighted = False
    chunks = eval_chunks(resolve_eval_data(data), batch_size, getattr(strategy, "batch_shards", 1), sharding_for)
    for number, (rows, chunk) in enumerate(chunks, 1):
        n += rows
        # A peer process that ended meanwhile fails the eval step's collective with the runtime's raw words.
        values = guarded(lambda: jax.device_get(wait_ready(eval_step(state, chunk))), f"evaluated (eval chunk {number})")
        means = {k: np.asarray(v, np.float64) for k, v in values.items()}
        weighted = LOSS_WEIGHT in means
        w = means.pop(LOSS_WEIGHT, rows)
        weight = weight + w
        for k, v in means.items():
            # a chunk of weight 0 adds nothing (its means are 0/0 in the user's loss)
            totals[k] = totals.get(k, 0.0) + np.where(w > 0, v * w, 0.0)
        if predict is not None:
            probs = np.mean(np.asarray(guarded(lambda: to_host(wait_ready(predict(state, chunk))),
                                               f"evaluated (eval chunk {number})")), axis=0)  # members' mean
            host = to_host(chunk)
            scores = predictor.score(probs, host)
            per_example_scores(scores, int(np.shape(jax.tree.leaves(host)[0])[0]), "the ensemble's eval")  # a pipeline's batches too
            for name, v in scores.items():
                scored[f"ensemble_{name}"] = scored.get(f"ensemble_{name}", 0.0) + float(np.sum(v))
        if on_chunk is not None:
            on_chunk()
    means = {k: v / weight for k, v in totals.items()} | {k: v / n for k, v in scored.items()}
    if weighted:  # the eval set's whole denominator, as the train step reports its batch's
        means[LOSS_WEIGHT] = weight
    return with_member_means(to_python(means))


class _Plan(NamedTuple):
    batch_size: int
    steps_per_epoch: int  # the run's length when the data's is unknown
    total: int
    eval_every: int
    epoch_examples: int | None = None  # examples in one epoch; None: a pipeline of unknown length

    def epochs(self, done: int) -> float | None:
        """Passes over the data after ``done`` steps; None when an epoch's length is unknown."""
        return None if self.epoch_examples is None else done / self.steps_per_epoch

    def examples(self, done: int) -> int:
        """Examples trained on in ``done`` steps (an epoch's short last batch counted as it is)."""
        if self.epoch_examples is None:
            return done * self.batch_size
        full, part = divmod(done, self.steps_per_epoch)
        return full * self.epoch_examples + min(part * self.batch_size, self.epoch_examples)


def _plan(task: Task, strategy: Any, config: TrainConfig, feed: Any) -> _Plan:
    """The run's length and sizes, validated before anything is built. A pipeline's length
    is its own (``feed.steps_per_epoch`` None: unknown, so the run needs ``steps``)."""
    bs, ga, n = config.batch_size, config.grad_accum, task.num_train
    if n is not None and bs > n:
        raise ConfigError(
            fix(f"batch_size={bs} is larger than the training set of task {task.name!r} ({n} examples).",
                f"use batch_size={n} or less (--batch-size).")
        )
    if bs % ga:
        # Only fixes the data allow: a batch of at most num_train rows, or a divisor of this batch.
        sizes = [m for m in (bs - bs % ga, bs - bs % ga + ga) if 0 < m and (n is None or m <= n)]
        divisor = max(d for d in range(1, ga) if bs % d == 0)
        options = ([f"batch_size={sizes[0]}"] if sizes else []) + [f"grad_accum={divisor}"]
        raise ConfigError(
            fix(f"batch_size={bs} is not a multiple of grad_accum={ga}: the micro-batches of a step must be "
                f"equal{'' if sizes else f', and no multiple of {ga} fits the {n} examples'}.",
                f"use {' or '.join(options)} (--batch-size, --grad-accum).")
        )
    shards = getattr(strategy, "batch_shards", 1)
    if bs % shards:
        warnings.warn(
            f"batch_size={bs} does not split over the {shards} devices of the batch axis: every step runs the "
            f"whole batch on every device (exact, not parallel). Use a multiple of {shards}.", stacklevel=4)  # the caller of fit
    if n is not None:
        per_epoch = n // bs if config.drop_remainder else math.ceil(n / bs)
    elif feed.steps_per_epoch is None and config.steps is None:
        raise ConfigError(fix(f"task {task.name!r} trains from a pipeline of unknown length, so epochs={config.epochs} "
                              "cannot be counted.", "give the run's length in steps (TrainConfig(steps=...); --steps)."))
    else:
        per_epoch = feed.steps_per_epoch
    total = config.steps if config.steps is not None else config.epochs * per_epoch
    examples = None if per_epoch is None else n if n is not None and not config.drop_remainder else per_epoch * bs
    return _Plan(bs, per_epoch or total, total, config.eval_every or per_epoch or total, examples)


def _check_same_task(ckpt: Checkpointer, task: str) -> None:
    """Another task's checkpoint, named as such before its leaves are compared (which named
    only the first parameter this task lacks)."""
    for step in reversed(ckpt.steps()):
        try:
            meta = ckpt.meta(step)
        except CheckpointError:
            continue  # a damaged step: restore_latest says so and falls back
        then = meta.get("task")
        if then is not None and then != task:
            raise ConfigError(fix(
                f"{ckpt.directory} holds a run of task {then!r} (step {step}, strategy "
                f"{(meta.get('strategy') or {}).get('strategy', '?')!r}); this run trains task {task!r}.",
                f"resume with --task {then} (the task it was written with), or start task {task!r} in another "
                "--checkpoint-dir (CheckpointConfig(directory) from Python)."))
        return


E = TypeVar("E", bound=Exception)


def _with_changed_options(error: CheckpointError, ckpt: Checkpointer, run_info: dict[str, Any] | None) -> CheckpointError:
    """A checkpoint whose leaves do not fit, with the options that made them differ: the leaf
    alone ("has no leaf state.params['DotReluDot_0']['W1']") did not say that --no-scan did it."""
    text = str(error)
    if not run_info or "leaf state" not in text.split("\n")[0] or not ckpt.steps():
        return error
    try:
        saved = ckpt.meta(ckpt.steps()[-1]).get("config") or {}
    except CheckpointError:
        return error
    return _with_options(error, saved, run_info, SHAPE_OPTIONS)


def _with_options(error: E, saved: dict[str, Any] | None, run_info: dict[str, Any] | None,
                  keys: tuple[str, ...]) -> E:
    """``error`` with the options of ``keys`` that differ between the checkpoint's run and this one."""
    changed = differing_options(saved, run_info, keys) if saved and run_info else []
    if not changed:
        return error
    head, sep, rest = str(error).partition("\n  Fix: ")
    return type(error)(f"{head} Options that differ from the checkpoint's run: {', '.join(changed)}.{sep}{rest}")


def _start(strategy: Any, make_state: Callable[..., Any], key: jax.Array, checkpoint: CheckpointConfig | None,
           ckpt: Checkpointer | None, config: TrainConfig, task: Task, log: Callable[[str], None],
           run_info: dict[str, Any] | None = None, total: int | None = None,
           feed: Any = None, eval_crc: str | None = None,
           optimizer: list[list[str]] | None = None) -> tuple[Any, int, dict[str, Any] | None]:
    """The initial state, the steps already done and the restored step's meta: fresh (None), or
    the newest intact checkpoint (with ``feed`` moved to its data position; a refused resume logs
    no resume)."""
    if ckpt is not None and checkpoint.resume:
        _check_same_task(ckpt, task.name)
        target = strategy.abstract(make_state, key, unbox=True)
        try:
            restored = ckpt.restore_latest(target, members=getattr(strategy, "members", None))
        except CheckpointError as e:
            raise _with_changed_options(e, ckpt, run_info) from None
        if restored is not None:
            state, meta = restored
            _check_resumable(meta, config, task.name, run_info, total, getattr(strategy, "bagging", None))
            if feed is not None and int(meta["step"]):  # the data position saved with that state (older: none)
                try:
                    feed.resume(meta.get("data"))
                except ConfigError as e:
                    raise _with_options(e, meta.get("config"), run_info, EXAMPLE_OPTIONS) from None
            _check_same_eval_data(meta, eval_crc)
            _check_same_optimizer(meta, optimizer)
            log(f"checkpoints: resumed from step {int(meta['step'])} in {ckpt.directory}")
            return state, int(meta["step"]), meta
        log(f"checkpoints: nothing to resume in {ckpt.directory}; starting from step 0")
    return strategy.init(make_state, key, unbox=True), 0, None


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
    _check_fit_arguments(task, strategy, optimizer, config, out_dir, checkpoint, log, step_timeout)
    run = _Run(task, strategy, optimizer, config, out_dir, checkpoint, log, run_info, progress, step_timeout)
    step = strategy.step(task_train_step(task, optimizer, config.grad_accum))
    batches = _feed_batches(run.feed, strategy, config, run.start_step, run.plan.total)
    state = run.state
    try:
        with run:  # Ctrl-C and SIGTERM stop at a step boundary; the watchdog; the progress bar
            for i in range(run.start_step, run.plan.total):
                epoch, batch = next(batches)
                run.watchdog.started(i + 1)
                state, aux = _run_step(step, state, batch, i + 1)
                run_hooks(run.hooks, StepInfo(i + 1, epoch, state, to_python(aux)))  # a hook may end the run
        # The steps are over: a Ctrl-C or SIGTERM now waits for the last checkpoint, summary and
        # plot (it cut them short, with a traceback and an exit code that contradicted the
        # summary's status). A second Ctrl-C still stops at once.
        with _StopRequest() as stop, Preemption() as term:
            result = run.finish(step, batches)
        if stop.requested or term.requested:
            log(f"{task.name}: a stop request came while the final files were written; they were finished first")
        return result
    finally:
        if isinstance(batches, Prefetch):
            batches.close()
        run.release()


def _run_step(step: Callable[..., Any], state: Any, batch: Any, number: int) -> tuple[Any, Any]:
    """One step, waited for: queued collective steps deadlock XLA:CPU. A peer process that
    ended fails the step's collective with the runtime's words (a raw JaxRuntimeError or
    ValueError, exit 1): it is a PeerLostError (exit 4), as in a gather. Each device's part is
    waited for on its own (``wait_ready``): with several devices a process, only some fail at
    once, and the others wait for them in gloo past the step watchdog's timeout."""
    def run() -> tuple[Any, Any]:
        new, aux = step(state, batch)
        return wait_ready(new), aux

    return guarded(run, f"ran step {number}")


def _check_fit_arguments(task, strategy, optimizer, config, out_dir, checkpoint, log, step_timeout) -> None:
    """Each of ``fit``'s arguments of the kind it must be, before any work: a name where an
    object belongs (``"data"``, ``"adam"``) would otherwise fail deep inside as an AttributeError."""
    def wrong(argument: str, value: Any, want: str, how: str) -> ConfigError:
        return ConfigError(fix(f"fit({argument}=...) got {type(value).__name__} {reprlib.repr(value)}; it needs {want}.", how))

    for argument, value in (("task", task), ("strategy", strategy), ("optimizer", optimizer), ("config", config)):
        if isinstance(value, type):  # spmdkit.DataParallel for spmdkit.DataParallel(): a raw TypeError deep inside
            raise ConfigError(fix(f"fit({argument}=...) got the class {value.__qualname__}, not an instance of it.",
                                  f"call it: {argument}={value.__module__.split('.')[0]}.{value.__qualname__}(...)."))
    if not isinstance(task, Task):
        raise wrong("task", task, "a spmdkit.Task", "pass spmdkit.get_task('linreg') or spmdkit.Task(name=..., init=..., "
                    "loss_fn=..., train_data=...).")
    if not all(callable(getattr(strategy, m, None)) for m in ("init", "step")):
        raise wrong("strategy", strategy, "a strategy (with init and step)",
                    "pass spmdkit.get_strategy('data') or spmdkit.DataParallel(), spmdkit.Sharded(...), ...")
    if not all(callable(getattr(optimizer, m, None)) for m in ("init", "update")):
        raise wrong("optimizer", optimizer, "an optax GradientTransformation",
                    "pass e.g. optax.adam(1e-3), or spmdkit.OptimizerConfig('adam', lr=1e-3).build().")
    if not isinstance(config, TrainConfig):
        raise wrong("config", config, "a spmdkit.TrainConfig", "pass spmdkit.TrainConfig(steps=100, batch_size=32) "
                    "(a dict d: spmdkit.TrainConfig(**d)).")
    if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
        raise wrong("checkpoint", checkpoint, "a spmdkit.CheckpointConfig or None",
                    "pass checkpoint=spmdkit.CheckpointConfig('runs/ckpt', every=100).")
    if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
        raise wrong("out_dir", out_dir, "a path or None", "pass out_dir='runs/mine'.")
    if not callable(log):
        raise wrong("log", log, "a function of one string", "pass log=print, or log=lambda message: None for silence.")
    if step_timeout is not None and (isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float))
                                     or not step_timeout > 0 or math.isinf(step_timeout)):
        raise wrong("step_timeout", step_timeout, "seconds > 0, or None for no step watchdog",
                    "pass step_timeout=100 (the default), or None.")


def _feed_batches(feed: Any, strategy: Any, config: TrainConfig, start: int, total: int) -> Any:
    """``(epoch, batch)`` from global batch ``start``; ``config.prefetch`` of them read and
    placed ahead by a thread (placement only: the steps stay on this thread, synced)."""
    if config.prefetch and hasattr(feed, "copy_batches"):
        feed.copy_batches = True
    batches = feed.batches(start)
    if config.prefetch and getattr(feed, "one_shot", False):
        # The thread read up to prefetch + 1 batches past the last step from the user's iterator, so
        # a run continued with the same iterator skipped them without a word. Nothing reads past the
        # last step of a one-shot iterator (the final probe skips it too).
        batches = itertools.islice(batches, max(total - start, 0))
    if not config.prefetch:
        return batches
    sharding_for = getattr(strategy, "_batch_sharding_for", None)
    place = None if sharding_for is None else (
        lambda b: to_devices(b, lambda even: sharding_for("step", even), getattr(strategy, "batch_shards", 1)))
    return Prefetch(batches, config.prefetch, place)


class _StopRun(Exception):
    """Raised by a hook to end the run at this step boundary with ``status``."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


class _Each(Hook):
    """``fn(info)`` after every step."""

    def __init__(self, fn: Callable[[StepInfo], None]):
        self.fn, self.every = fn, 1

    def __call__(self, info: StepInfo) -> None:
        self.fn(info)


class _NoWatchdog:
    def started(self, step: int) -> None:
        pass

    def finished(self, step: int) -> None:
        pass

    def progressed(self) -> None:
        pass


class HeldCheckpoints(Hook):
    """fit's checkpoints: every ``every`` steps a save is held in ``known`` until the next
    step's loss, computed from that state, is seen finite (``fit`` then calls ``save``); a
    diverged run so keeps its newest known-good checkpoint. ``close`` saves the last state
    (for a diverged run, the last known-good one) unless a save failed."""

    def __init__(self, ckpt: Checkpointer, every: int, meta: Callable[[StepInfo], dict[str, Any]], known: KnownGood):
        self.ckpt, self.every, self.meta, self.known = ckpt, every, meta, known
        self.saved_at: int | None = None

    def __call__(self, info: StepInfo) -> None:
        self.known.hold(info.step, info.state, self.meta(info))

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        self.ckpt.save(step, state, meta)
        self.saved_at = step

    def close(self, info: StepInfo | None, status: str, failure: BaseException | None = None) -> None:
        # A diverged run's ``info`` is its last known-good state (its loss was seen finite), the one
        # params.npz and summary.json report: saved too, so all three name one step and a resume starts
        # there (it was skipped, leaving the checkpoint up to every-1 steps behind them). A non-finite
        # state is never saved. A run ended by bad data still saves its last good state; a failed save
        # does not retry.
        if not isinstance(failure, CheckpointSaveError) and info is not None \
                and info.step != self.saved_at and state_is_finite(info.state):
            self.save(info.step, info.state, self.meta(info))
        self.ckpt.close()


def _run_settings(task: Task, optimizer: optax.GradientTransformation, config: TrainConfig,
                  checkpoint: CheckpointConfig | None, plan: _Plan) -> dict[str, Any]:
    """What every process of one ``fit`` gives alike besides its data, compared before any step.
    Left out: the checkpoint directory (``Checkpointer.claim`` compares it, resolved) and what is
    each process's own, ``prefetch`` (batches read ahead on its host) and ``step_timeout`` (its
    watchdog's)."""
    import dataclasses

    from flax import nnx

    from spmdkit._strategies._agree import signature_or_error

    with nnx.use_eager_sharding(False):  # as validate_task traces it: annotated NNX variables need no mesh
        state = signature_or_error(lambda: jax.eval_shape(task_state(task, optimizer), jax.random.key(0)), "task.init")
    kept = None if checkpoint is None else {k: v for k, v in dataclasses.asdict(checkpoint).items() if k != "directory"}
    train = {k: v for k, v in dataclasses.asdict(config).items() if k != "prefetch"}
    # The run's length and eval interval as planned: with epochs, from each process's own pipeline.
    length = {"steps": plan.total, "steps_per_epoch": plan.steps_per_epoch, "eval_every": plan.eval_every}
    return {"task": task.name, "TrainConfig": train, "CheckpointConfig": kept, "run": length,
            "optimizer": optimizer_record(optimizer), "state": state}


# The command's flag for each setting fit compares across processes.
_SETTING_FLAGS = {
    **{f"TrainConfig.{k}": f"--{k.replace('_', '-')}" for k in ("steps", "epochs", "batch_size", "seed", "eval_every",
                                                                "eval_batch_size", "log_every", "drop_remainder",
                                                                "grad_accum")},
    "CheckpointConfig.every": "--checkpoint-every", "CheckpointConfig.keep": "--keep",
    "CheckpointConfig.resume": "--resume", "CheckpointConfig.overwrite": "--overwrite-checkpoints",
    "CheckpointConfig": "--checkpoint-dir", "optimizer": "--optimizer, --lr, --momentum and --weight-decay",
    "task": "--task", "state": "--task and model flags", "run.steps": "--steps or --epochs",
    "run.steps_per_epoch": "--data", "run.eval_every": "--eval-every",
}
_SETTING_FIXES = {
    **{name: f"give every process the same {name} (on the command line: the same {flag} in every process)."
       for name, flag in _SETTING_FLAGS.items()},
    "state": "build the same model (task.init) and optimizer in every process (on the command line: the same --task "
             "and model flags in every process).",
    "run.steps_per_epoch": "give every process a pipeline of the same length (its share of every batch), or the "
                           "same arrays (on the command line: the same --data in every process).",
}


def _said_setting(name: str, first: Any, other: Any) -> str | None:
    """How two processes' optimizers or states differ, in words (else both values are shown)."""
    if name == "optimizer" and isinstance(first, list) and isinstance(other, list):
        return "; ".join(changed_constants(first, other))
    return None


class _Run:
    """One run of ``fit``: its start (fresh or resumed), its hooks, and its end (the final
    checkpoint, summary and artifacts). ``with run:`` turns the ways a run ends early
    (NaN, a failed save, Ctrl-C, preemption) into its status."""

    def __init__(self, task, strategy, optimizer, config, out_dir, checkpoint, log, run_info, progress, step_timeout):
        self.entered = time.perf_counter()  # for first_step_in_fit_s: start-up inside fit, imports excluded
        self.task, self.strategy, self.config, self.run_info, self.log = task, strategy, config, run_info, log
        # Read (and a bad SPMDKIT_HOST_ALLOCATOR refused) before any step, not in the summary after the last.
        self.host_memory = host_memory()
        self.feed = open_feed(task.train_data, config.batch_size, config.seed, config.drop_remainder, strategy)
        # Every process draws its rows from its own copy of the arrays: copies that differ mixed silently.
        check_same_data({"task.train_data": task.train_data,
                         **({"task.eval_data": task.eval_data} if task.eval_data is not None else {})},
                        getattr(strategy, "mesh", None), "fit")
        self.plan = _plan(task, strategy, config, self.feed)
        # Every process runs one program step for step: other steps, intervals (also from pipelines of
        # other lengths), a resume in one process only, another model or learning rate each left a
        # process waiting for ever in a collective.
        check_same_settings(lambda: _run_settings(task, optimizer, config, checkpoint, self.plan),
                            getattr(strategy, "mesh", None), "fit", _said_setting, _SETTING_FIXES)
        validate_task(task, config.batch_size, self.feed.example())
        # A pipeline not split per process trained on each example once per process, silently.
        check_distinct_shares(getattr(self.feed, "first_share", None), getattr(strategy, "mesh", None), "fit",
                              "task.train_data", config.batch_size // jax.process_count(), config.batch_size)
        self.out = None if out_dir is None else Path(out_dir)
        # With several processes (jax.distributed) every one trains; process 0 alone writes. A process's
        # own program (a mesh of its own devices: a sweep split between processes) writes its own.
        mesh = getattr(strategy, "mesh", None)
        own = mesh is not None and all(d.process_index == jax.process_index() for d in mesh.devices.flat)
        self.primary = jax.process_index() == 0 or own
        self.out_lock = None
        if self.out is not None and self.primary:
            art.prepare_out_dir(self.out)
            self.out_lock = art.lock_out_dir(self.out, log)
        self.ckpt = None
        try:
            self._begin(optimizer, checkpoint, progress, step_timeout)
        except BaseException:
            # A refused resume or a bad option leaves both directories unlocked.
            if self.ckpt is not None:
                self.ckpt.abandon()
            self.release()
            raise

    def _begin(self, optimizer, checkpoint, progress, step_timeout) -> None:
        task, strategy, config, log = self.task, self.strategy, self.config, self.log
        init_key, _, self.eval_key = jax.random.split(jax.random.key(config.seed), 3)
        self.ckpt = None if checkpoint is None else Checkpointer(checkpoint, log=log).claim()
        # The eval arrays' CRC-32, read once: a resume compares it, every checkpoint records it.
        self.eval_crc = arrays_digest(task.eval_data) if checkpoint is not None else None
        self.optimizer_record = optimizer_record(optimizer) if checkpoint is not None else None
        self.state, self.start_step, resumed = _start(strategy, task_state(task, optimizer), init_key, checkpoint,
                                                      self.ckpt, config, task, log, self.run_info, self.plan.total,
                                                      self.feed, self.eval_crc, self.optimizer_record)
        if self.ckpt is not None:
            check_savable(self.state, "fit(checkpoint=...) saves the whole train state", in_fit=True,
                          name_max=self.ckpt.name_max)
        self.run_id = self._claim_out(resumed)  # after every check: a refused start leaves --out as it was
        self.last = StepInfo(self.start_step, 0, self.state, {})
        self.status, self.failure, self.t_first, self.first_step_s = "completed", None, None, None
        self.known = KnownGood(self.state, self.start_step)  # checkpoints wait until their state's loss is seen finite
        # A resumed run keeps the history up to its checkpoint and drops what came after.
        self.history = _previous_history(self.out, self.start_step) if self.start_step else []
        self.writer = art.MetricsWriter(None if self.out is None or not self.primary else self.out / "metrics.jsonl",
                                        kept=self.history)
        self.bar = ProgressHook(self.plan.total, f"{task.name} / {strategy.name}", start=self.start_step) \
            if progress and self.primary else None
        if progress and self.primary:
            _hint_host_memory(self.host_memory, log)
        self.watchdog = StepWatchdog(step_timeout, knob="--distributed-timeout (fit(step_timeout=...) from Python)") \
            if step_timeout and jax.process_count() > 1 else _NoWatchdog()
        self.hooks = self._hooks(checkpoint)

    def _claim_out(self, resumed: dict[str, Any] | None) -> str:
        """This run's id, ``--out`` made its own: a resume into an ``--out`` of another run is
        refused (it took that run's rows and summary for its own, or, at its last step, handed
        back that run's results). Process 0 decides and writes, and every process of its program
        ends with its verdict."""
        # The id later checkpoints carry (the checkpoint directory's, agreed by every process);
        # without checkpoints a run cannot be resumed, and only process 0 writes --out.
        run_id = self.ckpt.run_id if self.ckpt is not None else art.new_run_id()
        verdict = None
        if self.out is not None and self.primary:
            verdict = self._out_verdict(run_id, (resumed or {}).get("run_id") or run_id)
        mesh = getattr(self.strategy, "mesh", None)
        if mesh is not None and spans_processes(mesh):  # a process's own program decides alone
            verdict = gather_json(verdict, "--out's verdict on this run")[0]
        if verdict is not None:
            raise (art.ArtifactError if verdict[0] == "io" else ConfigError)(verdict[1])
        return run_id

    def _out_verdict(self, run_id: str, resumed_id: str) -> list[str] | None:
        """None once ``--out`` is this run's, else ``[kind, message]`` of why it cannot be. A resume
        is checked against the id its restored step was saved with (the checkpoint directory may
        have been copied without its owner file, which gives it a new id from here on)."""
        try:
            if self.start_step:
                problem = art.other_run(self.out, (resumed_id, run_id), self.ckpt.directory)
                if problem is not None:
                    return ["config", problem]
            art.claim_out_dir(self.out, run_id, not self.start_step, self.log)
        except art.ArtifactError as e:
            return ["io", str(e)]
        except ConfigError as e:
            return ["config", str(e)]
        return None

    def release(self) -> None:
        """Unlock ``--out`` (the checkpoint directory is unlocked by its own close or abandon)."""
        if self.out_lock is not None:
            self.out_lock.release()

    def _hooks(self, checkpoint: CheckpointConfig | None) -> list[Hook]:
        """In order: the NaN guard, the step's bookkeeping, metrics, checkpoints, eval, progress, stops.
        Metrics before checkpoints: a checkpoint's meta records the metrics window after its step."""
        hint = ("lower the learning rate (optimizer=; --lr on the command line), or check the data for NaN/inf. "
                "The parameters of the last finite loss are kept" + (f" in {self.out / 'params.npz'}." if self.out else "."))
        self.metrics = MetricsHook(self._record, every=self.config.log_every)
        # A resume that trains no further step (its files to be written anew) reports the loss logged at its step.
        self.metrics.last_row = next((r for r in reversed(self.history) if r.get("split") == "train"
                                      and r.get("step") == self.start_step), None)
        self._resume_metrics()
        self.evaluator = _eval_hook(self.task, self.strategy, self.config, self.plan, self._record, self.eval_key,
                                    self.watchdog.progressed)
        self.held = None if self.ckpt is None else HeldCheckpoints(
            self.ckpt, checkpoint.every,
            _checkpoint_meta(self.task, self.strategy, self.config, self.plan, self.run_info, self.feed, self.eval_crc,
                             self.optimizer_record, self._window_at),
            self.known)
        optional = [_Each(self._stepped), self.metrics, self.held, self.evaluator, self.bar]  # run_hooks: metrics.add every step
        self.guard = NaNGuard(hint=hint)
        return [self.guard, *[h for h in optional if h is not None], _Each(self._at_end)]

    def _resume_metrics(self) -> None:
        """A resumed run's rows go on as an uninterrupted run's: the next row's means include the
        steps before the checkpoint since its last row (the window the checkpoint's meta keeps), and
        ``elapsed_s`` goes on from the checkpoint's (else the kept history's last), not from 0."""
        window = None
        if self.start_step and self.ckpt is not None:
            try:
                window = self.ckpt.meta(self.start_step).get("metrics")
            except CheckpointError:
                pass  # restored a moment ago; a window is a nicety, the run goes on without it
        kept = next((r["elapsed_s"] for r in reversed(self.history)
                     if isinstance(r.get("elapsed_s"), (int, float))), None)
        self.metrics.resume(window, kept)
        self.known_window = (self.start_step, 0, self.metrics.snapshot())
        self.steps_run = 0

    def _window_at(self, step: int) -> dict[str, Any]:
        """The metrics window after ``step``: a diverged run's kept step is behind the steps counted."""
        return self.metrics.window(self.known_window[2] if step == self.known_window[0] else None)

    def _flush_metrics(self, done: int) -> None:
        """A run that ends between rows (interrupted, preempted, diverged, failed) writes the steps
        since its last row as a row at the step it keeps, so that the summary's final train loss is
        of that step. A diverged run's window is the one at its last good step: the steps after it
        are not of the state it keeps (a row written past it already is left as it is)."""
        if self.status == "completed" or done <= self.start_step:
            return  # the last step logged already (_at_end); or this process trained nothing
        if self.status == "diverged":
            step, epoch, snapshot = self.known_window
            if step == done:
                self.metrics.flush(StepInfo(done, epoch, None, {}), self.metrics.window(snapshot))
            return
        self.metrics.flush(StepInfo(done, self.last.epoch, None, {}))

    def _record(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        self.writer.write(row)
        if self.bar is not None and row["split"] == "train":
            self.bar.show(row)

    def _stepped(self, info: StepInfo) -> None:
        due = self.known.confirm(self.last.state, self.last.step)  # this step's loss came from it: good
        # The metrics window after the known-good step: a diverged run's checkpoint and last row need it.
        self.known_window = (self.last.step, self.last.epoch, self.metrics.snapshot())
        self.steps_run += 1
        if due is not None:
            self.held.save(*due)
        self.last = info
        self.watchdog.finished(info.step)
        if self.t_first is None:  # excludes compilation from steps/s
            self.t_first, self.first_step_s = time.perf_counter(), process_age_s()  # start-up cost

    def _at_end(self, info: StepInfo) -> None:
        """The last step always logs and evaluates; a stop request ends the run here."""
        if info.step == self.plan.total:
            # The steps since the last row stay counted: the final checkpoint's meta keeps them, so a
            # run resumed with more steps writes its next row as an uninterrupted run does.
            self.metrics.flush(info)
            if self.evaluator is not None and info.step % self.evaluator.every:
                self.evaluator(info)
        if self._stop.requested and jax.process_count() == 1:
            raise _StopRun("interrupted")
        if self._preempt.reached(info.step):  # with several processes a Ctrl-C arrives this way too
            raise _StopRun("preempted")

    def __enter__(self) -> _Run:
        self._stop, self._preempt = _StopRequest(self.log), Preemption()
        self._contexts = [c for c in (self._stop, self._preempt, self.bar, self.watchdog) if hasattr(c, "__enter__")]
        for c in self._contexts:
            c.__enter__()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, kind, error, tb) -> bool:
        for c in reversed(self._contexts):
            c.__exit__(None, None, None)
        self.elapsed = time.perf_counter() - self.t0
        if isinstance(error, NonFiniteLossError):
            # The loss of step k comes from the state after k - 1 updates: keep the one before.
            self.status, self.failure = "diverged", error
            self.last = StepInfo(self.known.step, 0, self.known.state, {})
            self.known.drop()
        elif isinstance(error, (CheckpointSaveError, DataError, art.ArtifactError)):
            # Bad data, or metrics.jsonl refused (a full disk, ulimit -f): the last state is still
            # saved and the other files attempted, as after a failed checkpoint save.
            self.status, self.failure = "failed", error
        elif isinstance(error, (KeyboardInterrupt, _StopRun)):
            self.status = getattr(error, "status", "interrupted")
        elif isinstance(error, PeerLostError):
            self._write_lost_peer(error)
        return error is None or self.status != "completed"

    def _write_lost_peer(self, error: PeerLostError) -> None:
        """With a peer process gone no collective runs, so the state cannot be gathered or
        saved: the survivor that writes (process 0) writes what it holds alone, the summary
        and the plot, so that ``--out`` says how the run ended and where to resume from."""
        if self.out is None or not self.primary:
            return
        self.writer.close()
        last = {k: v for k, v in (self.metrics.last_row or {}).items() if k not in ("split", "step", "epoch")}
        summary = {"task": self.task.name, "run_id": self.run_id, "status": "failed", "error": str(error).splitlines()[0],
                   **self.strategy.describe(), "steps": self.last.step, "steps_planned": self.plan.total,
                   "final_train_loss": last.get("loss"), "params_written": False,
                   **({"checkpoint_dir": str(self.ckpt.directory), "checkpoint_steps": self.ckpt.steps()}
                      if self.ckpt is not None else {}),
                   **({"config": self.run_info} if self.run_info else {})}
        errors: list[OSError] = []
        _attempt(errors, art.record_written, self.out, self.run_id, ["summary.json"] + (["loss.png"] if self.history else []))
        _attempt(errors, art.write_json, self.out / "summary.json", summary)
        if self.history:
            _attempt(errors, art.plot_history, self.history, self.out / "loss.png", _plot_title(self.task, summary))
        if errors:
            self.log(f"{self.task.name}: {str(errors[0]).splitlines()[0].rstrip('.')} (a peer process was lost; "
                     "its error follows)")

    def _write_out(self, params: Any, state: Any, summary: dict[str, Any]) -> None:
        """``--out``'s files. When the run has already failed (a checkpoint save on a full disk,
        which is often --out's disk too), a failure to write them is said in one line and the
        run's own error is the one raised: it names the steps that are intact."""
        saved = params if state.model_state is None else {"params": params, "model_state": to_host(state.model_state)}
        try:
            _write_artifacts(self.out, saved, summary, self.history, self.task)
        except OSError as e:
            if self.failure is None:
                raise
            self.log(f"{self.task.name}: {str(e).splitlines()[0].rstrip('.')} (the run had already failed; its error follows)")

    def finish(self, step: Callable[..., Any], batches: Iterator[Any]) -> FitResult:
        """Confirm the last state, evaluate an interrupted run, save the last state, write the
        summary and artifacts."""
        self._confirm_final(step, batches)
        done, state = self.last.step, self.last.state
        if self.status == "preempted" and self.ckpt is None:
            self.log(f"{self.task.name}: preempted at step {done} with no checkpoint directory: nothing is saved to "
                     "resume from, so a restart begins at step 0 (pass --checkpoint-dir; CheckpointConfig from Python)")
        final = StepInfo(done, 0, state, {})
        self._flush_metrics(done)
        if self.status == "interrupted" and self.evaluator is not None and done and self.evaluator.last_step != done:
            self.evaluator(final)  # so an interrupted run still reports where it got
        self.writer.close()
        if self.held is not None:
            try:
                self.held.close(final if done > self.start_step else None, self.status, self.failure)
            except CheckpointSaveError as e:
                self.status, self.failure = "failed", self.failure or e
                self.ckpt.abandon()
        params = to_host(state.params)
        kept = self._already_complete()
        if kept is not None:
            return FitResult(state, params, kept, self.history)
        if self.status == "preempted" and self._stop.requested:
            # Several processes stopped together for this one's Ctrl-C (see _StopRequest); the
            # collective work is done, so this one now reports the interrupt (exit code 130).
            self.status = "interrupted"
        summary = self._summary(params)
        if self.out is not None and self.primary:
            self._write_out(params, state, summary)
        release_host_memory()  # the run's temporaries are free: a sweep of fits keeps no run's peak
        if self.failure is not None:
            raise self.failure
        return FitResult(state, params, summary, self.history)

    def _already_complete(self) -> dict[str, Any] | None:
        """A resumed run whose checkpoint is at its last step trains nothing: the summary and
        artifacts it wrote when it completed are kept (they were overwritten with a summary of
        no steps: no final loss, no speed)."""
        if not (self.start_step and self.start_step == self.plan.total and self.status == "completed"):
            return None
        try:
            previous = json.loads((self.out / "summary.json").read_text()) if self.out is not None else None
        except (OSError, ValueError):
            previous = None
        if not isinstance(previous, dict) or previous.get("steps") != self.start_step \
                or previous.get("status") != "completed" or previous.get("run_id") not in (None, self.run_id) \
                or not (self.out / "params.npz").is_file():
            # Another --out, or one whose files were not all written (a kill before the summary, which
            # is written last; a params.npz the disk refused): written anew from the checkpoint.
            return None
        self.log(f"{self.task.name}: already complete at step {self.start_step}; nothing to train, "
                 f"{self.out} is left as it was")
        return previous

    def _confirm_final(self, step: Callable[..., Any], batches: Iterator[Any]) -> None:
        """The last state is kept (saved, written) only if known good, like every checkpoint: the
        loss the next step would compute from it is finite. Otherwise the run diverged at its end
        and the newest known-good state is kept instead."""
        # Every process probes or none does (a probe is a collective step): an interrupt is per process.
        agreed = ("completed", "preempted") + (("interrupted",) if jax.process_count() == 1 else ())
        # A one-shot iterator of the user's is not read past the run's last batch.
        if self.status not in agreed or self.last.step <= self.start_step or (self.ckpt is None and self.out is None) \
                or getattr(self.feed, "one_shot", False):
            return
        try:
            epoch, host_batch = next(batches)
        except (StopIteration, DataError):  # a pipeline that ends with the run: only the leaves can be checked
            return
        probe = step(self.last.state, host_batch)
        jax.block_until_ready(probe)  # queued collective steps deadlock XLA:CPU
        try:
            self.guard(StepInfo(self.last.step + 1, epoch, self.last.state, to_python(probe[1])))
        except NonFiniteLossError as e:
            self.status, self.failure = "diverged", e
            self.last = StepInfo(self.known.step, 0, self.known.state, {})
            return
        self.known.confirm(self.last.state, self.last.step)

    def _summary(self, params: Any) -> dict[str, Any]:
        eval_seconds = self.evaluator.seconds if self.evaluator is not None else 0.0
        train_seconds = None if self.t_first is None else time.perf_counter() - self.t_first - eval_seconds
        summary = _summary(self.task, self.strategy, self.config, self.plan, self.status, self.last.step, self.start_step,
                           self.history, self.steps_run, params, self.elapsed, train_seconds, self.ckpt,
                           self.run_info, self.host_memory)
        summary["run_id"] = self.run_id
        summary["first_step_s"] = None if self.first_step_s is None else round(self.first_step_s, 3)
        summary["first_step_in_fit_s"] = None if self.t_first is None else round(self.t_first - self.entered, 3)
        if self.failure is not None:
            summary["error"] = str(self.failure).splitlines()[0]
        return summary


_hinted = False


def _hint_host_memory(status: HostMemory, log: Callable[[str], None]) -> None:
    """A CPU run on glibc's malloc defaults faults its temporaries in at every step: say how not
    to, once per process (a sweep of fits needs it once)."""
    global _hinted
    if not _hinted and jax.default_backend() == "cpu" and status.why == DEFAULTS_WHY:
        _hinted = True
        log("note: each CPU step takes its temporary buffers from the kernel anew (glibc's malloc defaults); "
            "call spmdkit.reuse_host_memory() first thing, before any JAX operation, to reuse them (the "
            "spmdkit command does; up to 1.4x the steps/s for more resident host memory, README 'Host memory "
            "on CPU'), or set SPMDKIT_HOST_ALLOCATOR=system to keep the defaults without this note.")


def _eval_hook(task, strategy, config, plan, record, eval_key, on_chunk=None) -> EvalHook | None:
    """Eval over the task's whole eval set every ``plan.eval_every`` steps (none without eval data)."""
    if task.eval_data is None:
        return None
    eval_step = strategy.evaluate(task_eval_step(task, eval_key))
    ensemble = task.predictor is not None and isinstance(strategy, Ensemble)
    predict = strategy.apply(lambda s, b: task.predictor.predict(s.params, b)) if ensemble else None

    def run_eval(state):
        return evaluate_task(state, task.eval_data, config.eval_batch_size, eval_step, predict, task.predictor,
                             strategy=strategy, on_chunk=on_chunk)

    return EvalHook(run_eval, record, every=plan.eval_every)


def _checkpoint_meta(task, strategy, config, plan, run_info, feed=None, eval_crc=None,
                     optimizer=None, window=None) -> Callable[[StepInfo], dict[str, Any]]:
    """What a checkpoint records of the run, to resume it exactly (see ``_check_resumable``)."""

    def meta(info: StepInfo) -> dict[str, Any]:
        return {"task": task.name, "seed": config.seed, "batch_size": config.batch_size,
                "drop_remainder": config.drop_remainder, "grad_accum": config.grad_accum,
                "epoch": info.epoch if info.metrics else None if plan.epoch_examples is None
                else info.step // plan.steps_per_epoch,
                "strategy": strategy.describe(), "config": run_info or {},
                "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **({"data": feed.state(info.step)} if feed is not None else {}),
                **({"eval_data": {"crc32": eval_crc}} if eval_crc is not None else {}),
                **({"optimizer": optimizer} if optimizer is not None else {}),
                # The metrics since the last row: a resume's next row is then an uninterrupted run's.
                **({"metrics": window(info.step)} if window is not None else {})}

    return meta


def _check_same_eval_data(meta: dict[str, Any], now: str | None) -> None:
    """Held-out data edited between runs: the resumed run trains as before, but its eval
    figures are over other examples than the ones logged before the resume."""
    then = (meta.get("eval_data") or {}).get("crc32")
    if then is not None and now is not None and now != then:
        warnings.warn(
            f"the checkpoint at step {meta.get('step')} was written evaluating on other data: the eval set's bytes "
            f"differ (CRC-32 {then} then, {now} now; the held-out file of --text-dir edited, another --eval-data). "
            "Training resumes as it was; eval figures from here on are not comparable with those logged before. "
            "To keep them comparable, resume with the eval data the run started with.", RuntimeWarning, stacklevel=4)


def _check_same_optimizer(meta: dict[str, Any], now: list[list[str]] | None) -> None:
    """Another optimizer given to a resumed ``fit`` (``optax.adam(1e-2)`` for the run's ``1e-3``):
    the command line compares its --lr and --optimizer; from Python the optimizer's constants
    are compared (``_optimizer_record``). A warning: a new learning rate is also set on purpose."""
    then = meta.get("optimizer")
    if not now or not isinstance(then, list) or not all(isinstance(e, list) and len(e) == 2 for e in then):
        return  # a checkpoint of an older spmdkit, or a run without the record
    changed = changed_constants(then, now)
    if changed:
        lr = (" (optax keeps a constant learning rate as scale(step_size=-learning_rate))"
              if any("(in scale)" in c for c in changed) else "")
        warnings.warn(
            f"the checkpoint at step {meta.get('step')} was written by a run with another optimizer: "
            f"{'; '.join(changed)}{lr}. Training resumes with the optimizer given now, from the restored optimizer "
            "state. If that is not meant, pass fit the optimizer the run started with.", RuntimeWarning, stacklevel=4)


def _summary(task, strategy, config, plan, status, done, start_step, history, ran, params, elapsed,
             train_seconds, ckpt, run_info, host: HostMemory) -> dict[str, Any]:
    """``ran``: the steps this process ran (a resumed run's, after its checkpoint), timed from the
    end of the first. The train and eval figures are the last rows at or before ``done``, the step
    whose parameters it reports (a diverged run logged rows past it, of states it does not keep)."""
    last_train = _last_row(history, "train", done)
    last_train = {k: v for k, v in (last_train or {}).items() if k not in ("split", "step", "epoch", "steps_per_sec", "elapsed_s")}
    eval_row = _last_row(history, "eval", done)
    return {
        "task": task.name,
        "status": status,
        **strategy.describe(),
        "steps": done,
        "steps_planned": plan.total,
        "epochs": plan.epochs(done),  # None for a pipeline of unknown length: no epoch to count in
        "examples_seen": plan.examples(done),
        "batches_seen": done,
        "batch_size": plan.batch_size,
        "seed": config.seed,
        "final_train_loss": last_train.get("loss"),
        "final_train_metrics": last_train,
        "eval_loss": None if eval_row is None else eval_row["loss"],
        **({f"eval_{k}": v for k, v in eval_row.items() if k not in ("split", "step", "loss")} if eval_row else {}),
        "wall_time_s": elapsed,
        "steps_per_sec": (ran - 1) / train_seconds if train_seconds and ran > 1 else None,
        "host_memory": str(host),  # glibc's defaults slow CPU steps: say which this run had
        "params_digest": art.params_digest(params),
        **({"resumed_from_step": start_step, "checkpoint_dir": str(ckpt.directory), "checkpoint_steps": ckpt.steps(),
            "checkpoint_blocked_s": ckpt.blocked} if ckpt is not None else {}),
        "param_count": art.param_count(params),
        **_task_report(task, strategy, params),
        **(strategy.summarize(eval_row or {}) if isinstance(strategy, Ensemble) else {}),
        **({"config": run_info} if run_info else {}),
    }


def _last_row(history: list[dict[str, Any]], split: str, upto: int) -> dict[str, Any] | None:
    return next((r for r in reversed(history) if r.get("split") == split and r.get("step", 0) <= upto), None)


def _write_artifacts(out: Path, params: Any, summary: dict[str, Any], history: list[dict[str, Any]], task: Task) -> None:
    """Every file is attempted, the first failure raised after them: params.npz, the large one, is
    what a small ``ulimit -f`` or a nearly full disk refuses, and stopping there lost the small
    summary.json that says how the run went. summary.json goes last, so that it can say a file
    failed, and so that a completed summary of the last step vouches for the files before it: a
    resume of a complete run keeps ``--out`` as it is only then (a run killed between the summary
    and the plot left no loss.png, or an interrupted run's, for good)."""
    errors: list[OSError] = []
    members = any("member_accuracy" in r for r in history)
    # Recorded first as this run's: what a fresh run after it removes (never a user's other files).
    written = ["params.npz", "summary.json"] + (["loss.png"] if history else []) + (["ensemble.png"] if members else [])
    _attempt(errors, art.record_written, out, summary["run_id"], written)
    _attempt(errors, art.save_params, out / "params.npz", params)
    bug = None
    try:
        if history:
            title = _plot_title(task, summary)
            _attempt(errors, art.plot_history, history, out / "loss.png", title)
            if members:
                _attempt(errors, art.plot_members, history, out / "ensemble.png", title)
    except Exception as e:  # a plot's bug: the summary of the run is still written, then it is raised
        bug = e
    if errors and "error" not in summary:  # a run that had failed already keeps its own error
        summary["status"], summary["error"] = "failed", str(errors[0]).splitlines()[0]
    _attempt(errors, art.write_json, out / "summary.json", summary)
    if bug is not None:
        raise bug
    if errors:
        raise errors[0]


def _plot_title(task: Task, summary: dict[str, Any]) -> str:
    return f"{task.name}, {summary['strategy']}, {summary['device_count']} device(s)"


def _attempt(errors: list[OSError], write: Callable[..., None], *args: Any) -> None:
    try:
        write(*args)
    except OSError as e:
        errors.append(e)
