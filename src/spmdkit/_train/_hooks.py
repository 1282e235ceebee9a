"""Small pieces that run every N steps around ``strategy.step``: the parts of ``fit``.

Each hook is a callable ``hook(info)`` with an ``every`` (``run_hooks`` calls it when
``info.step % every == 0``; a plain function, with none, after every step) and a
``close(info, status)`` for the end of a run. They
work alone around a user's own loop:

    >>> import jax, jax.numpy as jnp, numpy as np, spmdkit
    >>> from spmdkit import NaNGuard, MetricsHook, StepInfo, run_hooks
    >>> strategy = spmdkit.Single()
    >>> def train_step(state, batch):
    ...     loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] * w - 1) ** 2))(state["w"])
    ...     return {"w": state["w"] - 0.1 * g}, {"loss": loss}
    >>> state, step = strategy.init(lambda rng: {"w": jnp.zeros(())}, 0), strategy.step(train_step)
    >>> rows = []
    >>> hooks = [NaNGuard(), MetricsHook(rows.append, every=5)]
    >>> for i in range(10):
    ...     state, aux = step(state, {"x": np.ones(8, np.float32)})
    ...     run_hooks(hooks, StepInfo(i + 1, 0, state, aux))  # device values are fine
    >>> [row["step"] for row in rows]
    [5, 10]
"""

from __future__ import annotations

import math
import reprlib
import warnings
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from spmdkit._console import finite_or_null
from spmdkit._errors import ConfigError, NonFiniteLossError, fix


class StepInfo(NamedTuple):
    """What a hook sees after a step: steps done, the epoch, the state, the step's metrics."""

    step: int
    epoch: int
    state: Any
    metrics: dict[str, Any]


# The fields a metrics row has besides the metrics. A metric of the same name overwrote
# them: a metric "step" renumbered every row, one named "split" hid the eval rows from the
# summary and the plot, with no error.
ROW_FIELDS = ("split", "step", "epoch", "steps_per_sec", "elapsed_s")


def check_metric_names(names: Iterable[str], where: str) -> None:
    """Refuse metric names that a row's own fields (``ROW_FIELDS``) would collide with."""
    clash = sorted(set(names) & set(ROW_FIELDS))
    if clash:
        raise ConfigError(fix(
            f"{where}: metric(s) {clash} have the name of a field of every metrics row ({', '.join(ROW_FIELDS)}); "
            "one of the two values would be lost.",
            f"rename the metric, e.g. {clash[0]!r} -> 'my_{clash[0]}'."))


def to_python(values: dict[str, Any]) -> dict[str, Any]:
    """Scalars to float, per-member arrays to lists: what JSON lines and plots take."""
    out = {}
    for k, v in jax.device_get(values).items():
        a = np.asarray(v, np.float64)
        out[k] = float(a) if a.ndim == 0 else a.tolist()
    return out


def flat_metrics(metrics: Mapping[str, Any], prefix: str = "", who: str = "MetricsHook") -> dict[str, np.ndarray]:
    """Metrics as float64 arrays; a nested dict's entries as ``outer/inner`` (a step's aux
    may group them: ``{"grad_norm": {"w": ..., "b": ...}}``). A value that is not a number is
    named (numpy's own error named neither the metric nor the fix)."""
    out: dict[str, np.ndarray] = {}
    for k, v in metrics.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat_metrics(v, f"{name}/", who))
            continue
        try:
            out[name] = np.asarray(jax.device_get(v), np.float64)
        except (TypeError, ValueError) as e:
            raise ConfigError(fix(f"{who}: metric {name!r} is {type(v).__name__} {reprlib.repr(v)}, not a number "
                                  f"or an array of numbers ({e}).", f"leave {name!r} out of the metrics, or log it "
                                  "yourself.")) from None
    return out


def with_member_means(values: dict[str, Any]) -> dict[str, Any]:
    """Per-member lists (ensembles) as their mean, the list kept as ``member_<name>``."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, list) and not k.startswith(("member_", "ensemble_")):
            out[k] = float(np.mean(v))
            out[f"member_{k}"] = v
        else:
            out[k] = v
    return out


def run_hooks(hooks: Iterable[Any], info: StepInfo) -> None:
    """Run ``hooks`` after a step of a loop of your own, as ``fit`` runs them after each of its.

    Each hook runs when ``info.step`` is a multiple of its ``every`` (1 for a plain function of
    ``info``); a :class:`Hook` also sees every step through its ``observe`` (a ``MetricsHook``
    averages its rows over them). In the list's order: a ``NaNGuard`` first stops a NaN step
    before any other hook sees it.

    Example:
        >>> import spmdkit
        >>> seen = []
        >>> for step in range(1, 5):
        ...     spmdkit.run_hooks([lambda info: seen.append(info.step)],
        ...                       spmdkit.StepInfo(step, 0, None, {"loss": 1.0 / step}))
        >>> seen
        [1, 2, 3, 4]
    """
    if callable(hooks) or not isinstance(hooks, Iterable):
        raise ConfigError(fix(f"run_hooks({hooks!r:.60}, ...): needs a list of hooks.", "pass run_hooks([hook], info)."))
    if not isinstance(info, StepInfo):
        raise ConfigError(fix(f"run_hooks(..., info={info!r:.60}): needs a spmdkit.StepInfo.",
                              "pass spmdkit.StepInfo(step, epoch, state, metrics)."))
    _check_info(info)
    for i, hook in enumerate(hooks):
        # A plain function of info is a hook that runs after every step.
        every = check_every(getattr(hook, "every", 1), f"run_hooks: hooks[{i}] is {type(hook).__name__}")
        if isinstance(hook, Hook):  # every step, in the list's order: a NaNGuard before it stops a NaN step first
            hook.observe(info)
        if info.step % every == 0:
            hook(info)


def _check_info(info: StepInfo) -> None:
    """The step a whole number and the metrics a dict: a step's bare loss or an aux tuple as
    ``metrics`` failed inside the first hook (AttributeError: no attribute 'get'), and a step of
    None as a bare TypeError of ``%``."""
    if isinstance(info.step, (bool, np.bool_)) or not isinstance(info.step, (int, np.integer)) or info.step < 0:
        raise ConfigError(fix(f"run_hooks: StepInfo.step={info.step!r} must be the steps done, a whole number >= 0.",
                              "pass StepInfo(i + 1, epoch, state, metrics) after the loop's i-th step."))
    if not isinstance(info.metrics, Mapping):
        raise ConfigError(fix(f"run_hooks: StepInfo.metrics is {type(info.metrics).__name__} "
                              f"{reprlib.repr(info.metrics)}; it must be a dict of metric name -> value.",
                              "pass the step's metrics as a dict, e.g. StepInfo(step, epoch, state, {'loss': loss})."))


def check_every(every: Any, where: str) -> int:
    """``every`` as a whole number of steps >= 1: 0 raised a bare ZeroDivisionError at the
    first step, and -2 or 2.5 were taken (``step % every``) and ran at other steps than asked."""
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise ConfigError(fix(f"{where}(every={every!r}): every must be a whole number of steps >= 1.",
                              "e.g. every=10 (every=1: after each step)."))
    return int(every)


class Hook:
    """Base: runs every ``every`` steps; nothing to do at the end."""

    every: int = 1

    def __call__(self, info: StepInfo) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def observe(self, info: StepInfo) -> None:
        """Called by ``run_hooks`` after every step, before ``__call__`` when that is due: what a
        hook that runs every N steps needs of the steps between (``MetricsHook``'s window means)."""

    def close(self, info: StepInfo | None, status: str) -> None:
        pass


class NaNGuard(Hook):
    """Raises :class:`NonFiniteLossError` when the loss is NaN or inf (``hint``: the fix)."""

    def __init__(self, every: int = 1, key: str = "loss", hint: str = "lower the learning rate, or check the data for NaN/inf."):
        self.every, self.key, self.hint = check_every(every, "NaNGuard"), key, hint
        self.last: tuple[int, float] | None = None
        self._warned = False

    def __call__(self, info: StepInfo) -> None:
        value = info.metrics.get(self.key)
        if value is None and info.metrics and not self._warned:
            self._warned = True  # a misspelt key would check nothing, silently
            warnings.warn(f"NaNGuard(key={self.key!r}): the step's metrics have no {self.key!r} (they have "
                          f"{sorted(info.metrics)}), so nothing is checked. Fix: pass key= one of those.",
                          RuntimeWarning, stacklevel=2)
        if value is not None and not isinstance(value, (int, float)):
            # An ensemble's per-member losses (a list, a numpy or JAX array): all must be finite.
            values = np.asarray(jax.device_get(value), dtype=np.float64).ravel()
            value = float(values.mean()) if np.isfinite(values).all() else values.tolist()
            value = value[0] if isinstance(value, list) and len(value) == 1 else value
        finite = value is not None and not isinstance(value, list) and math.isfinite(value)
        if value is None or finite:
            if finite:
                self.last = (info.step, value)
            return
        before = "no finite loss before it" if self.last is None else f"the last finite loss was {self.last[1]:.6g} at step {self.last[0]}"
        raise NonFiniteLossError(
            fix(f"the training {self.key} became {value} at step {info.step} (epoch {info.epoch + 1}); {before}.", self.hint),
            step=info.step,
            loss=value if not isinstance(value, list) else float("nan"),
        )


class MetricsHook(Hook):
    """Every ``every`` steps, one row with the mean of each metric over the steps since the last
    row that gave it, ``steps_per_sec`` and ``elapsed_s``, handed to ``record`` (a list's append,
    a writer). ``run_hooks`` counts every step toward the next row (:meth:`add`)."""

    def __init__(self, record: Callable[[dict[str, Any]], None], every: int = 1):
        if not callable(record):
            raise ConfigError(fix(f"MetricsHook({type(record).__name__}): record must be a function of one row.",
                                  "pass a list's append: MetricsHook(rows.append)."))
        self.record, self.every = record, check_every(every, "MetricsHook")
        self._sums: dict[str, Any] = {}
        self._counts: dict[str, int] = {}
        self._count = 0
        self._added: int | None = None  # the step last counted: counting it again (add, then run_hooks) is a no-op
        self._start = self._t0 = time.perf_counter()
        self._before = 0.0  # elapsed_s of the steps before this hook's first (a resumed run's, see resume)
        self._warned_back, self._written_again = False, None  # see _went_back
        self.last_row: dict[str, Any] | None = None

    def add(self, info: StepInfo) -> None:
        """Count a step toward the next row; ``run_hooks`` calls this after every step, and a
        step already counted is not counted again."""
        if info.step != self._added:
            self._count_step(info)

    def observe(self, info: StepInfo) -> None:
        # A step counted already by add() is not a step given again; one whose row is written is.
        again = info.step == self._added and not self._count and self.last_row is not None \
            and self.last_row["step"] == info.step
        if self._added is not None and (info.step < self._added or again):
            self._went_back(info.step)
        self.add(info)

    def _went_back(self, step: int) -> None:
        """A loop that gives a step again (a retry) or goes back (a restart): said once, and a
        step given again through run_hooks writes no second row of itself (it repeated the row's
        metrics, as if it had run twice)."""
        if not self._warned_back:
            self._warned_back = True
            said = "was given again" if step == self._added else f"came after step {self._added}"
            warnings.warn(f"MetricsHook: step {step} {said}: the rows follow the steps "
                          "as given, so they repeat steps (a loop that retries or restarts its steps). Give each "
                          "step its own number (a restarted loop: a new MetricsHook).", RuntimeWarning, stacklevel=4)
        if step == self._added and self.last_row is not None and self.last_row["step"] == step:
            self._written_again = step

    def _count_step(self, info: StepInfo) -> None:
        for k, v in flat_metrics(info.metrics).items():
            if k in self._sums and np.shape(self._sums[k]) != np.shape(v):  # numpy's broadcast error named neither
                raise ConfigError(fix(f"MetricsHook: metric {k!r} has shape {np.shape(v)} at step {info.step}, "
                                      f"where earlier steps since the last row gave {np.shape(self._sums[k])}: "
                                      "a row holds each metric's mean over those steps.",
                                      f"give {k!r} one shape at every step, or log it yourself."))
            self._sums[k] = self._sums.get(k, 0.0) + v
            self._counts[k] = self._counts.get(k, 0) + 1
        self._count += 1
        self._added = info.step

    def __call__(self, info: StepInfo) -> None:
        if self._written_again == info.step and not self._count:  # run_hooks gave a step already written again
            self._written_again = None
            return
        if not self._count:  # called by hand, not through run_hooks (again at one step: that step's metrics again)
            self._count_step(info)
        now = self._row(info, self._sums, self._counts)
        self._sums, self._counts, self._count, self._start = {}, {}, 0, now

    def _row(self, info: StepInfo, sums: dict[str, Any], counts: dict[str, int]) -> float:
        check_metric_names(sums, "MetricsHook")
        now = time.perf_counter()
        # Each metric over the steps that gave it: one given every other step was halved.
        means = to_python({k: v / counts[k] for k, v in sums.items()})
        row = {"split": "train", "step": info.step, "epoch": info.epoch + 1, **with_member_means(means),
               "steps_per_sec": self._count / max(now - self._start, 1e-9), "elapsed_s": self.elapsed(now)}
        self.last_row = row
        self.record(row)
        return now

    def elapsed(self, now: float | None = None) -> float:
        """Seconds since this hook was made, plus a resumed run's time before (see :meth:`resume`)."""
        return (time.perf_counter() if now is None else now) - self._t0 + self._before

    def flush(self, info: StepInfo, window: dict[str, Any] | None = None) -> None:
        """A row at ``info.step`` of the steps counted since the last row (a run that ends between
        rows), unless there are none or a row of that step was written. The steps stay counted: a
        checkpoint of this step records them (:meth:`window`), so that the run resumed from it
        writes the next row an uninterrupted run writes. ``window``: another one to write (a
        diverged run's at its last good step)."""
        sums, counts = (self._sums, self._counts) if window is None else self._unpacked(window)
        if counts and (self.last_row is None or self.last_row["step"] < info.step):
            self._row(info, sums, counts)

    def snapshot(self) -> tuple[dict[str, Any], dict[str, int], float]:
        """The steps counted toward the next row, kept as they are now (cheap: every step takes
        one; :meth:`window` turns it to JSON only when a checkpoint needs it)."""
        return dict(self._sums), dict(self._counts), self.elapsed()

    def window(self, snapshot: tuple[dict[str, Any], dict[str, int], float] | None = None) -> dict[str, Any]:
        """The steps counted toward the next row (now, or at ``snapshot``), as JSON (a float per
        metric; a list per ensemble metric): each metric's sum and count, and ``elapsed_s``. For a
        checkpoint's meta, and :meth:`resume` from it."""
        sums, counts, elapsed = snapshot if snapshot is not None else self.snapshot()
        return {"sums": finite_or_null({k: np.asarray(v).tolist() for k, v in sums.items()}),
                "counts": dict(counts), "elapsed_s": elapsed}

    def resume(self, window: Any, elapsed_s: float | None = None) -> None:
        """Continue a run stopped between rows, from the :meth:`window` saved with its checkpoint:
        its sums and counts join the next row's means (``steps_per_sec`` counts this process's
        steps only), and ``elapsed_s`` goes on from the window's (or ``elapsed_s``): the time to
        the checkpoint, the downtime after it not counted. A window that is not one is ignored
        (a checkpoint of an older spmdkit has none)."""
        if isinstance(window, Mapping) and isinstance(window.get("elapsed_s"), (int, float)):
            elapsed_s = window["elapsed_s"]
        if isinstance(elapsed_s, (int, float)) and math.isfinite(elapsed_s):
            self._before = float(elapsed_s)
        try:
            self._sums, self._counts = self._unpacked(window)
        except (TypeError, ValueError, AttributeError):
            self._sums, self._counts = {}, {}

    @staticmethod
    def _unpacked(window: Any) -> tuple[dict[str, Any], dict[str, int]]:
        if not isinstance(window, Mapping) or not isinstance(window.get("sums"), Mapping):
            return {}, {}
        counts = {str(k): int(v) for k, v in window.get("counts", {}).items()}
        # JSON's null is a non-finite sum: NaN again (numpy reads None as NaN in a float array).
        sums = {str(k): np.asarray(v if v is not None else np.nan, np.float64) for k, v in window["sums"].items()
                if k in counts}
        return sums, {k: counts[k] for k in sums}

    def close(self, info: StepInfo | None, status: str) -> None:
        """The last row: the steps since the previous one (a run of 7 steps with every=5 lost
        steps 6 and 7), unless a row for ``info.step`` was written already."""
        # Something to write (steps counted since the last row, a resumed window, or the metrics of
        # ``info``, a hand call's): with none it wrote an empty row of no metrics.
        if info is not None and (self._count or self._counts or flat_metrics(info.metrics)) \
                and (self.last_row is None or self.last_row["step"] != info.step):
            self(info)


class EvalHook(Hook):
    """Every ``every`` steps, ``evaluate(state) -> {metric: value}`` recorded as an eval row."""

    def __init__(self, evaluate: Callable[[Any], dict[str, Any]], record: Callable[[dict[str, Any]], None], every: int):
        self.evaluate, self.record, self.every = evaluate, record, check_every(every, "EvalHook")
        self.seconds = 0.0
        self.last_step: int | None = None

    def __call__(self, info: StepInfo) -> None:
        started = time.perf_counter()
        metrics = self.evaluate(info.state)
        if not isinstance(metrics, Mapping):
            raise ConfigError(fix(f"EvalHook: evaluate(state) returned {type(metrics).__name__} {metrics!r:.40}, "
                                  "not a dict of metrics.", "return e.g. {'loss': loss, 'accuracy': acc}."))
        check_metric_names(metrics, "EvalHook: evaluate(state)")
        # As MetricsHook's rows: Python numbers, nested dicts as outer/inner (a record that
        # json.dumps each row failed on device arrays and NumPy scalars).
        values = to_python(flat_metrics(metrics, who="EvalHook: evaluate(state)"))
        self.record({"split": "eval", "step": info.step, **values})
        self.seconds += time.perf_counter() - started
        self.last_step = info.step


class CheckpointHook(Hook):
    """Every ``every`` steps, ``checkpointer.save(step, state, meta(info))``; at the end the
    last state too, unless the run diverged (a NaN state is never saved).

    With ``known`` (a ``KnownGood``, as ``fit`` passes) a save is held until the next
    step's loss, computed from that state, is seen finite; the loop then saves it.
    """

    def __init__(self, checkpointer: Any, every: int, meta: Callable[[StepInfo], dict[str, Any]], known: Any = None):
        if not callable(getattr(checkpointer, "save", None)):
            raise ConfigError(fix(f"CheckpointHook({checkpointer!r:.60}, ...): needs a spmdkit.Checkpointer.",
                                  "pass CheckpointHook(spmdkit.Checkpointer(spmdkit.CheckpointConfig(dir)).claim(), "
                                  "every=100, meta=lambda info: {})."))
        self.checkpointer, self.every, self.meta, self.known = checkpointer, check_every(every, "CheckpointHook"), meta, known
        self.saved_at: int | None = None

    def __call__(self, info: StepInfo) -> None:
        if self.known is not None:
            self.known.hold(info.step, info.state, self.meta(info))
            return
        self.checkpointer.save(info.step, info.state, self.meta(info))
        self.saved_at = info.step

    def close(self, info: StepInfo | None, status: str) -> None:
        # A step the directory holds already is the one this run resumed from (a rerun of a finished
        # loop trains nothing): saving it again was refused as an overwrite.
        if info is not None and status != "diverged" and info.step != self.saved_at and info.step > 0 \
                and info.step not in self.checkpointer.steps():
            self.checkpointer.save(info.step, info.state, self.meta(info))
            self.saved_at = info.step
        self.checkpointer.close()


class ProgressHook(Hook):
    """A progress bar (rich) with the loss and steps/s; ``with ProgressHook(...) as bar``."""

    def __init__(self, total: int, title: str, every: int = 1, start: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.every = check_every(every, "ProgressHook")
        self._bar = Bar(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                        TextColumn("{task.fields[rate]} steps/s"), TimeElapsedColumn(), TimeRemainingColumn())
        self._task = self._bar.add_task(title, total=total, loss="-", rate="-", completed=start)

    def __enter__(self) -> ProgressHook:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def __call__(self, info: StepInfo) -> None:
        self._bar.update(self._task, completed=info.step)

    def show(self, row: dict[str, Any]) -> None:
        self._bar.update(self._task, loss=f"{row['loss']:.4g}", rate=f"{row['steps_per_sec']:.1f}")
