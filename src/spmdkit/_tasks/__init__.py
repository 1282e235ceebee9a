"""Built-in tasks. Adding one is adding a module with ``make()`` and ``DEFAULTS`` and a line here."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from spmdkit._errors import ConfigError, fix
import inspect

from spmdkit._tasks import digits, linreg, lm, mlp, mnist
from spmdkit._tasks._base import Task

TASKS: dict[str, ModuleType] = {"linreg": linreg, "digits": digits, "mnist": mnist, "mlp": mlp, "lm": lm}


def _module(name: str) -> ModuleType:
    if name not in TASKS:
        raise ConfigError(fix(f"task={name!r} is not known.", f"choose one of {sorted(TASKS)}."))
    return TASKS[name]


def get_task(name: str, data_dir: str | None = None, **options: Any) -> Task:
    """A built-in task by name; ``data_dir`` is where tasks with files (mnist) read them.

    ``options`` are the task's own (``layers``, ``depth``... for mlp); one the task
    does not take is an error, not silently ignored.
    """
    make = _module(name).make
    accepted = task_options(name)
    given = {k: v for k, v in options.items() if v is not None}
    wrong = sorted(set(given) - accepted)
    if wrong:
        raise ConfigError(
            fix(
                f"task {name!r} does not take option(s) {wrong}.",
                f"it takes {sorted(accepted) or 'no options'}; drop the others.",
            )
        )
    return make(data_dir=data_dir, **given)


def task_options(name: str) -> set[str]:
    """The model options a task's ``make`` takes (``layers``, ``d_model``...), without building it."""
    return set(inspect.signature(_module(name).make).parameters) - {"data_dir"}


def task_defaults(name: str) -> dict[str, Any]:
    """The option values a task trains well with, without loading its data."""
    return dict(_module(name).DEFAULTS)


__all__ = ["TASKS", "Task", "get_task", "task_defaults", "task_options"]
