"""One process of the multi-process benchmark: trains a model for N steps, prints its step time.

Run by ``spmdkit bench --suite multiprocess`` directly (one process) or under
``spmdkit launch`` (several, joined by jax.distributed; torch uses gloo on the next port).
Process 0 prints one JSON line ``{"samples_per_s", "step_s", "step_times", "config"}``.

Besides the data-parallel strategy's own step (``--allreduce strategy``), the levers are
hand-written here, so each can be measured before any becomes the strategy's default:

- ``--allreduce leaf|packed|bucketed``: a shard_map step whose gradient all-reduce is
  one ``psum`` per leaf, one over all gradients raveled into a flat buffer, or
  ``--buckets`` flat buffers (leaves in reverse order, the order backward produces
  them, as DDP's buckets), so the reduction of the last layers can overlap the backward
  pass of the first;
- ``--grad-dtype bf16|f16``: the buffers are reduced in that dtype (half the bytes);
- ``--donate``: the strategy's step with ``donate=True`` (the new state reuses the old one's memory);
- ``--accum K``: K micro-batches per step, their gradients summed before one reduction
  (the hand-written steps unroll the micro-batches; the strategy runs fit's step, a scan);
- ``--threads T``: this process may use T cores (``os.sched_setaffinity``, process i
  gets cores i*T..i*T+T-1): XLA:CPU sizes its intra-op thread pool from the affinity;
- ``--xla-flags``: appended to ``XLA_FLAGS`` (e.g. ``--xla_cpu_multi_thread_eigen=false``);
- ``--cpu-collectives``: ``jax_cpu_collectives_implementation`` (gloo, mpi);
- torch: ``--torch-threads T`` (0: PyTorch's default) and ``--compile`` (``torch.compile``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

WARMUP_STEPS = 5


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("SPMDKIT_PROCESS_ID", "0")), int(os.environ.get("SPMDKIT_NUM_PROCESSES", "1"))


def _pin(threads: int) -> list[int] | None:
    """Restrict this process to ``threads`` cores, its own slice by process index."""
    if not threads or not hasattr(os, "sched_setaffinity"):
        return None
    rank, _ = _rank_world()
    cores = sorted(os.sched_getaffinity(0))
    mine = [cores[(rank * threads + i) % len(cores)] for i in range(threads)]
    os.sched_setaffinity(0, mine)
    return mine


def _data(model: str, batch: int):
    rng = np.random.default_rng(0)
    if model == "mlp":
        return rng.standard_normal((batch, 784)).astype(np.float32), rng.integers(0, 10, batch).astype(np.int32)
    from spmdkit._tasks.digits import load

    train, _ = load()
    idx = rng.integers(0, len(train["label"]), batch)
    return train["image"][idx], train["label"][idx]


def _timed(step, steps: int, sync) -> list[float]:
    """Per-step seconds after the warm-up; ``sync`` blocks on the step's outputs."""
    for _ in range(WARMUP_STEPS):
        sync(step())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sync(step())  # every step: the CPU collective rule
        times.append(time.perf_counter() - t0)
    return times


def _flax_net(model: str):
    import flax.linen as nn

    from spmdkit._tasks.digits import CNN

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(1024)(x))
            x = nn.relu(nn.Dense(1024)(x))
            return nn.Dense(10)(x)

    return MLP() if model == "mlp" else CNN()


def _buckets(leaves: list, count: int) -> list[list[int]]:
    """Leaf indices in reverse order (backward's order), cut into ``count`` groups of similar size."""
    order = list(range(len(leaves)))[::-1]
    total = sum(leaf.size for leaf in leaves)
    groups, current, filled = [], [], 0
    for i in order:
        current.append(i)
        filled += leaves[i].size
        if filled >= total * (len(groups) + 1) / count and len(groups) < count - 1:
            groups.append(current)
            current = []
    return groups + ([current] if current else [])


def reduce_grads(grads, axis: str, allreduce: str, buckets: int, dtype):
    """Sum of ``grads`` over ``axis``, one psum per leaf, per packed buffer or per bucket."""
    import jax
    import jax.numpy as jnp

    cast = lambda x: x.astype(dtype) if dtype is not None else x  # noqa: E731
    if allreduce == "leaf":
        return jax.tree.map(lambda g: jax.lax.psum(cast(g), axis).astype(g.dtype), grads)
    leaves, treedef = jax.tree.flatten(grads)
    groups = [list(range(len(leaves)))] if allreduce == "packed" else _buckets(leaves, buckets)
    out = list(leaves)
    for group in groups:
        flat = jax.lax.psum(cast(jnp.concatenate([leaves[i].ravel() for i in group])), axis)
        offset = 0
        for i in group:
            out[i] = flat[offset : offset + leaves[i].size].reshape(leaves[i].shape).astype(leaves[i].dtype)
            offset += leaves[i].size
    return jax.tree.unflatten(treedef, out)


def _hand_step(net, opt, mesh, a: argparse.Namespace):
    """A hand-written data-parallel step: local gradients, the chosen reduction, the update."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    axis = "data"
    dtype = {"f32": None, "bf16": jnp.bfloat16, "f16": jnp.float16}[a.grad_dtype]

    def loss(params, x, y):
        logits = net.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def per_device(params, opt_state, x, y):
        # Unrolled micro-batches: a scan around convolutions is a slow while loop on XLA:CPU.
        xs, ys = jnp.split(x, a.accum), jnp.split(y, a.accum)
        grads = jax.grad(loss)(params, xs[0], ys[0])
        for xm, ym in zip(xs[1:], ys[1:]):
            grads = jax.tree.map(jnp.add, grads, jax.grad(loss)(params, xm, ym))
        n = jax.lax.psum(1, axis) * a.accum
        grads = jax.tree.map(lambda g: g / n, reduce_grads(grads, axis, a.allreduce, a.buckets, dtype))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(axis), P(axis)), out_specs=(P(), P()),
                      check_vma=False),
        donate_argnums=(0, 1),
    )


def run_jax(a: argparse.Namespace) -> list[float]:
    if a.cpu_collectives:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", a.cpu_collectives)
    from spmdkit._launch import initialize_distributed

    initialize_distributed()
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from spmdkit._mesh import make_mesh
    from spmdkit._strategies import DataParallel

    net = _flax_net(a.model)
    x, y = _data(a.model, a.batch)
    opt = optax.sgd(0.01)
    init = lambda k: net.init(k, jnp.asarray(x[:1]))["params"]  # noqa: E731
    if a.allreduce == "strategy":
        from spmdkit._tasks import Task
        from spmdkit._train._steps import task_state, task_train_step

        def loss_fn(params, b, rng):
            logits = net.apply({"params": params}, b["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), {}

        host = {"x": x, "y": y}
        task = Task(name=a.model, init=init, loss_fn=loss_fn, train_data=host)
        strategy = DataParallel(impl=a.impl)
        state = strategy.init(task_state(task, opt), jax.random.key(0), unbox=True)
        train = strategy.step(task_train_step(task, opt, a.accum), donate=a.donate)  # the step fit runs

        def step():
            nonlocal state
            state, _ = train(state, host)
            return state

        return _timed(step, a.steps, jax.block_until_ready)
    mesh = make_mesh(data=-1)
    repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.jit(init, out_shardings=repl)(jax.random.key(0))
    opt_state = jax.jit(opt.init, out_shardings=repl)(params)
    train = _hand_step(net, opt, mesh, a)
    rank, world = _rank_world()
    per = a.batch // world
    local = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]

    def step():
        nonlocal params, opt_state
        xb, yb = (jax.make_array_from_process_local_data(split, v, (a.batch, *v.shape[1:])) for v in local)
        params, opt_state = train(params, opt_state, xb, yb)
        return params

    return _timed(step, a.steps, jax.block_until_ready)


def run_torch(a: argparse.Namespace) -> list[float]:
    import torch
    import torch.nn as tnn

    rank, world = _rank_world()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    elif a.torch_threads is None:
        torch.set_num_threads(max(1, cores // world))  # one share of the cores per process
    torch.manual_seed(0)
    if a.model == "mlp":
        net = tnn.Sequential(tnn.Linear(784, 1024), tnn.ReLU(), tnn.Linear(1024, 1024), tnn.ReLU(), tnn.Linear(1024, 10))
    else:
        net = tnn.Sequential(
            tnn.Conv2d(1, 32, 3, padding=1), tnn.ReLU(), tnn.AvgPool2d(2), tnn.Conv2d(32, 64, 3, padding=1), tnn.ReLU(),
            tnn.AvgPool2d(2), tnn.Flatten(), tnn.Linear(256, 256), tnn.ReLU(), tnn.Linear(256, 10),
        )
    if world > 1:
        import torch.distributed as dist

        host, port = os.environ["SPMDKIT_COORDINATOR"].rsplit(":", 1)
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(int(port) + 1))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        net = tnn.parallel.DistributedDataParallel(net)
    if a.compile:
        net = torch.compile(net)
    x, y = _data(a.model, a.batch)
    per = a.batch // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    xt = torch.from_numpy(x if a.model == "mlp" else np.transpose(x, (0, 3, 1, 2)).copy())
    yt = torch.from_numpy(y.astype(np.int64))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        tnn.functional.cross_entropy(net(xt), yt).backward()
        opt.step()

    return _timed(step, a.steps, lambda _: None)  # eager CPU: the step has finished when it returns


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=("jax", "torch"), required=True)
    p.add_argument("--model", choices=("mlp", "cnn"), required=True)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--impl", default="auto", help="the strategy's impl (with --allreduce strategy)")
    p.add_argument("--allreduce", choices=("strategy", "leaf", "packed", "bucketed"), default="strategy")
    p.add_argument("--buckets", type=int, default=4)
    p.add_argument("--grad-dtype", choices=("f32", "bf16", "f16"), default="f32")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--donate", action="store_true", help="the strategy's step with donate=True (the state's memory reused)")
    p.add_argument("--threads", type=int, default=0, help="cores for this process (0: all it has)")
    p.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS")
    p.add_argument("--cpu-collectives", default=None, help="jax_cpu_collectives_implementation")
    p.add_argument("--torch-threads", type=int, default=None, help="0: PyTorch's default; unset: cores / processes")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.batch % a.accum:
        raise SystemExit(f"--batch {a.batch} is not a multiple of --accum {a.accum}")
    pinned = _pin(a.threads)  # before JAX starts: XLA sizes its thread pool from the affinity
    if a.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {a.xla_flags}".strip()
    times = run_jax(a) if a.framework == "jax" else run_torch(a)
    rank, world = _rank_world()
    if rank == 0:
        step_s = sum(times) / len(times)
        config = {k: v for k, v in vars(a).items()} | {"processes": world, "cores": pinned}
        print(json.dumps({"samples_per_s": a.batch / step_s, "step_s": step_s, "step_times": times,
                          "config": config}), flush=True)


if __name__ == "__main__":
    main()
