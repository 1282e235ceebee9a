"""One process of tests/test_pmap_multiprocess.py: runs spmdkit.pmap (and jax.pmap) cases.

argv: out.npz num_processes process_id port devices_per_process. Every process
passes its local slice of the same global data; results are this process's rows.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import spmdkit


def local_rows(out):
    """This process's rows of a mapped output, in device order."""
    shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def local_block(out):
    """This process's rows of an output sharded over a device grid (first axis)."""
    shards = out.addressable_shards
    first = min(s.index[0].start or 0 for s in shards)
    rows = len({s.index[0].start or 0 for s in shards}) * shards[0].data.shape[0]
    block = np.zeros((rows, *out.shape[1:]), out.dtype)
    for s in shards:
        start = (s.index[0].start or 0) - first
        block[(slice(start, start + s.data.shape[0]), *s.index[1:])] = np.asarray(s.data)
    return block


def step(w, x):
    g = jax.grad(lambda q: jnp.sum((x @ q) ** 2))(w)
    return w - 0.1 * jax.lax.pmean(g, "i"), jax.lax.psum(x, "i")


def main() -> None:
    out_path, nproc, pid, port, per = sys.argv[1], *map(int, sys.argv[2:])
    jax.config.update("jax_num_cpu_devices", per)
    if nproc > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
            initialization_timeout=60,
        )

    n = nproc * per
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, 3)).astype(np.float32)
    W = rng.standard_normal(3).astype(np.float32)
    rows = slice(pid * per, (pid + 1) * per)
    cases = {
        "psum": (lambda x: jax.lax.psum(x, "i"), (X,), {}),
        "all_gather": (lambda x: jax.lax.all_gather(x, "i").sum(0) * x, (X,), {}),
        "axis_index": (lambda x: x * jax.lax.axis_index("i"), (X,), {}),
        "ppermute": (
            lambda x: jax.lax.ppermute(x, "i", [(j, (j + 1) % n) for j in range(n)]), (X,), {}
        ),
        "grad step": (step, (W, X), {"in_axes": (None, 0)}),
    }

    results = {}
    for name, (f, args, kw) in cases.items():
        local = tuple(a if kw.get("in_axes", (0,))[i] is None else a[rows] for i, a in enumerate(args))
        for impl_name, impl in (("spmdkit", spmdkit.pmap), ("jax", jax.pmap)):
            try:
                mapped = impl(f, "i", **kw)
                out = mapped(*local)
            except Exception as e:  # recorded: jax.pmap may not support a case across processes
                print(f"{impl_name} {name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            if impl_name == "spmdkit":  # a repeat call (no re-validation) gives the same
                for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(mapped(*local))):
                    np.testing.assert_array_equal(local_rows(x), local_rows(y), err_msg=name)
            for j, leaf in enumerate(jax.tree.leaves(out)):
                results[f"{impl_name}/{name}/{j}"] = local_rows(leaf)

    # out_axes=None across processes, checked; a chained call consumes the global output.
    total = spmdkit.pmap(lambda x: jax.lax.psum(x, "i"), "i", out_axes=None)(X[rows])
    results["spmdkit/out_axes None"] = np.asarray(total.addressable_data(0))
    try:
        spmdkit.pmap(lambda x: x, "i", out_axes=None)(X[rows])
        results["spmdkit/replication error"] = np.array(0)
    except spmdkit.ReplicationError:
        results["spmdkit/replication error"] = np.array(1)
    first = spmdkit.pmap(lambda x: x * 2, "i")(X[rows])
    chained = spmdkit.pmap(lambda x: jax.lax.psum(x, "i"), "i")
    results["spmdkit/chained"] = local_rows(chained(first))
    for _ in range(2):  # global outputs fed back (the loop), then host slices again
        np.testing.assert_array_equal(local_rows(chained(first)), results["spmdkit/chained"])
    np.testing.assert_array_equal(local_rows(chained(X[rows] * 2)), results["spmdkit/chained"])
    # Nested maps: the outer axis spans the processes ([per // 2, 2] per process, a
    # [n // 2, 2] device grid in all), the inner one stays within each process.
    def inner(v):
        return (jax.lax.psum(v, "b") * (1 + jax.lax.axis_index("a")) + jax.lax.pmean(v, ("a", "b"))
                + v * jax.lax.axis_index("b"))

    grid = spmdkit.pmap(spmdkit.pmap(inner, "b"), "a")
    local = X[rows].reshape(per // 2, 2, 3)
    out = grid(local)
    results["spmdkit/nested"] = local_block(out)
    np.testing.assert_array_equal(local_block(grid(local)), results["spmdkit/nested"])  # repeat
    results["spmdkit/nested chained"] = local_block(grid(out))  # a global output fed back
    np.testing.assert_array_equal(local_block(grid(out)), results["spmdkit/nested chained"])
    # Three levels: [per // 4, 2, 2] per process, an [n // 4, 2, 2] grid in all.
    cube = spmdkit.pmap(spmdkit.pmap(spmdkit.pmap(
        lambda v: jax.lax.psum(v, ("a", "c")) + jax.lax.axis_index("b") + jax.lax.pmean(v, "a"), "c"), "b"), "a")
    results["spmdkit/nested 3 levels"] = local_block(cube(X[rows].reshape(per // 4, 2, 2, 3)))
    np.savez(out_path, **results)
    print("done", pid, jax.device_count(), file=sys.stderr)


if __name__ == "__main__":
    main()
