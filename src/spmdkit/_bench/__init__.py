"""Benchmark suites: ``spmdkit bench --suite NAME``. One module per suite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmdkit._bench import (
    checkpoint_suite,
    data_suite,
    ensemble_suite,
    input_suite,
    lm_suite,
    multiprocess_suite,
    pmap_suite,
    sharded_suite,
    startup_suite,
    step_suite,
)

# A suite takes its quick flag and returns a report: {"suite", "machine", "rows", "targets"}.
SUITES: dict[str, Callable[..., dict[str, Any]]] = {
    "pmap": pmap_suite.run,
    "data": data_suite.run,
    "ensemble": ensemble_suite.run,
    "input": input_suite.run,
    "sharded": sharded_suite.run,
    "checkpoint": checkpoint_suite.run,
    "multiprocess": multiprocess_suite.run,
    "startup": startup_suite.run,
    "step": step_suite.run,
    "lm": lm_suite.run,
}
