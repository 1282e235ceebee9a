"""spmdkit calibrate: the alpha-beta fit, the target file it writes, its checks and its command.

No test asserts a speed (the machine running the tests is shared): the real runs are
smoke runs that check the file's fields and that the fit explains what was measured.
"""

from __future__ import annotations

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
    predict,
    steps_and_wire,
)
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
    assert target["links"]["intra_host"] == target["collectives"]["all_reduce"]["intra_host"]
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


def test_tiny_intra_process_calibration_writes_every_schema_field(tmp_path):
    out = tmp_path / "target.json"
    target = calibrate(devices=2, processes=1, sizes=[4096, 65536], rounds=2, quick=True, out=out)
    _check_fields(target, devices=2, links=["intra_host"])
    assert {(m["kind"], m["n"], m["bytes"]) for m in target["measurements"]} == {
        (k, 2, b) for k in KINDS for b in (4096, 65536)}
    assert json.loads(out.read_text()) == json.loads(json.dumps(target))
    assert spmdkit.calibrate is calibrate
    loaded = spmdkit.load_target(out)  # the planner reads what calibrate writes
    assert loaded.devices_per_host == 2 and loaded.link("all_gather", "intra_host").beta == pytest.approx(
        target["collectives"]["all_gather"]["intra_host"]["beta"])
    # the per-operation cost the planner charges for every op of a step is calibrated too
    assert 0 < target["op_overhead"] < 1e-2 and loaded.op_overhead == target["op_overhead"]


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
    with pytest.raises(CalibrationFileError, match="does not exist") as e:
        calibrate(processes=1, out=blocker / "target.json")
    assert isinstance(e.value, OSError)
    with pytest.raises(CalibrationFileError, match="is a directory"):
        calibrate(processes=1, out=tmp_path)


def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert main(["calibrate", "--processes", "3", "--out", str(tmp_path / "t.json")]) == 2
    assert "processes=3" in capsys.readouterr().err
    assert main(["calibrate", "--sizes", "0", "4K", "--out", str(tmp_path / "t.json")]) == 2
    assert "sizes[0] = 0" in capsys.readouterr().err
    assert main(["calibrate", "--processes", "1", "--out", str(tmp_path)]) == 5  # an I/O failure
    assert "is a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--sizes", "lots"])
    assert e.value.code == 2 and "--sizes" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


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

    def fake_run(sizes, kinds, rounds, target_s, timeout):
        asked.update(sizes=list(sizes), kinds=list(kinds))
        # 4 KiB 10% slower than predicted, 64 KiB 40% faster
        return [{"kind": "all_reduce", "link": "inter_host", "n": 2, "bytes": b, "iqr_rel": 0.0,
                 "seconds": predict(coeffs, "all_reduce", b, 2) * f} for b, f in ((4096, 1.1), (65536, 1 / 0.6))], []

    monkeypatch.setattr(_calibrate, "run_two_processes", fake_run)
    result = check(str(path))
    assert asked == {"sizes": [4096, 65536], "kinds": ["all_reduce"]}  # the file's own sizes
    assert [round(r["rel_err"], 6) for r in result["rows"]] == [round(1 / 1.1 - 1, 6), -0.4]
    assert result["max_rel_err"] == pytest.approx(0.4) and not result["ok"]
    assert main(["calibrate", "--check", str(path)]) == 1
    path.write_text(json.dumps({"format": "spmdkit-target", "version": 1, "links": {"intra_host": coeffs}}))
    with pytest.raises(CalibrationError, match="inter_host"):
        check(str(path))
    path.write_text("{}")
    with pytest.raises(CalibrationError, match="not a spmdkit-target file"):
        check(str(path))


# ---- the one 2-process launch ------------------------------------------------------


def test_cli_two_processes_measure_the_inter_host_link(tmp_path):
    out = tmp_path / "target.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_") or k == "SPMDKIT_COMPILE_CACHE"}
    command = [SPMDKIT, "calibrate", "--quick", "--devices", "2", "--sizes", "4K", "64K", "--rounds", "2",
               "--timeout", "200", "--out", str(out)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=260)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # calibrate, its launcher and both workers
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    target = json.loads(out.read_text())
    _check_fields(target, devices=2, links=["intra_host", "inter_host"])
    inter = {(m["kind"], m["n"], m["bytes"]) for m in target["measurements"] if m["link"] == "inter_host"}
    assert inter == {(k, 2, b) for k in KINDS for b in (4096, 65536)}
    assert "2-process all-reduce" in stdout and f"wrote {out}" in stdout
