"""Printing a benchmark report as a table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def print_report(report: dict[str, Any], console: Console) -> None:
    m = report["machine"]
    table = Table(
        title=f"suite {report['suite']}: {m['devices']} {m['backend']} device(s), "
        f"{m['cpu_count']} cores, jax {m['jax']}"
    )
    for col in report["columns"]:
        table.add_column(col, justify="left" if col in ("workload", "inputs", "impl") else "right")
    for row in report["rows"]:
        table.add_row(*(_cell(row[c]) for c in report["columns"]))
    console.print(table)
    for t in report.get("targets", []):
        verdict = "[green]met[/]" if t["met"] else "[red]MISSED[/]"
        console.print(f"target: {t['name']} = {t['value']:.3f} (target {t['target']}): {verdict}")
    for note in report.get("notes", []):
        console.print(f"note: {note}")


def to_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown section, the form BENCHMARKS.md keeps."""
    m = report["machine"]
    cols = report["columns"]
    lines = [
        f"Measured {m['date']} on {m['cpu_count']} cores ({m['processor']}), "
        f"{m['devices']} {m['backend']} device(s), jax {m['jax']}, Python {m['python']}.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join(" --- " for _ in cols) + "|",
    ]
    lines += ["| " + " | ".join(_cell(row[c]) for c in cols) + " |" for row in report["rows"]]
    lines.append("")
    for t in report.get("targets", []):
        verdict = "met" if t["met"] else "**missed**"
        lines.append(f"- {t['name']}: **{t['value']:.3f}** (target {t['target']}): {verdict}")
    lines += [f"- {note}" for note in report.get("notes", [])]
    return "\n".join(lines) + "\n"
