"""Preemption: SIGTERM means "save at the next step boundary and exit cleanly".

One process: a SIGTERM handler sets a flag the loop reads after each step. Several
processes: JAX's preemption service (started by ``jax.distributed.initialize``) hears
the notice and agrees with every process on one step to stop at, so all of them save the
same step together (a save is collective).
"""

from __future__ import annotations

import signal
import threading

import jax


class Preemption:
    """Context manager; ``reached(step)`` is True at the step boundary to stop at.

    Example:
        >>> with Preemption() as p:
        ...     p.reached(1)
        False
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        self._multi = jax.process_count() > 1

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __enter__(self) -> Preemption:
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def reached(self, step: int) -> bool:
        if not self._multi:
            return self.requested
        from jax.experimental import multihost_utils

        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except Exception:  # the preemption service is off (jax_enable_preemption_service=False)
            return False
