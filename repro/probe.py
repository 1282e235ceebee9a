"""Does this process really reuse its host memory, and what does spmdkit say?

usage: python probe.py [call|nocall]
Prints spmdkit's status and the page faults of the last 8 of 12 calls of a program whose
temporaries (~96 MiB) exceed glibc's mmap threshold: thousands per call = not reused.
"""
import json, resource, sys

import spmdkit

err = None
try:
    status = spmdkit.reuse_host_memory() if "nocall" not in sys.argv else spmdkit.host_memory()
except Exception as e:  # noqa: BLE001 - a probe reports everything
    err, status = f"{type(e).__name__}: {e}", None
import jax, jax.numpy as jnp

x = jnp.ones((8192, 256)); w = jnp.ones((256, 1024)) * 1e-3
f = jax.jit(lambda x, w: jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w.T) ** 2))(w).sum())
faults = []
for _ in range(12):
    b = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - b)
print(json.dumps({"status": str(status), "error": err, "faults_last8_median": sorted(faults[-8:])[4]}))
