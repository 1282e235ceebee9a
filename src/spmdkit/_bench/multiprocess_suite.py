"""``spmdkit bench --suite multiprocess``: two processes on two cores, against PyTorch.

Same model, global batch (512) and steps for every case; each case is one launch of
:mod:`spmdkit._bench.mp_worker` (or two under ``spmdkit launch``), which reports its mean
step time after warm-up steps. Launches are interleaved like every other suite's cases:
R rounds, every case once per round, in a rotating order.

(a) spmdkit, 1 process using every core; (b) spmdkit, 2 processes x 1 device
(jax.distributed, gloo): the strategy's step (``impl="jit"``, the only one: the user's
whole step is compiled, so spmdkit cannot pack its gradients), and a hand-written
shard_map step with one all-reduce per leaf (``levers=allreduce``: one packed buffer); (c) PyTorch, 1 process; (d) PyTorch
DistributedDataParallel, gloo, 2 processes. PyTorch runs with its best settings (threads
= cores / processes, or its default; ``torch.compile``): the targets compare against the
fastest PyTorch case of the same run. ``levers=`` adds the levers of :data:`LEVERS`.
PyTorch is an optional extra (``pip install torch==2.13.0``, the CPU build, or ``-e '.[bench]'`` in a checkout); without
it the suite reports the spmdkit cases only, and says so. PyTorch may live in another
interpreter than JAX (a wheel for an older Python): ``torch_python`` (``--torch-python PATH``
or ``$SPMDKIT_TORCH_PYTHON``) runs the PyTorch cases there, with this spmdkit (alone, not the
directory it is installed in) first on its path, while the JAX cases run with the current interpreter and its JAX.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from spmdkit._bench._timing import inverse, machine, measure, ratio, target
from spmdkit._bench._torch import TORCH_PYTHON_ENV, ProbeFailed, probe_python
from spmdkit._bench.report import collect
from spmdkit._host_memory import REUSE, SYSTEM, child_env

# -P: no working directory on the path (a benchmark run from a folder holding a rich.py or a
# logging.py would import those in place of the library's), as the console script does.
WORKER = [sys.executable, "-P", "-m", "spmdkit._bench.mp_worker"]
LAUNCH = [sys.executable, "-P", "-m", "spmdkit._cli", "launch", "-n", "2", "--host-devices-per-process", "1", "--"]
MODELS = {"mlp": "MLP 784-1024-1024-10", "cnn": "digits CNN"}
BATCH = 512

# name -> extra cases: (label, command prefix, worker arguments)
LEVERS: dict[str, list[tuple[str, list[str], list[str]]]] = {
    "allreduce": [
        ("(b) lever: hand shard_map, one packed all-reduce", LAUNCH, ["--allreduce", "packed"]),
        ("(b) lever: hand shard_map, 4 bucketed all-reduces", LAUNCH, ["--allreduce", "bucketed", "--buckets", "4"]),
        ("(b) lever: hand shard_map, 8 bucketed all-reduces", LAUNCH, ["--allreduce", "bucketed", "--buckets", "8"]),
    ],
    "bf16": [
        ("(b) lever: packed all-reduce in bf16", LAUNCH, ["--allreduce", "packed", "--grad-dtype", "bf16"]),
        ("(b) lever: 4 buckets in bf16", LAUNCH, ["--allreduce", "bucketed", "--grad-dtype", "bf16"]),
    ],
    "accum": [
        ("(b) lever: strategy default + grad-accum 2", LAUNCH, ["--accum", "2"]),
        ("(b) lever: hand packed + grad-accum 2 (unrolled)", LAUNCH, ["--allreduce", "packed", "--accum", "2"]),
    ],
    "threads": [
        ("(a) lever: 1 process pinned to 1 core", WORKER, ["--threads", "1"]),
        ("(b) lever: default, each process pinned to its own core", LAUNCH, ["--threads", "1"]),
    ],
    "xla": [
        ("(b) lever: default, --xla_cpu_multi_thread_eigen=false", LAUNCH,
         ["--xla-flags=--xla_cpu_multi_thread_eigen=false"]),
    ],
}


MALLOC_NOTE = ", spmdkit's malloc settings"


def _cases(quick: bool, torch: bool, levers: list[str]) -> dict[str, tuple[list[str], list[str], str]]:
    """label -> (command prefix, worker arguments, host allocator); ``--framework torch``
    cases are run by the torch interpreter. PyTorch runs on glibc's defaults, and its
    best cases also with spmdkit's malloc settings, so its best of both is the baseline."""
    cases = {
        "(a) spmdkit, 1 process": (WORKER, ["--framework", "jax"], REUSE),
        "(b) spmdkit, 2 processes, default": (LAUNCH, ["--framework", "jax"], REUSE),
    }
    if not quick:
        cases["(b) hand shard_map, one all-reduce per leaf"] = (LAUNCH, ["--framework", "jax", "--allreduce", "leaf"],
                                                                 REUSE)
    if torch:
        c, d = "(c) PyTorch, 1 process", "(d) PyTorch DDP, 2 processes, cores/processes threads"
        cases[c] = (WORKER, ["--framework", "torch"], SYSTEM)
        cases[d] = (LAUNCH, ["--framework", "torch"], SYSTEM)
        if not quick:
            compiled = "(c) PyTorch, 1 process, torch.compile"
            cases[compiled] = (WORKER, ["--framework", "torch", "--compile"], SYSTEM)
            cases["(d) PyTorch DDP, default threads"] = (LAUNCH, ["--framework", "torch", "--torch-threads", "0"], SYSTEM)
            cases["(d) PyTorch DDP, torch.compile"] = (LAUNCH, ["--framework", "torch", "--compile"], SYSTEM)
            for label in (c, compiled, d):
                cases[label + MALLOC_NOTE] = (*cases[label][:2], REUSE)
    for lever in levers:
        for label, prefix, extra in LEVERS[lever]:
            cases[label] = (prefix, ["--framework", "jax", *extra], REUSE)
    return cases


def _launcher(cmd: list[str], errors: dict[str, str], label: str, steps: dict[str, list[list[float]]],
              env: dict[str, str] | None = None):
    """A self-timed case: one launch, its mean step time, or None (stderr kept in ``errors``).

    Every launch's own per-step times go to ``steps[label]``, to see the spread inside a process.
    """

    def case() -> float | None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        except subprocess.TimeoutExpired:
            errors[label] = "timed out after 900 s"
            return None
        for line in out.stdout.splitlines():
            line = line.removeprefix("[0] ")
            if line.startswith("{"):
                result = json.loads(line)
                steps.setdefault(label, []).append(result["step_times"])
                return float(result["step_s"])
        errors[label] = out.stderr[-2000:]
        return None

    return case


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _spmdkit_alone() -> str:
    """A directory that holds this spmdkit and nothing else, for another interpreter's path.

    spmdkit's parent directory is ``src/`` in a checkout but ``site-packages`` in an install,
    whose jax and numpy (built for this Python) then shadowed the other interpreter's own."""
    where = tempfile.mkdtemp(prefix="spmdkit-path-")
    os.symlink(os.path.dirname(os.path.abspath(__import__("spmdkit").__file__)), os.path.join(where, "spmdkit"))
    atexit.register(shutil.rmtree, where, True)  # the link only: rmtree does not follow it
    return where


def torch_interpreter(torch_python: str | None = None) -> tuple[str, dict[str, str]] | None:
    """The Python that runs the PyTorch cases and the environment it needs, or None without PyTorch.

    ``torch_python`` (else ``$SPMDKIT_TORCH_PYTHON``) names another interpreter, e.g. an env
    with a PyTorch wheel for an older Python; it gets this spmdkit alone first on
    ``PYTHONPATH`` (:func:`_spmdkit_alone`) so both frameworks run the same worker; it needs
    spmdkit's dependencies (jax, numpy) of its own. ValueError when that interpreter
    cannot import torch and spmdkit.
    """
    path = torch_python or os.environ.get(TORCH_PYTHON_ENV)
    if not path:
        return (sys.executable, dict(os.environ)) if _have_torch() else None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_spmdkit_alone(), os.environ.get("PYTHONPATH")) if p))
    try:
        probe_python(path, "import torch, spmdkit._bench.mp_worker", env)
    except ProbeFailed as e:
        if e.cannot_run:
            raise ValueError(f"--torch-python {path!r} (or ${TORCH_PYTHON_ENV}) cannot run: {e}") from e
        raise ValueError(f"--torch-python {path!r} (or ${TORCH_PYTHON_ENV}) cannot import torch and spmdkit "
                         f"({e}); give an interpreter with torch, numpy and spmdkit's dependencies installed") from e
    return path, env


def _versions(python: str, env: dict[str, str]) -> str:
    code = "import sys, torch; print(f'PyTorch {torch.__version__}, Python {sys.version.split()[0]}')"
    try:
        return probe_python(python, code, env) or "?"
    except ProbeFailed:
        return "?"


def check_levers(levers: str | None) -> list[str]:
    """The lever names of a ``--levers`` value ('all' or a comma-separated list); ValueError names an unknown one."""
    if not levers:
        return []
    names = list(LEVERS) if levers == "all" else [n.strip() for n in levers.split(",") if n.strip()]
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        raise ValueError(f"unknown lever(s) {unknown} for --levers: choose from {list(LEVERS)} or 'all'")
    return names


def _best(run: dict[str, Any], prefix: str) -> str | None:
    """The fastest case (lowest median step time) whose label starts with ``prefix``."""
    ok = [k for k, c in run["cases"].items() if k.startswith(prefix) and c["median"] == c["median"]]
    return min(ok, key=lambda k: run["cases"][k]["median"]) if ok else None


def _model_targets(model: str, run: dict[str, Any]) -> list[dict[str, Any]]:
    c, d, b_best = _best(run, "(c)"), _best(run, "(d)"), _best(run, "(b)")
    pairs = [("(b) default / best (d)", "(b) spmdkit, 2 processes, default", d),
             (f"best (b) [{b_best}] / best (d)", b_best, d),
             ("(a) / best (c)", "(a) spmdkit, 1 process", c)]
    out = []
    for label, ours, theirs in pairs:
        if ours and theirs:
            # Throughput ratio, paired per round: their step time / ours.
            out.append(target(f"{model}: {label} [{theirs}] (samples/s)", inverse(ratio(run, ours, theirs)), ">=", 1.0))
    return out


def _command(prefix: list[str], args: list[str], base: list[str], torch: tuple[str, dict[str, str]] | None,
             allocator: str) -> tuple[list[str], dict[str, str]]:
    """The case's command line and environment: PyTorch cases run the worker with the torch
    interpreter; every case's processes start with the host allocator it names."""
    worker, env = WORKER, dict(os.environ)
    if torch and "torch" in args:
        env = dict(torch[1])
        if torch[0] != sys.executable:
            worker = [torch[0], "-m", "spmdkit._bench.mp_worker"]  # without -P: that Python may predate 3.11
    return (LAUNCH if prefix is LAUNCH else []) + worker + args + base, child_env(env, allocator)


def run(quick: bool = False, rounds: int | None = None, levers: str | None = None,
        torch_python: str | None = None) -> dict[str, Any]:
    steps = 5 if quick else 40
    rounds = rounds or (2 if quick else 5)
    torch = torch_interpreter(torch_python)
    chosen = check_levers(levers)
    models = ["mlp"] if quick else list(MODELS)
    rows, targets, runs, errors, step_times = [], [], {}, {}, {}
    for model in models:
        base = ["--model", model, "--steps", str(steps), "--batch", str(BATCH)]
        # A case's prefix is WORKER (one process) or LAUNCH (two): LAUNCH runs WORKER under it.
        cases = {}
        for label, (prefix, args, allocator) in _cases(quick, torch is not None, chosen).items():
            cmd, env = _command(prefix, args, base, torch, allocator)
            cases[label] = _launcher(cmd, errors, f"{model}: {label}", step_times, env)
        if not quick:
            first = next(iter(cases))
            cases[first]()  # one untimed launch: the OS's file caches
            step_times.pop(f"{model}: {first}", None)
            errors.pop(f"{model}: {first}", None)
        run = measure(cases, rounds=rounds, warmup=0, self_timed=True)
        runs[MODELS[model]] = run
        for label, c in run["cases"].items():
            ok = c["median"] == c["median"]
            rows.append({
                "model": MODELS[model],
                "case": label,
                "samples_per_s": BATCH / c["median"] if ok else float("nan"),
                "iqr_pct": 100 * c["iqr_rel"] if ok else float("nan"),
                "min_per_s": BATCH / c["max"] if ok else float("nan"),
                "max_per_s": BATCH / c["min"] if ok else float("nan"),
                "flag": ",".join(c["flags"]),
            })
        targets += _model_targets(model, run)
    notes = [f"global batch {BATCH}, SGD, {steps} timed steps after 5 warm-up steps in each launch, every step synced; "
             f"{os.cpu_count()} cores; each round launches every case once, in a rotating order"]
    if torch:
        notes.append(f"PyTorch cases: {_versions(*torch)} ({torch[0]}); JAX cases: {sys.executable}")
    else:
        notes.append("PyTorch is not installed: spmdkit cases only, no targets "
                     "(pip install torch==2.13.0, or -e '.[bench]' in a checkout, for cases (c) and (d))")
    if quick:
        notes.append("quick: MLP only, fewer cases and rounds; a smoke run, not figures")
    report = {
        "suite": "multiprocess",
        "machine": machine(),
        "columns": ["model", "case", "samples_per_s", "iqr_pct", "min_per_s", "max_per_s", "flag"],
        "rows": rows,
        "targets": targets,
        "levers": chosen,
        "errors": errors,
        "launch_step_times": step_times,
        "notes": notes,
    }
    report = collect(report, runs)
    report["warnings"] += [f"{label} failed: {err.strip().splitlines()[-1] if err.strip() else '?'}"
                           for label, err in errors.items()]
    return report
