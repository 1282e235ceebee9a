"""Per-device memory of a train step, counted from the layout (and the model, when known).

The analytic count: the state passed in, the new state returned (the step does not
donate) or the gradients (laid out like the parameters), whichever is larger, since the
fused optimizer update turns one into the other; the batch's share; and, for the built-in
``lm``, the activations its remat policy keeps for the backward pass. The compiled
program's own figure (``memory_analysis``: arguments + outputs + temporaries - aliased)
is the other estimate; the plan reports the larger and the margin between them. XLA:CPU
never fails for lack of memory, so neither is an out-of-memory verdict on this machine.
"""

from __future__ import annotations

import math
from typing import Any

import jax


def compiled_bytes(compiled: Any) -> dict[str, int]:
    mem = compiled.memory_analysis()
    mem = mem[0] if isinstance(mem, (list, tuple)) else mem
    parts = {name: int(getattr(mem, f"{name}_size_in_bytes", 0) or 0)
             for name in ("argument", "output", "temp", "alias", "generated_code")}
    parts["total"] = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
    return parts


def batch_bytes(batch: Any) -> int:
    return sum(math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize for x in jax.tree.leaves(batch))


def param_leaves(layout: Any) -> list[Any]:
    """The parameters among a layout's leaves (``.params`` / ``['params']`` of the state;
    every leaf when the state names none)."""
    found = [leaf for leaf in layout.leaves if ".params" in leaf.path or "['params']" in leaf.path]
    return found or list(layout.leaves)


def analytic_bytes(layout: Any, batch: Any, batch_shards: int, activations: int | None) -> dict[str, int | None]:
    """Parameters, gradients, optimizer state (in and out), batch and activations, per device."""
    params = sum(leaf.bytes_per_device for leaf in param_leaves(layout))
    state = sum(leaf.bytes_per_device for leaf in layout.leaves)
    out = {"params": params, "optimizer_and_rest": state - params, "new_state": state, "gradients": params,
           "batch": batch_bytes(batch) // max(batch_shards, 1), "activations": activations}
    # The new state is written from the gradients by the optimizer's elementwise update, which
    # XLA fuses into the gradients' last use: each gradient dies as its update is written, so
    # gradients and new state peak at the larger of the two, not at their sum.
    out["total"] = state + max(state, params) + out["batch"] + (activations or 0)
    return out


def lm_activation_bytes(cfg: Any, rows_per_device: int, remat: str, model_split: int) -> int:
    """Bytes the lm keeps for its backward pass on one device: per layer and token, under
    ``remat`` none, the block input, norms, q/k/v, attention scores and probabilities
    (float32), the attention output, the MLP's two activations; under ``dots`` only the
    outputs of the projections; under ``full`` the block input only. Plus embeddings and
    the float32 logits and their softmax. Heads, MLP and vocab (tensor parallel) or the
    sequence (sequence parallel) split it over ``model_split`` devices."""
    e, m, h, l = cfg.d_model, cfg.mlp_ratio * cfg.d_model, cfg.heads, cfg.seq_len
    item = 2 if cfg.precision == "bf16" else 4
    per_layer = {"none": (8 * e + 2 * m) * item + 2 * h * l * 4, "dots": (5 * e + m) * item, "full": e * item}[remat]
    top = 3 * e * item + 2 * 256 * 4
    return int(rows_per_device * l * (cfg.layers * per_layer + top) / max(model_split, 1))
