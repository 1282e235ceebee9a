"""``spmdkit calibrate``: this machine's hardware target file, measured.

The planner prices a layout with a small model of the hardware (``spmdkit plan
--target FILE``): a GEMM rate, a memory bandwidth and, per collective and per link, an
alpha-beta cost, time = s(n) * alpha + w(n, B) * beta (steps and wire bytes of a ring
algorithm, n devices, payload B bytes). This module measures those figures here:

- ``intra_host``: the N simulated CPU devices of one process. XLA:CPU's collectives
  within a process are memory copies between device buffers plus a rendezvous of the
  devices' threads, and all N devices share this machine's cores: the figure is what
  a collective over a mesh axis costs on simulated devices with every device busy,
  not the speed of any interconnect.
- ``inter_host``: 2 processes x 1 device joined by ``jax.distributed`` (gloo over
  loopback TCP), each process on its own core: the closest this machine comes to two
  hosts.

Every collective runs ``reps`` times inside one compiled program (a loop whose every
iteration depends on the last, so nothing is hoisted), the way a collective runs inside
a training step, without a dispatch per call. Cases are timed with the house method
(:mod:`spmdkit._bench._timing`: warm-up, interleaved rounds, medians); each round times
a call of ``reps`` and one of ``2 * reps`` collectives, each after a barrier, and keeps
the difference, so no fixed cost per call (dispatch, the wait for the other process) is
in the figure. ``check`` re-measures a file the same way: the same function, kinds,
sizes, rounds and repetitions. alpha and beta are fitted per kind and link by
non-negative least squares on the *relative* error, so 4 KiB and 64 MiB points count
alike, over two size ranges where one line misses (``pieces``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spmdkit._atomic import replace_text
from spmdkit._errors import SpmdkitError, fix, unwritable, wrong_output_path
from spmdkit._target import (  # the cost model shared with the planner, and its readers of a file's fields
    TRANSPOSE_CURVE_BYTES, TargetError, _collectives, _finite, _link, _link_json, _measurements, from_json,
    measure_cache_curve, measure_op_overhead, steps_and_wire, with_collective_waits)

FORMAT = "spmdkit-target"
VERSION = 1
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
LINKS = ("intra_host", "inter_host")
KiB, MiB = 1024, 1024 * 1024
DEFAULT_SIZES = tuple(4 * KiB * 4**k for k in range(8))  # 4 KiB .. 64 MiB, x4 apart
QUICK_SIZES = (4 * KiB, 64 * KiB, 1 * MiB)
ACCEPT_REL_ERR = 0.25  # the 2-process all-reduce must be predicted within this
ENV_STRIP = ("SPMDKIT_COORDINATOR", "SPMDKIT_NUM_PROCESSES", "SPMDKIT_PROCESS_ID", "SPMDKIT_HOST_DEVICES")


class CalibrationError(SpmdkitError, ValueError):
    """``spmdkit calibrate`` was asked for something it cannot measure or fit."""


class CalibrationFileError(SpmdkitError, OSError):
    """The target file cannot be written: ``--out`` a path that cannot be one (exit code 2,
    bad input), or in a place that refuses the write (5, an I/O failure)."""

    exit_code = 5  # the CLI's code for an I/O failure; check_out sets 2 for a wrong path


class CalibrationRunError(SpmdkitError, RuntimeError):
    """The processes that measure the inter-host link failed or timed out."""

    exit_code = 4  # the CLI's code for a lost peer process


# --- the cost model (target-schema.md) ------------------------------------------------


def predict(coeffs: dict[str, float], kind: str, nbytes: float, n: int) -> float:
    """Seconds for one collective: ``s(n) * alpha + w(n, B) * beta`` (0 for n == 1).

    Example:
        >>> predict({"alpha": 1e-5, "beta": 1e-9}, "all_reduce", 1e6, 2)
        0.00102
    """
    if n <= 1:
        return 0.0
    s, w = steps_and_wire(kind, n, nbytes)
    ab = _link(coeffs, f"{kind} coefficients").at(nbytes)  # the planner's reading of a link, pieces included
    return s * ab.alpha + w * ab.beta


def coefficients(target: dict[str, Any], kind: str, link: str) -> dict[str, float]:
    """The (alpha, beta) the target gives ``kind`` on ``link``: its own entry, else the link's."""
    own = target.get("collectives", {}).get(kind, {}).get(link)
    if own is not None:
        return own
    if link in target.get("links", {}):
        return target["links"][link]
    raise CalibrationError(fix(f"the target has no figures for link {link!r} (kind {kind!r}).",
                                   "calibrate it with spmdkit calibrate --processes 2."))


def _nnls2(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||a @ x - y|| over x >= 0 for two unknowns: the free optimum, else the best edge."""
    x, *_ = np.linalg.lstsq(a, y, rcond=None)
    if np.all(x >= 0):
        return x
    best, best_err = np.zeros(2), float(np.sum(y**2))
    for j in range(2):
        col = a[:, j]
        denom = float(col @ col)
        if denom > 0:
            cand = np.zeros(2)
            cand[j] = max(0.0, float(col @ y) / denom)
            err = float(np.sum((a @ cand - y) ** 2))
            if err < best_err:
                best, best_err = cand, err
    return best


def fit_alpha_beta(kind: str, points: Sequence[tuple[int, float, float]]) -> dict[str, float]:
    """Fit ``{"alpha", "beta"}`` (both >= 0) to ``(n, bytes, seconds)`` points of one kind and link.

    Least squares on the relative error (``predicted / measured - 1``), so a 4 KiB point,
    where alpha dominates, counts as much as a 64 MiB one, where beta does.

    Example:
        >>> pts = [(2, b, 2 * 1e-5 + b * 2e-9) for b in (4096, 65536, 2**20, 2**24)]
        >>> fit = fit_alpha_beta("all_reduce", pts)  # s(2) = 2, w(2, B) = B
        >>> round(fit["alpha"], 12), round(fit["beta"], 15)
        (1e-05, 2e-09)
    """
    raw, times = [], []
    for i, (n, nbytes, seconds) in enumerate(points):
        if n < 2:
            continue  # one device: nothing on any link
        if not (seconds > 0 and math.isfinite(seconds)):
            raise CalibrationError(fix(f"{kind}: point {i} (n={n}, {nbytes} bytes) has time {seconds!r}.",
                                       "pass positive, finite seconds."))
        raw.append(steps_and_wire(kind, n, nbytes))
        times.append(seconds)
    model = np.asarray(raw, dtype=np.float64).reshape(-1, 2)
    # Two unknowns need two points whose (steps, wire bytes) are not proportional.
    if len(raw) < 2 or np.linalg.matrix_rank(model / np.maximum(model.max(axis=0), 1e-300)) < 2:
        raise CalibrationError(fix(f"{kind}: {len(raw)} usable point(s) cannot fix two unknowns (alpha, beta).",
                                   "measure at least two distinct payload sizes with n >= 2 devices."))
    rows, ys = model / np.asarray(times)[:, None], np.ones(len(times))
    a = rows
    # Columns differ by ~1e6 in scale (steps vs bytes): normalise, solve, scale back.
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
    x = _nnls2(a / scale, ys) / scale
    return {"alpha": float(x[0]), "beta": float(x[1])}


SPLIT_ABOVE = 0.10  # a fit that errs by more at some size is tried in two size ranges
PIECE_MIN_SIZES = 3  # distinct sizes per range: two fix (alpha, beta), the third tests them


def _max_rel_err(kind: str, coeffs: dict[str, Any], points: Sequence[tuple[int, float, float]]) -> float:
    return max(abs(predict(coeffs, kind, b, n) / t - 1.0) for n, b, t in points if n >= 2)


def fit_pieces(kind: str, points: Sequence[tuple[int, float, float]]) -> dict[str, Any]:
    """:func:`fit_alpha_beta` over all sizes and, when that errs by more than 10% at some size,
    over two size ranges, kept as ``"pieces"`` if they halve the largest error.

    The cost is affine in bytes only within one regime: between two processes the time per
    byte of a payload that fits in the caches is a fraction of that of one that streams
    through memory, so one line through 4 KiB .. 64 MiB misses both ends. Each range holds
    at least 3 sizes, so every piece is tested by a point it was not solved from. The
    whole-range ``alpha``/``beta`` stay (a reader that ignores ``pieces`` gets them);
    ``pieces[0]["max_bytes"]`` is the geometric middle between the two ranges' sizes.

    Example (cheap bytes up to 1 MiB, 4x dearer beyond):
        >>> t = lambda b: 2e-4 + b * (1e-9 if b <= 2**20 else 4e-9)
        >>> fit = fit_pieces("all_reduce", [(2, b, t(b)) for b in (4096 * 4**k for k in range(8))])
        >>> [p.get("max_bytes") for p in fit["pieces"]], round(fit["pieces"][1]["beta"] * 1e9, 3)
        ([2097152, None], 4.0)
    """
    whole = fit_alpha_beta(kind, points)
    worst = _max_rel_err(kind, whole, points)
    sizes = sorted({b for n, b, _ in points if n >= 2})
    if worst <= SPLIT_ABOVE or len(sizes) < 2 * PIECE_MIN_SIZES:
        return whole
    best: tuple[float, int, dict, dict] | None = None
    for i in range(PIECE_MIN_SIZES, len(sizes) - PIECE_MIN_SIZES + 1):
        lo = [p for p in points if p[1] < sizes[i]]
        hi = [p for p in points if p[1] >= sizes[i]]
        f_lo, f_hi = fit_alpha_beta(kind, lo), fit_alpha_beta(kind, hi)
        err = max(_max_rel_err(kind, f_lo, lo), _max_rel_err(kind, f_hi, hi))
        if best is None or err < best[0]:
            best = (err, i, f_lo, f_hi)
    if best is None or best[0] > worst / 2:
        return whole
    _, i, f_lo, f_hi = best
    bound = int(round(math.sqrt(sizes[i - 1] * sizes[i])))
    return {**whole, "pieces": [{"max_bytes": bound, **f_lo}, f_hi]}


def prediction_errors(target: dict[str, Any], measurements: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every measured point with the target's prediction and the relative error (pred / meas - 1).

    Example:
        >>> t = {"links": {"inter_host": {"alpha": 1e-5, "beta": 1e-9}}}
        >>> m = [{"kind": "all_reduce", "link": "inter_host", "n": 2, "bytes": 1e6, "seconds": 0.00102}]
        >>> abs(prediction_errors(t, m)[0]["rel_err"]) < 1e-9
        True
    """
    rows = []
    for m in measurements:
        pred = predict(coefficients(target, m["kind"], m["link"]), m["kind"], m["bytes"], m["n"])
        rows.append({**m, "predicted": pred, "rel_err": pred / m["seconds"] - 1.0})
    return rows


def error_summary(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{kind: {link: {"points", "max_rel_err", "median_rel_err"}}}`` (absolute relative errors).

    Example:
        >>> rows = [{"kind": "all_reduce", "link": "inter_host", "rel_err": e} for e in (0.1, -0.3, 0.05)]
        >>> error_summary(rows)["all_reduce"]["inter_host"]
        {'points': 3, 'max_rel_err': 0.3, 'median_rel_err': 0.1}
    """
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r["kind"], r["link"]), []).append(abs(r["rel_err"]))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (kind, link), errs in groups.items():
        out.setdefault(kind, {})[link] = {"points": len(errs), "max_rel_err": max(errs),
                                          "median_rel_err": statistics.median(errs)}
    return out


# --- input checks --------------------------------------------------------------------

_SUFFIX = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB, "g": 1024 * MiB,
           "gb": 1024 * MiB, "gib": 1024 * MiB}


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``4K``, ``64KiB``, ``1M``, ``64MiB`` (binary units).

    Example:
        >>> parse_size("64KiB"), parse_size("1M"), parse_size("4096")
        (65536, 1048576, 4096)
    """
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SUFFIX:
        raise CalibrationError(fix(f"--sizes {text!r} is not a size in bytes.",
                                   "pass sizes like 4096, 64K, 1M or 64MiB (binary units)."))
    return int(float(m.group(1)) * _SUFFIX[m.group(2).lower()])


def check_sizes(sizes: Sequence[int] | None, quick: bool) -> list[int]:
    """Sorted distinct payload sizes in bytes; names a non-positive one."""
    if sizes is None:
        return list(QUICK_SIZES if quick else DEFAULT_SIZES)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise CalibrationError(fix(f"sizes={sizes!r} is not a list of byte counts.", "pass e.g. sizes=[4096, 2**20]."))
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0:
            raise CalibrationError(fix(f"sizes[{i}] = {s!r}: payload sizes must be whole numbers of bytes > 0.",
                                       "pass e.g. sizes=[4096, 65536, 2**20] (CLI: --sizes 4K 64K 1M)."))
    out = sorted({int(s) for s in sizes})
    if len(out) < 2:
        raise CalibrationError(fix(f"sizes={list(sizes)}: one distinct size cannot separate alpha from beta.",
                                   "pass at least two sizes, e.g. 4096 and 1048576 (CLI: --sizes 4K 1M)."))
    return out


def check_processes(processes: int) -> int:
    if isinstance(processes, bool) or processes not in (1, 2):
        raise CalibrationError(fix(f"processes={processes!r}: calibrate measures 1 process (intra_host only) or 2 "
                                   "(intra_host and inter_host, 1 device each).",
                                   "pass processes=1 or 2 (CLI: --processes 1 or 2)."))
    return processes


def check_out(out: str | os.PathLike | None) -> str | None:
    """The output path, checked writable before minutes of measuring."""
    if out is None:
        return None
    path = os.fspath(out)
    problem = unwritable(path, f"out={path!r} (--out)", "--out target.json")
    if problem:
        error = CalibrationFileError(fix(*problem))
        if wrong_output_path(path):  # a directory, a missing folder, a file in the way: bad input
            error.exit_code = 2
        raise error from None
    return path


def write_target(path: str, target: dict[str, Any]) -> None:
    """Write the JSON file whole or not at all (:func:`replace_whole`)."""
    try:
        replace_text(path, json.dumps(target, indent=2) + "\n")
    except OSError as e:
        raise CalibrationFileError(fix(f"cannot write the target file {path}: {e.strerror or e}.",
                                       "free disk space or pass another --out.")) from None


def load_target_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as fh:
            target = json.load(fh)
    except OSError as e:
        raise CalibrationError(fix(f"cannot read the target file {path}: {e.strerror or e}.",
                                       "pass a file written by spmdkit calibrate --out FILE.")) from None
    except ValueError as e:
        raise CalibrationError(fix(f"{path} is not JSON ({e}).", "pass a file written by spmdkit calibrate.")) from None
    if not isinstance(target, dict) or target.get("format") != FORMAT or target.get("version") != VERSION:
        raise CalibrationError(fix(f"{path} is not a {FORMAT} file of version {VERSION}.",
                                       "pass a file written by spmdkit calibrate --out FILE."))
    _check_readable(target, f"target file {path!r}")
    return target


def _check_calibrated(target: dict[str, Any], path: str) -> None:
    """--check compares this machine with a calibration of it. A datasheet file (h100x8) has none:
    it measured for minutes, then judged gloo on loopback against NVLink's figures."""
    if not any(isinstance(m, dict) and m.get("link") == "inter_host" for m in target.get("measurements") or []):
        raise CalibrationError(fix(f"{path} holds no inter_host measurements: it was not written by spmdkit calibrate "
                                   "--processes 2 on this machine (a datasheet target, or --processes 1), so there is "
                                   "no calibration to check.",
                                   "calibrate first: spmdkit calibrate --out target.json, then spmdkit calibrate "
                                   "--check target.json."))


def _check_readable(target: dict[str, Any], where: str) -> None:
    """The fields --check reads, checked before minutes of measuring: a hand-edited
    ``"collectives": []`` was a raw AttributeError, a measurement without ``bytes`` a KeyError."""
    links = target.get("links", {})
    if not isinstance(links, dict):
        raise TargetError(fix(f"{where}: links is {links!r:.80}, not an object.",
                              'write "links": {"inter_host": {"alpha": ..., "beta": ...}}.'))
    for name, link in links.items():
        _link(link, f"{where} links.{name}")
    _collectives(target.get("collectives"), where)
    for i, m in enumerate(_measurements(target.get("measurements"), where)):
        if isinstance(m, dict) and m.get("link") == "inter_host" and not (_finite(m.get("bytes")) and m["bytes"] >= 1):
            raise TargetError(fix(f"{where}: measurements[{i}] has bytes {m.get('bytes')!r}, not a size in bytes.",
                                  "leave measurements as spmdkit calibrate wrote them, or remove the field."))


# --- running the measurements --------------------------------------------------------


# A small all-reduce between 2 processes varies 2-5x from one call to the next, and runs in two
# regimes: gloo's event loop busy-polls while it waits, taking one of the 2 shared cores, and
# then 4 KiB costs 1-1.6 ms a collective instead of 0.15-0.3 (BENCHMARKS.md, "calibrate",
# 2026-11-27, later). Idle, the median of 5-7 rounds moved 2-4x between two runs a minute apart
# at 4 KiB-1 MiB; on one machine the median of 31 rounds moved under 12% over three runs, on
# another (rounds' IQR 100-370% of the median) -62% to +109% between two runs back to back,
# where 151 rounds moved -24% to +23%. A call lasts about 10 ms at small sizes; the whole
# calibration takes about 6 minutes idle (4.5 for a check).
INTER_HOST_ROUNDS = 151


def _defaults(quick: bool, rounds: int | None, link: str = "intra_host") -> tuple[int, float]:
    """(rounds, seconds one timed call should last) for measuring ``link``.

    Example:
        >>> _defaults(False, None), _defaults(False, None, "inter_host"), _defaults(False, 5, "inter_host")[0]
        ((7, 0.02), (151, 0.02), 5)
    """
    if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1):
        raise CalibrationError(fix(f"rounds={rounds!r}: need a whole number >= 1.", "pass e.g. rounds=7 (CLI: --rounds 7)."))
    default = 3 if quick else (INTER_HOST_ROUNDS if link == "inter_host" else 7)
    return rounds or default, 0.005 if quick else 0.02


def group_sizes(count: int, quick: bool) -> list[int]:
    """Mesh-axis sizes to measure on ``count`` devices: powers of two that divide it, and itself.

    Example:
        >>> group_sizes(8, quick=False), group_sizes(8, quick=True), group_sizes(6, quick=False)
        ([2, 4, 8], [8], [2, 6])
    """
    if count < 2:
        return []
    if quick:
        return [count]
    return sorted({2**k for k in range(1, count.bit_length()) if count % 2**k == 0} | {count})


def run_two_processes(sizes: Sequence[int], kinds: Sequence[str], rounds: int, target_s: float,
                      timeout: float, reps: dict[tuple[str, int], int] | None = None,
                      ) -> tuple[list[dict[str, Any]], list[str]]:
    """The inter-host points: 2 local processes x 1 device under ``spmdkit launch``.

    The one way both :func:`calibrate` and :func:`check` measure the inter-host link;
    ``reps`` fixes the repetitions per ``(kind, bytes)`` (see
    :func:`spmdkit._calibrate_measure.measure_collectives`). A hard ``timeout`` (seconds):
    the launcher and both processes are then killed with SIGKILL (JAX catches SIGTERM
    after ``jax.distributed.initialize``).
    """
    with tempfile.TemporaryDirectory(prefix="spmdkit-calibrate-") as tmp:
        out = os.path.join(tmp, "inter_host.json")
        command = [sys.executable, "-P", "-m", "spmdkit._cli", "launch", "-n", "2", "--host-devices-per-process", "1", "--",
                   sys.executable, "-P", "-m", "spmdkit._calibrate_worker", "--out", out, "--rounds", str(rounds),
                   "--target-seconds", str(target_s), "--timeout", str(int(max(60, timeout))),
                   "--sizes", *map(str, sizes), "--kinds", *kinds,
                   "--reps", *(f"{k}:{b}:{r}" for (k, b), r in sorted((reps or {}).items()))]
        env = {k: v for k, v in os.environ.items() if k not in ENV_STRIP}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise CalibrationRunError(fix(f"the 2-process measurement did not finish in {timeout:.0f} s; killed.",
                                          "run on a less busy machine, measure fewer --sizes, or raise the "
                                          "timeout (calibrate(timeout=...)).")) from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0 or not os.path.exists(out):
            tail = "\n".join(stderr.strip().splitlines()[-15:])
            raise CalibrationRunError(fix(f"the 2-process measurement failed (exit code {proc.returncode}):\n{tail}",
                                          "check that two processes can join with jax.distributed here "
                                          "(spmdkit launch -n 2 -- spmdkit devices), or pass --processes 1."))
        with open(out) as fh:
            result = json.load(fh)
    return result["measurements"], result["warnings"]


def _fit_all(points: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    collectives: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in KINDS:
        for link in LINKS:
            mine = [(p["n"], p["bytes"], p["seconds"]) for p in points if p["kind"] == kind and p["link"] == link]
            if mine:
                collectives.setdefault(kind, {})[link] = fit_pieces(kind, mine)
    return collectives


def _per_operand(collectives: dict[str, dict[str, dict[str, Any]]], points: Sequence[dict[str, Any]]) -> float | None:
    """Mark the inter-host fits ``per_operand`` when the 2-process run found alpha paid per operand
    of a combined all-reduce (its ``per_operand_ratio``, see
    :func:`spmdkit._plan._processes.measure_process_links`); the ratio, or None if not measured.

    Example:
        >>> fits = {"all_reduce": {"inter_host": {"alpha": 1e-4, "beta": 1e-9}}}
        >>> _per_operand(fits, [{"link": "inter_host", "per_operand_ratio": 1.3}]), fits["all_reduce"]["inter_host"]["per_operand"]
        (1.3, True)
    """
    from spmdkit._plan._processes import PER_OPERAND_RATIO

    ratios = [p["per_operand_ratio"] for p in points if p.get("link") == "inter_host" and "per_operand_ratio" in p]
    if not ratios:
        return None
    if ratios[0] > PER_OPERAND_RATIO:
        for per_link in collectives.values():
            if "inter_host" in per_link:
                per_link["inter_host"]["per_operand"] = True
    return ratios[0]


def build_target(points: Sequence[dict[str, Any]], compute: dict[str, Any], devices_per_host: int,
                 processes: int, warnings: Sequence[str]) -> dict[str, Any]:
    """The target dict (target-schema.md) from measured points and compute figures."""
    import jax

    collectives = _fit_all(points)
    ratio = _per_operand(collectives, points)
    links = {link: dict(collectives["all_reduce"][link]) for link in LINKS if link in collectives.get("all_reduce", {})}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    host = platform.node() or "this host"
    target: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "name": f"{host}: {devices_per_host} simulated CPU devices"
        + (" + 2 processes x 1 device (jax.distributed, gloo)" if processes == 2 else "") + ", calibrated",
        "source": f"calibrated on {host} {now}, jax {jax.__version__}",
        "devices_per_host": devices_per_host,
        "peak_flops": compute["peak_flops"],
        "memory_bandwidth": compute["memory_bandwidth"],
        "links": links,
        "collectives": collectives,
    }
    if compute.get("op_overhead"):
        target["op_overhead"] = compute["op_overhead"]
    if compute.get("cache_bandwidth"):
        target["cache_bandwidth"] = [list(p) for p in compute["cache_bandwidth"]]
    if compute.get("transpose_bandwidth"):
        target["transpose_bandwidth"] = [list(p) for p in compute["transpose_bandwidth"]]
    if ratio is not None:  # optional: the evidence for inter_host's per_operand
        target["per_operand_ratio"] = ratio
    rows = prediction_errors(target, points)
    target["measurements"] = [{k: r[k] for k in ("kind", "link", "n", "bytes", "seconds", "predicted", "rel_err",
                                                 "iqr_rel", "min_seconds", "single_seconds", "fixed_seconds", "reps",
                                                 "rounds", "flags")
                               if k in r} for r in rows]
    # Optional fields (a reader may ignore them): how well the fit explains the points, and why.
    target["fit_quality"] = error_summary(rows)
    target["compute_detail"] = compute["detail"]
    target["notes"] = [
        f"intra_host: {devices_per_host} simulated CPU devices in one process sharing {os.cpu_count()} cores; "
        "XLA:CPU collectives within a process are memory copies plus a rendezvous of the devices' threads, "
        "measured with every device of the mesh busy (mesh axes of n devices, all groups at once)",
        "inter_host: 2 processes x 1 device on this machine, jax.distributed with gloo over loopback TCP; "
        "per_operand (if present): a combined all-reduce of several arrays costs alpha per array "
        "(per_operand_ratio: each extra array's share of a one-array call)",
        "every collective timed inside one compiled loop: seconds = median over interleaved rounds of "
        "(t(2 reps) - t(reps)) / reps, each call after a barrier, so no fixed cost per call (dispatch, the wait "
        "for the peer process) is in it; fixed_seconds = that fixed cost per call",
        f"peak_flops and memory_bandwidth: per device with all {devices_per_host} devices computing at once",
        "fit: alpha, beta >= 0 by least squares on the relative error; links[*] = the all_reduce fit",
        "pieces (optional): where one alpha-beta line errs by more than 10%, fits over two size ranges "
        "(up to max_bytes, and above); alpha and beta alone are the fit over all sizes",
    ]
    target["warnings"] = merge_warnings(warnings)
    return target


def add_waits(target: dict[str, Any], n: int) -> None:
    """``target``'s in-process collectives (fitted from loops of nothing but collectives) given
    what they cost between computation, where a step runs them, measured now on ``n`` devices
    as the ``cpu`` target measures them: ``collective_sync_ops`` and the all-reduce's and
    all-gather's ``groups`` (:func:`spmdkit._target.with_collective_waits`). Without them a
    calibrated file priced every in-process collective below what ``--target cpu`` prices it."""
    if n < 2:
        return
    measured = with_collective_waits(from_json(target, "the calibrated target"), n)
    if measured.collective_sync_ops:
        target["collective_sync_ops"] = {str(g): v for g, v in sorted(measured.collective_sync_ops.items())}
    for kind, per_link in measured.collectives.items():
        groups = per_link["intra_host"].groups if "intra_host" in per_link else ()
        if groups:
            # a group of a link fitted in pieces has them too (floored piece by piece): as Target.to_json writes it
            target["collectives"][kind]["intra_host"]["groups"] = _link_json(per_link["intra_host"])["groups"]
    target["notes"].append(
        "collective_sync_ops and collectives.*.intra_host.groups: what an in-process collective costs between "
        "computation (its devices wait for each other there), measured as spmdkit plan's cpu target measures it: a "
        "tiny all-gather in a loop of matmuls (in operation times), and the all-reduce and all-gather over each group "
        "size at 4 KiB and 1 MiB after a small matmul (never below the loop's alpha and beta)")


def merge_warnings(warnings: Sequence[str]) -> list[str]:
    """One line per distinct message: ``"GROUP: message"`` lines that repeat across groups are counted.

    Example:
        >>> merge_warnings(["a n=2 4 B: busy", "a n=2 8 B: busy", "a n=2 8 B: x: spread 20%"])
        ['busy (2 of 2 measurement groups)', 'a n=2 8 B: x: spread 20%']
    """
    split = [w.split(": ", 1) if ": " in w else ["", w] for w in warnings]
    groups = {group for group, _ in split if group}
    counts: dict[str, int] = {}
    for _, msg in split:
        counts[msg] = counts.get(msg, 0) + 1
    merged = [f"{msg} ({k} of {len(groups)} measurement groups)" for msg, k in counts.items() if k > 1]
    return merged + [w for w, (_, msg) in zip(warnings, split) if counts[msg] == 1]


def _check_devices(devices: int | None):
    import jax

    if jax.process_count() > 1:
        raise CalibrationError(fix("calibrate runs in one process; this one is part of a jax.distributed job.",
                                   "run spmdkit calibrate on its own: it starts its own 2 processes."))
    have = jax.devices()
    if devices is None:
        return have
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise CalibrationError(fix(f"devices={devices!r}: need a whole number >= 1.", "pass e.g. devices=8."))
    if devices > len(have):
        raise CalibrationError(fix(f"devices={devices}: this process has only {len(have)} device(s).",
                                   f"call spmdkit.use_host_devices({devices}) before any JAX work "
                                   f"(CLI: --devices {devices})."))
    return have[:devices]


def calibrate(
    *,
    devices: int | None = None,
    processes: int = 2,
    sizes: Sequence[int] | None = None,
    rounds: int | None = None,
    quick: bool = False,
    out: str | os.PathLike | None = None,
    timeout: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure this machine and return its hardware target (the dict ``spmdkit plan --target`` reads).

    Times all_reduce (psum), all_gather, reduce_scatter (psum_scatter) and all_to_all at
    ``sizes`` bytes (default 4 KiB .. 64 MiB, x4 apart; ``quick``: 4 KiB, 64 KiB, 1 MiB), in
    ``rounds`` interleaved rounds (default 7, and 151 for the 2-process link; ``quick``: 3), on the
    first ``devices`` devices of this process (``intra_host``) and, with ``processes=2``,
    across 2 processes x 1 device (``inter_host``); fits alpha and beta per kind and link;
    measures the float32/bfloat16 GEMM rate and the memory bandwidth per device, and what an
    in-process collective costs between computation as the ``cpu`` target measures it
    (``collective_sync_ops``; the all-reduce's and all-gather's ``groups``). Writes the
    file to ``out`` if given (checked writable first). The per-point predictions and errors
    are in ``measurements``, their summary in ``fit_quality``.

    Example (a smoke run: 2 simulated devices, two sizes, one process, one round):
        >>> import spmdkit
        >>> target = spmdkit.calibrate(devices=2, processes=1, sizes=[4096, 65536], rounds=1, quick=True)
        >>> sorted(target["collectives"]["all_reduce"]["intra_host"])[:2]
        ['alpha', 'beta']
        >>> list(target["collective_sync_ops"])  # a collective's wait between computation, by group size
        ['2']
        >>> sorted({(m["kind"], m["bytes"]) for m in target["measurements"]})[:2]
        [('all_gather', 4096), ('all_gather', 65536)]
    """
    check_processes(processes)
    sizes = check_sizes(sizes, quick)
    given_rounds = rounds
    rounds, target_s = _defaults(quick, rounds)
    path = check_out(out)
    if timeout is not None and not timeout > 0:
        raise CalibrationError(fix(f"timeout={timeout!r}: need seconds > 0.", "pass e.g. timeout=600."))
    devs = _check_devices(devices)
    if len(devs) < 2 and processes == 1:
        raise CalibrationError(fix("one device in one process: no collective to measure.",
                                   "use several simulated devices (spmdkit.use_host_devices(8); CLI --devices 8) "
                                   "or processes=2."))
    log = log or (lambda _: None)
    from spmdkit._calibrate_measure import measure_collectives, measure_compute

    t0 = time.perf_counter()
    points, warnings = measure_collectives(devs, group_sizes(len(devs), quick), sizes, KINDS, "intra_host",
                                           rounds=rounds, target_s=target_s, log=log)
    compute = measure_compute(devs, quick=quick, rounds=rounds)
    warnings += compute["warnings"]
    # The fixed cost per operation dominates small CPU models; the planner adds it per op of a step.
    compute["op_overhead"] = measure_op_overhead(len(devs))
    # Small elementwise operations run from the caches; the planner prices their warm bytes by it.
    compute["cache_bandwidth"] = measure_cache_curve(len(devs), repeats=3 if quick else 5)
    # Transpositions (sequence parallelism's layout changes) run slower still, by their own curve.
    compute["transpose_bandwidth"] = measure_cache_curve(len(devs), TRANSPOSE_CURVE_BYTES, repeats=3,
                                                         transpose=True)
    if processes == 2:
        log("inter_host: starting 2 processes x 1 device")
        inter_rounds, _ = _defaults(quick, given_rounds, "inter_host")
        inter, more = run_two_processes(sizes, KINDS, inter_rounds, target_s, timeout or (600.0 if quick else 3600.0))
        points += inter
        warnings += more
    target = build_target(points, compute, len(devs), processes, warnings)
    log("intra_host: collectives between computation (their waits)")
    add_waits(target, len(devs))
    target["calibration_seconds"] = time.perf_counter() - t0
    if path:
        write_target(path, target)
    return target


def replay(target: dict[str, Any], sizes: Sequence[int] | None, rounds: int | None,
           quick: bool) -> tuple[list[int], list[str], int, dict[tuple[str, int], int]]:
    """What :func:`check` measures to re-measure a calibration: ``(sizes, kinds, rounds, reps)``.

    The file's own inter-host points: the same kinds (interleaved as the calibration did
    them: what runs between two all-reduces changes their time), sizes, rounds and
    repetitions per call, so the check runs the programs the fit was made from. ``sizes``
    or ``rounds`` given override the file's; sizes the file has no repetitions for are
    probed as a calibration does.

    Example:
        >>> t = {"measurements": [{"kind": k, "link": "inter_host", "bytes": b, "reps": r, "rounds": 5}
        ...                       for k, b, r in (("all_reduce", 4096, 40), ("all_gather", 4096, 80),
        ...                                       ("all_reduce", 65536, 20), ("all_gather", 65536, 30))]}
        >>> sizes, kinds, rounds, reps = replay(t, None, None, quick=False)
        >>> sizes, kinds, rounds, reps[("all_gather", 65536)]
        ([4096, 65536], ['all_reduce', 'all_gather'], 5, 30)
    """
    then = [m for m in target.get("measurements", []) if isinstance(m, dict) and m.get("link") == "inter_host"]
    measured = sorted({int(m["bytes"]) for m in then if m.get("kind") == "all_reduce"})
    sizes = check_sizes(sizes if sizes is not None else (measured if len(measured) >= 2 else None), quick)
    kinds = [k for k in KINDS if any(m.get("kind") == k for m in then)] or list(KINDS)
    if "all_reduce" not in kinds:
        kinds.insert(0, "all_reduce")
    file_rounds = [m["rounds"] for m in then if isinstance(m.get("rounds"), int)]
    if rounds is None and file_rounds:
        rounds = max(file_rounds)
    rounds, _ = _defaults(quick, rounds, "inter_host")
    reps = {(m["kind"], int(m["bytes"])): int(m["reps"]) for m in then
            if m.get("kind") in kinds and isinstance(m.get("reps"), int) and m["reps"] >= 1}
    return sizes, kinds, rounds, reps


def check(path: str, *, sizes: Sequence[int] | None = None, rounds: int | None = None, quick: bool = False,
          timeout: float | None = None) -> dict[str, Any]:
    """Re-measure the 2-process all-reduce and compare it with the prediction of the target file at ``path``.

    Measures exactly as the calibration did (:func:`replay`: the same kinds, sizes,
    rounds and repetitions, through the same :func:`run_two_processes`) and compares
    the all-reduce with the file's prediction. Returns ``{"rows": [{"bytes", "seconds",
    "predicted", "rel_err", "then_seconds", "vs_then", ...}], "max_rel_err",
    "median_rel_err", "max_vs_then", "limit", "ok", "warnings"}``: ``ok`` when every size
    is within 25% of the prediction; ``vs_then`` = now / the calibration's own
    measurement - 1, how well the measurement reproduces.
    """
    target = load_target_json(path)
    coeffs = coefficients(target, "all_reduce", "inter_host")
    _check_calibrated(target, path)
    sizes, kinds, rounds, reps = replay(target, sizes, rounds, quick)
    _, target_s = _defaults(quick, rounds)
    points, warnings = run_two_processes(sizes, kinds, rounds, target_s, timeout or (600.0 if quick else 1800.0),
                                         reps=reps)
    then = {int(m["bytes"]): m for m in target.get("measurements", [])
            if m.get("kind") == "all_reduce" and m.get("link") == "inter_host" and m.get("seconds")}
    rows = []
    for p in points:
        if p["kind"] != "all_reduce":
            continue
        row = {k: p.get(k) for k in ("bytes", "seconds", "iqr_rel", "reps", "fixed_seconds", "min_seconds",
                                     "single_seconds", "flags")}
        row["predicted"] = predict(coeffs, "all_reduce", p["bytes"], p["n"])
        row["rel_err"] = row["predicted"] / p["seconds"] - 1.0
        old = then.get(p["bytes"])
        if old:
            row["then_seconds"] = old["seconds"]
            row["vs_then"] = p["seconds"] / old["seconds"] - 1.0
            # How well the other statistics would have reproduced (the same rounds): the evidence
            # for the one ``seconds`` uses.
            for key in ("min_seconds", "single_seconds"):
                if (old.get(key) or 0) > 0 and (p.get(key) or 0) > 0:
                    row[f"vs_then_{key.split('_')[0]}"] = p[key] / old[key] - 1.0
        rows.append(row)
    errs = [abs(r["rel_err"]) for r in rows]
    drift = [abs(r["vs_then"]) for r in rows if "vs_then" in r]
    return {"file": path, "coefficients": coeffs, "kinds": kinds, "rounds": rounds, "rows": rows,
            "max_rel_err": max(errs), "median_rel_err": statistics.median(errs),
            "max_vs_then": max(drift) if drift else None, "limit": ACCEPT_REL_ERR,
            "ok": max(errs) <= ACCEPT_REL_ERR, "warnings": merge_warnings(warnings)}
