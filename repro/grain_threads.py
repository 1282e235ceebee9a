"""A Grain pipeline read by 8 threads (ReadOptions(num_threads=8)) with a numpy .map per batch,
feeding fit(): slower under reuse_host_memory()'s one malloc arena? Rough timing only.

usage: python grain_threads.py reuse|system DATA_DIR
"""
import json
import os
import sys
import time

import numpy as np

import spmdkit

mode, data_dir = sys.argv[1], sys.argv[2]
status = spmdkit.reuse_host_memory() if mode == "reuse" else spmdkit.host_memory()
import grain  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

if not os.path.exists(data_dir):
    x = np.random.default_rng(0).normal(size=(8192, 512)).astype(np.float32)
    spmdkit.write_dataset(data_dir, {"x": x, "y": x[:, :1]})


def augment(b):
    x = b["x"]
    for _ in range(6):
        x = np.tanh((x - x.mean(0)) / (x.std(0) + 1e-3))
    return {"x": x, "y": b["y"]}


ds = spmdkit.grain_batches(data_dir, 128, seed=0).repeat(None).map(augment)  # 64 batches an epoch
it = ds.to_iter_dataset(grain.ReadOptions(num_threads=8, prefetch_buffer_size=16))
t = time.perf_counter()
n = 0
for _ in it:
    n += 1
    if n == 600:
        break
loader_s = time.perf_counter() - t
task = spmdkit.Task(name="grain", init=lambda rng: {"w": jnp.zeros((512, 1))},
                    loss_fn=lambda p, b, rng: (jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), {}), train_data=it)
t = time.perf_counter()
spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.01), spmdkit.TrainConfig(steps=300, batch_size=128, prefetch=4),
            progress=False)
print(json.dumps({"mode": mode, "reused": status.reused, "loader_600_s": round(loader_s, 2),
                  "fit_300_s": round(time.perf_counter() - t, 2)}), flush=True)
