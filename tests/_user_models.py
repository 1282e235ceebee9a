"""A zoo of user models, written the way a Flax/JAX user writes them for one device.

Each model is three plain functions and nothing spmdkit-specific:

    make_state(rng) -> state            any pytree (TrainState subclass, NNX state, dicts)
    train_step(state, batch) -> (state, aux)
    predict(state, batch) -> per-example outputs [B, ...]

plus a batch maker and the logical rules a user would pass to ``Sharded``. The
tests run them with plain ``jax.jit`` on one device (the reference) and through
every strategy, which must give the same numbers.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P


def _cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _images(seed: int, size: int, hw: int = 8, classes: int = 4) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"image": r.normal(size=(size, hw, hw, 1)).astype(np.float32),
            "label": r.integers(0, classes, size=size).astype(np.int32)}


def _vectors(seed: int, size: int, features: int = 16, classes: int = 4) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"x": r.normal(size=(size, features)).astype(np.float32),
            "label": r.integers(0, classes, size=size).astype(np.int32)}


# ---- (a) a BatchNorm CNN; the running statistics live in a TrainState subclass ----------


class BNCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = x.mean(axis=(1, 2))
        return nn.Dense(4)(x)


class BNTrainState(train_state.TrainState):
    batch_stats: Any


def bn_make_state(rng):
    model = BNCNN()
    variables = model.init(rng, jnp.ones((1, 8, 8, 1)), train=False)
    return BNTrainState.create(apply_fn=model.apply, params=variables["params"],
                               batch_stats=variables["batch_stats"], tx=optax.sgd(0.1, momentum=0.9))


def bn_train_step(state, batch):
    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                         batch["image"], train=True, mutable=["batch_stats"])
        return _cross_entropy(logits, batch["label"]), (logits, updates)

    (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return state, {"loss": loss, "accuracy": accuracy}


def bn_predict(state, batch):
    return state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, batch["image"], train=False)


# ---- (b) a Dropout MLP; the dropout key is part of the state, folded with the step --------


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(4)(x)


class DropoutTrainState(train_state.TrainState):
    key: jax.Array


dropout_tx = optax.sgd(0.1, momentum=0.9)


def dropout_make_state(rng):
    params_key, dropout_key = jax.random.split(rng)
    model = DropoutMLP()
    params = model.init(params_key, jnp.ones((1, 16)), train=False)["params"]
    return DropoutTrainState.create(apply_fn=model.apply, params=params, key=dropout_key, tx=dropout_tx)


def dropout_train_step(state, batch):
    # A new mask every step, and the same masks however the batch is split.
    dropout_key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"], train=True, rngs={"dropout": dropout_key})
        return _cross_entropy(logits, batch["label"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def dropout_predict(state, batch):
    return state.apply_fn({"params": state.params}, batch["x"], train=False)


# ---- (c) a custom step: two parameter groups, two optimizers, and an EMA copy ----------


two_opt_encoder_tx = optax.adam(1e-2)
two_opt_head_tx = optax.sgd(0.1, momentum=0.9)


def _dense_init(key, n_in, n_out):
    return {"w": jax.random.normal(key, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.zeros((n_out,))}


def two_opt_make_state(rng):
    k1, k2 = jax.random.split(rng)
    params = {"encoder": _dense_init(k1, 16, 32), "head": _dense_init(k2, 32, 4)}
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "ema": params,
        "encoder_opt": two_opt_encoder_tx.init(params["encoder"]),
        "head_opt": two_opt_head_tx.init(params["head"]),
    }


# Plain arrays carry no names: the user gives them, shaped like the params.
TWO_OPT_AXES = {"encoder": {"w": ("embed", "hidden"), "b": ("hidden",)}, "head": {"w": ("hidden", None), "b": (None,)}}


def _two_opt_forward(params, x):
    h = jnp.tanh(x @ params["encoder"]["w"] + params["encoder"]["b"])
    return h @ params["head"]["w"] + params["head"]["b"]


def two_opt_train_step(state, batch):
    params = state["params"]
    loss, grads = jax.value_and_grad(lambda p: _cross_entropy(_two_opt_forward(p, batch["x"]), batch["label"]))(params)
    enc_updates, encoder_opt = two_opt_encoder_tx.update(grads["encoder"], state["encoder_opt"], params["encoder"])
    head_updates, head_opt = two_opt_head_tx.update(grads["head"], state["head_opt"], params["head"])
    params = {"encoder": optax.apply_updates(params["encoder"], enc_updates),
              "head": optax.apply_updates(params["head"], head_updates)}
    ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state["ema"], params)
    new = {"step": state["step"] + 1, "params": params, "ema": ema, "encoder_opt": encoder_opt, "head_opt": head_opt}
    return new, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def two_opt_predict(state, batch):
    return _two_opt_forward(state["ema"], batch["x"])


# ---- (d) NNX: Dropout + BatchNorm, trained functionally through nnx.split / nnx.merge ----


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.linear1 = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, ("embed", "hidden")), rngs=rngs)
        self.bn = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.linear2 = nnx.Linear(32, 4, kernel_init=nnx.with_partitioning(init, ("hidden", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.bn(self.linear1(x)))))


nnx_tx = optax.sgd(0.1, momentum=0.9)


def _nnx_build(rng):
    # The kernels carry sharding names; no mesh exists yet, so place nothing eagerly.
    with nnx.use_eager_sharding(False):
        return NNXNet(nnx.Rngs(rng))


nnx_graphdef = nnx.graphdef(nnx.eval_shape(lambda: _nnx_build(jax.random.key(0))))


def nnx_make_state(rng):
    _, params, rest = nnx.split(_nnx_build(rng), nnx.Param, ...)
    return {"params": params, "rest": rest, "opt_state": nnx_tx.init(params)}


def nnx_train_step(state, batch):
    def loss_fn(params, rest):
        # copy=True: fresh Variables owned by this trace, so BatchNorm may update them.
        model = nnx.merge(nnx_graphdef, params, rest, copy=True)
        model.train()
        logits = model(batch["x"])
        _, _, rest = nnx.split(model, nnx.Param, ...)  # updated batch statistics and rng counts
        return _cross_entropy(logits, batch["label"]), rest

    # Only the parameters are differentiated (the rng counters are integers).
    (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], state["rest"])
    updates, opt_state = nnx_tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "rest": rest, "opt_state": opt_state}, {"loss": loss}


def nnx_predict(state, batch):
    model = nnx.merge(nnx_graphdef, state["params"], state["rest"])
    model.eval()
    return model(batch["x"])


# ---- (e) the MLPs of Flax's pjit guide: mesh axes, logical axes, nn.scan with metadata ----


class DotReluDot(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        W1 = self.param("W1", nn.with_partitioning(nn.initializers.xavier_normal(), (None, "model")),
                        (x.shape[-1], self.depth))
        y = jax.nn.relu(jnp.dot(x, W1))
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        W2 = self.param("W2", nn.with_partitioning(nn.initializers.xavier_normal(), ("model", None)),
                        (self.depth, x.shape[-1]))
        z = jnp.dot(y, W2)
        z = jax.lax.with_sharding_constraint(z, P("data", None))
        return z, None


class LogicalDotReluDot(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        W1 = self.param("W1", nn.with_logical_partitioning(nn.initializers.xavier_normal(), ("embed", "hidden")),
                        (x.shape[-1], self.depth))
        y = jax.nn.relu(jnp.dot(x, W1))
        y = nn.with_logical_constraint(y, ("batch", "hidden"))
        W2 = self.param("W2", nn.with_logical_partitioning(nn.initializers.xavier_normal(), ("hidden", "embed")),
                        (self.depth, x.shape[-1]))
        z = jnp.dot(y, W2)
        z = nn.with_logical_constraint(z, ("batch", "embed"))
        return z, None


class MLP(nn.Module):
    num_layers: int
    depth: int
    use_scan: bool
    logical: bool = False

    @nn.compact
    def __call__(self, x):
        layer = LogicalDotReluDot if self.logical else DotReluDot
        if self.use_scan:
            x, _ = nn.scan(layer, length=self.num_layers, variable_axes={"params": 0},
                           split_rngs={"params": True},
                           metadata_params={nn.PARTITION_NAME: "layer" if self.logical else None})(self.depth)(x)
        else:
            for _ in range(self.num_layers):
                x, _ = layer(self.depth)(x)
        return x


PJIT_RULES = (("batch", "data"), ("hidden", "model"), ("embed", None), ("layer", None))


def _pjit_model(logical: bool):
    model = MLP(num_layers=2, depth=32, use_scan=True, logical=logical)
    optimizer = optax.adam(learning_rate=0.001)

    def make_state(rng):
        variables = model.init(rng, jnp.ones((8, 16)))
        return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optimizer)

    def train_step(state, batch):
        def loss_unrolled(params):  # the guide's stand-in loss
            return model.apply({"params": params}, batch["x"]).sum()

        loss, grads = jax.value_and_grad(loss_unrolled)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    def predict(state, batch):
        return state.apply_fn({"params": state.params}, batch["x"])

    return make_state, train_step, predict


# ---- (f) a byte-level decoder-only transformer LM: examples/transformer_lm.py -----------

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from transformer_lm import LM_RULES, LMConfig, lm_batch, lm_functions  # noqa: E402

LM_CONFIG = LMConfig(embed=16, heads=4, kv=4, mlp=32, layers=2, length=8)  # tiny: compile time


# ---- the registry the tests iterate over -------------------------------------------------


class UserModel(NamedTuple):
    name: str
    make_state: Callable[[jax.Array], Any]
    train_step: Callable[[Any, Any], tuple[Any, Any]]
    predict: Callable[[Any, Any], Any]
    batch: Callable[[int, int], dict]  # (seed, size) -> a global batch of numpy arrays
    rules: tuple  # Flax-format logical rules for Sharded
    needs_mesh: bool = False  # its code names mesh axes, so even the reference runs under a mesh
    state_axes: Any = None  # logical names of plain arrays, for Sharded (params-shaped)
    # Adam divides by a running RMS, turning rounding-level gradient differences of
    # near-zero components into updates of up to ~lr; SGD agrees to float rounding.
    atol: float = 1e-5


_pjit_direct = _pjit_model(logical=False)
_pjit_logical = _pjit_model(logical=True)
_lm = lm_functions(LM_CONFIG)

ZOO: dict[str, UserModel] = {m.name: m for m in [
    UserModel("batchnorm_cnn", bn_make_state, bn_train_step, bn_predict, _images,
              rules=(("batch", "data"),)),
    UserModel("dropout_mlp", dropout_make_state, dropout_train_step, dropout_predict, _vectors,
              rules=(("batch", "data"),)),
    UserModel("two_optimizers", two_opt_make_state, two_opt_train_step, two_opt_predict, _vectors,
              rules=(("batch", "data"), ("embed", None), ("hidden", "model")), state_axes=TWO_OPT_AXES,
              atol=1e-4),  # Adam on the encoder, see above
    UserModel("nnx_dropout_batchnorm", nnx_make_state, nnx_train_step, nnx_predict, _vectors,
              rules=(("batch", "data"), ("embed", None), ("hidden", "model"))),
    UserModel("pjit_mlp", *_pjit_direct, _vectors,
              rules=PJIT_RULES, needs_mesh=True, atol=1e-4),
    UserModel("pjit_logical_mlp", *_pjit_logical, _vectors,
              rules=PJIT_RULES, atol=1e-4),
    UserModel("transformer_lm", *_lm, functools.partial(lm_batch, cfg=LM_CONFIG), rules=LM_RULES, atol=1e-4),
]}


def one_device_mesh():
    """A 1x1 ``data x model`` mesh: what code that names mesh axes needs even on one device."""
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def reference_context(model: UserModel):
    """What a user's one-device run needs around it: a 1x1 mesh if the code names mesh axes."""
    return jax.set_mesh(one_device_mesh()) if model.needs_mesh else contextlib.nullcontext()


def reference_run(model: UserModel, steps: int, batch_size: int, key: jax.Array | None = None):
    """Plain ``jax.jit`` on one device: init from ``key`` (default key 0), ``steps`` train
    steps, then predict. jit's cache is per function, so repeated runs compile once."""
    with reference_context(model):
        state = jax.jit(model.make_state)(jax.random.key(0) if key is None else key)
        step = jax.jit(model.train_step)
        auxes = []
        for i in range(steps):
            state, aux = step(state, model.batch(100 + i, batch_size))
            auxes.append(jax.block_until_ready(aux))
        out = jax.jit(model.predict)(state, model.batch(999, batch_size))
    return state, auxes, out


class Lookup(nn.Module):
    """An embedding lookup whose activation names the batch axis, as a transformer's does (the
    gather whose gradient XLA:CPU got wrong when a constraint split its rows unevenly)."""

    @nn.compact
    def __call__(self, tok):
        emb = self.param("emb", nn.with_logical_partitioning(nn.initializers.normal(0.1), ("vocab", "embed")),
                         (16, 8))
        x = nn.with_logical_constraint(emb[tok], ("batch", "length", "embed"))
        return jnp.einsum("bld,vd->blv", jnp.sin(x), emb)

