"""One process of the multi-process benchmark: trains a model for N steps, prints samples/s.

Run by ``spmdkit bench --suite multiprocess`` directly (one process) or under
``spmdkit launch`` (several, joined by jax.distributed; torch uses gloo on the next port).
Process 0 prints one JSON line ``{"samples_per_s": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def _data(model: str, batch: int):
    rng = np.random.default_rng(0)
    if model == "mlp":
        return rng.standard_normal((batch, 784)).astype(np.float32), rng.integers(0, 10, batch).astype(np.int32)
    from spmdkit._tasks.digits import load

    train, _ = load()
    idx = rng.integers(0, len(train["label"]), batch)
    return train["image"][idx], train["label"][idx]


def run_jax(model: str, batch: int, steps: int, impl: str, accum: int) -> float:
    from spmdkit._launch import initialize_distributed

    initialize_distributed()
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from spmdkit._strategies import DataParallel
    from spmdkit._tasks.digits import CNN

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(1024)(x))
            x = nn.relu(nn.Dense(1024)(x))
            return nn.Dense(10)(x)

    net = MLP() if model == "mlp" else CNN()
    x, y = _data(model, batch)

    def loss_fn(params, b, rng):
        logits = net.apply({"params": params}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), {}

    opt = optax.sgd(0.01)
    strategy = DataParallel(impl=impl)
    state = strategy.init_state(lambda k: net.init(k, jnp.asarray(x[:1]))["params"], opt, jax.random.key(0))
    step = strategy.train_step(loss_fn, opt, accum=accum)
    host = {"x": x, "y": y}
    rng = jax.random.key(1)
    for _ in range(5):
        state, _ = step(state, *strategy.put_batch(host), rng)
        jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, _ = step(state, *strategy.put_batch(host), rng)
        jax.block_until_ready(state)  # every step: the CPU collective rule
    return batch * steps / (time.perf_counter() - t0)


def run_torch(model: str, batch: int, steps: int) -> float:
    import torch
    import torch.nn as tnn

    world = int(os.environ.get("SPMDKIT_NUM_PROCESSES", "1"))
    rank = int(os.environ.get("SPMDKIT_PROCESS_ID", "0"))
    torch.set_num_threads(max(1, 2 // world))
    torch.manual_seed(0)
    if model == "mlp":
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
    x, y = _data(model, batch)
    per = batch // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    xt = torch.from_numpy(x if model == "mlp" else np.transpose(x, (0, 3, 1, 2)).copy())
    yt = torch.from_numpy(y.astype(np.int64))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        tnn.functional.cross_entropy(net(xt), yt).backward()
        opt.step()

    for _ in range(5):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=("jax", "torch"), required=True)
    p.add_argument("--model", choices=("mlp", "cnn"), required=True)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--impl", default="auto")
    p.add_argument("--accum", type=int, default=1)
    a = p.parse_args()
    if a.framework == "jax":
        rate = run_jax(a.model, a.batch, a.steps, a.impl, a.accum)
    else:
        rate = run_torch(a.model, a.batch, a.steps)
    if int(os.environ.get("SPMDKIT_PROCESS_ID", "0")) == 0:
        print(json.dumps({"samples_per_s": rate}), flush=True)


if __name__ == "__main__":
    main()
