"""``spmdkit plan``: the command line of the planner, for the built-in ``lm`` and ``mlp``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import Any

from rich.console import Console

from spmdkit._errors import ConfigError, fix

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``"16e9"``, ``"16GB"``, ``"512MiB"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes like 16e9, 16GB or 512MiB, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, got {text!r}")
    return values


def add_plan_parser(sub: Any, common: argparse.ArgumentParser, positive_int: Any, lm_options: Any) -> None:
    from spmdkit._plan._candidates import DEFAULT_RULES

    p = sub.add_parser(
        "plan", parents=[common],
        help="rank mesh x rules x remat x accumulation for a model on N devices, with reasons",
        description="Compiles (never runs) every candidate layout on N simulated devices, counts its memory per "
        "device, reads the collectives of the compiled program, prices the step on a hardware target and prints "
        "the ranking, the memory/time Pareto frontier and why the winner wins.")
    p.add_argument("--task", choices=("lm", "mlp"), default="lm", help="the model (lm)")
    p.add_argument("--devices", type=positive_int, required=True, metavar="N", help="devices to plan for")
    p.add_argument("--processes", type=positive_int, default=1, metavar="P",
                   help="processes (hosts) the devices are spread over: collectives across them use the target's "
                   "inter_host link (1)")
    p.add_argument("--memory-per-device", type=parse_bytes, metavar="BYTES",
                   help="budget per device, e.g. 16GB or 512MiB (default: the target's memory_per_device)")
    p.add_argument("--target", default="cpu", metavar="cpu|FILE",
                   help="cpu (this machine, measured now), a target JSON file (spmdkit calibrate writes one), "
                   "or h100x8 / tpu-v5e-16 (datasheet examples) (cpu)")
    p.add_argument("--rules", type=_names, default=DEFAULT_RULES, metavar="LIST",
                   help=f"rules to try, comma-separated: presets, hsdp+tp, TOML files ({','.join(DEFAULT_RULES)})")
    p.add_argument("--remat-options", type=_names, default=None, metavar="LIST",
                   help="lm: remat policies to try, e.g. none,dots,full (default: --remat, else none)")
    p.add_argument("--grad-accum", type=_ints, default=(1,), metavar="LIST",
                   help="accumulation steps to try at the same global batch, e.g. 1,2,4 (1)")
    p.add_argument("--batch-size", type=positive_int, help="global batch (the task's)")
    p.add_argument("--measure", type=int, default=0, metavar="K", help="also run the K best for real and compare (0)")
    p.add_argument("--measure-steps", type=positive_int, default=5, metavar="S",
                   help="--measure: timed steps per candidate per round (5)")
    p.add_argument("--measure-rounds", type=positive_int, default=3, metavar="R",
                   help="--measure: rounds in which the candidates take turns (3)")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--png", metavar="FILE", help="also draw the memory/time frontier as a PNG")
    p.add_argument("--layers", type=positive_int, help="mlp, lm: number of layers (mlp 4, lm 2)")
    p.add_argument("--depth", type=positive_int, help="mlp: hidden width (512)")
    p.add_argument("--embed", type=positive_int, help="mlp: input/output width (128)")
    lm_options(p)


def _lm(args: argparse.Namespace, batch_size: int):
    import optax

    from spmdkit._plan._memory import lm_activations
    from spmdkit._tasks import lm
    from spmdkit._train._steps import task_state, task_train_step

    sizes = {k: getattr(args, k) for k in ("layers", "d_model", "heads", "seq_len", "precision") if getattr(args, k)}
    cfg = lm.LMConfig(**sizes)
    # Enough text for one global batch: the planner needs shapes, --measure a real batch.
    need = max(batch_size * (cfg.seq_len + 1) * 2, 20_000)
    task = lm.make(**sizes, text_dir=args.text_dir, text_bytes=args.text_bytes or need)
    optimizer = optax.adamw(lm.DEFAULTS["lr"])

    def step_for(remat: str, accum: int):
        _, init, loss_fn = lm.lm_functions(lm.LMConfig(**sizes, remat=remat))
        return task_train_step(dataclasses.replace(task, init=init, loss_fn=loss_fn), optimizer, accum)

    activations = lm_activations(cfg, batch_size)
    remat = args.remat_options or ((args.remat,) if args.remat else ("none",))
    dtype = "bfloat16" if cfg.precision == "bf16" else "float32"
    return task, task_state(task, optimizer), step_for, activations, remat, dtype


def _mlp(args: argparse.Namespace, batch_size: int):
    import optax

    from spmdkit._plan._memory import mlp_activations
    from spmdkit._tasks import mlp
    from spmdkit._train._steps import task_state, task_train_step

    sizes = {k: getattr(args, k) for k in ("layers", "depth", "embed") if getattr(args, k)}
    task = mlp.make(**sizes, num_train=512, num_eval=64)
    optimizer = optax.adam(mlp.DEFAULTS["lr"])
    return (task, task_state(task, optimizer), (lambda remat, accum: task_train_step(task, optimizer, accum)),
            mlp_activations(batch_size, **sizes))


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    import jax

    from spmdkit._plan import plan, print_plan, save_png
    from spmdkit._tasks import task_defaults

    if jax.device_count() != args.devices:
        raise ConfigError(fix(f"--devices {args.devices}, but this process has {jax.device_count()} device(s).",
                              f"leave --host-devices out (plan simulates --devices), or give --host-devices {args.devices}."))
    batch_size = args.batch_size or task_defaults(args.task)["batch_size"]
    if args.task == "lm":
        task, make_state, step_for, activations, remat, dtype = _lm(args, batch_size)
    else:
        if args.remat_options and tuple(args.remat_options) != ("none",):
            raise ConfigError(fix("--remat-options is an option of --task lm.", "drop it for --task mlp."))
        task, make_state, step_for, activations = _mlp(args, batch_size)
        remat, dtype = ("none",), "float32"
    rows = jax.tree.leaves(task.train_data)[0].shape[0]
    if rows < batch_size:
        raise ConfigError(fix(f"--batch-size {batch_size}: the task's training set has only {rows} examples.",
                              "give a smaller --batch-size (or, for lm, more --text-bytes)."))
    batch = jax.tree.map(lambda x: x[:batch_size], task.train_data)
    result = plan(make_state, None, batch, memory_per_device=args.memory_per_device, target=args.target,
                  rules=args.rules, remat=tuple(remat), accum=args.grad_accum, step_for=step_for,
                  processes=args.processes, dtype=dtype, activations=activations, measure=args.measure,
                  measure_steps=args.measure_steps,
                  measure_rounds=args.measure_rounds, progress=lambda s: console.print(f"compiling {s}", highlight=False, markup=False))
    result["task"] = args.task
    print_plan(result, console)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
        console.print(f"wrote {args.json}", highlight=False)
    if args.png:
        save_png(result, args.png)
        console.print(f"wrote {args.png}", highlight=False)
    return 0 if any(r["status"] == "ok" for r in result["candidates"]) else 1
