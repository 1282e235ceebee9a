"""A buffer grown by concatenation while small arrays are kept alongside (a loader's log, a
metrics list): under reuse_host_memory() each freed old buffer stays resident as a hole the
next, larger buffer does not fit, so RSS approaches the SUM of all sizes, not the largest.

usage: python grow_buffer.py reuse|system [steps] [MiB per step] [trim]
  trim: call glibc's malloc_trim(0) at the end (gives the holes' pages back)
"""
import sys

import numpy as np

import spmdkit

if sys.argv[1] == "reuse":
    spmdkit.reuse_host_memory()
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 25
mib = int(sys.argv[3]) if len(sys.argv) > 3 else 8


def rss():
    d = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS"):
            d[k] = int(v.split()[0]) // 1024
    return d


buf = np.zeros(0, np.uint8)
kept = []
for i in range(steps):
    buf = np.concatenate([buf, np.ones(mib * 2**20, np.uint8)])
    kept.append(np.ones(2000))  # 16 KB through malloc: lands above the new buffer
print(f"{spmdkit.host_memory()}: buffer {buf.nbytes >> 20} MiB, {rss()} MiB", flush=True)
if "trim" in sys.argv:
    import ctypes

    ctypes.CDLL(None).malloc_trim(0)
    print(f"after malloc_trim(0): {rss()} MiB", flush=True)
