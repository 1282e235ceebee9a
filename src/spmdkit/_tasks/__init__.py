"""Built-in tasks. Adding one is adding a module with ``make()`` and ``DEFAULTS`` and a line here."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from spmdkit._errors import ConfigError, fix
from spmdkit._tasks import digits, linreg, mnist
from spmdkit._tasks._base import Task

TASKS: dict[str, ModuleType] = {"linreg": linreg, "digits": digits, "mnist": mnist}


def _module(name: str) -> ModuleType:
    if name not in TASKS:
        raise ConfigError(fix(f"task={name!r} is not known.", f"choose one of {sorted(TASKS)}."))
    return TASKS[name]


def get_task(name: str, data_dir: str | None = None) -> Task:
    """A built-in task by name; ``data_dir`` is where tasks with files (mnist) read them."""
    return _module(name).make(data_dir=data_dir)


def task_defaults(name: str) -> dict[str, Any]:
    """The option values a task trains well with, without loading its data."""
    return dict(_module(name).DEFAULTS)


__all__ = ["TASKS", "Task", "get_task", "task_defaults"]
