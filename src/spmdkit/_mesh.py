"""Device meshes with named axes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from spmdkit._errors import MeshError, fix


def _format(axes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in axes.items())


def make_mesh(shape: Mapping[str, int] | None = None, /, *, devices: Sequence[jax.Device] | None = None,
              **axes: int) -> Mesh:
    """A ``jax.sharding.Mesh`` from ordered ``name=size`` pairs; one size may be -1.

    The -1 axis takes whatever the others leave of the device count. Axes are of
    type ``Auto`` (the classic sharding-propagation behaviour the seeds rely on).
    ``devices`` defaults to all devices (of every process). The axes may also come as
    one ordered mapping, as ``dict(mesh.shape)`` and ``plan`` give them (an axis named
    like the ``devices`` keyword needs this form).

    Example:
        >>> import jax, spmdkit
        >>> mesh = spmdkit.make_mesh(data=-1)
        >>> dict(mesh.shape) == {"data": jax.device_count()}
        True
        >>> spmdkit.make_mesh({"data": -1}).axis_names
        ('data',)
    """
    if shape is not None:
        # make_mesh({"data": 4, "model": 2}) was a raw "takes 0 positional arguments" TypeError.
        if not isinstance(shape, Mapping) or axes:
            raise MeshError(fix(f"make_mesh({shape!r:.60}{', ...' if axes else ''}): the axes come either as one "
                                "mapping of name to size or as keywords, not "
                                + ("both." if axes else f"a {type(shape).__name__}."),
                                "pass e.g. make_mesh({'data': 4, 'model': 2}) or make_mesh(data=4, model=2)."))
        if not all(isinstance(k, str) for k in shape):
            raise MeshError(fix(f"make_mesh({shape!r:.60}): axis names are strings.",
                                "pass e.g. make_mesh({'data': 4, 'model': 2})."))
        axes = dict(shape)
    devs = _checked_devices(devices)
    n = len(devs)
    _check_axes(axes, n)
    fill = [k for k, v in axes.items() if v == -1]
    if len(fill) > 1:
        raise MeshError(
            fix(
                f"make_mesh({_format(axes)}): only one axis may be -1, got {fill}.",
                f"give every axis but one a size, e.g. make_mesh({fill[0]}=-1, "
                + ", ".join(f"{k}=2" for k in fill[1:])
                + ").",
            )
        )
    known = math.prod(v for v in axes.values() if v != -1)
    if fill:
        if n % known:
            raise MeshError(
                fix(
                    f"make_mesh({_format(axes)}): the fixed axes use {known} devices, which does "
                    f"not divide the {n} available, so {fill[0]}=-1 cannot be filled.",
                    _suggest(axes, n),
                )
            )
        axes = {k: (n // known if v == -1 else v) for k, v in axes.items()}
    elif known != n:
        more = (
            f" To simulate {known} CPU devices: --host-devices {known} on the command line, or "
            f"spmdkit.use_host_devices({known}) before any JAX work."
            if known > n
            else ""
        )
        raise MeshError(
            fix(
                f"make_mesh({_format(axes)}) needs {known} devices but {n} are available.",
                _suggest(axes, n, simulate=not more) + more,
            )
        )
    return jax.make_mesh(
        tuple(axes.values()),
        tuple(axes.keys()),
        axis_types=(AxisType.Auto,) * len(axes),
        devices=devs,
    )


def _checked_devices(devices: Sequence[jax.Device] | None) -> list[jax.Device]:
    """``devices`` as a list, each a distinct ``jax.Device`` (all devices when None)."""
    devs = list(jax.devices() if devices is None else devices)
    seen: dict[Any, int] = {}
    for i, d in enumerate(devs):
        if not isinstance(d, jax.Device):
            raise MeshError(fix(f"make_mesh: devices[{i}] is a {type(d).__name__}, not a jax.Device.",
                                "pass devices from jax.devices(), e.g. devices=jax.devices()[:4]."))
        if d in seen:
            raise MeshError(fix(f"make_mesh: devices[{seen[d]}] and devices[{i}] are the same device ({d}); "
                                "a mesh holds each device once.",
                                "pass distinct devices, e.g. devices=jax.devices()[:k]."))
        seen[d] = i
    return devs


def _check_axes(axes: dict[str, int], n: int) -> None:
    """At least one axis, each an int >= 1 or -1."""
    if not axes:
        raise MeshError(
            fix("make_mesh() got no axes.", f"name at least one axis, e.g. make_mesh(data={n}).")
        )
    for name, size in axes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise MeshError(
                fix(
                    f"make_mesh: axis {name!r} has size {size!r}; sizes are ints >= 1, or -1 "
                    "for 'the rest of the devices'.",
                    f"e.g. make_mesh({name}=-1).",
                )
            )


def _suggest(axes: dict[str, int], n: int, simulate: bool = True) -> str:
    """The fix for sizes that do not fit ``n`` devices; ``simulate=False`` when the caller names
    the exact simulation (use_host_devices(k)) itself."""
    names = list(axes)
    if len(names) == 1:
        return f"use make_mesh({names[0]}={n}) or make_mesh({names[0]}=-1)."
    # Keep the last axis if it divides n and let the first take the rest.
    last = axes[names[-1]]
    if last != -1 and n % last == 0:
        alt = {names[0]: -1, **{k: (1 if k != names[-1] else last) for k in names[1:]}}
        return f"make the sizes multiply to {n}, e.g. make_mesh({_format(alt)})" + (
            "; the devices can be simulated with spmdkit.use_host_devices(k) before any JAX work." if simulate
            else ".")
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return (
        f"make the sizes multiply to {n} (axis sizes that divide {n}: {divisors}); one axis "
        "may be -1 to take the rest."
    )
