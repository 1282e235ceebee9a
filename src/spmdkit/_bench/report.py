"""Printing a benchmark report as a table, and its Markdown form."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

TEXT_COLUMNS = ("workload", "inputs", "impl", "model", "case", "layout", "mesh", "operation", "flag")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def _target_text(t: dict[str, Any], bold: bool = False) -> str:
    value = f"**{t['value']:.3f}**" if bold else f"{t['value']:.3f}"
    spread = ""
    if t.get("q1") is not None and t.get("q3") is not None:
        spread = f" [IQR {t['q1']:.3f}-{t['q3']:.3f}]"
    flags = f" (flagged: {', '.join(t['flags'])})" if t.get("flags") else ""
    return f"{t['name']} = {value}{spread} (target {t['target']}){flags}"


def _load_text(report: dict[str, Any]) -> str | None:
    load = report.get("load")
    if not load:
        return None
    parts = []
    for when in ("before", "after"):
        snap = load.get(when) or {}
        avg = snap.get("loadavg")
        other = snap.get("other_cpu")
        text = f"load average {avg[0]:.2f}" if avg else "load average ?"
        if other is not None:
            text += f", other processes {other:.0%} CPU"
        parts.append(f"{when}: {text}")
    return "machine load " + "; ".join(parts)


def print_report(report: dict[str, Any], console: Console) -> None:
    m = report["machine"]
    table = Table(
        title=f"suite {report['suite']}: {m['devices']} {m['backend']} device(s), "
        f"{m['cpu_count']} cores, jax {m['jax']}"
    )
    for col in report["columns"]:
        table.add_column(col, justify="left" if col in TEXT_COLUMNS else "right")
    for row in report["rows"]:
        table.add_row(*(escape(_cell(row.get(c, ""))) for c in report["columns"]))
    console.print(table)
    for t in report.get("targets", []):
        verdict = "[green]met[/]" if t["met"] else "[red]MISSED[/]"
        console.print(f"target: {escape(_target_text(t))}: {verdict}")
    for note in report.get("notes", []):
        console.print(f"note: {escape(note)}")
    load = _load_text(report)
    if load:
        console.print(f"note: {load}")
    for warning in report.get("warnings", []):
        console.print(f"[yellow]warning:[/] {escape(warning)}")


def to_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown section, the form BENCHMARKS.md keeps."""
    m = report["machine"]
    cols = report["columns"]
    lines = [
        f"Measured {m['date']} on {m['cpu_count']} cores ({m['processor']}), "
        f"{m['devices']} {m['backend']} device(s), jax {m['jax']}, Python {m['python']}"
        + (f", {report['rounds']} rounds" if report.get("rounds") else "")
        + ".",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join(" --- " for _ in cols) + "|",
    ]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in cols) + " |" for row in report["rows"]]
    lines.append("")
    for t in report.get("targets", []):
        verdict = "met" if t["met"] else "**missed**"
        lines.append(f"- {_target_text(t, bold=True)}: {verdict}")
    lines += [f"- {note}" for note in report.get("notes", [])]
    load = _load_text(report)
    if load:
        lines.append(f"- {load}")
    lines += [f"- warning: {w}" for w in report.get("warnings", [])]
    return "\n".join(lines) + "\n"


def collect(report: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Attach the timing runs to a report: their records, the load and every warning.

    ``runs`` maps a label (e.g. the workload) to a :func:`spmdkit._bench._timing.measure`
    record; the report's ``load`` is the first run's ``before`` and the last run's ``after``.
    """
    report["timings"] = runs
    records = list(runs.values())
    if records:
        report["rounds"] = min(r["rounds"] for r in records)
        report["load"] = {"before": records[0]["load"]["before"], "after": records[-1]["load"]["after"]}
    warnings = report.setdefault("warnings", [])
    for label, run in runs.items():
        warnings += [f"{label}: {w}" for w in run["warnings"]]
    for t in report.get("targets", []):
        if t.get("flags"):
            warnings.append(f"target {t['name']!r} is flagged ({', '.join(t['flags'])}): do not read it as a figure")
    return report


AGREEMENT = 0.10  # two runs agree when a target ratio differs by at most this share of their mean


def _target_key(name: str) -> str:
    # Names may carry the winning case in brackets ("best (b) [(b) ...]"), which can change between runs.
    return name.split(" [")[0]


def _cases(report: dict[str, Any]) -> set[tuple[str, ...]]:
    """The cases a suite measured: the text cells of its table's rows (not their flags)."""
    columns = report.get("columns", [])
    out = set()
    for row in report.get("rows", []):
        cells = row.items() if isinstance(row, dict) else zip(columns or range(len(row)), row)
        out.add(tuple(v for k, v in cells if isinstance(v, str) and k != "flag"))
    return out


def compare(first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target of two runs side by side: ``{suite, target, first, second, diff, agree, note}``.

    ``first``/``second`` map a suite name to its JSON report. ``diff`` is |a - b| over their
    mean; runs agree on a target when it is at most :data:`AGREEMENT`. A target that takes
    the best of several cases (its name names the winner in brackets) is not comparable,
    ``agree`` None, when the two runs measured different cases (``--levers`` in one only)
    and picked different winners: each run's best is then the best of another set.

    Example:
        >>> run = lambda v: {"data": {"targets": [{"name": "x [best]", "value": v}]}}
        >>> [(r["target"], round(r["diff"], 3), r["agree"]) for r in compare(run(1.0), run(1.05))]
        [('x', 0.049, True)]
    """
    rows = []
    for suite in sorted(set(first) & set(second)):
        theirs = {_target_key(t["name"]): t for t in second[suite].get("targets", [])}
        same_cases = _cases(first[suite]) == _cases(second[suite])
        for t in first[suite].get("targets", []):
            other = theirs.get(_target_key(t["name"]))
            if other is None:
                continue
            a, b = t["value"], other["value"]
            diff = abs(a - b) / ((a + b) / 2) if a + b else float("inf")
            row = {"suite": suite, "target": _target_key(t["name"]), "first": a, "second": b, "diff": diff,
                   "agree": diff <= AGREEMENT, "note": ""}
            if not same_cases and t["name"] != other["name"]:
                row.update(agree=None, note=f"not comparable: the runs measured different cases and their best "
                                            f"differs ({t['name']} vs {other['name']})")
            rows.append(row)
    return rows
