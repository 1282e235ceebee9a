"""spmdkit calibrate: the alpha-beta fit, the target file it writes, its checks and its command.

No test asserts a speed (the machine running the tests is shared): the real runs are
smoke runs that check the file's fields and that the fit explains what was measured.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import spmdkit
from spmdkit import _calibrate
from spmdkit._calibrate import (
    KINDS,
    CalibrationError,
    CalibrationFileError,
    calibrate,
    check,
    fit_alpha_beta,
    fit_pieces,
    predict,
    steps_and_wire,
)
from spmdkit._calibrate_measure import choose_reps, pair_case, per_collective
from spmdkit._target import (CACHE_CURVE_BYTES, TRANSPOSE_CURVE_BYTES, Link, TargetError, collective_time, from_json,
                             load_target)
from spmdkit._cli import main

SPMDKIT = shutil.which("spmdkit") or os.path.join(os.path.dirname(sys.executable), "spmdkit")
SIZES = [4096 * 4**k for k in range(8)]


# ---- the fit ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("alpha, beta", [(2e-5, 1e-9), (3e-4, 0.0), (0.0, 5e-10)])
def test_fit_recovers_known_alpha_beta(kind, alpha, beta):
    points = [(n, b, predict({"alpha": alpha, "beta": beta}, kind, b, n)) for n in (2, 4, 8) for b in SIZES]
    fit = fit_alpha_beta(kind, points)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert fit["beta"] == pytest.approx(beta, rel=1e-6, abs=1e-18)


def test_fit_on_noisy_times_stays_nonnegative_and_weights_small_sizes():
    rng = np.random.default_rng(0)
    alpha, beta = 5e-5, 2e-10
    points = [(2, b, predict({"alpha": alpha, "beta": beta}, "all_reduce", b, 2) * rng.uniform(0.9, 1.1))
              for b in SIZES]
    fit = fit_alpha_beta("all_reduce", points)
    assert fit["alpha"] == pytest.approx(alpha, rel=0.15) and fit["beta"] == pytest.approx(beta, rel=0.15)
    # Fitting relative errors: the 4 KiB point (alpha-dominated) is predicted as well as 64 MiB.
    for n, b, t in points:
        assert abs(predict(fit, "all_reduce", b, n) / t - 1) < 0.2
    # Times that fall with size would need a negative alpha or beta: the fit clamps to >= 0.
    falling = [(2, b, 1e-3 / (1 + k)) for k, b in enumerate(SIZES)]
    clamped = fit_alpha_beta("all_gather", falling)
    assert clamped["alpha"] >= 0 and clamped["beta"] >= 0


def test_fit_needs_two_sizes_and_positive_times():
    with pytest.raises(CalibrationError, match="two unknowns"):
        fit_alpha_beta("all_reduce", [(2, 4096, 1e-4), (2, 4096, 1.1e-4)])
    with pytest.raises(CalibrationError, match="point 1"):
        fit_alpha_beta("all_reduce", [(2, 4096, 1e-4), (2, 8192, 0.0)])


def test_the_cost_model_is_the_schema_table():
    assert steps_and_wire("all_reduce", 8, 800.0) == (14, 1400.0)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert steps_and_wire(kind, 8, 800.0) == (7, 700.0)
    assert steps_and_wire("collective_permute", 8, 800.0) == (1, 800.0)
    assert predict({"alpha": 1.0, "beta": 1.0}, "all_reduce", 1e6, 1) == 0.0


def _two_regimes(b):
    """A 2-process all-reduce whose bytes cost 4x more once the payload leaves the caches."""
    return 2e-4 + b * (0.5e-9 if b <= 2**20 else 2e-9)


def test_one_line_that_misses_is_split_in_two_size_ranges():
    points = [(2, b, _two_regimes(b)) for b in SIZES]  # 4 KiB .. 64 MiB
    assert max(abs(predict(fit_alpha_beta("all_reduce", points), "all_reduce", b, 2) / t - 1)
               for _, b, t in points) > 0.25  # one line cannot do it
    fit = fit_pieces("all_reduce", points)
    assert [p.get("max_bytes") for p in fit["pieces"]] == [2 * 2**20, None]
    assert fit["pieces"][0]["beta"] == pytest.approx(0.5e-9, rel=1e-6)
    assert fit["pieces"][1]["beta"] == pytest.approx(2e-9, rel=1e-6)
    for _, b, t in points:
        assert predict(fit, "all_reduce", b, 2) == pytest.approx(t, rel=1e-6)
    # the whole-range line stays for readers that ignore pieces
    assert fit["alpha"] == fit_alpha_beta("all_reduce", points)["alpha"]


def test_no_pieces_for_an_affine_cost_or_too_few_sizes():
    affine = [(2, b, 2e-4 + b * 1e-9) for b in SIZES]
    assert "pieces" not in fit_pieces("all_reduce", affine)
    # 4 sizes cannot make two ranges of 3: the one line stays however badly it fits
    four = [(2, b, _two_regimes(b)) for b in (4096, 65536, 2**20, 2**24)]
    assert fit_pieces("all_reduce", four) == fit_alpha_beta("all_reduce", four)


def test_the_planner_reads_the_pieces(tmp_path):
    fit = fit_pieces("all_reduce", [(2, b, _two_regimes(b)) for b in SIZES])
    path = tmp_path / "t.json"
    doc = {"format": "spmdkit-target", "version": 1, "name": "t", "source": "test", "devices_per_host": 1,
           "peak_flops": {"float32": 1e9}, "memory_bandwidth": 1e9,
           "links": {"intra_host": {"alpha": 1e-5, "beta": 1e-9}, "inter_host": fit}}
    path.write_text(json.dumps(doc))
    target = load_target(path)
    for b in (4096, 2**20, 3 * 2**20, 2**26):
        assert collective_time(target, "all_reduce", b, 2, "inter_host") == pytest.approx(
            predict(fit, "all_reduce", b, 2))
    assert json.loads(json.dumps(target.to_json()))["links"]["inter_host"]["pieces"][0]["max_bytes"] == 2 * 2**20
    doc["links"]["inter_host"] = {**fit, "pieces": [{"max_bytes": 100, "alpha": "x", "beta": 0.0}]}
    path.write_text(json.dumps(doc))
    with pytest.raises(TargetError, match=r"inter_host.pieces\[0\]"):
        load_target(path)


# ---- the timing path: t(2r) - t(r), after a barrier ---------------------------------


def test_the_difference_of_two_calls_has_no_fixed_cost_per_call():
    now, log = [0.0], []
    per, skew = 1e-5, iter([3e-3, 3e-3, 1e-4, 1e-4, 2e-3, 2e-3])  # per call: dispatch + waiting for the peer

    def run(k):
        log.append(k)
        now[0] += next(skew) + k * per

    case, raw = pair_case(run, 10, lambda: log.append("barrier"), clock=lambda: now[0])
    got = [case() for _ in range(3)]
    assert got == pytest.approx([per] * 3, rel=1e-9)
    # one timed call per round would report the skew spread over the reps: 31x and 2x too slow
    assert [t1 / 10 for t1, _ in raw] == pytest.approx([3.1e-4, 2e-5, 2.1e-4])
    # a barrier before every timed call; which call goes first alternates
    assert log == ["barrier", 10, "barrier", 20, "barrier", 20, "barrier", 10, "barrier", 10, "barrier", 20]
    assert per_collective(raw, 10)["seconds"] == pytest.approx(per)
    assert per_collective(raw, 10)["fixed_seconds"] == pytest.approx(2e-3)


def test_the_statistic_is_the_median_of_paired_differences():
    raw = [(1.0e-3, 1.1e-3), (5.0e-3, 5.1e-3), (1.2e-3, 1.6e-3)]  # round 2 hit by load in both calls
    fig = per_collective(raw, 10)
    assert fig["seconds"] == pytest.approx(1e-5) and fig["flags"] == []
    assert fig["single_seconds"] == pytest.approx(1.2e-4)
    assert fig["iqr_rel"] == pytest.approx(1.5)  # quartiles of (1, 1, 4) x 1e-5: 1 and 2.5
    # noise larger than r collectives: the upper bound t(2r) / 2r, flagged
    fig = per_collective([(2e-3, 1e-3), (2e-3, 1.5e-3), (1e-3, 3e-3)], 10)
    assert fig["flags"] == ["fixed-cost"] and fig["seconds"] == pytest.approx(1.5e-3 / 20)
    assert fig["iqr_rel"] > 0  # relative to the figure used, not to the negative median difference


def test_the_probe_for_repetitions_times_each_call_after_the_barrier():
    # 0.4 ms per collective; the peer arrives 3 ms late at any call not preceded by the barrier,
    # which absorbs that wait outside the timed call.
    now, log, per = [0.0], [], 4e-4
    waiting = [0.0]

    def barrier():
        log.append("barrier")
        now[0] += waiting[0]
        waiting[0] = 0.0

    def run(k):
        log.append(k)
        now[0] += waiting[0] + 1e-4 + k * per  # 0.1 ms dispatch
        waiting[0] = 3e-3

    asked = []
    reps = choose_reps(run, barrier, 0.01, agree=lambda flag: asked.append(flag) or flag, clock=lambda: now[0])
    # doubling to 32 (12.9 ms, the first call over 10 ms), then the median of 3 calls of 32
    assert reps == 25  # 10 ms / 0.403 ms: the 0.1 ms dispatch spread over 32 collectives
    assert log == [1] + [x for k in (1, 2, 4, 8, 16, 32, 32, 32) for x in ("barrier", k)]
    assert asked == [False] * 5 + [True]


def test_every_process_probes_as_process_0_decides():
    # This process measures calls far over the target, process 0 does not: it must keep doubling
    # with process 0 (the calls are collectives), and its own times still set nothing odd.
    now, log = [0.0], []

    def run(k):
        log.append(k)
        now[0] += 1.0

    decisions = iter([False, False, True])
    reps = choose_reps(run, lambda: None, 0.01, agree=lambda flag: next(decisions), clock=lambda: now[0])
    assert log == [1, 1, 2, 4, 4, 4] and reps == 1
    # 1 ms per collective; a burst of load stops the doubling early (the call of 4 takes 18 ms),
    # and the median of the 3 calls of 4 still reads 1 ms
    now[0], log[:] = 0.0, []
    times = iter([1e-3, 1e-3, 2e-3, 18e-3, 4e-3, 4e-3])

    def noisy(k):
        log.append(k)
        now[0] += next(times)

    assert choose_reps(noisy, lambda: None, 0.01, clock=lambda: now[0]) == 10
    assert log == [1, 1, 2, 4, 4, 4]


# ---- a real calibration in this process ---------------------------------------------


def _check_fields(target, devices, links):
    assert target["format"] == "spmdkit-target" and target["version"] == 1
    assert isinstance(target["name"], str) and target["name"]
    assert target["source"].startswith("calibrated on ") and ", jax " in target["source"]
    assert target["devices_per_host"] == devices
    assert set(target["peak_flops"]) == {"float32", "bfloat16"}
    for rate in target["peak_flops"].values():
        assert 1e6 < rate < 1e15  # FLOP/s per device: any CPU is within this
    assert 1e6 < target["memory_bandwidth"] < 1e13
    assert set(target["links"]) == set(links)
    for kind in KINDS:
        assert set(target["collectives"][kind]) == set(links)
        for link in links:
            c = target["collectives"][kind][link]
            assert c["alpha"] >= 0 and c["beta"] >= 0 and math.isfinite(c["alpha"]) and math.isfinite(c["beta"])
            assert c["alpha"] > 0 or c["beta"] > 0
    # the links are the all-reduce's fit; its groups (between computation) stay the all-reduce's own
    loop = {k: v for k, v in target["collectives"]["all_reduce"]["intra_host"].items() if k != "groups"}
    assert target["links"]["intra_host"] == loop
    for m in target["measurements"]:
        assert m["kind"] in KINDS and m["link"] in links and m["seconds"] > 0 and m["bytes"] > 0
        assert m["predicted"] == pytest.approx(predict(target["collectives"][m["kind"]][m["link"]], m["kind"],
                                                        m["bytes"], m["n"]))
        assert m["rel_err"] == pytest.approx(m["predicted"] / m["seconds"] - 1)
    for kind in KINDS:
        for link in links:
            q = target["fit_quality"][kind][link]
            errs = [abs(m["rel_err"]) for m in target["measurements"] if (m["kind"], m["link"]) == (kind, link)]
            assert q["points"] == len(errs) and q["max_rel_err"] == pytest.approx(max(errs))


def _fake_two_processes(calls, factor=1.0, ratio=None):
    """A stand-in for the 2-process launch: records its arguments, returns points as the worker does
    (with ``ratio``: the worker's per-operand measurement on every point)."""

    def run(sizes, kinds, rounds, target_s, timeout, reps=None):
        calls.append({"sizes": list(sizes), "kinds": list(kinds), "rounds": rounds, "reps": reps})
        points = [{"kind": k, "link": "inter_host", "n": 2, "bytes": b, "iqr_rel": 0.05,
                   "fixed_seconds": 1e-3, "reps": (reps or {}).get((k, b), 7 + i), "rounds": rounds, "flags": [],
                   "seconds": factor * predict({"alpha": 2e-4, "beta": 1e-9}, k, b, 2) * (1.1 if b == 4096 else 1.0)}
                  for i, (b, k) in enumerate((b, k) for b in sizes for k in kinds)]
        for p in points:  # the other statistics of the same rounds: 10% apart from the first
            p.update(min_seconds=p["seconds"], single_seconds=p["seconds"] * (1.1 if reps else 1.0))
            if ratio is not None:
                p["per_operand_ratio"] = ratio
        return points, []

    return run


def test_tiny_calibration_writes_every_schema_field_and_check_replays_it(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(_calibrate, "run_two_processes", _fake_two_processes(calls))
    # What the in-process collectives cost between computation, as the cpu target measures it (its own
    # tests time it): a fixed figure here, to see it reach the file and the planner.
    from spmdkit import _target

    waited = []
    monkeypatch.setattr(_target, "measure_collective_sync",
                        lambda n: waited.append(n) or _target.SyncMeasurement({2: 3e-4}, 1e-4))
    monkeypatch.setattr(_target, "measure_group_links",
                        lambda n, loops: {kind: ((2, Link(link.alpha + 1e-4, link.beta * 2)),)
                                          for kind, link in loops.items()})
    out = tmp_path / "target.json"
    target = calibrate(devices=2, processes=2, sizes=[4096, 65536], rounds=2, quick=True, out=out)
    _check_fields(target, devices=2, links=["intra_host", "inter_host"])
    assert {(m["kind"], m["n"], m["bytes"]) for m in target["measurements"] if m["link"] == "intra_host"} == {
        (k, 2, b) for k in KINDS for b in (4096, 65536)}
    assert all(m["reps"] >= 1 and m["fixed_seconds"] is not None for m in target["measurements"])
    # --check measures through the same function, with the calibration's kinds, sizes, rounds and reps
    monkeypatch.setattr(_calibrate, "run_two_processes", _fake_two_processes(calls, factor=1.2))
    result = check(str(out))
    made, again = calls
    assert made["reps"] is None  # the calibration probes
    assert again["sizes"] == made["sizes"] and again["kinds"] == made["kinds"] == list(KINDS)
    assert again["rounds"] == made["rounds"] == 2
    assert again["reps"] == {(m["kind"], m["bytes"]): m["reps"] for m in target["measurements"]
                             if m["link"] == "inter_host"}
    assert [r["vs_then"] for r in result["rows"]] == pytest.approx([0.2, 0.2])
    assert [r["reps"] for r in result["rows"]] == [7, 11]
    assert [r["vs_then_single"] for r in result["rows"]] == pytest.approx([1.2 * 1.1 - 1] * 2)
    capsys.readouterr()
    assert main(["calibrate", "--check", str(out)]) in (0, 6)
    text = capsys.readouterr().out
    assert "reproduces the calibration's own within 20%" in text
    assert "difference of the minima 20%, one call of reps per round 32%" in text
    assert json.loads(out.read_text()) == json.loads(json.dumps(target))
    assert spmdkit.calibrate is calibrate
    loaded = spmdkit.load_target(out)  # the planner reads what calibrate writes
    assert loaded.devices_per_host == 2 and loaded.link("all_gather", "intra_host").beta == pytest.approx(
        target["collectives"]["all_gather"]["intra_host"]["beta"])
    # the per-operation cost the planner charges for every op of a step is calibrated too
    assert 0 < target["op_overhead"] < 1e-2 and loaded.op_overhead == target["op_overhead"]
    # and the warm bytes' rates: one point a size, 32 KiB to 32 MiB read and written
    assert [b for b, _ in loaded.cache_bandwidth] == [2 * b for b in CACHE_CURVE_BYTES]
    assert all(r > 0 for _, r in loaded.cache_bandwidth)
    # and the transpositions' (32 KiB to 8 MiB), which the planner charges sequence parallelism's layout changes
    assert [b for b, _ in loaded.transpose_bandwidth] == [2 * b for b in TRANSPOSE_CURVE_BYTES]
    assert all(r > 0 for _, r in loaded.transpose_bandwidth)
    # and what a collective costs between computation: the wait (beyond the tiny all-gather's own price, in
    # operation times) and the all-reduce's and all-gather's groups, so the file prices as --target cpu does
    assert waited == [2] and list(target["collective_sync_ops"]) == ["2"]
    own = target["collectives"]["all_gather"]["intra_host"]
    plain = json.loads(json.dumps(target))
    for kind in ("all_reduce", "all_gather"):
        plain["collectives"][kind]["intra_host"].pop("groups")
    gather = collective_time(from_json(plain), "all_gather", 4 * 256 * 2, 2, "intra_host")  # the loop's price
    assert loaded.collective_sync_ops[2] == pytest.approx(3.0 - gather / 1e-4)
    for kind in ("all_reduce", "all_gather"):
        fitted = target["collectives"][kind]["intra_host"]
        assert fitted["groups"] == {"2": {"alpha": pytest.approx(fitted["alpha"] + 1e-4),
                                          "beta": pytest.approx(fitted["beta"] * 2)}}
        assert loaded.link(kind, "intra_host").for_group(2).alpha == pytest.approx(fitted["alpha"] + 1e-4)
    assert "groups" not in target["links"]["intra_host"] and "groups" not in target["collectives"]["all_to_all"][
        "intra_host"] and own["groups"]
    assert any("between computation" in note for note in target["notes"])
    from rich.console import Console

    from spmdkit._calibrate_cli import print_fit

    shown = Console(record=True, width=200, file=io.StringIO())
    print_fit(target, shown)
    text = shown.export_text()
    assert text.count("2 devices, between computation") == 2 and "also waits (operation times, by devices in its " \
        f"group): 2: {loaded.collective_sync_ops[2]:.1f}" in text


# ---- bad input: named errors before anything is measured -----------------------------


@pytest.mark.parametrize("sizes, match", [([0, 4096], r"sizes\[0\] = 0"), ([4096, -1], r"sizes\[1\] = -1"),
                                          ([4096], "at least two sizes"), ("4K", "not a list")])
def test_bad_sizes_are_named(sizes, match):
    with pytest.raises(CalibrationError, match=match) as e:
        calibrate(sizes=sizes)
    assert isinstance(e.value, ValueError) and "Fix:" in str(e.value)


@pytest.mark.parametrize("processes", [0, 3, True])
def test_processes_other_than_1_or_2_are_named(processes):
    with pytest.raises(CalibrationError, match=rf"processes={processes!r}"):
        calibrate(processes=processes)


def test_unwritable_out_is_named_before_measuring(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CalibrationFileError, match="file is a file, not a directory") as e:  # not "mkdir -p" it
        calibrate(processes=1, out=blocker / "target.json")
    assert isinstance(e.value, OSError)
    with pytest.raises(CalibrationFileError, match="is a directory"):
        calibrate(processes=1, out=tmp_path)


def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert main(["calibrate", "--processes", "3", "--out", str(tmp_path / "t.json")]) == 2
    assert "processes=3" in capsys.readouterr().err
    assert main(["calibrate", "--sizes", "0", "4K", "--out", str(tmp_path / "t.json")]) == 2
    assert "sizes[0] = 0" in capsys.readouterr().err
    assert main(["calibrate", "--processes", "1", "--out", str(tmp_path)]) == 2  # a directory given: bad input
    assert "is a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--sizes", "lots"])
    assert e.value.code == 2 and "--sizes" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()



def test_host_devices_after_the_command_name_is_its_device_count():
    # The README: every command but launch takes --host-devices N before or after its name;
    # after `calibrate` it was "unrecognized arguments" (exit 2). It is --devices N there.
    from spmdkit._cli import build_parser

    for argv in (["calibrate", "--host-devices", "4"], ["--host-devices", "4", "calibrate"], ["calibrate", "--devices", "4"]):
        assert build_parser().parse_args(argv).host_devices == 4, argv

def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--devices", "--processes", "--sizes", "--rounds", "--quick", "--check"):
        assert flag in text


# ---- --check: the comparison (its measurement stubbed; the real launch is below) ----


def test_check_compares_the_two_process_all_reduce_with_the_file(tmp_path, monkeypatch):
    coeffs = {"alpha": 1e-4, "beta": 1e-9}
    path = tmp_path / "target.json"
    path.write_text(json.dumps({"format": "spmdkit-target", "version": 1, "links": {"inter_host": coeffs},
                                "measurements": [{"kind": "all_reduce", "link": "inter_host", "bytes": b}
                                                 for b in (4096, 65536)]}))
    asked = {}

    def fake_run(sizes, kinds, rounds, target_s, timeout, reps=None):
        asked.update(sizes=list(sizes), kinds=list(kinds))
        # 4 KiB 10% slower than predicted, 64 KiB 40% faster
        return [{"kind": "all_reduce", "link": "inter_host", "n": 2, "bytes": b, "iqr_rel": 0.0,
                 "seconds": predict(coeffs, "all_reduce", b, 2) * f} for b, f in ((4096, 1.1), (65536, 1 / 0.6))], []

    monkeypatch.setattr(_calibrate, "run_two_processes", fake_run)
    result = check(str(path))
    assert asked == {"sizes": [4096, 65536], "kinds": ["all_reduce"]}  # the file's own sizes and kinds
    assert [round(r["rel_err"], 6) for r in result["rows"]] == [round(1 / 1.1 - 1, 6), -0.4]
    assert result["max_rel_err"] == pytest.approx(0.4) and not result["ok"]
    assert main(["calibrate", "--check", str(path)]) == 6
    path.write_text(json.dumps({"format": "spmdkit-target", "version": 1, "links": {"intra_host": coeffs}}))
    with pytest.raises(CalibrationError, match="inter_host"):
        check(str(path))
    path.write_text("{}")
    with pytest.raises(CalibrationError, match="not a spmdkit-target file"):
        check(str(path))


@pytest.mark.parametrize("change, words", [
    ({"collectives": [1]}, r"collectives is \[1\], not an object"),
    ({"links": ["inter_host"]}, r"links is \['inter_host'\], not an object"),
    ({"links": {"inter_host": {"alpha": 1e-4, "beta": 1e-9, "max_byte": 3}}}, r"'max_byte' is not a field of a link"),
    ({"measurements": [{"kind": "all_reduce", "link": "inter_host"}]}, r"measurements\[0\] has bytes None"),
    ({"measurements": 5}, r"measurements is 5, not a list"),
])
def test_check_names_a_broken_field_before_measuring(tmp_path, monkeypatch, change, words):
    # A hand-edited file was a raw AttributeError / KeyError (before or after minutes of measuring).
    path = tmp_path / "target.json"
    path.write_text(json.dumps({"format": "spmdkit-target", "version": 1,
                                "links": {"inter_host": {"alpha": 1e-4, "beta": 1e-9}}, **change}))
    monkeypatch.setattr(_calibrate, "run_two_processes", lambda *a, **k: pytest.fail("measured a broken file"))
    with pytest.raises(TargetError, match=words):
        check(str(path))


# ---- the one 2-process launch ------------------------------------------------------


def _run(command, timeout):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_") or k == "SPMDKIT_COMPILE_CACHE"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # calibrate, its launcher and both workers
            proc.wait()
    return proc.returncode, stdout, stderr


def test_cli_two_processes_measure_the_inter_host_link_and_check_replays_it(tmp_path):
    out = tmp_path / "target.json"
    code, stdout, stderr = _run([SPMDKIT, "calibrate", "--quick", "--devices", "2", "--sizes", "4K", "64K",
                                 "--rounds", "2", "--timeout", "200", "--out", str(out)], timeout=260)
    assert code == 0, stderr[-3000:]
    target = json.loads(out.read_text())
    _check_fields(target, devices=2, links=["intra_host", "inter_host"])
    inter = {(m["kind"], m["n"], m["bytes"]): m for m in target["measurements"] if m["link"] == "inter_host"}
    assert set(inter) == {(k, 2, b) for k in KINDS for b in (4096, 65536)}
    assert "2-process all-reduce" in stdout and f"wrote {out}" in stdout
    # the workers also measured whether alpha is paid per operand of a combined all-reduce
    assert math.isfinite(target["per_operand_ratio"])
    assert target["links"]["inter_host"].get("per_operand", False) is (target["per_operand_ratio"] > 0.5)
    # the check's processes run the calibration's programs: same repetitions (passed to the workers)
    code, stdout, stderr = _run([SPMDKIT, "calibrate", "--check", str(out), "--quick", "--json", "--timeout", "200"],
                                timeout=260)
    assert code in (0, 6), stderr[-3000:]  # 6: outside 25%, which a loaded machine may well be
    result = json.loads(stdout)
    assert result["kinds"] == list(KINDS) and result["rounds"] == 2
    assert [(r["bytes"], r["reps"]) for r in result["rows"]] == [
        (b, inter[("all_reduce", 2, b)]["reps"]) for b in (4096, 65536)]
    assert all(r["seconds"] > 0 and math.isfinite(r["vs_then"]) for r in result["rows"])


@pytest.mark.parametrize("ratio, per_operand", [(1.3, True), (0.1, False)])
def test_calibration_marks_inter_host_per_operand_as_measured_and_plan_reads_it(tmp_path, monkeypatch, ratio,
                                                                                 per_operand):
    from spmdkit._target import collective_time, load_target, steps_and_wire

    monkeypatch.setattr(_calibrate, "run_two_processes", _fake_two_processes([], ratio=ratio))
    out = tmp_path / "target.json"
    made = calibrate(devices=2, processes=2, sizes=[4096, 65536], rounds=2, quick=True, out=out)
    assert made["per_operand_ratio"] == ratio
    assert made["links"]["inter_host"].get("per_operand", False) is per_operand
    assert all(fits["inter_host"].get("per_operand", False) is per_operand for fits in made["collectives"].values())
    assert "per_operand" not in made["links"]["intra_host"]  # a lone process's link is priced once
    target = load_target(str(out))
    one = collective_time(target, "all_reduce", 4096, 2, "inter_host", operands=1)
    five = collective_time(target, "all_reduce", 4096, 2, "inter_host", operands=5)
    alpha = target.link("all_reduce", "inter_host").at(4096).alpha
    steps, _ = steps_and_wire("all_reduce", 2, 4096)  # ring steps, each paying alpha
    assert five - one == pytest.approx(4 * steps * alpha if per_operand else 0.0, rel=1e-6, abs=1e-15)


def test_check_of_a_datasheet_target_says_there_is_no_calibration(monkeypatch):
    # It measured for minutes, then judged gloo on loopback against the H100 file's InfiniBand figures.
    from spmdkit._target import example_targets

    monkeypatch.setattr(_calibrate, "run_two_processes", lambda *a, **k: pytest.fail("measured a datasheet file"))
    with pytest.raises(CalibrationError, match=r"(?s)holds no inter_host measurements.*Fix: calibrate first"):
        check(str(example_targets()["h100x8"]))
