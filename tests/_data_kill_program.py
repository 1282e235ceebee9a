"""A user's script for tests/test_data.py: fit from a Grain pipeline with checkpoints.

Killed and started again with RESUME=1 it continues the pipeline where its checkpoint
stands (the iterator state saved with the train state). Arguments: CKPT_DIR OUT.npz
STEPS RESUME(0/1). Imported, :func:`run` trains in the calling process.
"""

from __future__ import annotations

import sys

import numpy as np


def pipeline():
    import grain

    x = np.linspace(-1, 1, 64, dtype=np.float32)
    source = grain.MapDataset.source([{"x": x[i], "y": np.float32(3 * x[i] + 1)} for i in range(64)])
    return source.shuffle(seed=1).batch(16, drop_remainder=True).to_iter_dataset()


def run(ckpt_dir, steps, resume, every=10):
    import jax.numpy as jnp
    import optax

    import spmdkit

    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
                        loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
                        train_data=pipeline())
    ckpt = None if ckpt_dir is None else spmdkit.CheckpointConfig(str(ckpt_dir), every=every, resume=bool(resume))
    result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.01, momentum=0.9),
                         spmdkit.TrainConfig(steps=steps, batch_size=16), checkpoint=ckpt, progress=False,
                         log=print)
    return {k: np.asarray(v) for k, v in result.params.items()}


if __name__ == "__main__":
    import spmdkit

    spmdkit.use_host_devices(8)
    np.savez(sys.argv[2], **run(sys.argv[1], int(sys.argv[3]), int(sys.argv[4])))
