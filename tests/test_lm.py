"""The lm task: a byte-level transformer on the stdlib sources, on every layout."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._train._steps import task_state
from spmdkit._cli import main
from spmdkit._sample import load_lm
from spmdkit._tasks import lm

# A tiny model (8 heads so that tp over 8 devices splits them) on 20 kB of text.
SIZES = dict(layers=2, d_model=32, heads=8, seq_len=16, text_bytes=20_000)
CONFIG = spmdkit.TrainConfig(steps=6, batch_size=16, eval_every=1000)
LAYOUTS = [("dp", {"data": 8}), ("fsdp", {"data": 8}), ("tp", {"model": 8}), ("fsdp+tp", {"data": 2, "model": 4}),
           ("fsdp+sp", {"data": 2, "model": 4}), ("hsdp+tp", {"data": 2, "fsdp": 2, "model": 2})]
# Float32 sums run in other orders on other layouts, and Adam divides each gradient by its own
# size, so a near-zero gradient's rounding moves its parameter by a visible part of the learning
# rate (1.06e-5 seen on a CI machine, 1/1700 of lr x steps). The bound is 1/180 of lr x steps, and
# the held-out bits per byte must still agree to 1e-5.
TOLERANCE = 1e-4


def _fit(task, strategy, config=CONFIG, **kw):
    return spmdkit.fit(task, strategy, optax.adamw(3e-3), config, progress=False, log=lambda m: None, **kw)


def _sharded(rules):
    return spmdkit.Sharded(spmdkit.make_mesh(**dict(LAYOUTS)[rules]), rules)


@pytest.fixture(scope="module")
def task():
    return lm.make(**SIZES)


@pytest.fixture(scope="module")
def one_device(task):
    return _fit(task, spmdkit.Single())


@pytest.fixture(scope="module")
def fsdp_tp(task):
    return _fit(task, _sharded("fsdp+tp"))


def test_data_is_the_stdlib_split_into_windows(task):
    files = lm.text_files()
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)
    train, held = lm.load_text(text_bytes=20_000)
    assert len(train) == 20_000 and len(held) == 2_000
    assert task.num_train == (20_000 - 1) // 16 and task.num_eval == (2_000 - 1) // 16
    # The first held-out file (sorted index 0) opens the held-out text; training starts at index 1.
    assert held.startswith(files[0].read_bytes()[:100]) and train.startswith(files[1].read_bytes()[:100])
    # Windows overlap by one byte: the last target of one is the first input of the next.
    tokens = task.train_data["tokens"]
    assert tokens.dtype == np.uint8 and (tokens[:-1, -1] == tokens[1:, 0]).all()


@pytest.mark.parametrize("rules", [r for r, _ in LAYOUTS])
def test_every_layout_trains_to_the_one_device_parameters(task, one_device, fsdp_tp, rules):
    result = fsdp_tp if rules == "fsdp+tp" else _fit(task, _sharded(rules))
    assert result.summary["rules"] == rules and result.summary["device_count"] == 8
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(one_device.params), strict=True):
        assert a.shape == b.shape and float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) <= TOLERANCE
    bpb = result.summary["eval_bits_per_byte"]
    assert bpb == pytest.approx(one_device.summary["eval_bits_per_byte"], rel=1e-5)
    assert bpb == pytest.approx(result.summary["eval_loss"] / np.log(2), rel=1e-6)


def test_resume_is_bit_equal(task, fsdp_tp, tmp_path):
    half = spmdkit.TrainConfig(steps=3, batch_size=16, eval_every=1000)
    _fit(task, _sharded("fsdp+tp"), half, checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=3))
    resumed = _fit(task, _sharded("fsdp+tp"), checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=3, resume=True))
    assert resumed.summary["resumed_from_step"] == 3 and resumed.summary["steps"] == 6
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(fsdp_tp.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Sampling reads the newest step (6); a run from Python saved no options, so sizes are given.
    sizes = {k: v for k, v in SIZES.items() if k != "text_bytes"}
    greedy = spmdkit.sample(tmp_path, "def ", length=5, **sizes)
    model, params, step = load_lm(tmp_path, **sizes)
    assert step == 6 and len(greedy) == 5
    logits = model.apply({"params": params}, np.frombuffer(b"def ", np.uint8).astype(np.int32)[None])
    assert greedy[0] == int(np.argmax(logits[0, -1]))
    assert spmdkit.sample(tmp_path, "def ", length=5, temperature=1.0, seed=3, **sizes) == \
        spmdkit.sample(tmp_path, "def ", length=5, temperature=1.0, seed=3, **sizes)
    streamed = []  # each byte as it is made, the same bytes as returned
    assert spmdkit.sample(tmp_path, "def ", length=5, stream=streamed.append, **sizes) == greedy
    assert streamed == [greedy[i:i + 1] for i in range(5)]
    # 123 as a prompt gave 123 zero bytes; a NaN temperature gave zero bytes out.
    for kwargs, words in [({"prompt": 123}, r"prompt=123 \(int\): text or bytes"),
                          ({"temperature": float("nan")}, r"temperature=nan: a finite number >= 0"),
                          ({"length": "5"}, r"length='5': a whole number"),
                          ({"seed": 2**64}, r"seed=18446744073709551616: a whole number from 0 to 4294967295"),
                          ({"seed": -1}, r"seed=-1: a whole number from 0 to 4294967295"),  # was seed 2**32 - 1's text
                          ({"seed": 1.5}, r"seed=1.5: a whole number"),
                          ({"stream": "out.txt"}, r"stream='out.txt': a function called with each generated byte")]:
        with pytest.raises(spmdkit.ConfigError, match=words):
            spmdkit.sample(tmp_path, **{"prompt": "def ", "length": 5, **kwargs}, **sizes)


def test_train_and_sample_from_the_command_line(tmp_path, capsys):
    flags = ["--task", "lm", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8",
             "--text-bytes", "4000", "--steps", "2", "--no-progress", "--no-compile-cache"]
    assert main(["train", *flags, "--precision", "bf16", "--remat", "--out", str(tmp_path / "run"),
                 "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["precision"] == "bf16" and summary["config"]["remat"] == "full"
    assert 0 < summary["eval_bits_per_byte"] < 12
    capsys.readouterr()
    assert main(["sample", "--checkpoint-dir", str(tmp_path / "ck"), "--prompt", "import", "--length", "7",
                 "--no-compile-cache"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("import") and len(printed.encode()) >= len("import") + 1
    assert main(["sample", "--checkpoint-dir", str(tmp_path / "none")]) == 2
    assert "does not exist" in " ".join(capsys.readouterr().err.split())
    assert main(["sample", "--checkpoint-dir", str(tmp_path / "run" / "params.npz")]) == 2
    assert "params.npz' is a file, not a directory" in " ".join(capsys.readouterr().err.split())


def test_scan_unroll_from_the_command_line_is_trained_saved_resumed_and_sampled(tmp_path, capsys, monkeypatch):
    # --scan-unroll had no flag: a rolled scan, which remat needs to save memory on jax 0.10.2, was Python's only.
    # It changes the program, not the parameters: a checkpoint without it (as one written before the
    # flag) resumes with it, and sample builds the form the newest checkpoint saved.
    built = []
    functions = lm.lm_functions
    monkeypatch.setattr(lm, "lm_functions", lambda cfg: (built.append(cfg), functions(cfg))[1])
    flags = ["--task", "lm", "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8",
             "--text-bytes", "4000", "--no-progress", "--no-compile-cache", "--out", str(tmp_path / "run"),
             "--checkpoint-dir", str(tmp_path / "ck")]
    sample = ["sample", "--checkpoint-dir", str(tmp_path / "ck"), "--length", "3", "--no-compile-cache"]
    assert main(["train", *flags, "--steps", "2"]) == 0
    assert built[-1].scan_unroll is None and built[-1].unroll == 2  # the default: 2 layers unrolled
    assert "scan_unroll" not in json.loads((tmp_path / "run" / "summary.json").read_text())["config"]
    assert main(sample) == 0 and built[-1].scan_unroll is None
    capsys.readouterr()
    assert main(["train", *flags, "--steps", "4", "--resume", "--scan-unroll", "1"]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    assert built[-1].scan_unroll == 1 and built[-1].unroll == 1  # a loop of 2 iterations
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["config"]["scan_unroll"] == 1
    assert main(sample) == 0 and built[-1].unroll == 1


@pytest.mark.parametrize("optimizer", [optax.sgd(0.1), optax.adam(1e-3)], ids=["sgd", "adam"])
def test_sample_from_a_python_run_with_any_optimizer(task, tmp_path, optimizer):
    # sample rebuilt the whole state with the saved optimizer, AdamW by default, and a run from Python
    # saves no options: any other optimizer's checkpoint could not be sampled ("resume with the
    # optimizer the checkpoint was written with"), and sample() takes no optimizer.
    result = spmdkit.fit(task, spmdkit.Single(), optimizer, spmdkit.TrainConfig(steps=2, batch_size=16, eval_every=1000),
                         checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=2), progress=False, log=lambda m: None)
    sizes = {k: v for k, v in SIZES.items() if k != "text_bytes"}
    model, params, step = load_lm(tmp_path, **sizes)
    assert step == 2
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(result.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(spmdkit.sample(tmp_path, "def ", length=3, **sizes)) == 3
    # Sizes that do not fit were "the model being trained: resume with the same model size".
    with pytest.raises(spmdkit.CheckpointError, match=r"(?s)in the model built to sample\..*lm's defaults: the run "
                                                      r"saved no options.*Fix: pass the sizes the run trained with") as e:
        spmdkit.sample(tmp_path, "def ", length=3)
    assert "the target" not in str(e.value)  # the restore's word, which a sampling user has no part in


def test_sample_takes_and_prints_bytes_that_are_not_utf8(tmp_path, capsysbinary):
    # The command line printed out.decode(errors="replace"): every generated byte that was not UTF-8
    # came out as U+FFFD, not as the sample; a prompt of such bytes was a UnicodeEncodeError traceback.
    flags = ["--task", "lm", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8",
             "--text-bytes", "4000", "--steps", "1", "--no-progress", "--no-compile-cache"]
    assert main(["train", *flags, "--out", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    capsysbinary.readouterr()
    prompt = b"\xff\xfe#"  # not UTF-8: the shell hands such bytes to Python as lone surrogates
    assert main(["sample", "--checkpoint-dir", str(tmp_path / "ck"), "--prompt", os.fsdecode(prompt), "--length",
                 "40", "--temperature", "5", "--seed", "1", "--no-compile-cache"]) == 0
    want = spmdkit.sample(tmp_path / "ck", prompt, 40, temperature=5.0, seed=1)
    assert want.decode("utf-8", "replace").encode() != want  # the check below needs bytes that are not UTF-8
    assert capsysbinary.readouterr().out == prompt + want + b"\n"
    assert spmdkit.sample(tmp_path / "ck", os.fsdecode(prompt), 40, temperature=5.0, seed=1) == want
    with pytest.raises(spmdkit.ConfigError, match=r"lone surrogate"):
        spmdkit.sample(tmp_path / "ck", "a\ud800", 3)


def test_sample_falls_back_past_a_step_cut_short_by_a_kill(task, tmp_path):
    # A run killed between Orbax's commit and the manifest (or a live run saving now) leaves its newest
    # step without a manifest. sample took that step and failed with "resume from an earlier step
    # (spmdkit does so with --resume)", a flag sample does not have.
    config = spmdkit.TrainConfig(steps=2, batch_size=16, eval_every=1000)
    result = spmdkit.fit(task, spmdkit.Single(), optax.adamw(3e-3), config, progress=False, log=lambda m: None,
                         checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=1, keep=5))
    sizes = {k: v for k, v in SIZES.items() if k != "text_bytes"}
    (tmp_path / "manifests" / "2.json").unlink()  # as a SIGKILL mid-save leaves it
    with pytest.warns(RuntimeWarning, match=r"step \[2\] of .* cannot be used \(step 2: it has no manifest.*sampling "
                                            r"from step 1, the newest intact one"):
        _, params, step = load_lm(tmp_path, **sizes)
    assert step == 1 and (tmp_path / "spmdkit_2").is_dir()  # a reader: the step is left in place
    assert not np.array_equal(np.asarray(params["token_embed"]), np.asarray(result.params["token_embed"]))
    with pytest.raises(spmdkit.CheckpointDamagedError, match=r"(?s)step 2 in .* is damaged: it has no manifest.*Fix: pass --step 1 "
                                                      r"\(the newest intact step"):
        load_lm(tmp_path, step=2, **sizes)
    (tmp_path / "manifests" / "1.json").write_text("{")
    with pytest.raises(spmdkit.CheckpointDamagedError, match=r"no intact checkpoint in .*: steps \[1, 2\] are all damaged"):
        load_lm(tmp_path, **sizes)


def test_sample_falls_back_past_a_step_whose_bytes_changed_and_hints_for_damaged_metadata(task, tmp_path):
    # Same size, other bytes: only the checksum, read with the arrays, shows it. sample took the step
    # and said "Fix: pass --step 1 (...; without --step, sample takes it)", which it had not done.
    config = spmdkit.TrainConfig(steps=2, batch_size=16, eval_every=1000)
    spmdkit.fit(task, spmdkit.Single(), optax.adamw(3e-3), config, progress=False, log=lambda m: None,
                checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=1, keep=5))
    sizes = {k: v for k, v in SIZES.items() if k != "text_bytes"}
    files = [f for f in (tmp_path / "spmdkit_2" / "state").rglob("*") if f.is_file() and "params." in str(f)]
    victim = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=r"step \[2\] of .* cannot be used \(step 2: .*checksum.*sampling from step 1"):
        _, _, step = load_lm(tmp_path, **sizes)
    assert step == 1
    # Unreadable metadata of the step asked for: sample's own fix, not the restore's "resume from another step".
    (tmp_path / "spmdkit_2" / "meta" / "metadata").write_text("garbage{")
    with pytest.raises(spmdkit.CheckpointDamagedError, match=r"(?s)metadata cannot be read.*Fix: pass --step 1 "):
        load_lm(tmp_path, step=2, **sizes)


def test_sample_beside_a_live_run_lists_again_when_its_step_is_deleted_while_read(task, tmp_path, monkeypatch):
    # The writing run's retention (--keep 1) deleted the step sample had chosen: "metadata cannot be read
    # ... sample built the model with {...} (saved with the checkpoint). Fix: pass the sizes the run trained with".
    import shutil

    from spmdkit._checkpoint import Checkpointer

    spmdkit.fit(task, spmdkit.Single(), optax.adamw(3e-3), spmdkit.TrainConfig(steps=2, batch_size=16, eval_every=1000),
                checkpoint=spmdkit.CheckpointConfig(str(tmp_path), every=1, keep=5), progress=False, log=lambda m: None)
    meta = Checkpointer.meta

    def retention(self, step):
        if step == 2 and (tmp_path / "spmdkit_2").exists():  # deleted as it is read, like keep=1 after step 3
            shutil.rmtree(tmp_path / "spmdkit_2")
            (tmp_path / "manifests" / "2.json").unlink()
        return meta(self, step)

    monkeypatch.setattr(Checkpointer, "meta", retention)
    sizes = {k: v for k, v in SIZES.items() if k != "text_bytes"}
    assert load_lm(tmp_path, **sizes)[2] == 1


def test_sample_names_an_ensemble_checkpoint(task, tmp_path):
    # Its leaves' leading member axis was blamed on the sizes: "sample built the model with {...} (saved
    # with the checkpoint). Fix: pass the sizes the run trained with", and it suggested --members.
    spmdkit.fit(task, spmdkit.Ensemble(2), optax.adamw(3e-3), spmdkit.TrainConfig(steps=1, batch_size=16,
                eval_every=1000), checkpoint=spmdkit.CheckpointConfig(str(tmp_path)), progress=False, log=lambda m: None)
    sizes = {k: v for k, v in SIZES.items() if k != "text_bytes"}
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)step 1 in .* holds an ensemble of 2 models \(--strategy "
                                                  r"ensemble\); sample continues a prompt with one model.*Fix: sample"):
        spmdkit.sample(tmp_path, "def ", length=3, **sizes)


def test_a_tiny_temperature_samples_the_most_likely_bytes(task, tmp_path):
    # logits / 1e-40 overflowed float32 (1e-40 is a denormal; 1e-300 rounds to 0): every positive logit
    # became +inf and categorical took the first of them, byte 10, "\n" after "\n", not the greedy text.
    spmdkit.fit(task, spmdkit.Single(), optax.adamw(3e-3), spmdkit.TrainConfig(steps=3, batch_size=16, eval_every=1000),
                checkpoint=spmdkit.CheckpointConfig(str(tmp_path)), progress=False, log=lambda m: None)
    sizes = {k: v for k, v in SIZES.items() if k != "text_bytes"}
    greedy = spmdkit.sample(tmp_path, "def ", length=8, **sizes)
    for temperature in (1e-20, 1e-40, 1e-300):
        assert spmdkit.sample(tmp_path, "def ", length=8, temperature=temperature, **sizes) == greedy, temperature


def test_sample_into_a_pipe_whose_reader_left_exits_141_without_a_traceback(tmp_path):
    # `spmdkit sample --length 100000 | head -c 100`: the reader leaves before the write (longer than the
    # pipe's buffer) ends; that was a BrokenPipeError traceback and exit 1.
    import subprocess
    import sys

    flags = ["--task", "lm", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8",
             "--text-bytes", "4000", "--steps", "1", "--no-progress", "--no-compile-cache"]
    assert main(["train", *flags, "--out", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    read, write = os.pipe()
    os.close(read)  # the reader has gone
    env = {**os.environ, "PYTHONPATH": str(Path(spmdkit.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "spmdkit", "sample", "--checkpoint-dir", str(tmp_path / "ck"),
                           "--length", "3", "--no-compile-cache"], stdout=write, stderr=subprocess.PIPE, text=True,
                          timeout=300, env=env)
    os.close(write)
    assert done.returncode == 141 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_sample_prints_each_byte_as_it_comes_and_ctrl_c_keeps_them(tmp_path, own_group):
    # sample printed everything at the end: a long sample showed nothing for minutes, and a Ctrl-C
    # lost all it had generated.
    flags = ["--task", "lm", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8",
             "--text-bytes", "4000", "--steps", "1", "--no-progress", "--no-compile-cache"]
    assert main(["train", *flags, "--out", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    env = {**os.environ, "PYTHONPATH": str(Path(spmdkit.__file__).parents[1])}
    cmd = [sys.executable, "-m", "spmdkit", "sample", "--checkpoint-dir", str(tmp_path / "ck"), "--prompt", "def ",
           "--length", "1000000", "--no-compile-cache"]
    with own_group(cmd, sigint=True, env=env) as proc:
        got, deadline = b"", time.monotonic() + 240
        while len(got) < len("def ") + 20 and time.monotonic() < deadline:  # the prompt, then 20 bytes
            if select.select([proc.stdout], [], [], 1)[0]:
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, proc.stderr.read()
                got += chunk
        assert len(got) >= len("def ") + 20, "nothing printed before the end"
        proc.send_signal(signal.SIGINT)
        while chunk := os.read(proc.stdout.fileno(), 4096):
            got += chunk
        assert proc.wait(timeout=60) == 130
        stderr = proc.stderr.read()
    assert got.startswith(b"def ") and "interrupted" in stderr and "Traceback" not in stderr, stderr
    assert got.endswith(b"\n")  # the shell's prompt starts a line of its own


def test_a_ctrl_c_that_garbage_collection_swallowed_still_ends_sample_with_130(tmp_path, monkeypatch, capsysbinary):
    # JAX's garbage-collection callback caught a KeyboardInterrupt raised inside it ("Exception ignored
    # in: <function _xla_gc_callback>"): sample ran to its end and exited 0.
    import spmdkit._sample

    made = []

    def sample(*args, stream, **kw):
        for i in range(100):
            if i == 3:
                try:  # what a garbage-collection callback does with the exception it raises
                    signal.raise_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass
            made.append(i)
            stream(b"x")
        return b"x" * 100

    monkeypatch.setattr(spmdkit._sample, "sample", sample)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # pytest started with `&` ignores it
    try:
        code = main(["sample", "--checkpoint-dir", str(tmp_path), "--prompt", "p", "--no-compile-cache"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and len(made) == 4
    out = capsysbinary.readouterr()
    assert out.out == b"pxxxx\n" and b"interrupted" in out.err


def test_training_lowers_held_out_bits_per_byte(task):
    untrained = jax.jit(task.loss_fn)(task.init(jax.random.key(0)), task.eval_data, None)[1]["bits_per_byte"]
    config = spmdkit.TrainConfig(steps=40, batch_size=16, eval_every=1000)
    result = spmdkit.fit(task, spmdkit.Single(), optax.adamw(1e-2), config, progress=False, log=lambda m: None)
    trained = result.summary["eval_bits_per_byte"]
    # Untrained: ~8.0 bits, uniform's (the tied embedding starts small: near-zero logits); 40 steps
    # reach ~5.0 bits: the margin is learning.
    assert 7.9 < float(untrained) < 8.1 and trained < float(untrained) - 2.5, (float(untrained), trained)


def test_bf16_with_remat_runs_sharded_and_stays_near_float32(fsdp_tp):
    task = lm.make(**SIZES, precision="bf16", remat="full")
    params = jax.tree.leaves(task.init(jax.random.key(0)))
    assert all(p.dtype == np.float32 for p in params)  # parameters (and so Adam's moments) stay float32
    result = _fit(task, _sharded("fsdp+tp"))
    assert all(np.isfinite(np.asarray(p)).all() and p.dtype == np.float32 for p in jax.tree.leaves(result.params))
    bpb = result.summary["eval_bits_per_byte"]
    assert np.isfinite(bpb) and bpb == pytest.approx(fsdp_tp.summary["eval_bits_per_byte"], abs=0.05)


def test_remat_computes_the_same_loss_gradients(task):
    sizes = dict(layers=2, d_model=32, heads=8, seq_len=16)
    _, init, loss_fn = lm.lm_functions(lm.LMConfig(**sizes))
    params, batch = init(jax.random.key(1)), jax.tree.map(lambda x: x[:4], task.train_data)
    grad = lambda f: jax.jit(jax.grad(lambda p: f(p, batch, None)[0]))(params)  # noqa: E731
    plain = jax.tree.leaves(grad(loss_fn))
    for remat in ("full", "dots"):
        remat_loss = lm.lm_functions(lm.LMConfig(**sizes, remat=remat))[2]
        for a, b in zip(plain, jax.tree.leaves(grad(remat_loss)), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_the_unrolled_scan_computes_what_the_rolled_loop_does(task):
    # 3 layers: scan_unroll=2 is a loop of one iteration and a remainder; the default (3) has no loop.
    sizes = dict(layers=3, d_model=32, heads=8, seq_len=16)
    assert lm.LMConfig(**sizes).unroll == 3 and lm.LMConfig(**sizes, scan_unroll=9).unroll == 3
    assert lm.LMConfig(**{**sizes, "layers": lm.UNROLL_ALL_UP_TO + 1}).unroll == 1
    batch = jax.tree.map(lambda x: x[:4], task.train_data)

    def run(**kw):
        _, init, loss_fn = lm.lm_functions(lm.LMConfig(**sizes, **kw))
        params = init(jax.random.key(1))
        fn = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, None)[0]))
        return params, fn(params), fn.lower(params).as_text()

    params, (loss, grads), program = run(scan_unroll=1)
    assert "stablehlo.while" in program  # the rolled loop over layers
    for kw in (dict(scan_unroll=2), dict(), dict(remat="full"), dict(remat="full", scan_unroll=1)):
        p, (l, g), program = run(**kw)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same initialisation
        assert float(l) == pytest.approx(float(loss), rel=1e-6), kw
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, err_msg=str(kw))
        if "scan_unroll" not in kw:
            assert "stablehlo.while" not in program, kw  # unrolled: one straight-line program


def test_every_lm_name_needs_a_rule(task):
    rules = dict(spmdkit.PRESETS["fsdp+tp"])
    del rules["heads"]
    strategy = spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), rules)
    with pytest.raises(spmdkit.LayoutError, match=r"(?s)\['layers'\]\['key'\].*logical axis 'heads'"):
        strategy.plan(task_state(task, optax.adamw(1e-3)))


def test_own_text_dir(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"held out " * 10)
    (tmp_path / "b.txt").write_bytes(b"to train " * 20)
    (tmp_path / ".hidden").write_bytes(b"never read")
    train, held = lm.load_text(tmp_path)
    assert train == b"to train " * 20 and held == b"held out " * 10
    assert lm.make(**{**SIZES, "text_bytes": 1000}, text_dir=str(tmp_path)).num_eval == (90 - 1) // 16


def test_a_file_larger_than_memory_is_read_only_as_far_as_needed(tmp_path):
    # Each file was read whole and then cut to --text-bytes: a 4 GB file cost 4.3 GB and 11 s for
    # its first kilobyte, one larger than memory was a MemoryError. A sparse 1 TiB file stands in.
    with open(tmp_path / "a.txt", "wb") as f:
        f.truncate(2**40)
    (tmp_path / "b.txt").write_bytes(b"to train " * 20)
    train, held = lm.load_text(tmp_path, text_bytes=100)
    assert train == (b"to train " * 20)[:100] and held == bytes(10)


@pytest.mark.parametrize("folder, mode, verb", [("sub", 0, "list"), ("sub", 0o400, "enter"), ("sub", 0o600, "enter"),
                                                ("", 0o400, "enter")])
def test_a_folder_of_the_corpus_that_cannot_be_listed_is_named(tmp_path, folder, mode, verb):
    # rglob skipped it without a word: its files left the corpus and the held-out split shifted. One
    # that can be listed but not entered (no x bit, --text-dir itself too) was a bare PermissionError.
    import shutil
    import subprocess
    import sys

    for name in ("a.txt", "b.txt", "sub/c.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name * 50)
    assert [p.name for p in lm.text_files(tmp_path)] == ["a.txt", "b.txt", "c.txt"]
    prefix = []
    if os.geteuid() == 0:  # root lists everything: setpriv drops that power
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file modes do not apply")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
    code = "import sys\nfrom spmdkit._tasks import lm\nlm.text_files(sys.argv[1])"
    locked = tmp_path / folder
    locked.chmod(mode)
    try:
        done = subprocess.run([*prefix, sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              timeout=120, env={"PYTHONPATH": str(Path(spmdkit.__file__).parents[1]), "PATH": "/usr/bin:/bin"})
    finally:
        locked.chmod(0o755)
    assert "DataError: lm: --text-dir" in done.stderr, done.stderr
    assert f"cannot {verb} {locked} (Permission denied)" in done.stderr and f"chmod -R u+rX {locked})" in done.stderr


def test_symlinked_folders_are_read_and_a_dangling_link_is_named(tmp_path):
    # os.walk does not enter symlinked folders: a corpus of links to text folders lost their files
    # without a word (all links: "holds 0 file(s)"), and a link to nothing was skipped silently.
    data, corpus = tmp_path / "data", tmp_path / "corpus"
    for name in ("books/a.txt", "books/b.txt", "own.txt"):
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text(name * 50)
    corpus.mkdir()
    (corpus / "books").symlink_to(data / "books")
    (corpus / "own.txt").symlink_to(data / "own.txt")
    (corpus / "loop").symlink_to(corpus)  # an ancestor: entered once, not forever
    (corpus / "same").symlink_to(data / "books")  # one folder under two names: its files once
    assert [p.relative_to(corpus).as_posix() for p in lm.text_files(corpus)] == ["books/a.txt", "books/b.txt",
                                                                                 "own.txt"]
    (corpus / "gone.txt").symlink_to(tmp_path / "nothing")
    with pytest.raises(spmdkit.DataError, match=r"(?s)gone.txt is a symbolic link to .*nothing, which does not exist.*"
                                                r"Fix: remove the link"):
        lm.text_files(corpus)


def test_a_linked_file_is_read_once_under_its_first_name_so_no_held_out_text_is_trained_on(tmp_path):
    # A "latest.txt" link (or a hard link) to the held-out file 0 put its text in the training split too.
    for i in range(6):
        (tmp_path / f"f{i}.txt").write_text(f"document {i} " * 30)
    (tmp_path / "latest.txt").symlink_to("f0.txt")
    os.link(tmp_path / "f0.txt", tmp_path / "zz_hard.txt")
    train, held = lm.split_files(tmp_path)
    assert [p.name for p in held] == ["f0.txt"] and [p.name for p in train] == [f"f{i}.txt" for i in range(1, 6)]
    text, held_text = lm.load_text(tmp_path)
    assert held_text not in text and b"document 0" not in text
    for i in range(1, 6):
        (tmp_path / f"f{i}.txt").unlink()
    with pytest.raises(spmdkit.DataError, match=r"holds 1 file\(s\) \(3 names, links to 1 file\(s\): each real file is "
                                                r"read once\); the corpus needs at least 2"):
        lm.text_files(tmp_path)


def test_a_folder_reached_twice_is_read_under_its_first_path_in_sorted_order(tmp_path):
    # The walk kept whichever name it met first ("a/z/x.txt"), where the sorted order of paths puts "a-b/x.txt" first.
    (tmp_path / "a-b").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a-b" / "x.txt").write_text("x " * 50)
    (tmp_path / "a" / "z").symlink_to("../a-b")
    (tmp_path / "m.txt").write_text("m " * 50)
    assert [p.relative_to(tmp_path).as_posix() for p in lm.text_files(tmp_path)] == ["a-b/x.txt", "m.txt"]


def test_a_fifo_or_a_device_under_the_text_dir_is_named(tmp_path):
    # Both were left out of the corpus without a word (the README says every non-hidden file is read).
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("text " * 50)
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(spmdkit.DataError, match=r"(?s)pipe is a FIFO, not a regular file.*move it out of --text-dir"):
        lm.text_files(tmp_path)
    (tmp_path / "pipe").unlink()
    (tmp_path / "zeros").symlink_to("/dev/zero")
    with pytest.raises(spmdkit.DataError, match=r"zeros is a character device, not a regular file"):
        lm.text_files(tmp_path)
    (tmp_path / "zeros").rename(tmp_path / ".zeros")  # hidden: skipped, as the fix says
    assert [p.name for p in lm.text_files(tmp_path)] == ["a.txt", "b.txt"]


def test_a_held_out_text_too_short_names_its_files(tmp_path):
    # "the held-out text has 3 bytes" did not say which files are held out (the first in sorted order).
    (tmp_path / "a.txt").write_bytes(b"abc")
    (tmp_path / "b.txt").write_bytes(b"to train " * 20)
    with pytest.raises(spmdkit.DataError, match=r"held-out \(the files at sorted positions 0, 20, 40...: a.txt\) "
                                                r"text has 3 bytes(?s:.*)or longer held-out files"):
        lm.make(**{**SIZES, "text_bytes": 1000}, text_dir=str(tmp_path))


def _small_corpus_run(tmp_path: Path) -> tuple[Path, list[str]]:
    """A corpus of 3 equal files and the flags of a tiny checkpointed lm run over it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_bytes(bytes(range(32, 127)) * 20)
    flags = ["--task", "lm", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--text-dir",
             str(corpus), "--no-progress", "--no-compile-cache", "--out", str(tmp_path / "run"), "--checkpoint-dir",
             str(tmp_path / "ck"), "--batch-size", "8"]
    return corpus, flags


def test_a_corpus_file_edited_between_runs_is_not_resumed_silently(tmp_path):
    # The same number of windows (the edit keeps the size) was resumed on other text without a word.
    corpus, flags = _small_corpus_run(tmp_path)
    assert main(["train", *flags, "--steps", "2"]) == 0
    text = (corpus / "1.txt").read_bytes()
    (corpus / "1.txt").write_bytes(text.replace(b"a", b"b"))
    assert main(["train", *flags, "--steps", "3", "--resume"]) == 2
    (corpus / "1.txt").write_bytes(text)
    assert main(["train", *flags, "--steps", "3", "--resume"]) == 0


def test_a_held_out_file_edited_between_runs_is_said_on_resume(tmp_path, capfd):
    # Editing the held-out file (sorted position 0) changed the eval figures of a resumed run
    # without a word; training resumes as it was, so it is a warning, not a refusal.
    corpus, flags = _small_corpus_run(tmp_path)
    assert main(["train", *flags, "--steps", "2"]) == 0
    assert main(["train", *flags, "--steps", "3", "--resume"]) == 0
    assert "evaluating on other data" not in capfd.readouterr().err  # the same held-out text: no word
    text = (corpus / "0.txt").read_bytes()
    (corpus / "0.txt").write_bytes(text.replace(b"a", b"b"))
    assert main(["train", *flags, "--steps", "4", "--resume"]) == 0
    err = capfd.readouterr().err
    assert re.search(r"the checkpoint at step 3 was written evaluating on other data: the eval set's bytes differ "
                     r"\(CRC-32 [0-9a-f]{8} then, [0-9a-f]{8} now", err), err[-2000:]
    assert "eval figures from here on are not comparable" in err


def test_a_file_deleted_after_the_listing_is_named(tmp_path, monkeypatch):
    # A file removed between listing the corpus and reading it was a bare FileNotFoundError.
    for name in "abc":
        (tmp_path / f"{name}.txt").write_bytes(name.encode() * 300)
    listing = lm.text_files

    def racing(text_dir=None):
        files = listing(text_dir)
        files[1].unlink()  # another process deletes it meanwhile
        return files

    monkeypatch.setattr(lm, "text_files", racing)
    with pytest.raises(spmdkit.DataError, match=r"cannot read the corpus file .*b\.txt .*removed or replaced while"):
        lm.load_text(tmp_path)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(text_dir="/no/such/dir"), r"--text-dir '/no/such/dir' does not exist"),
        (dict(d_model=30, heads=8), r"(?s)d_model=30 is not a multiple of heads=8.*Fix: use --heads 6 or 10 \(divisors "
                                    r"of d_model=30\), or --d-model 24 or 32 \(multiples of heads=8\)"),
        (dict(precision="fp16"), r"(?s)precision='fp16' is not known.*bf16"),
        (dict(remat="some"), r"remat='some' is not a remat policy"),
        (dict(scan_unroll=0), r"scan_unroll=0 must be a whole number >= 1"),
        (dict(seq_len=4096, text_bytes=100), r"fewer than one window of seq_len\+1 = 4097"),
    ],
)
def test_bad_options_are_clean_errors(kw, match):
    with pytest.raises(spmdkit.SpmdkitError, match=match):
        lm.make(**kw)


def test_a_missing_text_dir_is_told_to_exist_not_to_be_readable(tmp_path, monkeypatch, capsys):
    from spmdkit._cli import main

    # `train --text-dir nothere` said "cannot list nothere ... make it readable (chmod -R u+rX
    # nothere)": the readable fix, for a path that is not there.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for name, said in (("nothere", "'nothere' does not exist"), ("afile/sub", "'afile/sub' does not exist"),
                       ("dangling", f"'dangling' is a symbolic link to {tmp_path / 'gone'}, which does not exist")):
        assert main(["train", "--task", "lm", "--text-dir", name, "--steps", "1", "--no-compile-cache"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"lm: --text-dir {said}." in err and f"pass a directory that exists (a relative path is taken from {tmp_path})" in err
        assert "chmod" not in err
    assert main(["train", "--task", "lm", "--text-dir", "afile", "--steps", "1", "--no-compile-cache"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "lm: --text-dir 'afile' is not a directory." in err and "chmod" not in err


def test_empty_text_dir(tmp_path):
    with pytest.raises(spmdkit.DataError, match=r"holds 0 file\(s\); the corpus needs at least 2"):
        lm.make(text_dir=str(tmp_path))


def test_lm_options_from_a_config_file(tmp_path):
    from spmdkit._config import build_run_config, load_toml, task_options

    path = tmp_path / "lm.toml"
    path.write_text('task = "lm"\nd-model = 32\nheads = 8\nseq-len = 16\nprecision = "bf16"\nremat = "dots"\n'
                    'text-bytes = 5000\n')
    options = task_options(build_run_config(load_toml(str(path))))
    assert options == {"d_model": 32, "heads": 8, "seq_len": 16, "precision": "bf16", "remat": "dots", "text_bytes": 5000}
    path.write_text('task = "lm"\nheads = "8"\n')
    with pytest.raises(spmdkit.ConfigError, match=r"heads = '8' \(str\) must be a whole number"):
        load_toml(str(path))
    with pytest.raises(spmdkit.ConfigError, match=r"task 'mlp' does not take option\(s\) \['text_dir'\]"):
        spmdkit.get_task("mlp", text_dir="corpus")


def test_the_one_qkv_product_computes_the_three_projections():
    # The default path (one product of the flattened tokens with the weights side by side) against
    # the sequence-parallel one (a product per projection): the same q, k, v in (batch, heads, length, kv).
    keys = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(keys[0], (2, 8, 16))
    weights = [jax.random.normal(k, (16, 4, 4)) for k in keys[1:]]
    flat, per = lm._project_qkv(h, weights, flat=True), lm._project_qkv(h, weights, flat=False)
    for i, (a, b) in enumerate(zip(flat, per, strict=True)):
        assert a.shape == b.shape == (2, 4, 8, 4)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg="qkv"[i])
        expected = np.einsum("ble,ehd->bhld", np.asarray(h), np.asarray(weights[i]))
        np.testing.assert_allclose(np.asarray(a), expected, atol=1e-4, err_msg="qkv"[i])
