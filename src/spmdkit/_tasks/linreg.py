"""Seed 002: learn y = 2x - 1 from noisy samples."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit._tasks._base import Task

TRUE_W, TRUE_B, NOISE = 2.0, -1.0, 0.5


def _samples(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1)).astype(np.float32)
    y = (TRUE_W * x + TRUE_B + NOISE * rng.normal(size=(n, 1))).astype(np.float32)
    return {"x": x, "y": y}


def init(rng: jax.Array) -> dict[str, jax.Array]:
    """The seed's init: weight and bias drawn from a standard normal."""
    wk, bk = jax.random.split(rng)
    return {"weight": jax.random.normal(wk, ()), "bias": jax.random.normal(bk, ())}


def loss_fn(params, batch, rng):
    """Least squares error of ``weight * x + bias`` against ``y``."""
    pred = params["weight"] * batch["x"] + params["bias"]
    return jnp.mean((pred - batch["y"]) ** 2), {}


DEFAULTS = {"optimizer": "sgd", "lr": 0.005, "steps": 1000, "batch_size": 128}


def make(data_dir: str | None = None, num_points: int = 128, data_seed: int = 0) -> Task:
    """128 training points (the seed's), 128 held-out points from the same line."""
    return Task(
        name="linreg",
        init=init,
        loss_fn=loss_fn,
        train_data=_samples(num_points, data_seed),
        eval_data=_samples(num_points, data_seed + 1),
        report=lambda p: {"w": float(p["weight"]), "b": float(p["bias"])},
        # The seed's (and the JAX tutorial's) full-batch SGD at learning rate 0.005.
        defaults={**DEFAULTS, "batch_size": num_points},
    )
