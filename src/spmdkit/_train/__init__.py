"""The training loop and what it writes."""

from spmdkit._train._artifacts import load_params, save_params
from spmdkit._train._loop import FitResult, evaluate, fit, iterate_batches

__all__ = ["FitResult", "evaluate", "fit", "iterate_batches", "load_params", "save_params"]
