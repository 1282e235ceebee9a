"""Facts about the running process that summaries report, and ending it at once."""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` at once, standard output and error flushed first.

    For a process that Python's own exit would hold: exit handlers or threads waiting
    for peers or commits that never come. Nothing else is flushed or run.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start-up and imports included).

    Read from ``/proc`` on Linux (10 ms resolution); None where that is not available.

    >>> age = process_age_s()
    >>> age is None or age > 0
    True
    """
    try:
        with open("/proc/self/stat") as fh:
            # Field 22 (starttime, in clock ticks since boot) follows the ")" that ends
            # the command name, which may itself contain spaces.
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
