"""A program for tests/test_watchdog.py: fit with an eval slower than the step timeout.

Every eval reads 24 batches of each process's rows, 0.25 s apart (a slow reader), so one
eval takes ~6 s against a step timeout of 3 s, while each chunk finishes on time. Under
``spmdkit launch``; prints the status and eval loss. Argument: the step timeout in seconds.
"""

from __future__ import annotations

import sys
import time

import numpy as np


class SlowEval:
    """A re-iterable eval pipeline: each process's share, batch by batch, slowly."""

    def __iter__(self):
        import jax

        rng = np.random.default_rng(jax.process_index())
        for _ in range(24):
            time.sleep(0.25)
            x = rng.normal(size=(8, 3)).astype(np.float32)
            yield {"x": x, "y": x.sum(1, keepdims=True)}


if __name__ == "__main__":
    import spmdkit

    assert spmdkit.initialize(), "expected to run under spmdkit launch"
    import jax
    import jax.numpy as jnp
    import optax

    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    task = spmdkit.Task(name="slow-eval", init=lambda k: {"w": jnp.zeros((3, 1))},
                        loss_fn=lambda p, b, rng: (jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), {}),
                        train_data={"x": x, "y": x.sum(1, keepdims=True)}, eval_data=SlowEval())
    result = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.1),
                         spmdkit.TrainConfig(steps=4, batch_size=8, eval_every=2), progress=False,
                         step_timeout=float(sys.argv[1]), log=lambda m: None)
    print("status", result.summary["status"], "evals", sum(r["split"] == "eval" for r in result.history))
    print("process", jax.process_index(), "of", jax.process_count(), "devices", jax.device_count())
