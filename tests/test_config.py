"""Configs: validation, the TOML file, and option precedence."""

from __future__ import annotations

import math

import pytest

import spmdkit
from spmdkit._config import build_run_config, check_keys, load_toml
from spmdkit._train_cli import resolve_options


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "batch_size=0 must be a whole number >= 1"),
        ({"batch_size": -4}, "batch_size=-4"),
        ({"steps": 10, "epochs": 2}, "both steps=10 and epochs=2"),
        ({"seed": -1}, "seed=-1"),
        ({"seed": 2**32}, r"seed=4294967296 must be an int from 0 to 4294967295 \(JAX's random key keeps 32 bits of a "
                          r"seed: 4294967296 would run as seed 0\)"),
        ({"seed": 2**63}, "seed=9223372036854775808 must be an int from 0 to 4294967295"),
        ({"log_every": 0}, "log_every=0"),
        # None means something only for steps, epochs and eval_every.
        ({"batch_size": None}, "batch_size=None must be a whole number >= 1"),
        ({"grad_accum": None}, "grad_accum=None"),
        ({"drop_remainder": "no"}, "drop_remainder='no' must be True or False"),
    ],
)
def test_train_config_errors(kwargs, match):
    with pytest.raises(spmdkit.ConfigError, match=match):
        spmdkit.TrainConfig(**kwargs)


def test_numpy_numbers_from_a_sweep_are_taken_as_python_numbers():
    # for bs in np.array([16, 32]): TrainConfig(batch_size=bs) said "batch_size=np.int64(16) must be a
    # whole number >= 1", and lr=np.float32(1e-3) "must be a finite number > 0": both false.
    import json

    import numpy as np

    config = spmdkit.TrainConfig(steps=np.int64(10), batch_size=np.int32(16), seed=np.uint8(3), prefetch=np.int64(0))
    assert (config.steps, config.batch_size, config.seed, config.prefetch) == (10, 16, 3, 0)
    assert all(type(v) is int for v in (config.steps, config.batch_size, config.seed, config.prefetch))
    json.dumps(config.__dict__)  # summaries and checkpoint metadata are JSON
    opt = spmdkit.OptimizerConfig("sgd", lr=np.float32(0.5), momentum=np.float64(0.9))
    assert type(opt.lr) is float and opt.lr == 0.5 and type(opt.momentum) is float
    for bad in ({"steps": np.float64(10.0)}, {"steps": np.bool_(True)}, {"batch_size": np.int64(0)}):
        with pytest.raises(spmdkit.ConfigError, match="must be a whole number >= 1"):
            spmdkit.TrainConfig(**bad)


def test_train_config_default_length():
    assert spmdkit.TrainConfig().steps == 100
    assert spmdkit.TrainConfig(epochs=3).steps is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -0.1}, "lr=-0.1: the learning rate must be a finite number > 0"),
        ({"lr": 0.0}, r"Fix: pass e\.g\. lr=0\.01 \(--lr 0\.01 on the command line"),  # was the flag alone
        ({"lr": 0.0}, "lr=0.0"),
        ({"lr": math.nan}, "lr=nan"),
        ({"name": "lion"}, r"optimizer='lion' is not known"),
        ({"momentum": 1.0}, "momentum=1.0"),
        # From Python any object reaches these: each must be a ConfigError, never a TypeError
        # or an OverflowError from the comparison.
        ({"lr": 10**400}, r"lr=1000.*\.\.\..*the learning rate must be a finite number > 0"),
        ({"momentum": None}, "momentum=None must be a number in"),
        ({"momentum": "0.9"}, "momentum='0.9' must be a number in"),
        ({"weight_decay": math.inf}, "weight_decay=inf must be a finite number >= 0"),
    ],
)
def test_optimizer_config_errors(kwargs, match):
    with pytest.raises(spmdkit.ConfigError, match=match):
        spmdkit.OptimizerConfig(**kwargs)


@pytest.mark.parametrize("name, kwargs, used_by", [("adam", {"momentum": 0.9}, "sgd"),
                                                   ("sgd", {"weight_decay": 0.5}, "adamw"),
                                                   ("adam", {"weight_decay": 0.5}, "adamw")])
def test_an_option_the_optimizer_ignores_is_refused(name, kwargs, used_by):
    key, value = next(iter(kwargs.items()))
    with pytest.raises(spmdkit.ConfigError, match=f"{name} does not use {key}, only {used_by} uses it"):
        spmdkit.OptimizerConfig(name, **kwargs)
    flag = "--" + key.replace("_", "-")
    with pytest.raises(spmdkit.ConfigError, match=f"{flag} {value} is an option of --optimizer {used_by}; "
                       f"--optimizer {name} does not use it"):
        build_run_config(resolve_options({"task": "linreg", "optimizer": name, key: value}))


@pytest.mark.parametrize("strategy, key, value, given, used_by", [
    ("data", "members", 4, "--members 4", "--strategy ensemble"),
    ("data", "bagging", True, "--bagging", "--strategy ensemble"),
    ("single", "mesh", "data=2", "--mesh data=2", "--strategy data or --strategy sharded"),
    ("sharded", "impl", "jit", "--impl jit", "--strategy data"),
    ("ensemble", "rules", "fsdp", "--rules fsdp", "--strategy sharded"),
])
def test_a_flag_the_strategy_ignores_is_named_as_a_flag(strategy, key, value, given, used_by):
    with pytest.raises(spmdkit.ConfigError) as e:
        build_run_config(resolve_options({"task": "linreg", "strategy": strategy, key: value}))
    assert str(e.value).startswith(f"{given} is an option of {used_by}; --strategy {strategy} takes ")
    assert f"Fix: drop --{key} (or `{key} = ...` in the --config file), or pass {used_by}." in str(e.value)


def test_strategy_flags_at_their_defaults_are_no_error():
    run = build_run_config(resolve_options({"task": "linreg", "strategy": "data", "bagging": False, "impl": "auto"}))
    assert run.strategy == "data"


def test_a_task_default_the_chosen_optimizer_ignores_is_dropped():
    # digits trains with SGD and momentum 0.9: --optimizer adam did not ask for momentum.
    options = resolve_options({"task": "digits", "optimizer": "adam"})
    assert "momentum" not in options and build_run_config(options).optimizer.momentum == 0.0


def test_resume_ignores_an_option_its_optimizer_never_read():
    from spmdkit._config import changed_options

    # Such a checkpoint recorded --momentum 0.9 with adam and trained without it.
    assert changed_options({"optimizer": "adam", "momentum": 0.9}, {"optimizer": "adam"}) == []
    assert changed_options({"optimizer": "sgd", "momentum": 0.9}, {"optimizer": "sgd"}) == [("--momentum", 0.9, 0.0)]


def test_resume_compares_precision_with_its_default_in_effect():
    from spmdkit._config import changed_options

    # --precision f32 is lm's default: a resume giving it was refused as "written with --precision None,
    # this run has --precision f32", and the fix said "resume with --precision None", which is no value.
    assert changed_options({"optimizer": "adamw"}, {"optimizer": "adamw", "precision": "f32"}) == []
    assert changed_options({"optimizer": "adamw", "precision": "f32"}, {"optimizer": "adamw", "precision": None}) == []
    assert changed_options({"optimizer": "adamw", "precision": "bf16"}, {"optimizer": "adamw"}) == [
        ("--precision", "bf16", "f32")]
    assert changed_options({"optimizer": "adamw"}, {"optimizer": "adamw", "precision": "bf16"}) == [
        ("--precision", "f32", "bf16")]


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizer_builds(name):
    import jax.numpy as jnp

    opt = spmdkit.OptimizerConfig(name=name, lr=0.1, momentum=0.9 if name == "sgd" else 0.0).build()
    state = opt.init({"w": jnp.ones(2)})
    updates, _ = opt.update({"w": jnp.ones(2)}, state, {"w": jnp.ones(2)})
    assert float(updates["w"][0]) < 0


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(spmdkit.ConfigError) as e:
        check_keys({"batchsize": 3}, "config file 'x.toml'")
    assert "unknown key 'batchsize'" in str(e.value) and "did you mean 'batch_size'" in str(e.value)
    assert check_keys({"batch-size": 3}, "f") == {"batch_size": 3}


def test_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('task = "digits"\nbatch-size = 16\nlr = 0.1\nsteps = 7\n')
    assert load_toml(str(path)) == {"task": "digits", "batch_size": 16, "lr": 0.1, "steps": 7}
    (tmp_path / "bad.toml").write_text("lr = = 1")
    with pytest.raises(spmdkit.ConfigError, match="is not valid TOML"):
        load_toml(str(tmp_path / "bad.toml"))
    (tmp_path / "nested.toml").write_text("[optimizer]\nlr = 1.0\n")
    with pytest.raises(spmdkit.ConfigError, match=r"keys are flat .*\['optimizer'\]"):
        load_toml(str(tmp_path / "nested.toml"))
    with pytest.raises(spmdkit.ConfigError, match="does not exist"):
        load_toml(str(tmp_path / "missing.toml"))
    (tmp_path / "typo.toml").write_text("learning_rate = 0.1\n")
    with pytest.raises(spmdkit.ConfigError, match="unknown key 'learning_rate'"):
        load_toml(str(tmp_path / "typo.toml"))


def test_a_config_that_is_a_directory_or_not_utf8_is_named(tmp_path):
    with pytest.raises(spmdkit.ConfigError, match="is a directory"):
        load_toml(str(tmp_path))
    (tmp_path / "latin1.toml").write_bytes('out = "r\xe9sum\xe9"\n'.encode("latin-1"))
    with pytest.raises(spmdkit.ConfigError, match=r"is not UTF-8 text \(byte 0xe9 at offset 8\)"):
        load_toml(str(tmp_path / "latin1.toml"))


def test_precedence_task_defaults_then_file_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('task = "digits"\nlr = 0.2\nsteps = 7\n')
    options = resolve_options({"config": str(path), "steps": 9})
    assert options["task"] == "digits"
    assert options["lr"] == 0.2  # file over the task's 0.05
    assert options["steps"] == 9  # flag over file
    assert options["momentum"] == 0.9  # the task's default
    run = build_run_config(options)
    assert run.train.steps == 9 and run.optimizer.lr == 0.2 and run.optimizer.momentum == 0.9
    # --epochs replaces the task's default steps rather than clashing with it.
    assert build_run_config(resolve_options({"epochs": 2})).train.epochs == 2


def test_wrongly_typed_value():
    with pytest.raises(spmdkit.ConfigError):
        build_run_config({"batch_size": "big"})


@pytest.mark.parametrize(
    "text, message",
    [
        ('resume = "false"\ncheckpoint-dir = "ck"\n', "resume = 'false' (str) must be true or false"),
        ('bagging = "no"\n', "bagging = 'no' (str) must be true or false"),
        ("host-devices = 0\n", "host-devices = 0 (int) must be a whole number >= 1"),
        ("mesh = 5\n", "mesh = 5 (int) must be a string"),
        ("steps = 2.5\n", "steps = 2.5 (float) must be a whole number >= 1"),
        ("lr = true\n", "lr = True (bool) must be a number"),
        # The fix's example is a value the key takes, not a placeholder that would be refused too.
        ("remat = true\n", 'write e.g. remat = "full" in a config file'),
        ("optimizer = 1\n", 'write e.g. optimizer = "adam" in a config file'),
        ("batch-size = 8\nbatch_size = 16\n", "'batch-size' and 'batch_size' are the same option, given twice"),
        # out = "" wrote the run's files into the current directory.
        ('out = ""\n', "out = '' (str) must be a path (a non-empty string)"),
        ('text-dir = ""\n', "text-dir = '' (str) must be a path"),
        ('rules = ""\n', "rules = '' (str) must be a non-empty string"),
        ("scan-unroll = 0\n", "scan-unroll = 0 (int) must be a whole number >= 1"),
        # 8, every number key's example, would not roll the loop the key is there for.
        ('scan-unroll = "1"\n', "write e.g. scan-unroll = 1 in a config file, or --scan-unroll on the command line"),
    ],
)
def test_config_values_are_typed_strictly(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(spmdkit.ConfigError) as e:
        load_toml(str(path))
    assert message in str(e.value) and "Fix:" in str(e.value)


def test_checkpoint_flags_without_a_directory_name_real_flags():
    with pytest.raises(spmdkit.ConfigError) as e:
        build_run_config({"checkpoint_every": 5, "resume": True})
    assert "--checkpoint-every, --resume need --checkpoint-dir" in str(e.value) and "--every'" not in str(e.value)


def test_overwrite_and_resume_together_are_refused():
    with pytest.raises(spmdkit.CheckpointError, match="resume and overwrite were both asked for"):
        build_run_config({"checkpoint_dir": "ck", "resume": True, "overwrite_checkpoints": True})


@pytest.mark.parametrize("task, key, value, flag, takes", [
    ("digits", "layers", 3, "--layers", "none of the model options"),
    ("linreg", "scan", False, "--no-scan", "none of the model options"),
    ("mlp", "text_dir", "/tmp", "--text-dir", "--layers, --depth, --embed, --no-scan"),
    ("mlp", "scan_unroll", 1, "--scan-unroll", "--layers, --depth, --embed, --no-scan"),
])
def test_another_tasks_model_flag_is_named_as_a_flag(task, key, value, flag, takes):
    with pytest.raises(spmdkit.ConfigError) as e:
        build_run_config(resolve_options({"task": task, key: value}))
    assert str(e.value).startswith(f"task {task!r} does not take option(s) [{key!r}] ({flag}).")
    assert f"Fix: drop them; --task {task} takes {takes}." in str(e.value)


def test_scan_unroll_from_a_config_file_is_an_lm_option_a_flag_overrides(tmp_path):
    # A rolled scan (remat's memory saving on jax 0.10.2) had neither a key nor a flag: Python only.
    from spmdkit._config import task_options

    path = tmp_path / "run.toml"
    path.write_text('task = "lm"\nscan-unroll = 1\n')
    assert task_options(build_run_config(resolve_options({"config": str(path)}))) == {"scan_unroll": 1}
    assert task_options(build_run_config(resolve_options({"config": str(path), "scan_unroll": 4}))) == {"scan_unroll": 4}


def test_a_config_file_with_a_utf8_byte_order_mark_is_read(tmp_path):
    # Notepad's BOM made tomllib fail with "Invalid statement (at line 1, column 1)", no cause named.
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbftask = \"linreg\"\nsteps = 3\n")
    assert load_toml(str(path)) == {"task": "linreg", "steps": 3}
    (tmp_path / "latin1.toml").write_bytes(b"out = \"caf\xe9\"\n")
    with pytest.raises(spmdkit.ConfigError, match="not UTF-8"):
        load_toml(str(tmp_path / "latin1.toml"))


def test_relative_paths_in_a_config_file_are_read_from_the_working_directory(tmp_path, monkeypatch):
    # README says so; a config in another directory must not move its relative paths.
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "run.toml"
    path.write_text('out = "runs/a"\ncheckpoint-dir = "ck"\n')
    monkeypatch.chdir(tmp_path)
    run = build_run_config(load_toml(str(path)))
    assert run.out == "runs/a" and str(run.checkpoint.directory) == "ck"


def test_a_length_flag_overrides_the_files_other_length_and_a_key_in_capitals_gets_its_hint(tmp_path):
    # steps = 5 in a file with --epochs 1 was "both steps=5 and epochs=1 were given", against
    # "flags override the file"; 'LR' got no "did you mean 'lr'".
    path = tmp_path / "run.toml"
    path.write_text("steps = 5\n")
    run = build_run_config(resolve_options({"task": "linreg", "config": str(path), "epochs": 1}))
    assert (run.train.steps, run.train.epochs) == (None, 1)
    path.write_text("epochs = 2\n")
    run = build_run_config(resolve_options({"task": "linreg", "config": str(path), "steps": 7}))
    assert (run.train.steps, run.train.epochs) == (7, None)
    with pytest.raises(spmdkit.ConfigError, match="both steps=3 and epochs=1"):  # both as flags: still refused
        build_run_config(resolve_options({"task": "linreg", "steps": 3, "epochs": 1}))
    path.write_text("LR = 0.1\n")
    with pytest.raises(spmdkit.ConfigError, match="(?s)unknown key 'LR'.*did you mean 'lr'"):
        resolve_options({"task": "linreg", "config": str(path)})


def test_every_on_off_option_a_file_turns_on_a_flag_turns_off(tmp_path):
    # resume = true (or bagging, drop-remainder, overwrite-checkpoints, replicate-unknown) in a file
    # had no flag to undo it for one run; progress = false none to turn it on.
    from spmdkit._cli import build_parser

    path = tmp_path / "run.toml"
    path.write_text('resume = true\nbagging = true\ndrop-remainder = true\noverwrite-checkpoints = true\n'
                    'replicate-unknown = true\nprogress = false\ncheckpoint-dir = "ck"\n')
    flags = ["--no-resume", "--no-bagging", "--no-drop-remainder", "--no-overwrite-checkpoints",
             "--no-replicate-unknown", "--progress"]
    args = vars(build_parser().parse_args(["train", "--config", str(path), *flags]))
    process = ("command", "coordinator", "num_processes", "process_id", "distributed_timeout", "compile_cache",
               "no_compile_cache")
    options = resolve_options({k: v for k, v in args.items() if k not in process})  # as train_from_args does
    assert {k: options[k] for k in ("resume", "bagging", "drop_remainder", "overwrite_checkpoints",
                                     "replicate_unknown", "progress")} == {
        "resume": False, "bagging": False, "drop_remainder": False, "overwrite_checkpoints": False,
        "replicate_unknown": False, "progress": True}
    assert "resume" not in vars(build_parser().parse_args(["train"]))  # not given: the file's or default value


def test_a_second_config_file_is_refused_not_taken_alone(tmp_path, capsys):
    # --config a.toml --config b.toml took b.toml alone, without a word.
    from spmdkit._cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--config", "a.toml", "--config", "b.toml"])
    assert e.value.code == 2
    assert "--config is given twice (a.toml and b.toml); it takes one file" in capsys.readouterr().err
    assert build_parser().parse_args(["train", "--config", "a.toml"]).config == "a.toml"


def test_a_flag_out_of_range_is_said_as_the_flag():
    # `spmdkit train --seed -1` was "flags: seed = -1 (int) must be ...; Fix: write e.g. seed = 0 in a
    # config file, or --seed on the command line": a file's line for a flag, and no value to pass.
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)^--seed -1 must be a whole number from 0 to 4294967295\..*"
                                                  r"Fix: pass e\.g\. --seed 0\.$"):
        resolve_options({"task": "linreg", "seed": -1})
    assert resolve_options({"task": "linreg", "seed": 0})["seed"] == 0  # the fix, applied
