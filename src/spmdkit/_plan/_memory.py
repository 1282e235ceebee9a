"""Per-device memory of a train step, counted from the layout (and the model, when known).

The analytic count follows what the compiled step holds on one device (it does not donate
its state): the state passed in and the new state returned, into whose buffers the fused
optimizer update writes the gradients; the batch's share; and, for a model spmdkit built
(``lm``, ``mlp``), what its forward and backward passes keep: the activations saved for
the backward pass under the remat policy, the logits and their gradient, the working set
of one layer's backward pass, the parameters that data-sharded layouts gather whole (one
layer at a time in a loop over layers, all of them in an unrolled program), and an
accumulating step's gradients of one micro-batch. Each array
the model keeps is counted through its logical names, so the rules and the mesh decide
its per-device share as they decide the program's layout. For a step spmdkit did not
build, the count is the state in and out and the batch (and, when it accumulates, one
micro-batch's gradients of every parameter); its activations are not known.

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
from spmdkit._strategies.sharded import _itemsize

Names = tuple[str | None, ...]


def compiled_bytes(compiled: Any) -> dict[str, int]:
    mem = compiled.memory_analysis()
    mem = mem[0] if isinstance(mem, (list, tuple)) else mem
    parts = {name: int(getattr(mem, f"{name}_size_in_bytes", 0) or 0)
             for name in ("argument", "output", "temp", "alias", "generated_code")}
    parts["total"] = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
    return parts


def batch_bytes(batch: Any) -> int:
    """Bytes of ``batch``'s leaves; PRNG keys (per-example keys) too, which ``jnp.dtype`` refuses."""
    return sum(math.prod(x.shape) * _itemsize(x.dtype) for x in jax.tree.leaves(batch))


def _in_optimizer(x: Any) -> bool:
    """An optax state (``ScaleByAdamState``, ``MultiTransformState``...: NamedTuples of optax)."""
    return isinstance(x, tuple) and hasattr(x, "_fields") and type(x).__module__.split(".")[0] == "optax"


def param_leaves(layout: Any) -> list[Any]:
    """The parameters among a layout's leaves (``.params`` / ``['params']`` of the state; in a
    state that names none, the leaves outside its optax states and ``opt_state``; else every leaf).

    A state such as ``{"model": params, "opt": tx.init(params)}`` counted Adam's two moments as
    parameters: three times the parameters' bytes, and as many again for an accumulating step's
    gradients, which raised the memory figure over the compiled one (10.6 MB against 9.4)."""
    # Layout.abstract holds the state's leaves in the order of Layout.leaves.
    flags = [opt for node in jax.tree.leaves(getattr(layout, "abstract", None), is_leaf=_in_optimizer)
             for opt in ([True] * len(jax.tree.leaves(node)) if _in_optimizer(node) else [False])]
    if len(flags) != len(layout.leaves):
        flags = [False] * len(layout.leaves)
    # an NNX Optimizer's state (nnx.split((model, optimizer))): its own Variables under .opt_state, no optax tuples
    flags = [opt or ".opt_state" in leaf.path or "['opt_state']" in leaf.path for leaf, opt in zip(layout.leaves, flags)]
    # not the moments of an optimizer initialised on {"params": ...}, whose paths name params too
    found = [leaf for leaf, opt in zip(layout.leaves, flags)
             if not opt and (".params" in leaf.path or "['params']" in leaf.path)]
    if found:
        return found
    outside = [leaf for leaf, opt in zip(layout.leaves, flags) if not opt]
    return outside if outside else list(layout.leaves)


def analytic_bytes(layout: Any, batch: Any, batch_shards: int, activations: int | Mapping[str, int] | None,
                   accum: int = 1) -> dict[str, Any]:
    """Per device: the state in and out, the batch and (when the model is known) what its
    passes keep; ``activations`` is a byte count or a dict of named parts.

    The gradients take no room of their own: the optimizer's elementwise update, fused into
    their last use, writes each into the new state's buffers as it is made. Accumulating
    steps hold one micro-batch's gradients besides (of one layer, for a model spmdkit built;
    of all parameters otherwise)."""
    params = sum(leaf.bytes_per_device for leaf in param_leaves(layout))
    state = sum(leaf.bytes_per_device for leaf in layout.leaves)
    parts = dict(activations) if isinstance(activations, Mapping) else None
    act = sum(parts.values()) if parts is not None else activations
    out: dict[str, Any] = {
        "params": params, "optimizer_and_rest": state - params, "new_state": state,
        "gradients": params if accum > 1 and act is None else 0,
        "batch": batch_bytes(batch) // max(batch_shards, 1), "activations": act, "activation_parts": parts,
        "counted": ("state in and out, batch share, and the model's activations, logits, gathered parameters "
                    "and micro-batch gradients" if act is not None else
                    "state in and out (the gradients are written into it), batch share"
                    + (", one micro-batch's gradients" if accum > 1 else "")
                    + "; no activations (a step spmdkit did not build)"),
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


# XLA's partitioner, for a matmul whose weight is split along a mesh axis that also splits
# the batch (FSDP), gathers the weight whole (one layer's in a loop over layers; and its
# gradient whole before the reduce-scatter), at every batch size measured on XLA:CPU (4 to
# 64 rows per device, jax 0.12). Whether the gathered copies take room of their own is the
# buffer assignment's call: it places a temporary in an output buffer of the step that is
# not yet written and large enough, and the new state's leaf of a stacked parameter holds
# every layer's share. When that leaf is at least one layer's gathered weight (as many
# layers as the weight is split over the batch's axes, or more), the gathered copies live
# there: an mlp of 4 layers on [data=8] holds 4 gathered matrices in temporaries (+4 MiB
# at 1024 x 256), of 8 layers none (0.9 MiB of temporaries in all).
def gathers(params: Iterable[tuple[Names, int]], table: list[tuple[str, Any]],
            mesh: Mapping[str, int]) -> tuple[int, int]:
    """``(held, extra)``: the bytes of ``params`` a device holds, and what gathering them
    whole over the batch's mesh axes adds (0 when nothing is split over them)."""
    params = list(params)
    held = int(sum(nbytes / pieces(names, table, mesh) for names, nbytes in params))
    return held, max(gathered_bytes(params, table, mesh) - held, 0)


def hosted(layer: Iterable[tuple[Names, int]], layers: int, table: list[tuple[str, Any]],
           mesh: Mapping[str, int]) -> bool:
    """Whether the new state's leaves can hold one layer's gathered parameters: for each
    parameter the rules split over the batch's axes, ``layers`` layers' share on one device
    is at least that parameter gathered (see :func:`gathers`)."""
    for names, nbytes in layer:
        share = nbytes / pieces(names, table, mesh)
        whole = gathered_bytes([(names, nbytes)], table, mesh)
        if whole > share and layers * share < whole:
            return False
    return True


def layer_parts(layer: list[tuple[Names, int]], layers: int, accum: int, table: Iterable[tuple[str, Any]],
                mesh: Mapping[str, int]) -> dict[str, int]:
    """In a loop over ``layers`` layers: one layer's parameters gathered whole, forward and
    backward (FSDP), unless the new state's buffers hold them (:func:`hosted`; an
    accumulating step still holds the running gradient's gathered layer); and, when the
    step accumulates, one layer's gradients of a micro-batch before they join the sum."""
    table = list(table)
    held, extra = gathers(layer, table, mesh)
    copies = (1 if accum > 1 else 0) if hosted(layer, layers, table, mesh) else 2
    return {"gathered": copies * extra, "micro_gradients": held if accum > 1 else 0}


# ---------------------------------------------------------------- the built-in lm
# What the lm keeps, by remat policy, in arrays of one block per batch row named like the
# block's activations (embed: the residual stream and norms; heads: q, k, v, attention
# output; scores: attention probabilities, float32; mlp: the MLP's hidden activations):
# "saved" for the backward pass by every block, "working" for one block's backward pass at
# a time (with what the policy recomputes), and "top" the logits, their softmax and
# gradient (vocab, float32) outside the blocks. Kinds split alike (heads and mlp) are only
# known together.
#
# The counts depend on the program's form (``LMConfig.unroll``, as the lm builds it):
# - unrolled (every layer in one straight-line program, the default up to 8 layers): XLA
#   schedules the whole step at once and reuses buffers across layers. Under ``none`` each
#   layer keeps about 8 residual-shaped arrays, 1.8 of scores and 14 of q/k/v/attention/MLP
#   shape (heads; the MLP's are among them) for the backward pass; under ``full`` and
#   ``dots`` hardly anything per layer (the block's input), and the recomputation's working
#   set takes the room. Where the rules shard parameters over the batch's mesh axes (FSDP),
#   XLA gathers every layer's parameters at once into room of their own (under ``full`` and
#   ``dots`` only where a device holds few rows, ``LM_GATHER_ROWS``), with
#   their gradients before the reduce-scatter ("gathered": that many times what gathering
#   adds; the second figure under accumulation, where the running sum of gradients is
#   gathered too); under sequence parallelism each layer keeps its keys and values (and,
#   under ``none``, their gradients) gathered over the whole length ("kv_gathered").
#   Part of the new parameters' buffers holds temporaries before the update writes them
#   ("outputs": that share of the parameters one device holds, subtracted). Fitted (least
#   worst relative error, tools/plan_memory_fit.py) to the compiled programs (XLA:CPU, jax
#   0.12) of the lm on 8 devices under every default rules preset at seven sizes (2-6
#   layers, width 32-128, 4-8 heads, length 32-128; accumulation 1 and 2 at four of them):
#   within 6.5% under ``none``, 7.8% under ``dots``, 10.3% under ``full``. XLA's schedule is
#   not a sum of parts (under ``full`` a 4-layer step can take less room than a 2-layer
#   one), so these are the counts of these programs; a fit to four of the sizes was 6-21%
#   off on the other three. Attention's layouts change them: re-take with
#   tools/plan_memory_table.py and refit.
# - rolled (a loop over layers, ``LMConfig.unroll`` < ``layers``): the loop holds one
#   layer's working set and every layer's saved arrays in stacked buffers, and gathers one
#   layer's parameters at a time (:func:`layer_parts`, from the layout, not fitted). Fitted
#   as the unrolled counts are, to the rolled programs at the same seven sizes: within 4.9%
#   under ``none``, 8.6% under ``full``, 8.3% under ``dots``.
# Under ``full`` and ``dots`` the unrolled lm's gathered parameters take room of their own
# where a device holds this many rows of the batch or fewer, or the step accumulates
# (measured at 4, 8 and 16 rows); with more rows XLA's schedule finds them room in buffers
# the recomputation holds anyway. Under ``none`` they always do: counted only up to 8 rows,
# FSDP over 8 devices at 16 rows each was 10-12% under (measured at 16 and 32 rows).
LM_GATHER_ROWS = 8
LM_COUNTS = {
    "none": {"saved": {"embed": 7.927, "heads": 14.266, "scores": 1.792},
             "working": {"embed": 0.834}, "top": {"vocab": 3.772},
             "kv_gathered": 2.202, "gathered": (1.139, 2.481), "micro": 0.0, "outputs": 0.768},
    "dots": {"saved": {"embed": 2.667},
             "working": {"embed": 4.032, "heads": 16.076, "scores": 1.923}, "top": {"vocab": 1.567},
             "kv_gathered": 1.026, "gathered": (0.962, 1.679), "micro": 0.0, "outputs": 0.237},
    "full": {"saved": {"embed": 0.115},
             "working": {"embed": 11.171, "heads": 14.109, "scores": 0.907}, "top": {"vocab": 1.338},
             "kv_gathered": 1.681, "gathered": (1.391, 2.214), "micro": 0.0, "outputs": 0.596},
}
LM_COUNTS_ROLLED = {
    "none": {"saved": {"embed": 8.718, "heads": 22.335, "scores": 1.099},
             "working": {"heads": 9.724, "scores": 5.187}, "top": {"vocab": 1.234},
             "kv_gathered": 1.531, "outputs": 0.505},
    "dots": {"saved": {"embed": 3.794, "heads": 4.263},
             "working": {"embed": 3.173, "heads": 12.342, "scores": 1.608}, "top": {"vocab": 2.408},
             "kv_gathered": 1.114, "outputs": 0.818},
    "full": {"saved": {"embed": 0.524},
             "working": {"embed": 9.36, "heads": 13.429, "scores": 2.398}, "top": {"vocab": 1.79},
             "kv_gathered": 1.296, "outputs": 1.0},
}

# Mixed precision (``--precision bf16``: bfloat16 compute, float32 parameters and optimizer
# state) makes other programs. XLA:CPU computes most bfloat16 operations in float32 (it
# converts around them) and keeps arrays of both widths, so its bfloat16 steps take as much
# room as float32 ones or more; the float32 counts with bfloat16's 2 bytes were up to 44%
# under them (41-44% at the plan's three sizes under ``none``). A device that keeps bfloat16
# activations at 2 bytes (a GPU, a TPU) needs less for them than these counts say; not
# measured here. Fitted as the float32 counts are, to the bfloat16 programs at the same seven
# sizes (counts of arrays of the compute dtype's size; scores and logits are float32):
# unrolled within 8.2% under ``none``, 14.4% under ``dots``, 16.7% under ``full`` (XLA's
# room under recomputation does not grow with depth as this form does: the 4-layer step
# under ``full`` holds less than the 2-layer one); rolled within 5.7% / 7.8% / 10.6%.
LM_COUNTS_BF16 = {
    "none": {"saved": {"embed": 13.147, "heads": 36.641, "scores": 1.903},
             "working": {"embed": 10.787}, "top": {"vocab": 1.325},
             "kv_gathered": 0.0, "gathered": (0.612, 0.912), "micro": 0.0, "outputs": 0.806},
    "dots": {"saved": {"heads": 11.94, "scores": 0.192},
             "working": {"embed": 17.898, "scores": 0.47}, "top": {"vocab": 1.14},
             "kv_gathered": 0.0, "gathered": (0.779, 1.635), "micro": 0.0, "outputs": 0.0},
    "full": {"saved": {"heads": 8.12},
             "working": {"embed": 20.042, "scores": 0.795}, "top": {"vocab": 1.008},
             "kv_gathered": 0.925, "gathered": (1.194, 1.68), "micro": 0.0, "outputs": 0.0},
}
LM_COUNTS_ROLLED_BF16 = {
    "none": {"saved": {"embed": 10.963, "heads": 26.213, "scores": 0.732},
             "working": {"embed": 11.552, "scores": 4.668}, "top": {"vocab": 1.068},
             "kv_gathered": 2.723, "outputs": 0.496},
    "dots": {"saved": {"embed": 1.056, "heads": 4.033, "scores": 0.498},
             "working": {"embed": 21.139, "heads": 9.923, "scores": 1.267}, "top": {"vocab": 1.258},
             "kv_gathered": 1.012, "outputs": 0.56},
    "full": {"saved": {"embed": 0.946},
             "working": {"embed": 20.549, "heads": 2.169, "scores": 2.332}, "top": {"vocab": 2.223},
             "kv_gathered": 1.539, "outputs": 0.958},
}


# XLA's buffer assignment changes between jax releases: jax 0.12.1's XLA:CPU keeps 7-21% fewer
# temporaries than 0.12.0.1's for the same lm steps (arguments and outputs byte-equal), which
# put the counts above, fitted to 0.12.0.1, up to 20.2% over. So each form has counts per release
# whose programs they were fitted to, and :func:`lm_counts` takes the newest release not after
# the running jax (the oldest for an older one). Keyed by (rolled, compute dtype), then by
# release. The 0.12.1 counts, fitted as above at the same seven sizes (the unrolled form with
# one more term, "micro": an accumulating step's gradients of one micro-batch), are within
# 6.7% / 6.9% / 10.95% (none / dots / full) unrolled and 4.9% / 7.7% / 10.3% rolled; in
# bfloat16, 7.2% / 11.2% / 11.0% and 5.7% / 7.4% / 11.0%. jax 0.10.2 (Python 3.11's newest),
# fitted the same way: 8.2% / 6.4% / 17.5% unrolled, 4.7% / 8.3% / 12.7% rolled; in bfloat16
# 8.0% / 6.7% / 17.9% and 8.1% / 12.4% / 11.2%. Its XLA keeps little of remat's saving in the
# unrolled program under the layouts without tensor parallelism (dp, fsdp, fsdp+sp: remat full
# 1.00-1.04 of none's memory without accumulation, 0.49-0.95 with tp), which counts per layer
# cannot follow (README, "Remat on jax 0.10.2 saves little in the unrolled lm"); the plan's
# per-device figure is the larger of the count and the compiled figure, so the budget holds.
LM_FITS: dict[tuple[bool, str], dict[tuple[int, ...], Mapping[str, Any]]] = {
    (False, "f32"): {(0, 10, 2): {
        "none": {"saved": {"embed": 7.585, "heads": 15.186, "scores": 2.099}, "working": {"embed": 1.824},
                 "top": {"vocab": 3.019}, "kv_gathered": 3.251, "gathered": (0.614, 2.282), "micro": 0.566, "outputs": 1.0},
        "dots": {"saved": {"embed": 7.865, "heads": 14.456, "scores": 1.991}, "working": {"embed": 0.603},
                 "top": {"vocab": 3.025}, "kv_gathered": 2.356, "gathered": (1.594, 2.337), "micro": 0.521,
                 "outputs": 0.592},
        "full": {"saved": {"embed": 3.197, "heads": 4.811, "scores": 2.785}, "working": {"embed": 7.347},
                 "top": {"vocab": 3.685}, "kv_gathered": 3.335, "gathered": (2.329, 2.15), "micro": 1.271,
                 "outputs": 0.598},
    }, (0, 12, 0, 1): LM_COUNTS, (0, 12, 1): {
        "none": {"saved": {"embed": 7.855, "heads": 15.271, "scores": 0.815},
                 "working": {"embed": 0.654}, "top": {"vocab": 3.789},
                 "kv_gathered": 1.956, "gathered": (1.281, 2.632), "micro": 0.258, "outputs": 1.0},
        "dots": {"saved": {"embed": 2.617, "heads": 2.518},
                 "working": {"embed": 3.377, "heads": 6.951, "scores": 2.581}, "top": {"vocab": 1.663},
                 "kv_gathered": 1.021, "gathered": (0.797, 1.67), "micro": 0.38, "outputs": 0.552},
        "full": {"saved": {"embed": 0.111},
                 "working": {"embed": 10.992, "heads": 12.859, "scores": 0.255}, "top": {"vocab": 1.303},
                 "kv_gathered": 2.021, "gathered": (1.334, 2.198), "micro": 0.0, "outputs": 0.573},
    }},
    (True, "f32"): {(0, 10, 2): {
        "none": {"saved": {"embed": 7.036, "heads": 28.714, "scores": 0.875},
                 "working": {"embed": 3.338, "heads": 5.238, "scores": 5.898}, "top": {"vocab": 0.944},
                 "kv_gathered": 1.595, "outputs": 0.517},
        "dots": {"saved": {"embed": 1.408, "heads": 6.649},
                 "working": {"embed": 9.11, "heads": 6.4, "scores": 1.498}, "top": {"vocab": 2.519},
                 "kv_gathered": 1.115, "outputs": 0.818},
        "full": {"saved": {},
                 "working": {"embed": 11.092, "heads": 12.04, "scores": 2.075}, "top": {"vocab": 1.865},
                 "kv_gathered": 2.095, "outputs": 1.0},
    }, (0, 12, 0, 1): LM_COUNTS_ROLLED, (0, 12, 1): {
        "none": {"saved": {"embed": 8.661, "heads": 19.623, "scores": 1.861},
                 "working": {"heads": 14.862, "scores": 2.913}, "top": {"vocab": 1.216},
                 "kv_gathered": 1.548, "outputs": 0.663},
        "dots": {"saved": {"embed": 3.222, "heads": 5.205},
                 "working": {"embed": 4.363, "heads": 12.804, "scores": 1.482}, "top": {"vocab": 2.162},
                 "kv_gathered": 1.144, "outputs": 1.0},
        "full": {"saved": {"embed": 0.596},
                 "working": {"embed": 9.649, "heads": 10.794, "scores": 2.015}, "top": {"vocab": 1.215},
                 "kv_gathered": 1.504, "outputs": 1.0},
    }},
    (False, "bf16"): {(0, 10, 2): {
        "none": {"saved": {"embed": 10.18, "heads": 35.066, "scores": 1.541}, "working": {"embed": 22.648},
                 "top": {"vocab": 2.034}, "kv_gathered": 5.123, "gathered": (0.953, 1.736), "micro": 0.864, "outputs": 1.0},
        "dots": {"saved": {"embed": 12.527, "heads": 36.006, "scores": 2.126}, "working": {"embed": 10.614},
                 "top": {"vocab": 1.535}, "kv_gathered": 3.268, "gathered": (1.421, 2.045), "micro": 1.515, "outputs": 1.0},
        "full": {"saved": {"embed": 6.943, "heads": 14.35, "scores": 2.62}, "working": {"embed": 17.712},
                 "top": {"vocab": 2.79}, "kv_gathered": 4.631, "gathered": (1.729, 2.051), "micro": 1.815,
                 "outputs": 0.876},
    }, (0, 12, 0, 1): LM_COUNTS_BF16, (0, 12, 1): {
        "none": {"saved": {"embed": 7.618, "heads": 35.586, "scores": 1.736},
                 "working": {"embed": 18.208}, "top": {"vocab": 1.487},
                 "kv_gathered": 1.323, "gathered": (0.868, 1.136), "micro": 0.296, "outputs": 1.0},
        "dots": {"saved": {"heads": 6.049},
                 "working": {"embed": 20.646, "heads": 5.701, "scores": 1.418}, "top": {"vocab": 0.567},
                 "kv_gathered": 1.11, "gathered": (1.027, 1.766), "micro": 0.46, "outputs": 0.0},
        "full": {"saved": {},
                 "working": {"embed": 17.279, "heads": 16.376, "scores": 1.61}, "top": {"vocab": 1.276},
                 "kv_gathered": 1.22, "gathered": (0.987, 1.912), "micro": 0.771, "outputs": 0.155},
    }},
    (True, "bf16"): {(0, 10, 2): {
        "none": {"saved": {"embed": 9.995, "heads": 71.804}, "working": {"embed": 17.832, "scores": 5.365},
                 "top": {"vocab": 2.765}, "kv_gathered": 3.415, "outputs": 0.0},
        "dots": {"saved": {"embed": 2.033, "heads": 12.578}, "working": {"embed": 19.394, "scores": 2.156},
                 "top": {"vocab": 2.764}, "kv_gathered": 0.817, "outputs": 0.0},
        "full": {"saved": {"embed": 0.895}, "working": {"embed": 24.886, "heads": 1.934, "scores": 2.341},
                 "top": {"vocab": 2.361}, "kv_gathered": 2.059, "outputs": 0.43},
    }, (0, 12, 0, 1): LM_COUNTS_ROLLED_BF16, (0, 12, 1): {
        "none": {"saved": {"embed": 10.985, "heads": 17.639, "scores": 1.471},
                 "working": {"embed": 13.092, "heads": 19.11, "scores": 2.058}, "top": {"vocab": 0.902},
                 "kv_gathered": 3.099, "outputs": 0.518},
        "dots": {"saved": {"embed": 1.375, "heads": 2.567, "scores": 0.483},
                 "working": {"embed": 17.197, "heads": 13.91, "scores": 1.275}, "top": {"vocab": 1.302},
                 "kv_gathered": 1.274, "outputs": 0.455},
        "full": {"saved": {"embed": 0.695, "scores": 0.061},
                 "working": {"embed": 16.6, "heads": 10.644, "scores": 1.833}, "top": {"vocab": 1.726},
                 "kv_gathered": 2.0, "outputs": 0.992},
    }},
}


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


def lm_params(cfg: Any) -> list[tuple[Names, int]]:
    """``(logical names, bytes)`` of all the lm's parameters (float32): the blocks, the
    token and position embeddings and the final norm."""
    e = cfg.d_model
    return lm_layer_params(cfg) * cfg.layers + [(("vocab", "embed"), 4 * 256 * e),
                                                (("length", "embed"), 4 * cfg.seq_len * e), (("embed",), 4 * e)]


def lm_looped(cfg: Any) -> bool:
    """Whether the lm's layers run in a loop (a rolled scan) rather than unrolled."""
    return cfg.layers // cfg.unroll >= 2


def lm_counts(cfg: Any, remat: str, jax_version: tuple[int, ...] | None = None) -> Mapping[str, Any]:
    """The fitted counts for the lm's program: rolled or unrolled (:func:`lm_looped`), float32
    or bfloat16 compute (``cfg.precision``), under ``remat``, of the jax release that compiles
    it (``jax_version``, by default the running one; :data:`LM_FITS`).

    Example:
        >>> from spmdkit._tasks.lm import LMConfig
        >>> lm_counts(LMConfig(precision="bf16"), "none", (0, 12, 0, 1)) is LM_COUNTS_BF16["none"]
        True
    """
    fits = LM_FITS[(lm_looped(cfg), cfg.precision)]
    return fits[fitted_release(fits, jax.__version_info__ if jax_version is None else jax_version)][remat]


def fitted_release(fits: Iterable[tuple[int, ...]], jax_version: tuple[int, ...]) -> tuple[int, ...]:
    """Of the jax releases that counts were fitted to, the newest not after ``jax_version`` (the
    oldest for an older jax). Releases compare by their first three parts: a post-release such
    as 0.12.0.1 ships the compiler of its release, so 0.12.0 takes 0.12.0.1's counts.

    Example:
        >>> fits = [(0, 10, 2), (0, 12, 0, 1), (0, 12, 1)]
        >>> [fitted_release(fits, v) for v in [(0, 10, 1), (0, 11, 0), (0, 12, 0), (0, 13)]]
        [(0, 10, 2), (0, 10, 2), (0, 12, 0, 1), (0, 12, 1)]
    """
    fits = list(fits)
    return max((r for r in fits if r[:3] <= tuple(jax_version)[:3]), default=min(fits))


def lm_memory(cfg: Any, rows: int, remat: str, accum: int, table: Iterable[tuple[str, Any]],
              mesh: Mapping[str, int], counts: Mapping[str, Any] | None = None) -> dict[str, int]:
    """What the lm's passes keep on one device for ``rows`` rows of the (micro-)batch: the
    saved activations of every block, one block's backward working set (under ``full`` and
    ``dots`` with the recomputed arrays), the logits and what surrounds them, and the
    parameters gathered whole and micro-batch gradients, counted for the program's form
    (``counts``: by default :func:`lm_counts`)."""
    table = list(table)
    looped = lm_looped(cfg)
    counts = counts if counts is not None else lm_counts(cfg, remat)
    out = {"saved": kept_bytes(_lm_arrays(cfg, counts["saved"], cfg.layers), rows, table, mesh),
           "working": kept_bytes(_lm_arrays(cfg, counts["working"], 1), rows, table, mesh),
           "logits": kept_bytes(_lm_arrays(cfg, counts["top"], 1), rows, table, mesh)}
    out["sequence_gathered"] = _sequence_gathered(cfg, counts.get("kv_gathered", 0.0) * cfg.layers, rows, table, mesh)
    held, extra = gathers(lm_params(cfg), table, mesh)
    out["in_new_parameters"] = -int(counts.get("outputs", 0.0) * held)
    if looped:
        return {**out, **layer_parts(lm_layer_params(cfg), cfg.layers, accum, table, mesh)}
    if rows / pieces(("batch",), table, mesh) > LM_GATHER_ROWS and accum == 1 and remat != "none":
        extra = 0
    return {**out, "gathered": int(counts["gathered"][accum > 1] * extra),
            "micro_gradients": int(counts["micro"] * held) if accum > 1 else 0}


def _sequence_gathered(cfg: Any, count: float, rows: int, table: list[tuple[str, Any]], mesh: Mapping[str, int]) -> int:
    """``count`` arrays of the attention's keys or values gathered over the whole length
    (sequence parallelism splits ``length``; every query needs every key): what they hold
    beyond their split share. Nothing when the rules leave ``length`` whole."""
    e, n, item = cfg.d_model, cfg.seq_len, 2 if cfg.precision == "bf16" else 4
    whole = kept_bytes([Kept(("batch", None, "heads", "kv"), n * e, item, count)], rows, table, mesh)
    return whole - kept_bytes([Kept(("batch", "length", "heads", "kv"), n * e, item, count)], rows, table, mesh)


# ---------------------------------------------------------------- the built-in mlp
def mlp_memory(layers: int, depth: int, embed: int, rows: int, accum: int, table: Iterable[tuple[str, Any]],
               mesh: Mapping[str, int]) -> dict[str, int]:
    """What the mlp's passes keep on one device for ``rows`` rows: each layer's ReLU output
    (hidden) for the backward pass, the prediction's error (embed), and one layer's
    gathered parameters and micro-batch gradients (:func:`layer_parts`)."""
    table = list(table)
    kept = [Kept(("batch", "hidden"), depth, 4, layers), Kept(("batch", "embed"), embed, 4, 1)]
    layer = [(("embed", "hidden"), 4 * embed * depth), (("hidden", "embed"), 4 * depth * embed)]
    return {"saved": kept_bytes(kept, rows, table, mesh), **layer_parts(layer, layers, accum, table, mesh)}


def _for_candidates(memory: Callable[[int, str, int, list, dict], dict[str, int]],
                    batch_size: int) -> Callable[[Any, int, int], dict[str, int]]:
    """The planner's ``activations(candidate, batch_shards, mesh_size)``: ``memory(rows,
    remat, accum, rules table, mesh)`` for the candidate's micro-batch of the global batch."""
    from spmdkit._plan._candidates import rules_table

    def activations(cand: Any, batch_shards: int, mesh_size: int) -> dict[str, int]:
        return memory(batch_size // cand.accum, cand.remat, cand.accum, list(rules_table(cand.rules).table),
                      dict(cand.mesh))

    return activations


def held_in_new_parameters(parts: dict[str, int]) -> dict[str, int]:
    """``parts`` (:func:`lm_memory`) with the temporaries the new parameters' buffers hold at
    most all the temporaries there are: the fitted share of the parameters can exceed a small
    step's (remat full, accumulation, many devices), and a negative count of activations
    means nothing. (The fit takes :func:`lm_memory` unbounded: it is linear in its counts.)

    Example:
        >>> held_in_new_parameters({"saved": 100, "working": 50, "in_new_parameters": -400})
        {'saved': 100, 'working': 50, 'in_new_parameters': -150}
    """
    rest = sum(v for k, v in parts.items() if k != "in_new_parameters")
    return {**parts, "in_new_parameters": max(parts.get("in_new_parameters", 0), -rest)}


def lm_activations(cfg: Any, batch_size: int) -> Callable[[Any, int, int], dict[str, int]]:
    """The planner's activation count for the built-in lm of config ``cfg`` (any remat:
    each candidate's policy is used) at global batch ``batch_size``."""
    return _for_candidates(lambda rows, remat, accum, table, mesh: held_in_new_parameters(
        lm_memory(cfg, rows, remat, accum, table, mesh)), batch_size)


def mlp_activations(batch_size: int, **sizes: int) -> Callable[[Any, int, int], dict[str, int]]:
    """The planner's activation count for the built-in mlp made with ``sizes`` (``layers``,
    ``depth``, ``embed``; the task's defaults for the others)."""
    import inspect

    from spmdkit._tasks import mlp

    given = {k: p.default for k, p in inspect.signature(mlp.make).parameters.items()
             if k in ("layers", "depth", "embed")}
    given.update(sizes)
    return _for_candidates(lambda rows, remat, accum, table, mesh: mlp_memory(
        given["layers"], given["depth"], given["embed"], rows, accum, table, mesh), batch_size)
