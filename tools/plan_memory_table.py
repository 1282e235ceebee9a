"""The planner's analytic memory count against the compiled figure, per candidate (BENCHMARKS.md,
"plan: analytic memory count vs compiled figure").

Compiles every candidate of the default rules on 8 simulated devices, as ``spmdkit plan`` does,
for the mlp and the lm at three sizes each (the lm under remat none, full and dots; accumulation
1 and 2), and prints the worst margin (analytic / compiled - 1) per model, size and policy.
Memory figures are deterministic: the machine's load does not change them.

    python tools/plan_memory_table.py [--only lm|mlp] [--sizes 0,1,2,3] [--remat none,full,dots]
        [--scan-unroll N] [--precision f32|bf16] [--json FILE]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

RULES = ("dp", "fsdp", "tp", "dp+tp", "fsdp+tp", "fsdp+sp", "hsdp+tp")
# Sizes 1-3 of each model are the three that `spmdkit plan --measure` is benchmarked at
# (BENCHMARKS.md "plan"); size 0 is a smaller one; the lm's sizes 4-6 widen the fit of its
# counts (tools/plan_memory_fit.py) to other depths, widths, heads and lengths.
LM_SIZES = [dict(layers=2, d_model=32, heads=8, seq_len=32, batch=16),
            dict(layers=2, d_model=64, heads=4, seq_len=64, batch=32),
            dict(layers=4, d_model=64, heads=4, seq_len=64, batch=32),
            dict(layers=4, d_model=128, heads=8, seq_len=128, batch=32),
            dict(layers=3, d_model=96, heads=6, seq_len=48, batch=24),
            dict(layers=2, d_model=128, heads=8, seq_len=128, batch=16),
            dict(layers=6, d_model=64, heads=4, seq_len=64, batch=16)]
MLP_SIZES = [dict(layers=2, embed=64, depth=256, batch=32),
             dict(layers=4, embed=128, depth=512, batch=64),
             dict(layers=4, embed=256, depth=1024, batch=128),
             dict(layers=8, embed=256, depth=1024, batch=128)]


def lm_plan(size: dict, remat: tuple[str, ...], accum: tuple[int, ...], scan_unroll: int | None,
            precision: str = "f32") -> dict:
    import optax

    from spmdkit._plan import plan
    from spmdkit._plan._memory import lm_activations
    from spmdkit._tasks import lm
    from spmdkit._train._steps import task_state, task_train_step

    sizes = {k: v for k, v in size.items() if k != "batch"}
    cfg = lm.LMConfig(**sizes, scan_unroll=scan_unroll, precision=precision)
    task = lm.make(**sizes, scan_unroll=scan_unroll, precision=precision,
                   text_bytes=max(size["batch"] * (cfg.seq_len + 1) * 2, 20_000))
    optimizer = optax.adamw(lm.DEFAULTS["lr"])

    def step_for(r: str, a: int):
        _, init, loss_fn = lm.lm_functions(dataclasses.replace(cfg, remat=r))
        return task_train_step(dataclasses.replace(task, init=init, loss_fn=loss_fn), optimizer, a)

    batch = jax.tree.map(lambda x: x[: size["batch"]], task.train_data)
    return plan(task_state(task, optimizer), None, batch, target="h100x8", rules=RULES, remat=remat, accum=accum,
                step_for=step_for, activations=lm_activations(cfg, size["batch"]))


def mlp_plan(size: dict, accum: tuple[int, ...]) -> dict:
    import optax

    from spmdkit._plan import plan
    from spmdkit._plan._memory import mlp_activations
    from spmdkit._tasks import mlp
    from spmdkit._train._steps import task_state, task_train_step

    sizes = {k: v for k, v in size.items() if k != "batch"}
    task = mlp.make(**sizes, num_train=512, num_eval=64)
    optimizer = optax.adam(mlp.DEFAULTS["lr"])
    batch = jax.tree.map(lambda x: x[: size["batch"]], task.train_data)
    return plan(task_state(task, optimizer), None, batch, target="h100x8", rules=RULES, accum=accum,
                step_for=lambda r, a: task_train_step(task, optimizer, a),
                activations=mlp_activations(size["batch"], **sizes))


def rows_of(result: dict, **key) -> list[dict]:
    out = []
    for r in result["candidates"]:
        if r["status"] != "ok":
            continue
        m = r["memory"]
        out.append({**key, "label": r["label"], "rules": r["rules"], "mesh": r["mesh"], "remat": r["remat"],
                    "accum": r["accum"], "compiled": m["compiled"], "margin": m["margin"],
                    "analytic": {k: v for k, v in m["analytic"].items() if k != "counted"}})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("lm", "mlp"))
    p.add_argument("--sizes", default=None, help="size numbers, e.g. 1,2,3 (default: all of each model)")
    p.add_argument("--remat", default="none,full,dots")
    p.add_argument("--accum", default="1,2")
    p.add_argument("--scan-unroll", type=int, default=None, help="lm: layers per loop iteration (default: the lm's)")
    p.add_argument("--precision", choices=("f32", "bf16"), default="f32", help="lm: compute dtype (f32)")
    p.add_argument("--json", help="write every candidate's figures here")
    p.add_argument("--table", nargs="+", metavar="JSON", help="only print the table of these --json files")
    p.add_argument("--recount", action="store_true", help="with --table: the analytic count of the code as it is "
                   "now against the stored compiled figures (compiling does not depend on the count)")
    a = p.parse_args()
    for flag, given in (("--precision", a.precision != "f32"), ("--scan-unroll", a.scan_unroll is not None)):
        if given and a.only != "lm":
            p.error(f"{flag} applies to the lm only (the mlp has one form, float32): add --only lm")
    if a.table:
        rows = [r for fn in a.table for r in json.load(open(fn))]
        table([recount(r) for r in rows] if a.recount else rows)
        return
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else None
    accum = tuple(int(s) for s in a.accum.split(","))
    rows: list[dict] = []
    started = time.time()
    for model in ("mlp", "lm"):
        if a.only not in (None, model):
            continue
        for i in sizes if sizes is not None else range(len(LM_SIZES if model == "lm" else MLP_SIZES)):
            for remat in (a.remat.split(",") if model == "lm" else ["none"]):
                res = (lm_plan(LM_SIZES[i], (remat,), accum, a.scan_unroll, a.precision) if model == "lm"
                       else mlp_plan(MLP_SIZES[i], accum))
                key = {"precision": a.precision} if model == "lm" else {}
                got = rows_of(res, model=model, size=i, unroll=a.scan_unroll, jax=jax.__version__, **key)
                rows += got
                worst = max(got, key=lambda r: abs(r["margin"]))
                print(f"{model} size {i} ({(LM_SIZES if model == 'lm' else MLP_SIZES)[i]}) remat {remat}: "
                      f"{len(got)} candidates, worst {worst['margin']:+.1%} {worst['label']} "
                      f"[{time.time() - started:.0f} s]", flush=True)
                if a.json:
                    with open(a.json, "w") as fh:
                        json.dump(rows, fh)
    table(rows)
    bad = [r for r in rows if abs(r["margin"]) > 0.10]
    print(f"{len(rows)} candidates, {len(bad)} outside 10%: "
          + ", ".join(f"{r['model']}{r['size']} {r['remat']} {r['label']} {r['margin']:+.1%}" for r in bad))
    raise SystemExit(1 if bad else 0)


def precision(row: dict) -> str:
    """The compute dtype a stored lm candidate was compiled at (files before --precision: f32)."""
    return row.get("precision", "f32")


def jax_release(row: dict) -> str:
    """The jax release a stored candidate was compiled with (files before this field: 0.12.0.1,
    the release of every sweep before it)."""
    return row.get("jax", "0.12.0.1")


def release_key(release: str) -> tuple[int, ...]:
    """A jax version string as ``LM_FITS`` keys it: its leading numeric parts, as
    ``jax.__version_info__`` reads them (a dev or rc build counts as its release).

        >>> release_key("0.12.1"), release_key("0.12.0.1"), release_key("0.12.2.dev20261201"), release_key("0.13.0rc1")
        ((0, 12, 1), (0, 12, 0, 1), (0, 12, 2), (0, 13, 0))
    """
    key = []
    for part in release.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        key.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(key)


def lm_count_args(row: dict) -> tuple:
    """``lm_memory``'s arguments for a stored lm candidate: (config, rows, remat, accum, rules table, mesh)."""
    from spmdkit._plan._candidates import rules_table
    from spmdkit._tasks import lm

    size = LM_SIZES[row["size"]]
    cfg = lm.LMConfig(**{k: v for k, v in size.items() if k != "batch"}, scan_unroll=row.get("unroll"),
                      precision=precision(row))
    return (cfg, size["batch"] // row["accum"], row["remat"], row["accum"], list(rules_table(row["rules"]).table),
            dict(row["mesh"]))


def state_and_batch(row: dict) -> int:
    """The count's part that does not depend on the model: the state in and out, the batch's share."""
    return 2 * row["analytic"]["new_state"] + row["analytic"]["batch"]


def recount(row: dict) -> dict:
    from spmdkit._plan._candidates import rules_table
    from spmdkit._plan._memory import held_in_new_parameters, lm_counts, lm_memory, mlp_memory

    if row["model"] == "lm":
        # the counts of the release that compiled the row, not of the running jax
        args = lm_count_args(row)
        release = release_key(jax_release(row))
        parts = held_in_new_parameters(lm_memory(*args, counts=lm_counts(args[0], row["remat"], release)))
    else:
        size = MLP_SIZES[row["size"]]
        parts = mlp_memory(size["layers"], size["depth"], size["embed"], size["batch"] // row["accum"], row["accum"],
                           list(rules_table(row["rules"]).table), dict(row["mesh"]))
    total = state_and_batch(row) + sum(parts.values())
    analytic = {**row["analytic"], "activation_parts": parts, "activations": sum(parts.values()), "total": total}
    return {**row, "analytic": analytic, "margin": total / row["compiled"]["total"] - 1}


def table(rows: list[dict]) -> None:
    """The BENCHMARKS.md table: the worst margin per model, size and remat policy (of one
    precision and program form: their cells would merge)."""
    for what, key in (("precisions", precision), ("program forms", lambda r: r.get("unroll"))):
        seen = {key(r) for r in rows if r["model"] == "lm"}
        if len(seen) > 1:
            raise SystemExit(f"these files hold lm candidates of {len(seen)} {what} ({sorted(map(str, seen))}): their "
                             "cells would merge; print one table per --precision and --scan-unroll")
    print("| model, size | candidates | remat none | remat full | remat dots |\n| --- | --- | --- | --- | --- |")
    for model, sizes in (("mlp", MLP_SIZES), ("lm", LM_SIZES)):
        for i, size in enumerate(sizes):
            cells, count = [], set()
            for remat in ("none", "full", "dots"):
                got = [r for r in rows if r["model"] == model and r["size"] == i and r["remat"] == remat]
                if not got:
                    cells.append("")
                    continue
                count.add(f"{len(got)} (accum {', '.join(str(a) for a in sorted({r['accum'] for r in got}))})")
                w = max(got, key=lambda r: abs(r["margin"]))
                mark = "**" if abs(w["margin"]) > 0.10 else ""
                cells.append(f"{mark}{w['margin']:+.1%}{mark} {w['label'].replace(' remat=' + remat, '')}")
            if count:
                name = (f"{size['layers']} layers, d {size['d_model']}, {size['heads']} heads, seq {size['seq_len']}"
                        if model == "lm" else f"{size['layers']} layers {size['embed']}-{size['depth']}-{size['embed']}")
                print(f"| {model} {name}, batch {size['batch']} | {' / '.join(sorted(count))} | "
                      + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
