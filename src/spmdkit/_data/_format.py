"""The on-disk data set: one ``.npy`` file per leaf and a ``manifest.json``.

Layout of a data set directory::

    DIR/manifest.json      {"format": "spmdkit-dataset", "version": 1, "count": N,
                            "leaves": [{"key": ["image"], "file": "image.npy",
                                        "shape": [N, 8, 8, 1], "dtype": "float32",
                                        "bytes": ..., "crc32": "1a2b3c4d"}, ...]}
    DIR/image.npy          every leaf has the N examples on axis 0
    DIR/label.npy

The arrays are read lazily (``np.load(mmap_mode="r")``): only the rows a batch needs
are paged in, so a data set may be larger than memory, and in several processes each
reads only its own rows. The manifest is written last, so a directory without one is
an interrupted write, never a silently shorter data set.

A data set with a held-out split keeps each split in a subdirectory, each a data set
as above with the same leaves and per-example shapes (``spmdkit data write DIR --task
NAME`` writes it from a task's data; ``spmdkit.write_dataset`` twice from arrays)::

    DIR/train/manifest.json, DIR/train/*.npy    trained on:   spmdkit train --data DIR
    DIR/eval/manifest.json,  DIR/eval/*.npy     evaluated on (or --eval-data DIR2)

From Python: ``Task(train_data=DIR / "train", eval_data=DIR / "eval")``. A single data
set (``DIR/manifest.json``) given as ``--data DIR`` is trained on and the task's own
eval set (or ``--eval-data DIR2``) is evaluated on.
"""

from __future__ import annotations

import errno
import json
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from spmdkit._atomic import is_temporary, replace_text, replace_whole
from spmdkit._data._errors import DatasetCorruptError, DatasetFileError, DatasetLayoutError, DatasetWriteError
from spmdkit._crc import crc32, crc32_file
from spmdkit._errors import DataError, fix

FORMAT = "spmdkit-dataset"
VERSION = 1
MANIFEST = "manifest.json"
_NUMERIC = "biuf"


def _leaves(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``(key path, array)`` of a (nested) dict of arrays, in sorted key order."""
    if isinstance(tree, Mapping):
        out = []
        for k in sorted(tree):
            if not isinstance(k, str) or not k:
                raise DataError(fix(f"data set key {prefix + (k,)!r} is not a non-empty string.",
                                    "write a dict with string keys, e.g. {'image': x, 'label': y}."))
            out += _leaves(tree[k], prefix + (k,))
        return out
    if prefix and hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return [(prefix, tree)]
    raise DataError(fix(f"write_dataset takes a (nested) dict of arrays; {'/'.join(prefix) or 'the data'} is "
                        f"a {type(tree).__name__}.", "pass e.g. {'image': images, 'label': labels}."))


def _file_name(key: tuple[str, ...], used: set[str]) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", "__".join(key)) or "leaf"
    if len(stem) > 120:  # a file name holds 255 bytes: a long key failed as "File name too long", "free disk space"
        stem = f"{stem[:100]}_{crc32(json.dumps(list(key)).encode()):08x}"  # the manifest keeps the whole key
    name, i = f"{stem}.npy", 1
    taken = {u.lower() for u in used}  # "X.npy" and "x.npy" are one file on macOS's and Windows' disks
    while name.lower() in taken:
        name, i = f"{stem}_{i}.npy", i + 1
    used.add(name)
    return name


def write_dataset(directory: str | os.PathLike, arrays: Mapping[str, Any], *, overwrite: bool = False) -> Path:
    """Write ``arrays`` (a dict, possibly nested, of arrays sharing axis 0) as a data set
    directory that :func:`load_dataset` and ``spmdkit train --data DIR`` read lazily.

    Example:
        >>> import numpy as np, spmdkit, tempfile
        >>> d = spmdkit.write_dataset(tempfile.mkdtemp() + "/ds", {"x": np.ones((6, 2), np.float32),
        ...                                                       "y": np.arange(6)})
        >>> data = spmdkit.load_dataset(d)
        >>> sorted(data), data["x"].shape, int(data["y"][5])
        (['x', 'y'], (6, 2), 5)
    """
    directory = Path(directory)
    stale: set[str] = set()
    leaves = _leaves(arrays)
    if not leaves:  # an empty dict (an .npz without arrays) was "needs the same number of examples; got {}"
        raise DataError(fix(f"write_dataset: the data hold no arrays ({arrays!r:.60}).",
                            "pass e.g. {'image': images, 'label': labels} (spmdkit data write --npz: an .npz "
                            "written by numpy.savez(path, image=images, label=labels))."))
    counts = {"/".join(k): np.shape(x)[0] if np.ndim(x) else None for k, x in leaves}
    if None in counts.values() or len(set(counts.values())) != 1:
        raise DataError(fix(f"write_dataset: every array needs the same number of examples on axis 0; got {counts}.",
                            "pass arrays of equal length (scalars belong in the model, not the data)."))
    if 0 in counts.values():  # refused now, not by every later read
        raise DataError(fix(f"write_dataset: the arrays hold no examples ({counts}).", "pass at least one example."))
    for k, x in leaves:
        if np.dtype(x.dtype).kind not in _NUMERIC:
            extra = (" (.npy has no bfloat16: store float32, or a uint16 view with .view(np.uint16))"
                     if np.dtype(x.dtype).name == "bfloat16" else "")
            raise DataError(fix(f"write_dataset: {'/'.join(k)} has dtype {x.dtype}; a data set holds NumPy's numeric "
                                f"dtypes{extra}.", "encode it as numbers first (token ids, one-hot floats)."))
    create_dir(directory)
    try:
        if any(directory.iterdir()):
            if not overwrite:
                raise DataError(fix(f"{directory} exists and is not empty.",
                                    "choose a new directory, or pass overwrite=True (--overwrite) to replace it."))
            if (foreign := _not_a_data_set(directory)) is not None:
                raise DataError(fix(f"{directory} is not a data set ({foreign}); overwrite=True (--overwrite) "
                                    "replaces a data set, not a directory of other files.",
                                    "choose a new or empty directory for the data set."))
            stale = _old_files(directory)
            (directory / MANIFEST).unlink(missing_ok=True)  # it is incomplete until the new manifest lands
        written = _write_files(directory, leaves, next(iter(counts.values())))
        # The old data set's files that the new one does not use: they stayed, unlisted, and took
        # their disk space (open readers keep theirs until they close them).
        for name in stale - written:
            (directory / name).unlink(missing_ok=True)
    except OSError as e:
        raise _cannot_write(directory, e) from None
    return directory


def _old_files(directory: Path) -> set[str]:
    """The files of the data set in ``directory`` (one that ``_not_a_data_set`` accepted): those its
    manifest lists, or without one (an interrupted write) its ``.npy`` and temporary files."""
    try:
        return {str(e["file"]) for e in json.loads((directory / MANIFEST).read_text())["leaves"]
                if str(e["file"]) == Path(str(e["file"])).name}
    except (OSError, ValueError, KeyError, TypeError):
        return {p.name for p in directory.iterdir() if p.is_file() and _ours_unlisted(p.name)}


def _ours_unlisted(name: str) -> bool:
    """A file an interrupted write may have left: an array, or a temporary file (also the
    ``.tmp`` names of earlier spmdkit versions)."""
    return name.endswith((".npy", ".tmp")) or is_temporary(name)


def _not_a_data_set(directory: Path) -> str | None:
    """Why overwriting ``directory`` would destroy what is not a data set, or None: it holds an
    spmdkit manifest, or (an interrupted write) only ``.npy`` and temporary files. --overwrite
    replaced a user's own manifest.json and x.npy in a directory of other files, silently."""
    manifest = directory / MANIFEST
    if manifest.is_file():
        try:
            ours = json.loads(manifest.read_text()).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
        return None if ours else f"its {MANIFEST} is not an spmdkit data set manifest"
    others = sorted(p.name for p in directory.iterdir() if not _ours_unlisted(p.name))
    return f"it holds {others[:3]}{'...' if len(others) > 3 else ''}" if others else None


def create_dir(directory: Path) -> None:
    """``directory`` made with its parents, or a DataError saying why it cannot be (exit code 5
    for a place that cannot be written, 2 for a file in the way)."""
    try:
        if directory.exists() and not directory.is_dir():
            raise DataError(fix(f"{directory} is a file, not a directory.", "choose a directory path for the data set."))
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cannot_write(directory, e) from None


def _write_files(directory: Path, leaves: list, count: int) -> set[str]:
    used: set[str] = set()
    entries = []
    for key, x in leaves:
        name = _file_name(key, used)
        x = np.ascontiguousarray(np.asarray(x))
        _warn_non_finite(key, x)
        if not x.dtype.isnative:  # JAX refuses other byte orders; the same values in this machine's are lossless
            x = x.astype(x.dtype.newbyteorder("="))
        _save_replacing(directory / name, x)
        entries.append({"key": list(key), "file": name, "shape": list(np.shape(x)), "dtype": np.dtype(x.dtype).str,
                        "bytes": (directory / name).stat().st_size, "crc32": crc32_file(directory / name)})
    manifest = {"format": FORMAT, "version": VERSION, "count": count, "leaves": entries}
    replace_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    return used


def _warn_non_finite(key: tuple[str, ...], x: np.ndarray, rows_per_piece: int = 1 << 16) -> None:
    """A warning when a floating-point leaf holds NaN or inf: they were written without a word,
    and the run that read them stopped at its first step with a non-finite loss, far from the
    cause. Written anyway: a loss that masks them is the user's choice. Read in pieces of rows,
    so a large leaf needs no second array of its size."""
    if x.dtype.kind != "f" or x.size == 0:
        return
    nan = inf = 0
    first = None
    for start in range(0, x.shape[0], rows_per_piece):
        piece = x[start:start + rows_per_piece]
        bad = ~np.isfinite(piece)
        if bad.any():
            n = int(np.isnan(piece).sum())
            nan, inf = nan + n, inf + int(bad.sum()) - n
            if first is None:
                first = start + int(np.argmax(bad.reshape(piece.shape[0], -1).any(axis=1)))
    if first is not None:
        warnings.warn(f"write_dataset: {'/'.join(key)} holds {nan} NaN and {inf} inf (the first in row {first}); "
                      "they are written as they are, and a training run stops at the first step whose loss "
                      "they make non-finite. Replace or drop those rows first (e.g. numpy.nan_to_num), unless "
                      "the model's loss masks them.", RuntimeWarning, stacklevel=4)


def _save_replacing(path: Path, x: Any) -> None:
    """``x`` saved as ``path`` through a temporary file renamed over it. A reader (a training run)
    may hold the old file memory-mapped: saving in place truncated it under the map, and the
    reader silently read the new rows, then died with SIGBUS past the new end. A rename leaves
    the old file's data to its readers until they close it."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.save(f, x, allow_pickle=False)
    replace_whole(path, write)


def _cannot_write(directory: Path, e: OSError) -> DataError:
    # numpy's short write ("1280000 requested and 511968 written") carries no errno: the file
    # system took part of it, which a file size limit or a full disk does.
    cause = f"{e.strerror or e} (errno {e.errno})" if e.errno is not None else \
        f"{e}: a short write, as a file size limit (ulimit -f) or a full disk gives"
    if e.errno in (errno.ENOTDIR, errno.EEXIST):  # a file where a directory belongs: bad input, exit code 2
        return DataError(fix(f"cannot write the data set {directory}: {cause}; a file stands where a directory "
                             "is needed.", "choose a path whose parents are directories."))
    if e.errno == errno.ENAMETOOLONG:  # bad input (exit code 2), not a disk to free
        return DataError(fix(f"cannot write the data set {directory}: {cause}; a name in the path is longer than "
                             "the file system allows (255 bytes a name here).", "choose a shorter directory name."))
    return DatasetWriteError(fix(f"cannot write the data set {directory}: {cause}.",
                                 "choose a directory you can write to, on a disk with free space."))


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise DatasetFileError(fix(f"data set directory {directory} does not exist.",
                                   "point --data (load_dataset) at a directory written by spmdkit.write_dataset "
                                   "or `spmdkit data write`."))
    if not path.is_file() and (directory / "train" / MANIFEST).is_file():
        raise DatasetFileError(fix(f"{path} is missing: {directory} holds a training split ({directory / 'train'}) "
                                   "and perhaps an eval split, each a data set of its own.",
                                   f"pass {directory / 'train'} as train_data and {directory / 'eval'} as eval_data "
                                   f"(the command line takes --data {directory} as it is)."))
    if not path.is_file():
        raise DatasetFileError(fix(f"{path} is missing: {directory} is not a data set, or its write was "
                                   "interrupted (the manifest is written last).",
                                   "write it again with spmdkit.write_dataset(dir, arrays) or "
                                   f"`spmdkit data write {directory} --task NAME` "
                                   "(add --overwrite over an interrupted write)."))
    try:
        manifest = json.loads(path.read_text())
    except PermissionError:
        raise
    except (OSError, ValueError) as e:
        raise DatasetLayoutError(fix(f"{path} is not valid JSON ({e}).", "write the data set again.")) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetLayoutError(fix(f"{path} is not an spmdkit data set manifest (format "
                                     f"{manifest.get('format') if isinstance(manifest, dict) else None!r}).",
                                     "write the data set with spmdkit.write_dataset."))
    if manifest.get("version") != VERSION:
        raise DatasetLayoutError(fix(f"{path} has layout version {manifest.get('version')!r}; this spmdkit reads "
                                     f"version {VERSION}.", "write the data set again with this spmdkit."))
    try:
        count = int(manifest["count"])
        for e in manifest["leaves"]:
            _ = (list(e["key"]), str(e["file"]), list(e["shape"]), np.dtype(e["dtype"]), int(e["bytes"]), e["crc32"])
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetLayoutError(fix(f"{path} lacks or mangles a field ({type(e).__name__}: {e}).",
                                     "write the data set again.")) from None
    if not manifest["leaves"] or count <= 0:
        raise DatasetLayoutError(fix(f"{path} describes no examples.", "write a data set with at least one example."))
    if (problem := _entries_problem(manifest)) is not None:
        raise DatasetLayoutError(fix(f"{path}: {problem}", "write the data set again with spmdkit.write_dataset "
                                     "(a manifest is not meant to be edited by hand)."))
    return manifest


def _entries_problem(manifest: dict[str, Any]) -> str | None:
    """What in a parsed manifest would load wrong, or None. A hand-edited (or foreign) manifest
    with two leaves under one key lost one of them silently; a key "xy" was read as the path
    x/y, an empty or clashing key was a bare ValueError, a file named "../other/x.npy" read
    another data set's file."""
    if not isinstance(manifest["count"], int) or isinstance(manifest["count"], bool):
        return f"count {manifest['count']!r} is not a whole number."
    keys = []
    for e in manifest["leaves"]:
        key, name = e["key"], e["file"]
        if not isinstance(key, list) or not key or not all(isinstance(k, str) and k for k in key):
            return f"leaf key {key!r} is not a list of non-empty strings (the leaf's path, e.g. [\"image\"])."
        if not isinstance(name, str) or name != Path(name).name or name in (".", "..", MANIFEST):
            return f"leaf {'/'.join(key)}: file {name!r} is not a file name inside the data set directory."
        if not isinstance(e["crc32"], str):
            return f"leaf {'/'.join(key)}: crc32 {e['crc32']!r} is not a checksum string."
        # A string where a number belongs ("bytes": "368256") was a raw TypeError comparing sizes, and a
        # string shape ("1438") was reported as a file of shape ('1', '4', '3', '8'), "replaced".
        if not _whole(e["bytes"]):
            return f"leaf {'/'.join(key)}: bytes {e['bytes']!r} is not a whole number of bytes."
        if not isinstance(e["shape"], list) or not all(_whole(d) for d in e["shape"]):
            return f"leaf {'/'.join(key)}: shape {e['shape']!r} is not a list of whole numbers."
        keys.append(tuple(key))
    for a in keys:
        for b in keys:
            if a is not b and b[: len(a)] == a:
                return (f"leaf key {list(a)} is given twice" if a == b else
                        f"leaf key {list(a)} is both a leaf and the parent of {list(b)}") + "."
    files = [e["file"] for e in manifest["leaves"]]
    if len(set(files)) != len(files):
        return f"two leaves share one file ({sorted(f for f in set(files) if files.count(f) > 1)})."
    return None


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _open_leaf(directory: Path, entry: dict[str, Any], count: int, verify: bool) -> np.ndarray:
    path = directory / entry["file"]
    if not path.is_file():
        # A directory (or a socket...) in the file's place was reported "missing", beside it in `ls`.
        what = "is missing" if not path.exists() else "is not a file (a directory stands in its place)" \
            if path.is_dir() else "is not a regular file"
        raise DatasetFileError(fix(f"{path} (leaf {'/'.join(entry['key'])}) {what}.",
                                   "restore the file, or write the data set again."))
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise DatasetCorruptError(fix(f"{path} has {size} bytes; the manifest says {entry['bytes']}: it is "
                                      f"{'truncated' if size < entry['bytes'] else 'longer than written'}.",
                                      "restore the file from an intact copy, or write the data set again."))
    if verify and (crc := crc32_file(path)) != entry["crc32"]:
        raise DatasetCorruptError(fix(f"{path}: checksum {crc} differs from the manifest's "
                                      f"{entry['crc32']}: the file is damaged.", "restore it, or write the data set again."))
    try:
        x = np.load(path, mmap_mode="r", allow_pickle=False)
    except PermissionError:
        raise
    except (OSError, ValueError) as e:
        raise DatasetCorruptError(fix(f"{path} cannot be read as .npy ({e}).", "write the data set again.")) from None
    want_shape, want_dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
    if x.shape != want_shape or x.dtype != want_dtype or want_shape[:1] != (count,):
        raise DatasetLayoutError(fix(f"{path} holds shape {x.shape} dtype {x.dtype}; the manifest says shape "
                                     f"{want_shape} dtype {want_dtype} with {count} examples.",
                                     "the file was replaced: write the data set again."))
    if x.dtype.kind not in _NUMERIC:
        raise DatasetLayoutError(fix(f"{path} has dtype {x.dtype}; a data set holds numbers.",
                                     "write it again from numeric arrays."))
    return x


def load_dataset(directory: str | os.PathLike, *, verify: bool = False) -> dict[str, Any]:
    """A data set directory as a dict of read-only memory-mapped arrays (read lazily).

    Sizes, shapes and dtypes are checked against the manifest when opening; with
    ``verify=True`` every file's CRC-32 too (reads everything once). Pass the result as
    a task's ``train_data`` (or ``spmdkit train --data DIR``). See :func:`write_dataset`.

    Example:
        >>> import numpy as np, spmdkit, tempfile
        >>> d = spmdkit.write_dataset(tempfile.mkdtemp() + "/ds", {"x": np.zeros((4, 3), np.float32)})
        >>> spmdkit.load_dataset(d)["x"].shape
        (4, 3)
        >>> _ = (d / "x.npy").write_bytes((d / "x.npy").read_bytes()[:-4])  # damaged: cut short
        >>> try:
        ...     spmdkit.load_dataset(d)
        ... except spmdkit.DatasetCorruptError as e:
        ...     print(str(e).split("x.npy ")[1])
        has 172 bytes; the manifest says 176: it is truncated.
          Fix: restore the file from an intact copy, or write the data set again.
    """
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
        out: dict[str, Any] = {}
        for entry in manifest["leaves"]:
            node = out
            *parents, last = entry["key"]
            for k in parents:
                node = node.setdefault(k, {})
            node[last] = _open_leaf(directory, entry, int(manifest["count"]), verify)
    except PermissionError as e:
        raise unreadable(directory, e) from None
    return out


def manifest_digest(directory: Path) -> str:
    """One CRC-32 over the manifest's leaves (their keys, files, shapes, dtypes and CRC-32s): it
    changes when the data set is written again with other rows, without reading the rows."""
    leaves = read_manifest(directory)["leaves"]
    return f"{crc32(json.dumps(leaves, sort_keys=True).encode()):08x}"


def unreadable(directory: Path, e: PermissionError) -> DatasetFileError:
    """A data set this user may not read: a bare PermissionError, or (for the manifest and the .npy
    files) "not valid JSON" / "cannot be read as .npy ... write the data set again", which is no fix."""
    return DatasetFileError(fix(f"cannot read the data set {directory}: {e.filename or directory}: permission denied.",
                                f"make it readable for this user (chmod -R u+rX {directory}, or ask its owner), "
                                "or run as a user who may read it."))


def is_dataset_dir(path: Any) -> bool:
    try:
        return isinstance(path, (str, os.PathLike)) and (Path(path) / MANIFEST).exists()
    except PermissionError as e:
        raise unreadable(Path(path), e) from None


class DatasetSource:
    """An on-disk data set as a random-access source of examples: ``len(source)`` and
    ``source[i]`` (one example, a dict of arrays), the protocol of Grain's
    ``MapDataset.source``; it pickles as its directory (Grain's worker processes reopen it).

    Example:
        >>> import numpy as np, spmdkit, tempfile
        >>> d = spmdkit.write_dataset(tempfile.mkdtemp() + "/ds", {"x": np.arange(12.0).reshape(6, 2)})
        >>> source = spmdkit.DatasetSource(d)
        >>> len(source), source[2]["x"].tolist()
        (6, [4.0, 5.0])
    """

    def __init__(self, directory: str | os.PathLike, *, verify: bool = False):
        self.directory = Path(directory)
        self.arrays = load_dataset(self.directory, verify=verify)
        self.digest = manifest_digest(self.directory)
        self._leaves = _leaves(self.arrays)
        self._count = int(self._leaves[0][1].shape[0])

    def __len__(self) -> int:
        return self._count

    def _tree(self, values: list[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for (key, _), value in zip(self._leaves, values):
            node = out
            for k in key[:-1]:
                node = node.setdefault(k, {})
            node[key[-1]] = value
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._tree([np.asarray(x[index]) for _, x in self._leaves])

    def rows(self, indices: Any) -> dict[str, Any]:
        """Examples ``indices`` (in that order) stacked on a leading axis: one read per leaf.

        Each leaf is read in ascending index order (a memory map then pages the file
        front to back) and put back in the order asked for, so the batch equals
        stacking ``source[i]`` for ``i`` in ``indices``.

        Example:
            >>> import numpy as np, spmdkit, tempfile
            >>> d = spmdkit.write_dataset(tempfile.mkdtemp() + "/ds", {"x": np.arange(6.0)})
            >>> spmdkit.DatasetSource(d).rows([4, 1, 2])["x"].tolist()
            [4.0, 1.0, 2.0]
        """
        given = np.asarray(indices)
        if given.size and given.dtype.kind not in "iu":
            # Cast to int64, a boolean mask picked rows 1 and 0 (True, False) and 1.7 picked row 1, silently.
            raise IndexError(f"DatasetSource.rows takes example numbers (integers); got dtype {given.dtype}"
                             f"{' (a boolean mask: pass np.flatnonzero(mask))' if given.dtype == bool else ''}.")
        idx = given.astype(np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._count):
            bad = int(idx[(idx < 0) | (idx >= self._count)][0])
            raise IndexError(f"example {bad} of {self.directory}: the data set holds {self._count} (0 to "
                             f"{self._count - 1})")
        order = np.argsort(idx, kind="stable")
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        ascending = idx[order]
        return self._tree([np.asarray(x[ascending])[back] for _, x in self._leaves])

    def _getitems(self, indices: Any) -> list[dict[str, Any]]:
        """Grain's batched read (``SupportsBatchedReadRandomAccessDataSource``): the examples
        ``indices`` as a list, read with one :meth:`rows` call."""
        batch = self.rows(indices)
        leaves = [leaf for _, leaf in _leaves(batch)]
        return [self._tree([leaf[i] for leaf in leaves]) for i in range(len(leaves[0]))]

    __getitems__ = _getitems  # the same batched read under PyTorch's name

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": str(self.directory)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"])

    def __repr__(self) -> str:
        return f"DatasetSource({str(self.directory)!r}, {self._count} examples)"
