"""Time the built-in MLP's train step under layouts the planner does not enumerate, over 2
processes (BENCHMARKS.md, "plan", runs o and p): what the collectives of one mesh axis cost in a
step, as one layout against the same mesh with that axis left unused.

    spmdkit launch -n 2 --host-devices-per-process 4 -- python tools/layout_steps.py

Each layout runs 3 steps per round, in ``ROUNDS`` (20) rotated rounds; a step counts as long as
the slower process took. Process 0 prints each layout's median and interquartile range.
"""

import argparse
import os
import statistics
import time

import spmdkit

if os.environ.get("SPMDKIT_COORDINATOR"):
    spmdkit.initialize()

import jax  # noqa: E402

from spmdkit._mesh import make_mesh  # noqa: E402
from spmdkit._plan import _host  # noqa: E402
from spmdkit._plan._candidates import rules_table  # noqa: E402
from spmdkit._plan._processes import slowest  # noqa: E402
from spmdkit._plan_cli import _mlp  # noqa: E402
from spmdkit._strategies._base import put_global  # noqa: E402
from spmdkit._strategies.sharded import Sharded  # noqa: E402

HSDP = {"batch": ("data", "fsdp"), "embed": "fsdp", "hidden": None, "layer": None}
DP_OVER_BOTH = {"batch": ("data", "fsdp"), "embed": None, "hidden": None, "layer": None}
LAYOUTS = [  # (name, rules, mesh in device order); "x": an axis that splits nothing
    ("hsdp+tp", "hsdp+tp", {"data": 2, "fsdp": 2, "model": 2}),
    ("hsdp+tp, fsdp pairs adjacent", "hsdp+tp", {"data": 2, "model": 2, "fsdp": 2}),
    ("dp+tp, x unused", "dp+tp", {"data": 2, "x": 2, "model": 2}),
    ("dp+tp, x unused, model pairs strided", "dp+tp", {"data": 2, "model": 2, "x": 2}),
    ("hsdp (no tp), x unused", HSDP, {"data": 2, "fsdp": 2, "x": 2}),
    ("batch over data+fsdp, embed replicated", DP_OVER_BOTH, {"data": 2, "fsdp": 2, "x": 2}),
]


def build(rules, mesh, make_state, step_for, batch):
    strategy = Sharded(make_mesh(**mesh), rules if isinstance(rules, dict) else rules_table(rules))
    state = strategy.init(make_state, 0, unbox=True)
    real = put_global(jax.tree.map(_host, batch), strategy._batch_sharding(True))
    step = strategy.step(step_for("none", 1))
    for _ in range(2):  # compile and warm up
        jax.block_until_ready(step(state, real))
    return lambda: jax.block_until_ready(step(state, real))


def main() -> None:
    task, make_state, step_for, _ = _mlp(argparse.Namespace(layers=None, depth=None, embed=None), 256)
    batch = jax.tree.map(lambda x: x[:256], task.train_data)
    runs = [(name, build(rules, mesh, make_state, step_for, batch)) for name, rules, mesh in LAYOUTS]
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    for r in range(int(os.environ.get("ROUNDS", 20))):
        for name, run in runs[r % len(runs):] + runs[: r % len(runs)]:
            steps = []
            for _ in range(3):
                start = time.perf_counter()
                run()
                steps.append(time.perf_counter() - start)
            times[name].append(statistics.median(slowest(steps, None)[0]))
    if jax.process_index() == 0:
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=4)
            print(f"{name:42s} median {statistics.median(ts) * 1e3:7.1f} ms  IQR {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}")


if __name__ == "__main__":
    main()
