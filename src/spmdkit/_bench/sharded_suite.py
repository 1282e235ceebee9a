"""``spmdkit bench --suite sharded``: layouts of the seed's MLP, and scan vs loop compile time.

Per layout (dp, fsdp, tp, dp+tp, fsdp+tp on 8 devices): time to compile the train step,
step time (host batch in, synced), per-device memory from ``memory_analysis``, and the
step time against a hand-written ``jax.jit`` step with the very same shardings.
Then the compile time of the scanned and the looped MLP for 4, 16 and 32 layers.
"""

from __future__ import annotations

import time
from typing import Any

import flax.linen as nn
import jax
import optax

from spmdkit._bench._timing import geomean, machine, measure, ratio, target
from spmdkit._bench.report import collect
from spmdkit._mesh import make_mesh
from spmdkit._rules import DEFAULT_MESH, AxisRules
from spmdkit._strategies.sharded import Sharded
from spmdkit._tasks import mlp
from spmdkit._train._steps import task_state, task_train_step

TARGET = 1.02
LAYOUTS = ("dp", "fsdp", "tp", "dp+tp", "fsdp+tp")


def _hand_jit(task, opt, strategy: Sharded, state):
    """What a user writes with jax.jit directly: same shardings, same contexts."""
    shardings = jax.tree.map(lambda x: x.sharding, state)

    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: task.loss_fn(p, batch, None)[0])(state.params)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        return state._replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state), loss

    compiled = jax.jit(step, in_shardings=(shardings, strategy._batch), out_shardings=(shardings, strategy._replicated))
    rules = strategy.rules.flax_rules()

    def call(host):
        with jax.set_mesh(strategy.mesh), nn.logical_axis_rules(rules):
            return compiled(state, jax.device_put(host, strategy._batch))

    return call


def _compile_seconds(fn, *args) -> tuple[float, Any]:
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return time.perf_counter() - t0, compiled


def _compile_times(quick: bool, opt) -> list[dict[str, Any]]:
    """Seconds to compile the dp+tp step of deeper and deeper MLPs, with nn.scan and without."""
    compile_rows = []
    for n_layers in (4, 16) if quick else (4, 16, 32):
        entry: dict[str, Any] = {"layers": n_layers}
        for scan in (True, False):
            t = mlp.make(layers=n_layers, depth=256, embed=64, scan=scan, num_train=32, num_eval=32)
            strategy = Sharded(make_mesh(data=2, model=4), AxisRules.preset("dp+tp"))
            state = strategy.init(task_state(t, opt), jax.random.key(0), unbox=True)
            entry["scan_s" if scan else "loop_s"], _ = _compile_seconds(
                strategy.step(task_train_step(t, opt)), state, t.train_data
            )
        compile_rows.append(entry)
    return compile_rows


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    layers, depth, embed, batch_size = (2, 256, 64, 32) if quick else (4, 1024, 256, 64)
    task = mlp.make(layers=layers, depth=depth, embed=embed, num_train=batch_size, num_eval=batch_size)
    opt = optax.adam(1e-3)
    host = task.train_data
    rows, ratios, runs = [], [], {}
    for name in LAYOUTS:
        strategy = Sharded(make_mesh(**DEFAULT_MESH[name]), AxisRules.preset(name))
        state = strategy.init(task_state(task, opt), jax.random.key(0), unbox=True)
        step = strategy.step(task_train_step(task, opt))
        seconds, compiled = _compile_seconds(step, state, host)
        mem = compiled.memory_analysis()

        def ours(step=step, state=state):
            return jax.block_until_ready(step(state, host))

        hand_call = _hand_jit(task, opt, strategy, state)
        times = measure(
            {"spmdkit": ours, "hand jit": lambda: jax.block_until_ready(hand_call(host))},
            rounds=rounds or (5 if quick else 9),
        )
        runs[name] = times
        r = ratio(times, "spmdkit", "hand jit")
        ratios.append(r)
        ours_t = times["cases"]["spmdkit"]
        rows.append(
            {
                "layout": name,
                "mesh": ",".join(f"{k}={v}" for k, v in strategy.mesh.shape.items()),
                "compile_s": seconds,
                "step_ms": ours_t["median"] * 1e3,
                "iqr_pct": 100 * ours_t["iqr_rel"],
                "hand_ms": times["cases"]["hand jit"]["median"] * 1e3,
                "x_hand_jit": r["median"],
                "args_mib": mem.argument_size_in_bytes / 2**20,
                "temp_mib": mem.temp_size_in_bytes / 2**20,
                "flag": ",".join(sorted(set(ours_t["flags"]) | set(r["flags"]))),
            }
        )
    compile_rows = _compile_times(quick, opt)
    geo = geomean(ratios)
    flat = compile_rows[-1]["scan_s"] / compile_rows[0]["scan_s"]
    report = {
        "suite": "sharded",
        "machine": machine(),
        "columns": ["layout", "mesh", "compile_s", "step_ms", "iqr_pct", "hand_ms", "x_hand_jit", "args_mib",
                    "temp_mib", "flag"],
        "rows": rows,
        "compile_columns": ["layers", "scan_s", "loop_s"],
        "compile_rows": compile_rows,
        "targets": [
            target(f"spmdkit sharded step / hand-written jit with the same shardings, geometric mean over "
                   f"{len(LAYOUTS)} layouts of paired ratios", geo, "<=", TARGET),
        ],
        "notes": [
            f"MLP {layers} layers, depth {depth}, embed {embed}, global batch {batch_size}, Adam",
            "compile time, dp+tp on data=2,model=4, depth 256: "
            + "; ".join(f"{r['layers']} layers: scan {r['scan_s']:.2f} s, loop {r['loop_s']:.2f} s" for r in compile_rows)
            + f" (scan from {compile_rows[0]['layers']} to {compile_rows[-1]['layers']} layers: x{flat:.2f}); "
            "compile times are single measurements, not rounds",
        ],
    }
    return collect(report, runs)
