"""``spmdkit bench --suite data``: the data-parallel step against hand-written ones.

Same devices, model, optimizer and global batch for every case; each call starts
from a host (numpy) batch, as in a training loop, and is synced before the next.

- ``spmdkit jit``: ``DataParallel().step`` of the task's single-device train step (what
  ``fit`` runs), from a host batch.
- ``hand jit``: ``jax.jit`` of a plain step with the same NamedShardings, batch put
  with ``jax.device_put`` (what a user would write without spmdkit).
- ``seed-002 pmap``: ``jax.pmap`` + ``lax.pmean`` of the gradients, parameters and
  optimizer state stacked per device, the batch reshaped to ``[n, B/n, ...]``.

Also the achieved FLOP/s (``cost_analysis``) of two single-device steps, the MLP
784-1024-1024-10 (the multiprocess suite's model; target >= 0.8 of the GEMM rate) and the
digits CNN, against an f32 GEMM timed in the same interleaved rounds.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdkit._bench._timing import case_row, geomean, machine, measure, ratio, target
from spmdkit._bench.report import collect
from spmdkit._strategies import DataParallel, Single
from spmdkit._tasks import digits, linreg
from spmdkit._train._steps import task_state, task_train_step

TARGET_HAND = 1.02
TARGET_PMAP = 1.0
TARGET_FLOPS = 0.8  # the MLP step's FLOP/s over the f32 GEMM rate of the same rounds


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
    step = strategy.step(task_train_step(task, opt))
    placed = jax.device_put(state, NamedSharding(strategy.mesh, P()))

    def call(host):
        new_state, metrics = step(placed, host)
        return new_state, metrics["loss"]

    return call


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", 0.0))


def _gemm(size: int):
    """A zero-argument f32 GEMM on one device and its FLOP count: the ceiling a step is measured against."""
    a = jax.device_put(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32), jax.devices()[0])
    mm = jax.jit(lambda x: x @ x)
    return (lambda: mm(a).block_until_ready()), 2 * size**3


def _mlp_step(batch_size: int):
    """One SGD step of the MLP 784-1024-1024-10 (the multiprocess suite's model) on one device."""
    from spmdkit._bench.mp_worker import _flax_net

    net, opt = _flax_net("mlp"), optax.sgd(0.01)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((batch_size, 784)).astype(np.float32), jax.devices()[0])
    y = jax.device_put(rng.integers(0, 10, batch_size).astype(np.int32), jax.devices()[0])
    params = net.init(jax.random.key(0), x[:1])["params"]
    opt_state = opt.init(params)

    def step(params, opt_state, x, y):
        loss_fn = lambda p: optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, x), y).mean()  # noqa: E731
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = jax.jit(step).lower(params, opt_state, x, y).compile()
    return (lambda: jax.block_until_ready(compiled(params, opt_state, x, y))), _flops(compiled)


def _digits_step(batch_size: int):
    task = digits.make()
    opt = optax.sgd(0.05, momentum=0.9)
    strategy = Single()
    state = strategy.init(task_state(task, opt), jax.random.key(0), unbox=True)
    batch = jax.device_put(jax.tree.map(lambda x: x[:batch_size], task.train_data), jax.devices()[0])
    compiled = strategy.step(task_train_step(task, opt)).lower(state, batch).compile()
    return (lambda: jax.block_until_ready(compiled(state, batch))), _flops(compiled)


def _single_device_flops(quick: bool, rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each step's FLOP/s over the GEMM rate, all timed in the same interleaved rounds.

    fraction = (flops / t_step) / (gemm_flops / t_gemm), per round, so a slow round slows both.
    """
    sizes = {"mlp": 128 if quick else 512, "digits": 64 if quick else 256}
    steps = {
        f"MLP 784-1024-1024-10 step, batch {sizes['mlp']}": _mlp_step(sizes["mlp"]),
        f"digits CNN step, batch {sizes['digits']}": _digits_step(sizes["digits"]),
    }
    gemm, gemm_flops = _gemm(1024 if quick else 2048)
    cases = {name: fn for name, (fn, _) in steps.items()}
    cases["f32 GEMM"] = gemm
    run = measure(cases, rounds=rounds)
    g = run["cases"]["f32 GEMM"]["median"]
    out = {"gemm_gflops": gemm_flops / g / 1e9}
    for name, (_, flops) in steps.items():
        r = ratio(run, "f32 GEMM", name)
        scale = flops / gemm_flops
        t = run["cases"][name]["median"]
        out[name] = {
            "flops_per_step": flops,
            "step_s": t,
            "achieved_gflops": flops / t / 1e9,
            "fraction_of_gemm": r["median"] * scale,
            "fraction_of_gemm_iqr": [r["q1"] * scale, r["q3"] * scale],
            "flags": r["flags"],
        }
    return out, run


def _workload(name: str, task, opt, batch_size: int, rounds: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One workload's step by spmdkit, by hand-written jit and by seed 002's pmap, timed
    interleaved: the timings and a table row per implementation."""
    n = jax.local_device_count()
    host = jax.tree.map(lambda x: np.ascontiguousarray(x[:batch_size]), task.train_data)
    ref = DataParallel()
    state = ref.init(task_state(task, opt), jax.random.key(0), unbox=True)
    cases = {
        "spmdkit jit": _spmdkit(ref, task, opt, state),
        "hand jit": _hand_jit(task, opt, ref.mesh, state),
        "seed-002 pmap": _seed_pmap(task, opt, n, state),
    }
    # Same update from the same state and batch, whoever computes it.
    losses = {k: float(np.ravel(jax.device_get(f(host)[1]))[0]) for k, f in cases.items()}
    spread = max(losses.values()) - min(losses.values())
    times = measure(
        {k: (lambda f=f: jax.block_until_ready(f(host))) for k, f in cases.items()},
        rounds=rounds,
    )
    rows = []
    for impl in cases:
        rh, rp = ratio(times, impl, "hand jit"), ratio(times, impl, "seed-002 pmap")
        c = case_row(times, impl)
        rows.append(
            {
                "workload": name,
                "batch": batch_size,
                "impl": impl,
                "median_ms": c["median"],
                "iqr_pct": c["iqr_pct"],
                "min_ms": c["min"],
                "max_ms": c["max"],
                "x_hand_jit": rh["median"],
                "x_seed_pmap": rp["median"],
                "flag": ",".join(sorted(set(c["flag"].split(",") + rh["flags"]) - {""})),
                "loss_spread": spread,
            }
        )
    return times, rows


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    rounds = rounds or (5 if quick else 9)
    n = jax.local_device_count()
    runs: dict[str, dict[str, Any]] = {}
    rows = []
    workloads = {
        "digits CNN": (digits.make(), optax.sgd(0.05, momentum=0.9), 64 if quick else 256),
        "linreg (seed 002)": (linreg.make(), optax.sgd(0.005), 128),
    }
    ratios_hand, ratios_pmap = [], []
    for name, (task, opt, batch_size) in workloads.items():
        times, workload_rows = _workload(name, task, opt, batch_size // n * n, rounds)
        runs[name] = times
        rows += workload_rows
        ratios_hand.append(ratio(times, "spmdkit jit", "hand jit"))
        ratios_pmap.append(ratio(times, "spmdkit jit", "seed-002 pmap"))
    flops, flops_run = _single_device_flops(quick, rounds)
    runs["single-device step vs GEMM"] = flops_run
    report = {
        "suite": "data",
        "machine": machine(),
        "columns": ["workload", "batch", "impl", "median_ms", "iqr_pct", "min_ms", "max_ms", "x_hand_jit",
                    "x_seed_pmap", "flag"],
        "rows": rows,
        "single_device_flops": flops,
        "targets": [
            target("spmdkit (default impl jit) / hand-written jit, geometric mean of paired ratios",
                   geomean(ratios_hand), "<=", TARGET_HAND),
            target("spmdkit (default impl jit) / seed-002 jax.pmap + pmean, geometric mean of paired ratios",
                   geomean(ratios_pmap), "<=", TARGET_PMAP),
        ]
        + [
            target(f"{name} FLOP/s / f32 GEMM FLOP/s (same rounds, one device)",
                   {"median": f["fraction_of_gemm"], "q1": f["fraction_of_gemm_iqr"][0],
                    "q3": f["fraction_of_gemm_iqr"][1], "flags": f["flags"]}, ">=", TARGET_FLOPS)
            for name, f in flops.items() if name.startswith("MLP")
        ],
        "notes": [
            f"{name}: {f['achieved_gflops']:.2f} GFLOP/s vs {flops['gemm_gflops']:.1f} GFLOP/s f32 GEMM "
            f"in the same rounds ({f['fraction_of_gemm']:.1%} of it)"
            for name, f in flops.items() if name != "gemm_gflops"
        ],
    }
    return collect(report, runs)

