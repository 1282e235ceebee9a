"""Facts about the running process that summaries report."""

from __future__ import annotations

import os
import time


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
