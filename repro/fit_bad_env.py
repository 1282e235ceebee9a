"""A user's own fit() with SPMDKIT_HOST_ALLOCATOR set to a value spmdkit does not know ("off"):
the user never calls reuse_host_memory(). Does training run to its end and then fail while
writing the summary (the run's result lost), or fail up front?

usage: SPMDKIT_HOST_ALLOCATOR=off python fit_bad_env.py [progress]
"""
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
import optax

import spmdkit

xs = np.linspace(-1, 1, 64, dtype=np.float32)
task = spmdkit.Task(
    name="line", init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
    loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
    train_data={"x": xs, "y": 3 * xs + 1})
out = tempfile.mkdtemp()
steps = []
try:
    r = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.3), spmdkit.TrainConfig(steps=20, batch_size=16),
                    out_dir=out, progress="progress" in sys.argv, log=lambda m: steps.append(m))
    print("ok:", r.summary.get("host_memory"))
except Exception as e:  # noqa: BLE001
    import os
    print(f"{type(e).__name__} after training wrote {sorted(os.listdir(out))}: {str(e)[:200]}")
