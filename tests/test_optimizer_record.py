"""The optimizer's constants recorded with checkpoints: what counts as another optimizer."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spmdkit._train._optimizer_record import changed_constants, optimizer_record


def _same(a, b):
    return changed_constants(optimizer_record(a), optimizer_record(b))


def test_optimizers_built_alike_are_the_same_and_others_are_named():
    masked = lambda lr: optax.multi_transform({"a": optax.adam(lr), "b": optax.sgd(0.1)}, {"w": "a", "b": "b"})  # noqa: E731
    assert _same(masked(1e-3), masked(1e-3)) == []
    assert _same(masked(1e-3), masked(2e-3)) == ["step_size -0.001 -> -0.002 (in scale)"]
    hyper = lambda lr: optax.inject_hyperparams(optax.adam)(learning_rate=lr)  # noqa: E731
    assert _same(hyper(1e-3), hyper(1e-2)) == ["numeric_hps['learning_rate'] 0.001 -> 0.01 (in inject_hyperparams)"]
    assert _same(optax.adam(1e-3), optax.adam(1e-3, b1=0.8)) == ["b1 0.9 -> 0.8 (in scale_by_adam)"]
    assert _same(optax.adam(1e-3), optax.chain(optax.clip(1.0), optax.adam(1e-3))) == \
        ["its transforms differ (nothing else then, clip now)"]
    many = _same(optax.adamw(1e-3, b1=0.9, b2=0.99, eps=1e-8, weight_decay=1e-4),
                 optax.adamw(2e-3, b1=0.8, b2=0.98, eps=1e-7, weight_decay=1e-3))
    assert len(many) == 4 and many[-1] == "2 more"


def test_arrays_partials_and_cycles_are_recorded_by_content():
    def lr_schedule(table):
        return lambda count: table[jnp.minimum(count, len(table) - 1)]

    a, b = np.linspace(1e-3, 0, 10), np.linspace(2e-3, 0, 10)
    assert _same(optax.sgd(lr_schedule(a)), optax.sgd(lr_schedule(a.copy()))) == []
    changed = _same(optax.sgd(lr_schedule(a)), optax.sgd(lr_schedule(b)))
    assert len(changed) == 1 and "table array float64[10] crc32" in changed[0]
    scaled = lambda s: optax.sgd(functools.partial(lambda count, s: s * 0.1, s=s))  # noqa: E731
    assert _same(scaled(1.0), scaled(1.0)) == [] and _same(scaled(1.0), scaled(2.0))

    def cyclic():  # a function in its own closure
        def f(count):
            return f and 0.1
        return optax.sgd(f)

    assert _same(cyclic(), cyclic()) == []
    big = jnp.zeros((1 << 20) + 1)  # counted by dtype and shape, not read back
    assert any(v == f"array float32[{(1 << 20) + 1}]" for _, v in optimizer_record(optax.sgd(lambda c: big[0])))


def test_the_record_survives_json_and_another_process():
    # Written in a checkpoint's metadata (JSON), compared in another process: no object
    # addresses, no hash() of bytes (it changes per process).
    code = ("import json, numpy as np, optax, jax.numpy as jnp; from spmdkit._train._optimizer_record import "
            "optimizer_record; t = np.arange(4.0); print(json.dumps(optimizer_record(optax.chain("
            "optax.clip_by_global_norm(1.0), optax.adamw(lambda c: t[c % 4], weight_decay=1e-4)))))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                      check=True).stdout) for _ in range(2)]
    assert runs[0] == runs[1] and changed_constants(runs[0], runs[1]) == []
    assert all(isinstance(w, str) and isinstance(v, str) and "0x" not in v for w, v in runs[0])
