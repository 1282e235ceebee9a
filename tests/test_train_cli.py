"""``spmdkit train`` end to end, as a user runs it (subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

SPMDKIT = [sys.executable, "-m", "spmdkit._cli"]


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"}
    return subprocess.run([*SPMDKIT, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_seed002_linreg_from_the_command_line(tmp_path):
    out = run("train", "--task", "linreg", "--host-devices", "8", "--steps", "1000", "--out", str(tmp_path),
              "--no-progress")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device_count"] == 8 and summary["strategy"] == "data"
    assert abs(summary["w"] - 2) < 0.15 and abs(summary["b"] + 1) < 0.15
    assert summary["config"]["lr"] == 0.005
    for name in ("metrics.jsonl", "params.npz", "loss.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "completed after 1000 steps" in out.stdout


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('task = "digits"\nstrategy = "single"\nsteps = 30\nbatch-size = 32\nhost-devices = 2\n')
    out = run("train", "--config", str(cfg), "--steps", "12", "--out", str(tmp_path / "o"), "--no-progress")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["task"] == "digits" and summary["strategy"] == "single"
    assert summary["steps"] == 12 and summary["batch_size"] == 32
    assert 0 <= summary["eval_accuracy"] <= 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-size", "0"], "--batch-size 0 must be a whole number >= 1.\n  Fix: pass e.g. --batch-size 8."),
        (["--batch-size", "500"], "larger than the training set"),
        (["--lr", "-0.1"], "the learning rate must be a finite number > 0"),
        (["--optimizer", "lion"], "optimizer='lion' is not known"),
        (["--optimizer", "adam", "--momentum", "0.9"], "--momentum 0.9 is an option of --optimizer sgd"),
    ],
)
def test_bad_options_are_clean_errors(tmp_path, args, message):
    out = run("train", "--task", "linreg", *args, "--out", str(tmp_path), "--no-progress")
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "cifar"], "invalid choice: 'cifar'"),
        (["--strategy", "ring"], "invalid choice: 'ring'"),
        (["--learning-rate", "1"], "unrecognized arguments: --learning-rate"),
    ],
)
def test_unknown_names_are_rejected(args, message):
    out = run("train", *args)
    assert out.returncode == 2 and message in out.stderr


def test_unknown_config_key(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("batchsize = 8\n")
    out = run("train", "--config", str(cfg))
    assert out.returncode == 2 and "did you mean 'batch_size'" in out.stderr


def test_config_that_is_a_directory_exits_2_without_a_traceback(tmp_path):
    out = run("train", "--config", str(tmp_path))
    assert out.returncode == 2 and "is a directory" in out.stderr and "Traceback" not in out.stderr


def _sigint_after_20_rows(proc, metrics, timeout, check_running=False):
    """SIGINT once the run has logged 20 rows; its (stdout, stderr). Killed (SIGKILL) if it outlives ``timeout``."""
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 20):
            time.sleep(0.2)
        if check_running:
            assert proc.poll() is None, "finished before the SIGINT: nothing tested"
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_inherited_ignored_sigint_stays_ignored(tmp_path):
    # `spmdkit train ... &` in a script: the shell ignores SIGINT for it, so that a Ctrl-C meant
    # for the foreground job does not stop it. fit's Ctrl-C handler took it back.
    env = {k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"}
    proc = subprocess.Popen(
        [*SPMDKIT, "train", "--task", "linreg", "--steps", "10000", "--out", str(tmp_path), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    _, stderr = _sigint_after_20_rows(proc, tmp_path / "metrics.jsonl", 300, check_running=True)
    assert proc.returncode == 0, stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 10000


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_after_the_files_are_written_keeps_exit_code_0(tmp_path, sig):
    # Found by a kill fuzzer: about a second of JAX's clean-up follows the "wrote ..." line. A Ctrl-C
    # there was a KeyboardInterrupt traceback (exit 0) or a death by SIGINT (130); a SIGTERM, 143:
    # after a run whose summary said completed.
    env = {k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"}
    proc = subprocess.Popen([*SPMDKIT, "train", "--task", "linreg", "--steps", "20", "--out", str(tmp_path),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if "loss.png" in line:
                time.sleep(0.1)  # past the command's return, into the interpreter's exit
                assert proc.poll() is None, "it had exited: nothing tested"
                proc.send_signal(getattr(signal, sig))
                break
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_main_called_from_python_leaves_the_callers_signal_handlers(tmp_path):
    # Ignoring a late SIGINT is for the program's own exit: a test or notebook calling main([...])
    # went on with SIGINT ignored, and every process it started later inherited that.
    from spmdkit._cli import main

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert main(["train", "--task", "linreg", "--steps", "2", "--out", str(tmp_path), "--no-progress"]) == 0
    assert main(["train", "--task", "linreg", "--steps", "2", "--out", str(tmp_path / "summary.json")]) == 2  # an error
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_divergence_exits_3_naming_the_step(tmp_path):
    out = run("train", "--task", "linreg", "--lr", "40", "--out", str(tmp_path), "--no-progress")
    assert out.returncode == 3
    assert "the training loss became" in out.stderr and "at step" in out.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "diverged"


def test_ctrl_c_finishes_the_step_and_writes_what_it_has(tmp_path):
    proc = subprocess.Popen(
        [*SPMDKIT, "train", "--task", "digits", "--host-devices", "2", "--steps", "100000",
         "--out", str(tmp_path), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stdout, stderr = _sigint_after_20_rows(proc, tmp_path / "metrics.jsonl", 120)
    assert proc.returncode == 130, stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert 20 <= summary["steps"] < 100000
    assert summary["eval_accuracy"] is not None  # evaluated where it stopped
    assert (tmp_path / "params.npz").exists() and (tmp_path / "loss.png").exists()
    assert "interrupted after" in stdout


def test_data_whose_examples_do_not_fit_the_model_options_is_named(tmp_path, capsys):
    # --task lm --seq-len 16 on a data set of 65-byte windows failed in loss_fn with "incompatible
    # shapes for broadcasting: (4, 64, 16), (1, 16, 16)", blamed on the loss.
    import numpy as np

    import spmdkit
    from spmdkit._cli import main

    spmdkit.write_dataset(tmp_path / "ds", {"tokens": np.zeros((40, 65), np.uint8)})
    code = main(["train", "--task", "lm", "--data", str(tmp_path / "ds"), "--seq-len", "16", "--d-model", "16",
                 "--heads", "2", "--layers", "1", "--text-bytes", "2000", "--steps", "1", "--no-progress",
                 "--no-compile-cache", "--out", str(tmp_path / "run")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    assert "each example of ['tokens'] has shape (65,); --task lm with" in err and "reads examples of shape (17,)" in err
    assert "Fix: pass --seq-len 64 (the data set's windows are seq_len + 1 bytes)" in err  # was "the model options"
    code = main(["train", "--task", "lm", "--data", str(tmp_path / "ds"), "--seq-len", "64", "--d-model", "16",
                 "--heads", "2", "--layers", "1", "--text-bytes", "2000", "--steps", "1", "--no-progress",
                 "--no-compile-cache", "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err  # the fix, applied


def test_lm_outputs_inside_the_text_dir_are_refused(tmp_path, monkeypatch, capsys):
    from spmdkit._cli import main

    # `--text-dir .` with the default --out runs/latest: the previous run's metrics.jsonl, params.npz and
    # loss.png (and a checkpoint directory beside them) became training text without a word.
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name * 100)
    monkeypatch.chdir(tmp_path)
    lm = ["train", "--task", "lm", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--steps",
          "1", "--no-progress", "--no-compile-cache", "--text-dir", "."]
    assert main(lm) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--out runs/latest is inside --text-dir .: lm reads every non-hidden file there" in err
    assert main([*lm, "--out", str(tmp_path.parent / "elsewhere"), "--checkpoint-dir", "ck"]) == 2
    assert "--checkpoint-dir ck is inside --text-dir ." in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ck").exists()
    # Through a symbolic link the corpus follows: the run's files became training text (the example
    # count grew run after run), and --out text/link/sub, a path inside --text-dir, was taken.
    outside = tmp_path.parent / f"{tmp_path.name}-out"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    for out in (outside, tmp_path / "link" / "sub", outside / "new" / "deeper"):
        assert main([*lm, "--out", str(out)]) == 2, out
        assert f"--out {out} is inside --text-dir ." in " ".join(capsys.readouterr().err.split())
    hidden = outside / ".runs"  # the corpus skips hidden folders, also below a link
    assert main([*lm, "--out", str(hidden), "--checkpoint-dir", str(hidden / "ck")]) == 0


def test_labels_outside_the_classifiers_classes_are_named(tmp_path, capsys):
    # Labels 0..49 for the 10-class CNN made the loss NaN at step 1, reported as a diverged run
    # ("lower the learning rate, or check the data for NaN/inf").
    import numpy as np

    import spmdkit
    from spmdkit._cli import main

    rng = np.random.default_rng(0)
    image = rng.random((40, 8, 8, 1)).astype(np.float32)
    spmdkit.write_dataset(tmp_path / "ds", {"image": image, "label": np.arange(40) + 10})
    spmdkit.write_dataset(tmp_path / "flat", {"image": image[..., 0], "label": np.arange(40) % 10})
    flags = ["--task", "digits", "--steps", "1", "--batch-size", "8", "--no-progress", "--no-compile-cache"]
    assert main(["train", *flags, "--data", str(tmp_path / "ds"), "--out", str(tmp_path / "r1")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "leaf ['label'] holds dtype int64, values 10 to 49; --task digits classifies into 10 classes" in err
    assert main(["train", *flags, "--data", str(tmp_path / "flat"), "--out", str(tmp_path / "r2")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "reads examples of shape (8, 8, 1). Fix: write it again with examples of shape (8, 8, 1)." in err


def test_a_relative_data_path_resumed_from_another_directory_is_pointed_out(tmp_path, monkeypatch, capsys):
    # The checkpoint recorded --data as given: "ds" in another working directory is another data
    # set, and the resume took it for the same one without a word.
    import numpy as np

    import spmdkit
    from spmdkit._cli import main

    rng = np.random.default_rng(0)
    data = {"image": rng.random((40, 8, 8, 1)).astype(np.float32), "label": np.arange(40) % 10}
    for where in ("a", "b"):  # the same bytes (moved): a resume with other bytes is refused (test_data)
        spmdkit.write_dataset(tmp_path / where / "ds", data)
    flags = ["--task", "digits", "--batch-size", "8", "--no-progress", "--no-compile-cache", "--data", "ds",
             "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"]
    monkeypatch.chdir(tmp_path / "a")
    assert main(["train", *flags, "--steps", "2", "--out", str(tmp_path / "r1")]) == 0
    summary = json.loads((tmp_path / "r1" / "summary.json").read_text())
    assert summary["config"]["data"] == str(tmp_path / "a" / "ds")  # recorded where it is
    capsys.readouterr()
    monkeypatch.chdir(tmp_path / "b")
    assert main(["train", *flags, "--steps", "4", "--resume", "--out", str(tmp_path / "r2")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"written with --data {tmp_path / 'a' / 'ds'}, this run has --data {tmp_path / 'b' / 'ds'}" in err, err


def test_text_options_beside_a_data_set_with_its_eval_split_are_refused(tmp_path, capsys):
    """--text-dir and --text-bytes chose nothing with --data DIR (DIR/train, DIR/eval): the run
    trained on DIR, said nothing, and its summary recorded them as its corpus."""
    import numpy as np

    import spmdkit
    from spmdkit._cli import main

    tokens = np.random.default_rng(0).integers(0, 256, (64, 9)).astype(np.uint8)
    spmdkit.write_dataset(tmp_path / "ds" / "train", {"tokens": tokens[:48]})
    spmdkit.write_dataset(tmp_path / "ds" / "eval", {"tokens": tokens[48:]})
    text = tmp_path / "txt"
    text.mkdir()
    (text / "a.py").write_text("print('hello')\n" * 50)
    lm = ["train", "--task", "lm", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--steps",
          "1", "--batch-size", "8", "--no-progress", "--no-compile-cache", "--data", str(tmp_path / "ds")]
    for extra, flags in ((["--text-bytes", "5000"], "--text-bytes 5000"),
                         (["--text-dir", str(text), "--text-bytes", "9"], f"--text-dir {text} and --text-bytes 9")):
        assert main([*lm, *extra, "--out", str(tmp_path / "o")]) == 2
        assert f"{flags} would not be used: the examples come from --data" in " ".join(capsys.readouterr().err.split())
    assert main([*lm, "--out", str(tmp_path / "o")]) == 0
