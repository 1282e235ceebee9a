"""Facts about the running process that summaries report, ending it (at once, or soon), and what
every process of a job holds (gather_json)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from spmdkit._errors import ConfigError, PeerLostError, ProcessMismatchError, fix


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` at once, its open files flushed first.

    For a process that Python's own exit would hold: exit handlers or threads waiting
    for peers or commits that never come. Python flushes open files only after the exit
    handlers, which are what hold it, so this flushes every open writable file object
    (standard output and error first); nothing else is run. The flushing gets 5 s: a write
    blocked on a full pipe must not hold the exit it exists to bound.
    """
    flushing = threading.Thread(target=_flush_open_files, name="spmdkit-flush-at-exit", daemon=True)
    flushing.start()
    flushing.join(5.0)
    os._exit(code)


def _flush_open_files() -> None:
    import gc
    import io

    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            _flush(obj)


def _flush(stream: object) -> None:
    try:
        if not stream.closed and stream.writable():  # type: ignore[attr-defined]
            stream.flush()  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError, RuntimeError):
        pass


# How long a process of a group that failed may spend in its exit handlers before it ends anyway.
EXIT_GRACE_S = 20.0
# Set when spmdkit joins this process to a group of several: its name there, the grace.
_JOINED: dict[str, object] = {}
_ARMED: dict[str, float] = {}  # the code end_soon's timer exits with, and when, once armed


def joined_as(name: str, grace_s: float = EXIT_GRACE_S) -> None:
    """Note that this process is ``name`` ("process 3") in a group of several, so that
    :func:`end_soon` arms, with ``grace_s`` as its default."""
    _JOINED.update(name=name, grace_s=grace_s)


def end_soon(code: int, after: str | None = None, grace_s: float | None = None) -> int:
    """Before a process of a group leaves with ``code``: make sure it ends within ``grace_s`` s.

    For a failure only this process may have met (a damaged file on its host, a full
    disk): its peers may be waiting for it in a collective, and JAX's exit handler waits
    for every peer, up to 5 minutes, then aborts and loses ``code`` (a launcher could then
    not tell a bad input from a crash). After one line on standard error (``spmdkit:
    process 1 ends within 20 s after <after> (exit code 2) ...``) the exit handlers still
    run; a timer ends the process with ``code``, its open files flushed, if they still hold
    it ``grace_s`` later (default: 20 s, or half the ``timeout_s`` given to
    :func:`spmdkit.initialize` if shorter, so a peer's step watchdog does not end first).

    Call it from the main thread as the process's last act: it cannot be undone. A second
    call changes the code and keeps the first deadline. Outside a group spmdkit joined
    (through :func:`spmdkit.initialize` or ``spmdkit train``) and at an interactive prompt
    it does nothing. Returns ``code``, for ``sys.exit(spmdkit.end_soon(2))``.

    >>> end_soon(2)  # a single process: nothing to arm
    2
    """
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
        raise ConfigError(fix(f"end_soon(code={code!r}): an exit code is an int from 0 to 255.",
                              "pass e.g. end_soon(2) for bad input, end_soon(1) for a failure."))
    if grace_s is not None and (isinstance(grace_s, bool) or not isinstance(grace_s, (int, float))
                                or not 0 < grace_s < float("inf")):
        raise ConfigError(fix(f"end_soon(grace_s={grace_s!r}): the grace is seconds > 0, in which the exit "
                              "handlers still run.", "leave grace_s out (20 s), or pass e.g. grace_s=5."))
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError(fix(f"end_soon() called from thread {threading.current_thread().name!r}: only the main "
                              "thread's exit ends the process.", "call sys.exit(spmdkit.end_soon(code)) in the main thread."))
    if not _JOINED or hasattr(sys, "ps1") or sys.flags.interactive:
        return code
    first = not _ARMED
    _ARMED["code"] = code
    if first:
        grace = float(grace_s if grace_s is not None else _JOINED["grace_s"])  # type: ignore[arg-type]
        after = after or ("this error" if code else "its end")
        try:
            sys.stderr.write(f"spmdkit: {_JOINED['name']} ends within {grace:g} s after {after} (exit code {code}), "
                             "even if JAX's exit waits for a peer that waits for it in a collective\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass
        _ARMED["deadline"] = time.monotonic() + grace
        timer = threading.Timer(grace, _exit_after_grace)
        timer.daemon = True
        timer.start()
    return code


def _exit_after_grace() -> None:
    import logging

    try:
        logging.shutdown()
    finally:
        exit_now(int(_ARMED["code"]))


def armed() -> tuple[int, float] | None:
    """``(exit code, seconds left)`` of :func:`end_soon`'s timer, None if it is not armed. For
    work at exit that must not promise a wait the timer cuts short, nor replace the code of
    the error that armed it."""
    if "deadline" not in _ARMED:
        return None
    return int(_ARMED["code"]), max(_ARMED["deadline"] - time.monotonic(), 0.0)


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


# What the CPU runtime's (gloo's) error says when the other end of the collective has gone; a
# peer that is only slow fails otherwise ("GetKeyValue() timed out"), which the launcher explains.
_PEER_ENDED = ("connection reset by peer", "connection closed by peer", "socket closed")


def allgather(tree: Any, what: str, tiled: bool = False) -> Any:
    """``multihost_utils.process_allgather(tree, tiled)``, but a peer process that ended (killed,
    crashed) is a :class:`PeerLostError` naming ``what`` was gathered, not JAX's traceback.

    >>> from unittest import mock
    >>> gone = ValueError("UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [10.0.0.2]:4")
    >>> with mock.patch("jax.experimental.multihost_utils.process_allgather", side_effect=gone):
    ...     allgather(np.zeros(2), "the batch sizes")
    Traceback (most recent call last):
    spmdkit._errors.PeerLostError: another process of the job ended while this one gathered the batch sizes from every process (JAX: UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [10.0.0.2]:4).
      Fix: see that process's log for why it ended (killed, out of memory, an error of its own); mend that, then start the job again (spmdkit train: add --resume to continue from its last checkpoint).
    """
    from jax.experimental.multihost_utils import process_allgather

    return guarded(lambda: process_allgather(tree, tiled=tiled), f"gathered {what} from every process")


def broadcast(tree: Any, what: str) -> Any:
    """``multihost_utils.broadcast_one_to_all(tree)``: process 0's ``tree`` in every process, a
    peer process that ended being a :class:`PeerLostError` as in :func:`allgather`."""
    from jax.experimental.multihost_utils import broadcast_one_to_all

    return guarded(lambda: broadcast_one_to_all(tree), f"took {what} from process 0")


def sync(name: str, what: str) -> None:
    """``multihost_utils.sync_global_devices(name)``, a peer process that ended being a
    :class:`PeerLostError` as in :func:`allgather`."""
    from jax.experimental.multihost_utils import sync_global_devices

    guarded(lambda: sync_global_devices(name), f"waited for every process {what}")


def guarded(collective: Callable[[], Any], doing: str) -> Any:
    """``collective()``, a peer process that ended during it being a :class:`PeerLostError` that
    says what this process was ``doing`` ("ran step 12"); any other error is raised as it is."""
    from jax.errors import JaxRuntimeError

    try:
        return collective()
    # One runtime failure, two types: a ValueError when the collective's dispatch meets it (seen
    # with one device per process), a JaxRuntimeError when reading its result does (two devices).
    except (JaxRuntimeError, ValueError) as e:
        lost = _peer_lost(e, doing)
        if lost is None:
            raise
        raise lost from None  # the frames inside JAX say nothing a user can act on; its words stay in the message


_WAITERS: dict[int, Any] = {}  # threads that wait for one device's part each (wait_ready), by their count


def wait_ready(tree: Any) -> Any:
    """``jax.block_until_ready(tree)``, but in a job of several processes each local device's part
    is waited for on its own, so the error of one device's part is raised as soon as that part has
    ended, while this process's other devices still wait.

    With several devices a process, a peer process that ends (killed) fails the step's all-reduce
    only on the devices that exchange with it (gloo: "Connection reset by peer"); this process's
    other devices wait in the same all-reduce for the device that failed, until gloo's own
    timeout (minutes). ``jax.block_until_ready`` waits for them all: the lost peer went unnoticed
    until the step watchdog ended the process, with no summary written. Each part is waited for
    by a thread of its own (a pool kept for the process), the first error raised here: a few
    tens of microseconds a step, where polling the parts cost up to a tenth of the step. With
    one device a process (or one process) there is no such wait: the plain
    ``jax.block_until_ready``, at no cost. A thread left waiting after an error ends with the
    process (whose exit is bounded: :func:`end_soon`).
    """
    import concurrent.futures

    import jax

    if jax.process_count() == 1:
        return jax.block_until_ready(tree)
    parts: dict[Any, Any] = {}  # one output a device: one execution a device makes all of its outputs at once
    wanted = jax.local_device_count()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            for shard in leaf.addressable_shards:
                parts.setdefault(shard.device, shard.data)
            if len(parts) >= wanted:
                break
    if len(parts) > 1:
        if len(parts) not in _WAITERS:  # one pool a device count (a process has one: its local devices)
            _WAITERS[len(parts)] = concurrent.futures.ThreadPoolExecutor(len(parts), thread_name_prefix="spmdkit-wait")
        waits = [_WAITERS[len(parts)].submit(part.block_until_ready) for part in parts.values()]
        done, _ = concurrent.futures.wait(waits, return_when=concurrent.futures.FIRST_EXCEPTION)
        for w in done:
            if w.exception() is not None:
                raise w.exception()
    return jax.block_until_ready(tree)


def _peer_lost(error: BaseException, doing: str) -> PeerLostError | None:
    """The :class:`PeerLostError` for a collective whose other end has gone (``doing``: what this
    process was doing, e.g. "ran step 12"), or None when ``error`` says something else."""
    if not any(mark in str(error).lower() for mark in _PEER_ENDED):
        return None
    return PeerLostError(fix(f"another process of the job ended while this one {doing} (JAX: {str(error).strip()}).",
                             "see that process's log for why it ended (killed, out of memory, an error of its "
                             "own); mend that, then start the job again (spmdkit train: add --resume to "
                             "continue from its last checkpoint)."))


def disagreement(payload: bytes, detail: Callable[[], Any], at: str) -> list[Any] | None:
    """None when every process gave the same ``payload``; else every process's ``detail()``
    (JSON-able), in process order. Every process must call it, at the same point: ``at`` names
    the point ("DataParallel.init: the init key"), and processes found at other points (one
    resumed from a checkpoint, the other started afresh) are a :class:`ProcessMismatchError`
    naming both. Their digests met in one collective and the detail of one check was read as
    another's: an internal TypeError, or a wrong "rng differs" in the other process."""
    digest = np.frombuffer(hashlib.sha256(at.encode() + b"\0" + payload).digest()[:16], np.uint32)
    every = np.asarray(allgather(digest, f"a digest of what every process must give alike ({at})")).reshape(-1, digest.size)
    if (every == every[0]).all():
        return None
    # Every process saw the same digests: all take this path.
    seen = gather_json({"at": at, "gave": detail()}, "what each process gave")
    apart = [p for p, s in enumerate(seen) if s["at"] != seen[0]["at"]]
    if apart:
        shown = "; ".join(f"process {p} at {seen[p]['at']}" for p in [0, *apart][:4])
        raise ProcessMismatchError(fix(
            f"the processes are at different points of the program ({shown}): they took different paths, "
            "each now waiting in a check the others are not at.",
            "make every process take the same path: the same resume decision (restore in every process, "
            "or in none), a Checkpointer built and saved in every process (not in process 0 only), the "
            "same calls in the same order."))
    return [s["gave"] for s in seen]


def gather_json(value: Any, what: str = "a value") -> list[Any]:
    """Every process's JSON-able ``value``, in process order (every process must call it);
    ``what`` names it should a peer process end meanwhile."""
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(allgather(np.array([data.size], np.int32), f"the size of {what}")).reshape(-1)
    padded = np.zeros(1 << max(8, int(sizes.max() - 1).bit_length()), np.uint8)  # few sizes: few compilations
    padded[:data.size] = data
    gathered = np.asarray(allgather(padded, what)).reshape(len(sizes), -1)
    return [json.loads(bytes(gathered[p, :int(n)]).decode()) for p, n in enumerate(sizes)]
