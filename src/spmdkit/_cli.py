"""The ``spmdkit`` command line: parses, sets up devices, calls the Python API.

Nothing here touches a JAX backend before ``--host-devices`` is applied: the
device count of a process is fixed by its first JAX operation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from spmdkit import __version__
from spmdkit._devices import (
    ENV_HOST_DEVICES,
    device_table,
    host_devices_from_env,
    model_parallel_suggestion,
    suggest_mesh,
    use_host_devices,
)
from spmdkit._errors import SpmdkitError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _device_options(default: object) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--host-devices",
        type=_positive_int,
        metavar="N",
        default=default,
        help=f"simulate N CPU devices (default: ${ENV_HOST_DEVICES}, else what JAX finds)",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spmdkit",
        description="Write a step for one device; run it on many.",
        parents=[_device_options(None)],
    )
    # SUPPRESS: a subcommand's unset flag must not overwrite `spmdkit --host-devices N CMD`.
    common = _device_options(argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version=f"spmdkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("devices", parents=[common], help="list devices and suggest a mesh")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    sub.add_parser(
        "demo",
        parents=[common],
        help="seed 000's parallel evaluation on 8 simulated devices",
        description="Runs seed 000's convolve with spmdkit.pmap on 8 simulated CPU devices "
        "(or --host-devices N) and prints what it did.",
    )

    from spmdkit._bench import SUITES

    p = sub.add_parser("bench", parents=[common], help="run a benchmark suite (8 devices by default)")
    p.add_argument("--suite", choices=sorted(SUITES), required=True, help="which suite")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON to FILE")
    p.add_argument("--markdown", metavar="FILE", help="also write the figures as Markdown to FILE")
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer rounds (smoke run)")
    return parser


# Commands that run on 8 simulated devices unless told otherwise: they are about
# showing or measuring many devices on a machine that has one CPU.
_DEFAULT_DEVICES = {"demo": 8, "bench": 8}


def _setup_devices(args: argparse.Namespace) -> None:
    n = args.host_devices or host_devices_from_env() or _DEFAULT_DEVICES.get(args.command)
    if n is not None:
        use_host_devices(n)


def _cmd_devices(args: argparse.Namespace, console: Console) -> int:
    import jax

    rows = device_table()
    per_process = dict(sorted(Counter(r["process_index"] for r in rows).items()))
    n = len(rows)
    info = {
        "devices": rows,
        "device_count": n,
        "devices_per_process": per_process,
        "process_count": jax.process_count(),
        "suggested_mesh": suggest_mesh(n),
        "suggested_model_parallel_mesh": model_parallel_suggestion(n),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    table = Table(title=f"{n} device(s), {jax.process_count()} process(es)")
    for col in ("id", "platform", "kind", "process"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["id"]), r["platform"], r["kind"], str(r["process_index"]))
    console.print(table)
    console.print("devices per process: " + ", ".join(f"{k}: {v}" for k, v in per_process.items()))
    fmt = lambda m: ", ".join(f"{k}={v}" for k, v in m.items())  # noqa: E731
    console.print(
        f"suggested mesh: spmdkit.make_mesh({fmt(info['suggested_mesh'])})  (data parallel)"
    )
    if info["suggested_model_parallel_mesh"]:
        console.print(
            f"  with model parallelism: "
            f"spmdkit.make_mesh({fmt(info['suggested_model_parallel_mesh'])})"
        )
    return 0


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._demo import run_demo

    return 0 if run_demo(console)["matches_vmap"] else 1


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from spmdkit._bench import SUITES
    from spmdkit._bench.report import print_report, to_markdown

    report = SUITES[args.suite](quick=args.quick)
    print_report(report, console)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        console.print(f"wrote {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(to_markdown(report))
        console.print(f"wrote {args.markdown}")
    return 0


_COMMANDS = {"devices": _cmd_devices, "demo": _cmd_demo, "bench": _cmd_bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``spmdkit`` console script."""
    args = build_parser().parse_args(argv)
    # Tables are for reading in logs too: do not fold them to 80 columns off a terminal.
    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        _setup_devices(args)
        return _COMMANDS[args.command](args, console)
    except SpmdkitError as e:
        Console(stderr=True).print(Text("error: ", style="bold red") + Text(str(e)))
        return 2


if __name__ == "__main__":
    sys.exit(main())
