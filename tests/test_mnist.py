"""The MNIST task: real IDX/npz reading from a directory, never a download."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import spmdkit
from spmdkit._tasks import mnist


def fake_mnist(directory, n_train=64, n_test=16, gz=True, seed=0):
    """Small MNIST-format files: class k is a bright k-th row band, plus noise."""
    rng = np.random.default_rng(seed)
    for which, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, k in enumerate(labels):
            images[i, 2 * k + 4 : 2 * k + 7, 4:24] = 250
        suffix = ".gz" if gz else ""
        mnist.write_idx(directory / f"{which}-images-idx3-ubyte{suffix}", images)
        mnist.write_idx(directory / f"{which}-labels-idx1-ubyte{suffix}", labels)
    return directory


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip_and_load(tmp_path, gz):
    fake_mnist(tmp_path, gz=gz)
    train, test = mnist.load(tmp_path)
    assert train["image"].shape == (64, 28, 28, 1) and test["image"].shape == (16, 28, 28, 1)
    assert train["image"].dtype == np.float32 and train["image"].max() <= 1.0
    assert train["label"].dtype == np.int32 and train["label"].max() <= 9
    raw = mnist.read_idx(tmp_path / f"train-labels-idx1-ubyte{'.gz' if gz else ''}")
    np.testing.assert_array_equal(raw, train["label"])


def test_idx_dtypes_round_trip(tmp_path):
    for arr in (np.arange(12, dtype=np.int32).reshape(3, 4), np.linspace(0, 1, 6, dtype=np.float32)):
        mnist.write_idx(tmp_path / "a.idx", arr)
        np.testing.assert_array_equal(mnist.read_idx(tmp_path / "a.idx"), arr)


def test_npz_layout(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist.npz", x_train=rng.integers(0, 255, (20, 28, 28)).astype(np.uint8),
             y_train=rng.integers(0, 10, 20), x_test=rng.integers(0, 255, (5, 28, 28)).astype(np.uint8),
             y_test=rng.integers(0, 10, 5))
    train, test = mnist.load(tmp_path)
    assert len(train["label"]) == 20 and len(test["label"]) == 5


def test_a_damaged_or_incomplete_npz_is_named_once(tmp_path):
    # A truncated mnist.npz was a bare zipfile.BadZipFile; one lacking arrays said "Fix:" twice.
    np.savez(tmp_path / "mnist.npz", x_train=np.zeros((20, 28, 28), np.uint8))
    with pytest.raises(spmdkit.DataError) as e:
        mnist.load(tmp_path)
    assert "mnist.npz lacks arrays ['y_train', 'x_test', 'y_test']" in str(e.value) and str(e.value).count("Fix:") == 1
    whole = (tmp_path / "mnist.npz").read_bytes()
    (tmp_path / "mnist.npz").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(spmdkit.DataError, match=r"mnist.npz cannot be read: File is not a zip file.\n  Fix: replace it"):
        mnist.load(tmp_path)


def test_missing_files_are_named(tmp_path):
    fake_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(spmdkit.DataError) as e:
        mnist.load(tmp_path)
    assert "['t10k-labels-idx1-ubyte']" in str(e.value) and "Nothing is downloaded" in str(e.value)


def test_truncated_file(tmp_path):
    fake_mnist(tmp_path, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(spmdkit.DataError) as e:
        mnist.load(tmp_path)
    msg = str(e.value)
    assert "train-images-idx3-ubyte" in msg and "(64, 28, 28)" in msg and "truncated" in msg


def test_not_an_idx_file(tmp_path):
    fake_mnist(tmp_path, gz=False)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(b"<html>rate limited</html>")
    with pytest.raises(spmdkit.DataError, match="t10k-images-idx3-ubyte is not an IDX file"):
        mnist.load(tmp_path)


def test_corrupt_gzip(tmp_path):
    fake_mnist(tmp_path)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(spmdkit.DataError, match="train-labels-idx1-ubyte.gz: cannot be read as gzip"):
        mnist.load(tmp_path)


def test_label_count_mismatch(tmp_path):
    fake_mnist(tmp_path)
    mnist.write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(10, np.uint8))
    with pytest.raises(spmdkit.DataError, match=r"train labels have shape \(10,\) but there are 64 train images"):
        mnist.load(tmp_path)


def test_no_data_dir():
    with pytest.raises(spmdkit.DataError, match="--task mnist needs --data-dir"):
        spmdkit.get_task("mnist")
    assert gzip  # the module also reads .gz files through gzip


def test_train_mnist_ensemble_from_the_command_line(tmp_path):
    data = fake_mnist(tmp_path / "data", n_train=128, n_test=32) if (tmp_path / "data").mkdir() is None else None
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"}
    proc = subprocess.run(
        [sys.executable, "-m", "spmdkit._cli", "train", "--task", "mnist", "--data-dir", str(data),
         "--strategy", "ensemble", "--members", "4", "--host-devices", "4", "--steps", "12",
         "--batch-size", "32", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "mnist" and summary["members"] == 4 and summary["device_count"] == 4
    assert len(summary["member_accuracy"]) == 4 and 0 <= summary["ensemble_accuracy"] <= 1
    assert (out / "ensemble.png").exists()
