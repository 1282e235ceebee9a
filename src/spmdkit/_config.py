"""Frozen configs, one per concern, and the TOML file that mirrors the CLI flags."""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import os
import reprlib
import tomllib
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import optax

from spmdkit._checkpoint import CheckpointConfig
from spmdkit._errors import ConfigError, fix
from spmdkit._strategies import ACCEPTS, StrategyOptions
from spmdkit._tasks import TASKS
from spmdkit._tasks import task_options as model_options
from spmdkit._types import finite_float, whole_number


@dataclass(frozen=True)
class TrainConfig:
    """When things happen in the training loop.

    Exactly one of ``steps`` and ``epochs`` sets the length. ``batch_size`` is the
    global batch (all devices together); results do not depend on how many devices
    share it.
    """

    steps: int | None = None
    epochs: int | None = None
    batch_size: int = 32
    seed: int = 0
    eval_every: int | None = None  # steps; None: once per epoch and at the end
    eval_batch_size: int = 256
    log_every: int = 1
    drop_remainder: bool = False
    grad_accum: int = 1  # micro-batches per optimizer step; batch_size is their total
    prefetch: int = 2  # batches read and put on the devices ahead of the step; 0: none

    def __post_init__(self) -> None:
        if self.steps is None and self.epochs is None:
            object.__setattr__(self, "steps", 100)
        if self.steps is not None and self.epochs is not None:
            raise ConfigError(
                fix(
                    f"both steps={self.steps} and epochs={self.epochs} were given.",
                    "give one of them: --steps S or --epochs E.",
                )
            )
        for name in ("steps", "epochs", "batch_size", "eval_every", "eval_batch_size", "log_every", "grad_accum"):
            value = getattr(self, name)
            if value is None and name in ("steps", "epochs", "eval_every"):
                continue  # None has a meaning for these (see the fields)
            number = whole_number(value)
            if number is None or number < 1:
                raise ConfigError(
                    fix(f"{name}={value!r} must be a whole number >= 1.", f"e.g. {name}=10.")
                )
            object.__setattr__(self, name, number)  # a NumPy int as Python's: summaries are JSON
        seed = whole_number(self.seed)
        if seed is None or not 0 <= seed < SEEDS:
            raise ConfigError(fix(f"seed={self.seed!r} must be an int from 0 to {SEEDS - 1}{_seed_why(seed)}.",
                                  "e.g. seed=0."))
        object.__setattr__(self, "seed", seed)
        if not isinstance(self.drop_remainder, bool):
            raise ConfigError(fix(f"drop_remainder={self.drop_remainder!r} must be True or False.",
                                  "e.g. drop_remainder=True (--drop-remainder)."))
        prefetch = whole_number(self.prefetch)
        if prefetch is None or prefetch < 0:
            raise ConfigError(fix(f"prefetch={self.prefetch!r} must be an int >= 0.", "e.g. prefetch=2 (--prefetch 2)."))
        object.__setattr__(self, "prefetch", prefetch)


_OPTIMIZERS = ("sgd", "adam", "adamw")
# The optimizers whose build() reads each hyperparameter: the others would drop it without a word.
OPTIMIZER_USES = {"momentum": ("sgd",), "weight_decay": ("adamw",)}


def unused_optimizer_options(name: str, values: dict[str, Any]) -> list[str]:
    """The keys of ``values`` set to a non-zero value that optimizer ``name`` does not read.

    >>> unused_optimizer_options("adam", {"momentum": 0.9, "weight_decay": 0.0})
    ['momentum']
    """
    return [k for k, users in OPTIMIZER_USES.items() if values.get(k) and name not in users]


@dataclass(frozen=True)
class OptimizerConfig:
    """Which optax optimizer, with which hyperparameters."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            raise ConfigError(
                fix(
                    f"optimizer={self.name!r} is not known.",
                    f"choose one of {list(_OPTIMIZERS)} (or pass any optax transformation "
                    "from Python).",
                )
            )
        lr = self.lr
        if (finite_float(lr) or 0) <= 0:
            raise ConfigError(
                fix(
                    f"lr={reprlib.repr(lr)}: the learning rate must be a finite number > 0.",
                    "pass e.g. lr=0.01 (--lr 0.01 on the command line; a negative rate would climb the loss, not "
                    "descend it).",
                )
            )
        momentum, decay = finite_float(self.momentum), finite_float(self.weight_decay)
        if momentum is None or not 0 <= momentum < 1:
            raise ConfigError(fix(f"momentum={self.momentum!r} must be a number in [0, 1).", "e.g. 0.9."))
        if decay is None or decay < 0:
            raise ConfigError(fix(f"weight_decay={self.weight_decay!r} must be a finite number >= 0.", "e.g. 1e-4."))
        for name, value in (("lr", finite_float(lr)), ("momentum", momentum), ("weight_decay", decay)):
            object.__setattr__(self, name, value)  # a NumPy number as Python's float
        self._check_used()

    def _check_used(self) -> None:
        for key in unused_optimizer_options(self.name, dataclasses.asdict(self)):
            users = OPTIMIZER_USES[key]
            raise ConfigError(fix(
                f"OptimizerConfig({self.name!r}, {key}={getattr(self, key)!r}): {self.name} does not use {key}, "
                f"only {' and '.join(users)} uses it; it would be ignored.",
                f"drop {key}, or choose name={users[0]!r}."))

    def build(self) -> optax.GradientTransformation:
        """The optax transformation this config describes."""
        if self.name == "sgd":
            return optax.sgd(self.lr, momentum=self.momentum or None)
        if self.name == "adam":
            return optax.adam(self.lr)
        return optax.adamw(self.lr, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class RunConfig:
    """What to train, where it runs, where results go."""

    task: str = "linreg"
    strategy: str = "data"
    impl: str = "auto"
    members: int | None = None
    bagging: bool = False
    mesh: str | None = None
    rules: str | None = None
    replicate_unknown: bool = False
    data_dir: str | None = None
    data: str | None = None  # a data set directory (spmdkit.write_dataset) the task trains on instead
    eval_data: str | None = None  # a data set directory the task evaluates on instead
    # --data / --eval-data: every file's CRC-32 checked before the first step (one read of the data
    # set; a file swapped for another of the same shape would otherwise train silently).
    verify_data: bool = True
    # Task options (mlp): None means the task's own default.
    layers: int | None = None
    depth: int | None = None
    embed: int | None = None
    scan: bool | None = None
    # Task options (lm): None means the task's own default.
    d_model: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    precision: str | None = None
    remat: str | None = None
    scan_unroll: int | None = None
    text_dir: str | None = None
    text_bytes: int | None = None
    host_devices: int | None = None
    out: str = "runs/latest"
    progress: bool = True
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig | None = None


# Keys of the TOML file / CLI flags -> (config section, field). Flags and keys share
# one table so that a key the file accepts is always a flag too, and the reverse.
_KEYS: dict[str, tuple[str | None, str]] = {
    "task": (None, "task"),
    "strategy": (None, "strategy"),
    "impl": (None, "impl"),
    "members": (None, "members"),
    "bagging": (None, "bagging"),
    "data_dir": (None, "data_dir"),
    "data": (None, "data"),
    "eval_data": (None, "eval_data"),
    "verify_data": (None, "verify_data"),
    "mesh": (None, "mesh"),
    "rules": (None, "rules"),
    "replicate_unknown": (None, "replicate_unknown"),
    "layers": (None, "layers"),
    "depth": (None, "depth"),
    "embed": (None, "embed"),
    "scan": (None, "scan"),
    **{k: (None, k) for k in ("d_model", "heads", "seq_len", "precision", "remat", "scan_unroll", "text_dir",
                              "text_bytes")},
    "host_devices": (None, "host_devices"),
    "out": (None, "out"),
    "progress": (None, "progress"),
    **{f.name: ("train", f.name) for f in dataclasses.fields(TrainConfig)},
    "optimizer": ("optimizer", "name"),
    "lr": ("optimizer", "lr"),
    "momentum": ("optimizer", "momentum"),
    "weight_decay": ("optimizer", "weight_decay"),
    "checkpoint_dir": ("checkpoint", "directory"),
    "checkpoint_every": ("checkpoint", "every"),
    "keep": ("checkpoint", "keep"),
    "resume": ("checkpoint", "resume"),
    "overwrite_checkpoints": ("checkpoint", "overwrite"),
}
CONFIG_KEYS = tuple(_KEYS)

# The type of every key: a TOML value of another type is an error, never a guess
# (the string "false" is not False; 5 is not a mesh).
_BOOLS = {"bagging", "replicate_unknown", "scan", "progress", "verify_data", "drop_remainder", "resume", "overwrite_checkpoints"}
_POSITIVE = {"members", "layers", "depth", "embed", "host_devices", "steps", "epochs", "batch_size", "eval_every",
             "eval_batch_size", "log_every", "grad_accum", "checkpoint_every", "keep",
             "d_model", "heads", "seq_len", "scan_unroll", "text_bytes"}
_NON_NEGATIVE = {"prefetch"}
_FLOATS = {"lr", "momentum", "weight_decay"}
_STRINGS = {"task", "strategy", "impl", "data_dir", "data", "eval_data", "mesh", "rules", "out", "optimizer", "checkpoint_dir",
            "precision", "remat", "text_dir"}
# Strings that name a file or directory: an empty one wrote the run's files into the current
# directory (out = "") as a flag's empty value did (see _argtypes.path_arg).
_PATHS = {"data_dir", "data", "eval_data", "out", "checkpoint_dir", "text_dir"}
# A real value of each string key: a placeholder like "name" in a fix would be refused in turn. A
# number key's example is 8 unless named here (scan-unroll = 8 would not roll the loop it is for).
_EXAMPLES = {"mesh": '"data=2,model=4"', "rules": '"dp+tp"', "out": '"runs/a"', "data_dir": '"data/mnist"',
             "checkpoint_dir": '"ck"', "remat": '"full"', "precision": '"bf16"', "optimizer": '"adam"',
             "task": '"digits"', "strategy": '"data"', "impl": '"jit"', "data": '"data/ds"', "eval_data": '"data/ds2"',
             "text_dir": '"texts"', "scan_unroll": "1"}


# Keys whose flag turns them off (on by default).
_NEGATED_FLAGS = {"progress": "--no-progress", "verify_data": "--no-verify-data", "scan": "--no-scan"}


def _flag(key: str) -> str:
    return _NEGATED_FLAGS.get(key) or "--" + key.replace("_", "-")


# jax.random.key keeps 32 bits of a seed (without x64): seed 2**32 gave seed 0's run, silently.
SEEDS = 2**32


def _seed_why(seed: Any) -> str:
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= SEEDS:
        return f" (JAX's random key keeps 32 bits of a seed: {seed} would run as seed {seed % SEEDS})"
    return ""


def check_value(key: str, value: Any, source: str) -> None:
    """``value`` has the type of ``key`` (and is in range); a ConfigError naming both otherwise."""
    if value is None:
        return
    if key in _BOOLS:
        ok, want, example = isinstance(value, bool), "true or false", f"{key.replace('_', '-')} = true"
    elif key in _POSITIVE:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        want, example = "a whole number >= 1", f"{key.replace('_', '-')} = {_EXAMPLES.get(key, 8)}"
    elif key == "seed":
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < SEEDS
        want, example = f"a whole number from 0 to {SEEDS - 1}{_seed_why(value)}", f"{key} = 0"
    elif key in _NON_NEGATIVE:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        want, example = "a whole number >= 0", f"{key} = 0"
    elif key in _FLOATS:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        want, example = "a number", f"{key.replace('_', '-')} = 0.01"
    elif key in _STRINGS:
        ok, want = isinstance(value, str), "a string"
        if ok and key in _PATHS and value == "":
            ok, want = False, "a path (a non-empty string)"
        elif ok and key in ("mesh", "rules") and not value.strip():  # was taken as not given: the preset
            ok, want = False, "a non-empty string"
        example = f"{key.replace('_', '-')} = {_EXAMPLES.get(key, chr(34) + 'name' + chr(34))}"
    else:
        return
    if not ok:
        if source == "flags":  # given on the command line: said in flags ("flags: seed = -1 (int)" read as a file's line)
            raise ConfigError(fix(f"{_flag(key)} {value!r} must be {want}.",
                                  f"pass e.g. {_flag(key)} {example.split(' = ', 1)[1]}."))
        raise ConfigError(fix(
            f"{source}: {key.replace('_', '-')} = {value!r} ({type(value).__name__}) must be {want}.",
            f"write e.g. {example} in a config file, or {_flag(key)} on the command line."))


# Options that change what a run computes beyond what a checkpoint checks itself (the task,
# seed, batch size and every leaf's shape): a resume with another value would not continue
# the run it claims to continue. The layout (strategy, mesh, rules, devices) may change, and so
# may lm's program form (remat, scan_unroll: the same state, recomputed or looped otherwise).
RESULT_OPTIONS = {"optimizer": OptimizerConfig.name, "lr": OptimizerConfig.lr, "momentum": OptimizerConfig.momentum,
                  "weight_decay": OptimizerConfig.weight_decay, "grad_accum": TrainConfig.grad_accum,
                  # lm's own default, not RunConfig's None ("not given"): a resume with --precision f32 of a run
                  # started without the flag computes the same and was refused ("--precision None").
                  "bagging": RunConfig.bagging, "precision": "f32"}
# Where the data come from: a path may move with the same data, so a change is only pointed out.
DATA_OPTIONS = ("data_dir", "data", "text_dir")


def moved_data(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(flag, saved path, this run's path)`` of every data location that differs.

    >>> moved_data({"text_dir": "txt"}, {"text_dir": "txt3"})
    [('--text-dir', 'txt', 'txt3')]
    """
    return [(_flag(k), saved.get(k), now.get(k)) for k in DATA_OPTIONS if not _same_place(saved.get(k), now.get(k))]


def _same_place(saved: Any, now: Any) -> bool:
    # Paths are recorded absolute; a checkpoint written before that holds the path as given,
    # taken here as relative to this run's working directory, as it was read before.
    if saved == now:
        return True
    return isinstance(saved, str) and isinstance(now, str) and os.path.abspath(saved) == os.path.abspath(now)


def _in_effect(options: dict[str, Any], key: str, default: Any) -> Any:
    # An option its optimizer does not read changes nothing: a checkpoint written before such
    # options were refused (they were recorded, then ignored) resumes without them.
    name = options.get("optimizer", OptimizerConfig.name)
    if name not in OPTIMIZER_USES.get(key, (name,)):
        return default
    value = options.get(key)
    return default if value is None else value  # None: not given, the default in effect


def changed_options(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(flag, saved value, this run's value)`` of every result-changing option that differs.

    >>> changed_options({"lr": 0.05, "optimizer": "sgd"}, {"lr": 0.5})
    [('--lr', 0.05, 0.5)]
    >>> changed_options({"precision": "bf16"}, {}), changed_options({}, {"precision": "f32"})
    ([('--precision', 'bf16', 'f32')], [])
    """
    out = []
    for key, default in RESULT_OPTIONS.items():
        then, value = _in_effect(saved, key, default), _in_effect(now, key, default)
        if then != value:
            out.append((_flag(key), then, value))
    return out


# Options that decide the state's leaves and shapes: a checkpoint that does not fit names one.
SHAPE_OPTIONS = ("task", "strategy", "members", "layers", "depth", "embed", "scan", "d_model", "heads", "seq_len",
                 "optimizer", "momentum")


# The options that choose the training examples: a resume with others reads another data order.
EXAMPLE_OPTIONS = (*DATA_OPTIONS, "text_bytes", "seq_len")


def differing_options(saved: dict[str, Any], now: dict[str, Any],
                          keys: tuple[str, ...] = SHAPE_OPTIONS) -> list[str]:
    """Every option of ``keys`` (the state-shaping ones unless told) that differs, as
    ``flag: checkpoint's -> this run's``.

    >>> differing_options({"task": "mlp"}, {"task": "mlp", "scan": False, "layers": 3})
    ['--layers: not given -> 3', '--no-scan: not given -> given']
    """
    def shown(key: str, value: Any) -> str:
        if key in _NEGATED_FLAGS and value is not None:
            value = None if value else "given"  # scan=False is the flag --no-scan given
        return "not given" if value is None else str(value)

    return [f"{_flag(k)}: {shown(k, saved.get(k))} -> {shown(k, now.get(k))}"
            for k in keys if shown(k, saved.get(k)) != shown(k, now.get(k))]


def _normalise(key: str) -> str:
    return key.strip().replace("-", "_")


def check_keys(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Normalise ``batch-size`` to ``batch_size``; an unknown, duplicate or mistyped key is a ConfigError."""
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in values.items():
        k = _normalise(key)
        if k in spelled:
            raise ConfigError(fix(f"{source}: {spelled[k]!r} and {key!r} are the same option, given twice.",
                                  f"keep one of them ({k.replace('_', '-')} = ...)."))
        spelled[k] = key
        if k not in _KEYS:
            close = difflib.get_close_matches(k.lower(), CONFIG_KEYS, n=1)  # LR -> lr
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                fix(
                    f"{source}: unknown key {key!r}.",
                    f"{hint}known keys: {', '.join(CONFIG_KEYS)}.",
                )
            )
        check_value(k, value, source)
        out[k] = value
    return out


def load_toml(path: str) -> dict[str, Any]:
    """Read a flat TOML config whose keys mirror the flags (``batch-size = 32``)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        # Windows editors (Notepad) start a UTF-8 file with a byte order mark, which tomllib
        # refuses as an "Invalid statement (at line 1, column 1)" that names no cause.
        raw = tomllib.loads(data.removeprefix(codecs.BOM_UTF8).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(fix(f"config file {path!r} does not exist.", "check the path.")) from None
    except IsADirectoryError:
        raise ConfigError(fix(f"--config {path!r} is a directory.", "pass a TOML file, e.g. --config run.toml.")) from None
    except OSError as e:
        raise ConfigError(fix(f"--config {path!r} cannot be read: {e.strerror or e}.",
                              "pass a TOML file you can read.")) from None
    except UnicodeDecodeError as e:
        raise ConfigError(fix(f"config file {path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start}): TOML is UTF-8.", "save it as UTF-8, or pass the TOML file meant.")) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(fix(f"config file {path!r} is not valid TOML: {e}.", "fix the syntax.")) from None
    nested = [k for k, v in raw.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(
            fix(
                f"config file {path!r}: keys are flat (they mirror the flags), but "
                f"{nested} are tables.",
                "write e.g. `lr = 0.01`, not `[optimizer]\\nlr = 0.01`.",
            )
        )
    return check_keys(raw, f"config file {path!r}")


def build_run_config(values: dict[str, Any]) -> RunConfig:
    """A RunConfig from flat, already-checked keys; each dataclass validates itself."""
    sections: dict[str | None, dict[str, Any]] = {None: {}, "train": {}, "optimizer": {}, "checkpoint": {}}
    for key, value in check_keys(values, "options").items():
        section, name = _KEYS[key]
        sections[section][name] = value
    try:
        train = TrainConfig(**sections["train"])
        _check_strategy_flags(sections[None])
        task = sections[None].get("task", RunConfig.task)
        check_task_flags(task, [k for k in TASK_FLAGS if sections[None].get(k) is not None])
        _check_optimizer_flags(sections["optimizer"])
        optimizer = OptimizerConfig(**sections["optimizer"])
        ckpt = sections["checkpoint"]
        if ckpt and "directory" not in ckpt:
            raise ConfigError(
                fix(f"{', '.join(sorted(_flag(_FLAG_OF[('checkpoint', k)]) for k in ckpt))} "
                    f"need{'s' if len(ckpt) == 1 else ''} --checkpoint-dir DIR.",
                    "pass --checkpoint-dir (where checkpoints are written and resumed from).")
            )
        checkpoint = CheckpointConfig(**ckpt) if ckpt else None
        return RunConfig(train=train, optimizer=optimizer, checkpoint=checkpoint, **sections[None])
    except TypeError as e:  # a wrongly typed value in a TOML file
        raise ConfigError(fix(f"invalid option value: {e}.", "check the types in the config file.")) from None


def _check_strategy_flags(top: dict[str, Any]) -> None:
    """get_strategy's check that every option is taken, in the terms of the flags that set them."""
    name = top.get("strategy", RunConfig.strategy)
    if name not in ACCEPTS:
        return  # get_strategy names the known ones
    defaults = StrategyOptions()
    for key in (f.name for f in dataclasses.fields(StrategyOptions)):
        if key in top and top[key] != getattr(defaults, key) and key not in ACCEPTS[name]:
            users = " or ".join(f"--strategy {s}" for s, keys in ACCEPTS.items() if key in keys)
            given = _flag(key) if top[key] is True else f"{_flag(key)} {top[key]}"
            takes = ", ".join(_flag(k) for k in ACCEPTS[name]) or "none of the strategy options"
            raise ConfigError(fix(
                f"{given} is an option of {users}; --strategy {name} takes {takes}, so it would be ignored.",
                f"drop {_flag(key)} (or `{key.replace('_', '-')} = ...` in the --config file), or pass {users}."))


def _check_optimizer_flags(opt: dict[str, Any]) -> None:
    """OptimizerConfig's check that every option is used, in the terms of the flags that set them."""
    name = opt.get("name", OptimizerConfig.name)
    if name not in _OPTIMIZERS:
        return  # OptimizerConfig names the known ones
    for key in unused_optimizer_options(name, opt):
        users = " or ".join(f"--optimizer {u}" for u in OPTIMIZER_USES[key])
        raise ConfigError(fix(
            f"{_flag(key)} {opt[key]} is an option of {users}; --optimizer {name} does not use it, so it "
            "would be ignored.",
            f"drop {_flag(key)} (or `{key.replace('_', '-')} = ...` in the --config file), or pass {users}."))


LM_OPTIONS = ("d_model", "heads", "seq_len", "precision", "remat", "scan_unroll", "text_dir", "text_bytes")
TASK_FLAGS = ("layers", "depth", "embed", "scan", *LM_OPTIONS)  # the model options of the built-in tasks


def check_task_flags(task: str, given: Sequence[str], offered: Sequence[str] = TASK_FLAGS) -> None:
    """The task takes every model option ``given``, said in the terms of the flags (``get_task``
    says it in Python's): another task's option would be dropped without a word. ``offered``:
    the model options the command has flags for."""
    if task not in TASKS:
        return  # get_task names the known ones
    accepted = model_options(task)
    wrong = [k for k in offered if k in given and k not in accepted]
    if wrong:
        flags = ", ".join(_flag(k) for k in wrong)
        takes = ", ".join(_flag(k) for k in offered if k in accepted) or "none of the model options"
        raise ConfigError(fix(f"task {task!r} does not take option(s) {wrong} ({flags}).",
                              f"drop them; --task {task} takes {takes}."))
_FLAG_OF = {where: key for key, where in _KEYS.items()}


def task_options(run: RunConfig) -> dict[str, Any]:
    """The options of ``run`` that belong to the task (given ones only)."""
    given = {"layers": run.layers, "depth": run.depth, "embed": run.embed, "scan": run.scan}
    given.update({k: getattr(run, k) for k in LM_OPTIONS})
    return {k: v for k, v in given.items() if v is not None}


def strategy_options(run: RunConfig) -> dict[str, Any]:
    """The options of ``run`` that belong to the strategy."""
    return {
        "members": run.members,
        "bagging": run.bagging,
        "mesh": run.mesh,
        "rules": run.rules,
        "replicate_unknown": run.replicate_unknown,
    }
