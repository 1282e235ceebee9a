"""The one-pass restore reader: bit-equal to Orbax's restore on every layout, or not used."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import spmdkit
from spmdkit import _checkpoint_read as _read
from spmdkit._checkpoint import read_manifest, step_name


def _state(mesh):
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "w": put(jax.random.normal(k[0], (16, 24)), P("data", "model")),
        "odd": put(jax.random.normal(k[1], (12, 20)), P("model", "data")),  # 3x10 chunks
        "h": put(jax.random.normal(k[2], (8, 4)).astype(jnp.bfloat16), P(None, "model")),
        "i": put(jax.random.randint(k[3], (4, 8), -9, 9), P()),
        "flags": {"b": put(jnp.arange(8) % 3 == 0, P("data")), "count": jnp.int32(7)},
        "seq": [put(jnp.arange(32.0).reshape(4, 8), P(None, "data"))],
    }


def _targets(state, mesh):
    four = spmdkit.make_mesh(data=2, model=2, devices=jax.devices()[:4])
    specs = {
        "another layout": lambda x: NamedSharding(mesh, P(*(["model", None][: x.ndim]))),
        "4 devices": lambda x: NamedSharding(four, P(*([None, ("data", "model")][: x.ndim]))),
        "1 device": lambda x: SingleDeviceSharding(jax.devices()[5]),
    }
    for name, spec in specs.items():
        yield name, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec(x)), state)


def test_one_pass_restore_is_bit_equal_to_orbax_on_every_layout(tmp_path):
    mesh = spmdkit.make_mesh(data=2, model=4)
    state = _state(mesh)
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    ckpt.save(1, state, {"note": "x"})
    ckpt.close()
    files = read_manifest(tmp_path / "ck", 1)[0]["files"]
    assert any(_read.is_chunk_file(n) for n in files) and not _read.is_chunk_file("state/w/.zarray")
    for name, target in _targets(state, mesh):
        assert _read.plan(tmp_path / "ck" / step_name(1), target, files) is not None, name  # the one-pass path
        fast, meta = ckpt.restore(1, target)
        slow, _ = ckpt._orbax_restore(1, target, partial=False)
        assert meta["note"] == "x"
        for (path, a), b, want, t in zip(jax.tree_util.tree_flatten_with_path(fast)[0], jax.tree.leaves(slow),
                                         jax.tree.leaves(state), jax.tree.leaves(target)):
            where = f"{name}: {jax.tree_util.keystr(path)}"
            assert a.dtype == b.dtype == want.dtype and a.sharding == b.sharding == t.sharding, where
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(want), err_msg=where)
            for shard in a.addressable_shards:  # every device holds its own copy of the right slice
                np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index], err_msg=where)
            _donate_each_shard(a, np.asarray(want), where)


def _donate_each_shard(a, want, where):
    """Replicas may share one restored buffer: a step that donates one device's shard must
    still leave every other device's shard as it was."""
    shards = list(a.addressable_shards)
    for i, shard in enumerate(shards):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a donation the client turns into a copy
            out = jax.jit(lambda x: jnp.zeros_like(x), donate_argnums=0)(shard.data)
        out.block_until_ready()
        for other in shards[i + 1:]:
            np.testing.assert_array_equal(np.asarray(other.data), want[other.index], err_msg=f"{where}, after donating {shard.device}")


def test_replicas_share_one_restored_buffer_and_a_donation_changes_neither(tmp_path):
    mesh = spmdkit.make_mesh(data=2, model=4)
    w = jax.random.normal(jax.random.key(1), (16, 24))
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    ckpt.save(1, {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model")))}, {})
    ckpt.close()
    assert _read._donation_copies("cpu")  # this JAX copies a donated adopted buffer: sharing is on
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P("model", None)))}
    got = ckpt.restore(1, target)[0]["w"]
    by_index: dict = {}
    for shard in got.addressable_shards:
        by_index.setdefault(str(shard.index), set()).add(shard.data.unsafe_buffer_pointer())
    assert len(by_index) == 4 and all(len(p) == 1 for p in by_index.values()), by_index  # 2 replicas, 1 buffer
    step = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_array_equal(np.asarray(step(got)), np.asarray(w) * 2 + 1)  # every replica right
    _donate_each_shard(ckpt.restore(1, target)[0]["w"], np.asarray(w), "P('model', None)")


def test_a_changed_chunk_is_named_and_a_format_it_does_not_know_goes_to_orbax(tmp_path, monkeypatch):
    monkeypatch.setattr(_read, "SLAB", 24)  # 4x2 f32 chunks read 3 rows, then 1: a chunk in pieces
    mesh = spmdkit.make_mesh(data=2, model=4)
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), state)
    for compress in (False, True):
        ck = tmp_path / f"ck{compress}"
        ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(ck), compress=compress), log=lambda m: None)
        ckpt.save(1, state, {})
        ckpt.close()
        files = read_manifest(ck, 1)[0]["files"]
        assert (_read.plan(ck / step_name(1), target, files) is None) == compress
        np.testing.assert_array_equal(np.asarray(ckpt.restore(1, target)[0]["w"]), np.asarray(state["w"]))
        cast = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding), target)
        assert _read.plan(ck / step_name(1), cast, files) is None  # a cast is Orbax's to do
    victim = tmp_path / "ckFalse" / step_name(1) / "state" / "w" / "1.3"
    data = bytearray(victim.read_bytes())
    data[3] ^= 0x10
    victim.write_bytes(bytes(data))
    plain = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ckFalse")), log=lambda m: None)
    with pytest.raises(spmdkit.CheckpointError, match=r"step 1 in .*/ckFalse is damaged: file spmdkit_1/state/w/1\.3 has changed"):
        plain.restore(1, target)


def test_a_partial_restore_names_damage_in_a_leaf_outside_its_target(tmp_path):
    """Restoring the parameters alone still checks the optimizer's files: every process then
    finds the same damage, and a damaged step is never half-trusted."""
    mesh = spmdkit.make_mesh(data=2, model=4)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "model")))  # noqa: E731
    state = {"params": {"w": put(jnp.ones((8, 8)))}, "opt": {"mu": put(jnp.full((8, 8), 2.0))}}
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    ckpt.save(1, state, {})
    ckpt.save(2, state, {})
    ckpt.close()
    files = read_manifest(tmp_path / "ck", 1)[0]["files"]
    mu = sorted(n for n in files if _read.is_chunk_file(n) and "mu" in n)
    assert mu, sorted(files)
    path = tmp_path / "ck" / step_name(1) / mu[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state["params"])
    with pytest.raises(spmdkit.CheckpointError, match=r"step 1 in .* is damaged: .*mu"):
        ckpt.restore(1, target)
    got, _ = ckpt.restore(2, target)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.ones((8, 8)))
