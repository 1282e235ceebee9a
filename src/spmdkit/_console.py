"""Where the command line writes its errors, warnings and progress lines, and how it writes sizes."""

from __future__ import annotations

import sys

from rich.console import Console


def stderr_console() -> Console:
    """A console on standard error that folds lines only on a terminal: off one (a log, a pipe,
    a test capturing output) each message keeps its own lines, so a path or a flag in it is
    never cut in two and ``grep`` finds it."""
    return Console(stderr=True, soft_wrap=not sys.stderr.isatty())


def readable_bytes(n: float) -> str:
    """Bytes in the unit that fits (B, KiB, MiB, GiB, TiB), three significant figures.

    >>> readable_bytes(10), readable_bytes(5000), readable_bytes(3 * 2**30)
    ('10 B', '4.88 KiB', '3 GiB')
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{_figures(n / size)} {unit}"
    return f"{_figures(n)} B"


def _figures(x: float) -> str:
    """Three significant figures, but 1000-1023 of a unit whole (``:.3g`` writes 1.02e+03)."""
    return f"{x:.3g}" if abs(x) < 999.5 else f"{x:.0f}"
