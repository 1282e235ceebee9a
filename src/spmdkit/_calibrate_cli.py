"""``spmdkit calibrate``: flags, and the tables it prints."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from spmdkit._argtypes import path_arg
from spmdkit._calibrate import ACCEPT_REL_ERR, DEFAULT_SIZES, QUICK_SIZES, CalibrationError, calibrate, check, parse_size
from spmdkit._console import stderr_console
from spmdkit._errors import EXIT_CHECK_FAILED

DEFAULT_OUT = "spmdkit-target.json"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except CalibrationError as e:
        raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None


def _kib(sizes) -> str:
    return ", ".join(f"{s // 1024} KiB" if s < 2**20 else f"{s // 2**20} MiB" for s in sizes)


def add_calibrate_parser(sub) -> None:
    from spmdkit._cli import _positive_int

    p = sub.add_parser(
        "calibrate",
        help="measure this machine's collectives, GEMM rate and bandwidth; write a target file for spmdkit plan",
        description="Times psum (all_reduce), all_gather, psum_scatter (reduce_scatter) and all_to_all at "
        f"log-spaced payload sizes ({_kib(DEFAULT_SIZES[:1])} .. {_kib(DEFAULT_SIZES[-1:])}; --quick: "
        f"{_kib(QUICK_SIZES)}) on --devices simulated devices in this process (link intra_host: they share "
        "this machine's cores) and across 2 processes x 1 device joined by jax.distributed (inter_host); "
        "fits alpha-beta per collective and link; prints every fit's prediction error. The largest size "
        "needs about 3 x devices x size of memory. Take figures on an idle machine.",
    )
    p.add_argument("--out", type=path_arg, metavar="FILE", default=DEFAULT_OUT, help=f"the target file to write ({DEFAULT_OUT})")
    # --host-devices too: every command but launch takes it after its name (README), here the same count.
    p.add_argument("--devices", "--host-devices", dest="host_devices", type=_positive_int, metavar="N",
                   default=argparse.SUPPRESS, help="simulated CPU devices for the intra_host link (8)")
    p.add_argument("--processes", type=int, default=2, metavar="P",
                   help="1: intra_host only; 2: also inter_host, 2 processes x 1 device (2)")
    p.add_argument("--sizes", type=_size, nargs="+", metavar="BYTES",
                   help="payload sizes, e.g. 4K 64K 1M 16M (binary units; default: 4 KiB .. 64 MiB, x4 apart)")
    p.add_argument("--rounds", type=int, metavar="R", help="interleaved timing rounds per case (7; 151 for the 2-process link, whose small "
                   "collectives vary more; --quick: 3)")
    p.add_argument("--quick", action="store_true", help="3 sizes, largest mesh axis only, 3 rounds: a smoke run")
    p.add_argument("--timeout", type=float, metavar="S", help="seconds before the 2-process run is killed "
                   "(3600; --quick: 600)")
    p.add_argument("--check", type=path_arg, metavar="FILE", help="instead: re-measure the 2-process collectives as FILE's "
                   "calibration did (its kinds, sizes, rounds and repetitions; --sizes/--rounds override) and "
                   "compare the all-reduce "
                   f"with FILE's prediction (exit 0 when every size is within {100 * ACCEPT_REL_ERR:.0f}%%, else 6)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def print_fit(target: dict[str, Any], console: Console) -> None:
    table = Table(title="alpha-beta fits: time = s(n) * alpha + w(n, B) * beta  (errors: predicted / measured - 1)")
    for col in ("kind", "link", "points", "alpha (us)", "1/beta (GB/s)", "max |err|", "median |err|"):
        table.add_column(col, justify="left" if col in ("kind", "link") else "right")
    for kind, per_link in target["collectives"].items():
        for link, c in per_link.items():
            q = target["fit_quality"][kind][link]
            table.add_row(kind, link, str(q["points"]), f"{c['alpha'] * 1e6:.1f}",
                          f"{1e-9 / c['beta']:.2f}" if c["beta"] else "inf",
                          f"{q['max_rel_err']:.0%}", f"{q['median_rel_err']:.0%}")
            for i, p in enumerate(c.get("pieces") or ()):  # the errors above are those of the pieces
                size = _kib([p["max_bytes"]]) if "max_bytes" in p else _kib([c["pieces"][i - 1]["max_bytes"]])
                table.add_row("", f"  {'<=' if 'max_bytes' in p else '>'} {size}", "", f"{p['alpha'] * 1e6:.1f}",
                              f"{1e-9 / p['beta']:.2f}" if p["beta"] else "inf", "", "")
            for g, ab in (c.get("groups") or {}).items():  # timed between computation, not fitted to the points
                table.add_row("", f"  {g} devices, between computation", "", f"{ab['alpha'] * 1e6:.1f}",
                              f"{1e-9 / ab['beta']:.2f}" if ab["beta"] else "inf", "", "")
    console.print(table)
    if target.get("collective_sync_ops"):
        console.print("a collective between computation also waits (operation times, by devices in its group): "
                      + ", ".join(f"{g}: {v:.1f}" for g, v in target["collective_sync_ops"].items()), highlight=False)
    flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in target["peak_flops"].items())
    console.print(f"per device ({target['devices_per_host']} at once): {flops}; memory "
                  f"{target['memory_bandwidth'] / 1e9:.2f} GB/s", highlight=False)


def print_points(rows: list[dict[str, Any]], title: str, console: Console) -> None:
    table = Table(title=title)
    then = any("then_seconds" in r for r in rows)  # a check: what the calibration measured, and the drift
    cols = ("n", "bytes", "reps", "fixed/call (us)", "measured (us)", "IQR") + (
        ("calibration (us)", "now/then") if then else ()) + ("predicted (us)", "error")
    for col in cols:
        table.add_column(col, justify="right")
    us = lambda v: f"{v * 1e6:.1f}" if isinstance(v, (int, float)) else ""  # noqa: E731
    for r in rows:
        iqr = r.get("iqr_rel")
        cells = [str(r.get("n", 2)), str(r["bytes"]), str(r.get("reps") or ""), us(r.get("fixed_seconds")),
                 us(r["seconds"]), f"{iqr:.0%}" if iqr is not None else ""]
        if then:
            cells += [us(r.get("then_seconds")), _pct(r["vs_then"]) if "vs_then" in r else ""]
        table.add_row(*cells, us(r["predicted"]), _pct(r["rel_err"]))
    console.print(table)


def _print_warnings(warnings: list[str], console: Console) -> None:
    for w in warnings:
        console.print(f"warning: {w}", style="yellow", highlight=False, markup=False)


def run_calibrate(args: argparse.Namespace, console: Console) -> int:
    if args.check:
        result = check(args.check, sizes=args.sizes, rounds=args.rounds, quick=args.quick, timeout=args.timeout)
        if args.json:
            print(json.dumps(result, indent=2))
            return 0 if result["ok"] else EXIT_CHECK_FAILED
        print_points(result["rows"], f"2-process all-reduce now vs the prediction of {args.check}", console)
        _print_warnings(result["warnings"], console)
        verdict = "met" if result["ok"] else "NOT met"
        console.print(f"max |error| {result['max_rel_err']:.0%}, median {result['median_rel_err']:.0%}: "
                      f"within {ACCEPT_REL_ERR:.0%} at every size: {verdict}", highlight=False)
        if result.get("max_vs_then") is not None:
            console.print(f"the measurement reproduces the calibration's own within {result['max_vs_then']:.0%} "
                          f"(same kinds {', '.join(result['kinds'])}, rounds and repetitions)", highlight=False)
            other = {name: [abs(r[key]) for r in result["rows"] if key in r]
                     for name, key in (("difference of the minima", "vs_then_min"),
                                       ("one call of reps per round", "vs_then_single"))}
            if all(other.values()):
                console.print("the same rounds summarised otherwise reproduce within: "
                              + ", ".join(f"{name} {max(v):.0%}" for name, v in other.items()), highlight=False)
        return 0 if result["ok"] else EXIT_CHECK_FAILED
    err = stderr_console()
    target = calibrate(processes=args.processes, sizes=args.sizes, rounds=args.rounds, quick=args.quick,
                       out=args.out, timeout=args.timeout, log=lambda line: err.print(line, highlight=False))
    if args.json:
        print(json.dumps(target, indent=2))
        return 0
    print_fit(target, console)
    inter = [m for m in target["measurements"] if m["kind"] == "all_reduce" and m["link"] == "inter_host"]
    if inter:
        print_points(inter, "2-process all-reduce: measured vs the fit", console)
        worst = max(abs(m["rel_err"]) for m in inter)
        console.print(f"2-process all-reduce predicted within {worst:.0%} at every size (target {ACCEPT_REL_ERR:.0%}: "
                      f"{'met' if worst <= ACCEPT_REL_ERR else 'NOT met'}); every point is in {args.out}",
                      highlight=False)
    _print_warnings(target["warnings"], console)
    console.print(f"wrote {args.out}: spmdkit plan --target {args.out}; re-check later with "
                  f"spmdkit calibrate --check {args.out}", highlight=False)
    return 0
