"""One writer per directory: a lock file that names the process holding it.

A checkpoint directory and a run's ``--out`` each take one, so two runs started into the same
place are refused before either writes, instead of interleaving their files. The lock is the
kernel's (``flock`` on the file, which NFSv4 and local file systems honour): it is released
when its process ends however it ends, so a run killed with ``kill -9`` leaves nothing that
blocks the next, and no pid has to be judged alive or dead (a pid is reused, also by the next
run itself after a container restart). The file's text only names the holder for the error.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spmdkit._errors import fix

OUT_LOCK = "spmdkit-out.lock"  # a run's --out; not spmdkit.lock, so one directory can be --out and checkpoints
OUT_RUN_FILE = "spmdkit-out.json"  # whose run a --out holds (spmdkit._train._artifacts)
_ATTEMPTS = 5  # a holder releasing (unlinking) the file while we open it sends us round again


class DirLock:
    """``take()`` the lock file at ``path``, or raise what ``refuse(owner)`` builds; ``release()`` it.

    ``owner`` is the holder's record (pid, host, run_id, started; empty if unreadable). ``log``
    hears of a lock file left by an ended run and taken over.
    """

    def __init__(self, path: Path, log: Callable[[str], None], what: str):
        self.path, self.log, self.what = Path(path), log, what
        self.held = False
        self._fd: int | None = None

    def take(self, run_id: str, refuse: Callable[[dict[str, Any]], Exception]) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        for _ in range(_ATTEMPTS):
            # Held read-only: a file open for writing would keep its file system from being
            # remounted read-only for as long as the run lasts. The record is written apart.
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise refuse(self._owner()) from None
                raise
            if not self._is_current(fd):  # the file we locked was unlinked by a releasing holder
                os.close(fd)
                continue
            previous = _record(os.pread(fd, 4096, 0))
            if previous is not None:
                self.log(f"{self.what}: took over the lock of an ended run (pid {previous.get('pid', '?')})")
            try:
                with open(self.path, "w") as fh:
                    fh.write(json.dumps(me))
            except OSError:
                os.close(fd)
                raise
            self._fd, self.held = fd, True
            return
        raise refuse(self._owner())

    def _is_current(self, fd: int) -> bool:
        try:
            here, there = os.fstat(fd), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)

    def release(self) -> None:
        """Unlock and remove the file if this process holds it; never raises (a directory turned
        read-only keeps the file, which no process then holds: the next run takes it over)."""
        if not self.held:
            return
        self.held = False
        try:
            self.path.unlink(missing_ok=True)  # before unlocking: no one may lock this file again
        except OSError as e:
            self.log(f"{self.what}: could not remove {self.path} ({e.strerror or e}); the next run takes it over")
        finally:
            os.close(self._fd)  # releases the kernel's lock
            self._fd = None

    def _owner(self) -> dict[str, Any]:
        try:
            return _record(self.path.read_bytes()) or {}
        except OSError:
            return {}


def _record(raw: bytes) -> dict[str, Any] | None:
    """A lock file's record; None for an empty file (just created), {} for an unreadable one."""
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def held_now(path: Path) -> bool | None:
    """Whether a process on this machine holds the lock at ``path`` now; None where the system
    does not say (no ``/proc/locks``: not Linux).

    Read from the kernel's list of locks, not by trying the lock: a probe, however short, would
    refuse a run that starts at that moment. A holder on another host of a network file system
    is not listed here (False).
    """
    try:
        st = os.stat(path)
    except OSError:
        return False
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    # Lines as "1: FLOCK  ADVISORY  WRITE 5009 fe:00:2150854 0 EOF": device in hex, inode.
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any("FLOCK" in line.split() and want in line.split() for line in text.splitlines())


def refusal(other: dict[str, Any], path: Path, writing: str, harm: str, instead: str) -> str:
    """The message of a refused lock: who holds it, what two writers would do, the way out.

    ``writing``: what the holder writes (``to --out DIR``); ``instead``: the other place to pass.
    """
    return fix(f"another run ({holder(other)}) is writing {writing}: {harm}.",
               f"wait for it to end, or pass {instead}. If no such process runs, delete {path}.")


def holder(other: dict[str, Any]) -> str:
    """``pid 123 on host, started 2026-...`` for an error message (``?`` for what is unknown)."""
    return f"pid {other.get('pid', '?')} on {other.get('host', '?')}, started {other.get('started', '?')}"
