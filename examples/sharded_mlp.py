"""A model-parallel MLP on a 2x4 device mesh, its inference, and a checkpoint restored on another mesh.

The model says how its parameters split, in mesh axis names: `W1` by columns over
"model", `W2` by rows, and its activations are constrained to ("data", "model"). The
train step and the inference function are the one-device code. `spmdkit.Sharded` lays
the state out from an abstract init (the model is never whole on one device), compiles
the step with those layouts, and tells a checkpoint where each array goes on a
different mesh.

    python examples/sharded_mlp.py
"""

from __future__ import annotations

import functools
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import PartitionSpec

import spmdkit


class DotReluDot(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        W1 = self.param("W1", nn.with_partitioning(nn.initializers.xavier_normal(), (None, "model")),
                        (x.shape[-1], self.depth))
        y = jax.nn.relu(jnp.dot(x, W1))
        # Optional: pins the layout the compiler would likely choose anyway.
        y = jax.lax.with_sharding_constraint(y, PartitionSpec("data", "model"))
        W2 = self.param("W2", nn.with_partitioning(nn.initializers.xavier_normal(), ("model", None)),
                        (self.depth, x.shape[-1]))
        z = jax.lax.with_sharding_constraint(jnp.dot(y, W2), PartitionSpec("data", None))
        return z, None  # (carry, output): the form nn.scan expects


class MLP(nn.Module):
    num_layers: int
    depth: int

    @nn.compact
    def __call__(self, x):
        # The stacked layer axis is not split: PARTITION_NAME None.
        x, _ = nn.scan(DotReluDot, length=self.num_layers, variable_axes={"params": 0},
                       split_rngs={"params": True}, metadata_params={nn.PARTITION_NAME: None})(self.depth)(x)
        return x


def init_fn(k, x, model, optimizer):
    variables = model.init(k, x)
    return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optimizer)


def make_train_step(model):
    def train_step(state, x):
        def loss_unrolled(params):  # a stand-in loss
            return model.apply({"params": params}, x).sum()

        grads = jax.grad(loss_unrolled)(state.params)
        return state.apply_gradients(grads=grads)

    return train_step


def apply_fn(state, x):
    return state.apply_fn({"params": state.params}, x)


def main(batch: int = 8, layers: int = 4, depth: int = 256, steps: int = 3, workdir: str | None = None,
         devices=None) -> dict[str, object]:
    devices = devices or jax.devices()
    model = MLP(layers, depth)
    optimizer = optax.adam(learning_rate=0.001)
    x = jnp.ones((batch, depth))
    make_state = functools.partial(init_fn, x=x, model=model, optimizer=optimizer)

    # Mesh axes the model names; the batch ("batch", the examples axis) goes over "data".
    mesh = spmdkit.make_mesh(data=2, model=-1, devices=devices)
    strategy = spmdkit.Sharded(mesh, {"batch": "data"})
    state = strategy.init(make_state, jax.random.key(0))
    step = strategy.step(lambda state, x: (make_train_step(model)(state, x), {}))
    for _ in range(steps):
        state, _ = jax.block_until_ready(step(state, x))
    y = strategy.apply(apply_fn)(state, x)

    # Save, then restore onto another mesh: the target is the abstract state with the
    # new strategy's layouts.
    workdir = workdir or tempfile.mkdtemp()
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(workdir))
    ckpt.save(steps, state, {"note": "sharded MLP"})
    ckpt.close()
    other = spmdkit.Sharded(spmdkit.make_mesh(data=1, model=len(devices) // 2, devices=devices[: len(devices) // 2]),
                            {"batch": "data"})
    restored, _ = ckpt.restore(steps, other.abstract(make_state))
    y_restored = other.apply(apply_fn)(restored, x)
    return {"state": state, "y": np.asarray(y), "restored": restored, "y_restored": np.asarray(y_restored),
            "make_state": make_state, "train_step": make_train_step(model), "x": x}


if __name__ == "__main__":
    spmdkit.use_host_devices(8)
    out = main()
    w1 = out["state"].params["ScanDotReluDot_0"]["W1"].value  # a Flax Partitioned box, as make_state returned it
    print("W1", w1.shape, "split as", w1.sharding.spec, "- one device holds", w1.addressable_shards[0].data.shape)
    w1 = out["restored"].params["ScanDotReluDot_0"]["W1"].value
    print("restored on", dict(w1.sharding.mesh.shape), "as", w1.sharding.spec)
    print("outputs agree after the restore:", np.allclose(out["y"], out["y_restored"]))
