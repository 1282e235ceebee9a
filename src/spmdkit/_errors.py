"""The spmdkit error hierarchy.

Every error spmdkit raises on bad input derives from :class:`SpmdkitError`, so a
caller can catch ours without catching JAX's. Messages follow one shape: what is
wrong, where (argument and pytree path), the sizes involved, and how to fix it.
"""

from __future__ import annotations

import zipfile
import zlib
from typing import Any

# What np.load raises for a damaged .npz beyond OSError and ValueError: a zip cut short or corrupt
# (BadZipFile, a bad CRC too), an empty file (EOFError), a compressed member cut short (zlib.error).
NPZ_DAMAGE = (zipfile.BadZipFile, EOFError, zlib.error)


# The command line's code for a check that did not pass (README, exit codes): not 1, which says
# spmdkit crashed, so that a script can tell a failed check from a bug.
EXIT_CHECK_FAILED = 6


def open_npz(path: Any) -> Any:
    """``np.load(path)`` of an .npz, without pickles, as :func:`npz_file` checks it.

    A file that is neither a zip nor an .npy is, to numpy, "pickled (object) data" to be loaded
    with ``allow_pickle``: random bytes read as a pickle, and the advice is one spmdkit never takes
    (a pickle runs code). It is a ValueError saying what the file is not, and how it starts."""
    import numpy as np

    try:
        return npz_file(np.load(path, allow_pickle=False))
    except ValueError as e:
        if "pickled" not in str(e):
            raise
        try:
            with open(path, "rb") as f:
                first = f.read(8)
        except TypeError:  # a file object, as np.load takes too
            first = b"?"
        raise ValueError(f"neither a zip archive of named arrays (.npz) nor an .npy array: it starts with the bytes "
                         f"{first!r} (spmdkit never loads a pickle, which can run code)") from None


def npz_file(loaded: Any) -> Any:
    """What ``np.load`` returned, if it is an .npz of named arrays; a ValueError for an .npy
    (one bare array), which failed as a bare TypeError where the caller opened it with ``with``."""
    if not hasattr(loaded, "files"):
        raise ValueError(f"it holds one bare array of shape {getattr(loaded, 'shape', '?')} (an .npy file), "
                         "not named arrays")
    return loaded


class SpmdkitError(Exception):
    """Base class of every error spmdkit raises on purpose."""


class DeviceSetupError(SpmdkitError, RuntimeError):
    """Devices were requested in a way the running JAX backend cannot honour."""


class MeshError(SpmdkitError, ValueError):
    """A mesh shape or axis name is invalid for the available devices."""


class MappedAxisError(SpmdkitError, ValueError):
    """An argument of a parallel-mapped function has a wrong mapped axis."""


class TreeMismatchError(SpmdkitError, ValueError):
    """A pytree prefix (``in_axes``, ``out_axes``) does not match its pytree."""


class AxisNameError(SpmdkitError, NameError):
    """A collective names an axis that the enclosing parallel map does not bind."""


class BatchSizeError(SpmdkitError, ValueError):
    """A batch cannot be split across devices as requested."""


def fix(message: str, remedy: str) -> str:
    """Join a diagnosis and its remedy in the house style."""
    return f"{message}\n  Fix: {remedy}"


def unwritable(path: str, label: str, example: str) -> tuple[str, str] | None:
    """Why an output file at ``path`` cannot be written, as ``(message, remedy)`` for
    :func:`fix`, or None if it can: checked before minutes of work that would end by writing it.
    ``label`` names the argument in the message (``"--json 'x.json'"``), ``example`` a good one.

    Example:
        >>> import tempfile
        >>> unwritable(tempfile.gettempdir(), "--out '/tmp'", "--out target.json")[0]
        "--out '/tmp' is a directory."
    """
    import os
    import shlex
    import tempfile

    from spmdkit._atomic import is_special

    if os.path.isdir(path):
        return f"{label} is a directory.", f"pass a file name, e.g. {example}."
    if is_special(path):  # /dev/stdout, a FIFO: written in place, so the node itself must take it
        return None if os.access(path, os.W_OK) else (f"{label}: cannot write to it.", "pass a path you can write to.")
    parent = os.path.dirname(_written_at(path))
    if os.path.islink(path):
        label = f"{label} (a symbolic link to {os.readlink(path)})"
    if not os.path.isdir(parent):
        blocker = _in_the_way(parent)
        if blocker is not None:  # "mkdir -p" would fail on it: the path itself is wrong
            return (f"{label}: {blocker}.", f"pass a path whose folders are directories, e.g. {example}.")
        # Quoted: "mkdir -p /tmp/out dir" would make two directories, neither of them this one.
        return f"{label}: directory {parent} does not exist.", f"create it (mkdir -p {shlex.quote(parent)}) or pass another path."
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".spmdkit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{label}: cannot write in {parent} ({e.strerror or e}).", "pass a path in a directory you can write to."
    return None


def wrong_output_path(path: str) -> bool:
    """Whether an output path that :func:`unwritable` refused is the caller's mistake (a
    directory given, a folder missing or a file in its place: bad input, exit code 2), not a
    place that refuses the write (no permission, a full disk: an I/O failure, 5)."""
    import os

    return os.path.isdir(path) or not os.path.isdir(os.path.dirname(_written_at(path)))


def _written_at(path: str) -> str:
    """The absolute path a file given as ``path`` is written at. A link's file is replaced beside
    itself, wherever the link is; a link to nothing yet too, so its target's folder is the one
    that must take the file (the link's own passed the check, and the write failed)."""
    import os

    return os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)


def _in_the_way(directory: str) -> str | None:
    """What stands where ``directory`` or an ancestor of it belongs (a file, a link to nothing), or None."""
    import os

    while not os.path.lexists(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    if os.path.isdir(directory):
        return None
    if os.path.islink(directory) and not os.path.exists(directory):
        return f"{directory} is a symbolic link to {os.readlink(directory)}, which does not exist"
    return f"{directory} is a file, not a directory"


class ConfigError(SpmdkitError, ValueError):
    """A training option or config-file key is invalid."""


class DataError(SpmdkitError, ValueError):
    """A data set is malformed: mismatched lengths, missing or corrupt files."""


class NonFiniteLossError(SpmdkitError, FloatingPointError):
    """Training produced a NaN or infinite loss; the last good state is kept."""

    def __init__(self, message: str, step: int, loss: float):
        super().__init__(message)
        self.step = step
        self.loss = loss


class MappedAxisTypeError(MappedAxisError, TypeError):
    """A parallel map got a value of the wrong type (``jax.pmap`` raises TypeError here)."""


class MappedAxisIndexError(MappedAxisError, IndexError):
    """A mapped axis is out of range for its argument (``jax.pmap`` raises IndexError here)."""


class ReplicationError(MappedAxisError):
    """An output declared replicated (``out_axes=None``) differs between devices."""


class TaskError(SpmdkitError, TypeError):
    """A Task's init, loss or data do not have the form spmdkit trains."""


class SignatureError(SpmdkitError, TypeError):
    """A compiled function was called with arguments of another structure, shape or dtype."""


class DonatedStateError(SpmdkitError, RuntimeError):
    """A state whose arrays were given away (donated) to an earlier step was passed again."""


class ProcessMismatchError(SpmdkitError, ValueError):
    """The processes of one program gave different values where each must give the same one
    (the init key, the global batch's structure, shapes or dtypes): names the processes and what each gave."""


class StepOutputError(SpmdkitError, TypeError):
    """A user's step returned what cannot be the next step's input or leave a compiled call."""


class PeerLostError(SpmdkitError, RuntimeError):
    """Another process of the job ended while this one waited for it in a collective
    (also a ``RuntimeError``, as JAX's own error for it is)."""

    exit_code = 4  # the CLI's code for a lost peer process (README, exit codes)


def first_line(e: BaseException) -> str:
    """An error's first line; a callback's error ("...calling callback: Traceback ...") by the user's own last line."""
    lines = [line for line in str(e).splitlines() if line.strip()] or [""]
    return (lines[0] if "Traceback (most recent" not in lines[0] else lines[0].split("Traceback")[0] + lines[-1])[:300]
