"""spmdkit.pmap under jax.distributed: 2 processes x 4 devices give 1 process x 8's results
(flat and nested maps)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from spmdkit._launch import free_port

WORKER = pathlib.Path(__file__).with_name("pmap_mp_worker.py")
TIMEOUT_S = 180


def start(out, nproc, pid, port, per):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMDKIT_", "JAX_", "XLA_"))}
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(out), str(nproc), str(pid), str(port), str(per)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.fixture
def processes():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:  # JAX catches SIGTERM after jax.distributed.initialize
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()


def finish(procs):
    logs, deadline = [], time.monotonic() + TIMEOUT_S
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the workers did not finish within {TIMEOUT_S} s")
        logs.append(err)
        assert p.returncode == 0, err[-3000:]
    return logs


def test_two_processes_of_four_equal_one_of_eight(tmp_path, processes):
    port = free_port()
    processes += [start(tmp_path / f"p{i}.npz", 2, i, port, 4) for i in range(2)]
    processes.append(start(tmp_path / "single.npz", 1, 0, 0, 8))
    logs = finish(processes)
    with np.load(tmp_path / "p0.npz") as a, np.load(tmp_path / "p1.npz") as b, np.load(
        tmp_path / "single.npz"
    ) as single:
        ours = [k for k in single.files if k.startswith("spmdkit/")]
        assert len(ours) >= 8
        for k in ours:
            if k.startswith("spmdkit/out_axes None") or k == "spmdkit/replication error":
                expected = single[k]
                np.testing.assert_allclose(a[k], expected, rtol=1e-5)
                np.testing.assert_allclose(b[k], expected, rtol=1e-5)
                continue
            got = np.concatenate([a[k], b[k]])
            np.testing.assert_allclose(got, single[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert int(single["spmdkit/replication error"]) == 1
        assert single["spmdkit/nested"].shape == (4, 2, 3)  # a 4 x 2 grid: 2 x 2 per process
        # Where jax.pmap runs across processes, both agree on every process.
        for k in a.files:
            if k.startswith("jax/") and k in b.files:
                np.testing.assert_allclose(
                    np.concatenate([a[k], b[k]]), np.concatenate([a["spmdkit/" + k[4:]], b["spmdkit/" + k[4:]]]),
                    rtol=1e-5, atol=1e-6, err_msg=k,
                )
    assert "done 0 8" in logs[0] and "done 1 8" in logs[1], logs
