"""strategy.step / apply under jax.distributed: 2 processes x 4 devices == 1 process x 8."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _launch_two import launch_two  # noqa: E402

sys.path.remove(str(HERE))


def test_two_processes_of_four_devices_equal_one_of_eight(tmp_path):
    out = tmp_path / "multi.npz"
    launch_two(HERE / "_step_mp_program.py", str(out), timeout=400)

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
