"""A user's script for tests/test_agree.py, run under ``spmdkit launch -n 2``: processes that
give different init keys or global batches, each case caught in both processes (both raise at
the same point, so they stay in step). Process i writes what each case raised to the JSON file
named on the command line, suffixed ``.i``."""

from __future__ import annotations

import json
import sys

import numpy as np


def cases():
    import jax
    import jax.numpy as jnp

    import spmdkit

    me = jax.process_index()

    def make_state(key):
        return {"w": jax.random.normal(key, (8, 4))}

    def train_step(state, batch):
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(state["w"])
        return {"w": state["w"] - 0.1 * grad}, {"loss": loss}

    x = np.ones((16, 8), np.float32)
    data = spmdkit.DataParallel()
    same = data.init(make_state, jax.random.key(0))
    yield "same key and batch", lambda: data.step(train_step)(same, {"x": x})
    for name, strategy in (("data", data), ("sharded", spmdkit.Sharded(spmdkit.make_mesh(data=8), "dp")),
                           ("ensemble", spmdkit.Ensemble(8))):
        yield f"key {name}", lambda s=strategy: s.init(make_state, jax.random.key(me))
    yield "key as int seed", lambda: data.init(make_state, 3 + me)
    yield "rows", lambda: data.step(lambda s, b: train_step(s, b))(same, {"x": x if me == 0 else np.ones((24, 8), np.float32)})
    yield "dtype", lambda: data.evaluate(lambda s, b: b["x"].sum())(same, {"x": x.astype(np.float32 if me == 0 else np.float64)})
    yield "leaf", lambda: data.apply(lambda s, b: b["x"] @ s["w"])(same, {"x": x, **({"y": x} if me == 1 else {})})
    # fit draws each process's rows of every batch from its own copy of the arrays.
    import optax

    def fit_on(train, evaluate=None, width=1, lr=0.1, steps=1, checkpoint=None, step_timeout=None):
        task = spmdkit.Task(name="agree", init=lambda key: {"w": jnp.zeros((8, width))},
                            loss_fn=lambda p, b, rng: (jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), {}),
                            train_data=train, eval_data=evaluate)
        spmdkit.fit(task, data, optax.sgd(lr), spmdkit.TrainConfig(steps=steps, batch_size=16), out_dir=None,
                    progress=False, checkpoint=checkpoint, **({"step_timeout": step_timeout} if step_timeout else {}))

    xy = {"x": np.ones((32, 8), np.float32), "y": np.ones((32, 1), np.float32)}
    yield "fit same data", lambda: fit_on(xy, xy)
    # A pipeline yields each process's share of every batch (8 of 16 rows): the same one in both
    # trained on each example twice, silently. Rows all alike (ones) cannot tell, and pass.
    ramp = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    batches = [{"x": ramp[i:i + 8], "y": ramp[i:i + 8, :1]} for i in (0, 8)]
    yield "fit pipeline unsplit", lambda: fit_on(batches)
    yield "fit pipeline split", lambda: fit_on([batches[me], batches[1 - me]])
    yield "fit pipeline of ones", lambda: fit_on([{k: v[:8] for k, v in xy.items()}] * 2)
    yield "fit rows", lambda: fit_on({k: v[: 32 + 8 * me] for k, v in {k: np.ones((40, v.shape[1]), np.float32)
                                                                       for k, v in xy.items()}.items()})
    yield "fit eval values", lambda: fit_on(xy, {"x": xy["x"] + me, "y": xy["y"]})
    # Settings and models that differ: one process waited for ever in a collective the other never reached.
    yield "fit steps", lambda: fit_on(xy, steps=1 + me)
    yield "fit model", lambda: fit_on(xy, width=1 + me)
    yield "fit lr", lambda: fit_on(xy, lr=0.1 * (1 + me))
    # Beside this launch's own output (two pytest workers each launch this program at once).
    where = f"{sys.argv[1]}-{jax.process_index()}-unused"
    yield "fit resume", lambda: fit_on(xy, checkpoint=spmdkit.CheckpointConfig(where, resume=me == 0))
    yield "fit own timeout", lambda: fit_on(xy, step_timeout=100 + 50 * me)  # each process's watchdog: its own
    yield "fit checkpoint in one", lambda: fit_on(xy, checkpoint=spmdkit.CheckpointConfig(where) if me else None)
    # strategy.init with the user's own make_state of other shapes: its first step waited for ever.
    yield "init state", lambda: data.init(lambda key: {"w": jnp.zeros((8, 4 + me))}, 0)
    # Processes on different paths (one resumed, the other started afresh; one built a Checkpointer):
    # their checks met in one collective, one read the other's detail as its own (a TypeError, or
    # "rng differs"), or one waited for ever in Orbax's barrier.
    fresh = data.step(lambda s, b: train_step(s, b))  # a step not yet called: its first call compares
    yield "paths apart", lambda: data.init(make_state, jax.random.key(0)) if me == 0 else fresh(same, {"x": x})
    yield "checkpointer in one", lambda: (spmdkit.Checkpointer(spmdkit.CheckpointConfig(where + "-one")) if me == 0
                                          else data.init(make_state, jax.random.key(0)))
    yield "checkpointer keep", lambda: spmdkit.Checkpointer(spmdkit.CheckpointConfig(where + "-keep", keep=1 + 2 * me))
    # A process's own one-device strategy runs its own program: its keys and batches may differ.
    own = spmdkit.Single(jax.local_devices()[0])
    yield "own device", lambda: own.step(train_step)(own.init(make_state, me), {"x": x[: 8 + 8 * me]})
    # fit on a process's own device (a sweep split between processes): process 0 ran a second fit
    # alone, which waited for ever in a gather of --out's verdict that process 1 never reached.
    own_task = spmdkit.Task(name="own", init=lambda key: {"w": jnp.zeros((8, 1))},
                            loss_fn=lambda p, b, rng: (jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), {}), train_data=xy)
    from spmdkit._process import sync

    def own_fits():
        for run in range(2 - me):
            spmdkit.fit(own_task, own, optax.sgd(0.1), spmdkit.TrainConfig(steps=1, batch_size=16),
                        out_dir=where + f"-own-{run}", progress=False)
        # Then both together again: process 1 ending while process 0 still trained alone failed the
        # launch on a loaded machine (its exit does not wait for a peer's own program).
        sync("agree-own-fits", "after each process's own fits")

    yield "fit own device", own_fits


def run() -> dict[str, str | None]:
    import spmdkit

    out = {}
    for name, case in cases():
        try:
            case()
            out[name] = None
        except (spmdkit.ProcessMismatchError, spmdkit.CheckpointError, spmdkit.DataError) as e:
            out[name] = str(e)
    return out


if __name__ == "__main__":
    import spmdkit

    assert spmdkit.initialize(), "expected to run under spmdkit launch"
    import jax

    results = run()
    with open(f"{sys.argv[1]}.{jax.process_index()}", "w") as f:
        json.dump(results, f)
    print("process", jax.process_index(), "of", jax.process_count(), "devices", jax.device_count())
