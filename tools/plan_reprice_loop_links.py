"""A measured plan's ranking scored again with its in-process all-reduces and all-gathers priced
as before the cpu target timed them between computation (BENCHMARKS.md, "plan", runs z-z3):
the loop's link over the ring's steps plus the target's ``collective_sync_ops`` wait, the same
measurements against both pricings.

    python tools/plan_reprice_loop_links.py /tmp/plans3/six_*_z.json

Prints per file: the recorded Spearman, the same recomputed from the candidates' collectives
(a check of this script), and the old way's; each with the planner's rank of the measured fastest.
"""

import dataclasses
import json
import math
import sys

from spmdkit._plan._cost import collective_costs
from spmdkit._plan._hlo import Collective, Program
from spmdkit._plan._report import spearman
from spmdkit._target import from_json


def without_groups(target):
    plain = lambda link: dataclasses.replace(link, groups=())  # noqa: E731
    return dataclasses.replace(target, links={k: plain(v) for k, v in target.links.items()},
                               collectives={k: {n: plain(v) for n, v in per.items()}
                                            for k, per in target.collectives.items()})


def step_seconds(row, devices_per_host, loop_target=None):
    """The candidate's step time as the planner forms it (:func:`spmdkit._plan._cost.step_time`'s
    range), its in-process all-reduces and all-gathers priced again by ``loop_target`` through the
    planner's own :func:`collective_costs` (the wait included) when given."""
    op_seconds = row["compute_s"] / row["ops"] if row["ops"] else 0.0
    collectives = row["collectives"]
    if loop_target is not None:
        again = [c for c in collectives if c["link"] == "intra_host" and c["kind"] in ("all_reduce", "all_gather")]
        program = Program([Collective(c["kind"], c["bytes"], c["group_size"], tuple(c["axes"]), c["count"],
                                      (tuple(range(c["group_size"])),), c["kind"], c["operands"]) for c in again],
                          0.0, 0.0, 0.0, 0)
        priced = collective_costs(program, loop_target, devices_per_host, op_seconds)
        collectives = [c for c in collectives if c not in again] + [{**c, "seconds": p["seconds"]}
                                                                     for c, p in zip(again, priced)]
    comm = sum(c["seconds"] for c in collectives)
    prefetched = sum(c["seconds"] for c in collectives if c["prefetched"])
    low = max(row["compute_s"], prefetched) + comm - prefetched
    high = row["compute_s"] + comm
    return math.sqrt(low * high)


def main(paths):
    for path in paths:
        plan = json.load(open(path))
        runs = plan["measured"]["runs"]
        rows = {r["label"]: r for r in plan["candidates"] if r["status"] == "ok"}
        measured = [m["measured_relative"] for m in runs]
        fastest = min(range(len(runs)), key=lambda i: measured[i])
        scores = []
        for loop_target in (None, without_groups(from_json(plan["target"]["file"]))):
            priced = [step_seconds(rows[m["label"]], plan["devices_per_host"], loop_target) for m in runs]
            scores.append(f"{spearman(priced, measured):.3f} / {sorted(priced).index(priced[fastest]) + 1}")
        print(f"{path}: recorded {plan['measured']['spearman']:.3f}; recomputed {scores[0]}; loop links {scores[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
