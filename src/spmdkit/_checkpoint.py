"""Checkpoints on Orbax: asynchronous saves, verified restores onto any layout.

Each step directory is Orbax's (``PyTreeSave`` of the train state, ``JsonSave`` of
the run's position and config); nothing is pickled. Beside them spmdkit keeps a
manifest per step (``manifests/<step>.json``: every file and its size, written once
Orbax has committed the step), so a truncated or missing file is found, and named,
before a restore is tried. Restores always take an explicit target (the abstract
state with the *current* strategy's shardings), which is what lets a checkpoint
written on 8 devices resume on 4, 2 or 1, or from a data-parallel layout into a
sharded one.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from spmdkit._errors import SpmdkitError, fix

_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(SpmdkitError, RuntimeError):
    """A checkpoint is damaged, missing, or does not fit the model being trained."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint, how many to keep, and whether to resume."""

    directory: str
    every: int = 100
    keep: int = 3
    resume: bool = False
    # Measured (BENCHMARKS.md): zstd compression saves ~8% on float weights and costs most of
    # the save time on 2 cores; OCDBT packs files for multi-host scale at a further cost here.
    compress: bool = False
    ocdbt: bool = False

    def __post_init__(self) -> None:
        for name in ("every", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(fix(f"checkpoint {name}={value!r} must be a whole number >= 1.", f"e.g. {name}=10."))


def leaf_table(state: Any) -> dict[str, list]:
    """``{path: [shape, dtype]}`` of every leaf: what a restore target must match."""
    return {
        jax.tree_util.keystr(path): [list(np.shape(leaf)), str(np.dtype(leaf.dtype))]
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }


def _files(step_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(step_dir)): p.stat().st_size for p in sorted(step_dir.rglob("*")) if p.is_file()}


class Checkpointer:
    """Save and restore train states in ``directory`` (one per process group).

    Example:
        >>> import tempfile, jax.numpy as jnp, spmdkit
        >>> ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(tempfile.mkdtemp(), every=1))
        >>> ckpt.save(1, {"w": jnp.ones(3)}, {"step": 1})
        >>> ckpt.close()
        >>> ckpt.steps()
        [1]
    """

    def __init__(self, config: CheckpointConfig, log: Callable[[str], None] = print):
        self.config = config
        self.directory = Path(config.directory).absolute()
        self.log = log
        self.directory.mkdir(parents=True, exist_ok=True)
        leftovers = sorted(p.name for p in self.directory.iterdir() if _TMP_MARK in p.name)
        for name in leftovers:
            # An interrupted save (a crash, a kill): never a checkpoint, safe to remove.
            shutil.rmtree(self.directory / name, ignore_errors=True)
            log(f"checkpoints: removed {name}, left by an interrupted save")
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.keep, enable_async_checkpointing=True, cleanup_tmp_directories=True, create=True
            ),
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(use_compression=config.compress, use_ocdbt=config.ocdbt),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        self.blocked: list[float] = []  # seconds the caller waited per save
        self._pending: int | None = None

    # ---- saving ----------------------------------------------------------------
    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an asynchronous save; returns once the arrays are copied off the devices."""
        t0 = time.perf_counter()
        self._finish_pending()
        meta = {**meta, "step": step, "leaves": leaf_table(state)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)))
        self._pending = step
        self.blocked.append(time.perf_counter() - t0)

    def _finish_pending(self) -> None:
        self.manager.wait_until_finished()
        if self._pending is not None and jax.process_index() == 0:
            manifests = self.directory / "manifests"
            manifests.mkdir(exist_ok=True)
            step_dir = self.directory / str(self._pending)
            if step_dir.is_dir():
                (manifests / f"{self._pending}.json").write_text(json.dumps(_files(step_dir)))
            kept = {str(s) for s in self.manager.all_steps()}
            for old in manifests.glob("*.json"):
                if old.stem not in kept:
                    old.unlink()
        self._pending = None

    def close(self) -> None:
        """Wait for the last save to finish (call before the process exits)."""
        self._finish_pending()
        self.manager.close()

    # ---- reading ---------------------------------------------------------------
    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def problems(self, step: int) -> list[str]:
        """What is wrong with a step's files, from its manifest ([] if intact or unverifiable)."""
        manifest = self.directory / "manifests" / f"{step}.json"
        if not manifest.exists():
            return []
        expected = json.loads(manifest.read_text())
        have = _files(self.directory / str(step))
        out = []
        for name, size in expected.items():
            if name not in have:
                out.append(f"file {step}/{name} is missing")
            elif have[name] != size:
                out.append(f"file {step}/{name} has {have[name]} bytes, expected {size} (truncated or overwritten)")
        return out

    def meta(self, step: int) -> dict[str, Any]:
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(fix(f"checkpoint step {step}: {path} cannot be read ({e}).",
                                      "the step is damaged; resume from another step.")) from None

    def check_target(self, step: int, target: Any, members: int | None = None) -> None:
        """The saved leaves have the target's paths and shapes; the first difference is named."""
        saved = self.meta(step).get("leaves", {})
        want = leaf_table(target)
        for path, (shape, dtype) in want.items():
            if path not in saved:
                what = "optimizer" if path.startswith(".opt_state") else "model (task and options)"
                raise CheckpointError(
                    fix(f"checkpoint step {step} has no leaf state{path} (the run being resumed has it).",
                        f"resume with the {what} the checkpoint was written with.")
                )
            if list(saved[path][0]) != list(shape):
                hint = ""
                if members is not None and saved[path][0] and shape and saved[path][0][0] != shape[0]:
                    hint = (f" The leading axis is the ensemble's member count: the checkpoint has "
                            f"{saved[path][0][0]} members, this run {shape[0]}; use --members {saved[path][0][0]}.")
                raise CheckpointError(
                    fix(f"checkpoint step {step}: leaf state{path} has shape {tuple(saved[path][0])} in the "
                        f"checkpoint but {tuple(shape)} in the model being trained.{hint}",
                        "resume with the same model size and member count, or start a new run.")
                )
        extra = sorted(set(saved) - set(want))
        if extra:
            what = "optimizer" if extra[0].startswith(".opt_state") else "model (task and options)"
            raise CheckpointError(
                fix(f"checkpoint step {step} has leaves the run being resumed lacks, e.g. state{extra[0]}.",
                    f"resume with the {what} the checkpoint was written with.")
            )

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` onto ``target`` (a pytree of ShapeDtypeStruct with shardings)."""
        problems = self.problems(step)
        if problems:
            raise CheckpointError(fix(f"checkpoint step {step} is damaged: {'; '.join(problems)}.",
                                      "resume from an earlier step (spmdkit does so with --resume)."))
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
                    ),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # Orbax / TensorStore raise many kinds on damaged data
            raise CheckpointError(
                fix(f"checkpoint step {step} could not be read: {type(e).__name__}: {str(e)[:300]}",
                    "resume from an earlier step (spmdkit does so with --resume).")
            ) from None
        return restored["state"], restored["meta"]

    def restore_latest(self, target: Any, members: int | None = None) -> tuple[Any, dict[str, Any]] | None:
        """The newest intact step restored onto ``target``, falling back past damaged ones."""
        steps = self.steps()
        for step in reversed(steps):
            problems = self.problems(step)
            if problems:
                self.log(f"checkpoints: step {step} is damaged ({problems[0]}); falling back to an earlier step")
                continue
            self.check_target(step, target, members)
            try:
                return self.restore(step, target)
            except CheckpointError as e:
                self.log(f"checkpoints: {str(e).splitlines()[0]}; falling back to an earlier step")
        if steps:
            raise CheckpointError(
                fix(f"no intact checkpoint in {self.directory}: steps {steps} are all damaged.",
                    "start a new run without --resume (or point --checkpoint-dir elsewhere).")
            )
        return None


def describe_directory(directory: str | Path) -> list[dict[str, Any]]:
    """Rows for ``spmdkit checkpoints DIR``: every step, complete or not, with its config."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(fix(f"{root} is not a directory.", "pass the --checkpoint-dir of a run."))
    rows = []
    for entry in sorted(root.iterdir(), key=lambda p: (len(p.name), p.name)):
        if not entry.is_dir() or entry.name == "manifests":
            continue
        step_text = entry.name.split(".")[0]
        if not step_text.isdigit():
            continue
        files = _files(entry)
        row: dict[str, Any] = {"step": int(step_text), "bytes": sum(files.values()), "files": len(files)}
        if _TMP_MARK in entry.name or "commit_success.txt" not in files and "_CHECKPOINT_METADATA" not in files:
            row["status"] = "incomplete (an interrupted save; removed on the next start)"
        else:
            manifest = root / "manifests" / f"{step_text}.json"
            problems = []
            if manifest.exists():
                expected = json.loads(manifest.read_text())
                problems = [n for n, size in expected.items() if files.get(n) != size]
            row["status"] = (f"damaged ({len(problems)} file(s), e.g. {problems[0]})" if problems
                             else "complete, verified" if manifest.exists() else "complete")
            try:
                meta = json.loads((entry / "meta" / "metadata").read_text())
                row["task"] = meta.get("task")
                row["strategy"] = (meta.get("strategy") or {}).get("strategy")
                row["mesh"] = (meta.get("strategy") or {}).get("mesh")
                row["config"] = meta.get("config")
                row["written"] = meta.get("written")
            except (OSError, ValueError):
                row["status"] += ", meta unreadable"
        rows.append(row)
    return rows
