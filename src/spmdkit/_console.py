"""Where the command line writes its errors, warnings and progress lines, and how it writes sizes."""

from __future__ import annotations

import errno
import math
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.text import Text

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class StdoutConsole(Console):
    """The command line's console on standard output. When the reader of a pipe leaves (``| head``),
    rich would end the program with exit code 1, which the README gives to a crash: the
    BrokenPipeError goes up to the command line's entry point instead, which exits with the shell's
    code for it (141)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of standard output left")


def stderr_console() -> Console:
    """A console on standard error that folds lines only on a terminal: off one (a log, a pipe,
    a test capturing output) each message keeps its own lines, so a path or a flag in it is
    never cut in two and ``grep`` finds it."""
    return Console(stderr=True, soft_wrap=not sys.stderr.isatty())


@contextmanager
def short_warnings() -> Iterator[None]:
    """spmdkit's own warnings as ``warning: message`` lines on standard error.

    Python's default shows the file and source line that raised the warning, which tells a user of
    the command line nothing they can act on: the message itself names the flag and the fix. A
    warning raised from any other package (JAX, Flax) keeps the default form, since there the
    source line is what one searches for.
    """
    default = warnings.showwarning
    cache_said = []

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 (warnings' hook)
        cache = _compile_cache_warning(str(message))
        if cache is not None:  # JAX's, once per program and start: one line of ours instead
            if not cache_said:
                cache_said.append(True)
                stderr_console().print(Text("warning: ", style="bold yellow") + Text(cache))
            return None
        if not os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
            return default(message, category, filename, lineno, file, line)
        stderr_console().print(Text("warning: ", style="bold yellow") + Text(str(message)))

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _compile_cache_warning(message: str) -> str | None:
    if "persistent compilation cache entry" not in message:
        return None  # no JAX import for every other warning
    import jax

    from spmdkit._cache import cache_warning

    return cache_warning(message, jax.config.jax_compilation_cache_dir)


_BYTE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def readable_bytes(n: float) -> str:
    """Bytes in the unit that fits (B, KiB, MiB, GiB, TiB), three significant figures.

    >>> readable_bytes(10), readable_bytes(5000), readable_bytes(3 * 2**30)
    ('10 B', '4.88 KiB', '3 GiB')
    """
    return _in_units(n, _BYTE_UNITS, "B")


def readable_bytes_up(n: float) -> str:
    """:func:`readable_bytes` rounded up, never below ``n``: a figure to pass back as a budget.

    >>> readable_bytes(66140), readable_bytes_up(66140)
    ('64.6 KiB', '64.6 KiB')
    >>> readable_bytes(66200), readable_bytes_up(66200)  # 64.648 KiB: 64.6 would not hold it
    ('64.6 KiB', '64.7 KiB')
    """
    return _in_units(n, _BYTE_UNITS, "B", _figures_up)


def readable_flops(n: float) -> str:
    """FLOPs in the SI unit that fits (FLOP, kFLOP, MFLOP, GFLOP, TFLOP), three significant figures.

    >>> readable_flops(640), readable_flops(2.5e7), readable_flops(3.06e9)
    ('640 FLOP', '25 MFLOP', '3.06 GFLOP')
    """
    return _in_units(n, (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)), "FLOP")


def _in_units(n: float, units: tuple[tuple[str, float], ...], smallest: str, figures: Any = None) -> str:
    """``n`` in the largest of ``units`` (largest first) it reaches, else in ``smallest``,
    written by ``figures`` (default :func:`_figures`)."""
    figures = figures or _figures
    for unit, size in units:
        if abs(n) >= size:
            return f"{figures(n / size)} {unit}"
    return f"{figures(n)} {smallest}"


def _figures(x: float) -> str:
    """Three significant figures, but 1000-1023 of a unit whole (``:.3g`` writes 1.02e+03)."""
    return f"{x:.3g}" if abs(x) < 999.5 else f"{x:.0f}"


def _figures_up(x: float) -> str:
    """:func:`_figures`, rounded up at the third significant figure."""
    digits = 2 - math.floor(math.log10(x)) if x > 0 else 0
    return _figures(math.ceil(x * 10**digits - 1e-9) / 10**digits)


def finite_or_null(x: Any) -> Any:
    """NaN and +-inf as JSON's null, in dicts, lists and tuples too. Python writes them as NaN
    and Infinity, which are not JSON: JavaScript's JSON.parse refused such a metrics line, and
    jq read Infinity as 1.8e308.

    >>> finite_or_null({"a": [1.0, float("nan")], "b": (float("inf"),)})
    {'a': [1.0, None], 'b': [None]}
    """
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_null(v) for v in x]
    return x
