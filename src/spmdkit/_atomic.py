"""Files written whole or not at all.

Every file spmdkit writes for a reader to find later (checkpoint manifests, data sets,
summaries, parameters, plans, plots, calibration targets) goes through
:func:`replace_whole`: a process killed mid-write, a full disk or Ctrl-C leaves the previous
file, or none, never half of one. A reader that holds the old file open (a training run
memory-mapping a data set being rewritten) keeps the old bytes until it closes it.

The ground floor: this module imports nothing of spmdkit.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable

# ".summary.1234.tmp.json": hidden, the writer's pid, and the final name's suffix kept
# (matplotlib picks the image format by it, np.savez appends ".npz" to a name without it).
_TEMPORARY = re.compile(r"^\..+\.\d+\.tmp(\.[^.]*)?$")


def temporary_name(path: str | os.PathLike) -> str:
    """The temporary file beside ``path`` that :func:`replace_whole` writes first."""
    folder, name = os.path.split(os.path.abspath(path))
    stem, suffix = os.path.splitext(name)
    return os.path.join(folder, f".{stem}.{os.getpid()}.tmp{suffix}")


def is_temporary(name: str) -> bool:
    """Whether the file name ``name`` is one of :func:`replace_whole`'s temporary files (left
    by a writer that was killed, so safe to delete when its directory is rewritten)."""
    return bool(_TEMPORARY.match(name))


def replace_whole(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write(tmp)`` writes the new contents to the path ``tmp``; they are flushed to disk and
    renamed over ``path`` (over the file a symbolic link names; a device or FIFO, such as
    ``/dev/stdout``, is written in place). Any error (an ``OSError`` from a full disk, Ctrl-C) removes the
    temporary file and propagates: the caller turns it into its own message.

        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
        >>> replace_whole(p, lambda tmp: pathlib.Path(tmp).write_text("hi"))
        >>> p.read_text()
        'hi'
    """
    if is_special(path):
        # /dev/stdout, /dev/null, a FIFO: renaming a file over one replaced the node itself (as
        # root, /dev/stdout became a regular file for every process). Written in place, as asked.
        write(os.fspath(path))
        return
    # Through a symbolic link to the file it names: the rename replaced the link with a file.
    path = os.path.realpath(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        # Renaming an unsynced file can leave an empty one after a power cut (ext4, xfs).
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def is_special(path: str | os.PathLike) -> bool:
    """A device, FIFO or socket at ``path`` (links followed): nothing that can be replaced whole."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def replace_text(path: str | os.PathLike, text: str) -> None:
    """:func:`replace_whole` for a text file (UTF-8)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
    replace_whole(path, write)
