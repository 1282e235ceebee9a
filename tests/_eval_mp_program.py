"""A program for tests/test_data_eval.py: evaluation from an on-disk eval set and from a
pipeline of each process's share, and fit's eval from the directory.

Under ``spmdkit launch`` the rows of the eval set each process read are recorded
(``take_rows`` wrapped) and written with the means. Imported, it runs in the calling
process. Arguments: EVAL_DIR OUT (writes OUT.<process>.npz).
"""

from __future__ import annotations

import sys

import numpy as np

ROWS = 45  # chunks of 16 on 8 devices: 16, 16, 8 and a tail of 5 rows


def eval_arrays():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :2]).astype(np.float32)}


def init(key):
    import jax

    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (4, 8)) * 0.5, "w2": jax.random.normal(k2, (8, 2)) * 0.5}


def predict(params, x):
    import jax.numpy as jnp

    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def task(eval_data, train=False):
    import jax.numpy as jnp

    import spmdkit

    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    return spmdkit.Task(name="mp-eval", init=init,
                        loss_fn=lambda p, b, rng: (jnp.mean((predict(p, b["x"]) - b["y"]) ** 2), {}),
                        train_data={"x": x, "y": np.sin(x[:, :2])}, eval_data=eval_data)


def state(strategy=None):
    import jax
    import jax.numpy as jnp

    import spmdkit

    strategy = strategy or spmdkit.DataParallel()
    return strategy.init(lambda key: spmdkit.TrainState(jnp.zeros((), jnp.int32), init(key), None), jax.random.key(0))


def share():
    """This process's rows of the eval set as batches of 8: uneven shares in two processes
    (23 and 22 rows: last batches of 7 and 6), what a pipeline sharded by process yields."""
    import jax

    arrays, p, count = eval_arrays(), jax.process_index(), jax.process_count()
    lo, hi = (0, ROWS) if count == 1 else ((0, 23), (23, ROWS))[p]
    return [{k: v[i:min(i + 8, hi)] for k, v in arrays.items()} for i in range(lo, hi, 8)]


def run(eval_dir):
    import jax
    import optax

    import spmdkit
    from spmdkit._data import _feed
    from spmdkit._train import evaluate_task
    from spmdkit._train._steps import task_eval_step

    strategy = spmdkit.DataParallel()
    s = state(strategy)
    reads = []
    plain = _feed.take_rows
    _feed.take_rows = lambda x, idx: (reads.append(np.array(idx)), plain(x, idx))[1]
    try:
        t = task(eval_dir)
        step = strategy.evaluate(task_eval_step(t, jax.random.key(0)))
        array_loss = evaluate_task(s, t.eval_data, 16, step)["loss"]
    finally:
        _feed.take_rows = plain
    pipeline_loss = evaluate_task(s, share(), 16, step)["loss"]
    fit = spmdkit.fit(task(eval_dir, train=True), strategy, optax.sgd(0.1),
                      spmdkit.TrainConfig(steps=2, batch_size=16, eval_batch_size=16), progress=False,
                      log=lambda m: None)
    rows = np.concatenate(reads[::2]) if reads else np.zeros(0, int)  # two leaves read the same rows
    return {"array_loss": np.asarray(array_loss), "pipeline_loss": np.asarray(pipeline_loss),
            "fit_eval_loss": np.asarray(fit.summary["eval_loss"]), "reads": rows}


if __name__ == "__main__":
    import spmdkit

    assert spmdkit.initialize(), "expected to run under spmdkit launch"
    import jax

    np.savez(f"{sys.argv[2]}.{jax.process_index()}.npz", **run(sys.argv[1]))
    print("process", jax.process_index(), "of", jax.process_count(), "devices", jax.device_count())
