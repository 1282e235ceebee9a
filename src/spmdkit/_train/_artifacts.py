"""What a run leaves behind: metrics.jsonl, summary.json, params.npz, plots."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit._atomic import replace_text, replace_whole
from spmdkit._checkpoint import is_prng_key, keys_as_data
from spmdkit._console import finite_or_null
from spmdkit._errors import NPZ_DAMAGE, ConfigError, DataError, SpmdkitError, fix, open_npz
from spmdkit._lockfile import OUT_LOCK, OUT_RUN_FILE, DirLock, refusal
from spmdkit._train._hooks import ROW_FIELDS


class ArtifactError(SpmdkitError, OSError):
    """An output (``--out``) cannot be written: a file in the way, read-only, or full."""

    exit_code = 5


def _cannot_write(path: Path, e: OSError) -> SpmdkitError:
    cause = e.strerror or str(e)
    if e.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):  # a wrong path: bad input, exit code 2
        return ConfigError(fix(f"cannot write {path}: {cause} (a file stands where a directory is needed).",
                               "pass an --out directory whose parents are directories."))
    return ArtifactError(fix(f"cannot write {path}: {cause} (errno {e.errno}).",
                             "pass an --out directory that is writable and has free space."))


def prepare_out_dir(out: Path) -> None:
    """Create the output directory, or say why it cannot be one (before any training)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(fix(f"--out {out} is a file, not a directory.", "pass a directory path to --out."))
    probe = out / f".spmdkit-write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")  # a byte, not an empty file: a full disk shows here, before training
    except OSError as e:
        raise _cannot_write(out, e) from None
    finally:
        try:  # also when the write failed: an empty probe was left in the user's --out
            probe.unlink()
        except OSError:
            pass




def lock_out_dir(out: Path, log: Callable[[str], None]) -> DirLock:
    """Keep a second run from writing the same ``--out`` at once (each would truncate the other's
    metrics.jsonl and overwrite its summary, plots and parameters)."""
    lock = DirLock(out / OUT_LOCK, log, "out")
    try:
        lock.take(uuid.uuid4().hex[:12], lambda other: ConfigError(refusal(
            other, lock.path, f"to --out {out}",
            "two runs would overwrite each other's metrics.jsonl, summary.json, plots and params.npz",
            "another --out (fit(out_dir=...) from Python)")))
    except IsADirectoryError:
        raise ConfigError(fix(f"{out / OUT_LOCK} is a directory, where spmdkit keeps the lock file of --out {out}.",
                              f"remove or rename {out / OUT_LOCK}, or pass another --out.")) from None
    except OSError as e:
        raise _cannot_write(out / OUT_LOCK, e) from None
    return lock


# Which run --out's files are of: a run's id, kept in its checkpoints too, so that a resume
# continues its own metrics.jsonl and summary, not those of another run written to the same --out
# (the default runs/latest holds whichever ran last).
# Named and marked as spmdkit's (a run.json of the user's, an experiment tracker's, is not taken
# for one, nor overwritten); not the checkpoint directory's spmdkit-run.json, so one directory can
# be both.
RUN_FILE = OUT_RUN_FILE
_MARK = "spmdkit_out"
# A run's files besides metrics.jsonl (which a fresh run truncates): an earlier run's, left beside
# a new run's rows, read as the new run's until it wrote its own.
RUN_OUTPUTS = ("summary.json", "params.npz", "loss.png", "ensemble.png")


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def _recorded(out: Path) -> dict[str, Any] | None:
    """``out``'s marked id file, or None (none, by an earlier spmdkit, or not spmdkit's)."""
    try:
        recorded = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict) or recorded.get(_MARK) != 1 or not isinstance(recorded.get("run_id"), str):
        return None
    return recorded


def out_summary_id(out: Path) -> str | None:
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary.get("run_id") if isinstance(summary, dict) and isinstance(summary.get("run_id"), str) else None


def out_run_id(out: Path) -> str | None:
    """The run id ``out``'s files were written by: its id file's, else its summary.json's (the id
    file deleted by hand); None if neither records one (empty, or by an earlier spmdkit)."""
    recorded = _recorded(out)
    return recorded["run_id"] if recorded is not None else out_summary_id(out)


def other_run(out: Path, ids: tuple[str, ...], checkpoint_dir: Path) -> str | None:
    """Why a run resumed from checkpoints of run ``ids`` (its restored step's, its directory's now)
    cannot continue ``out``'s files, or None. An ``out`` of an earlier spmdkit (no run id recorded)
    cannot tell, and is continued."""
    theirs = out_run_id(out)
    if theirs is None or theirs in ids:
        return None
    return fix(f"--out {out} holds the files of another run (run id {theirs}), not of the run whose checkpoint in "
               f"{checkpoint_dir} is resumed (run id {ids[0]}): that run's metrics.jsonl and summary.json would be "
               "taken for this one's.",
               "resume with the --out that run wrote to (fit(out_dir=...) from Python), or a new, empty one; to "
               "start over instead, drop --resume (CheckpointConfig(resume=False)).")


def _write_record(out: Path, run_id: str, files: list[str]) -> None:
    try:
        replace_text(out / RUN_FILE, json.dumps({_MARK: 1, "run_id": run_id, "files": sorted(files),
                                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
    except OSError as e:
        raise _cannot_write(out / RUN_FILE, e) from None


def claim_out_dir(out: Path, run_id: str, fresh: bool, log: Callable[[str], None]) -> None:
    """Make ``out`` this run's: record its id and, for a fresh run, remove the summary, parameters
    and plots the earlier run recorded as written (a run killed before writing its own left them to
    be read as its); files it did not record, a user's own, stay. The id first: a disk that refuses
    it leaves the earlier run's files whole."""
    if (out / RUN_FILE).is_dir() or ((out / RUN_FILE).exists() and _recorded(out) is None):
        raise ConfigError(fix(f"{out / RUN_FILE} is not a file spmdkit wrote, where it records whose run --out {out} "
                              "holds.", f"move {RUN_FILE} out of {out}, or pass another --out."))
    earlier = _recorded(out)
    listed = [n for n in (earlier or {}).get("files", []) if n in RUN_OUTPUTS]
    if earlier is not None and out_summary_id(out) == earlier["run_id"]:
        listed = sorted(set(listed) | {"summary.json"})  # its id file's last update was refused: still its own
    if earlier is None and not fresh and out_run_id(out) is not None:
        # The id file deleted by hand, the run matched by its summary: its outputs there are its own.
        listed = [n for n in RUN_OUTPUTS if (out / n).is_file()]
    ours = listed if fresh else []
    # A fresh run's record lists what it is about to remove: a removal refused or cut short is retried.
    _write_record(out, run_id, listed)
    gone = []
    for name in ours:
        try:
            (out / name).unlink()
            gone.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _cannot_write(out / name, e) from None
    if gone:
        log(f"{out}: removed an earlier run's {', '.join(gone)} (a new run starts here; "
            "its files are written as it goes and at its end)")


def record_written(out: Path, run_id: str, names: list[str]) -> None:
    """Add ``names`` to the files ``out``'s id file says this run wrote (what a fresh run after it removes)."""
    recorded = _recorded(out) or {}
    _write_record(out, run_id, sorted(set(recorded.get("files", [])) | set(names)))


class MetricsWriter:
    """Append-only JSON lines, each written whole or not at all.

    ``kept`` (a resumed run's rows up to its checkpoint) replaces the file whole, atomically,
    before anything is appended: truncating it and writing them back one by one lost every row
    not yet written back when the process was killed there, and the next resume found only those.
    A row the file takes in part (a full disk, ``ulimit -f``) is cut back off before the error is
    raised: the file ends in whole lines, which a resume and any JSON-lines reader take.
    """

    def __init__(self, path: Path | None, kept: list[dict[str, Any]] | None = None):
        self.path = path
        try:
            if path is not None and kept:
                replace_text(path, "".join(_metrics_line(r) for r in kept))
            # Unbuffered: a row is on disk once write returns, and a failed one leaves nothing buffered
            # for close to write after the cut.
            self._fh = None if path is None else open(path, "ab" if kept else "wb", buffering=0)
        except OSError as e:
            raise _cannot_write(path, e) from None

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        line = _metrics_line(record).encode()
        start = None
        try:
            start = self._fh.seek(0, os.SEEK_END)
            done = 0
            while done < len(line):  # a short write (near a file size limit) is finished, or fails
                done += self._fh.write(line[done:]) or 0
        except OSError as e:
            fh, self._fh = self._fh, None
            try:
                if start is not None:
                    os.ftruncate(fh.fileno(), start)
                fh.close()
            except OSError:
                pass  # a read-only disk took nothing to cut back
            raise _cannot_write(self.path, e) from None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def _metrics_line(record: dict[str, Any]) -> str:
    return json.dumps(finite_or_null(record), allow_nan=False) + "\n"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a summary."""
    path = Path(path)
    text = json.dumps(finite_or_null(data), indent=2, default=_jsonable, allow_nan=False) + "\n"
    try:
        replace_text(path, text)
    except OSError as e:
        raise _cannot_write(path, e) from None


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.generic, np.ndarray, jax.Array)):
        return finite_or_null(np.asarray(x).tolist())
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def flat_params(params: Any) -> dict[str, np.ndarray]:
    """``{"['Dense_0']['kernel']": array, ...}``: one array per leaf, keyed by path."""
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }


# NumPy's .npz keeps bfloat16 and float8 leaves as raw bytes ('|V2'): such leaves are
# stored as unsigned ints of their width, their dtype names under this key.
_DTYPES_KEY = "__spmdkit_dtypes__"


def _npz_arrays(params: Any) -> dict[str, np.ndarray]:
    named = {f"{jax.tree_util.keystr(p)}": f"key:{jax.random.key_impl(x)}"
             for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if is_prng_key(x)}
    arrays = flat_params(keys_as_data(params))  # a typed PRNG key (NNX's Rngs) as its uint32 data
    for key, arr in arrays.items():
        if arr.dtype.type.__module__.startswith("ml_dtypes"):
            named[key] = arr.dtype.name
            arrays[key] = arr.view(f"u{arr.dtype.itemsize}")
    if named:
        arrays[_DTYPES_KEY] = np.array(json.dumps(named))
    return arrays


def _from_npz(arrays: dict[str, np.ndarray], path: Any) -> dict[str, np.ndarray]:
    named = json.loads(str(arrays.pop(_DTYPES_KEY))) if _DTYPES_KEY in arrays else {}
    for key, name in named.items():
        if name.startswith("key:"):
            arrays[key] = jax.random.wrap_key_data(arrays[key], impl=name[4:])
        else:
            arrays[key] = arrays[key].view(jnp.dtype(name))
    raw = [k for k, a in arrays.items() if a.dtype.type is np.void]
    if raw:
        raise DataError(fix(f"{path}: {raw[0]} holds raw bytes ({arrays[raw[0]].dtype}), not numbers: a bfloat16 or "
                            "float8 leaf saved without its dtype (by np.savez, or an earlier spmdkit).",
                            "save it again with spmdkit.save_params, or view it: arr.view(jnp.bfloat16)."))
    return arrays


def save_params(path: str | os.PathLike, params: Any) -> None:
    """Save parameters as ``.npz``, one array per leaf keyed by its pytree path (atomically).
    bfloat16 and float8 leaves keep their dtype through :func:`load_params`."""
    path = Path(path)
    arrays = _npz_arrays(params)
    try:
        # np.savez appends ".npz" to a name without it: a path of another suffix is written through a handle
        replace_whole(path, lambda tmp: _savez(tmp, arrays))
    except OSError as e:
        raise _cannot_write(path, e) from None


def _savez(path: str, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def load_params(path: str | os.PathLike, like: Any = None) -> Any:
    """Read a ``params.npz`` written by spmdkit (no pickle is ever loaded).

    Without ``like`` returns ``{path: array}``; with ``like`` (a pytree of the same
    structure, e.g. the model's init) returns that structure filled from the file; an array
    of the file that ``like`` has no place for is a :class:`DataError`, not dropped.

    Example:
        >>> import numpy as np, tempfile, pathlib, spmdkit
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "params.npz"
        >>> spmdkit.save_params(p, {"w": np.ones(2)})
        >>> spmdkit.load_params(p, like={"w": np.zeros(2)})["w"].tolist()
        [1.0, 1.0]
    """
    try:
        with open_npz(path) as f:
            arrays = {k: f[k] for k in f.files}
    except OSError as e:
        raise DataError(fix(f"{path} cannot be read: {e.strerror or e}.", "check the path.")) from None
    except NPZ_DAMAGE as e:
        raise DataError(fix(f"{path} is damaged (truncated or corrupt: {e}).",
                            "load an intact copy of the params.npz that spmdkit.save_params wrote.")) from None
    except ValueError as e:
        what = ("holds object arrays (spmdkit never unpickles)" if "Object arrays" in str(e)
                else f"is not a params file ({e})")
        raise DataError(fix(f"{path} {what}.", "load a params.npz that spmdkit.save_params wrote.")) from None
    arrays = _from_npz(arrays, path)
    if like is None:
        return arrays
    leaves = jax.tree_util.tree_flatten_with_path(like)
    out = []
    for p, leaf in leaves[0]:
        key = jax.tree_util.keystr(p)
        if key not in arrays:
            raise DataError(
                fix(
                    f"{path} has no array for parameter {key} (it holds {sorted(arrays)[:6]}...).",
                    "load it into the structure it was saved from.",
                )
            )
        if arrays[key].shape != np.shape(leaf):
            raise DataError(
                fix(
                    f"{path}: parameter {key} has shape {arrays[key].shape} in the file but "
                    f"{np.shape(leaf)} in the model.",
                    "load it into the model it was trained with.",
                )
            )
        _check_dtype(path, key, arrays[key], leaf)
        out.append(arrays[key])
    _check_all_used(path, arrays, {jax.tree_util.keystr(p) for p, _ in leaves[0]})
    return jax.tree_util.tree_unflatten(leaves[1], out)


def _check_all_used(path: Any, arrays: dict[str, Any], used: set[str]) -> None:
    """Every array of the file has a place in ``like``: a model built without a layer the file
    holds (another depth, a renamed module) loaded the rest and dropped that layer, silently."""
    unused = sorted(set(arrays) - used)
    if unused:
        raise DataError(fix(
            f"{path} holds {len(unused)} array(s) that `like` has no place for: {unused[:6]}"
            f"{'...' if len(unused) > 6 else ''} (like has {len(used)}, the file {len(arrays)}).",
            "load it into the whole structure it was saved from (a stateful task's file holds "
            "{'params': ..., 'model_state': ...}), or take the arrays you want from load_params(path), "
            "which returns every array by its path."))


def _check_dtype(path: Any, key: str, arr: Any, leaf: Any) -> None:
    # A silent cast would hand a bf16 model f32 weights (or the reverse) that it never trained with;
    # a plain Python number in `like` carries no dtype to compare.
    want = getattr(leaf, "dtype", None)
    if want is None or arr.dtype == want:
        return
    raise DataError(
        fix(
            f"{path}: parameter {key} is {arr.dtype} in the file but {want} in `like`.",
            f"pass a `like` of the dtypes the file was saved with, then cast on purpose, e.g. "
            f"params = jax.tree.map(lambda x: x.astype(jnp.{want}), params).",
        )
    )


def params_digest(params: Any) -> str:
    """A short hash of every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for key, arr in flat_params(params).items():
        h.update(f"{key}|{arr.dtype}|{arr.shape}|".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


def param_count(params: Any) -> int:
    return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params)))


def plot_history(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Loss (train and eval) per step, and every other metric in a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in history if r["split"] == "train"]
    evals = [r for r in history if r["split"] == "eval"]
    # Scalar metrics only: per-member lists have their own plot (ensemble.png).
    extra = sorted(
        {k for r in history for k, v in r.items() if k not in _NOT_METRICS and k != "loss" and not isinstance(v, list)}
    )
    fig, axes = plt.subplots(1, 2 if extra else 1, figsize=(11 if extra else 6, 4), squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval loss")
    # None: a non-finite value read back from metrics.jsonl (a resumed run's history)
    losses = [r["loss"] for r in train + evals if r["loss"] is not None and math.isfinite(r["loss"])]
    if losses and min(losses) > 0 and max(losses) / min(losses) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if extra:
        ax = axes[0, 1]
        for name in extra:
            for split, rows, style in (("train", train, "-"), ("eval", evals, "o-")):
                pts = [(r["step"], r[name]) for r in rows if name in r]
                if pts:
                    ax.plot(*zip(*pts), style, label=_label(f"{split} {name}"))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    _save_figure(fig, path)


def _label(text: str, most: int = 40) -> str:
    """A legend entry of at most ``most`` characters, its start and end kept: a metric named in
    300 characters made a legend wider than the figure, over the loss panel.

    >>> _label("train " + "x" * 100)
    'train xxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxx'
    """
    return text if len(text) <= most else f"{text[:most // 2 - 1]}...{text[-(most // 2 - 2):]}"


def _save_figure(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` and free it; an unwritable path is an ArtifactError."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise _cannot_write(path, e) from None
    finally:
        plt.close(fig)


def plot_members(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Each member's eval accuracy and the ensemble's, per eval (one per epoch by default)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in history if r["split"] == "eval" and "member_accuracy" in r]
    if not evals:
        # Train rows carry member_accuracy too: a task without eval data, or a run preempted before its
        # first eval, has nothing to draw here (an IndexError, exit 1, after the run had finished).
        return
    steps = [r["step"] for r in evals]
    members = np.array([r["member_accuracy"] for r in evals], dtype=float)  # null (non-finite) as NaN
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in range(members.shape[1]):
        ax.plot(steps, members[:, m], color="0.6", lw=1, label="members" if m == 0 else None)
    ax.plot(steps, members.mean(1), "k--", label="mean member")
    if "ensemble_accuracy" in evals[0]:
        ax.plot(steps, [r["ensemble_accuracy"] for r in evals], "o-", color="C3", lw=2, label="ensemble")
    ax.set_xlabel("step")
    ax.set_ylabel("eval accuracy")
    ax.set_title(f"{title}: {members.shape[1]} members")
    ax.grid(alpha=0.3)
    ax.legend()
    _save_figure(fig, path)


# A row's own fields. (A stale "count" here left a user's metric of that name out of loss.png.)
_NOT_METRICS = set(ROW_FIELDS)
