"""``spmdkit.initialize()``: a user's own script joins a multi-process job.

The same start-up as ``spmdkit train``: explicit arguments, then the variables
``spmdkit launch`` sets, then JAX's ``JAX_COORDINATOR_ADDRESS`` variables, then a
multi-task SLURM or Open MPI job.
"""

from __future__ import annotations

import os

import jax

from spmdkit._devices import host_devices_from_env, use_host_devices
from spmdkit._errors import DeviceSetupError, fix
from spmdkit._launch import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, initialize_distributed, note_joined


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    host_devices: int | None = None,
    timeout_s: int = 100,
) -> bool:
    """Join a ``jax.distributed`` job if there is one; True if this process is part of one.

    Call it first, before any JAX work. ``host_devices`` simulates that many CPU devices
    in this process (default: ``SPMDKIT_HOST_DEVICES``, else the real devices). Without
    arguments it joins what the environment describes (``spmdkit launch``, JAX's
    ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, SLURM, Open MPI)
    and returns False in a lone process. ``timeout_s`` is how long a peer may fall silent
    (dead, disconnected) before the job is ended (the coordination heartbeat is
    ``3 * timeout_s + 30``); a peer alive but stuck keeps its heartbeat, so wrap your own loop in
    a :class:`spmdkit.StepWatchdog` (``fit`` runs one). In a job
    of several processes, a process whose main thread raises an uncaught exception then exits
    within 20 s (or ``timeout_s / 2`` if shorter), rather than wait in JAX's exit handler for
    peers that wait for it (install your own ``sys.excepthook`` before calling this); leave
    with ``sys.exit(spmdkit.end_soon(code))`` for the same bound with a code of your own.

    Example:
        >>> import spmdkit
        >>> spmdkit.initialize()   # a lone process: nothing to join
        False
    """
    if coordinator is None and (num_processes is not None or process_id is not None) and not os.environ.get(ENV_COORDINATOR):
        raise DeviceSetupError(
            fix("num_processes/process_id were given without coordinator.",
                'pass coordinator="HOST:PORT" (the address of process 0), e.g. initialize("node0:1234", 2, 0).')
        )
    if (coordinator or os.environ.get(ENV_COORDINATOR)) and (
        (num_processes is None and ENV_NUM_PROCESSES not in os.environ)
        or (process_id is None and ENV_PROCESS_ID not in os.environ)
    ):
        raise DeviceSetupError(
            fix(f"coordinator={coordinator or os.environ.get(ENV_COORDINATOR)!r} is given, but not "
                "num_processes and process_id.",
                "pass all three: initialize(coordinator, num_processes=N, process_id=I).")
        )
    if jax.distributed.is_initialized():  # joined by the script's own jax.distributed.initialize, or a call before
        # A second call asking for another place in another job was answered True, silently.
        for name, given, actual in (("num_processes", num_processes, jax.process_count()),
                                    ("process_id", process_id, jax.process_index())):
            if given is not None and given != actual:
                raise DeviceSetupError(fix(
                    f"initialize({name}={given!r}): this process has already joined a job as process "
                    f"{jax.process_index()} of {jax.process_count()}; a job cannot be joined twice.",
                    "call spmdkit.initialize() once, first in the script (a second call without arguments "
                    "returns True)."))
        note_joined(None, timeout_s)
        return True
    n = host_devices or host_devices_from_env()
    if n is not None:
        use_host_devices(n)
    try:
        return initialize_distributed(coordinator, num_processes, process_id, timeout_s)
    except RuntimeError as e:
        if "before" not in str(e) and "already" not in str(e):
            raise
        raise DeviceSetupError(
            fix(f"initialize() came after JAX had started in this process ({e}).",
                "call spmdkit.initialize() first in the script, before any jax operation.")
        ) from None
