"""A step watchdog for multi-process runs: a dead or hung peer must not hang the rest.

Each process publishes, in the coordination service's key-value store, the last step it
started and a tick its watchdog thread advances every second. If no step finishes for
``timeout`` seconds, the watchdog reads the others': a process whose tick stands still is
dead or stopped; one that has not started the step the others are in is hung before it.
It names them and ends this process with an error; every process runs one, so all exit.
"""

from __future__ import annotations

import math
import numbers
import sys
import threading
import time
import warnings
from typing import Any

import jax

from spmdkit._errors import ConfigError, fix
from spmdkit._process import exit_now

EXIT_PEER_LOST = 4
_CLIENT_METHODS = ("key_value_set", "blocking_key_value_get")


def coordination_client():
    """The client of the coordination service that ``jax.distributed`` started, or None.

    JAX has no public key-value API; its own checkpointing reaches the client through
    this private module too. Where a JAX version moves it, this returns None and the
    watchdog still ends a run that stopped making progress, but cannot name who is behind.
    """
    try:
        from jax._src import distributed
    except ImportError:
        return None
    client = getattr(getattr(distributed, "global_state", None), "client", None)
    if client is None or not all(callable(getattr(client, m, None)) for m in _CLIENT_METHODS):
        return None
    return client


def _client():
    client = coordination_client()
    if client is None:
        raise RuntimeError("no coordination client")
    return client


class StepWatchdog:
    """Ends every process of a job whose steps stop, naming the process that fell behind.

    ``jax.distributed`` ends a job when a process dies or disconnects, but a process that is
    alive and stuck (a data reader waiting forever, a ``time.sleep`` in a debugger) keeps its
    heartbeat, and its peers wait in the next collective forever. ``fit`` runs one of these
    (``--distributed-timeout``); wrap your own loop in one the same way. If no step finishes for
    ``timeout_s`` seconds, each process prints which peer is behind and exits with code 4. In a
    lone process it does nothing.

    Example:
        >>> import jax, jax.numpy as jnp, spmdkit
        >>> step = jax.jit(lambda x: x + 1)
        >>> x = jnp.zeros(3)
        >>> with spmdkit.StepWatchdog(timeout_s=100) as watchdog:
        ...     for i in range(3):
        ...         watchdog.started(i + 1)
        ...         x = jax.block_until_ready(step(x))
        ...         watchdog.finished(i + 1)
        >>> int(x[0])
        3
    """

    _entered = 0  # watchdogs entered in this process: every process enters its own in the same order

    def __init__(self, timeout_s: float, knob: str = "StepWatchdog(timeout_s=...)"):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf:
            raise ConfigError(fix(f"StepWatchdog(timeout_s={timeout_s!r}): a number of seconds > 0.",
                                  "pass e.g. timeout_s=100, well above your slowest step (a compile counts)."))
        self.timeout_s, self.knob = float(timeout_s), knob
        self.index = jax.process_index()
        self.count = jax.process_count()
        self.step = 0
        self.started_step = 0
        self._tick = 0
        self._key = "spmdkit/progress/0"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="spmdkit-watchdog")

    def __enter__(self) -> StepWatchdog:
        if self._thread.is_alive() or self._stop.is_set():
            raise ConfigError(fix("this StepWatchdog was entered before: each watches one loop.",
                                  "make a new spmdkit.StepWatchdog(timeout_s=...) for each with block."))
        self._last = time.monotonic()  # the clock starts here, not when it was made
        if self.count == 1:
            return self  # no peer to wait for: a slow step is only slow
        # Its own keys: a watchdog nested in another's loop must not overwrite the outer's steps.
        StepWatchdog._entered += 1
        self._key = f"spmdkit/progress/{StepWatchdog._entered}"
        if coordination_client() is None:
            warnings.warn(
                f"spmdkit: JAX {jax.__version__} does not expose its coordination client where "
                "spmdkit looks for it; a run whose steps stop for --distributed-timeout seconds still "
                "ends on every process, but the message cannot name the process that fell behind.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._publish()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _check_step(self, step: Any, call: str) -> None:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
            raise ConfigError(fix(f"StepWatchdog.{call}({step!r}): steps are whole numbers counted from 1.",
                                  f"pass the step's number, e.g. watchdog.{call}(i + 1) for the loop's i-th."))
        if self.count > 1 and not self._thread.is_alive():
            raise ConfigError(fix(f"StepWatchdog.{call}() outside its with block: nothing watches the steps.",
                                  "write: with spmdkit.StepWatchdog(timeout_s=...) as watchdog: (your loop)."))

    def started(self, step: int) -> None:
        """Call before step ``step`` (counted from 1): peers see which step each process is in."""
        self._check_step(step, "started")
        self.started_step = int(step)
        if self.count > 1:
            self._publish()

    def finished(self, step: int) -> None:
        """Call once step ``step``'s results are ready (``jax.block_until_ready``)."""
        self._check_step(step, "finished")
        self.step = int(step)
        self._last = time.monotonic()

    def progressed(self) -> None:
        """Call when work between steps that every process does together completes a part (an
        eval chunk, a collective like a step's): the clock restarts as after a step. An eval of
        many chunks longer than ``timeout_s`` ended a healthy job ("no process stands out"); a
        hung peer stops those chunks too, so the timeout still fires."""
        self._last = time.monotonic()

    def _publish(self) -> None:
        try:
            value = f"{self.started_step} {self._tick}"
            _client().key_value_set(f"{self._key}/{self.index}", value, allow_overwrite=True)
        except Exception:  # publishing is best effort; the timeout still fires
            pass

    def _peers(self) -> dict[int, tuple[int, int] | None]:
        out = {}
        for i in range(self.count):
            try:
                started, tick = _client().blocking_key_value_get(f"{self._key}/{i}", 200).split()
                out[i] = (int(started), int(tick))
            except Exception:
                out[i] = None
        return out

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            self._tick += 1
            self._publish()
            idle = time.monotonic() - self._last
            if idle < self.timeout_s:
                continue
            before = self._peers()
            for _ in range(3):  # a live watchdog ticks every second, this one too while it checks:
                time.sleep(1.0)  # peers whose timeouts fire together must see each other alive
                self._tick += 1
                self._publish()
            after = self._peers()
            if time.monotonic() - self._last < self.timeout_s:
                continue  # a step finished while the peers were asked: the job moves after all
            reasons = {}
            for i in range(self.count):
                if i == self.index:
                    continue
                if after[i] is None or before[i] is None or after[i][1] == before[i][1]:
                    # Its watchdog ticks only once it trains: one still starting or restoring is silent too.
                    reasons[i] = "not answering (dead, stopped, or not training yet: starting or restoring)"
            started = {i: v[0] for i, v in after.items() if v is not None}
            top = max(started.values(), default=0)
            for i, s in started.items():
                if s < top and i not in reasons:
                    reasons[i] = f"has not started step {top} (hung at step {s})"
            who = (", ".join(f"process {i} {why}" for i, why in sorted(reasons.items()))
                   if reasons else f"no process stands out (all in step {top})")
            if coordination_client() is None:
                who = "unknown (this JAX version does not let spmdkit read the other processes' progress)"
            sys.stderr.write(
                f"spmdkit: process {self.index}: no step finished for {idle:.0f} s (timeout {self.timeout_s:.0f} s); "
                f"behind: {who}. A dead or hung process stops the collective; every process now exits. "
                f"Fix: see that process's log; raise {self.knob} if steps are just slow.\n"
            )
            exit_now(EXIT_PEER_LOST)
