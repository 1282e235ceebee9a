"""``spmdkit bench --suite data``: the data-parallel step against hand-written ones.

Same devices, model, optimizer and global batch for every case; each call starts
from a host (numpy) batch, as in a training loop, and is synced before the next.

- ``spmdkit jit`` / ``spmdkit shard_map``: ``DataParallel(impl=...)``: put_batch + step.
- ``hand jit``: ``jax.jit`` of a plain step with the same NamedShardings, batch put
  with ``jax.device_put`` (what a user would write without spmdkit).
- ``seed-002 pmap``: ``jax.pmap`` + ``lax.pmean`` of the gradients, parameters and
  optimizer state stacked per device, the batch reshaped to ``[n, B/n, ...]``.

Also the single-device digits step's achieved FLOP/s (``cost_analysis``) against an
f32 GEMM measured in the same run.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdkit._bench._timing import interleaved, machine
from spmdkit._strategies import DataParallel, Single
from spmdkit._tasks import digits, linreg

TARGET_HAND = 1.02
TARGET_PMAP = 1.0


def _hand_jit(task, opt, mesh, state):
    repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def step(state, batch):
        (loss, aux), grads = jax.value_and_grad(task.loss_fn, has_aux=True)(state.params, batch, None)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        return state._replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state), loss

    compiled = jax.jit(step, in_shardings=(repl, split), out_shardings=(repl, repl))
    placed = jax.device_put(state, repl)
    return lambda host: compiled(placed, jax.device_put(host, split))


def _seed_pmap(task, opt, n, state):
    def update(state, batch):
        (loss, aux), grads = jax.value_and_grad(task.loss_fn, has_aux=True)(state.params, batch, None)
        grads = jax.lax.pmean(grads, "num_devices")
        loss = jax.lax.pmean(loss, "num_devices")
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        return state._replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state), loss

    pmapped = jax.pmap(update, axis_name="num_devices")
    stacked = jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), jax.device_get(state))

    def split(host):
        return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), host)

    return lambda host: pmapped(stacked, split(host))


def _spmdkit(strategy, task, opt, state):
    step = strategy.train_step(task.loss_fn, opt)
    placed = jax.device_put(state, NamedSharding(strategy.mesh, P()))
    rng = jax.random.key(0)

    def call(host):
        batch, mask = strategy.put_batch(host)
        new_state, metrics = step(placed, batch, mask, rng)
        return new_state, metrics["loss"]

    return call


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", 0.0))


def gemm_peak(size: int = 2048, repeats: int = 7) -> float:
    """f32 GEMM FLOP/s on one device: the ceiling a step is measured against."""
    a = jax.device_put(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32), jax.devices()[0])
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / float(np.median(times))


def _single_device_flops(quick: bool) -> dict[str, Any]:
    task = digits.make()
    batch_size = 64 if quick else 256
    opt = optax.sgd(0.05, momentum=0.9)
    strategy = Single()
    state = strategy.init_state(task.init, opt, jax.random.key(0))
    host = jax.tree.map(lambda x: x[:batch_size], task.train_data)
    batch, mask = strategy.put_batch(host)
    step = strategy.train_step(task.loss_fn, opt)
    rng = jax.random.key(1)
    flops = _flops(step.lower(state, batch, mask, rng).compile())
    t = interleaved({"step": lambda: jax.block_until_ready(step(state, batch, mask, rng))}, rounds=5)["step"]["median"]
    peak = gemm_peak(1024 if quick else 2048)
    return {
        "batch_size": batch_size,
        "flops_per_step": flops,
        "step_s": t,
        "achieved_gflops": flops / t / 1e9,
        "gemm_peak_gflops": peak / 1e9,
        "fraction_of_peak": flops / t / peak,
    }


def run(quick: bool = False) -> dict[str, Any]:
    n = jax.local_device_count()
    rows = []
    workloads = {
        "digits CNN": (digits.make(), optax.sgd(0.05, momentum=0.9), 64 if quick else 256),
        "linreg (seed 002)": (linreg.make(), optax.sgd(0.005), 128),
    }
    ratios_hand, ratios_pmap = [], []
    for name, (task, opt, batch_size) in workloads.items():
        batch_size = batch_size // n * n
        host = jax.tree.map(lambda x: np.ascontiguousarray(x[:batch_size]), task.train_data)
        ref = DataParallel(impl="jit")
        state = ref.init_state(task.init, opt, jax.random.key(0))
        cases = {
            "spmdkit jit": _spmdkit(ref, task, opt, state),
            "spmdkit shard_map": _spmdkit(DataParallel(impl="shard_map"), task, opt, state),
            "hand jit": _hand_jit(task, opt, ref.mesh, state),
            "seed-002 pmap": _seed_pmap(task, opt, n, state),
        }
        # Same update from the same state and batch, whoever computes it.
        losses = {k: float(np.ravel(jax.device_get(f(host)[1]))[0]) for k, f in cases.items()}
        spread = max(losses.values()) - min(losses.values())
        times = interleaved(
            {k: (lambda f=f: jax.block_until_ready(f(host))) for k, f in cases.items()},
            rounds=5 if quick else 9,
        )
        hand, pm = times["hand jit"]["median"], times["seed-002 pmap"]["median"]
        for impl, t in times.items():
            rows.append(
                {
                    "workload": name,
                    "batch": batch_size,
                    "impl": impl,
                    "median_ms": t["median"] * 1e3,
                    "min_ms": t["min"] * 1e3,
                    "x_hand_jit": t["median"] / hand,
                    "x_seed_pmap": t["median"] / pm,
                    "loss_spread": spread,
                }
            )
        best = min(("spmdkit jit", "spmdkit shard_map"), key=lambda k: times[k]["median"])
        ratios_hand.append(times["spmdkit jit"]["median"] / hand)
        ratios_pmap.append(times["spmdkit jit"]["median"] / pm)
        rows[-4]["faster_impl"] = best  # noted on the first row of the workload
    geo = lambda xs: float(np.exp(np.mean(np.log(xs))))  # noqa: E731
    flops = _single_device_flops(quick)
    return {
        "suite": "data",
        "machine": machine(),
        "columns": ["workload", "batch", "impl", "median_ms", "min_ms", "x_hand_jit", "x_seed_pmap"],
        "rows": rows,
        "single_device_flops": flops,
        "targets": [
            {
                "name": "spmdkit (default impl jit) / hand-written jit, geometric mean",
                "value": geo(ratios_hand),
                "target": f"<= {TARGET_HAND}",
                "met": geo(ratios_hand) <= TARGET_HAND,
            },
            {
                "name": "spmdkit (default impl jit) / seed-002 jax.pmap + pmean, geometric mean",
                "value": geo(ratios_pmap),
                "target": f"<= {TARGET_PMAP}",
                "met": geo(ratios_pmap) <= TARGET_PMAP,
            },
        ],
        "notes": [
            f"single-device digits step (batch {flops['batch_size']}): "
            f"{flops['achieved_gflops']:.2f} GFLOP/s achieved vs {flops['gemm_peak_gflops']:.1f} GFLOP/s "
            f"f32 GEMM peak measured in this run ({flops['fraction_of_peak']:.1%} of peak)"
        ],
    }
