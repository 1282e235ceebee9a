"""Data-parallel linear regression: fit y = w * x + b on every device at once.

`init`, `loss_fn` and `update` are the one-device program. `strategy.step(update)`
splits each global batch over the devices and averages the gradients where the program
needs it, so `update` has no axis names and no `pmean`, and the learned `w` and `b` are
those of the same loop on one device.

    python examples/regression.py
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import spmdkit

LEARNING_RATE = 0.005


class Params(NamedTuple):
    weight: jnp.ndarray
    bias: jnp.ndarray


def init(rng) -> Params:
    weights_key, bias_key = jax.random.split(rng)
    return Params(jax.random.normal(weights_key, ()), jax.random.normal(bias_key, ()))


def loss_fn(params: Params, xs, ys):
    pred = params.weight * xs + params.bias
    return jnp.mean((pred - ys) ** 2)


def update(params: Params, batch) -> tuple[Params, jnp.ndarray]:
    """One SGD step on a batch {"x", "y"}."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch["x"], batch["y"])
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def make_data(n: int = 128, seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    xs = r.normal(size=(n, 1)).astype(np.float32)
    noise = 0.5 * r.normal(size=(n, 1)).astype(np.float32)
    return {"x": xs, "y": xs * 2 - 1 + noise}  # true w = 2, b = -1


def main(steps: int = 1000, strategy: spmdkit.Strategy | None = None, log_every: int = 0) -> Params:
    strategy = strategy or spmdkit.DataParallel()  # every device
    data = make_data()
    params = strategy.init(init, jax.random.key(123))
    step = strategy.step(update)
    for i in range(steps):
        # Block each step: XLA:CPU collectives can stall when many steps are queued.
        params, loss = jax.block_until_ready(step(params, data))
        if log_every and i % log_every == 0:
            print(f"step {i:4d}, loss {float(loss):.3f}")
    return jax.device_get(params)


if __name__ == "__main__":
    spmdkit.use_host_devices(8)
    params = main(log_every=100)
    print(f"w = {float(params.weight):.3f} (2), b = {float(params.bias):.3f} (-1)")
