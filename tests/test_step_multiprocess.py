"""strategy.step / apply under jax.distributed: 2 processes x 4 devices == 1 process x 8."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def test_two_processes_of_four_devices_equal_one_of_eight(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_")}
    out = tmp_path / "multi.npz"
    command = [sys.executable, "-m", "spmdkit._cli", "launch", "-n", "2", "--host-devices-per-process", "4", "--",
               sys.executable, str(HERE / "_step_mp_program.py"), str(out)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert "process 1 of 2 devices 8" in stdout + stderr

    sys.path.insert(0, str(HERE))
    try:
        import _step_mp_program
    finally:
        sys.path.remove(str(HERE))
    single = _step_mp_program.run()  # this process: 8 devices
    with np.load(out) as multi:
        assert sorted(multi.files) == sorted(single)
        for key in multi.files:
            np.testing.assert_allclose(multi[key], single[key], rtol=0, atol=2e-6, err_msg=key)
