"""The training loop and what it writes."""

from spmdkit._train._artifacts import load_params, save_params
from spmdkit._train._hooks import (
    CheckpointHook,
    EvalHook,
    MetricsHook,
    NaNGuard,
    ProgressHook,
    StepInfo,
    run_hooks,
)
from spmdkit._train._loop import FitResult, evaluate_task, fit, iterate_batches
from spmdkit._train._steps import task_state
from spmdkit._train._watchdog import StepWatchdog

__all__ = [
    "CheckpointHook",
    "EvalHook",
    "FitResult",
    "MetricsHook",
    "NaNGuard",
    "ProgressHook",
    "StepInfo",
    "StepWatchdog",
    "evaluate_task",
    "fit",
    "iterate_batches",
    "load_params",
    "run_hooks",
    "save_params",
    "task_state",
]
