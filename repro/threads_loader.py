"""A user's threaded data loader (ThreadPoolExecutor making numpy batches) feeding fit():
slower under reuse_host_memory()'s one malloc arena? Rough: run interleaved, several rounds.

usage: python threads_loader.py reuse|system loader|fit [threads] [batch rows]
Prints one JSON line: mode, what, seconds.
"""
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import spmdkit

mode, what = sys.argv[1], sys.argv[2]
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 4
status = spmdkit.reuse_host_memory() if mode == "reuse" else spmdkit.host_memory()
B, D = (int(sys.argv[4]) if len(sys.argv) > 4 else 128), 512


def make_batch(i):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(B, D)).astype(np.float32)          # several temporaries per batch,
    for _ in range(6):                                         # each 256 KiB-1 MiB (malloc, GIL off)
        x = np.tanh((x - x.mean(0)) / (x.std(0) + 1e-3))
    return {"x": x, "y": x[:, :1] * 0.5}


def batches(n):
    with ThreadPoolExecutor(threads) as pool:
        yield from pool.map(make_batch, range(n))


t = time.perf_counter()
if what == "loader":
    n = sum(1 for _ in batches(1500))
else:
    import jax.numpy as jnp
    import optax

    task = spmdkit.Task(name="threads", init=lambda rng: {"w": jnp.zeros((D, 1))},
                        loss_fn=lambda p, b, rng: (jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), {}),
                        train_data=batches(400))
    spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.01), spmdkit.TrainConfig(steps=400, batch_size=B, prefetch=4),
                progress=False)
print(json.dumps({"mode": mode, "what": what, "reused": status.reused, "s": round(time.perf_counter() - t, 2)}),
      flush=True)
