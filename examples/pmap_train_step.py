"""A data-parallel train step, two ways: by hand with `spmdkit.pmap`, and with `strategy.step`.

By hand, as with `jax.pmap`: the parameters are broadcast to every device, the batch is
split, and the gradients (and the loss, for logging) are averaged across devices with
`pmean`. Without that `pmean` every device would update its own copy and they would
drift apart.

With `spmdkit.DataParallel().step(train_step)` the step stays the one-device function:
no axis name, no `pmean`, the global batch goes in, and the result is what the same
step computes on one device.

    python examples/pmap_train_step.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import spmdkit

LEARNING_RATE = 0.01


def train_step(params, batch_x, batch_y):
    """One SGD step of least squares, written for one device."""

    def loss_fn(p):
        return jnp.mean((batch_x @ p - batch_y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return params - LEARNING_RATE * grads, loss


def pmapped_step(params, batch_x, batch_y):
    """The same step for `spmdkit.pmap`: each device sees its slice of the batch."""

    def loss_fn(p):
        return jnp.mean((batch_x @ p - batch_y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = jax.lax.pmean(grads, axis_name="devices")  # equal slices: the mean of means is the mean
    loss = jax.lax.pmean(loss, axis_name="devices")
    return params - LEARNING_RATE * grads, loss


def make_data(batch: int = 128, features: int = 8, seed: int = 0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(batch, features)).astype(np.float32)
    true_w = r.normal(size=(features,)).astype(np.float32)
    return x, (x @ true_w + 0.1 * r.normal(size=batch)).astype(np.float32)


def main(steps: int = 100, n_devices: int | None = None) -> dict[str, np.ndarray]:
    n = n_devices or jax.local_device_count()
    x, y = make_data()
    params = jnp.zeros(x.shape[1])

    # 1. By hand: split the batch into [n, B/n, ...] (a mapped size of n uses n devices);
    #    in_axes=None broadcasts the parameters, out_axes=None returns the one copy every
    #    device holds after the pmean.
    step = spmdkit.pmap(pmapped_step, axis_name="devices", in_axes=(None, 0, 0), out_axes=None)
    xs, ys = x.reshape(n, -1, x.shape[1]), y.reshape(n, -1)
    by_hand = params
    for _ in range(steps):
        by_hand, loss = jax.block_until_ready(step(by_hand, xs, ys))  # CPU collectives: sync each step

    # 2. The step transform: the one-device step, the global batch, nothing else.
    strategy = spmdkit.DataParallel(spmdkit.make_mesh(data=n, devices=jax.devices()[:n]))
    dp_step = strategy.step(lambda p, batch: train_step(p, batch["x"], batch["y"]))
    transformed = strategy.init(lambda rng: params, jax.random.key(0))
    for _ in range(steps):
        transformed, dp_loss = jax.block_until_ready(dp_step(transformed, {"x": x, "y": y}))

    return {"by_hand": np.asarray(by_hand), "transformed": np.asarray(transformed),
            "loss": float(loss), "dp_loss": float(dp_loss)}


if __name__ == "__main__":
    spmdkit.use_host_devices(8)
    out = main()
    print(f"loss after 100 steps: by hand {out['loss']:.4f}, strategy.step {out['dp_loss']:.4f}")
    print("largest difference between the two:", float(np.abs(out["by_hand"] - out["transformed"]).max()))
