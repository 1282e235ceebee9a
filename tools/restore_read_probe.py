"""Probe behind BENCHMARKS.md "checkpoint" (the preadv lever): is reading a chunk file straight
into a shard's buffer cheaper than reading it into a small reused buffer and copying?

The restore reads each chunk file in 2 MiB pieces into one buffer per thread, then copies the
piece into every shard buffer that holds it. Reading the piece straight into the first shard's
buffer (``preadv``, one buffer per row where a chunk's row is part of a shard's row) would save
one copy. This times the three ways over a 512 MiB destination that is already paged in, in
interleaved rounds, from a 2 MiB file in the page cache:

    python tools/restore_read_probe.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

PIECE = 2 * 2**20
DEST = 512 * 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile() as tmp:
        tmp.write(os.urandom(PIECE))
        tmp.flush()
        fd = os.open(tmp.name, os.O_RDONLY)
        dest = np.ones(DEST, np.uint8)  # touched: no page faults in the timed part
        scratch = np.empty(PIECE, np.uint8)

        def through_buffer() -> None:
            for i in range(0, DEST, PIECE):
                os.preadv(fd, [scratch], 0)
                dest[i: i + PIECE] = scratch

        def straight() -> None:
            for i in range(0, DEST, PIECE):
                os.preadv(fd, [dest[i: i + PIECE]], 0)

        def rows(size: int):
            def run() -> None:
                for i in range(0, DEST, PIECE):
                    os.preadv(fd, [dest[i + j: i + j + size] for j in range(0, PIECE, size)], 0)
            return run

        cases = {"read into a 2 MiB buffer, then copy (the restore)": through_buffer,
                 "read straight into the destination": straight,
                 "straight, 8 KiB rows (256 buffers per readv)": rows(8192),
                 "straight, 256 KiB rows": rows(256 * 1024)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.rounds + 1):
            names = list(cases)[r % len(cases):] + list(cases)[: r % len(cases)]
            for name in names:
                t0 = time.perf_counter()
                cases[name]()
                if r:  # round 0 warms up
                    times[name].append(time.perf_counter() - t0)
        os.close(fd)
    base = statistics.median(times["read into a 2 MiB buffer, then copy (the restore)"])
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds; ms per 512 MiB, median [min-max], x the restore's way")
    for name, ts in times.items():
        ms = [t * 1e3 for t in ts]
        print(f"  {name:52s} {statistics.median(ms):7.1f} [{min(ms):.1f}-{max(ms):.1f}]  x{statistics.median(ts) / base:.2f}")


if __name__ == "__main__":
    main()
