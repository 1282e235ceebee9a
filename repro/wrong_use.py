"""Calls in the wrong place: after jax.devices(), twice, in children (spawn and fork)."""
import multiprocessing as mp
import os
import sys

import spmdkit


def child(tag):
    try:
        s = spmdkit.reuse_host_memory()
    except Exception as e:  # noqa: BLE001
        s = f"{type(e).__name__}: {e}"
    print(f"child[{tag}] MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX')} -> {s}", flush=True)


if __name__ == "__main__":
    if "after" in sys.argv:
        import jax

        jax.devices()
        try:
            spmdkit.reuse_host_memory()
        except spmdkit.DeviceSetupError as e:
            print("after jax.devices():", type(e).__mro__[1:3], "\n", e)
        print("host_memory():", spmdkit.host_memory())
        sys.exit()
    print("first:", spmdkit.reuse_host_memory())
    print("second:", spmdkit.reuse_host_memory())
    import jax

    jax.devices()
    print("third, after jax.devices():", spmdkit.reuse_host_memory())
    for method in ("spawn", "forkserver"):
        p = mp.get_context(method).Process(target=child, args=(method,))
        p.start(); p.join(60)
