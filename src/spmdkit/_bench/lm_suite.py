"""``spmdkit bench --suite lm``: language-model training throughput, spmdkit against PyTorch.

spmdkit's ``--task lm`` model (:mod:`spmdkit._tasks.lm`: byte-level decoder-only
transformer, RMSNorm, ``nn.scan`` over layers) trained by its own step on one device, in
one process, against the same architecture in PyTorch (:func:`lm_worker.torch_lm`) with
its best CPU settings: threads = cores, eager and ``torch.compile`` both measured; the
target compares with the faster. Same shapes, batch, AdamW, the same training bytes in the
same order (standard-library text, :func:`spmdkit._tasks.lm.load_text`) and the same
initial parameters: the suite checks that both models hold the same number of
parameters and reports the held-out bits per byte of each, before and after the timed
steps (both models train: similar figures). Extra rows, no target: spmdkit with bf16
compute, with remat and with the scan over layers as a rolled loop (``scan_unroll=1``; the
model unrolls it by default), each against spmdkit's default in float32, and PyTorch with
bf16 autocast.

Every case is a worker process (:mod:`spmdkit._bench.lm_worker`) started once and kept:
the rounds send each worker "run K steps" in a rotating order (the house method,
:mod:`spmdkit._bench._timing`), and its mean step time is the round's figure.

PyTorch is an optional extra (``pip install torch==2.13.0``, or ``-e '.[bench]'`` in a checkout). The PyTorch workers run in
this Python if it has torch, else in the Python named by ``SPMDKIT_TORCH_PYTHON`` (any
interpreter with torch and NumPy: the worker needs neither JAX nor spmdkit there). Without
either, the suite reports the spmdkit cases only, and says so.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from spmdkit._bench import lm_worker
from spmdkit._bench._timing import inverse, machine, measure, ratio, target
from spmdkit._bench._torch import TORCH_PYTHON_ENV, ProbeFailed, probe_python
from spmdkit._bench.report import collect
from spmdkit._host_memory import REUSE, SYSTEM, child_env
from spmdkit._tasks.lm import LMConfig, load_text, lm_functions, windows

# Model, batch and corpus sizes; a round (``steps`` steps of every case) takes seconds on 2 cores.
# The held-out bits per byte is taken after ``eval_after`` training steps (the timed ones and
# untimed ones after them). With the token embedding's former normal(1.0) init the loss spiked
# around step 15 at lr 3e-3 and the frameworks' rounding differences grew there; from step 20 to
# 64 their training losses agreed within a few hundredths of a bit per byte again. With
# normal(0.02) it falls steadily; the 64 steps are kept.
SIZES = {
    False: {"layers": 4, "d_model": 256, "heads": 4, "seq_len": 128, "batch": 16, "text_bytes": 1_000_000, "steps": 4,
            "eval_after": 64},
    True: {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64, "batch": 8, "text_bytes": 200_000, "steps": 2,
           "eval_after": 0},
}
BASE = "spmdkit f32"
ROLLED = "spmdkit f32, rolled scan"
TORCH_REUSE = "PyTorch f32, torch.compile, spmdkit's malloc settings"
START_TIMEOUT = 600  # s: start-up includes importing torch or JAX, and the first eval
RUN_TIMEOUT = 1800  # s: a warm-up run includes compiling (torch.compile takes minutes on a busy machine)


# ---------------------------------------------------------------- the cases
SYSTEM_ALLOC = "spmdkit f32, system allocator"


def cases(quick: bool, torch: bool) -> dict[str, tuple[str, list[str], str]]:
    """label -> (framework, worker arguments, host allocator: REUSE or SYSTEM)."""
    out = {
        BASE: ("jax", ["--precision", "f32"], REUSE),
        "spmdkit bf16": ("jax", ["--precision", "bf16"], REUSE),
        "spmdkit f32, remat full": ("jax", ["--precision", "f32", "--remat", "full"], REUSE),
        # Lever rows: the scan over layers as a rolled loop (scan_unroll=1), the default before
        # the model unrolled it; glibc's allocator defaults, before spmdkit reused host memory.
        ROLLED: ("jax", ["--precision", "f32", "--scan-unroll", "1"], REUSE),
        SYSTEM_ALLOC: ("jax", ["--precision", "f32"], SYSTEM),
    }
    if torch:
        out["PyTorch f32, eager"] = ("torch", ["--precision", "f32"], SYSTEM)
        if not quick:  # torch.compile takes minutes to compile: not for smoke runs
            out["PyTorch f32, torch.compile"] = ("torch", ["--precision", "f32", "--compile"], SYSTEM)
            # PyTorch's best configuration may include the allocator settings spmdkit uses: measured too.
            out[TORCH_REUSE] = ("torch", ["--precision", "f32", "--compile"], REUSE)
            out["PyTorch bf16 autocast, eager"] = ("torch", ["--precision", "bf16"], SYSTEM)
    return out


def torch_python() -> tuple[str | None, str]:
    """``(interpreter, description)`` of the Python that runs the PyTorch cases, or ``(None, why not)``."""
    named = os.environ.get(TORCH_PYTHON_ENV)
    if not named:
        if importlib.util.find_spec("torch") is None:
            return None, (f"PyTorch is not installed in this Python ({sys.executable}): spmdkit cases only, no target. "
                          f"Install it (pip install torch==2.13.0; in a checkout of spmdkit: pip install -e '.[bench]') or name a Python that has it in {TORCH_PYTHON_ENV}")
        return sys.executable, f"torch {importlib.metadata.version('torch')} in {sys.executable}"
    try:
        version = probe_python(named, "import numpy, torch; print(torch.__version__)")
    except ProbeFailed as e:
        what = f"cannot run: {e}" if e.cannot_run else f"cannot import torch and numpy ({e})"
        return None, f"{TORCH_PYTHON_ENV}={named!r} {what}; spmdkit cases only, no target"
    return named, f"torch {version} in {named} ({TORCH_PYTHON_ENV})"


def worker_env(allocator: str = REUSE) -> dict[str, str]:
    """This process's environment for a worker with one CPU device (no simulated devices),
    with glibc's malloc set as spmdkit sets it (``REUSE``) or left at its defaults (``SYSTEM``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPMDKIT_HOST_DEVICES", "JAX_NUM_CPU_DEVICES")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return child_env(env, allocator)


class Worker:
    """One worker process, asked one JSON command at a time; ``None`` answers when it failed."""

    def __init__(self, label: str, cmd: list[str], errors: dict[str, str], allocator: str = REUSE):
        self.label, self.errors = label, errors
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True, env=worker_env(allocator))
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            if line.startswith("{"):
                self._lines.put(json.loads(line))
        self._lines.put(None)  # the process ended

    def answer(self, timeout: float) -> dict[str, Any] | None:
        if self.label in self.errors:
            return None
        try:
            reply = self._lines.get(timeout=timeout)
        except queue.Empty:
            reply, why = None, f"no answer within {timeout:.0f} s"
        else:
            why = f"ended with exit code {self._proc.poll()}"
        if reply is None:
            self._stderr.seek(0)
            self.errors[self.label] = f"{why}: {self._stderr.read()[-2000:]}"
        return reply

    def ask(self, command: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        if self.label in self.errors:
            return None
        try:
            self._proc.stdin.write(json.dumps(command) + "\n")
            self._proc.stdin.flush()
        except OSError:
            pass  # it died: answer() says so with its stderr
        return self.answer(timeout)

    def close(self) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()


# ---------------------------------------------------------------- the run
def write_inputs(directory: Path, size: dict[str, int]) -> tuple[Path, Path, int]:
    """The data and initial-parameter files every worker reads; the spmdkit model's parameter count."""
    train, held_out = load_text(None, size["text_bytes"])
    order = np.random.default_rng(0).permutation((len(train) - 1) // size["seq_len"])
    data = directory / "data.npz"
    np.savez(data, train=windows(train, size["seq_len"], "training")[order],
             held_out=windows(held_out, size["seq_len"], "held-out"))
    cfg = LMConfig(layers=size["layers"], d_model=size["d_model"], heads=size["heads"], seq_len=size["seq_len"])
    params = nn.unbox(jax.jit(lm_functions(cfg)[1])(jax.random.key(0)))  # the workers' init: the same key
    flat = lm_worker.flatten_params(params)
    init = directory / "init.npz"
    np.savez(init, **flat)
    return data, init, sum(v.size for v in flat.values())


def _command(framework: str, args: list[str], python: str | None, size: dict[str, int], data: Path, init: Path):
    model = ["--layers", str(size["layers"]), "--d-model", str(size["d_model"]), "--heads", str(size["heads"]),
             "--seq-len", str(size["seq_len"]), "--batch", str(size["batch"]), "--data", str(data)]
    if framework == "jax":
        return [sys.executable, "-P", "-m", "spmdkit._bench.lm_worker", "--framework", "jax", *model, *args]
    # By path: the PyTorch Python needs neither JAX nor spmdkit.
    return [python, lm_worker.__file__, "--framework", "torch", "--init", str(init), *model, *args]


def _start(labels: dict[str, tuple[str, list[str], str]], python, size, data, init, params: int, errors):
    """Start every worker (one after another: start-up is not timed), check its parameter count,
    and take its held-out bits per byte at initialisation."""
    workers, before, counts = {}, {}, {}
    for label, (framework, args, allocator) in labels.items():
        w = Worker(label, _command(framework, args, python, size, data, init), errors, allocator)
        workers[label] = w
        ready = w.answer(START_TIMEOUT)
        if ready is None:
            continue
        counts[label] = ready["params"]
        if ready["params"] != params:
            raise RuntimeError(f"lm suite: case {label!r} has {ready['params']:,} parameters, the spmdkit model "
                               f"{params:,}: not the same architecture")
        reply = w.ask({"eval": True}, START_TIMEOUT)
        before[label] = reply["bits_per_byte"] if reply else float("nan")
    return workers, before, counts


def _timed_case(worker: Worker, steps: int, step_times: dict[str, list]):
    def case() -> float | None:
        reply = worker.ask({"run": steps}, RUN_TIMEOUT)
        if reply is None:
            return None
        step_times.setdefault(worker.label, []).append(reply["step_times"])
        return float(reply["step_s"])

    return case


def _best(run: dict[str, Any], prefix: str) -> str | None:
    ok = [k for k, c in run["cases"].items() if k.startswith(prefix) and c["median"] == c["median"]]
    return min(ok, key=lambda k: run["cases"][k]["median"]) if ok else None


def _rows(run, tokens: int, before: dict, after: dict) -> list[dict[str, Any]]:
    rows = []
    for label, c in run["cases"].items():
        ok = c["median"] == c["median"]
        vs = inverse(ratio(run, label, BASE))["median"] if BASE in run["cases"] else float("nan")
        rows.append({
            "case": label,
            "tokens_per_s": tokens / c["median"] if ok else float("nan"),
            "iqr_pct": 100 * c["iqr_rel"] if ok else float("nan"),
            "min_per_s": tokens / c["max"] if ok else float("nan"),
            "max_per_s": tokens / c["min"] if ok else float("nan"),
            "x_spmdkit_f32": vs,
            "bpb_init": before.get(label, float("nan")),
            "bpb": after.get(label, float("nan")),
            "flag": ",".join(c["flags"]),
        })
    return rows


def _ratios(run: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(targets, extra ratios): throughput ratios, paired per round."""
    cases_ = run["cases"]
    targets, extra = [], []
    best = _best(run, "PyTorch f32")
    if BASE in cases_ and best:
        targets.append(target(f"lm: spmdkit f32 / best PyTorch f32 [{best}] (tokens/s)",
                              inverse(ratio(run, BASE, best)), ">=", 1.0))
    pairs = [("spmdkit bf16 / spmdkit f32", "spmdkit bf16", BASE),
             ("spmdkit remat full / no remat", "spmdkit f32, remat full", BASE),
             ("spmdkit rolled scan / unrolled", ROLLED, BASE),
             ("spmdkit system allocator / reused host memory", SYSTEM_ALLOC, BASE),
             ("PyTorch torch.compile, spmdkit's malloc settings / its defaults", TORCH_REUSE,
              "PyTorch f32, torch.compile"),
             ("PyTorch bf16 autocast / PyTorch f32 eager", "PyTorch bf16 autocast, eager", "PyTorch f32, eager"),
             ("spmdkit bf16 / PyTorch bf16 autocast", "spmdkit bf16", "PyTorch bf16 autocast, eager")]
    for name, a, b in pairs:
        if a in cases_ and b in cases_:
            r = inverse(ratio(run, a, b))
            extra.append({"name": f"{name} (tokens/s)", "value": r["median"], "q1": r["q1"], "q3": r["q3"],
                          "flags": r["flags"]})
    return targets, extra


def _measure(labels, python, size, errors, step_times):
    """Start the workers, time their rounds, take the bits per byte; ``(run, before, after, counts, params, trained)``."""
    with tempfile.TemporaryDirectory(prefix="spmdkit-lm-bench-") as tmp:
        data, init, params = write_inputs(Path(tmp), size)
        workers: dict[str, Worker] = {}
        try:
            workers, before, counts = _start(labels, python, size, data, init, params, errors)
            timed = {label: _timed_case(w, size["steps"], step_times) for label, w in workers.items()}
            # Warm-up: one run of every case (compilation); then the rounds.
            run_ = measure(timed, rounds=size["rounds"], warmup=1, self_timed=True)
            after, trained = {}, None
            for label, w in workers.items():
                done = size["steps"] * (size["rounds"] + 1)
                if size["eval_after"] > done:  # past the loss spike of the first steps (see SIZES)
                    w.ask({"run": size["eval_after"] - done}, RUN_TIMEOUT)
                reply = w.ask({"eval": True}, RUN_TIMEOUT)
                after[label] = reply["bits_per_byte"] if reply else float("nan")
                trained = reply["steps"] if reply else trained
        finally:
            for w in workers.values():
                w.close()
    return run_, before, after, counts, params, trained


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    size = dict(SIZES[quick], rounds=rounds or (2 if quick else 5))
    python, torch_note = torch_python()
    errors: dict[str, str] = {}
    step_times: dict[str, list] = {}
    run_, before, after, counts, params, trained = _measure(cases(quick, python is not None), python, size, errors,
                                                            step_times)
    targets, extra = _ratios(run_)
    shape = {k: size[k] for k in ("layers", "d_model", "heads", "seq_len", "batch")}
    peers = {label: n for label, n in counts.items() if not label.startswith("spmdkit")}
    notes = [
        f"model {shape}: {params:,} parameters in spmdkit"
        + "".join(f", {n:,} in {label}" for label, n in peers.items()) + (" (equal)" if peers else ""),
        f"{size['steps']} steps per case per round, every step synced; {size['rounds']} rounds after one warm-up run; "
        f"{trained} training steps per case (the timed ones, then untimed ones) before the held-out bits per byte (bpb); AdamW lr {lm_worker.LR}; "
        f"{os.cpu_count()} cores; {torch_note}",
        *[f"{e['name']} = {e['value']:.3f} [IQR {e['q1']:.3f}-{e['q3']:.3f}] (no target)"
          + (f" (flagged: {', '.join(e['flags'])})" if e["flags"] else "") for e in extra],
    ]
    if quick:
        notes.append("quick: a tiny model, no torch.compile, 2 rounds unless --rounds; a smoke run, not figures")
    report = {
        "suite": "lm",
        "machine": machine(),
        "columns": ["case", "tokens_per_s", "iqr_pct", "min_per_s", "max_per_s", "x_spmdkit_f32", "bpb_init", "bpb",
                    "flag"],
        "rows": _rows(run_, size["batch"] * size["seq_len"], before, after),
        "targets": targets,
        "ratios": extra,
        "parameters": {"spmdkit": params, **counts},
        "torch": torch_note,
        "errors": errors,
        "worker_step_times": step_times,
        "notes": notes,
    }
    report = collect(report, {"lm": run_})
    report["warnings"] += [f"{label} failed: {err.strip().splitlines()[-1] if err.strip() else '?'}"
                           for label, err in errors.items()]
    if python is None:
        report["warnings"].append(torch_note)
    return report
