"""One case of ``spmdkit bench --suite lm``: a language model that trains when told to, in its own process.

The suite starts one worker per case and keeps it for the whole run, so a model is built
and compiled once and the cases' rounds can interleave. The worker reads commands on
stdin, one JSON object a line, and answers each with one JSON line on stdout:

- at start-up (no command): ``{"ready": true, "params": N, "framework", "config"}``;
- ``{"run": K}``: K training steps, every step synced; ``{"step_s": mean, "step_times"}``;
- ``{"eval": true}``: held-out bits per byte; ``{"bits_per_byte": x, "steps": trained}``;
- end of input: the worker exits.

Both frameworks read the same ``--data`` file (``train`` and ``held_out`` windows of
``seq_len + 1`` bytes, written by the suite) and take training batch t as rows
``t*B .. t*B+B-1`` (mod the row count) of ``train``, so they see the same bytes in the
same order. ``--framework jax`` trains spmdkit's ``--task lm`` model
(:mod:`spmdkit._tasks.lm`) with its training step on :class:`spmdkit.Single`, AdamW as the
task uses. ``--framework torch`` trains the same architecture written for PyTorch
(:func:`torch_lm`) from the parameters in ``--init`` (the spmdkit model's initial
parameters), with ``torch.optim.AdamW`` set like optax's. This file imports only the
standard library and NumPy at the top: the PyTorch worker runs it by path in any Python
that has torch, without JAX or spmdkit installed there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

VOCAB = 256
LR = 3e-3  # the lm task's AdamW: learning rate, no weight decay (optax's defaults otherwise)
TOKEN_EMBED_STD = 0.02  # the lm task's (spmdkit._tasks.lm.TOKEN_EMBED_STD: this file does not import spmdkit)


def batch_rows(step: int, batch: int, rows: int) -> np.ndarray:
    """The rows of training batch ``step``: consecutive, wrapping around the data.

    Example:
        >>> batch_rows(2, 3, 7).tolist()
        [6, 0, 1]
    """
    return (step * batch + np.arange(batch)) % rows


# ---------------------------------------------------------------- PyTorch
def torch_lm(layers: int, d_model: int, heads: int, seq_len: int, mlp_ratio: int = 4):
    """The lm task's transformer in PyTorch: same blocks, shapes, parameter count and init scales.

    Pre-norm blocks (RMSNorm eps 1e-6, causal attention without biases, tanh-GELU MLP), a
    final RMSNorm, logits tied to the token embedding and divided by sqrt(d_model). Written
    the fast PyTorch way: one fused q/k/v projection, ``F.scaled_dot_product_attention``,
    ``F.embedding`` for the one-hot product.
    """
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F

    head_dim, hidden = d_model // heads, mlp_ratio * d_model

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = tnn.RMSNorm(d_model, eps=1e-6)
            self.qkv = tnn.Linear(d_model, 3 * d_model, bias=False)
            self.out = tnn.Linear(d_model, d_model, bias=False)
            self.mlp_norm = tnn.RMSNorm(d_model, eps=1e-6)
            self.mlp_in = tnn.Linear(d_model, hidden, bias=False)
            self.mlp_out = tnn.Linear(hidden, d_model, bias=False)
            out_std = 0.02 / math.sqrt(2 * layers)
            for lin, std in ((self.qkv, 0.02), (self.out, out_std), (self.mlp_in, 0.02), (self.mlp_out, out_std)):
                tnn.init.normal_(lin.weight, std=std)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.attn_norm(x)).view(b, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, n, d_model))
            return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x)), approximate="tanh"))

    class LM(tnn.Module):
        def __init__(self):
            super().__init__()
            self.token_embed = tnn.Parameter(TOKEN_EMBED_STD * torch.randn(VOCAB, d_model))
            self.position_embed = tnn.Parameter(0.02 * torch.randn(seq_len, d_model))
            self.blocks = tnn.ModuleList(Block() for _ in range(layers))
            self.final_norm = tnn.RMSNorm(d_model, eps=1e-6)

        def forward(self, tokens):
            x = F.embedding(tokens, self.token_embed) + self.position_embed[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return (self.final_norm(x) @ self.token_embed.t()) / math.sqrt(d_model)

    return LM()


def load_flat_init(model, flat: dict[str, np.ndarray], layers: int) -> None:
    """Copy the spmdkit model's parameters (keys as :func:`flatten_params` writes them) into
    :func:`torch_lm`; every array used once, every parameter set, shapes checked."""
    import torch

    d = model.token_embed.shape[1]
    used, targets = set(), {}

    def take(key):
        used.add(key)
        return flat[key]

    targets["token_embed"] = take("token_embed")
    targets["position_embed"] = take("position_embed")
    targets["final_norm.weight"] = take("final_norm.scale")
    for i in range(layers):
        p = f"blocks.{i}."
        qkv = [take(f"layers.{n}")[i].reshape(d, d).T for n in ("query", "key", "value")]  # (E,H,D) -> (H*D, E)
        targets[p + "qkv.weight"] = np.concatenate(qkv, axis=0)
        targets[p + "out.weight"] = take("layers.out")[i].reshape(d, d).T  # (H,D,E) -> (E, H*D)
        targets[p + "mlp_in.weight"] = take("layers.mlp_in")[i].T
        targets[p + "mlp_out.weight"] = take("layers.mlp_out")[i].T
        targets[p + "attn_norm.weight"] = take("layers.attn_norm.scale")[i]
        targets[p + "mlp_norm.weight"] = take("layers.mlp_norm.scale")[i]
    params = dict(model.named_parameters())
    missing, unused = sorted(set(params) - set(targets)), sorted(set(flat) - used)
    if missing or unused:
        raise ValueError(f"the PyTorch model and the spmdkit parameters differ: PyTorch parameters not set {missing}, "
                         f"spmdkit arrays not used {unused}")
    with torch.no_grad():
        for name, value in targets.items():
            if tuple(params[name].shape) != value.shape:
                raise ValueError(f"{name}: PyTorch shape {tuple(params[name].shape)} != spmdkit's {value.shape}")
            params[name].copy_(torch.from_numpy(np.array(value)))  # a writable copy


def _torch_worker(a: argparse.Namespace, data: dict[str, np.ndarray]):
    import torch
    import torch.nn.functional as F

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(a.threads or cores)
    torch.manual_seed(0)
    model = torch_lm(a.layers, a.d_model, a.heads, a.seq_len)
    if a.init:
        with np.load(a.init) as f:
            load_flat_init(model, dict(f), a.layers)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    net = torch.compile(model) if a.compile else model
    autocast = a.precision == "bf16"
    train = torch.from_numpy(data["train"].astype(np.int64))
    steps = 0

    def loss_of(tokens):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = net(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def step():
        nonlocal steps
        tokens = train[torch.from_numpy(batch_rows(steps, a.batch, len(train)))]
        opt.zero_grad(set_to_none=True)
        loss_of(tokens).backward()
        opt.step()  # eager CPU: the step has finished when it returns
        steps += 1

    def evaluate():
        held = torch.from_numpy(data["held_out"].astype(np.int64))
        with torch.no_grad():
            losses = [float(loss_of(held[i : i + a.batch])) for i in range(0, len(held) - a.batch + 1, a.batch)]
        return sum(losses) / len(losses) / math.log(2), steps

    return params, step, evaluate


# ---------------------------------------------------------------- spmdkit
def flatten_params(params) -> dict[str, np.ndarray]:
    """``{"layers.query": array, ...}``: a parameter tree's leaves by dotted path."""
    import jax

    return {".".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def _jax_worker(a: argparse.Namespace, data: dict[str, np.ndarray]):
    from spmdkit._host_memory import _apply

    _apply(strict=False)  # as the spmdkit command does, before JAX starts (the suite's env decides)
    import jax
    import optax

    from spmdkit._strategies import Single
    from spmdkit._tasks import Task
    from spmdkit._tasks.lm import DEFAULTS, LMConfig, lm_functions
    from spmdkit._train._steps import task_eval_step, task_state, task_train_step

    cfg = LMConfig(layers=a.layers, d_model=a.d_model, heads=a.heads, seq_len=a.seq_len, precision=a.precision,
                   remat=a.remat, scan_unroll=a.scan_unroll or None)
    _, init, loss_fn = lm_functions(cfg)
    task = Task(name="lm", init=init, loss_fn=loss_fn, train_data={"tokens": data["train"]},
                eval_data={"tokens": data["held_out"]}, defaults=DEFAULTS)
    opt = optax.adamw(LR, weight_decay=0.0)  # what `--task lm` trains with (OptimizerConfig("adamw", 3e-3))
    strategy = Single()
    state = strategy.init(task_state(task, opt), jax.random.key(0))
    train_step = strategy.step(task_train_step(task, opt), donate=True)
    eval_step = strategy.evaluate(task_eval_step(task, jax.random.key(1)))
    params = sum(x.size for x in jax.tree.leaves(state.params))
    train = data["train"]
    steps = 0

    def step():
        nonlocal state, steps
        state, _ = train_step(state, {"tokens": train[batch_rows(steps, a.batch, len(train))]})
        jax.block_until_ready(state)
        steps += 1

    def evaluate():
        held = data["held_out"]
        losses = [float(eval_step(state, {"tokens": held[i : i + a.batch]})["loss"])
                  for i in range(0, len(held) - a.batch + 1, a.batch)]
        return sum(losses) / len(losses) / math.log(2), steps

    return params, step, evaluate


# ---------------------------------------------------------------- the command loop
def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("jax", "torch"), required=True)
    p.add_argument("--data", required=True, help="an .npz with 'train' and 'held_out' uint8 windows")
    p.add_argument("--init", help="torch: an .npz of the spmdkit model's initial parameters")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--precision", choices=("f32", "bf16"), default="f32")
    p.add_argument("--remat", default="none", help="jax: the lm task's remat policy")
    p.add_argument("--scan-unroll", type=int, default=0,
                   help="jax: layers per iteration of the scan over layers (1: a rolled loop; 0: the task's default)")
    p.add_argument("--compile", action="store_true", help="torch: torch.compile the model")
    p.add_argument("--threads", type=int, default=0, help="torch: intra-op threads (0: every core this process has)")
    p.add_argument("--xla-flags", default="", help="jax: appended to XLA_FLAGS")
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {a.xla_flags}".strip()
    with np.load(a.data) as f:
        data = {"train": f["train"], "held_out": f["held_out"]}
    params, step, evaluate = (_jax_worker if a.framework == "jax" else _torch_worker)(a, data)
    _say({"ready": True, "params": int(params), "framework": a.framework, "config": vars(a),
          "malloc": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}})
    for line in sys.stdin:
        cmd = json.loads(line)
        if "run" in cmd:
            times = []
            for _ in range(int(cmd["run"])):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            _say({"step_s": sum(times) / len(times), "step_times": times})
        elif "eval" in cmd:
            bpb, trained = evaluate()
            _say({"bits_per_byte": bpb, "steps": trained})


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run by path: this package's other modules must not shadow top-level names
    main()
