"""A user's script for tests/test_step_multiprocess.py: own state, step and inference on three
strategies. Run under ``spmdkit launch`` it joins the job with ``spmdkit.initialize()``; imported,
it runs in the calling process. Process 0 writes the results to the .npz named on the command line."""

from __future__ import annotations

import sys

import numpy as np


def run():
    import jax
    import jax.numpy as jnp
    import optax

    import spmdkit
    from spmdkit._strategies._base import to_host

    tx = optax.sgd(0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    batch = {"x": x, "y": np.tanh(x[:, :4])}

    def make_state(key):
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 4)) * 0.3}
        return {"params": params, "opt": tx.init(params), "rng": jax.random.key_data(key)}

    def forward(params, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    def train_step(state, batch):
        key = jax.random.wrap_key_data(state["rng"])
        key, drop = jax.random.split(key)

        def loss_fn(params):
            h = jnp.tanh(batch["x"] @ params["w1"]) * jax.random.bernoulli(drop, 0.9, (batch["x"].shape[0], 16)) / 0.9
            return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "rng": jax.random.key_data(key)}
        return new, {"loss": loss}

    strategies = {
        "data": spmdkit.DataParallel(),
        "sharded": spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "fsdp+tp",
                                   state_axes={"w1": ("embed", "hidden"), "w2": ("hidden", None)}),
        "ensemble": spmdkit.Ensemble(8),
    }
    out = {}
    for name, strategy in strategies.items():
        state = strategy.init(make_state, jax.random.key(0))
        step = strategy.step(train_step)
        for n in (16, 16, 13):  # the last batch cannot split over 8 devices
            state, aux = step(state, {k: v[:n] for k, v in batch.items()})
            jax.block_until_ready(state)
        pred = strategy.apply(lambda s, b: forward(s["params"], b["x"]))(state, {"x": x[:5]})
        out[f"{name}/w1"] = to_host(state["params"]["w1"])
        out[f"{name}/loss"] = np.asarray(aux["loss"])
        out[f"{name}/pred"] = np.asarray(pred)
    return out


if __name__ == "__main__":
    import spmdkit

    assert spmdkit.initialize(), "expected to run under spmdkit launch"
    import jax

    results = run()
    if jax.process_index() == 0:
        np.savez(sys.argv[1], **results)
    print("process", jax.process_index(), "of", jax.process_count(), "devices", jax.device_count())
