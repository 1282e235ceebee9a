"""The one timing method of every benchmark suite.

A figure taken once, in a fixed order, on a machine someone else is using, can move
by 2x between two runs. So every suite measures the same way:

1. warm-up: each case runs ``warmup`` times untimed (compilation, caches);
2. ``rounds`` (>= 5 for figures) rounds, every case once per round, in a rotating
   order (A B C, B C A, C A B, ...), so a slow drift of the machine hits all cases
   alike;
3. per case: the per-round times, their median, quartiles (IQR) and min-max;
4. ratios between cases from the *same* rounds: the median and IQR of the per-round
   paired ratios (a_r / b_r), so one noisy round cannot fake a speed-up;
5. the machine's load before and after (``os.getloadavg`` and the CPU time other
   processes used, from ``/proc/stat``); a figure is flagged, and a warning given,
   when other processes used more than :data:`BUSY_FRACTION` of the CPU or a case's
   IQR exceeds :data:`SPREAD_LIMIT` of its median.

A case is a zero-argument callable that blocks until its result is ready; with
``self_timed=True`` it returns its own seconds (or ``None`` if it failed), for cases
whose set-up must not be timed (a process launch that reports its own step time, a
file that must exist before it is read).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

SPREAD_LIMIT = 0.10  # IQR / median above which a figure is flagged "spread"
BUSY_FRACTION = 0.10  # other processes' share of all cores above which a figure is flagged "load"
MIN_ROUNDS = 5  # fewer rounds than this give a smoke run, never a figure


def _proc_stat() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, or None off Linux."""
    try:
        with open("/proc/stat") as fh:
            fields = [float(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


def _launch_root() -> int:
    """This process, or the ``spmdkit launch`` that started it (its ``SPMDKIT_LAUNCHER_PID``,
    when that process is an ancestor of this one): the root of the process tree whose CPU time
    is this run's own. Each of the processes of one launch (calibrate's or plan's workers) would
    otherwise count the others, and the launcher, as other people's load."""
    from spmdkit._launch import ENV_LAUNCHER_PID

    me = os.getpid()
    given = os.environ.get(ENV_LAUNCHER_PID, "")
    if not given.isdigit() or int(given) == me:
        return me
    parents = _process_table()[0]
    p, seen = parents.get(me), 0
    while p is not None and p > 1 and seen < 64:
        if p == int(given):
            return p
        p, seen = parents.get(p), seen + 1
    return me  # a stale value (a process started by the launched command, then detached): ours alone


def _process_table() -> tuple[dict[int, int], dict[int, float]]:
    """``(parent of each pid, CPU seconds of each: its own and its waited-for children's)`` from /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}, {}
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # after the command: state ppid ... utime(12) stime(13) cutime(14) cstime(15), 0-based here
        pid = int(name)
        parent[pid] = int(fields[1])
        cpu[pid] = sum(float(v) for v in fields[11:15]) / tick
    return parent, cpu


def _live_descendants_cpu(root: int | None = None) -> float:
    """CPU seconds of the descendants of ``root`` (default: this process) that are still
    running (or not yet waited for).

    A suite that keeps worker processes for the whole run (the lm suite, calibrate's and the
    multiprocess suite's launches while they run) must not count their work as other people's
    load; ``os.times`` only counts children once they have been waited for.
    """
    parent, cpu = _process_table()
    me, total = os.getpid() if root is None else root, 0.0
    for pid in cpu:
        p, seen = parent.get(pid), 0
        while p is not None and p > 1 and seen < 64:
            if p == me:
                total += cpu[pid]
                break
            p, seen = parent.get(p), seen + 1
    return total


def _own_cpu() -> float:
    """CPU seconds of this process, of its children that have been waited for, and of its
    descendants still running; in a process of ``spmdkit launch``, of the whole launch: the
    launcher, every process it started, and theirs."""
    root = _launch_root()
    if root != os.getpid():
        return _process_table()[1].get(root, 0.0) + _live_descendants_cpu(root)
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _live_descendants_cpu()


class LoadMeter:
    """CPU use of *other* processes over an interval: machine busy time minus our own.

    Example:
        >>> meter = LoadMeter()
        >>> snapshot = meter.stop()
        >>> sorted(snapshot)
        ['loadavg', 'other_cpu']
    """

    def __init__(self) -> None:
        self._stat, self._own, self._t0 = _proc_stat(), _own_cpu(), time.perf_counter()

    def stop(self) -> dict[str, Any]:
        """``{"loadavg": (1, 5, 15 min), "other_cpu": share of all cores used by others or None}``."""
        stat, own, wall = _proc_stat(), _own_cpu(), time.perf_counter() - self._t0
        other = None
        if stat is not None and self._stat is not None and wall > 0:
            busy, total = stat[0] - self._stat[0], stat[1] - self._stat[1]
            if total > 0:
                other = min(1.0, max(0.0, (busy - (own - self._own)) / total))
        return {"loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None, "other_cpu": other}


def idle_load(seconds: float = 0.25) -> dict[str, Any]:
    """The machine's load while this process sleeps: what others are doing right now."""
    meter = LoadMeter()
    time.sleep(seconds)
    return meter.stop()


def _quantile(sorted_xs: list[float], q: float) -> float:
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(xs: list[float]) -> dict[str, float]:
    """Median, quartiles, min, max and the relative IQR of some per-round values.

    Example:
        >>> s = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> s["median"], s["q1"], s["q3"], s["iqr_rel"]
        (3.0, 2.0, 4.0, 0.6666666666666666)
    """
    s = sorted(xs)
    med = statistics.median(s)
    q1, q3 = _quantile(s, 0.25), _quantile(s, 0.75)
    return {
        "median": med,
        "q1": q1,
        "q3": q3,
        "min": s[0],
        "max": s[-1],
        "iqr_rel": (q3 - q1) / med if med else float("inf"),
        "range_rel": (s[-1] - s[0]) / med if med else float("inf"),
    }


def rotations(names: list[str], rounds: int) -> list[list[str]]:
    """The order of every round: each round starts one case later than the last.

    Example:
        >>> rotations(["a", "b", "c"], 4)
        [['a', 'b', 'c'], ['b', 'c', 'a'], ['c', 'a', 'b'], ['a', 'b', 'c']]
    """
    return [names[r % len(names):] + names[: r % len(names)] for r in range(rounds)]


def measure(
    cases: dict[str, Callable[[], Any]],
    *,
    rounds: int = 7,
    warmup: int = 2,
    round_seconds: float = 0.15,
    self_timed: bool = False,
    idle_seconds: float = 0.25,
) -> dict[str, Any]:
    """Time ``cases`` in interleaved rounds; the JSON-ready record of the whole run.

    Returns ``{"rounds", "order", "cases": {name: {"times": [s per call, one per round],
    "calls", "median", "q1", "q3", "min", "max", "iqr_rel", "range_rel", "flags"}},
    "load": {"before", "during", "after"}, "flags", "warnings"}``. Unless ``self_timed``,
    a case is called ``calls`` times per round (as many as fit in ``round_seconds``) and
    its time is the mean of those calls. A self-timed case that returns ``None`` failed:
    its times hold ``None`` there and its summary covers the rounds that ran.

    Example:
        >>> run = measure({"a": lambda: sum(range(100)), "b": lambda: sum(range(200))}, rounds=5, idle_seconds=0)
        >>> len(run["cases"]["a"]["times"]), run["order"][1]
        (5, ['b', 'a'])
        >>> 0 < ratio(run, "a", "b")["median"]
        True
    """
    names = list(cases)
    before = idle_load(idle_seconds) if idle_seconds else LoadMeter().stop()
    counts: dict[str, int] = {}
    for name, fn in cases.items():
        for _ in range(warmup):
            fn()
        if self_timed:
            counts[name] = 1
        else:
            t0 = time.perf_counter()
            fn()
            counts[name] = max(1, int(round_seconds / max(time.perf_counter() - t0, 1e-6)))
    times: dict[str, list[float | None]] = {name: [] for name in names}
    order = rotations(names, rounds)
    meter = LoadMeter()
    for round_order in order:
        for name in round_order:
            if self_timed:
                times[name].append(cases[name]())
                continue
            fn, k = cases[name], counts[name]
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            times[name].append((time.perf_counter() - t0) / k)
    during = meter.stop()
    after = idle_load(idle_seconds) if idle_seconds else LoadMeter().stop()
    return _record(times, counts, order, {"before": before, "during": during, "after": after})


def record(times: dict[str, list[float | None]], order: list[list[str]], load: dict[str, Any]) -> dict[str, Any]:
    """The record of :func:`measure` for rounds a suite ran itself (cases that depend on each
    other within a round, e.g. a second start that needs the first start's cache).

    ``times`` holds one time per round for every case, ``order`` what ran in each round,
    ``load`` the ``before``/``during``/``after`` snapshots (:func:`idle_load`, :class:`LoadMeter`).
    """
    return _record(times, {name: 1 for name in times}, order, load)


def _load_flag(load: dict[str, Any]) -> str | None:
    cores = os.cpu_count() or 1
    others = [snap["other_cpu"] for snap in load.values() if snap.get("other_cpu") is not None]
    if others:
        worst = max(others)
        if worst > BUSY_FRACTION:
            return f"other processes used {worst:.0%} of the {cores} cores"
        return None
    avg = load["before"].get("loadavg")
    if avg and avg[0] > BUSY_FRACTION * cores + 0.5:  # no /proc/stat: the 1-minute load average
        return f"load average {avg[0]:.2f} on {cores} cores before the run"
    return None


def _record(times, counts, order, load) -> dict[str, Any]:
    rounds = len(order)
    warnings: list[str] = []
    run_flags: list[str] = []
    busy = _load_flag(load)
    if busy:
        run_flags.append("load")
        warnings.append(f"machine busy: {busy}; these figures are not comparable")
    if rounds < MIN_ROUNDS:
        run_flags.append("rounds")
        warnings.append(f"only {rounds} round(s) (figures need >= {MIN_ROUNDS}): a smoke run")
    cases: dict[str, Any] = {}
    for name, ts in times.items():
        ok = [t for t in ts if t is not None]
        entry: dict[str, Any] = {"times": ts, "calls": counts[name]}
        flags = list(run_flags)
        if not ok:
            entry.update(median=float("nan"), flags=flags + ["failed"])
            warnings.append(f"{name}: failed in every round")
            cases[name] = entry
            continue
        entry.update(summarize(ok))
        if len(ok) < len(ts):
            flags.append("failed")
            warnings.append(f"{name}: failed in {len(ts) - len(ok)} of {len(ts)} rounds")
        if entry["iqr_rel"] > SPREAD_LIMIT:
            flags.append("spread")
            warnings.append(f"{name}: spread {entry['iqr_rel']:.0%} of the median (IQR) exceeds {SPREAD_LIMIT:.0%}")
        entry["flags"] = flags
        cases[name] = entry
    return {"rounds": rounds, "order": order, "cases": cases, "load": load, "flags": run_flags, "warnings": warnings}


def ratio(run: dict[str, Any], a: str, b: str) -> dict[str, Any]:
    """a's time / b's time: median and quartiles of the per-round paired ratios.

    Also ``of_medians`` (median a / median b) and the flags of either case; a ratio whose
    IQR exceeds :data:`SPREAD_LIMIT` of its median is flagged ``spread``.

    Example:
        >>> run = {"cases": {"a": {"times": [2.0, 2.2, 1.8], "median": 2.0, "flags": []},
        ...                  "b": {"times": [1.0, 1.1, 0.9], "median": 1.0, "flags": []}}}
        >>> ratio(run, "a", "b")["median"]
        2.0
    """
    ca, cb = run["cases"][a], run["cases"][b]
    pairs = [x / y for x, y in zip(ca["times"], cb["times"]) if x is not None and y]
    # A case's own spread may cancel in the pairs: the ratio is judged by its own IQR.
    flags = sorted((set(ca.get("flags", [])) | set(cb.get("flags", []))) - {"spread"})
    if not pairs:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"), "of_medians": float("nan"),
                "flags": sorted(set(flags) | {"failed"})}
    s = summarize(pairs)
    if s["iqr_rel"] > SPREAD_LIMIT:
        flags.append("spread")
    return {"median": s["median"], "q1": s["q1"], "q3": s["q3"], "min": s["min"], "max": s["max"],
            "of_medians": ca["median"] / cb["median"], "flags": flags}


def inverse(r: dict[str, Any]) -> dict[str, Any]:
    """A time ratio turned into a throughput ratio (b's rate / a's rate = a's time / b's time, flipped)."""
    flip = lambda v: 1.0 / v if v else float("nan")  # noqa: E731
    out = dict(r, median=flip(r["median"]), q1=flip(r.get("q3")), q3=flip(r.get("q1")), of_medians=flip(r["of_medians"]))
    if "min" in r:
        out.update(min=flip(r["max"]), max=flip(r["min"]))
    return out


def geomean(ratios: list[dict[str, Any]]) -> dict[str, Any]:
    """Geometric mean over workloads of :func:`ratio` results (median and quartiles), flags joined.

    Example:
        >>> round(geomean([{"median": 2.0, "q1": 2.0, "q3": 2.0, "flags": []},
        ...                {"median": 0.5, "q1": 0.5, "q3": 0.5, "flags": ["load"]}])["median"], 6)
        1.0
    """
    geo = lambda key: math.exp(statistics.fmean(math.log(r[key]) for r in ratios))  # noqa: E731
    return {"median": geo("median"), "q1": geo("q1"), "q3": geo("q3"),
            "flags": sorted({f for r in ratios for f in r["flags"]})}


def target(name: str, r: dict[str, Any], op: str, bound: float) -> dict[str, Any]:
    """A target entry for a report: the paired-ratio median, its IQR, met or not, and its flags."""
    v = r["median"]
    met = {"<=": v <= bound, "<": v < bound, ">=": v >= bound, ">": v > bound}[op]
    return {"name": name, "value": v, "q1": r.get("q1"), "q3": r.get("q3"), "target": f"{op} {bound}",
            "met": bool(met), "flags": r.get("flags", [])}


def case_row(run: dict[str, Any], name: str, scale: float = 1e3) -> dict[str, Any]:
    """The spread columns of a report row for one case: median, IQR %, min, max (in 1/scale s)."""
    c = run["cases"][name]
    if not c.get("times") or "q1" not in c:
        return {"median": float("nan"), "iqr_pct": float("nan"), "min": float("nan"), "max": float("nan"),
                "flag": ",".join(c.get("flags", []))}
    return {"median": c["median"] * scale, "iqr_pct": 100 * c["iqr_rel"], "min": c["min"] * scale,
            "max": c["max"] * scale, "flag": ",".join(c["flags"])}


def interleaved(
    cases: dict[str, Callable[[], Any]],
    *,
    rounds: int = 7,
    round_seconds: float = 0.15,
    warmup: int = 3,
) -> dict[str, dict[str, Any]]:
    """Per-case summaries of :func:`measure` (``{name: {"median", "min", "calls", ...}}``).

    The older entry point: suites should prefer :func:`measure`, whose record also holds
    the rounds, the load and the warnings for the report.
    """
    return measure(cases, rounds=rounds, warmup=warmup, round_seconds=round_seconds, idle_seconds=0)["cases"]


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
