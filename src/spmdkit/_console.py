"""Where the command line writes its errors, warnings and progress lines."""

from __future__ import annotations

import sys

from rich.console import Console


def stderr_console() -> Console:
    """A console on standard error that folds lines only on a terminal: off one (a log, a pipe,
    a test capturing output) each message keeps its own lines, so a path or a flag in it is
    never cut in two and ``grep`` finds it."""
    return Console(stderr=True, soft_wrap=not sys.stderr.isatty())
