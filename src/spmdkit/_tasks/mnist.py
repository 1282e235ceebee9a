"""Seed 003's MNIST CNN on the real MNIST files, read from a local directory.

Nothing is downloaded: ``--data-dir DIR`` must hold the four standard IDX files
(``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, each optionally ``.gz``) or one ``mnist.npz`` with
``x_train, y_train, x_test, y_test`` (the Keras layout).
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np

from spmdkit._errors import NPZ_DAMAGE, DataError, fix, open_npz
from spmdkit._tasks._base import Task
from spmdkit._tasks.digits import CNN, NUM_CLASSES, classification_task  # noqa: F401 (NUM_CLASSES: the CLI's label check)

DEFAULTS = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "steps": 1000, "batch_size": 128}

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# IDX type codes (the third magic byte) -> numpy dtype, big-endian as the format says.
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_CODES = {np.dtype(v).newbyteorder(">"): k for k, v in _DTYPES.items()}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (gzipped or not); a damaged file is a DataError naming it."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(fix(f"{path}: cannot be read as {'gzip' if path.suffix == '.gz' else 'a file'}: {e}.",
                            "replace it with an intact copy.")) from None
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _DTYPES:
        raise DataError(
            fix(
                f"{path} is not an IDX file: it starts with bytes {raw[:4].hex()!r}, expected "
                "00 00 <type code> <ndim> (e.g. 00000803 for MNIST images, 00000801 for labels).",
                "point --data-dir at the original MNIST files (or their .gz).",
            )
        )
    dtype, ndim = np.dtype(_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(fix(f"{path}: truncated inside its header.", "replace it with an intact copy."))
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(
            fix(
                f"{path}: the header says shape {dims} ({expected} bytes with the header) but the "
                f"file has {len(raw)} bytes: it is {'truncated' if len(raw) < expected else 'too long'}.",
                "replace it with an intact copy.",
            )
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write an array as an IDX file (``.gz`` if the name says so): for tests and tools."""
    path = Path(path)
    array = np.asarray(array)
    code = _CODES[array.dtype.newbyteorder(">")] if array.dtype != np.uint8 else 0x08
    body = struct.pack(f">BBBB{array.ndim}I", 0, 0, code, array.ndim, *array.shape)
    body += array.astype(np.dtype(_DTYPES[code])).tobytes()
    path.write_bytes(gzip.compress(body) if path.suffix == ".gz" else body)


def _find(data_dir: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (data_dir / name).exists():
            return data_dir / name
    return None


def load(data_dir: str | Path) -> tuple[dict, dict]:
    """``(train, test)`` dicts of ``image`` [N, 28, 28, 1] in [0, 1] and ``label`` [N]."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(fix(f"--data-dir {data_dir} is not a directory.", "pass the directory holding the MNIST files."))
    npz = data_dir / "mnist.npz"
    if npz.exists():
        try:
            with open_npz(npz) as f:
                missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f.files]
                if missing:
                    raise DataError(fix(f"{npz} lacks arrays {missing} (it has {f.files}).",
                                        "write it with x_train, y_train, x_test, y_test."))
                arrays = {k: f[k] for k in ("x_train", "y_train", "x_test", "y_test")}
        except DataError:  # the missing arrays' own message: a ValueError, it was wrapped in a second "Fix:"
            raise
        except (OSError, ValueError, *NPZ_DAMAGE) as e:
            raise DataError(fix(f"{npz} cannot be read: {e}.", "replace it with an intact copy.")) from None
        parts = {"train_images": arrays["x_train"], "train_labels": arrays["y_train"],
                 "test_images": arrays["x_test"], "test_labels": arrays["y_test"]}
        source = {k: npz for k in parts}
    else:
        source = {k: _find(data_dir, stem) for k, stem in FILES.items()}
        missing = [FILES[k] for k, p in source.items() if p is None]
        if missing:
            raise DataError(
                fix(
                    f"{data_dir} lacks the MNIST file(s) {missing} (also looked for .gz and "
                    "'.idx' spellings) and has no mnist.npz. Nothing is downloaded.",
                    "copy the four MNIST IDX files (or mnist.npz) into that directory.",
                )
            )
        parts = {k: read_idx(p) for k, p in source.items()}
    split = {}
    for which in ("train", "test"):
        images, labels = parts[f"{which}_images"], parts[f"{which}_labels"]
        where = source[f"{which}_images"]
        if images.ndim != 3:
            raise DataError(fix(f"{where}: {which} images have shape {images.shape}, expected [N, rows, cols].",
                                "use the MNIST image files (idx3)."))
        if labels.ndim != 1 or len(labels) != len(images):
            raise DataError(
                fix(
                    f"{source[f'{which}_labels']}: {which} labels have shape {labels.shape} but there are "
                    f"{len(images)} {which} images.",
                    "use the label file that belongs to the image file.",
                )
            )
        if len(labels) and (labels.min() < 0 or labels.max() > 9):
            raise DataError(fix(f"{source[f'{which}_labels']}: labels range over {labels.min()}..{labels.max()}, expected 0..9.",
                                "use the MNIST label files."))
        scale = 255.0 if images.dtype == np.uint8 else 1.0
        split[which] = {"image": (images.astype(np.float32) / scale)[..., None], "label": labels.astype(np.int32)}
    return split["train"], split["test"]


NEEDS_DATA_DIR = True  # its own data sets are files the user supplies (--data-dir)


def make(data_dir: str | None = None) -> Task:
    if data_dir is None:
        raise DataError(
            fix(
                "--task mnist needs --data-dir DIR: the directory with the MNIST IDX files "
                f"({', '.join(FILES.values())}, optionally .gz) or mnist.npz. Nothing is downloaded.",
                "pass --data-dir (or data-dir = \"...\" in the config file), or train from a data set written "
                "once from those files: spmdkit data write DIR --task mnist --data-dir RAW, then --data DIR.",
            )
        )
    train, test = load(data_dir)
    return classification_task("mnist", CNN(), train, test, defaults=DEFAULTS)


def from_data(train: dict, test: dict | None) -> Task:
    """The MNIST CNN on given splits (``spmdkit data write DIR --task mnist`` then
    ``spmdkit train --task mnist --data DIR``): no IDX files are read."""
    return classification_task("mnist", CNN(), train, test, defaults=DEFAULTS)
