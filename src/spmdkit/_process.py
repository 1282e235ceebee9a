"""Facts about the running process that summaries report, and ending it: at once, or soon."""

from __future__ import annotations

import os
import sys
import threading
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


# How long a process of a group that failed may spend in its exit handlers before it ends anyway.
EXIT_GRACE_S = 20.0
# Who this process is in its group ("process 3"), once spmdkit joined it to several.
_JOINED: list[str] = []


def joined_as(name: str) -> None:
    """Note that this process is ``name`` in a group of several (for :func:`end_soon`)."""
    _JOINED[:] = [name]


def end_soon(code: int, after: str = "this error", grace_s: float = EXIT_GRACE_S) -> int:
    """Before a process of a group leaves with ``code``: make sure it ends within ``grace_s`` s.

    For a failure only this process may have met (a damaged file on its host, a full
    disk): its peers may be waiting for it in a collective, and JAX's exit handler waits
    for every peer, up to 5 minutes, then aborts and loses ``code`` (a launcher could then
    not tell a bad input from a crash). The exit handlers still run; a timer ends the
    process with ``code`` (flushing standard output and error and ``logging``) if they
    still hold it ``grace_s`` later. Outside a group that spmdkit joined (through
    :func:`spmdkit.initialize` or ``spmdkit train``) it does nothing. Returns ``code``,
    for ``sys.exit(spmdkit.end_soon(2))``.

    >>> end_soon(2)  # a single process: nothing to arm
    2
    """
    if not _JOINED:
        return code
    sys.stderr.write(f"spmdkit: {_JOINED[0]} ends within {grace_s:.0f} s after {after} (exit code {code}), "
                     "even if JAX's exit waits for a peer that waits for it in a collective\n")
    sys.stderr.flush()
    timer = threading.Timer(grace_s, _exit_after_grace, args=(code,))
    timer.daemon = True
    timer.start()
    return code


def _exit_after_grace(code: int = 1) -> None:
    import logging

    try:
        logging.shutdown()
    finally:
        exit_now(code)


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
