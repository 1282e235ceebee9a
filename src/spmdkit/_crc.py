"""CRC-32 of checkpoint and data set files, at the speed of the machine's CRC instructions.

Checkpoints and data sets record each file's CRC-32 (zlib's polynomial) and every save,
restore and verified read runs it over every byte, so its speed bounds theirs. zlib 1.2's
``crc32`` runs at about 3 GB/s on one core; zlib-ng's (a dependency) computes the same value
with carry-less multiplication at about 25 GB/s. Without zlib-ng (an unusual platform where it
did not install) the standard library's ``zlib.crc32`` gives the same checksums, slower:
nothing written by one is unreadable by the other. CRC-32 finds changed, truncated or torn
bytes; it does not guard against forgery.

Example:
    >>> from spmdkit._crc import crc32
    >>> f"{crc32(b'spmdkit'):08x}" == f"{__import__('zlib').crc32(b'spmdkit'):08x}"
    True
"""

from __future__ import annotations

import threading
from pathlib import Path

try:  # both release the GIL on large buffers, so threads checksum on every core
    from zlib_ng.zlib_ng import crc32
    IMPLEMENTATION = "zlib-ng"
except ImportError:  # zlib-ng is a dependency; this is its fallback (tests/test_crc.py)
    from zlib import crc32
    IMPLEMENTATION = "zlib"

__all__ = ["crc32", "crc32_file", "IMPLEMENTATION"]

_BUFFERS = threading.local()


def crc32_file(path: Path) -> str:
    """A file's CRC-32 as 8 hex digits, read in 4 MiB pieces into one buffer per thread
    (reused: no new pages per piece)."""
    buf = getattr(_BUFFERS, "buf", None)
    if buf is None:
        buf = _BUFFERS.buf = memoryview(bytearray(1 << 22))
    crc = 0
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = crc32(buf[:n], crc)
    return f"{crc:08x}"
