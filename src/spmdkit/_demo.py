"""``spmdkit demo``: seed 000's parallel evaluation, narrated."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from spmdkit._pmap import pmap


def convolve(x: jax.Array, w: jax.Array) -> jax.Array:
    """Seed 000's 1-D convolution of a length-5 signal with a length-3 kernel."""
    return jnp.array([jnp.dot(x[i - 1 : i + 2], w) for i in range(1, len(x) - 1)])


def run_demo(console: Console | None = None) -> dict[str, object]:
    """Run seed 000 on every local device and report what happened."""
    console = console or Console()
    n = jax.local_device_count()
    console.rule(f"spmdkit demo: seed 000 parallel evaluation on {n} device(s)")
    console.print(f"devices: {jax.local_devices()}")
    w = np.array([2.0, 3.0, 4.0], np.float32)
    xs = np.arange(5 * n, dtype=np.float32).reshape(-1, 5)
    ws = np.stack([w] * n)
    console.print(f"xs: shape {xs.shape} (one row per device), ws: shape {ws.shape}")

    reference = jax.vmap(convolve)(xs, ws)
    t0 = time.perf_counter()
    out = jax.block_until_ready(pmap(convolve)(xs, ws))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(pmap(convolve)(xs, ws))
    again = time.perf_counter() - t0
    console.print(f"spmdkit.pmap(convolve)(xs, ws) -> shape {out.shape}, first row {out[0].tolist()}")
    console.print(
        f"equals jax.vmap(convolve): {bool(jnp.array_equal(out, reference))}; "
        f"first call {first * 1e3:.1f} ms (compiles), again {again * 1e3:.2f} ms (cached)"
    )
    placement = [(s.device.id, s.index[0].start) for s in out.addressable_shards]
    console.print(f"output rows live on devices (device id, row): {placement}")

    nested = jax.block_until_ready(pmap(convolve)(xs, pmap(convolve)(xs, ws)))
    nested_ref = jax.vmap(convolve)(xs, jax.vmap(convolve)(xs, ws))
    console.print(
        "nested pmap(convolve)(xs, pmap(convolve)(xs, ws)): the inner result stays sharded on "
        f"the devices; equals the vmap result: {bool(jnp.array_equal(nested, nested_ref))}"
    )
    normalised = pmap(lambda x: x / jax.lax.psum(x, "i"), axis_name="i")(jnp.arange(1.0, n + 1))
    console.print(
        f"collective: x / psum(x, 'i') over {n} devices sums to {float(normalised.sum()):.6f}"
    )
    ok = bool(jnp.array_equal(out, reference) and jnp.array_equal(nested, nested_ref))
    console.print("[bold green]demo OK[/]" if ok else "[bold red]demo FAILED[/]")
    return {"devices": n, "first_row": out[0].tolist(), "matches_vmap": ok}
