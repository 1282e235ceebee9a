"""A data set directory with a held-out split: `spmdkit data write DIR --task NAME` writes
DIR/train and DIR/eval, `spmdkit train --data DIR` trains on one and evaluates on the other,
and a missing or mismatched eval split is named with its directory, leaf, shapes and fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

import spmdkit
from spmdkit._cli import main
from spmdkit._config import build_run_config
from spmdkit._data._splits import data_splits, write_splits
from spmdkit._tasks import mnist
from spmdkit._train_cli import build_task, resolve_options


def _raw_mnist(directory, n_train=16, n_test=12):
    rng = np.random.default_rng(0)
    directory.mkdir()
    for which, n in (("train", n_train), ("t10k", n_test)):
        mnist.write_idx(directory / f"{which}-images-idx3-ubyte", rng.integers(0, 255, (n, 28, 28)).astype(np.uint8))
        mnist.write_idx(directory / f"{which}-labels-idx1-ubyte", rng.integers(0, 10, n).astype(np.uint8))
    return directory


def _err(capsys):
    return "".join(capsys.readouterr().err.split())  # the console wraps lines, and folds long paths anywhere


def _said(*texts):
    return ["".join(t.split()) for t in texts]


def test_mnist_trains_and_evaluates_from_data_alone(tmp_path, capsys):
    raw, data, out = _raw_mnist(tmp_path / "raw"), tmp_path / "mnist", tmp_path / "run"
    assert main(["data", "write", str(data), "--task", "mnist", "--data-dir", str(raw)]) == 0
    assert sorted(p.name for p in data.iterdir()) == ["eval", "train"]
    assert main(["data", "check", str(data)]) == 0
    capsys.readouterr()
    assert main(["train", "--task", "mnist", "--data", str(data), "--steps", "2", "--batch-size", "8",
                 "--eval-batch-size", "8", "--no-progress", "--out", str(out)]) == 0  # no --data-dir
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["eval_loss"] is not None and "eval_accuracy" in summary
    assert summary["epochs"] == 1.0 and summary["examples_seen"] == 16
    # the eval split is the raw test set: the same figure as from the task's own files
    task = build_task(build_run_config(resolve_options({"task": "mnist", "data": str(data)})))
    own = mnist.make(str(raw))
    np.testing.assert_array_equal(task.eval_data["image"], own.eval_data["image"])


def test_digits_from_data_alone_and_the_layout_errors(tmp_path, capsys):
    from spmdkit._tasks import digits

    data = tmp_path / "digits"
    assert main(["data", "write", str(data), "--task", "digits"]) == 0
    run = lambda **o: build_run_config(resolve_options({"task": "digits", **o}))  # noqa: E731
    task = build_task(run(data=str(data)))
    _, test = digits.load()
    assert task.num_eval == len(test["label"]) and task.num_train == 1797 - len(test["label"])
    # a mismatched eval split: MNIST-sized images against digits'
    write_splits(tmp_path / "other", {"image": np.zeros((4, 28, 28, 1), np.float32), "label": np.zeros(4, np.int32)},
                 {"image": np.zeros((2, 28, 28, 1), np.float32), "label": np.zeros(2, np.int32)})
    assert main(["train", "--task", "digits", "--data", str(data), "--eval-data", str(tmp_path / "other"),
                 "--no-progress"]) == 2
    err = _err(capsys)
    want = f"--eval-data {tmp_path / 'other' / 'eval'}: leaf ['image'] holds examples of shape (28, 28, 1)"
    assert _said(want)[0] in err
    assert all(t in err for t in _said(f"{data / 'train'} holds shape (8, 8, 1)", "Fix: write both splits"))
    # a missing eval split (an interrupted write): the directory, the file and the flags that fix it
    (data / "eval" / "manifest.json").unlink()
    assert main(["train", "--task", "digits", "--data", str(data), "--no-progress"]) == 2
    err = _err(capsys)
    assert all(t in err for t in _said("has a training split but no eval split", "eval/manifest.json is missing"))
    assert all(t in err for t in _said("--task digits --overwrite", "--eval-data"))
    with pytest.raises(spmdkit.DataError, match="pass .*train as train_data"):
        spmdkit.load_dataset(data)
    (data / "train" / "manifest.json").unlink()  # the training split's write interrupted, too
    assert main(["train", "--task", "digits", "--data", str(data), "--no-progress"]) == 2
    assert _said(f"{data / 'train'} exists without its manifest.json: its write was interrupted")[0] in _err(capsys)


def test_a_single_data_set_for_mnist_needs_an_eval_split_or_data_dir(tmp_path, capsys):
    flat = spmdkit.write_dataset(tmp_path / "flat", {"image": np.zeros((4, 28, 28, 1), np.float32),
                                                     "label": np.zeros(4, np.int32)})
    assert main(["train", "--task", "mnist", "--data", str(flat), "--no-progress"]) == 2
    err = _err(capsys)
    assert _said(f"--data {flat} is a single data set (no eval split)")[0] in err
    assert _said(f"spmdkit data write {flat} --task mnist --data-dir RAW")[0] in err
    with pytest.raises(spmdkit.DataError, match=r"--eval-data .*flat has leaves \['image'\], \['label'\]; the "
                       r"training split .*xy/train has \['x'\], \['y'\]"):
        xy = write_splits(tmp_path / "xy", {"x": np.ones(3), "y": np.ones(3)}, {"x": np.ones(2), "y": np.ones(2)})
        build_task(build_run_config(resolve_options({"task": "mnist", "data": str(xy), "eval_data": str(flat)})))
    with pytest.raises(spmdkit.DataError, match=r"its training data hold \['x', 'y'\]; it reads 'image'"):
        build_task(build_run_config(resolve_options({"task": "mnist", "data": str(xy)})))
    assert main(["train", "--task", "mnist", "--data", str(tmp_path / "nowhere"), "--no-progress"]) == 2
    assert _said(f"--data {tmp_path / 'nowhere'} does not exist")[0] in _err(capsys)


def test_a_data_set_of_other_leaves_than_the_task_reads_is_named_before_training(tmp_path, capsys):
    digits_like = {"image": np.ones((4, 8, 8, 1), np.float32), "label": np.zeros(4, np.int32)}
    both = write_splits(tmp_path / "both", digits_like, digits_like)
    assert main(["train", "--task", "linreg", "--data", str(both), "--no-progress", "--steps", "1"]) == 2
    err = _err(capsys)  # not "KeyError: 'x'" from the first step
    assert all(t in err for t in _said(f"--data {both / 'train'} holds leaves ['image'], ['label']; --task linreg "
                                       "reads ['x'], ['y']", "arrays named x, y"))
    flat = spmdkit.write_dataset(tmp_path / "flat", {"x": np.ones((4, 1), np.float32)})
    with pytest.raises(spmdkit.DataError, match=r"holds leaves \['x'\]; --task linreg reads \['x'\], \['y'\]"):
        build_task(build_run_config(resolve_options({"task": "linreg", "data": str(flat)})))


def test_a_single_data_set_with_an_eval_folder_inside_is_refused_not_ignored(tmp_path, capsys):
    xy = {"x": np.ones((8, 1), np.float32), "y": np.zeros((8, 1), np.float32)}
    flat = spmdkit.write_dataset(tmp_path / "flat", xy)
    spmdkit.write_dataset(flat / "eval", xy)  # the user's held-out set, put where a split would be
    assert main(["train", "--task", "linreg", "--data", str(flat), "--no-progress", "--steps", "1"]) == 2
    err = _err(capsys)
    assert all(t in err for t in _said(f"with a folder {flat / 'eval'} inside it", f"--eval-data {flat / 'eval'}"))
    # the fix it names works: the same folder evaluated on explicitly
    assert data_splits(flat, flat / "eval") == (flat, flat / "eval")
    assert main(["train", "--task", "linreg", "--data", str(flat), "--eval-data", str(flat / "eval"),
                 "--batch-size", "8", "--eval-batch-size", "8", "--steps", "1", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
