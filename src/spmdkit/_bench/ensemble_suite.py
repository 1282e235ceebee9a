"""``spmdkit bench --suite ensemble``: K members at once vs one after another.

For K = 8 digits CNNs (the seed's ensemble), one training step of every member:
- ``spmdkit ensemble, 1 device``: all 8 members vectorised (vmap) on one device;
- ``spmdkit ensemble, N devices``: members spread one per device;
- ``sequential jit``: a plain jitted single-model step called 8 times, one per member,
  on one device (what a user does without an ensemble strategy).
Each call starts from the host batch and is synced. ``members_per_s`` = K / time.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import inspect

from spmdkit._bench._timing import case_row, machine, measure, ratio, target
from spmdkit._bench.report import collect

from spmdkit._strategies import Ensemble, Single
from spmdkit._strategies.ensemble import MEMBER_LOOPS
from spmdkit._tasks import digits
from spmdkit._train._steps import task_state, task_train_step

MEMBERS = 8
DEFAULT_LOOP = inspect.signature(Ensemble).parameters["member_loop"].default
TARGET_ONE_DEVICE = 1.0  # ensemble time / sequential time on the same single device


def _ensemble_case(ensemble: Ensemble, task, opt, host):
    state = ensemble.init(task_state(task, opt), jax.random.key(0), unbox=True)
    step = ensemble.step(task_train_step(task, opt))

    def call():
        return jax.block_until_ready(step(state, host))

    return call


def _sequential_case(task, opt, host, members: int):
    single = Single()
    states = [single.init(task_state(task, opt), k, unbox=True) for k in jax.random.split(jax.random.key(0), members)]
    sharding = NamedSharding(single.mesh, P())

    def plain(state, batch):
        (loss, _), grads = jax.value_and_grad(task.loss_fn, has_aux=True)(state.params, batch, None)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        return state._replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state), loss

    step = jax.jit(plain, out_shardings=sharding)

    def call():
        batch = jax.device_put(host, sharding)
        return jax.block_until_ready([step(s, batch) for s in states])

    return call


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    task = digits.make()
    opt = optax.sgd(0.05, momentum=0.9)
    batch_size = 32 if quick else 64
    host = jax.tree.map(lambda x: np.ascontiguousarray(x[:batch_size]), task.train_data)
    n = jax.device_count()
    one_device = jax.devices()[:1]
    cases = {
        f"spmdkit ensemble ({loop}), 1 device": _ensemble_case(
            Ensemble(MEMBERS, devices=one_device, member_loop=loop), task, opt, host
        )
        for loop in MEMBER_LOOPS
    }
    cases[f"spmdkit ensemble, {min(n, MEMBERS)} devices"] = _ensemble_case(Ensemble(MEMBERS), task, opt, host)
    cases["sequential jit, 1 device"] = _sequential_case(task, opt, host, MEMBERS)
    times = measure(cases, rounds=rounds or (5 if quick else 9))
    base = "sequential jit, 1 device"
    rows = []
    for name in cases:
        c, r = case_row(times, name), ratio(times, name, base)
        rows.append(
            {
                "impl": name,
                "members": MEMBERS,
                "batch": batch_size,
                "median_ms": c["median"],
                "iqr_pct": c["iqr_pct"],
                "min_ms": c["min"],
                "max_ms": c["max"],
                "members_per_s": MEMBERS / times["cases"][name]["median"],
                "x_sequential": r["median"],
                "flag": ",".join(sorted(set(c["flag"].split(",") + r["flags"]) - {""})),
            }
        )
    one = ratio(times, f"spmdkit ensemble ({DEFAULT_LOOP}), 1 device", base)
    report = {
        "suite": "ensemble",
        "machine": machine(),
        "columns": ["impl", "members", "batch", "median_ms", "iqr_pct", "min_ms", "max_ms", "members_per_s",
                    "x_sequential", "flag"],
        "rows": rows,
        "targets": [
            target(f"ensemble of 8 on 1 device (default member_loop={DEFAULT_LOOP}) / "
                   "8 sequential jitted steps on 1 device (time, paired per round)", one, "<", TARGET_ONE_DEVICE)
        ],
    }
    return collect(report, {"ensemble": times})
