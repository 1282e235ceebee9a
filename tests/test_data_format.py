"""The on-disk data set: written from arrays, read lazily, damaged files named."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import spmdkit
from spmdkit._data import DatasetCorruptError, DatasetFileError, DatasetLayoutError

ARRAYS = {"image": np.arange(40, dtype=np.float32).reshape(10, 2, 2), "label": np.arange(10, dtype=np.int32),
          "meta": {"w": np.ones(10, np.float16)}}


def test_round_trip_is_lazy_and_exact(tmp_path):
    d = spmdkit.write_dataset(tmp_path / "ds", ARRAYS)
    data = spmdkit.load_dataset(d, verify=True)
    assert isinstance(data["image"], np.memmap)  # read lazily
    for got, want in zip((data["image"], data["label"], data["meta"]["w"]),
                         (ARRAYS["image"], ARRAYS["label"], ARRAYS["meta"]["w"])):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["count"] == 10 and manifest["version"] == 1
    with pytest.raises(spmdkit.DataError, match="exists and is not empty"):
        spmdkit.write_dataset(d, ARRAYS)
    spmdkit.write_dataset(d, ARRAYS, overwrite=True)


def test_batched_reads_equal_per_example_reads(tmp_path):
    source = spmdkit.DatasetSource(spmdkit.write_dataset(tmp_path / "ds", ARRAYS))
    idx = np.array([7, 2, 9, 2, 0, 5])  # unsorted, with a repeat
    batch, listed = source.rows(idx), source._getitems(idx)
    assert source.__getitems__ is not None and len(listed) == len(idx)
    for pos, i in enumerate(idx):
        one = source[int(i)]
        for path, want in ((("image",), one["image"]), (("label",), one["label"]), (("meta", "w"), one["meta"]["w"])):
            got, item = batch, listed[pos]
            for k in path:
                got, item = got[k], item[k]
            assert got.dtype == want.dtype and item.dtype == want.dtype
            np.testing.assert_array_equal(got[pos], want)
            np.testing.assert_array_equal(item, want)
    assert source.rows([])["image"].shape == (0, 2, 2)
    with pytest.raises(IndexError, match="example 10 of .* holds 10"):
        source.rows([3, 10])


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(spmdkit.DataError, match="same number of examples"):
        spmdkit.write_dataset(tmp_path / "a", {"x": np.ones(3), "y": np.ones(4)})
    with pytest.raises(spmdkit.DataError, match="dtype <U1"):
        spmdkit.write_dataset(tmp_path / "b", {"x": np.array(list("abc"))})
    with pytest.raises(spmdkit.DataError, match="hold no examples"):  # refused when written, not when read
        spmdkit.write_dataset(tmp_path / "c", {"x": np.zeros((0, 3), np.float32)})
    assert not (tmp_path / "c" / "manifest.json").exists()
    import ml_dtypes  # a dependency of jax
    with pytest.raises(spmdkit.DataError, match="no bfloat16: store float32"):
        spmdkit.write_dataset(tmp_path / "d", {"x": np.ones((2, 2), ml_dtypes.bfloat16)})
    with pytest.raises(DatasetFileError, match="does not exist"):
        spmdkit.load_dataset(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetFileError, match="manifest.json is missing") as e:
        spmdkit.load_dataset(tmp_path / "empty")
    # DIR is data write's first argument: the command the fix shows must parse as written.
    assert f"`spmdkit data write {tmp_path / 'empty'} --task NAME`" in str(e.value) and " --out DIR" not in str(e.value)


def test_a_place_that_cannot_be_written_exits_5_and_a_file_in_the_way_2(tmp_path, capsys):
    from spmdkit._cli import main

    with pytest.raises(spmdkit.DatasetWriteError, match="cannot write the data set /proc/dd: No such file") as e:
        spmdkit.write_dataset("/proc/dd", ARRAYS)  # /proc takes no new directory, even from root
    assert isinstance(e.value, OSError)
    assert main(["data", "write", "/proc/dd", "--task", "linreg"]) == 5  # both splits: the top directory named
    assert "cannot write the data set /proc/dd:" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert main(["data", "write", str(tmp_path / "f"), "--task", "linreg", "--split", "train"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert main(["data", "write", str(tmp_path / "f" / "sub"), "--task", "linreg"]) == 2
    assert "a file stands where a directory is needed" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "manifest", "version", "dtype"])
def test_damaged_data_set_is_a_named_error_with_the_path(tmp_path, damage):
    d = spmdkit.write_dataset(tmp_path / "ds", ARRAYS)
    f, m = d / "label.npy", d / "manifest.json"
    manifest = json.loads(m.read_text())
    expect, verify = {"missing": DatasetFileError, "truncated": DatasetCorruptError, "flipped": DatasetCorruptError,
                      "manifest": DatasetLayoutError, "version": DatasetLayoutError, "dtype": DatasetLayoutError}[damage], False
    if damage == "missing":
        f.unlink()
    elif damage == "truncated":
        f.write_bytes(f.read_bytes()[:-7])
    elif damage == "flipped":
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
        verify = True
    elif damage == "manifest":
        m.write_text("{not json")
    elif damage == "version":
        m.write_text(json.dumps({**manifest, "version": 99}))
    else:  # the file was replaced by one of another dtype (same size)
        np.save(f, ARRAYS["label"].astype(np.float32))
    with pytest.raises(expect, match="Fix:") as info:
        spmdkit.load_dataset(d, verify=verify)
    assert str(d) in str(info.value)
    assert isinstance(info.value, spmdkit.DataError)


def test_a_task_trains_from_a_data_set_directory(tmp_path):
    import jax.numpy as jnp, optax  # noqa: E401

    x = np.linspace(-1, 1, 64, dtype=np.float32)
    d = spmdkit.write_dataset(tmp_path / "line", {"x": x, "y": 3 * x + 1})

    def task(data):
        return spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
                            loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
                            train_data=data)

    config = spmdkit.TrainConfig(steps=10, batch_size=16)
    from_dir = spmdkit.fit(task(str(d)), spmdkit.DataParallel(), optax.sgd(0.3), config, progress=False)
    from_arrays = spmdkit.fit(task({"x": x, "y": 3 * x + 1}), spmdkit.DataParallel(), optax.sgd(0.3), config,
                              progress=False)
    np.testing.assert_array_equal(from_dir.params["w"], from_arrays.params["w"])


def test_cli_writes_checks_and_trains_from_a_data_set(tmp_path, capsys):
    from spmdkit._cli import main

    d = tmp_path / "lin"
    assert main(["data", "write", str(d), "--task", "linreg"]) == 0
    assert main(["data", "check", str(d), "--verify"]) == 0
    assert "intact (CRC-32 verified)" in capsys.readouterr().out
    raw = bytearray((d / "train" / "x.npy").read_bytes())
    raw[-1] ^= 1  # a flipped bit: every size, shape and dtype still as the manifest says
    (d / "train" / "x.npy").write_bytes(bytes(raw))
    assert main(["data", "check", str(d)]) == 0  # it was "intact", which --verify then refuted
    assert "contents not checked (--verify reads every file" in capsys.readouterr().out
    assert main(["data", "check", str(d), "--verify"]) == 2
    assert "checksum" in capsys.readouterr().err
    assert main(["data", "write", str(d), "--task", "linreg", "--overwrite"]) == 0
    out = tmp_path / "run"
    assert main(["train", "--task", "linreg", "--data", str(d), "--steps", "3", "--no-progress", "--out", str(out),
                 "--prefetch", "1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    (d / "train" / "x.npy").unlink()  # the task's data is written as DIR/train and DIR/eval
    assert main(["train", "--task", "linreg", "--data", str(d), "--steps", "3", "--no-progress",
                 "--out", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # as wrapped by the console
    assert "x.npy (leaf x) is missing" in err and "Fix:" in err


def test_mnist_and_digits_are_readable_through_the_data_set_path(tmp_path):
    from spmdkit._cli import main
    from spmdkit._tasks import digits, get_task, mnist

    rng = np.random.default_rng(0)
    raw = tmp_path / "raw"
    raw.mkdir()
    for which, n in (("train", 32), ("t10k", 8)):
        mnist.write_idx(raw / f"{which}-images-idx3-ubyte", rng.integers(0, 255, (n, 28, 28)).astype(np.uint8))
        mnist.write_idx(raw / f"{which}-labels-idx1-ubyte", rng.integers(0, 10, n).astype(np.uint8))
    assert main(["data", "write", str(tmp_path / "mnist"), "--task", "mnist", "--data-dir", str(raw)]) == 0
    task = get_task("mnist", data_dir=str(raw))
    on_disk = spmdkit.load_dataset(tmp_path / "mnist" / "train")
    for k in ("image", "label"):
        np.testing.assert_array_equal(on_disk[k], task.train_data[k])
    train, _ = digits.load()
    spmdkit.write_dataset(tmp_path / "digits", train)
    assert spmdkit.Task(name="d", init=task.init, loss_fn=task.loss_fn,
                        train_data=str(tmp_path / "digits")).num_train == len(train["label"])


def test_cli_writes_from_an_npz_and_names_a_missing_one(tmp_path, capsys):
    from spmdkit._cli import main

    np.savez(tmp_path / "a.npz", x=np.arange(6.0), y=np.arange(6))
    assert main(["data", "write", str(tmp_path / "ds"), "--npz", str(tmp_path / "a.npz")]) == 0
    assert spmdkit.load_dataset(tmp_path / "ds")["x"].tolist() == list(np.arange(6.0))
    assert main(["data", "write", str(tmp_path / "ds2"), "--npz", str(tmp_path / "missing.npz")]) == 2
    assert "missing.npz: cannot be read" in " ".join(capsys.readouterr().err.split())  # as wrapped by the console


def test_a_task_given_a_data_set_directory_checks_its_crc32s_as_the_command_does(tmp_path):
    # fit(Task(train_data=DIR)) trained on negated labels swapped in, without a word; the command refused them.
    import jax.numpy as jnp

    x = np.arange(32.0, dtype=np.float32).reshape(16, 2)
    spmdkit.write_dataset(tmp_path / "ds", {"x": x, "y": x[:, 0].copy()})
    np.save(tmp_path / "ds" / "y.npy", -x[:, 0])  # same shape, dtype and size
    task = lambda **data: spmdkit.Task(name="lin", init=lambda r: {"w": jnp.zeros(2)},  # noqa: E731
                                       loss_fn=lambda p, b, r: (jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), {}), **data)
    for data in ({"train_data": tmp_path / "ds"}, {"train_data": {"x": x, "y": x[:, 0]}, "eval_data": str(tmp_path / "ds")}):
        with pytest.raises(DatasetCorruptError, match=r"(?s)y.npy: checksum .* differs from the manifest's"):
            task(**data)
    assert task(train_data=spmdkit.load_dataset(tmp_path / "ds")).num_train == 16  # unchecked, by choice


def test_cli_train_refuses_a_file_swapped_for_another_of_the_same_shape(tmp_path, capsys):
    # Sizes, shapes and dtypes all match: only the CRC-32 tells, and `spmdkit train --data`
    # checks it by default, before the first step.
    from spmdkit._cli import main

    d = tmp_path / "lin"
    assert main(["data", "write", str(d), "--task", "linreg"]) == 0
    y = d / "train" / "y.npy"
    np.save(y, np.load(y)[::-1].copy())  # the labels of another ordering: same shape, dtype and size
    out = tmp_path / "run"
    args = ["train", "--task", "linreg", "--data", str(d), "--steps", "2", "--no-progress", "--out", str(out)]
    capsys.readouterr()
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "y.npy: checksum" in err and "differs from the manifest's" in err and "Fix:" in err
    assert not (out / "summary.json").exists()  # refused before training
    assert main([*args, "--no-verify-data"]) == 0  # the user's choice: opened unverified, as load_dataset does
    off = _toml(tmp_path, "verify-data = false")
    assert main([*args, "--config", str(off)]) == 0
    assert main([*args, "--config", str(off), "--verify-data"]) == 2  # the flag turns the file's choice back on
    capsys.readouterr()
    assert main(["train", "--config", str(_toml(tmp_path, 'verify-data = "no"')), "--data", str(d)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "verify-data = true" in err and "--no-verify-data on the command line" in err, err


def _toml(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    return path


def test_overwriting_a_data_set_leaves_its_open_readers_the_old_rows(tmp_path):
    # np.save over the file truncated it under the reader's memory map: the reader saw the new
    # rows silently, then died with SIGBUS past the new end. Each file is now renamed into place.
    d = spmdkit.write_dataset(tmp_path / "ds", {"x": np.arange(40000.0).reshape(10000, 4)})
    reading = spmdkit.load_dataset(d)
    spmdkit.write_dataset(d, {"x": np.ones((10, 4))}, overwrite=True)
    np.testing.assert_array_equal(reading["x"][5], [20.0, 21.0, 22.0, 23.0])
    np.testing.assert_array_equal(reading["x"][9999], [39996.0, 39997.0, 39998.0, 39999.0])
    assert spmdkit.load_dataset(d, verify=True)["x"].shape == (10, 4)
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "x.npy"]  # no temporary left


@pytest.mark.parametrize("edit, words", [
    (lambda m: m["leaves"][1].update(key=["image"]), r"leaf key \['image'\] is given twice"),
    (lambda m: m["leaves"][1].update(key=["image", "x"]), r"\['image'\] is both a leaf and the parent of"),
    (lambda m: m["leaves"][0].update(key=[]), r"leaf key \[\] is not a list of non-empty strings"),
    (lambda m: m["leaves"][0].update(key="image"), r"leaf key 'image' is not a list"),
    (lambda m: m["leaves"][0].update(key=[1]), r"leaf key \[1\] is not a list"),
    (lambda m: m.update(count=10.5), r"count 10.5 is not a whole number"),
    (lambda m: m["leaves"][0].update(file="../other/image.npy"), r"is not a file name inside the data set"),
    (lambda m: m["leaves"][0].pop("crc32"), r"lacks or mangles a field \(KeyError: 'crc32'\)"),
    # a raw TypeError ('<' between int and str), and a "replaced" file of shape ('1', '0')
    (lambda m: m["leaves"][0].update(bytes=str(m["leaves"][0]["bytes"])), r"bytes '\d+' is not a whole number"),
    (lambda m: m["leaves"][0].update(bytes=-1), r"bytes -1 is not a whole number"),
    (lambda m: m["leaves"][0].update(shape="10"), r"shape '10' is not a list of whole numbers"),
    (lambda m: m["leaves"][0].update(shape=[10.0, 4]), r"shape \[10.0, 4\] is not a list of whole numbers"),
])
def test_a_hand_edited_manifest_is_named_not_loaded_wrong(tmp_path, edit, words):
    # Two leaves under one key lost one silently; a key "xy" became the path x/y; an empty or
    # clashing key, or a missing crc32 under verify=True, was a bare Python error.
    d = spmdkit.write_dataset(tmp_path / "ds", ARRAYS)
    manifest = json.loads((d / "manifest.json").read_text())
    edit(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))
    for verify in (False, True):
        with pytest.raises(DatasetLayoutError, match=words):
            spmdkit.load_dataset(d, verify=verify)


def test_other_byte_orders_are_stored_native_or_named(tmp_path):
    # write_dataset stored a big-endian array as it was, and training from it (or from the array
    # itself) failed with a TaskError blaming loss_fn: "dtype('>f4') is not a valid dtype for JAX".
    big = {"x": np.arange(6, dtype=">f4"), "y": np.arange(6, dtype=">i8")}
    data = spmdkit.load_dataset(spmdkit.write_dataset(tmp_path / "ds", big), verify=True)
    assert data["x"].dtype == np.float32 and data["y"].dtype == np.int64 and data["x"].dtype.isnative
    np.testing.assert_array_equal(data["x"], big["x"])
    task = lambda d: spmdkit.Task(name="t", init=lambda k: {"w": np.zeros((), np.float32)},
                                  loss_fn=lambda p, b, r: ((p["w"] * b["x"]).mean(), {}), train_data=d)
    assert task(str(tmp_path / "ds")).num_train == 6
    with pytest.raises(spmdkit.DataError, match=r"train_data\['x'\] has dtype >f4, whose byte order is not"):
        task(big)


@pytest.mark.parametrize("damage", ["half", "10 bytes short", "stub", "empty", "bad crc"])
def test_cli_names_a_damaged_npz(tmp_path, capsys, damage):
    # A zip cut short or corrupt was a bare zipfile.BadZipFile (an empty file an EOFError), exit 1.
    from spmdkit._cli import main

    np.savez(tmp_path / "a.npz", x=np.arange(600.0), y=np.arange(600))
    whole = (tmp_path / "a.npz").read_bytes()
    flipped = bytearray(whole)
    flipped[len(whole) // 3] ^= 0xFF
    (tmp_path / "a.npz").write_bytes({"half": whole[:len(whole) // 2], "10 bytes short": whole[:-10],
                                      "stub": b"PK\x03\x04garbage", "empty": b"", "bad crc": bytes(flipped)}[damage])
    assert main(["data", "write", str(tmp_path / "ds"), "--npz", str(tmp_path / "a.npz")]) == 2
    err = " ".join(capsys.readouterr().err.split())  # as wrapped by the console
    assert f"--npz {tmp_path / 'a.npz'}: the file is damaged (truncated or corrupt" in err and "intact copy" in err


def test_an_npy_given_as_npz_is_named_as_one_bare_array(tmp_path, capsys):
    # np.load returns the array itself for an .npy: `with` on it was a bare TypeError, exit 1.
    from spmdkit._cli import main

    np.save(tmp_path / "a.npy", np.arange(6.0))
    assert main(["data", "write", str(tmp_path / "ds"), "--npz", str(tmp_path / "a.npy")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "it holds one bare array of shape (6,) (an .npy file), not named arrays" in err and "numpy.savez" in err
    with pytest.raises(spmdkit.DataError, match=r"is not a params file \(it holds one bare array of shape \(6,\)"):
        spmdkit.load_params(tmp_path / "a.npy")


@pytest.mark.parametrize("content", [bytes(range(7, 200)), b"\x80\x04\x95" + bytes(40)], ids=["random", "pickle"])
def test_a_file_that_is_no_npz_is_named_without_numpys_pickle_advice(tmp_path, capsys, content):
    # numpy calls such a file "pickled (object) data" and offers allow_pickle: random bytes were read
    # as a pickle by the message, and load_params said "holds object arrays".
    from spmdkit._cli import main

    bad = tmp_path / "a.npz"
    bad.write_bytes(content)
    assert main(["data", "write", str(tmp_path / "ds"), "--npz", str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    start = repr(content[:8])
    assert f"neither a zip archive of named arrays (.npz) nor an .npy array: it starts with the bytes {start}" in err
    assert "allow_pickle" not in err and "never loads a pickle" in err
    with pytest.raises(spmdkit.DataError, match=r"is not a params file \(neither a zip archive") as e:
        spmdkit.load_params(bad)
    assert "object arrays" not in str(e.value)
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object))  # the case that does hold objects
    with pytest.raises(spmdkit.DataError, match="holds object arrays"):
        spmdkit.load_params(tmp_path / "obj.npz")


def test_no_arrays_is_named_as_such(tmp_path, capsys):
    # An empty dict (or an .npz without arrays) was "every array needs the same number of examples; got {}".
    from spmdkit._cli import main

    with pytest.raises(spmdkit.DataError, match=r"write_dataset: the data hold no arrays"):
        spmdkit.write_dataset(tmp_path / "ds", {})
    np.savez(tmp_path / "empty.npz")
    assert main(["data", "write", str(tmp_path / "ds"), "--npz", str(tmp_path / "empty.npz")]) == 2
    assert "hold no arrays" in capsys.readouterr().err


def test_the_printed_train_command_quotes_a_path_with_spaces(tmp_path, capsys, monkeypatch):
    # "--data my data/ds" was printed bare: pasted, it passed two arguments.
    import shlex

    from spmdkit._cli import main

    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "a.npz", x=np.zeros((3, 2), np.float32))
    assert main(["data", "write", "my data/dä ds", "--npz", "a.npz"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert shlex.split(printed.split("train with ")[1])[-2:] == ["--data", "my data/dä ds"]


@pytest.mark.parametrize("indices, words", [(np.array([True, False] * 5), r"dtype bool \(a boolean mask: pass "
                                                                           r"np.flatnonzero\(mask\)\)"),
                                            ([1.7, 2.2], r"dtype float64")])
def test_rows_takes_example_numbers_only(tmp_path, indices, words):
    # Cast to int64, a boolean mask read rows [1, 0, 1, 0, ...] and 1.7 read row 1, silently.
    source = spmdkit.DatasetSource(spmdkit.write_dataset(tmp_path / "ds", ARRAYS))
    with pytest.raises(IndexError, match=words):
        source.rows(indices)
    assert source.rows([])["label"].shape == (0,) and source.rows(np.array([3], np.uint8))["label"].tolist() == [3]


def test_overwrite_replaces_a_data_set_never_a_directory_of_other_files(tmp_path):
    # --overwrite replaced a user's own manifest.json and x.npy in a directory of other files, silently.
    own = tmp_path / "mine"
    own.mkdir()
    (own / "manifest.json").write_text('{"my": "config"}')
    np.save(own / "x.npy", np.arange(5))
    with pytest.raises(spmdkit.DataError, match=r"is not a data set \(its manifest.json is not an spmdkit"):
        spmdkit.write_dataset(own, {"x": np.zeros(3)}, overwrite=True)
    (own / "manifest.json").unlink()
    (own / "notes.txt").write_text("important")
    with pytest.raises(spmdkit.DataError, match=r"is not a data set \(it holds \['notes.txt'\]\)"):
        spmdkit.write_dataset(own, {"x": np.zeros(3)}, overwrite=True)
    assert np.load(own / "x.npy").tolist() == [0, 1, 2, 3, 4] and (own / "notes.txt").read_text() == "important"
    # a data set, and an interrupted write of one (no manifest yet), are replaced
    d = spmdkit.write_dataset(tmp_path / "ds", ARRAYS)
    (d / "manifest.json").unlink()
    assert spmdkit.load_dataset(spmdkit.write_dataset(d, {"x": np.zeros(3)}, overwrite=True))["x"].shape == (3,)
    assert spmdkit.load_dataset(spmdkit.write_dataset(d, {"x": np.zeros(4)}, overwrite=True))["x"].shape == (4,)


def test_overwrite_removes_the_old_data_sets_files_it_no_longer_uses(tmp_path):
    # The old leaves' files stayed behind, unlisted, and took their disk space.
    d = spmdkit.write_dataset(tmp_path / "ds", ARRAYS)
    spmdkit.write_dataset(d, {"x": np.zeros(3)}, overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "x.npy"]
    (d / "manifest.json").unlink()  # an interrupted write: its .npy files go too
    np.save(d / "old.npy", np.zeros(2))
    spmdkit.write_dataset(d, {"y": np.zeros(3)}, overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "y.npy"]


def _as_a_user_without_root_powers() -> list[str]:
    """A command prefix under which file modes apply (root reads everything: setpriv drops that)."""
    import os
    import shutil

    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file modes do not apply")
    return ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.parametrize("lock", ["train", "train/manifest.json", "train/x.npy"])
def test_a_data_set_this_user_may_not_read_is_named_with_the_fix(tmp_path, lock):
    # A bare PermissionError (spmdkit data check, train --data), or "not valid JSON ... write the data
    # set again" / "cannot be read as .npy ... write the data set again", which is no fix.
    import subprocess
    import sys
    from pathlib import Path

    from spmdkit._data._splits import write_splits

    write_splits(tmp_path / "ds", {"x": np.zeros((4, 2))}, {"x": np.zeros((2, 2))})
    (tmp_path / "ds" / lock).chmod(0)
    code = ("import sys, spmdkit\nfrom spmdkit._cli import main\n"
            "sys.exit(main(['data', 'check', '--verify', sys.argv[1]]) * 10 + main(['data', 'check', sys.argv[2]]))")
    src = str(Path(spmdkit.__file__).parents[1])
    try:
        done = subprocess.run([*_as_a_user_without_root_powers(), sys.executable, "-c", code, str(tmp_path / "ds"),
                               str(tmp_path / "ds" / "train")], capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    finally:
        (tmp_path / "ds" / lock).chmod(0o755)
    err = " ".join(done.stderr.split())
    assert done.returncode == 22, done.stderr[-2000:]
    assert err.count("permission denied. Fix: make it readable for this user (chmod -R u+rX") == 2
    assert "Traceback" not in err


def test_keys_that_differ_only_in_case_get_files_that_differ_in_more(tmp_path):
    """On macOS's and Windows' default disks "X.npy" and "x.npy" are one file: the second
    array overwrote the first, and both keys silently read the same rows."""
    arrays = {"X": np.zeros(4, np.float32), "x": np.ones(4, np.float32)}
    d = spmdkit.write_dataset(tmp_path / "ds", arrays)
    files = [e["file"] for e in json.loads((d / "manifest.json").read_text())["leaves"]]
    assert len({f.lower() for f in files}) == 2, files
    data = spmdkit.load_dataset(d, verify=True)
    np.testing.assert_array_equal(data["X"], arrays["X"])
    np.testing.assert_array_equal(data["x"], arrays["x"])


def test_a_long_key_gets_a_file_name_the_disk_takes(tmp_path):
    """A file name holds 255 bytes: a 300-character key failed as "File name too long", with
    the fix "choose a directory you can write to, on a disk with free space" (exit 5)."""
    long_a, long_b = "feature_" + "a" * 300, "feature_" + "a" * 299 + "b"  # one stem if only cut short
    arrays = {long_a: np.arange(4.0), long_b: np.ones(4), "nested": {"n" * 200: np.zeros(4)}}
    d = spmdkit.write_dataset(tmp_path / "ds", arrays)
    files = [e["file"] for e in json.loads((d / "manifest.json").read_text())["leaves"]]
    assert len(set(files)) == 3 and max(map(len, files)) <= 130, files
    data = spmdkit.load_dataset(d, verify=True)
    np.testing.assert_array_equal(data[long_a], arrays[long_a])
    np.testing.assert_array_equal(data[long_b], arrays[long_b])
    assert list(data["nested"]) == ["n" * 200]
    with pytest.raises(spmdkit.DataError, match="a name in the path is longer than the file system allows") as e:
        spmdkit.write_dataset(tmp_path / ("d" * 300), arrays)  # the directory's own name: bad input, not the disk
    assert not isinstance(e.value, spmdkit.DatasetWriteError)


def test_a_directory_in_a_leaf_files_place_is_not_called_missing(tmp_path):
    d = spmdkit.write_dataset(tmp_path / "ds", ARRAYS)
    (d / "label.npy").unlink()
    (d / "label.npy").mkdir()  # `ls` shows it: "is missing" sent the user looking for a file that is there
    with pytest.raises(DatasetFileError, match=r"label.npy \(leaf label\) is not a file \(a directory stands"):
        spmdkit.load_dataset(d)


def test_non_finite_values_are_written_with_a_warning(tmp_path, capsys):
    """NaN and inf were stored without a word; the run reading them stopped at its first step."""
    from spmdkit._cli import main

    x = np.ones((70_000, 2), np.float32)
    x[3, 1], x[66_000, 0], x[66_001, 1] = np.nan, np.inf, -np.inf  # the last two in the second piece read
    with pytest.warns(RuntimeWarning, match=r"x holds 1 NaN and 2 inf \(the first in row 3\).*nan_to_num") as w:
        d = spmdkit.write_dataset(tmp_path / "ds", {"x": x, "y": np.arange(70_000)})
    assert w[0].filename == __file__  # points at the caller's line
    np.testing.assert_array_equal(spmdkit.load_dataset(d)["x"], x)  # written as they are
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # finite floats and integers: no warning
        spmdkit.write_dataset(tmp_path / "ok", {"x": np.ones((4, 2), np.float16), "y": np.arange(4)})
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.array([[0.0, np.nan]], np.float32), y=np.array([1]))
    assert main(["data", "write", str(tmp_path / "cli"), "--npz", str(bad)]) == 0
    assert "warning: write_dataset: x holds 1 NaN and 0 inf (the first in row 0)" in capsys.readouterr().err
