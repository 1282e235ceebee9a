"""use_host_devices, the environment variable, the device table, mesh suggestions."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

import spmdkit
from spmdkit._devices import model_parallel_suggestion


def test_same_count_after_start_is_a_no_op():
    spmdkit.use_host_devices(8)
    assert jax.device_count() == 8


def test_changing_count_after_start_is_our_error():
    with pytest.raises(spmdkit.DeviceSetupError) as e:
        spmdkit.use_host_devices(4)
    msg = str(e.value)
    assert "already" in msg or "after JAX had started" in msg
    assert "8 CPU device(s)" in msg
    assert "SPMDKIT_HOST_DEVICES=4" in msg and "--host-devices 4" in msg
    # It said to set the variable "before Python starts", which a plain script never reads.
    assert "before Python starts" not in msg and "which a plain Python script does not read" in msg
    assert "before any JAX operation" in msg
    assert isinstance(e.value, RuntimeError)  # still catchable as before


@pytest.mark.parametrize("bad", [0, -2, 2.5, "8", True])
def test_bad_count(bad):
    with pytest.raises(spmdkit.DeviceSetupError, match="n must be an int >= 1"):
        spmdkit.use_host_devices(bad)


def test_fresh_process_gets_requested_devices():
    code = "import spmdkit, jax; spmdkit.use_host_devices(3); print(jax.device_count())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "3"


def test_env_is_not_read_by_a_plain_script():
    # What the README and the errors now say: only the spmdkit command (and initialize()) read
    # SPMDKIT_HOST_DEVICES; a script importing spmdkit gets what JAX finds until it asks.
    code = "import spmdkit, jax; print(jax.device_count())"
    env = {**os.environ, "SPMDKIT_HOST_DEVICES": "3", "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=env)
    assert out.stdout.strip() == "1"


@pytest.mark.parametrize("raw, expected", [("", None), ("4", 4), (" 2 ", 2)])
def test_env_parsing(monkeypatch, raw, expected):
    monkeypatch.setenv(spmdkit.ENV_HOST_DEVICES, raw)
    assert spmdkit.host_devices_from_env() == expected


@pytest.mark.parametrize("raw", ["zero", "0", "-3"])
def test_env_bad_value(monkeypatch, raw):
    monkeypatch.setenv(spmdkit.ENV_HOST_DEVICES, raw)
    with pytest.raises(spmdkit.DeviceSetupError, match="SPMDKIT_HOST_DEVICES="):
        spmdkit.host_devices_from_env()


def test_more_simulated_devices_than_the_bound_are_refused_before_jax_starts(monkeypatch):
    from spmdkit._devices import MAX_HOST_DEVICES

    # 100000 hung the start with no word; the bound is checked before JAX is told anything.
    with pytest.raises(spmdkit.DeviceSetupError, match=rf"use_host_devices\(100000\): at most {MAX_HOST_DEVICES} "):
        spmdkit.use_host_devices(100000)
    monkeypatch.setenv(spmdkit.ENV_HOST_DEVICES, str(MAX_HOST_DEVICES + 1))
    with pytest.raises(spmdkit.DeviceSetupError, match="SPMDKIT_HOST_DEVICES=4097: at most 4096 simulated devices"):
        spmdkit.host_devices_from_env()
    monkeypatch.setenv(spmdkit.ENV_HOST_DEVICES, str(MAX_HOST_DEVICES))
    assert spmdkit.host_devices_from_env() == MAX_HOST_DEVICES


def test_device_table():
    rows = spmdkit.device_table()
    assert [r["id"] for r in rows] == list(range(8))
    assert all(r["platform"] == "cpu" and r["process_index"] == 0 and r["local"] for r in rows)


@pytest.mark.parametrize(
    "n, data_only, model_parallel",
    [
        (8, {"data": 8}, {"data": 2, "model": 4}),
        (4, {"data": 4}, {"data": 2, "model": 2}),
        (6, {"data": 6}, {"data": 2, "model": 3}),
        (1, {"data": 1}, None),
        (7, {"data": 7}, None),
    ],
)
def test_suggestions(n, data_only, model_parallel):
    assert spmdkit.suggest_mesh(n) == data_only
    assert model_parallel_suggestion(n) == model_parallel


def test_a_backend_that_cannot_start_is_named_by_jax_platforms(monkeypatch):
    from spmdkit._devices import backend_failure
    from spmdkit._errors import DeviceSetupError

    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    err = backend_failure(RuntimeError("Unable to initialize backend 'tpu': no libtpu.so "
                                       "(set JAX_PLATFORMS='' to automatically choose an available backend)"))
    assert isinstance(err, DeviceSetupError)
    assert "JAX_PLATFORMS='tpu'" in str(err) and "no libtpu.so" in str(err) and "JAX_PLATFORMS=cpu" in str(err)
    # Another failure is not blamed on the variable.
    assert backend_failure(RuntimeError("a bug of the user's")) is None
