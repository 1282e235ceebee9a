"""The spmdkit command line: help, devices, demo, bench, device set-up errors."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from spmdkit._cli import main
from spmdkit._errors import EXIT_CHECK_FAILED

SPMDKIT = shutil.which("spmdkit") or os.path.join(os.path.dirname(sys.executable), "spmdkit")


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: int = 300):
    # The caller's own SPMDKIT_HOST_DEVICES must not leak into what a test expects.
    full_env = {k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"}
    full_env.update(env or {})
    return subprocess.run(
        [SPMDKIT, *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    for word in ("devices", "demo", "bench", "--host-devices"):
        assert word in out.stdout


def test_python_dash_m_spmdkit_is_the_command():
    out = subprocess.run([sys.executable, "-m", "spmdkit", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "devices" in out.stdout and "plan" in out.stdout


def test_devices_json_in_process(capsys):
    assert main(["devices", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["device_count"] == 8
    assert info["devices_per_process"] == {"0": 8}
    assert info["suggested_mesh"] == {"data": 8}
    assert info["suggested_model_parallel_mesh"] == {"data": 2, "model": 4}


@pytest.mark.parametrize("args", [["devices"], ["devices", "--json"]], ids=["table", "json"])
def test_a_reader_that_left_the_pipe_is_exit_141_without_a_traceback(args):
    # `spmdkit devices | head -0`, `... --json | head`: rich's table ended with exit 1 (a crash, by the
    # README's codes) and print() with a BrokenPipeError traceback. Any command: the shell's code.
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first write
    try:
        done = subprocess.run([sys.executable, "-m", "spmdkit", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"})
    finally:
        os.close(write)
    assert done.returncode == 141, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_devices_table_in_process(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "8 device(s), 1 process(es)" in out and "make_mesh(data=8)" in out


def test_host_devices_after_start_is_a_clean_error(capsys):
    # This test process already runs 8 devices: asking for 4 must say how to fix it.
    import jax

    assert len(jax.devices()) == 8  # JAX started here, not by whichever test ran before (run alone, none did)
    assert main(["--host-devices", "4", "devices"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "--host-devices 4" in err
    assert "Traceback" not in err


def test_bad_flag_values_are_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["devices", "--host-devices", "0"])
    assert e.value.code == 2
    assert "--host-devices: expected a whole number >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    # An unset shell variable (--config "$CONFIG"): --config "" trained with the defaults, --out "" wrote
    # into the current directory, `checkpoints ""` listed it as "no checkpoints"; none said a word.
    (["train", "--config", ""], "--config"), (["train", "--out", ""], "--out"),
    (["train", "--checkpoint-dir", ""], "--checkpoint-dir"), (["checkpoints", ""], "directory"),
    (["plan", "--devices", "2", "--json", ""], "--json"), (["bench", "--suite", "data", "--markdown", ""], "--markdown"),
    (["calibrate", "--out", ""], "--out"), (["data", "write", "", "--task", "digits"], "DIR"),
    (["--compile-cache", "", "devices"], "--compile-cache"), (["launch", "-n", "2", "--compile-cache", "", "--", "true"],
                                                               "--compile-cache"),
    # --rules "" and --mesh "" were taken as not given: a sharded run on the dp preset without a word.
    (["inspect", "--rules", ""], "--rules"), (["train", "--strategy", "sharded", "--mesh", " "], "--mesh"),
    # Only blanks made a folder named " " without a word.
    (["train", "--out", " "], "--out"), (["data", "write", "  ", "--task", "digits"], "DIR"),
])
def test_an_empty_path_or_layout_is_refused_by_the_parser(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (f"argument {flag}: expected a path, got an empty string" in err
            or f"argument {flag}: expected a path, got only blanks" in err
            or f"argument {flag}: expected a value, got " in err), err


def test_host_devices_above_the_bound_are_named_for_each_way_of_asking(tmp_path, capsys):
    for args in (["devices", "--host-devices", "100000"], ["launch", "-n", "2", "--host-devices-per-process", "5000",
                                                          "--", "spmdkit", "devices"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2 and "expected at most 4096 simulated devices" in capsys.readouterr().err
    (tmp_path / "many.toml").write_text("host-devices = 100000\n")
    assert main(["train", "--config", str(tmp_path / "many.toml")]) == 2
    assert "host-devices = 100000 in --config" in capsys.readouterr().err
    assert main(["plan", "--devices", "100000"]) == 2
    assert "--devices 100000: at most 4096 simulated devices" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, env, expected",
    [
        (["devices", "--json"], {"SPMDKIT_HOST_DEVICES": "4"}, 4),
        (["--host-devices", "2", "devices", "--json"], {"SPMDKIT_HOST_DEVICES": "4"}, 2),
        (["devices", "--host-devices", "3", "--json"], None, 3),
    ],
)
def test_device_count_from_flag_and_env(args, env, expected):
    out = run_cli(*args, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["device_count"] == expected


def test_data_verbs_take_host_devices_after_their_name(tmp_path, capsys):
    from spmdkit._cli import build_parser

    # `spmdkit data check --host-devices 2 DIR` was refused (unrecognized arguments) while the
    # README says every command but launch takes it before or after the command name.
    parse = build_parser().parse_args
    assert parse(["data", "check", "--host-devices", "2", "DIR"]).host_devices == 2
    assert parse(["data", "write", "DIR", "--task", "linreg", "--host-devices", "3"]).host_devices == 3
    assert parse(["data", "--host-devices", "2", "check", "DIR"]).host_devices == 2  # as before
    assert parse(["data", "--host-devices", "2", "check", "DIR", "--no-compile-cache"]).host_devices == 2
    d = tmp_path / "ds"
    assert main(["data", "write", str(d), "--task", "linreg", "--host-devices", "8"]) == 0
    assert main(["data", "check", "--host-devices", "8", str(d), "--verify"]) == 0
    assert "intact" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["train", "--help"]])
def test_host_devices_help_states_every_default_in_the_order_they_apply(argv, capsys):
    from spmdkit._cli import _DEFAULT_DEVICES

    # It said "$SPMDKIT_HOST_DEVICES, else what JAX finds": bench, demo, inspect and calibrate run 8.
    with pytest.raises(SystemExit):
        main(argv)
    squeeze = lambda t: "".join(t.split())  # noqa: E731 (argparse wraps lines, also at a hyphen)
    text = squeeze(capsys.readouterr().out)
    text = text[text.index("--host-devicesNsimulate"):]
    assert squeeze("Default: train's host-devices in --config, plan's --devices, else $SPMDKIT_HOST_DEVICES, "
                   "else 8 for") in text
    assert squeeze("else what JAX finds (1 device on a machine without GPU or TPU)") in text
    defaults = text[text.index("else8for"):text.index("elsewhatJAXfinds")]
    assert set(_DEFAULT_DEVICES.values()) == {8} and all(c in defaults for c in _DEFAULT_DEVICES)


def test_plan_help_states_its_own_text_bytes_default(capsys):
    from spmdkit._plan_cli import _text_bytes

    # It said train's 1000000; plan reads max(batch x (seq_len + 1) x 2, 20000) (_text_bytes).
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    squeeze = lambda t: "".join(t.split())  # noqa: E731 (argparse wraps lines)
    text = squeeze(capsys.readouterr().out)
    text = text[text.index("--text-bytesTEXT_BYTESlm:"):]
    assert "1000000" not in text[:200]
    assert squeeze("max(batch-size x (seq-len + 1) x 2, 20000)") in text
    assert _text_bytes(argparse.Namespace(text_bytes=None), 64, 32) == 20_000
    assert _text_bytes(argparse.Namespace(text_bytes=None), 128, 256) == 256 * 129 * 2
    with pytest.raises(SystemExit):  # train keeps its own default
        main(["train", "--help"])
    assert squeeze("lm: training bytes read (1000000;") in squeeze(capsys.readouterr().out)


def test_bad_env_value_is_a_clean_error():
    out = run_cli("devices", env={"SPMDKIT_HOST_DEVICES": "many"})
    assert out.returncode == 2
    assert "SPMDKIT_HOST_DEVICES='many' is not a positive integer" in out.stderr


def test_demo_runs_seed000_and_trains_on_eight_devices(tmp_path):
    out = run_cli("demo", "--out", str(tmp_path), "--steps", "60")
    assert out.returncode == 0, out.stderr
    assert "on 8 device(s)" in out.stdout
    assert "first row [11.0, 20.0, 29.0]" in out.stdout
    assert "split over mesh {'data': 8}" in out.stdout
    assert "demo OK" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device_count"] == 8 and summary["steps"] == 60
    # Fewer steps than the accuracy check needs: said, not "demo FAILED" with a crash's exit code 1.
    out = run_cli("demo", "--out", str(tmp_path / "short"), "--steps", "5")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test accuracy not checked: 5 steps" in out.stdout and "demo OK" in out.stdout


def test_a_demo_whose_check_fails_exits_6_not_a_crash_s_1(monkeypatch):
    # A script running `spmdkit demo` as a smoke test tells "the results are off" from a bug.
    import spmdkit._cli
    import spmdkit._demo

    asked = []
    monkeypatch.setattr(spmdkit._demo, "run_demo", lambda console, out, steps: asked.append((out, steps)) or {"ok": False})
    assert spmdkit._cli._cmd_demo(argparse.Namespace(out="elsewhere", steps=60), None) == EXIT_CHECK_FAILED == 6
    monkeypatch.setattr(spmdkit._demo, "run_demo", lambda console, out, steps: asked.append((out, steps)) or {"ok": True})
    assert spmdkit._cli._cmd_demo(argparse.Namespace(out="elsewhere", steps=60), None) == 0
    assert asked == [("elsewhere", 60)] * 2


def test_bench_pmap_quick_writes_json(bench_all_quick):
    path, md = bench_all_quick.json / "pmap.json", bench_all_quick.markdown / "pmap.md"
    out = bench_all_quick.done  # the pmap suite's part of `bench --all --quick`
    assert out.returncode == 0, out.stderr
    report = json.loads(path.read_text())
    assert report["suite"] == "pmap" and report["machine"]["devices"] == 8
    impls = {r["impl"] for r in report["rows"]}
    assert impls == {"spmdkit.pmap", "jax.pmap", "jit(vmap)"}
    for row in report["rows"]:
        assert row["median_us"] > 0
        if row["impl"] == "jax.pmap":
            assert row["x_jax_pmap"] == 1.0
    (target,) = report["targets"]
    assert target["value"] > 0 and isinstance(target["met"], bool)
    assert "target" in out.stdout
    assert "| spmdkit.pmap |" in md.read_text() and "target <= 1.0" in md.read_text()


def test_inspect_json_and_show():
    out = run_cli("inspect", "--task", "mlp", "--mesh", "data=2,model=4", "--rules", "dp+tp", "--layers", "2",
                  "--json", "--show", "['ScanDotReluDot_0']['W2']")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["mesh"] == {"data": 2, "model": 4} and report["rules"] == "dp+tp"
    assert report["params"][1]["spec"] == "P(None, 'model', None)"
    assert report["show"]["grid"][0][1] == "[:, 128:256, :]"
    # train --grad-accum's step can be inspected (it was "unrecognized arguments").
    out = run_cli("inspect", "--task", "mlp", "--mesh", "data=2,model=4", "--rules", "dp+tp", "--layers", "2",
                  "--grad-accum", "4", "--batch-size", "64")
    assert out.returncode == 0, out.stderr
    assert "compiled train step (batch 64 in 4 micro-batches), per device: arguments " in " ".join(out.stdout.split())
    assert "{readable" not in out.stdout, out.stdout  # every figure filled in (an f missing printed the code)
    out = run_cli("inspect", "--task", "mlp", "--layers", "2", "--grad-accum", "3", "--batch-size", "64")
    assert out.returncode == 2 and "grad_accum=3 must be a whole number >= 1 that divides batch_size=64" in out.stderr


def test_inspect_writes_a_tiny_models_sizes_in_bytes_not_as_zero_mib():
    out = run_cli("inspect", "--task", "mlp", "--layers", "2", "--depth", "8", "--embed", "4", "--mesh", "data=8",
                  "--rules", "dp")
    assert out.returncode == 0, out.stderr
    assert "0.00 MiB" not in out.stdout and "256 B" in out.stdout  # each (2, 4, 8) float32 matrix
    assert "parameters: 512 B in all, 512 B per device" in out.stdout


def test_inspect_counts_a_scanned_models_flops_for_every_layer():
    flops = {}
    for scan in ("scan", "no-scan"):
        out = run_cli("inspect", "--task", "mlp", "--layers", "4", "--depth", "64", "--embed", "32", "--mesh", "data=8",
                      "--rules", "dp", "--batch-size", "64", "--json", *(["--no-scan"] if scan == "no-scan" else []))
        assert out.returncode == 0, out.stderr
        flops[scan] = json.loads(out.stdout)["step_flops_per_device"]
    # XLA's cost analysis alone counted the scanned body once: a quarter of the 4 layers
    assert flops["scan"] == pytest.approx(flops["no-scan"], rel=0.1)
    # 4 layers x 2 matmuls of 8 rows x 32 x 64, forward and backward (3 matmuls each), 2 FLOPs per multiply-add
    assert flops["scan"] >= 4 * 2 * 3 * 2 * 8 * 32 * 64


def test_inspect_compiles_the_batch_asked_for_and_says_where_an_uneven_one_goes():
    tiny = ("inspect", "--task", "mlp", "--layers", "1", "--depth", "16", "--embed", "8", "--mesh", "data=8",
            "--rules", "dp")
    report = json.loads(run_cli(*tiny, "--batch-size", "3", "--json").stdout)
    # Rounded up to 8 before: a step nobody runs; train places 3 rows whole on every device.
    assert report["batch_size"] == 3 and report["batch_placement"].startswith("whole on every device")
    out = run_cli(*tiny, "--batch-size", "16")
    assert out.returncode == 0, out.stderr
    assert "batch 16: split: 2 row(s) on each of 8 batch shard(s)" in out.stdout


def test_inspect_names_the_rule_error():
    out = run_cli("inspect", "--mesh", "data=8", "--rules", "dp+tp")
    assert out.returncode == 2
    assert "rule 'hidden' -> 'model'" in out.stderr and "Traceback" not in out.stderr


def test_train_sharded_from_the_command_line(tmp_path):
    out = run_cli("train", "--host-devices", "8", "--task", "mlp", "--strategy", "sharded", "--rules", "fsdp+tp", "--mesh", "data=2,model=4",
                  "--layers", "2", "--depth", "64", "--embed", "32", "--no-scan", "--steps", "5", "--out", str(tmp_path),
                  "--no-progress")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] == "sharded" and summary["rules"] == "fsdp+tp"
    assert summary["rules_table"]["hidden"] == "model" and summary["steps"] == 5
    with np.load(tmp_path / "params.npz") as params:
        assert "['DotReluDot_1']['W1']" in params.files


def test_task_option_for_the_wrong_task_is_an_error():
    out = run_cli("train", "--task", "digits", "--layers", "3", "--no-progress")
    assert out.returncode == 2 and "task 'digits' does not take option(s) ['layers']" in out.stderr


@pytest.mark.parametrize("command", [["train", "--task", "lm"], ["inspect", "--task", "lm"],
                                     ["plan", "--task", "lm", "--devices", "2"]])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_scan_unroll_takes_a_whole_number_of_layers(command, value, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--scan-unroll", value])
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    shown = repr(value) if value == "x" else value
    assert (f"argument --scan-unroll: expected a whole number >= 1, got {shown}: pass --scan-unroll 1 for a rolled "
            "loop over the layers, or --scan-unroll N with N = --layers for no loop") in err, err


def test_scan_unroll_for_the_mlp_is_named_as_the_flag(capsys):
    assert main(["train", "--task", "mlp", "--scan-unroll", "1", "--no-progress", "--no-compile-cache"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "task 'mlp' does not take option(s) ['scan_unroll'] (--scan-unroll). Fix: drop them" in err, err


@pytest.mark.parametrize("task, flag, key", [("mlp", ["--scan-unroll", "1"], "scan_unroll"),
                                             ("mlp", ["--remat"], "remat"), ("lm", ["--depth", "8"], "depth")])
def test_inspect_names_another_tasks_option_by_its_flag(task, flag, key, capsys):
    assert main(["inspect", "--task", task, *flag, "--no-compile-cache"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"task {task!r} does not take option(s) [{key!r}] ({flag[0]}). Fix: drop them" in err, err


def test_inspect_builds_the_lm_with_the_scan_unroll_given(monkeypatch):
    import spmdkit._tasks
    from spmdkit._cli import _cmd_inspect, build_parser

    asked = {}

    def get_task(name, data_dir=None, **options):
        asked.update(options, task=name)
        raise RuntimeError("built")  # what inspect asked for is all this test reads: nothing compiles

    monkeypatch.setattr(spmdkit._tasks, "get_task", get_task)
    with pytest.raises(RuntimeError, match="built"):
        _cmd_inspect(build_parser().parse_args(["inspect", "--task", "lm", "--scan-unroll", "1"]), None)
    assert asked["task"] == "lm" and asked["scan_unroll"] == 1


def test_data_write_takes_lm_corpus_options(tmp_path, capsys):
    # `data write --task lm` took no --text-dir or --seq-len: only the stdlib at --seq-len 64 could be written.
    import spmdkit

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"f{i}.txt").write_text(f"text number {i} " * 30)
    assert main(["data", "write", str(tmp_path / "ds"), "--task", "lm", "--text-dir", str(corpus), "--seq-len", "16",
                 "--text-bytes", "5000"]) == 0
    assert "--seq-len 16" in capsys.readouterr().out  # the printed train command reads the same windows
    train = spmdkit.load_dataset(tmp_path / "ds" / "train")["tokens"]
    assert train.shape[1] == 17 and bytes(train[0, :16]) == (corpus / "f1.txt").read_bytes()[:16]
    assert main(["data", "write", str(tmp_path / "d2"), "--task", "digits", "--seq-len", "16"]) == 2
    assert "does not take option(s) ['seq_len']" in capsys.readouterr().err


@pytest.mark.parametrize("platform", ["cuda", "bogus"])
def test_jax_platforms_naming_a_missing_platform_is_a_clean_error(platform):
    # cuda on a CPU-only machine: a raw traceback ending in jax's bare AssertionError, exit 1.
    out = run_cli("devices", env={"JAX_PLATFORMS": platform}, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert f"JAX_PLATFORMS={platform!r}" in out.stderr and "JAX_PLATFORMS=cpu" in out.stderr


def test_ctrl_c_during_a_command_is_one_line_and_exit_code_130(own_group):
    # Ctrl-C while plan compiled ended in a KeyboardInterrupt traceback (and the process killed
    # by SIGINT, not exit code 130).
    import signal

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_")}
    with own_group([sys.executable, "-m", "spmdkit", "plan", "--task", "lm", "--devices", "8", "--target", "h100x8",
                    "--no-compile-cache"], sigint=True, env=env) as proc:
        first = proc.stdout.readline()  # "compiling [1/10] ...": inside the command, with 9 more to go
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert first.startswith("compiling"), first + err[-2000:]
    assert proc.returncode == 130, err[-3000:]
    assert "spmdkit: interrupted" in err.splitlines() and "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("argv", [
    ["data", "write", "d" * 300, "--task", "digits"], ["train", "--task", "digits", "--data", "runs/" + "d" * 300],
    ["train", "--out", "x" * 256], ["checkpoints", "c" * 400],
])
def test_a_path_with_a_name_past_255_bytes_is_refused_by_the_parser(argv, capsys):
    """It was a raw OSError (File name too long) from the first look at the path, exit code 1."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "file systems take at most 255: shorten it" in capsys.readouterr().err
