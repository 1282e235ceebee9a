"""Data under jax.distributed: each process reads only its rows; checkpoints move between
1 process x 8 devices and 2 x 4 with the data order of an uninterrupted run; pipelines that
yield each process's share train as the arrays do."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _data_mp_program as program  # noqa: E402
from _launch_two import launch_two  # noqa: E402

sys.path.remove(str(HERE))


def _launch(*args: str) -> None:
    launch_two(HERE / "_data_mp_program.py", *args, timeout=300)


def _expected_rows(data_dir, k):
    from spmdkit._data import ArrayFeed, load_dataset

    return ArrayFeed(load_dataset(data_dir), 16, 3, False).indices(k)[1]


def test_processes_read_only_their_rows_and_checkpoints_move_between_topologies(tmp_path):
    data = program.write_data(tmp_path / "ds")
    # 2 x 4 from scratch to step 4, then 1 x 8 resumes to 8.
    _launch(str(data), str(tmp_path / "a"), "4", str(tmp_path / "ck_a"), "0")
    for p in (0, 1):
        with np.load(tmp_path / f"a.{p}.npz") as got:
            reads = got["reads"]
        assert len(reads) >= 4  # prefetch may read a batch or two ahead
        for k, rows in enumerate(reads):
            np.testing.assert_array_equal(rows, _expected_rows(data, k)[8 * p: 8 * (p + 1)])  # its half, no more
    one_after_two = program.run(data, 8, tmp_path / "ck_a", 1)
    assert int(one_after_two["start"]) == 4
    # 1 x 8 to step 4, then 2 x 4 resumes to 8; and the uninterrupted run.
    four = program.run(data, 4, tmp_path / "ck_b", 0)
    _launch(str(data), str(tmp_path / "b"), "8", str(tmp_path / "ck_b"), "1")
    whole = program.run(data, 8, tmp_path / "ck_c", 0)
    with np.load(tmp_path / "a.0.npz") as two_fresh, np.load(tmp_path / "b.0.npz") as two_after_one, \
            np.load(tmp_path / "a.pipeline.0.npz") as two_from_pipelines:
        assert int(two_after_one["start"]) == 4
        np.testing.assert_array_equal(two_after_one["reads"][0], _expected_rows(data, 4)[:8])
        for key in ("w1", "w2"):
            np.testing.assert_allclose(two_fresh[key], four[key], rtol=0, atol=2e-6, err_msg=key)
            np.testing.assert_allclose(two_from_pipelines[key], four[key], rtol=0, atol=2e-6, err_msg=key)
            np.testing.assert_allclose(one_after_two[key], whole[key], rtol=0, atol=2e-6, err_msg=key)
            np.testing.assert_allclose(two_after_one[key], whole[key], rtol=0, atol=2e-6, err_msg=key)
    try:
        import grain  # noqa: F401
    except ImportError:  # Python 3.11: no Grain
        return
    # spmdkit.grain_batches read by 2 processes (each its half) trains as the arrays do, and its
    # checkpoint resumes in 1 process by global batch number, with the order of an uninterrupted run.
    one_after_two_grain = program.run(data, 8, f"{tmp_path / 'ck_a'}_grain", 1, grain=True)
    assert int(one_after_two_grain["start"]) == 4
    with np.load(tmp_path / "a.grain.0.npz") as two_grain:
        for key in ("w1", "w2"):
            np.testing.assert_allclose(two_grain[key], four[key], rtol=0, atol=2e-6, err_msg=key)
            np.testing.assert_allclose(one_after_two_grain[key], whole[key], rtol=0, atol=2e-6, err_msg=key)


def test_a_save_failed_by_a_dead_peer_does_not_blame_the_disk():
    from spmdkit._checkpoint import _save_fix

    gloo = ("ValueError: UNKNOWN: Gloo AllGather failed: [external/gloo/transport/tcp/pair.cc:547] "
            "Connection closed by peer [127.0.0.1]:28047")
    assert "another process of the job stopped" in _save_fix(gloo) and "disk" not in _save_fix(gloo)
    assert "free disk space" in _save_fix("OSError: [Errno 28] No space left on device")
