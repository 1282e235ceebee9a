"""Allocate a large numpy array, free it, keep working: is its memory kept (VmRSS)?

usage: python big_free.py GB [reuse|system] [hold]
  hold: keep a small allocation made after the big one alive (it pins the heap top, so
  glibc cannot trim even under its defaults when the big block came from brk).
Prints VmHWM / VmRSS in MiB after the free and after small work.
"""
import sys

import numpy as np

import spmdkit

gb = float(sys.argv[1])
if sys.argv[2] == "reuse":
    print(spmdkit.reuse_host_memory())
else:
    print(spmdkit.host_memory())


def st(tag):
    d = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS"):
            d[k] = int(v.split()[0]) // 1024
    print(tag, d, flush=True)


a = np.ones(int(gb * 2**30) // 8)
pin = np.ones(1000) if "hold" in sys.argv else None
st("allocated")
del a
st("freed")
import jax.numpy as jnp

for _ in range(20):
    x = jnp.ones((256, 256)) @ jnp.ones((256, 256))
x.block_until_ready()
b = [np.ones(10_000) for _ in range(1000)]
st("after small work")
