"""A user's loop for tests/test_checkpoint.py, run under ``spmdkit launch -n 2``: two saves over
both processes, then an exit without ``close()`` in one or both (``MODE``: ``none`` closes in
neither, ``one`` in process 0 only, ``lost`` has process 1 end at once without finishing, ``raises``
has process 1 end by an uncaught error, which gives it end_soon's 20 s at most)."""

from __future__ import annotations

import os
import sys


def main(directory: str, mode: str) -> None:
    import jax
    import jax.numpy as jnp

    import spmdkit
    import spmdkit._checkpoint

    assert spmdkit.initialize(), "expected to run under spmdkit launch"
    # The test's own bound on waiting for a lost peer; above end_soon's grace where that must decide.
    spmdkit._checkpoint.UNCLOSED_WAIT_S = 60.0 if mode == "raises" else 10.0
    data = spmdkit.DataParallel()
    state = data.init(lambda key: {"w": jax.random.normal(key, (64, 32))}, jax.random.key(0))
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(directory, every=1))
    ckpt.save(1, state, {"step": 1})
    ckpt.save(2, jax.tree.map(lambda w: w * 2, state), {"step": 2})
    print("process", jax.process_index(), "of", jax.process_count(), "devices", jax.device_count(), flush=True)
    if mode == "one" and jax.process_index() == 0:
        ckpt.close()
    if mode == "lost" and jax.process_index() == 1:
        os._exit(0)
    if mode == "raises" and jax.process_index() == 1:
        raise RuntimeError("the user's own error after the saves")


if __name__ == "__main__":
    main(*sys.argv[1:3])
