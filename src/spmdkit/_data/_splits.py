"""A data set directory with a held-out split: ``DIR/train`` and ``DIR/eval``.

Each split is a data set of its own (:mod:`spmdkit._data._format`); ``spmdkit train
--data DIR`` trains on ``DIR/train`` and evaluates on ``DIR/eval``, which must hold the
same leaves with the same per-example shapes. A directory that is itself a data set
(``DIR/manifest.json``) is a training set alone: the task's own eval set, or
``--eval-data DIR2``, is evaluated on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from spmdkit._data._errors import DatasetFileError, DatasetLayoutError
from spmdkit._data._format import MANIFEST, create_dir, read_manifest, unreadable, write_dataset
from spmdkit._errors import DataError, fix

TRAIN, EVAL = "train", "eval"


def is_split_dir(path: Any) -> bool:
    """True for a directory of splits (``DIR/train/manifest.json``)."""
    try:
        return isinstance(path, (str, os.PathLike)) and (Path(path) / TRAIN / MANIFEST).exists()
    except PermissionError as e:  # a bare traceback from `spmdkit data check` and `train --data`
        raise unreadable(Path(path), e) from None


def write_splits(directory: str | os.PathLike, train: Any, eval_data: Any, *, overwrite: bool = False) -> Path:
    """Write ``DIR/train`` and ``DIR/eval`` (dicts of arrays, the same leaves) as one data set
    directory with a held-out split, which ``spmdkit train --data DIR`` trains and evaluates on.

    The training split's manifest is written last: a directory whose write was cut
    short is never taken for a complete one.

    Example:
        >>> import numpy as np, tempfile
        >>> d = write_splits(tempfile.mkdtemp() + "/ds", {"x": np.ones((6, 2))}, {"x": np.zeros((2, 2))})
        >>> sorted(p.name for p in d.iterdir())
        ['eval', 'train']
    """
    directory = Path(directory)
    check_splits_match(train, eval_data, "the training arrays", "the eval arrays",
                       "write arrays of the same leaves and per-example shapes to both splits.")
    create_dir(directory)
    if (directory / MANIFEST).exists():
        raise DataError(fix(f"{directory} holds a single data set ({directory / MANIFEST}); a directory with a "
                            "held-out split keeps each split in its own subdirectory.",
                            "choose a new directory, or remove the old data set first."))
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise DataError(fix(f"{directory} exists and is not empty.",
                            "choose a new directory, or pass overwrite=True (--overwrite) to replace it."))
    (directory / TRAIN / MANIFEST).unlink(missing_ok=True)  # incomplete until the training split lands again
    write_dataset(directory / EVAL, eval_data, overwrite=overwrite)
    write_dataset(directory / TRAIN, train, overwrite=overwrite)
    return directory


def data_splits(data: str | os.PathLike, eval_data: str | os.PathLike | None = None, task: str = "NAME"
                ) -> tuple[Path, Path | None]:
    """``(training split, eval split)`` of ``--data DIR`` (and ``--eval-data DIR2``); the eval
    split is None when DIR is a single data set and no ``--eval-data`` is given."""
    try:
        return _data_splits(Path(data), eval_data, task)
    except PermissionError as e:
        raise unreadable(Path(data), e) from None


def _data_splits(d: Path, eval_data: str | os.PathLike | None, task: str) -> tuple[Path, Path | None]:
    flat, split = (d / MANIFEST).exists(), is_split_dir(d)
    if flat and split:
        raise DatasetLayoutError(fix(f"--data {d} holds both a data set ({d / MANIFEST}) and a training split "
                                     f"({d / TRAIN}): which one to train on is ambiguous.",
                                     f"remove one: keep {d / TRAIN} and {d / EVAL} (spmdkit data write DIR --task "
                                     "NAME), or the single data set."))
    if not flat and not split:
        what = "does not exist" if not d.exists() else f"holds neither {MANIFEST} nor {TRAIN}/{MANIFEST}"
        if (d / TRAIN).is_dir():  # the training split's manifest is written last: its write was interrupted
            what += f" ({d / TRAIN} exists without its {MANIFEST}: its write was interrupted, or it was removed)"
        raise DatasetFileError(fix(f"--data {d} {what}: it is not a data set directory.",
                                   f"write one: spmdkit data write {d} --task {task} (writes {d / TRAIN} and "
                                   f"{d / EVAL}), or spmdkit.write_dataset(dir, arrays)."))
    train = d / TRAIN if split else d
    if eval_data is not None:
        return train, eval_split(eval_data)
    if not split:
        if (d / EVAL).is_dir():  # a held-out set the user put there would otherwise be ignored without a word
            raise DatasetLayoutError(fix(
                f"--data {d} is a single data set ({d / MANIFEST}) with a folder {d / EVAL} inside it: a single "
                "data set has no eval split, so that folder would not be evaluated on.",
                f"evaluate on it with --eval-data {d / EVAL}; or keep the splits side by side ({d}/{TRAIN} and "
                f"{d}/{EVAL}: spmdkit data write DIR --task {task}); or move {d / EVAL} out of the data set."))
        return train, None
    if not (d / EVAL / MANIFEST).exists():
        raise DatasetFileError(fix(f"--data {d} has a training split but no eval split: {d / EVAL / MANIFEST} is "
                                   "missing (never written, or its write was interrupted).",
                                   f"write both splits again: spmdkit data write {d} --task {task} --overwrite; or "
                                   f"pass --eval-data DIR2; or train on {d / TRAIN} alone (--data {d / TRAIN}, "
                                   "evaluated on the task's own eval set)."))
    read_manifest(d / EVAL)  # a damaged manifest named now, before anything is built
    return train, d / EVAL


def eval_split(eval_data: str | os.PathLike) -> Path:
    """The eval set ``--eval-data DIR2`` names: a data set, or the eval split of a directory of splits."""
    held_out = Path(eval_data)
    if is_split_dir(held_out) and (held_out / EVAL / MANIFEST).exists():
        held_out = held_out / EVAL
    if not (held_out / MANIFEST).exists():
        raise DatasetFileError(fix(f"--eval-data {held_out}: {held_out / MANIFEST} is missing; it is not a data "
                                   "set (or its write was interrupted).",
                                   f"write it: spmdkit data write {held_out} --task NAME --split eval, or point "
                                   "--eval-data at a data set directory."))
    read_manifest(held_out)
    return held_out


def _examples(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {jax.tree_util.keystr(p): (tuple(np.shape(x)[1:]), np.dtype(x.dtype))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_splits_match(train: Any, eval_data: Any, train_name: str, eval_name: str, remedy: str) -> None:
    """The eval set holds the training set's leaves with the same per-example shapes and
    kinds of dtype (the model evaluates what it trains on); a DataError naming both, the
    leaf, the shapes and ``remedy`` otherwise."""
    want, got = _examples(train), _examples(eval_data)
    if set(want) != set(got):
        names = lambda leaves: ", ".join(sorted(leaves)) or "none"  # noqa: E731
        raise DatasetLayoutError(fix(
            f"{eval_name} has leaves {names(got)}; {train_name} has {names(want)} "
            f"(missing {names(set(want) - set(got))}, extra {names(set(got) - set(want))}).", remedy))
    for leaf, (shape, dtype) in want.items():
        other, other_dtype = got[leaf]
        if other != shape or other_dtype.kind != dtype.kind:
            raise DatasetLayoutError(fix(
                f"{eval_name}: leaf {leaf} holds examples of shape {other} dtype {other_dtype}; {train_name} holds "
                f"shape {shape} dtype {dtype}: the model cannot evaluate what it does not train on.", remedy))
