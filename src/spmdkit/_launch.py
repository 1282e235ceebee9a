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


def initialize_from_env(timeout_s: int = 120) -> bool:
    """Join the process group the launcher (or a cluster) describes; False if none."""
    address = os.environ.get(ENV_COORDINATOR)
    if not address:
        return False
    try:
        count, index = int(os.environ[ENV_NUM_PROCESSES]), int(os.environ[ENV_PROCESS_ID])
    except (KeyError, ValueError):
        raise DeviceSetupError(
            fix(f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} are missing or not numbers.",
                "start the processes with spmdkit launch, or set all three variables.")
        ) from None
    jax.distributed.initialize(
        coordinator_address=address, num_processes=count, process_id=index, initialization_timeout=timeout_s
    )
    return True


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
