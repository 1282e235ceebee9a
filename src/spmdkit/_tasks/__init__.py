"""Built-in tasks. Adding one is adding a module with ``make()`` and a line here."""

from __future__ import annotations

from collections.abc import Callable

from spmdkit._errors import ConfigError, fix
from spmdkit._tasks import digits, linreg
from spmdkit._tasks._base import Task

TASKS: dict[str, Callable[[], Task]] = {
    "linreg": linreg.make,
    "digits": digits.make,
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(fix(f"task={name!r} is not known.", f"choose one of {sorted(TASKS)}."))
    return TASKS[name]()


__all__ = ["TASKS", "Task", "get_task"]
