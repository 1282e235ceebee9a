"""Per-device memory of a train step, counted from the layout (and the model, when known).

The analytic count follows what the compiled step holds on one device (it does not donate
its state): the state passed in and the new state returned; the gradients; the batch's
share; and, for a model spmdkit built (``lm``, ``mlp``), what its forward and backward
passes keep: the activations saved for the backward pass under the remat policy, the
logits and their gradient, the working set of one layer's backward pass, and the
parameters that data-sharded layouts gather whole for one layer at a time. Each array
the model keeps is counted through its logical names, so the rules and the mesh decide
its per-device share as they decide the program's layout. For a step spmdkit did not
build, the count is the state in and out, the gradients and the batch only.

The compiled program's own figure (``memory_analysis``: arguments + outputs + temporaries
- aliased) is the other estimate; the plan reports both, the margin between them, and
uses the larger. XLA:CPU never fails for lack of memory, so neither is an out-of-memory
verdict on this machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax

from spmdkit._rules import _as_tuple

Names = tuple[str | None, ...]


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


def analytic_bytes(layout: Any, batch: Any, batch_shards: int, activations: int | Mapping[str, int] | None,
                   accum: int = 1) -> dict[str, Any]:
    """Per device: the state in and out, the gradients, the batch and (when the model is
    known) its activations; ``activations`` is a byte count or a dict of named parts."""
    params = sum(leaf.bytes_per_device for leaf in param_leaves(layout))
    state = sum(leaf.bytes_per_device for leaf in layout.leaves)
    parts = dict(activations) if isinstance(activations, Mapping) else None
    act = sum(parts.values()) if parts is not None else activations
    out: dict[str, Any] = {
        "params": params, "optimizer_and_rest": state - params, "new_state": state,
        # Accumulation keeps the running sum and one micro-batch's gradients.
        "gradients": params * (2 if accum > 1 else 1),
        "batch": batch_bytes(batch) // max(batch_shards, 1), "activations": act, "activation_parts": parts,
        "counted": ("state in and out, gradients, batch share and the model's activations" if act is not None else
                    "state in and out, gradients and batch share only (a step spmdkit did not build: its "
                    "activations are not known)"),
    }
    out["total"] = 2 * state + out["gradients"] + out["batch"] + (act or 0)
    return out


# ---------------------------------------------------------------- arrays a model keeps, by logical names
class Kept(NamedTuple):
    """``count`` arrays of ``elements`` elements per batch row, ``itemsize`` bytes each,
    their dimensions named ``names`` (the first ``batch``)."""

    names: Names
    elements: int
    itemsize: int
    count: float = 1.0


def pieces(names: Names, table: Iterable[tuple[str, Any]], mesh: Mapping[str, int]) -> int:
    """Into how many pieces the rules split an array named ``names`` on ``mesh``: as Flax
    resolves logical names, each rule in order takes its dimension unless its mesh axes are
    already taken (an activation named ``batch, embed`` under FSDP rules splits its batch
    over ``data``, not its embedding too)."""
    used: set[str] = set()
    taken: set[int] = set()
    for name, axes in table:
        if name not in names or axes is None:
            continue
        pos = names.index(name)
        axes = _as_tuple(axes)
        if pos in taken or used & set(axes):
            continue
        taken.add(pos)
        used.update(axes)
    return math.prod(mesh.get(a, 1) for a in used)


def kept_bytes(arrays: Iterable[Kept], rows: int, table: Iterable[tuple[str, Any]], mesh: Mapping[str, int]) -> int:
    """Bytes per device of arrays with a leading ``batch`` of ``rows`` rows."""
    table = list(table)
    return int(sum(a.count * rows * a.elements * a.itemsize / pieces(a.names, table, mesh) for a in arrays))


def gathered_bytes(params: Iterable[tuple[Names, int]], table: Iterable[tuple[str, Any]],
                   mesh: Mapping[str, int]) -> int:
    """Per device, parameters ``(names, bytes)`` as a matmul needs them: gathered whole over
    the mesh axes that also split the batch (FSDP), still split over the others (tensor
    parallel)."""
    table = list(table)
    batch_axes = set(_as_tuple(dict(table).get("batch")))
    out = 0.0
    for names, nbytes in params:
        split = pieces(names, [(n, a) for n, a in table if not batch_axes & set(_as_tuple(a))], mesh)
        out += nbytes / split
    return int(out)


# ---------------------------------------------------------------- the built-in lm
# Arrays of one block (per batch row) its backward pass needs, by remat policy, counted
# from what JAX's autodiff keeps of ``lm.Block``: under ``none`` the residual stream and
# the normalised inputs (embed), q, k, v and the attention output (heads), the attention
# probabilities (float32), the MLP's input and activation (mlp); under ``dots`` the block's
# input and the outputs of its projections; under ``full`` the block's input only.
LM_SAVED = {
    "none": {"embed": 6, "heads": 4, "scores": 1, "mlp": 3},
    "dots": {"embed": 1, "heads": 3, "scores": 0, "mlp": 1},
    "full": {"embed": 1, "heads": 0, "scores": 0, "mlp": 0},
}
# One block's backward pass at a time: the arrays the remat policy recomputes plus the
# gradients flowing through it (scores and probabilities in float32).
LM_WORKING = {"embed": 4, "heads": 4, "scores": 2, "mlp": 2}
# Outside the blocks: the one-hot tokens, the logits, their softmax and gradient (vocab,
# float32), the final norm's input and output (embed).
LM_TOP = {"vocab": 4, "embed": 3}


def _lm_arrays(cfg: Any, counts: Mapping[str, float], layers: int) -> list[Kept]:
    e, m, h, n = cfg.d_model, cfg.mlp_ratio * cfg.d_model, cfg.heads, cfg.seq_len
    item = 2 if cfg.precision == "bf16" else 4
    shapes = {"embed": (("batch", "length", "embed"), n * e, item),
              "heads": (("batch", "length", "heads", "kv"), n * e, item),
              "scores": (("batch", "heads", "length", None), h * n * n, 4),
              "mlp": (("batch", "length", "mlp"), n * m, item),
              "vocab": (("batch", "length", "vocab"), n * 256, 4)}
    return [Kept(*shapes[kind], count=layers * c) for kind, c in counts.items() if c]


def lm_layer_params(cfg: Any) -> list[tuple[Names, int]]:
    """``(logical names, bytes)`` of one block's parameters (float32)."""
    e, m = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    return [(("embed", "heads", "kv"), 4 * e * e)] * 3 + [(("heads", "kv", "embed"), 4 * e * e),
                                                          (("embed", "mlp"), 4 * e * m), (("mlp", "embed"), 4 * m * e),
                                                          (("embed",), 8 * e)]


def lm_memory(cfg: Any, rows: int, remat: str, table: Iterable[tuple[str, Any]],
              mesh: Mapping[str, int]) -> dict[str, int]:
    """What the lm's forward and backward passes keep on one device for ``rows`` rows of
    the (micro-)batch: saved activations of every block, one block's backward working set
    (under ``full`` and ``dots`` the recomputed arrays), the logits and what surrounds
    them, and one block's parameters gathered whole (twice: forward and backward)."""
    table = list(table)
    working = dict(LM_WORKING)
    if remat != "none":
        working = {k: working.get(k, 0) + LM_SAVED["none"].get(k, 0) - LM_SAVED[remat].get(k, 0)
                   for k in set(working) | set(LM_SAVED["none"])}
    return {"saved": kept_bytes(_lm_arrays(cfg, LM_SAVED[remat], cfg.layers), rows, table, mesh),
            "working": kept_bytes(_lm_arrays(cfg, working, 1), rows, table, mesh),
            "logits": kept_bytes(_lm_arrays(cfg, LM_TOP, 1), rows, table, mesh),
            "gathered": 2 * gathered_bytes(lm_layer_params(cfg), table, mesh)}


# ---------------------------------------------------------------- the built-in mlp
# Per layer and row: the layer's input (embed) and its ReLU output (hidden) are kept for
# the backward pass; the output, its error and gradient (embed) at the top.
MLP_SAVED = {"embed": 1, "hidden": 1}
MLP_TOP = {"embed": 3}


def mlp_memory(layers: int, depth: int, embed: int, rows: int, table: Iterable[tuple[str, Any]],
               mesh: Mapping[str, int]) -> dict[str, int]:
    """What the mlp's forward and backward passes keep on one device for ``rows`` rows."""
    table = list(table)
    size = {"embed": embed, "hidden": depth}
    saved = [Kept(("batch", kind), size[kind], 4, layers * c) for kind, c in MLP_SAVED.items()]
    top = [Kept(("batch", kind), size[kind], 4, c) for kind, c in MLP_TOP.items()]
    layer = [(("embed", "hidden"), 4 * embed * depth), (("hidden", "embed"), 4 * depth * embed)]
    return {"saved": kept_bytes(saved, rows, table, mesh), "logits": kept_bytes(top, rows, table, mesh),
            "gathered": 2 * gathered_bytes(layer, table, mesh)}


def _for_candidates(memory: Callable[[int, str, list, dict], dict[str, int]],
                    batch_size: int) -> Callable[[Any, int, int], dict[str, int]]:
    """The planner's ``activations(candidate, batch_shards, mesh_size)``: ``memory(rows,
    remat, rules table, mesh)`` for the candidate's micro-batch of the global batch."""
    from spmdkit._plan._candidates import rules_table

    def activations(cand: Any, batch_shards: int, mesh_size: int) -> dict[str, int]:
        return memory(batch_size // cand.accum, cand.remat, list(rules_table(cand.rules).table), dict(cand.mesh))

    return activations


def lm_activations(cfg: Any, batch_size: int) -> Callable[[Any, int, int], dict[str, int]]:
    """The planner's activation count for the built-in lm of config ``cfg`` (any remat:
    each candidate's policy is used) at global batch ``batch_size``."""
    return _for_candidates(lambda rows, remat, table, mesh: lm_memory(cfg, rows, remat, table, mesh), batch_size)


def mlp_activations(batch_size: int, **sizes: int) -> Callable[[Any, int, int], dict[str, int]]:
    """The planner's activation count for the built-in mlp made with ``sizes`` (``layers``,
    ``depth``, ``embed``; the task's defaults for the others)."""
    import inspect

    from spmdkit._tasks import mlp

    given = {k: p.default for k, p in inspect.signature(mlp.make).parameters.items() if k in ("layers", "depth", "embed")}
    given.update(sizes)
    return _for_candidates(lambda rows, remat, table, mesh: mlp_memory(given["layers"], given["depth"], given["embed"],
                                                                      rows, table, mesh), batch_size)
