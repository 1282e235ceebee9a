"""The plan as a table, a frontier, reasons for the winner, a PNG, and measured checks."""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from spmdkit._console import readable_bytes, readable_bytes_up
from spmdkit._errors import SpmdkitError, first_line, fix
from spmdkit._plan._drift import links_line


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3f}" if abs(ms) >= 0.01 or ms == 0 else f"{ms:.2g}"


def _ms_range(low: float, high: float) -> str:
    """``low-high`` in ms, or one figure when the two print alike (no collective to overlap)."""
    a, b = _ms(low), _ms(high)
    return a if a == b else f"{a}-{b}"


def pareto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Candidates no other beats on both per-device memory and step time, by memory."""
    ok = [r for r in rows if r["status"] == "ok"]
    front = [r for r in ok if not any(
        o is not r and o["memory"]["per_device"] <= r["memory"]["per_device"] and o["step_s"] <= r["step_s"]
        and (o["memory"]["per_device"] < r["memory"]["per_device"] or o["step_s"] < r["step_s"]) for o in ok)]
    return sorted(front, key=lambda r: r["memory"]["per_device"])


_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A",
          "collective_permute": "CP"}


def _by_kind(row: dict[str, Any]) -> dict[tuple[str, str], dict[str, float]]:
    out: dict[tuple[str, str], dict[str, float]] = {}
    for c in row.get("collectives", []):
        key = (c["kind"], "+".join(c["axes"]) or "-")
        slot = out.setdefault(key, {"seconds": 0.0, "bytes": 0.0, "count": 0, "across_hosts": False})
        slot["across_hosts"] = slot["across_hosts"] or c.get("link") == "inter_host"
        slot["seconds"] += c["seconds"]
        slot["bytes"] += c["bytes"] * c["count"]
        slot["count"] += c["count"]
    return out


def _no_fit_hints(plan: dict[str, Any]) -> list[str]:
    """What would let a candidate fit, from the reasons all of them were excluded for."""
    rows, batch = plan["candidates"], plan.get("global_batch")
    reasons = [r.get("reason") or "" for r in rows]
    hints = []
    # Each such reason ends "... = N": the batch shards x accumulation steps that must divide the batch.
    # The hint once rounded up to the device count alone: "e.g. 16 rows" for a batch of 16 that
    # 2 devices x 3 accumulation steps could not split.
    needs = [int(m.group(1)) for r in reasons if (m := re.search(r"is not divisible by .* = (\d+)$", r))]
    if batch and needs:
        rows_fit = min(-(-batch // k) * k for k in needs)
        hints.append(f"a global batch that a candidate's batch shards x accumulation steps divide, e.g. {rows_fit} rows "
                     f"(--batch-size {rows_fit})")
    over = [r["memory"]["per_device"] for r in rows if r["status"] == "over_budget"]
    if over:
        # Rounded up: "64.6 KiB" for 66180 B, passed back, still excluded it.
        hints.append(f"a budget of at least {readable_bytes_up(min(over))} per device (--memory-per-device), or more "
                     "devices")
    if any("cannot split evenly" in r for r in reasons):
        hints.append("model sizes the mesh axes divide (e.g. --heads or --d-model a multiple of the model axis)")
    return hints


def _transposition_gap(run: dict[str, Any], win: dict[str, Any]) -> str:
    """`` (transpositions +X ms)`` when the runner-up's transpositions cost a tenth of a
    millisecond or more than the winner's (sequence parallelism's layout changes), else ``""``."""
    gap = run.get("transposed_s", 0.0) - win.get("transposed_s", 0.0)
    return f" (transpositions {'+' if gap >= 0 else ''}{_ms(gap)} ms)" if abs(gap) >= 1e-4 else ""


def explain(plan: dict[str, Any]) -> list[str]:
    """Why the winner wins: what it pays, what it avoids, what the runner-up costs more."""
    ok = [r for r in plan["candidates"] if r["status"] == "ok"]
    if not ok:
        rows = plan["candidates"]
        if not rows:
            return ["no candidate at all: the rules given yield no layout; pass rules such as (\"dp\", \"fsdp\")."]
        over = sum(r["status"] == "over_budget" for r in rows)
        hints = _no_fit_hints(plan)
        return [f"no candidate fits: all {len(rows)} were excluded ({len(rows) - over} pruned, {over} over the memory "
                "budget); each one's reason is in its \"reason\" (printed as \"excluded ...\")."
                + (f" Fix: {'; or '.join(hints)}." if hints else "")]
    win = ok[0]
    lines = [f"winner: {win['label']}: {_ms_range(win['step_s_overlapped'], win['step_s_serial'])} ms per step "
             f"(compute {_ms(win['compute_s'])} ms"
             + (f" ({_ms(win['transposed_s'])} ms of it transpositions)" if win.get("transposed_s") else "")
             + f", collectives {_ms(win['comm_s'])} ms"
             + (f", {_ms(win['sync_s'])} ms of it waiting at them" if win.get("sync_s") else "")
             + (f", {_ms(win['prefetched_s'])} ms of it parameter gathers that can run during compute"
                if win.get("prefetched_s") else "") + "), "
             f"{readable_bytes(win['memory']['per_device'])} per device"]
    paid = sorted(_by_kind(win).items(), key=lambda kv: -kv[1]["seconds"])
    if paid:
        lines.append("  pays: " + "; ".join(
            f"{kind} over {axes}{' (across hosts)' if v['across_hosts'] else ''} x{int(v['count'])} "
            f"({readable_bytes(v['bytes'])}, {_ms(v['seconds'])} ms)" for (kind, axes), v in paid[:4]))
    else:
        lines.append("  pays: no collective at all")
    others = {key for r in ok[1:] for key in _by_kind(r)}
    avoided = sorted(others - set(_by_kind(win)))
    if avoided:
        lines.append("  avoids: " + "; ".join(f"{kind} over {axes}" for kind, axes in avoided[:6]))
    if len(ok) > 1:
        run = ok[1]
        theirs, ours = _by_kind(run), _by_kind(win)
        # Over the kinds either pays: one the winner alone pays counts against the runner-up's total.
        extra = {k: theirs.get(k, {"seconds": 0.0})["seconds"] - ours.get(k, {"seconds": 0.0})["seconds"]
                 for k in {**theirs, **ours}}
        worst = max(extra.items(), key=lambda kv: kv[1], default=None)
        best = min(extra.items(), key=lambda kv: kv[1], default=None)
        comm = run["comm_s"] - win["comm_s"]
        lines.append(
            f"  runner-up {run['label']}: +{_ms(run['step_s'] - win['step_s'])} ms per step (compute "
            f"{'+' if run['compute_s'] >= win['compute_s'] else ''}{_ms(run['compute_s'] - win['compute_s'])} ms"
            + _transposition_gap(run, win) + ", "
            f"collectives {'+' if run['comm_s'] >= win['comm_s'] else ''}{_ms(run['comm_s'] - win['comm_s'])} ms"
            + ((f", most of it {worst[0][0]} over {worst[0][1]} +{_ms(worst[1])} ms" if worst[1] <= comm else
                f", {worst[0][0]} over {worst[0][1]} +{_ms(worst[1])} ms"
                + (f" less {best[0][0]} over {best[0][1]} {_ms(best[1])} ms" if best[1] < 0 else ""))
               if worst and worst[1] > 0 else "")
            + f"), memory {'+' if run['memory']['per_device'] >= win['memory']['per_device'] else ''}"
            f"{readable_bytes(run['memory']['per_device'] - win['memory']['per_device'])} per device")
    # A while_loop whose condition reads data has no trip count in the program: its compute and
    # collectives are priced for one trip (a dp step's 20 all-reduces in such a loop read as 1), which
    # the plan held in "unknown_loops" and said nowhere.
    # A state without logical names is left whole by every rules table: fsdp and tp then rank beside
    # dp for the batch alone, and only their "replicated" flag hinted at why.
    unnamed = sorted({e["path"] for r in ok for e in r.get("replicated") or [] if not e.get("logical")})
    if unnamed:
        lines.append(f"  note: {len(unnamed)} large parameter(s) ({', '.join(unnamed[:3])}"
                     f"{', ...' if len(unnamed) > 3 else ''}) carry no logical names, so no rules table shards "
                     "them and the layouts differ in the batch alone: name their axes (state_axes=..., "
                     "nn.with_partitioning / nnx.with_partitioning in the model) to let fsdp or tp split them.")
    looped = [r["label"] for r in ok if r.get("unknown_loops")]
    if looped:
        lines.append(f"  note: {len(looped)} of {len(ok)} candidate(s) ({', '.join(looped[:3])}"
                     f"{', ...' if len(looped) > 3 else ''}) run a loop whose trip count the program does not "
                     "say (a while_loop on data): its compute and collectives are priced for one trip, so those "
                     "step times are low by the trips it makes; a fixed count (fori_loop, scan) is priced per trip.")
    return lines


def print_plan(plan: dict[str, Any], console: Console) -> None:
    console.print(f"target: {plan['target']['name']} ({plan['target']['source']})", highlight=False)
    told = plan["target"].get("warnings") or []
    if told:  # the calibration's own doubts: a busy machine or a smoke run first, then the noisy points
        told = sorted(told, key=lambda w: "spread" in w)
        console.print(f"note: the target file's calibration warned {len(told)} time(s): " + "; ".join(told[:3])
                      + (f"; and {len(told) - 3} more (its \"warnings\")" if len(told) > 3 else "")
                      + ". Its figures, and this plan's times, may be off.", highlight=False, markup=False)
    if plan["target"].get("links_note"):
        console.print(f"links: {plan['target']['links_note']}", highlight=False)
    budget = plan["memory_budget"]
    table = Table(title=f"{plan['devices']} devices, {plan['processes']} process(es), global batch {plan['global_batch']}"
                  + (f", budget {readable_bytes(budget)} per device" if budget else ""))
    console.print("collectives: AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all, CP collective "
                  "permute; :axes x count per step", highlight=False)
    for col in ("#", "candidate", "step ms", "compute ms", "comm ms", "memory/device",
                "analytic/compiled", "margin", "collectives", "flags"):
        table.add_column(col, justify="left" if col in ("candidate", "collectives", "flags") else "right")
    for r in plan["candidates"]:
        if r["status"] == "pruned":
            continue
        mem = r["memory"]
        rep = r.get("replicated", [])
        flags = [f"{len(rep)} large param(s) replicated"] if rep else []
        if r.get("unknown_loops"):
            flags.append(f"{r['unknown_loops']} loop(s) priced for one trip")
        if r["status"] == "over_budget":
            flags.insert(0, "[red]over budget[/]")
        kinds = ", ".join(f"{_SHORT[k]}:{a} x{int(v['count'])}" for (k, a), v in sorted(_by_kind(r).items()))
        table.add_row(str(r.get("rank", "-")), escape(r["label"]), _ms_range(r['step_s_overlapped'], r['step_s_serial']),
                      _ms(r["compute_s"]), _ms(r["comm_s"]), readable_bytes(mem["per_device"]),
                      f"{readable_bytes(mem['analytic']['total'])}/{readable_bytes(mem['compiled']['total'])}",
                      "n/a" if mem["margin"] is None else f"{mem['margin']:+.1%}", kinds or "none",
                      "; ".join(flags))
    console.print(table)
    pruned = [r for r in plan["candidates"] if r["status"] != "ok"]
    for r in pruned:
        console.print(f"excluded {r['label']}: {r['reason']}", highlight=False, markup=False)
    for r in plan["candidates"]:
        if r.get("replicated"):
            names = ", ".join(f"{f['path']} {tuple(f['shape'])} ({readable_bytes(f['bytes'])})" for f in r["replicated"])
            console.print(f"{r['label']}: rules {r['rules']!r} leave these large parameters replicated on every "
                          f"device: {names}", highlight=False, markup=False)
    front = pareto(plan["candidates"])
    if front:
        console.print("Pareto frontier (memory vs step time): " + " | ".join(
            f"{r['label']} {readable_bytes(r['memory']['per_device'])} {_ms(r['step_s'])} ms" for r in front),
                      highlight=False, markup=False)
    console.print("memory per device: the larger of the analytic count and the compiled figure; XLA:CPU never "
                  "fails for lack of memory, so neither is an out-of-memory verdict here.", highlight=False)
    counted = sorted({r["memory"]["analytic"].get("counted") for r in plan["candidates"] if "memory" in r} - {None})
    if counted:
        console.print(f"analytic count: {'; '.join(counted)}; margin = analytic / compiled - 1", highlight=False)
    for line in explain(plan):
        console.print(line, highlight=False, markup=False)
    if "measured" in plan:
        print_measured(plan["measured"], console)


def save_png(plan: dict[str, Any], path: str) -> None:
    """Every priced candidate as memory vs step time, the frontier joined by a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in plan["candidates"] if r["status"] in ("ok", "over_budget")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        mem, t = r["memory"]["per_device"] / 2**20, r["step_s"] * 1e3
        ax.errorbar(mem, t, yerr=[[t - r["step_s_overlapped"] * 1e3], [r["step_s_serial"] * 1e3 - t]],
                    fmt="o" if r["status"] == "ok" else "x", color="C0" if r["status"] == "ok" else "C3", capsize=3)
        ax.annotate(r["label"], (mem, t), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = pareto(plan["candidates"])
    if front:
        ax.plot([r["memory"]["per_device"] / 2**20 for r in front], [r["step_s"] * 1e3 for r in front], "-", color="C1",
                label="Pareto frontier")
        ax.legend()
    if plan["memory_budget"]:
        ax.axvline(plan["memory_budget"] / 2**20, color="C3", linestyle="--", linewidth=1)
    ax.set_xlabel("memory per device (MiB)")
    ax.set_ylabel("predicted step time (ms; bars: overlapped..serial)")
    ax.set_title(f"spmdkit plan: {plan['devices']} devices, {plan['target']['name']}", fontsize=9)
    fig.tight_layout()
    # A PNG unless the name asks for another format matplotlib writes (plan.svg): a name without a
    # suffix ("--png plan", written first as ".plan.<pid>.tmp") ended the run in matplotlib's
    # "Format 'tmp' is not supported", after the plan was printed and its JSON written.
    suffix = os.path.splitext(path)[1][1:].lower()
    fig.savefig(path, dpi=120, format=suffix if suffix in fig.canvas.get_supported_filetypes() else "png")
    plt.close(fig)


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 3 pairs."""
    if len(a) < 3:
        return None

    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in set(x):  # ties share their mean rank
            idx = [i for i, y in enumerate(x) if y == v]
            r[idx] = r[idx].mean()
        return r

    ra, rb = ranks(list(a)), ranks(list(b))
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(plan: dict[str, Any], k: int | str,
            prepare: Callable[[dict[str, Any]], tuple[Callable[[int], list[float]], int, str]],
            steps: int, rounds: int = 3) -> dict[str, Any]:
    """Run the ``k`` best candidates (``"all"``: every ranked one) for real: predicted vs measured step time and memory.

    ``prepare(row) -> (run(steps) -> seconds per step, memory, where the memory figure comes from)``. The candidates take turns,
    ``rounds`` times ``steps`` steps each, each round starting one candidate later than the last, so a change in the
    machine's load and whoever ran just before fall on all alike; a candidate's time is the median of its rounds'
    medians (``measured_rounds_s``). The measured order (rank correlation, fastest, ties) comes from each round's
    medians relative to that round's geometric mean over the candidates (``measured_relative``, the median of
    ``measured_relative_rounds``): a paired comparison, so a slow minute of the machine, which falls on one round,
    does not reorder candidates."""
    rows = [r for r in plan["candidates"] if r["status"] == "ok"][:None if k == "all" else k]
    prepared: list = []
    try:
        for row in rows:
            prepared.append(_failing_as(row, "preparing", 0, lambda: prepare(row)))
    except KeyboardInterrupt:
        raise MeasureInterrupted(None, 0, rounds) from None
    times: list[list[float]] = [[] for _ in rows]
    per_round: list[list[float]] = [[] for _ in rows]
    order = list(range(len(rows)))
    done = 0
    try:
        for r in range(rounds):
            for i in order[r % len(order):] + order[: r % len(order)] if order else []:
                t = _failing_as(rows[i], "running", r + 1, lambda: prepared[i][0](steps))
                times[i].extend(t)
                per_round[i].append(statistics.median(t))
            done = r + 1
    except KeyboardInterrupt:
        # Ctrl-C: the whole rounds so far are a paired comparison of their own (a part round is not).
        raise MeasureInterrupted(_summary(rows, prepared, times, [pr[:done] for pr in per_round], done) if done else None,
                                 done, rounds) from None
    return {**_summary(rows, prepared, times, per_round, rounds if rows else 0), "asked": k}


def _failing_as(row: dict[str, Any], doing: str, round_: int, call: Callable[[], Any]) -> Any:
    """``call()``; an error of the step's own (raised in it, or by the runtime running it) as a
    :class:`MeasureFailed` naming the candidate: it came as JAX's bare error, naming none."""
    try:
        return call()
    except (KeyboardInterrupt, SpmdkitError):
        raise
    except Exception as e:
        first = first_line(e)
        _settle_effects()
        at = f" in round {round_}" if round_ else ""
        raise MeasureFailed(fix(f"measuring {row['label']} (rank {row['rank']}) failed {doing} its step{at}: "
                                f"{type(e).__name__}: {first}",
                                "the candidate compiled and was priced, so the step itself failed when run (its "
                                "traceback is the cause of this error in Python). The ranking is kept (the error's "
                                ".plan; the command's table and --json); measure=0 (--measure 0) prices only.")) from e


def _settle_effects() -> None:
    """Wait out the failed step's pending effects (a ``jax.debug.callback``'s error), whose error
    JAX's exit handler raised again, as "Exception ignored in atexit callback"."""
    try:
        jax.effects_barrier()
    except Exception:  # the same error, already reported
        pass


class MeasureFailed(SpmdkitError, RuntimeError):
    """A candidate's step failed while ``plan`` measured it; from :func:`spmdkit.plan`, the priced
    plan rides along as ``plan``, as with :class:`MeasureInterrupted`."""

    exit_code = 1  # the step's own failure, as a crash

    def __init__(self, message: str):
        super().__init__(message)
        self.plan: dict[str, Any] | None = None


class MeasureInterrupted(KeyboardInterrupt):
    """Ctrl-C while ``plan`` measured: still a KeyboardInterrupt (a script stops), carrying what
    was measured in whole rounds (``measured``, or None before the first), and, from
    :func:`spmdkit.plan`, the priced plan (``plan``), so the command can print and write them."""

    def __init__(self, measured: dict[str, Any] | None, done: int, rounds: int):
        super().__init__(f"measurement interrupted after {done} of {rounds} round(s)")
        self.measured, self.done, self.rounds = measured, done, rounds
        self.plan: dict[str, Any] | None = None
        if measured is not None:
            measured["interrupted"] = {"rounds_done": done, "rounds_asked": rounds}


def _summary(rows: list[dict[str, Any]], prepared: list, times: list[list[float]], per_round: list[list[float]],
             rounds: int) -> dict[str, Any]:
    """The ``measured`` dict from each candidate's step times and round medians."""
    relative = _relative_rounds(per_round)
    out = []
    for r, (_, memory, source), t, pr, rel in zip(rows, prepared, times, per_round, relative):
        out.append({"label": r["label"], "rank": r["rank"], "predicted_s": r["step_s"],
                    "predicted_range_s": [r["step_s_overlapped"], r["step_s_serial"]],
                    "measured_s": statistics.median(pr), "measured_spread_s": [min(t), max(t)],
                    "measured_rounds_s": pr, "measured_relative": statistics.median(rel) if rel else None,
                    "measured_relative_rounds": rel, "steps": len(t),
                    "predicted_memory": r["memory"]["analytic"]["total"], "per_device_memory": r["memory"]["per_device"],
                    "measured_memory": memory,
                    "measured_memory_source": source})
    fastest = min(out, key=_measured_order) if out else None
    return {"runs": out, "rounds": rounds,
            "spearman": spearman([m["predicted_s"] for m in out], [_measured_order(m) for m in out]),
            "reproducibility": reproducibility(relative),
            "measured_fastest": fastest["label"] if fastest else None,
            "measured_fastest_predicted_rank": fastest["rank"] if fastest else None,
            "ties": ties(out)}


def _relative_rounds(per_round: list[list[float]]) -> list[list[float]]:
    """Each candidate's round medians over that round's geometric mean across the candidates.

    Example:
        >>> [[round(x, 6) for x in r] for r in _relative_rounds([[1.0, 2.0], [4.0, 8.0]])]  # round 2 twice as slow
        [[0.5, 0.5], [2.0, 2.0]]
    """
    if not per_round or any(len(pr) != len(per_round[0]) for pr in per_round):
        return [[] for _ in per_round]
    logs = np.log(np.array(per_round, dtype=float))
    return (np.exp(logs - logs.mean(axis=0, keepdims=True))).tolist()


def reproducibility(relative: list[list[float]]) -> float | None:
    """How well the measurement reproduces its own order: the rank correlation of the
    candidates' medians over one half of the rounds with those over the other half
    (``relative``: each candidate's paired times per round, all of one length). The
    candidates' turns rotate by one place a round, so ``n`` candidates take ``n`` rounds to
    hold every place once; the halves are these whole rotations taken in turn (rounds 0..n-1,
    2n..3n-1, ... against n..2n-1, ...), so that a place in the round that costs more, such as
    the first, falls on every candidate in both halves. A trailing part rotation is left out.
    Well below 1, the measured order is partly the machine's noise, and so is any rank
    correlation against it; more rounds raise it. Each half has half the rounds, so the whole
    measurement is steadier than this figure says. None for fewer than 3 candidates, fewer
    than two whole rotations (``2 * n`` rounds), or when either half ties every candidate.

    Example:
        >>> round(reproducibility([[1.0, 1.1, 1.0, 1.1, 1.0, 1.1], [2.0, 2.1, 2.0, 2.1, 2.0, 2.1],
        ...                        [3.0, 2.9, 3.1, 3.0, 3.0, 2.9]]), 3)
        1.0
        >>> round(reproducibility([[1.0] * 3 + [2.0] * 3, [2.0] * 3 + [1.0] * 3, [1.5] * 6]), 3)
        -1.0
    """
    n = len(relative)
    whole = len(relative[0]) // n if n else 0
    if n < 3 or whole < 2:
        return None
    halves = [[statistics.median(x for k, x in enumerate(r[:whole * n]) if (k // n) % 2 == half) for r in relative]
              for half in (0, 1)]
    return spearman(*halves)


def _measured_order(m: dict[str, Any]) -> float:
    """What the measured candidates are ordered by: their paired relative time, else their median."""
    return m["measured_relative"] if m.get("measured_relative") is not None else m["measured_s"]


def ties(runs: list[dict[str, Any]]) -> list[list[str]]:
    """Pairs of measured candidates whose rounds do not tell them apart: the interquartile
    ranges of their rounds' relative times (``measured_relative_rounds``; the rounds' medians,
    ``measured_rounds_s``, where those are missing) overlap. Their measured order, and the
    part of the rank correlation it makes, is noise; more rounds narrow the ranges.

    Example:
        >>> ties([{"label": "a", "measured_rounds_s": [1.0, 1.1, 1.2, 1.3]},
        ...       {"label": "b", "measured_rounds_s": [1.1, 1.2, 1.3, 1.4]},
        ...       {"label": "c", "measured_rounds_s": [2.0, 2.1, 2.2, 2.3]}])
        [['a', 'b']]
    """
    rounds = [m.get("measured_relative_rounds") or m["measured_rounds_s"] for m in runs]
    iqr = [np.percentile(r, [25, 75]) if len(r) > 1 else None for r in rounds]
    return [[a["label"], b["label"]] for i, a in enumerate(runs) for j, b in enumerate(runs)
            if i < j and iqr[i] is not None and iqr[j] is not None and iqr[i][0] <= iqr[j][1] and iqr[j][0] <= iqr[i][1]]


def _measured_note(measured: dict[str, Any]) -> str | None:
    """What ``--measure K`` did not run: K beyond the ranked candidates was silent, and with none
    ranked (all over budget or excluded) an empty table said "measured fastest: None"."""
    asked, ran = measured.get("asked"), len(measured["runs"])
    if ran == 0:
        return ("nothing measured: --measure runs ranked candidates only, and none is ranked (each was excluded or "
                "over the memory budget; see above)")
    if isinstance(asked, int) and asked > ran:
        return f"measured {ran} of the {asked} asked: only {ran} candidate(s) are ranked"
    return None


def print_measured(measured: dict[str, Any], console: Console) -> None:
    note = _measured_note(measured)
    if note:
        console.print(note, highlight=False)
    if not measured["runs"]:
        return
    procs = measured.get("processes", 1)
    table = Table(title="predicted vs measured (" + (f"{procs} processes, each step as long as the slowest process "
                        "took; " if procs > 1 else "") + "simulated devices: they share this machine's cores)")
    for col in ("rank", "candidate", "predicted ms", "measured ms (median, min-max)", "measured / round's geometric mean",
                "predicted memory (analytic)", "measured memory"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for m in measured["runs"]:
        table.add_row(str(m["rank"]), escape(m["label"]), _ms(m["predicted_s"]),
                      f"{_ms(m['measured_s'])} ({_ms_range(*m['measured_spread_s'])})",
                      "n/a" if m.get("measured_relative") is None else f"{m['measured_relative']:.3f}",
                      readable_bytes(m["predicted_memory"]), "n/a" if m["measured_memory"] is None else readable_bytes(m["measured_memory"]))
    console.print(table)
    if measured.get("interrupted"):
        cut = measured["interrupted"]
        console.print(f"interrupted: measured in {cut['rounds_done']} of {cut['rounds_asked']} round(s); "
                      "the figures above are those rounds'", highlight=False)
    sources = sorted({m["measured_memory_source"] for m in measured["runs"]})
    if sources:
        console.print(f"measured memory: {', '.join(sources)}", highlight=False)
    rho = measured["spearman"]
    console.print("measured order: each round's times relative to that round's geometric mean over the candidates "
                  "(a paired comparison: the machine's drift between rounds cancels)"
                  + ("; one round only: no spread to judge ties by, so the order may be noise (--measure-rounds)"
                     if measured.get("rounds", 2) < 2 else ""), highlight=False, markup=False)
    console.print(f"Spearman rank correlation of predicted and measured step times: "
                  f"{'n/a (fewer than 3 runs)' if rho is None else f'{rho:.3f}'}; measured fastest: "
                  f"{measured['measured_fastest']} (planner's rank {measured['measured_fastest_predicted_rank']})",
                  highlight=False, markup=False)
    if "reproducibility" in measured:
        again = measured["reproducibility"]
        if again is None:
            verdict = "n/a (fewer than 3 runs, or --measure-rounds below twice the runs)"
        else:
            verdict = f"{again:.3f}" + (" - below 0.8 the measured order is partly noise, and so is the rank "
                                        "correlation above; more --measure-rounds" if again < 0.8 else "")
        console.print(f"the measurement against itself (one half of its rounds' order against the other's): {verdict}",
                      highlight=False, markup=False)
    if measured.get("links"):
        console.print(links_line(measured["links"]), highlight=False, markup=False)
    if measured.get("ties"):
        console.print("within each other's spread (the interquartile ranges of their rounds' medians overlap): "
                      + "; ".join(f"{a} ~ {b}" for a, b in measured["ties"]) + ". Their measured order, and what it "
                      "adds to or takes from the rank correlation, is noise; more --measure-rounds narrow it.",
                      highlight=False, markup=False)


def time_steps(step: Callable, state: Any, batch: Any, steps: int) -> list[float]:
    """Seconds per step, each step waited for (simulated devices deadlock on queued collectives)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - start)
    return times
