"""A byte-level transformer language model trained with FSDP + tensor parallelism on a 2x4 mesh.

Every parameter and activation names its axes logically (batch, length, embed, heads,
kv, mlp, vocab, layers); the layers are one `nn.scan`. The rules table below is the
whole parallelism plan: `embed` over "data" shards every weight FSDP-style, `heads`,
`mlp` and `vocab` over "model" split the matrix products tensor-parallel, the batch goes
over "data". Another plan is another table; the model does not change. The train step
is the one-device step, with a token-weighted loss (padding tokens weigh 0), and gives
the one-device numbers.

    python examples/transformer_lm.py
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import spmdkit


class LMConfig(NamedTuple):
    vocab: int = 256
    embed: int = 32
    heads: int = 4
    kv: int = 8
    mlp: int = 64
    layers: int = 2
    length: int = 16


def _param(init, names):
    return nn.with_logical_partitioning(init, names)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", _param(nn.initializers.ones, ("embed",)), (x.shape[-1],))
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return x * scale


class Block(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x, _):
        cfg = self.cfg
        dense = nn.initializers.normal(0.02)
        h = RMSNorm(name="attn_norm")(x)
        # Projections as explicit [embed, heads, kv] weights (nn.DenseGeneral flattens its
        # kernel at init, which a 3-name logical annotation cannot describe).
        qkv = [self.param(name, _param(dense, ("embed", "heads", "kv")), (cfg.embed, cfg.heads, cfg.kv))
               for name in ("query", "key", "value")]
        q, k, v = (jnp.einsum("ble,ehd->blhd", h, w) for w in qkv)
        q, k, v = (nn.with_logical_constraint(t, ("batch", "length", "heads", "kv")) for t in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.kv)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        attn = nn.with_logical_constraint(attn, ("batch", "length", "heads", "kv"))
        w_out = self.param("out", _param(dense, ("heads", "kv", "embed")), (cfg.heads, cfg.kv, cfg.embed))
        out = jnp.einsum("blhd,hde->ble", attn, w_out)
        x = nn.with_logical_constraint(x + out, ("batch", "length", "embed"))
        h = RMSNorm(name="mlp_norm")(x)
        h = nn.Dense(cfg.mlp, kernel_init=_param(dense, ("embed", "mlp")), use_bias=False, name="wi")(h)
        h = nn.with_logical_constraint(jax.nn.gelu(h), ("batch", "length", "mlp"))
        h = nn.Dense(cfg.embed, kernel_init=_param(dense, ("mlp", "embed")), use_bias=False, name="wo")(h)
        return nn.with_logical_constraint(x + h, ("batch", "length", "embed")), None


class TransformerLM(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.embed, name="embed",
                         embedding_init=_param(nn.initializers.normal(cfg.embed ** -0.5), ("vocab", "embed")))
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        x, _ = nn.scan(Block, length=cfg.layers, variable_axes={"params": 0}, split_rngs={"params": True},
                       metadata_params={nn.PARTITION_NAME: "layers"})(cfg, name="layers")(x, None)
        x = RMSNorm(name="final_norm")(x)
        logits = embed.attend(x)  # tied input/output embedding
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


# batch over data; the other names split parameters FSDP-style (embed over data) and
# tensor-parallel (heads, mlp, vocab over model). Flax skips a mesh axis already taken,
# so an activation ("batch", "length", "embed") is split by batch only.
LM_RULES = (("batch", "data"), ("embed", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model"),
            ("kv", None), ("length", None), ("layers", None))

LM_TEXT = (b"spmdkit runs a step written for one device on many devices; "
           b"the numbers do not change with the device count. ") * 4


def lm_batch(seed: int, size: int, cfg: LMConfig = LMConfig()) -> dict[str, np.ndarray]:
    """Windows of bytes; ``weights`` zeroes a random tail of each row (ragged documents)."""
    r = np.random.default_rng(seed)
    data = np.frombuffer(LM_TEXT, np.uint8).astype(np.int32)
    starts = r.integers(0, len(data) - cfg.length - 1, size=size)
    window = np.stack([data[s:s + cfg.length + 1] for s in starts])
    lengths = r.integers(cfg.length // 2, cfg.length + 1, size=size)
    weights = (np.arange(cfg.length)[None, :] < lengths[:, None]).astype(np.float32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:], "weights": weights}


def lm_functions(cfg: LMConfig = LMConfig(), tx: optax.GradientTransformation | None = None):
    model = TransformerLM(cfg)
    tx = tx or optax.adamw(3e-3, weight_decay=0.01)

    def make_state(rng):
        params = model.init(rng, jnp.zeros((1, cfg.length), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["inputs"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            # A token-weighted mean: normalised by a count taken from the batch itself.
            return jnp.sum(losses * batch["weights"]) / jnp.sum(batch["weights"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    def predict(state, batch):
        logits = state.apply_fn({"params": state.params}, batch["inputs"])
        return jnp.argmax(logits, -1)

    return make_state, train_step, predict


def main(steps: int = 200, strategy: spmdkit.Strategy | None = None, batch_size: int = 16,
         cfg: LMConfig = LMConfig(), log_every: int = 0) -> dict[str, object]:
    if strategy is None:
        strategy = spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), LM_RULES)
    make_state, train_step, predict = lm_functions(cfg)
    state = strategy.init(make_state, jax.random.key(0))
    step = strategy.step(train_step)
    losses = []
    for i in range(steps):
        state, aux = step(state, lm_batch(i, batch_size, cfg))
        losses.append(float(aux["loss"]))  # also waits for the step (XLA:CPU collectives)
        if log_every and i % log_every == 0:
            print(f"step {i:4d}  loss {losses[-1]:.3f}")
    prompt = lm_batch(10_000, 3, cfg)  # any number of rows: exactly 3 come back
    # predict treats rows independently: rowwise=True pads 3 rows to the data axis, runs them split.
    next_bytes = strategy.apply(predict, rowwise=True)(state, prompt)
    return {"state": state, "losses": np.array(losses), "next_bytes": np.asarray(next_bytes), "prompt": prompt}


if __name__ == "__main__":
    spmdkit.use_host_devices(8)
    out = main(log_every=50)
    wte = out["state"].params["embed"]["embedding"].value  # inside its LogicallyPartitioned box
    print("embedding", wte.shape, "split as", wte.sharding.spec)
    for row, guess in zip(out["prompt"]["inputs"], out["next_bytes"]):
        print(repr(bytes(row.astype(np.uint8))), "->", repr(bytes(guess.astype(np.uint8))))
