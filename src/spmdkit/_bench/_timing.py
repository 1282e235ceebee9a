"""Timing helpers shared by the benchmark suites.

Every case is timed in the same rounds, interleaved (A B C, B C A, ...), so slow
drifts of a shared machine hit all cases alike and ratios stay meaningful.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def interleaved(
    cases: dict[str, Callable[[], Any]],
    *,
    rounds: int = 7,
    round_seconds: float = 0.15,
    warmup: int = 3,
) -> dict[str, dict[str, float]]:
    """Seconds per call of each zero-argument ``case`` (which must block itself).

    Returns ``{name: {"median": s, "min": s, "calls": k}}``: per-call times, the
    median and best of ``rounds`` rounds of ``k`` calls each.
    """
    counts: dict[str, int] = {}
    for name, fn in cases.items():
        for _ in range(warmup):
            fn()
        t0 = time.perf_counter()
        fn()
        once = max(time.perf_counter() - t0, 1e-6)
        counts[name] = max(1, int(round_seconds / once))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn, k = cases[name], counts[name]
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            samples[name].append((time.perf_counter() - t0) / k)
    return {
        name: {"median": statistics.median(s), "min": min(s), "calls": counts[name]}
        for name, s in samples.items()
    }


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
    }
