"""Run a test program under ``spmdkit launch -n 2`` with 4 devices per process: a hard
timeout, and the launcher and both workers killed with SIGKILL if it is still running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def start_two(program: Path, *args: str) -> subprocess.Popen:
    """The launcher started in its own session (``os.killpg(proc.pid, SIGKILL)`` ends it and both workers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_")}
    command = [sys.executable, "-m", "spmdkit._cli", "launch", "-n", "2", "--host-devices-per-process", "4", "--",
               sys.executable, str(program), *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_two(program: Path, *args: str, timeout: float) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of the launch, SIGKILLed (launcher and workers) at ``timeout``."""
    proc = start_two(program, *args)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers
            proc.wait()
    return proc.returncode, stdout, stderr


def launch_two(program: Path, *args: str, timeout: float) -> None:
    code, stdout, stderr = run_two(program, *args, timeout=timeout)
    assert code == 0, stderr[-3000:]
    assert "process 1 of 2 devices 8" in stdout + stderr
