"""One writer per directory: a lock file that names the process holding it.

A checkpoint directory and a run's ``--out`` each take one, so two runs started into the same
place are refused before either writes, instead of interleaving their files. The lock is a file
created with ``O_EXCL`` (atomic on local and network file systems alike, unlike ``flock``), holding
the owner's pid, host, run id and start time; a lock whose process has ended on this host, or an
unreadable one older than a few seconds, is taken over and said so.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_UNREADABLE_STALE_S = 10  # a lock file cut short by a kill, or still being written by its owner


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DirLock:
    """``take()`` the lock file at ``path``, or raise what ``refuse(owner)`` builds; ``release()`` it.

    ``owner`` is the holder's record (pid, host, run_id, started; empty if unreadable). ``log``
    hears of a lock taken over from an ended process.
    """

    def __init__(self, path: Path, log: Callable[[str], None], what: str):
        self.path, self.log, self.what = Path(path), log, what
        self.held = False

    def take(self, run_id: str, refuse: Callable[[dict[str, Any]], Exception]) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        for _ in range(3):  # a stale lock removed here may be taken by a third run first
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = self._owner()
                if not self._stale(other, me["host"]):
                    raise refuse(other) from None
                self.path.unlink(missing_ok=True)
                self.log(f"{self.what}: removed the lock of an ended run (pid {other.get('pid', '?')})")
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(me))
            self.held = True
            return
        raise refuse(self._owner())

    def release(self) -> None:
        """Remove the lock if this process holds it; never raises (a directory turned read-only
        leaves a lock of a dead pid, which the next run takes over)."""
        if not self.held:
            return
        self.held = False
        try:
            self.path.unlink(missing_ok=True)
        except OSError as e:
            self.log(f"{self.what}: could not remove {self.path} ({e.strerror or e}); the next run takes it over "
                     "once this process has ended")

    def _owner(self) -> dict[str, Any]:
        try:
            other = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return other if isinstance(other, dict) else {}

    def _stale(self, other: dict[str, Any], host: str) -> bool:
        if not other:
            try:
                return time.time() - self.path.stat().st_mtime > _UNREADABLE_STALE_S
            except FileNotFoundError:
                return True  # released meanwhile
        return other.get("host") == host and isinstance(other.get("pid"), int) and not pid_alive(other["pid"])


def holder(other: dict[str, Any]) -> str:
    """``pid 123 on host, started 2026-...`` for an error message (``?`` for what is unknown)."""
    return f"pid {other.get('pid', '?')} on {other.get('host', '?')}, started {other.get('started', '?')}"
