"""Seed 003's DotReluDot MLP with logical axis names, learning a fixed teacher network.

Parameters are annotated with logical names (``embed``, ``hidden``, and ``layer`` for
the scanned stack) and activations are constrained to ``(batch, hidden)`` and
``(batch, embed)``; a rules table decides which of them are split over the mesh.
The target is a real regression problem: the outputs of a fixed random one-layer
DotReluDot "teacher", normalised to unit variance.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spmdkit._tasks._base import Task

DEFAULTS = {"optimizer": "adam", "lr": 1e-3, "steps": 200, "batch_size": 64}


class DotReluDot(nn.Module):
    """``relu(x @ W1) @ W2`` with W1 ``(embed, hidden)`` and W2 ``(hidden, embed)``."""

    depth: int

    @nn.compact
    def __call__(self, x, _=None):
        w1 = self.param("W1", nn.with_logical_partitioning(nn.initializers.xavier_normal(), ("embed", "hidden")),
                        (x.shape[-1], self.depth))
        y = jax.nn.relu(x @ w1)
        y = nn.with_logical_constraint(y, ("batch", "hidden"))
        w2 = self.param("W2", nn.with_logical_partitioning(nn.initializers.xavier_normal(), ("hidden", "embed")),
                        (self.depth, x.shape[-1]))
        z = nn.with_logical_constraint(y @ w2, ("batch", "embed"))
        return z, None


class MLP(nn.Module):
    """``num_layers`` DotReluDot layers, as one ``nn.scan`` or as a Python loop."""

    num_layers: int
    depth: int
    use_scan: bool

    @nn.compact
    def __call__(self, x):
        if self.use_scan:
            x, _ = nn.scan(
                DotReluDot,
                length=self.num_layers,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={nn.PARTITION_NAME: "layer"},
            )(self.depth)(x, None)
        else:
            for _ in range(self.num_layers):
                x, _ = DotReluDot(self.depth)(x)
        return x


def scan_to_loop_params(params: dict, num_layers: int) -> dict:
    """The scanned stack's parameters as the loop version's ``DotReluDot_i`` entries."""
    stacked = params["ScanDotReluDot_0"]
    return {f"DotReluDot_{i}": jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)}


def teacher_data(n: int, embed: int, depth: int, seed: int) -> dict[str, np.ndarray]:
    """Inputs ~ N(0, 1) and a fixed random one-layer teacher's outputs (unit variance)."""
    weights = np.random.default_rng(1234)
    w1 = weights.standard_normal((embed, depth)) * np.sqrt(2.0 / embed)
    w2 = weights.standard_normal((depth, embed)) * np.sqrt(1.0 / depth)
    x = np.random.default_rng(seed).standard_normal((n, embed))
    y = np.maximum(x @ w1, 0) @ w2
    y = (y - y.mean(0)) / y.std(0)
    return {"x": x.astype(np.float32), "y": y.astype(np.float32)}


def make(
    data_dir: str | None = None,
    layers: int = 4,
    depth: int = 512,
    embed: int = 128,
    scan: bool = True,
    num_train: int = 4096,
    num_eval: int = 512,
) -> Task:
    model = MLP(num_layers=layers, depth=depth, use_scan=scan)

    def init(rng):
        return model.init(rng, jnp.zeros((1, embed), jnp.float32))["params"]

    def loss_fn(params, batch, rng):
        pred = model.apply({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2), {}

    return Task(
        name="mlp",
        init=init,
        loss_fn=loss_fn,
        train_data=teacher_data(num_train, embed, depth, seed=0),
        eval_data=teacher_data(num_eval, embed, depth, seed=1),
        defaults=DEFAULTS,
    )
