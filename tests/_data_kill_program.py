"""A user's script for tests/test_data_grain.py: fit from a Grain pipeline with checkpoints.

Killed and started again with RESUME=1 it continues the pipeline where its checkpoint
stands (the iterator state saved with the train state). Arguments: CKPT_DIR OUT.npz
STEPS RESUME(0/1) [mp]. Imported, :func:`run` trains in the calling process.

With ``mp`` it runs under ``spmdkit launch``: each process's pipeline yields its own
share (every other example), its iterator state saved per process; RESUME=0 first
trains the same run uninterrupted (OUT.straight.npz), then the checkpointed run that
the test kills; RESUME=1 resumes it and records how many examples this process read.
"""

from __future__ import annotations

import sys

import numpy as np


class _Counted:
    """The examples as a random-access source that counts its reads."""

    def __init__(self, records):
        self.records, self.reads = records, 0

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        self.reads += 1
        return self.records[i]


def pipeline(source=None):
    import grain
    import jax

    x = np.linspace(-1, 1, 64, dtype=np.float32)
    source = source or [{"x": x[i], "y": np.float32(3 * x[i] + 1)} for i in range(64)]
    p, count = jax.process_index(), jax.process_count()
    shuffled = grain.MapDataset.source(source).shuffle(seed=1)[p::count]  # this process's share
    return shuffled.batch(16 // count, drop_remainder=True).to_iter_dataset()


def run(ckpt_dir, steps, resume, every=10, source=None):
    import jax.numpy as jnp
    import optax

    import spmdkit

    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(()), "b": jnp.zeros(())},
                        loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] + p["b"] - b["y"]) ** 2), {}),
                        train_data=pipeline(source))
    ckpt = None if ckpt_dir is None else spmdkit.CheckpointConfig(str(ckpt_dir), every=every, resume=bool(resume))
    result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.01, momentum=0.9),
                         spmdkit.TrainConfig(steps=steps, batch_size=16), checkpoint=ckpt, progress=False,
                         log=print)
    return {k: np.asarray(v) for k, v in result.params.items()}


if __name__ == "__main__":
    import spmdkit

    ckpt_dir, out, steps, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if sys.argv[5:] != ["mp"]:
        spmdkit.use_host_devices(8)
        np.savez(out, **run(ckpt_dir, steps, resume))
        sys.exit(0)
    assert spmdkit.initialize(), "expected to run under spmdkit launch"
    import jax

    if not resume:
        straight = run(None, steps, 0)
        if jax.process_index() == 0:
            np.savez(f"{out}.straight.npz", **straight)
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    counted = _Counted([{"x": x[i], "y": np.float32(3 * x[i] + 1)} for i in range(64)])
    params = run(ckpt_dir, steps, resume, source=counted)
    np.savez(f"{out}.{jax.process_index()}.npz", reads=counted.reads, **params)
    print("process", jax.process_index(), "of", jax.process_count(), "devices", jax.device_count())
