"""One device: the reference every other strategy must agree with."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from spmdkit._strategies.data import DataParallel


def Single(device: jax.Device | None = None) -> DataParallel:  # noqa: N802 (reads like a class)
    """Train on one device (the first by default): a data-parallel mesh of one.

    Example:
        >>> import spmdkit
        >>> spmdkit.Single().describe()["device_count"]
        1
    """
    mesh = Mesh(np.array([device or jax.devices()[0]]), ("data",))
    return DataParallel(mesh, axis="data", impl="jit", name="single")
