"""Host-device simulation and the device table."""

from __future__ import annotations

import os
from typing import Any

import jax

from spmdkit._errors import DeviceSetupError, fix

ENV_HOST_DEVICES = "SPMDKIT_HOST_DEVICES"
# Simulated devices share the machine's cores and XLA sets each one up when JAX starts: 1024
# took 3.6 s here, 4096 26 s and 1.4 GB, 100,000 hang with no word. Tests use up to 8, benchmarks 64.
MAX_HOST_DEVICES = 4096


def check_host_device_count(n: int, asked: str) -> None:
    """A DeviceSetupError if ``n`` simulated devices, asked for as ``asked``, are too many."""
    if n <= MAX_HOST_DEVICES:
        return
    raise DeviceSetupError(fix(
        f"{asked}: at most {MAX_HOST_DEVICES} simulated devices. They share this machine's {os.cpu_count()} "
        "core(s) and each is set up when JAX starts: a few thousand take half a minute, many more stall the "
        "start with no word.",
        f"ask for {MAX_HOST_DEVICES} or fewer; simulated devices show that a program is correct on N devices, "
        "not how fast it runs there."))


def use_host_devices(n: int) -> None:
    """Simulate ``n`` CPU devices in this process (before any JAX work).

    Simulated devices share the machine's cores: they prove that a program is
    correct on ``n`` devices, not that it is faster. Calling this after JAX has
    started its backends raises :class:`DeviceSetupError`, unless the process
    already has exactly ``n`` CPU devices.

    Example:
        >>> import spmdkit, jax
        >>> spmdkit.use_host_devices(jax.device_count())  # already so: a no-op
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DeviceSetupError(
            fix(f"use_host_devices(n={n!r}): n must be an int >= 1.", "pass e.g. n=8.")
        )
    check_host_device_count(n, f"use_host_devices({n})")
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have == n:
            return
        raise DeviceSetupError(
            fix(
                f"use_host_devices({n}) was called after JAX had started its backends with "
                f"{have} CPU device(s); the device count cannot change in a running process.",
                f"call spmdkit.use_host_devices({n}) right after `import spmdkit`, before any "
                f"JAX operation (creating an array, jax.devices(), a jit call); the spmdkit "
                # A plain script never reads the variable: only the command and
                # spmdkit.initialize() do, so it is offered for the command alone.
                f"command takes --host-devices {n} or {ENV_HOST_DEVICES}={n} in the environment "
                f"(which a plain Python script does not read).",
            )
        ) from None


def host_devices_from_env() -> int | None:
    """The device count asked for by ``SPMDKIT_HOST_DEVICES``, or None if unset."""
    raw = os.environ.get(ENV_HOST_DEVICES, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise DeviceSetupError(
            fix(
                f"{ENV_HOST_DEVICES}={raw!r} is not a positive integer.",
                f"set it to a device count such as {ENV_HOST_DEVICES}=8, or unset it.",
            )
        )
    check_host_device_count(n, f"{ENV_HOST_DEVICES}={raw}")
    return n


def device_table() -> list[dict[str, Any]]:
    """One row per device of every process: id, platform, kind, process index."""
    me = jax.process_index()
    return [
        {
            "id": d.id,
            "platform": d.platform,
            "kind": d.device_kind,
            "process_index": d.process_index,
            "local": d.process_index == me,
        }
        for d in jax.devices()
    ]


def suggest_mesh(n_devices: int, model: int | None = None) -> dict[str, int]:
    """A default mesh for ``n_devices``: all data parallel, or data x model.

    With ``model`` unset: ``{"data": n}``. With ``model=k`` (k divides n):
    ``{"data": n // k, "model": k}``.

    Example:
        >>> suggest_mesh(8), suggest_mesh(8, model=4)
        ({'data': 8}, {'data': 2, 'model': 4})
    """
    if model is None:
        return {"data": n_devices}
    return {"data": n_devices // model, "model": model}


def model_parallel_suggestion(n_devices: int) -> dict[str, int] | None:
    """The most square data x model split of ``n_devices`` (model the larger), or None."""
    best = None
    for k in range(2, n_devices):
        if n_devices % k == 0 and k >= n_devices // k:
            best = k
            break
    return None if best is None else suggest_mesh(n_devices, model=best)


def backend_failure(exc: BaseException) -> DeviceSetupError | None:
    """The error to show for JAX failing to start the backend ``JAX_PLATFORMS`` names, else None.

    JAX_PLATFORMS=cuda on a machine without CUDA ends in a bare ``AssertionError`` inside
    jax (0.12), other unavailable platforms in a ``RuntimeError``; either came out as a raw
    traceback that did not say the variable was the cause.
    """
    import traceback

    platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
    frames = traceback.extract_tb(exc.__traceback__)
    in_bridge = bool(frames) and frames[-1].filename.replace("\\", "/").endswith("jax/_src/xla_bridge.py")
    if not platforms or not (in_bridge or "Unable to initialize backend" in str(exc)):
        return None
    detail = str(exc).split(" (set JAX_PLATFORMS")[0].strip() or f"{type(exc).__name__} in JAX's backend setup"
    return DeviceSetupError(fix(
        f"JAX_PLATFORMS={platforms!r}: JAX cannot start that platform on this machine ({detail}).",
        "unset JAX_PLATFORMS (JAX then picks what is there), or set JAX_PLATFORMS=cpu; "
        "a GPU or TPU platform needs its jax plugin installed (pip install 'jax[cuda12]' or 'jax[tpu]').",
    ))
