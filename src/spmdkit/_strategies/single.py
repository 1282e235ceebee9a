"""One device: the reference every other strategy must agree with."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from spmdkit._errors import MeshError, fix
from spmdkit._strategies.data import DataParallel


class Single(DataParallel):
    """Train on one device (the first by default): a data-parallel mesh of one.

    Example:
        >>> import spmdkit
        >>> strategy = spmdkit.Single()
        >>> type(strategy).__name__, strategy.describe()["device_count"]
        ('Single', 1)
    """

    def __init__(self, device: jax.Device | None = None):
        if device is not None and not isinstance(device, jax.Device):
            raise MeshError(fix(f"Single(device={device!r}): a jax.Device, not {type(device).__name__}.",
                                "pass e.g. spmdkit.Single(jax.devices()[3]), or nothing for the first device."))
        mesh = Mesh(np.array([device or jax.devices()[0]]), ("data",))
        super().__init__(mesh, axis="data", impl="jit", name="single")
