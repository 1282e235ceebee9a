"""Parallel evaluation: one function, written for one example, run on every device.

`convolve` knows nothing of devices. `spmdkit.pmap` runs it on one row per device,
feeds one map's output to the next without moving it, and nests: an outer map over
rows of devices and an inner map over the devices of a row, each with a name that
collectives (`psum`, `pmean`, ...) refer to.

    python examples/parallel_evaluation.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import spmdkit


def convolve(x, w):
    """A 3-tap convolution of one signal `x` with the kernel `w`."""
    return jnp.array([jnp.dot(x[i - 1:i + 2], w) for i in range(1, len(x) - 1)])


def row_totals(x, w):
    # Called once per device of a 2-D layout: `psum` over "cols" adds up the devices of a row.
    return jax.lax.psum(convolve(x, w), "cols")


def main(n_devices: int | None = None, nested: bool = True) -> dict[str, np.ndarray]:
    n = n_devices or jax.local_device_count()
    xs = np.arange(5 * n, dtype=np.float32).reshape(n, 5)  # one signal per device
    ws = np.stack([np.array([2.0, 3.0, 4.0], np.float32)] * n)

    once = spmdkit.pmap(convolve)(xs, ws)  # row i computed on device i
    # The inner result stays on the devices and is consumed there by the outer call.
    twice = spmdkit.pmap(convolve)(xs, spmdkit.pmap(convolve)(xs, ws))

    out = {"xs": xs, "ws": ws, "once": np.asarray(once), "twice": np.asarray(twice)}
    if nested:
        # Nested maps: devices as a (rows x cols) grid, e.g. 2 x 4 on 8 devices.
        rows = 2 if n % 2 == 0 else 1
        grid = xs.reshape(rows, n // rows, 5), ws.reshape(rows, n // rows, 3)
        out["grid"] = grid
        out["nested"] = np.asarray(spmdkit.pmap(spmdkit.pmap(row_totals, axis_name="cols"), axis_name="rows")(*grid))
    return out


if __name__ == "__main__":
    spmdkit.use_host_devices(8)  # simulated CPU devices; must come before any JAX work
    out = main()
    print("convolve on each device:\n", out["once"])
    print("a map of a map's output:\n", out["twice"])
    print("nested (2 rows x 4 devices), totals of each row:\n", out["nested"][:, 0])
