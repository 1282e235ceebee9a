"""A training script for tests/test_data_multiprocess.py: fit from an on-disk data set.

Under ``spmdkit launch`` every process reads only its rows; the rows each process read
are recorded (``take_rows`` wrapped) and written with the parameters. Imported, it runs
in the calling process. Arguments: DATA_DIR OUT.npz STEPS CKPT_DIR RESUME(0/1).
"""

from __future__ import annotations

import sys

import numpy as np


def write_data(directory):
    import spmdkit

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype(np.float32)
    return spmdkit.write_dataset(directory, {"x": x, "y": np.tanh(x[:, :4]).astype(np.float32)})


def process_share(data_dir, steps):
    """This process's rows of each of the arrays run's global batches, as a list: what a
    pipeline sharded by JAX process (e.g. Grain's ShardByJaxProcess) yields."""
    import jax

    from spmdkit._data import ArrayFeed, load_dataset

    data = load_dataset(data_dir)
    feed, p, share = ArrayFeed(data, 16, 3, False), jax.process_index(), 16 // jax.process_count()
    rows = [feed.indices(k)[1][p * share:(p + 1) * share] for k in range(steps)]
    return [{k: np.asarray(v[r]) for k, v in data.items()} for r in rows]


def run(data_dir, steps, ckpt_dir, resume, pipeline=False, grain=False):
    import jax
    import jax.numpy as jnp
    import optax

    import spmdkit
    from spmdkit._data import _feed

    reads = []
    plain = _feed.take_rows
    _feed.take_rows = lambda x, idx: (reads.append(np.array(idx)), plain(x, idx))[1]
    try:
        def init(key):
            k1, k2 = jax.random.split(key)
            return {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 4)) * 0.3}

        def loss_fn(p, b, rng):
            return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2), {}

        data = process_share(data_dir, steps) if pipeline else str(data_dir)
        if grain:  # a Grain MapDataset of this process's rows, read a batch at a time
            data = spmdkit.grain_batches(data_dir, 16, seed=3)
        task = spmdkit.Task(name="mp-data", init=init, loss_fn=loss_fn, train_data=data)
        ckpt = None if ckpt_dir is None else spmdkit.CheckpointConfig(str(ckpt_dir), every=2, resume=bool(resume))
        result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.1, momentum=0.9),
                             spmdkit.TrainConfig(steps=steps, batch_size=16, seed=3), checkpoint=ckpt, progress=False,
                             log=lambda m: None)
    finally:
        _feed.take_rows = plain
    start = result.summary.get("resumed_from_step", 0)
    return {"w1": np.asarray(result.params["w1"]), "w2": np.asarray(result.params["w2"]), "start": np.asarray(start),
            "reads": np.stack(reads[::2]) if reads else np.zeros((0, 16))}  # one per batch (two leaves, same rows)


if __name__ == "__main__":
    import spmdkit

    assert spmdkit.initialize(), "expected to run under spmdkit launch"
    import jax

    out = run(sys.argv[1], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    np.savez(f"{sys.argv[2]}.{jax.process_index()}.npz", **out)
    if not int(sys.argv[5]):  # the same run from a list of this process's shares
        piped = run(sys.argv[1], int(sys.argv[3]), None, 0, pipeline=True)
        np.savez(f"{sys.argv[2]}.pipeline.{jax.process_index()}.npz", **piped)
        try:
            import grain  # noqa: F401
        except ImportError:  # Python 3.11: no Grain
            pass
        else:  # checkpointed, to be resumed by one process
            from_grain = run(sys.argv[1], int(sys.argv[3]), f"{sys.argv[4]}_grain", 0, grain=True)
            np.savez(f"{sys.argv[2]}.grain.{jax.process_index()}.npz", **from_grain)
    print("process", jax.process_index(), "of", jax.process_count(), "devices", jax.device_count())
