"""Several processes joined by ``jax.distributed``: the local launcher and the start-up.

``spmdkit launch -n P -- spmdkit train ...`` starts P copies of a command on this
machine, tells each its place through the environment (coordinator address on
127.0.0.1 and a free port, process count, process id, devices per process),
prefixes their output with the process index, and ends them all (SIGKILL after a
grace period: JAX catches SIGTERM) as soon as one fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import jax

from spmdkit._errors import DeviceSetupError, fix

ENV_COORDINATOR = "SPMDKIT_COORDINATOR"
ENV_NUM_PROCESSES = "SPMDKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "SPMDKIT_PROCESS_ID"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_detected() -> bool:
    """A multi-task SLURM or Open MPI job, or JAX's own ``JAX_COORDINATOR_ADDRESS``
    (with ``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``): jax.distributed reads them by itself."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        try:
            if int(os.environ.get(name, "1")) > 1:
                return True
        except ValueError:
            pass
    return False


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: int = 100,
) -> bool:
    """Join a process group, if there is one; False when this is a single process.

    Sources, first found wins: the arguments (``--coordinator`` ...), the variables
    ``spmdkit launch`` sets, JAX's ``JAX_COORDINATOR_ADDRESS`` variables, a SLURM /
    Open MPI job (auto-detected by JAX). TPU pods are not auto-detected: pass the flags.
    The training loop's step watchdog uses ``timeout_s``; the coordination service's
    heartbeat timeout is set to ``2 * timeout_s + 10`` as the backstop.
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if coordinator:
        try:
            count = num_processes if num_processes is not None else int(os.environ[ENV_NUM_PROCESSES])
            index = process_id if process_id is not None else int(os.environ[ENV_PROCESS_ID])
        except (KeyError, ValueError):
            raise DeviceSetupError(
                fix(f"a coordinator ({coordinator}) is given but the process count or id is missing.",
                    "pass --num-processes and --process-id (or start the processes with spmdkit launch).")
            ) from None
        # The heartbeat is the backstop; the step watchdog (which names the process that
        # fell behind) gets to speak first.
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=index,
                                   initialization_timeout=max(timeout_s, 60), heartbeat_timeout_seconds=2 * timeout_s + 10)
        return True
    if num_processes is not None or process_id is not None:
        raise DeviceSetupError(fix("--num-processes/--process-id need --coordinator HOST:PORT.",
                                   "pass the address of process 0, e.g. --coordinator node0:1234."))
    if _cluster_detected():
        jax.distributed.initialize(heartbeat_timeout_seconds=2 * timeout_s + 10)
        return True
    return False


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(f"{prefix}{line}")
        sink.flush()


def launch(command: Sequence[str], processes: int, devices_per_process: int | None = None, grace_s: float = 5.0) -> int:
    """Run ``command`` in ``processes`` local processes; the exit code of the first to fail, else 0."""
    if processes < 1:
        raise DeviceSetupError(fix(f"-n {processes}: need at least one process.", "pass -n 2."))
    if not command:
        raise DeviceSetupError(fix("no command to launch.", "write it after --, e.g. spmdkit launch -n 2 -- spmdkit train"))
    port = free_port()
    procs: list[subprocess.Popen] = []
    pumps = []
    for i in range(processes):
        env = {**os.environ, ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(processes),
               ENV_PROCESS_ID: str(i)}
        if devices_per_process is not None:
            env["SPMDKIT_HOST_DEVICES"] = str(devices_per_process)
        proc = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                bufsize=1)
        procs.append(proc)
        for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, f"[{i}] ", sink), daemon=True)
            t.start()
            pumps.append(t)
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        failed = (-1, 130)
    if failed is not None:
        deadline = time.time() + grace_s
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                p.kill()  # JAX catches SIGTERM once jax.distributed is up
        for p in procs:
            p.wait()
    for t in pumps:
        t.join(timeout=5)
    if failed is None:
        return 0
    index, code = failed
    if index >= 0:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        sys.stderr.write(f"spmdkit launch: process {index} {how}; stopped the other {processes - 1}\n")
    return code if code > 0 else 1
