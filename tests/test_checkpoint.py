"""Checkpoints: exact resume, resharding, damage, mismatches, crash safety."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P, SingleDeviceSharding

import spmdkit
from spmdkit._checkpoint import parse_step, step_name
from spmdkit._tasks import digits, linreg, mlp
from spmdkit._train._steps import task_state


@pytest.fixture(scope="module")
def task():
    return digits.make()


def fit(task, strategy, steps, ckpt_dir=None, resume=False, every=5, out=None, opt=None):
    checkpoint = None if ckpt_dir is None else spmdkit.CheckpointConfig(str(ckpt_dir), every=every, keep=3, resume=resume)
    return spmdkit.fit(task, strategy, opt or optax.sgd(0.05, momentum=0.9),
                       spmdkit.TrainConfig(steps=steps, batch_size=64, eval_every=1000),
                       out_dir=out, progress=False, checkpoint=checkpoint, log=lambda m: None)


def assert_bit_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("make", [lambda: spmdkit.DataParallel(), lambda: spmdkit.Ensemble(members=8)],
                         ids=["data", "ensemble"])
def test_resume_is_bit_for_bit(task, tmp_path, make):
    straight = fit(task, make(), 30)
    fit(task, make(), 15, tmp_path / "ck")
    resumed = fit(task, make(), 30, tmp_path / "ck", resume=True)
    assert resumed.summary["resumed_from_step"] == 15 and resumed.summary["steps"] == 30
    assert_bit_equal(resumed.params, straight.params)
    assert resumed.summary["checkpoint_steps"] == [20, 25, 30]  # keep=3


def test_resume_keeps_the_history(task, tmp_path):
    fit(task, spmdkit.DataParallel(), 10, tmp_path / "ck", out=tmp_path / "out")
    result = fit(task, spmdkit.DataParallel(), 20, tmp_path / "ck", resume=True, out=tmp_path / "out")
    steps = [r["step"] for r in result.history if r["split"] == "train"]
    assert steps == list(range(1, 21))
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if '"train"' in line] == steps


def test_resharding_8_devices_dp_tp_to_4_devices_fsdp_and_to_1_device_in_a_fresh_process(tmp_path):
    task = mlp.make(layers=2, depth=128, embed=64, num_train=256, num_eval=32)
    opt = optax.adam(1e-3)
    source = spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp")
    saved = fit(task, source, 10, tmp_path / "ck", every=10, opt=opt, out=tmp_path / "out").params

    four = spmdkit.Sharded(spmdkit.make_mesh(data=4, devices=jax.devices()[:4]), "fsdp")
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    state, meta = ckpt.restore(10, four.abstract(task_state(task, opt), unbox=True))
    w1 = state.params["ScanDotReluDot_0"]["W1"]
    assert w1.sharding.spec == jax.P(None, "data", None) and len(w1.sharding.device_set) == 4
    assert meta["strategy"]["mesh"] == {"data": 2, "model": 4}
    assert_bit_equal(jax.device_get(state.params), saved)
    # The parameters alone (inference) onto the other mesh: a part of the state is a target too.
    params, _ = ckpt.restore(10, four.abstract(task_state(task, opt), unbox=True).params)
    assert params["ScanDotReluDot_0"]["W1"].sharding.spec == jax.P(None, "data", None)
    assert_bit_equal(jax.device_get(params), saved)

    script = f"""
import spmdkit, numpy as np, optax, jax
spmdkit.use_host_devices(1)
from spmdkit._tasks import mlp
from spmdkit._train._steps import task_state
task = mlp.make(layers=2, depth=128, embed=64, num_train=256, num_eval=32)
strategy = spmdkit.DataParallel()
ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig({str(tmp_path / 'ck')!r}), log=lambda m: None)
state, _ = ckpt.restore(10, strategy.abstract(task_state(task, optax.adam(1e-3)), unbox=True))
saved = spmdkit.load_params({str(tmp_path / 'out' / 'params.npz')!r}, like=jax.device_get(state.params))
assert jax.device_count() == 1
for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(a, b)
print("restored on", jax.device_count(), "device")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "restored on 1 device" in out.stdout


def test_params_alone_restore_from_data_parallel_and_a_wrong_part_is_named(tmp_path):
    task, opt = linreg.make(), optax.sgd(0.05)
    saved = fit(task, spmdkit.DataParallel(), 2, tmp_path / "ck", every=2, opt=opt).params
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    target = spmdkit.Single().abstract(task_state(task, opt), unbox=True).params
    params, meta = ckpt.restore(2, target)
    assert meta["step"] == 2 and set(params) == set(saved)
    assert_bit_equal(jax.device_get(params), saved)
    assert ckpt.restore_latest(target)[1]["step"] == 2
    with pytest.raises(spmdkit.CheckpointError, match=r"has no leaf state\['weights'\]") as e:
        ckpt.restore(2, {"weights": target["weight"]})
    assert "damaged" not in str(e.value)
    # A target of another structure altogether (task.init's tree) said only "resume with the model".
    assert re.search(r"(?s)nor any other of the target's 1 leaves: the saved state holds state.params, state.rng, "
                     r"state.step.*spmdkit.task_state\(task, optimizer\), with unbox=True",
                     str(e.value)), str(e.value)
    public = spmdkit.DataParallel().abstract(spmdkit.task_state(task, opt), unbox=True)  # the README's way
    assert_bit_equal(jax.device_get(ckpt.restore(2, public)[0].params), saved)
    # Another dtype was cast silently (a float32 step counter, bfloat16 weights rounded).
    halved = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding), target)
    with pytest.raises(spmdkit.CheckpointError, match=r"(?s)leaf state.params\['\w+'\] is float32 in the checkpoint but "
                                                      r"bfloat16 in the target.*cast after"):
        ckpt.restore(2, halved)


def _annotated_net_checkpointer(tmp_path):
    """A Flax net with a logically annotated kernel (its state boxed as strategy.init returns it),
    Sharded dp+tp on data=4, model=2, and a Checkpointer in tmp_path/ck."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                        ("embed", "mlp")))(x)

    make_state = lambda rng: {"params": Net().init(rng, jnp.zeros((1, 3)))["params"]}  # noqa: E731
    strategy = spmdkit.Sharded(spmdkit.make_mesh(data=4, model=2), "dp+tp")
    return make_state, strategy, spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)


def test_a_boxed_target_of_a_bare_checkpoint_names_unbox(tmp_path):
    """A model annotated since its run was saved (or a target built without unbox=True): its
    leaves sit one level deeper, at .value, which was "has no leaf" and "resume with the model"."""
    make_state, strategy, ckpt = _annotated_net_checkpointer(tmp_path)
    ckpt.save(1, strategy.init(make_state, jax.random.key(0), unbox=True), {})
    ckpt.close()
    with pytest.raises(spmdkit.CheckpointError, match=r"(?s)has no leaf state\['params'\]\['Dense_0'\]\['kernel'\]\.value "
                                                      r"\(the target has it\); it holds state\['params'\]\['Dense_0'\]\['kernel'\], "
                                                      r"the same array without Flax's box.*abstract\(make_state, unbox=True\)"):
        ckpt.restore(1, strategy.abstract(make_state))
    restored, _ = ckpt.restore(1, strategy.abstract(make_state, unbox=True))
    assert restored["params"]["Dense_0"]["kernel"].sharding.spec == P(None, "model")



def test_a_bare_target_of_a_boxed_checkpoint_names_the_boxed_target(tmp_path):
    """The other way round: a state saved as strategy.init returns it (boxed) restored into
    abstract(make_state, unbox=True), the README's recipe for one's own state, was "has no leaf ...;
    resume with the model the checkpoint was written with", for the whole state and its .params."""
    make_state, strategy, ckpt = _annotated_net_checkpointer(tmp_path)
    ckpt.save(1, strategy.init(make_state, jax.random.key(0)), {})
    ckpt.close()
    for target in (strategy.abstract(make_state, unbox=True), strategy.abstract(make_state, unbox=True)["params"]):
        with pytest.raises(spmdkit.CheckpointError, match=r"(?s)it holds state\['params'\]\['Dense_0'\]\['kernel'\]\.value, "
                                                          r"the same array inside Flax's box.*without unbox=True"):
            ckpt.restore(1, target)
    restored, _ = ckpt.restore(1, strategy.abstract(make_state))  # the fix, applied
    assert restored["params"]["Dense_0"]["kernel"].value.sharding.spec == P(None, "model")
    part, _ = ckpt.restore(1, strategy.abstract(make_state)["params"])
    np.testing.assert_array_equal(np.asarray(part["Dense_0"]["kernel"].value),
                                  np.asarray(restored["params"]["Dense_0"]["kernel"].value))

def test_a_part_under_a_list_index_is_named_as_such(tmp_path):
    # Two networks in a list: a target of one of them was "has no leaf state['w'] (the run being resumed
    # has it)", and part="['nets'][1]" was "not a place of the saved state ... (none does)".
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    state = {"nets": [{"w": jnp.ones((4, 3))}, {"w": jnp.zeros((4, 3))}], "step": jnp.int32(1)}
    ckpt.save(1, state, {})
    ckpt.close()  # the save committed
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    for part in (None, "['nets'][1]"):
        with pytest.raises(spmdkit.CheckpointError, match=r"(?s)the target's leaves are found in the saved state at "
                                                          r"\"\['nets'\]\[0\]\" and \"\['nets'\]\[1\]\", under a list "
                                                          r"or tuple index.*restore the whole state"):
            ckpt.restore(1, target["nets"][1], part=part)
    whole, _ = ckpt.restore(1, target)  # the way out the error gives
    np.testing.assert_array_equal(np.asarray(whole["nets"][1]["w"]), np.zeros((4, 3)))
    with pytest.raises(spmdkit.CheckpointError, match=r"has no leaf state\['v'\] \(the target has it\)"):
        ckpt.restore(1, {"v": target["step"]})
    ckpt.close()


def test_a_part_that_fits_two_places_of_the_state_is_named_never_guessed(tmp_path):
    # A DQN's online and target networks, or parameters and their EMA: a bare subtree has no position.
    def make_state(rng):
        k1, k2, k3 = jax.random.split(rng, 3)
        return {"online": {"w": jax.random.normal(k1, (8, 4))}, "target": {"w": jax.random.normal(k2, (8, 4))},
                "head": {"w": jax.random.normal(k3, (8, 3))}}

    state = spmdkit.DataParallel().init(make_state, jax.random.key(0))
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    ckpt.save(5, state, {})
    ckpt.close()
    abstract = spmdkit.Single().abstract(make_state)
    reader = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    with pytest.raises(spmdkit.CheckpointError, match=r"(?s)the target matches 2 places of the saved state, "
                       r"\"\['online'\]\", \"\['target'\]\".*ambiguous.*Fix: name it: restore\(5, target, "
                       r"part=\"\['target'\]\"\)"):
        reader.restore(5, abstract["target"])
    for name in ("online", "target"):
        got, _ = reader.restore(5, abstract[name], part=f"['{name}']")
        np.testing.assert_array_equal(got["w"], state[name]["w"])
    # The shapes decide where they can: only the head is (8, 3).
    np.testing.assert_array_equal(reader.restore(5, abstract["head"])[0]["w"], state["head"]["w"])
    with pytest.raises(spmdkit.CheckpointError, match=r"part=\"\['nowhere'\]\" is not a place .* holding exactly"):
        reader.restore(5, abstract["target"], part="['nowhere']")
    with pytest.raises(spmdkit.CheckpointError, match=r"leaf state\['head'\]\['w'\] has shape \(8, 3\) in the checkpoint but "
                                                      r"\(8, 4\)") as e:
        reader.restore(5, abstract["target"], part="['head']")
    assert not isinstance(e.value, spmdkit.CheckpointDamagedError)  # a misfit: the files are fine
    # A job may read several checkpoint directories: the error says which one does not fit.
    assert str(e.value).startswith(f"checkpoint step 5 in {reader.directory}: leaf"), str(e.value)


@pytest.mark.parametrize("strategy", [spmdkit.DataParallel, lambda: spmdkit.Ensemble(4)])
def test_a_state_holding_typed_prng_keys_saves_and_restores(tmp_path, strategy):
    # A dropout key in the state, NNX's Rngs: Orbax stores no key dtype (a TypeError before).
    import flax.nnx as nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.dense, self.drop = nnx.Linear(3, 2, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

    def make_state(rng):
        return {"model": nnx.state(Model(nnx.Rngs(rng))), "key": jax.random.key(1),
                "rbg": jax.random.key(2, impl="rbg")}

    s = strategy()
    state = s.init(make_state, 0)
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None).claim()
    ckpt.save(1, state, {})
    ckpt.close()
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck"), resume=True), log=lambda m: None).claim()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    back, meta = ckpt.restore_latest(target)
    ckpt.close()
    assert meta["step"] == 1 and jax.tree.structure(back) == jax.tree.structure(state)
    data = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x  # noqa: E731
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(jax.device_get(data(a)), jax.device_get(data(b)))
    assert jax.random.key_impl(back["rbg"]) == jax.random.key_impl(state["rbg"])


def test_a_key_saved_as_raw_data_comes_back_as_a_key_of_the_targets_implementation(tmp_path):
    # Saved as uint32 data (a legacy PRNGKey, key_data), restored into a typed rbg key: it was wrapped
    # as threefry whatever the target said, a raw TypeError ("expected key_data.shape to end with (2,)").
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    rbg, threefry = jax.random.key_data(jax.random.key(5, impl="rbg")), jax.random.PRNGKey(7)
    ckpt.save(1, {"rbg": rbg, "threefry": threefry}, {})
    ckpt.close()
    sd = SingleDeviceSharding(jax.devices()[0])
    like = {"rbg": jax.random.key(0, impl="rbg"), "threefry": jax.random.key(0)}
    got, _ = ckpt.restore(1, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sd) for k, v in like.items()})
    assert jax.random.key_impl(got["rbg"]) == jax.random.key_impl(like["rbg"])
    assert np.array_equal(jax.random.key_data(got["rbg"]), rbg)
    assert np.array_equal(jax.random.key_data(got["threefry"]), threefry)


def test_data_parallel_checkpoint_resumes_sharded(tmp_path):
    task = mlp.make(layers=2, depth=64, embed=32, num_train=256, num_eval=32)
    opt = optax.adam(1e-3)
    fit(task, spmdkit.DataParallel(), 5, tmp_path / "ck", opt=opt)
    result = fit(task, spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp"), 10, tmp_path / "ck",
                 resume=True, opt=opt)
    assert result.summary["resumed_from_step"] == 5 and result.summary["strategy"] == "sharded"


def truncate_largest(ckpt_dir, step):
    files = [p for p in (ckpt_dir / step_name(step)).rglob("*") if p.is_file()]
    victim = max(files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return victim.relative_to(ckpt_dir)


def test_truncated_file_is_named_and_resume_falls_back(task, tmp_path):
    fit(task, spmdkit.DataParallel(), 10, tmp_path / "ck")
    victim = truncate_largest(tmp_path / "ck", 10)
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    target = spmdkit.DataParallel().abstract(task_state(task, optax.sgd(0.05, momentum=0.9)), unbox=True)
    with pytest.raises(spmdkit.CheckpointDamagedError) as e:  # a CheckpointError a caller can tell from a misfit
        ckpt.restore(10, target)
    assert f"checkpoint step 10 in {tmp_path / 'ck'} is damaged" in str(e.value) and str(victim) in str(e.value)
    messages = []
    resumed = spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.05, momentum=0.9),
                          spmdkit.TrainConfig(steps=12, batch_size=64), progress=False,
                          checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=5, resume=True),
                          log=messages.append)
    assert resumed.summary["resumed_from_step"] == 5
    assert any("step 10 is damaged" in m and "falling back" in m for m in messages)


def test_a_step_without_a_manifest_is_never_restored_unverified(task, tmp_path):
    fit(task, spmdkit.DataParallel(), 10, tmp_path / "ck")
    (tmp_path / "ck" / "manifests" / "10.json").unlink()
    truncate_largest(tmp_path / "ck", 10)  # damage nothing but a manifest could have shown
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    target = spmdkit.DataParallel().abstract(task_state(task, optax.sgd(0.05, momentum=0.9)), unbox=True)
    with pytest.raises(spmdkit.CheckpointDamagedError, match="checkpoint step 10 in .*/ck is damaged: it has no manifest"):
        ckpt.restore(10, target)
    state, meta = ckpt.restore_latest(target)
    assert meta["step"] == 5
    # A step that is not there is not a damaged one; every step damaged is (a caller catching the
    # damage missed both: a plain CheckpointError for "all damaged", a damaged one for step 99).
    with pytest.raises(spmdkit.CheckpointError, match=r"holds no checkpoint step 99 \(it holds steps \[5, 10\]\)") as e:
        ckpt.meta(99)
    assert not isinstance(e.value, spmdkit.CheckpointDamagedError)
    (tmp_path / "ck" / "manifests" / "5.json").unlink()
    with pytest.raises(spmdkit.CheckpointDamagedError, match=r"steps \[5, 10\] are all damaged"):
        ckpt.restore_latest(target)
    from spmdkit._checkpoint import describe_directory

    with pytest.raises(spmdkit.CheckpointError, match="does not exist"):
        describe_directory(tmp_path / "nonexistent")


def test_saves_log_no_ocdbt_merge_warning(task, tmp_path, caplog):
    caplog.set_level("WARNING")
    fit(task, spmdkit.DataParallel(), 5, tmp_path / "ck")
    assert "OCDBT" not in caplog.text


def test_member_count_mismatch_names_the_leaf(task, tmp_path):
    fit(task, spmdkit.Ensemble(members=8), 5, tmp_path / "ck")
    with pytest.raises(spmdkit.CheckpointError) as e:
        fit(task, spmdkit.Ensemble(members=4, devices=jax.devices()[:4]), 10, tmp_path / "ck", resume=True)
    msg = str(e.value)
    assert "leaf state.params['Conv_0']['bias']" in msg or "leaf state.step" in msg
    assert "8 members, this run 4; use --members 8 (Ensemble(8) from Python)" in msg  # fit's caller has no flag


def test_optimizer_mismatch_says_so(task, tmp_path):
    fit(task, spmdkit.DataParallel(), 5, tmp_path / "ck")
    with pytest.raises(spmdkit.CheckpointError, match="resume with the optimizer the checkpoint was written with"):
        fit(task, spmdkit.DataParallel(), 10, tmp_path / "ck", resume=True, opt=optax.adam(1e-3))


def test_model_mismatch_names_the_leaf(tmp_path):
    opt = optax.adam(1e-3)
    fit(mlp.make(layers=2, depth=64, embed=32, num_train=128), spmdkit.DataParallel(), 5, tmp_path / "ck", opt=opt)
    with pytest.raises(spmdkit.CheckpointError, match=r"has shape \(2, 32, 64\) in the checkpoint but \(2, 32, 128\)"):
        fit(mlp.make(layers=2, depth=128, embed=32, num_train=128), spmdkit.DataParallel(), 10, tmp_path / "ck",
            resume=True, opt=opt)


def test_a_model_mismatch_names_the_options_that_differ(tmp_path):
    # --no-scan on resume: the error named a leaf the checkpoint lacks and said "resume with the model
    # (task and options) the checkpoint was written with", not which option that was.
    def run(info, **kw):
        return spmdkit.fit(mlp.make(layers=2, depth=32, embed=16, num_train=128, **kw), spmdkit.DataParallel(),
                           optax.sgd(0.05), spmdkit.TrainConfig(steps=10, batch_size=64), progress=False,
                           checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=5, resume=True),
                           run_info={"task": "mlp", "layers": 2, "steps": 10, **info}, log=lambda m: None)

    run({"steps": 5})
    with pytest.raises(spmdkit.CheckpointError, match=r"has no leaf state.params\['DotReluDot_0'\]\['W1'\] .*Options "
                                                      r"that differ from the checkpoint's run: --no-scan: not given -> "
                                                      r"given\.\n  Fix: resume with the model"):
        run({"scan": False}, scan=False)


def test_a_data_mismatch_names_the_options_that_differ(tmp_path):
    # --text-bytes 200000 -> 300000 on resume: "the checkpoint was written training from arrays with 6249
    # examples; this run trains from arrays with 9374", without the option that made them differ.
    def run(num_train, info):
        return spmdkit.fit(mlp.make(layers=2, depth=32, embed=16, num_train=num_train), spmdkit.DataParallel(),
                           optax.sgd(0.05), spmdkit.TrainConfig(steps=10, batch_size=64), progress=False,
                           checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=5, resume=True),
                           run_info={"task": "mlp", "steps": 10, **info}, log=lambda m: None)

    run(128, {"steps": 5, "text_bytes": 200000})
    with pytest.raises(spmdkit.ConfigError, match=r"with 128 examples; this run trains from arrays with 192: the data "
                                                  r"order would differ\. Options that differ from the checkpoint's "
                                                  r"run: --text-bytes: 200000 -> 300000\.\n  Fix: resume with the same"):
        run(192, {"text_bytes": 300000})


def test_resume_with_another_batch_size_is_refused(task, tmp_path):
    fit(task, spmdkit.DataParallel(), 5, tmp_path / "ck")
    with pytest.raises(spmdkit.ConfigError, match="written with batch_size=64, this run has batch_size=32"):
        spmdkit.fit(task, spmdkit.DataParallel(), optax.sgd(0.05, momentum=0.9), spmdkit.TrainConfig(steps=10, batch_size=32),
                    progress=False, checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), resume=True),
                    log=lambda m: None)


def test_resume_with_another_grad_accum_is_refused_from_python_too(tmp_path):
    # The checkpoint records grad_accum and spmdkit train refuses --grad-accum 1 -> 2, but fit()
    # from Python continued with the other accumulation, silently.
    def run(steps, accum):
        return spmdkit.fit(linreg.make(), spmdkit.DataParallel(), optax.sgd(0.01),
                           spmdkit.TrainConfig(steps=steps, batch_size=32, grad_accum=accum), progress=False,
                           checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=5, resume=True),
                           log=lambda m: None)

    run(5, 2)
    with pytest.raises(spmdkit.ConfigError, match="written with grad_accum=2, this run has grad_accum=1"):
        run(10, 1)
    assert run(10, 2).summary["steps"] == 10


def test_resume_with_another_optimizer_is_said_from_python(tmp_path):
    # spmdkit train refuses another --lr on resume; fit() from Python, given optax.adam(1e-2) for
    # the run's 1e-3 (a script edited between runs), continued with it without a word.
    def run(steps, optimizer, where="ck"):
        return spmdkit.fit(linreg.make(), spmdkit.DataParallel(), optimizer,
                           spmdkit.TrainConfig(steps=steps, batch_size=32), progress=False,
                           checkpoint=spmdkit.CheckpointConfig(str(tmp_path / where), every=5, resume=True),
                           log=lambda m: None)

    def schedule(lr):
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.cosine_decay_schedule(lr, 100)))

    run(5, schedule(1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same optimizer, built again: no warning
        assert run(10, schedule(1e-3)).summary["steps"] == 10
    with pytest.warns(RuntimeWarning, match=r"step 10 was written by a run with another optimizer: init_value "
                                            r"0\.001 -> 0\.01 \(in cosine_decay_schedule\)\. Training resumes"):
        assert run(15, schedule(1e-2)).summary["steps"] == 15  # a warning: changing it may be meant
    run(5, optax.sgd(0.01), "ck2")
    with pytest.warns(RuntimeWarning, match=r"step_size -0\.01 -> -0\.02 \(in scale\) \(optax keeps a constant "
                                            r"learning rate as scale\(step_size=-learning_rate\)\)"):
        run(10, optax.sgd(0.02), "ck2")


def test_resume_with_another_bagging_is_refused_from_python_too(tmp_path):
    # Ensemble(K, bagging=True) -> False: another data order per member, continued silently.
    def run(steps, bagging):
        return spmdkit.fit(linreg.make(), spmdkit.Ensemble(2, bagging=bagging), optax.sgd(0.01),
                           spmdkit.TrainConfig(steps=steps, batch_size=32), progress=False,
                           checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=5, resume=True),
                           log=lambda m: None)

    run(5, True)
    with pytest.raises(spmdkit.ConfigError, match="written with bagging=True, this run has bagging=False"):
        run(10, False)
    assert run(10, True).summary["steps"] == 10


def test_divergence_leaves_the_last_good_checkpoint(tmp_path):
    with pytest.raises(spmdkit.NonFiniteLossError) as e:
        spmdkit.fit(linreg.make(), spmdkit.DataParallel(), optax.sgd(40.0), spmdkit.TrainConfig(steps=100, batch_size=128),
                    progress=False, checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=1, keep=2),
                    log=lambda m: None)
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    assert max(ckpt.steps()) < e.value.step
    state, _ = ckpt.restore(max(ckpt.steps()), spmdkit.DataParallel().abstract(task_state(linreg.make(), optax.sgd(40.0)), unbox=True))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_a_diverged_run_saves_its_last_good_state_where_params_and_summary_say(tmp_path):
    # The README: the last checkpoint, params.npz and summary.json of a diverged run describe the same,
    # last good step. The final save was skipped for a diverged run: the checkpoint stayed at the last
    # multiple of `every` (steps [39, 42, 45] for a run whose params.npz and summary said 46), so a
    # resume repeated steps and started from other parameters than params.npz's.
    with pytest.raises(spmdkit.NonFiniteLossError) as e:
        spmdkit.fit(linreg.make(), spmdkit.DataParallel(), optax.sgd(40.0), spmdkit.TrainConfig(steps=100, batch_size=128),
                    out_dir=tmp_path / "out", progress=False, log=lambda m: None,
                    checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=1000))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    good = e.value.step - 2  # the loss of step k comes from the state after k - 1 updates
    assert summary["status"] == "diverged" and summary["steps"] == good > 0 and summary["checkpoint_steps"] == [good]
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    state, meta = ckpt.restore(good, spmdkit.DataParallel().abstract(task_state(linreg.make(), optax.sgd(40.0)), unbox=True))
    saved = spmdkit.load_params(tmp_path / "out" / "params.npz")
    restored = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    assert meta["step"] == good and saved.keys() == restored.keys()
    assert all(np.array_equal(saved[k], restored[k]) for k in saved)


def test_restore_never_unpickles(task, tmp_path, monkeypatch):
    fit(task, spmdkit.DataParallel(), 5, tmp_path / "ck")

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint restore tried to unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    state, meta = ckpt.restore(5, spmdkit.DataParallel().abstract(task_state(task, optax.sgd(0.05, momentum=0.9)), unbox=True))
    assert int(state.step) == 5 and meta["task"] == "digits"


def test_leftover_temporary_directory_is_removed(tmp_path):
    (tmp_path / "ck").mkdir()
    leftover = tmp_path / "ck" / "spmdkit_20.orbax-checkpoint-tmp-123"
    (leftover / "state").mkdir(parents=True)
    messages = []
    spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=messages.append).claim().close()
    assert not leftover.exists() and "left by an interrupted save" in messages[0]
    # An old step's deletion (keep) renames it ..-deleting first; a kill there was "an interrupted save".
    doomed = tmp_path / "ck" / "spmdkit_10.orbax-checkpoint-tmp-deleting"
    (doomed / "state").mkdir(parents=True)
    messages.clear()
    spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=messages.append).claim().close()
    assert not doomed.exists() and "left by the deletion of an old step (keep) cut short" in messages[0]


def test_a_checkpoint_directory_that_is_not_utf8_is_refused_before_training(tmp_path, capsys):
    # TensorStore takes paths as UTF-8 text: a --checkpoint-dir with a byte like 0xff (a Latin-1 name)
    # trained `every` steps, then the save failed with pybind11's "Unable to cast Python instance of type
    # str to C++ type" and exit 5, "free disk space or make the directory writable".
    import os

    from spmdkit._cli import main

    bad = tmp_path / os.fsdecode(b"ck\xffx")
    with pytest.raises(spmdkit.CheckpointError, match=r"(?s)holds a byte that is not UTF-8 \(b'\\xff' at position "
                                                      rf"{len(str(tmp_path)) + 3}\).*Fix: pass a --checkpoint-dir whose "
                                                      "full path is UTF-8"):
        spmdkit.CheckpointConfig(str(bad))
    assert main(["train", "--task", "linreg", "--steps", "2", "--no-progress", "--out", str(tmp_path / "run"),
                 "--checkpoint-dir", str(bad)]) == 2
    assert "not UTF-8" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_config_errors():
    with pytest.raises(spmdkit.CheckpointError, match="every=0"):
        spmdkit.CheckpointConfig("d", every=0)
    for directory in ("", None, 3):  # "" would be the working directory
        with pytest.raises(spmdkit.CheckpointError, match="must be a non-empty path"):
            spmdkit.CheckpointConfig(directory)
    from spmdkit._config import build_run_config

    with pytest.raises(spmdkit.ConfigError, match="--resume needs --checkpoint-dir"):
        build_run_config({"resume": True})


# ---- the command line, and SIGKILL at random moments ----------------------------

CLI = [sys.executable, "-m", "spmdkit._cli"]


def train_args(ck, out):
    return [*CLI, "train", "--task", "digits", "--host-devices", "8", "--steps", "150", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "3", "--keep", "2", "--out", str(out), "--no-progress"]


def test_killed_at_random_moments_resumes_to_the_same_parameters(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"}
    clean = subprocess.run(train_args(tmp_path / "ck0", tmp_path / "o0"), capture_output=True, text=True,
                           timeout=300, env=env)
    assert clean.returncode == 0, clean.stderr
    rng = random.Random(0)
    ck, out = tmp_path / "ck", tmp_path / "o"
    kills, steps_seen = 0, []

    def newest():
        return max((parse_step(p.name) or 0 for p in ck.iterdir()), default=0) if ck.exists() else 0

    for attempt in range(4):
        before = newest()
        proc = subprocess.Popen(train_args(ck, out) + (["--resume"] if attempt else []),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        # Kill once this attempt has made progress, at a random moment after it: mid-step
        # or mid-save (saves every 3 steps take a good part of each step's time).
        deadline = time.time() + 120
        while proc.poll() is None and newest() <= before and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is not None:
            break  # it finished before the kill: nothing more to interrupt
        proc.send_signal(signal.SIGKILL)  # no chance to clean up
        proc.wait(timeout=60)
        kills += 1
        steps_seen.append(newest())
    final = subprocess.run(train_args(ck, out) + ["--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert final.returncode == 0, final.stderr
    assert kills >= 2, "the kills all missed the run"
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] > 0, steps_seen
    assert "resumed from step" in final.stdout
    with np.load(tmp_path / "o0" / "params.npz") as a, np.load(out / "params.npz") as b:
        assert a.files == b.files
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k])


def test_checkpoints_command_lists_steps(task, tmp_path):
    fit(task, spmdkit.DataParallel(), 10, tmp_path / "ck")
    out = subprocess.run([*CLI, "checkpoints", str(tmp_path / "ck"), "--json", "--verify"], capture_output=True,
                         text=True, timeout=120)
    rows = json.loads(out.stdout)
    assert [r["step"] for r in rows] == [5, 10]
    assert all(r["status"] == "complete, verified" and r["task"] == "digits" for r in rows)
    truncate_largest(tmp_path / "ck", 10)
    rows = json.loads(subprocess.run([*CLI, "checkpoints", str(tmp_path / "ck"), "--json"], capture_output=True,
                                     text=True, timeout=120).stdout)
    assert rows[1]["status"].startswith("damaged")


def test_checkpoints_of_the_older_layout_are_named_not_silently_ignored(tmp_path):
    # Earlier versions saved step N in a directory named N, with manifests/N.json beside it.
    ck = tmp_path / "ck"
    (ck / "100").mkdir(parents=True)
    (ck / "100" / "_CHECKPOINT_METADATA").write_text("{}")
    (ck / "manifests").mkdir()
    (ck / "manifests" / "100.json").write_text("{}")
    (ck / "7").mkdir()  # a user's own numbered directory is not a checkpoint
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(ck), resume=True), log=lambda m: None)
    with pytest.raises(spmdkit.CheckpointError, match=r"steps \[100\] .*spmdkit_<step>") as e:
        ckpt.restore_latest(target=None)
    assert "--checkpoint-dir" in str(e.value)


def test_orbax_file_system_errors_log_their_line_without_a_traceback():
    import errno
    import logging
    import sys

    from spmdkit._checkpoint import _QuietOcdbtMerge

    def record(error):
        try:
            raise error
        except Exception:
            return logging.LogRecord("absl", logging.ERROR, __file__, 1, "background save failed", None,
                                     sys.exc_info())

    quiet = _QuietOcdbtMerge()
    for error in (OSError(errno.EROFS, "Read-only file system"), ValueError("PERMISSION_DENIED: Error writing")):
        r = record(error)
        assert quiet.filter(r) and r.exc_info is None and str(error) in r.getMessage()
    other = record(KeyError("a bug"))
    assert quiet.filter(other) and other.exc_info is not None  # not a file-system cause: kept whole


def test_a_file_size_limit_is_named_as_such_and_logs_no_tracebacks(tmp_path):
    # ulimit -f (or FAT32's 4 GiB): TensorStore's EFBIG was not taken for a file-system cause, so a
    # failed save printed ~400 lines of tracebacks (Orbax's threads, asyncio's unretrieved chunk
    # writes) and its error said "free disk space or make the directory writable".
    import logging

    from spmdkit._checkpoint import _os_cause, _quiet_orbax, _save_fix

    error = ValueError('OUT_OF_RANGE: Error writing local file "ck/spmdkit_2/state/w/0": Failed to write 90112 '
                       "bytes to file 7: File too large [os_error_code='27']")
    cause = _os_cause(error)
    assert cause.startswith("File too large (ValueError: OUT_OF_RANGE")
    assert "ulimit -f" in _save_fix(cause) and "free disk space" not in _save_fix(cause)
    assert "free disk space" in _save_fix(_os_cause(OSError(errno.ENOSPC, "No space left on device")))
    _quiet_orbax()
    for name in ("absl", "asyncio"):
        try:
            raise error
        except ValueError:
            r = logging.LogRecord(name, logging.ERROR, __file__, 1, "Task exception was never retrieved\nfuture: "
                                  "<Task coro=<write_fragment() at orbax/checkpoint/serialization.py:188>", None,
                                  sys.exc_info())
            mine = logging.LogRecord(name, logging.ERROR, __file__, 1, "Task exception was never retrieved", None,
                                     sys.exc_info())
        assert logging.getLogger(name).filter(r) and r.exc_info is None and "File too large" in r.getMessage()
        assert logging.getLogger(name).filter(mine) and (mine.exc_info is None) == (name == "absl")  # asyncio: not Orbax's
    # TensorStore's writes that end after the failed save closed Orbax's loop: unraisable, dropped.
    import asyncio
    import types

    from spmdkit._checkpoint import _closed_loop_callbacks_dropped

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        closed = e
    passed: list = []
    hook = _closed_loop_callbacks_dropped(passed.append)
    others = [RuntimeError("Event loop is closed"), KeyError("other")]  # not raised by a closed loop: kept
    for error in (closed, *others):
        hook(types.SimpleNamespace(exc_value=error, exc_traceback=error.__traceback__, object=None))
    assert [u.exc_value for u in passed] == others


def test_an_older_step_is_deleted_in_the_background_and_gone_once_closed(tmp_path):
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path), every=1, keep=2), log=lambda m: None)
    for step in range(1, 5):
        ckpt.save(step, {"w": np.full((64, 64), step, np.float32)}, {})
    ckpt.close()
    assert ckpt.steps() == [3, 4] and sorted(os.listdir(tmp_path / "manifests")) == ["3.json", "4.json"]
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("spmdkit_")) == ["spmdkit_3", "spmdkit_4"]
    assert not any(t.name == "spmdkit-delete-step" for t in threading.enumerate())


def test_restore_names_a_missing_step_a_key_of_another_kind_and_an_ensembles_member_axis(tmp_path):
    def make(rng):
        return {"w": jax.random.normal(rng, (8, 4)), "key": jax.random.fold_in(rng, 1)}

    ensemble = spmdkit.Ensemble(4)
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(tmp_path), log=lambda m: None)
    ckpt.save(1, ensemble.init(make, 0), {})
    ckpt.close()
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(tmp_path, resume=True), log=lambda m: None)
    # Each was "damaged: it has no manifest", or "shape (4, 2) ... resume with the same model size".
    with pytest.raises(spmdkit.CheckpointError, match=r"holds no checkpoint step 5 \(it holds steps \[1\]\)"):
        ckpt.restore(5, ensemble.abstract(make))
    rbg = ensemble.abstract(lambda r: {**make(r), "key": jax.random.key(0, impl="rbg")})
    with pytest.raises(spmdkit.CheckpointError, match=r"(?s)state\['key'\] is a threefry2x32 PRNG key in the "
                                                      r"checkpoint but a rbg key.*impl='threefry2x32'"):
        ckpt.restore(1, rbg)
    with pytest.raises(spmdkit.CheckpointError, match=r"an Ensemble\(4\) checkpoint. Restore it into "
                                                      r"Ensemble\(4\).abstract\(make_state\)"):
        ckpt.restore(1, spmdkit.Single().abstract(make))
    restored, _ = ckpt.restore(1, ensemble.abstract(make))
    assert restored["key"].dtype == jax.random.key(0).dtype


def test_resuming_a_complete_run_trains_nothing_and_keeps_its_artifacts(tmp_path):
    task, opt = linreg.make(), optax.sgd(0.1)
    config = spmdkit.TrainConfig(steps=6, batch_size=16)
    first = spmdkit.fit(task, spmdkit.Single(), opt, config, progress=False, out_dir=tmp_path / "out",
                        checkpoint=spmdkit.CheckpointConfig(tmp_path / "ck", every=3), log=lambda m: None)
    before = (tmp_path / "out" / "summary.json").read_text()
    said = []
    again = spmdkit.fit(task, spmdkit.DataParallel(), opt, config, progress=False, out_dir=tmp_path / "out",
                        checkpoint=spmdkit.CheckpointConfig(tmp_path / "ck", every=3, resume=True), log=said.append)
    # The summary was rewritten as a run of no steps: no final loss, no speed.
    assert (tmp_path / "out" / "summary.json").read_text() == before
    assert again.summary["final_train_loss"] == first.summary["final_train_loss"] is not None
    assert any("already complete at step 6" in m for m in said)
    np.testing.assert_array_equal(np.asarray(again.params["weight"]), np.asarray(first.params["weight"]))


@pytest.mark.parametrize("resume_at", ["the end", "mid-run"])
def test_a_resume_into_another_runs_out_is_refused_not_taken_for_its_own(tmp_path, resume_at):
    # Run B's checkpoint resumed with the --out run A wrote (the default runs/latest holds whichever
    # ran last): at its last step it handed back A's summary as its result, and mid-run it kept
    # A's metrics rows as its own and appended to them.
    task, opt = linreg.make(), optax.sgd(0.1)

    def run(out, ck, steps, seed, resume=False):
        return spmdkit.fit(task, spmdkit.Single(), opt, spmdkit.TrainConfig(steps=steps, batch_size=16, seed=seed),
                           progress=False, out_dir=tmp_path / out,
                           checkpoint=spmdkit.CheckpointConfig(tmp_path / ck, every=3, resume=resume), log=lambda m: None)

    b = run("out_b", "ck_b", 6 if resume_at == "the end" else 3, seed=1)
    a = run("out_a", "ck_a", 6, seed=0)
    assert a.summary["run_id"] != b.summary["run_id"]
    assert json.loads((tmp_path / "out_a" / "spmdkit-out.json").read_text())["run_id"] == a.summary["run_id"]
    before = {p.name: p.read_bytes() for p in (tmp_path / "out_a").iterdir() if p.is_file()}
    with pytest.raises(spmdkit.ConfigError, match=rf"(?s)--out {tmp_path / 'out_a'} holds the files of another run "
                                                  rf"\(run id {a.summary['run_id']}\), not of the run whose checkpoint in "
                                                  rf"{tmp_path / 'ck_b'} is resumed \(run id {b.summary['run_id']}\).*"
                                                  r"Fix: resume with the --out that run wrote to"):
        run("out_a", "ck_b", 6, seed=1, resume=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out_a").iterdir() if p.is_file()} == before  # untouched
    # Its own --out, or a new one: resumed.
    again = run("out_b", "ck_b", 6, seed=1, resume=True)
    assert again.summary["run_id"] == b.summary["run_id"]
    assert run("out_new", "ck_b", 6, seed=1, resume=True).summary["run_id"] == b.summary["run_id"]


def test_a_fresh_run_removes_an_earlier_runs_files_from_its_out(tmp_path, request):
    # A new run killed before its end left the earlier run's summary ("completed"), params.npz and
    # plots beside its own rows; an ensemble's ensemble.png stayed after any later run.
    task, opt, said = linreg.make(), optax.sgd(0.1), []
    config = spmdkit.TrainConfig(steps=3, batch_size=16)
    spmdkit.fit(task, spmdkit.Single(), opt, config, progress=False, out_dir=tmp_path, log=lambda m: None)
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "params.npz").is_file()
    (tmp_path / "ensemble.png").write_bytes(b"not written by that run")  # the run did not record it: kept
    (tmp_path / "notes.txt").write_text("the user's own")

    with pytest.raises(request.getfixturevalue("stop_fit_at_start")):  # the new run, killed before its first step
        spmdkit.fit(task, spmdkit.Single(), opt, config, progress=False, out_dir=tmp_path, log=said.append)
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file() and not p.name.startswith("."))
    assert names == ["ensemble.png", "metrics.jsonl", "notes.txt", "spmdkit-out.json"], names
    assert any("removed an earlier run's loss.png, params.npz, summary.json" in m for m in said), said


def test_a_users_own_files_in_out_are_never_removed(tmp_path, monkeypatch, request):
    (tmp_path / "summary.json").write_text('{"mine": 1}')  # not a run's summary
    (tmp_path / "params.npz").write_bytes(b"the user's own")
    (tmp_path / "run.json").write_text('{"run_id": "an-experiment-trackers"}')  # a common name, not spmdkit's

    with pytest.raises(request.getfixturevalue("stop_fit_at_start")):  # the run ends at its start, as a kill would
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=16),
                    progress=False, out_dir=tmp_path, log=lambda m: None)
    assert (tmp_path / "summary.json").read_text() == '{"mine": 1}'
    assert (tmp_path / "params.npz").read_bytes() == b"the user's own"
    assert (tmp_path / "run.json").read_text() == '{"run_id": "an-experiment-trackers"}'
    # A spmdkit-out.json spmdkit did not write is refused, not overwritten.
    (tmp_path / "spmdkit-out.json").write_text('{"run_id": "x"}')
    monkeypatch.undo()
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)spmdkit-out.json is not a file spmdkit wrote.*Fix: move"):
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=16),
                    progress=False, out_dir=tmp_path, log=lambda m: None)
    assert (tmp_path / "spmdkit-out.json").read_text() == '{"run_id": "x"}'


def test_a_resume_from_a_checkpoint_copied_without_its_owner_file_continues_its_out(tmp_path):
    # The copy's owner file gone, the directory took a new run id: the resume was refused as
    # another run's, and the owner file already rewritten, so the fix it gave could never work.
    task, opt = linreg.make(), optax.sgd(0.1)

    def run(steps, resume):
        return spmdkit.fit(task, spmdkit.Single(), opt, spmdkit.TrainConfig(steps=steps, batch_size=16),
                           progress=False, out_dir=tmp_path / "out", log=lambda m: None,
                           checkpoint=spmdkit.CheckpointConfig(tmp_path / "ck", every=3, resume=resume))

    first = run(3, False)
    (tmp_path / "ck" / "spmdkit-run.json").unlink()
    again = run(6, True)
    assert again.summary["resumed_from_step"] == 3 and again.summary["run_id"] != first.summary["run_id"]
    assert run(9, True).summary["resumed_from_step"] == 6  # the new id recorded in --out too
    # Once more without the owner file, and a resume that saves no new step (nothing left to train):
    # the next resume restores a step of the id before, and continues.
    (tmp_path / "ck" / "spmdkit-run.json").unlink()
    assert run(9, True).summary["resumed_from_step"] == 9
    assert run(12, True).summary["resumed_from_step"] == 9


def test_a_resume_whose_out_lost_its_id_file_is_checked_by_its_summary(tmp_path):
    # spmdkit-out.json deleted by hand: a resume into another run's --out took that run's rows.
    task, opt = linreg.make(), optax.sgd(0.1)

    def run(out, ck, steps, resume=False, seed=0):
        return spmdkit.fit(task, spmdkit.Single(), opt, spmdkit.TrainConfig(steps=steps, batch_size=16, seed=seed),
                           progress=False, out_dir=tmp_path / out, log=lambda m: None,
                           checkpoint=spmdkit.CheckpointConfig(tmp_path / ck, every=3, resume=resume))

    run("a", "ck_a", 3)
    other = run("a", "ck_b", 3, seed=1)
    (tmp_path / "a" / "spmdkit-out.json").unlink()
    with pytest.raises(spmdkit.ConfigError, match=rf"holds the files of another run \(run id {other.summary['run_id']}\)"):
        run("a", "ck_a", 6, resume=True)


def test_a_run_refused_at_its_start_leaves_out_as_it_was(tmp_path):
    # A state fit cannot save (an empty leaf) was refused after --out had been taken: the earlier
    # run's files removed, and its resume then refused as another run's.
    task, opt = linreg.make(), optax.sgd(0.1)
    spmdkit.fit(task, spmdkit.Single(), opt, spmdkit.TrainConfig(steps=3, batch_size=16), progress=False,
                out_dir=tmp_path / "out", log=lambda m: None)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}
    empty = dataclasses.replace(task, init=lambda rng: {**task.init(rng), "none": jnp.zeros((0, 3))})
    with pytest.raises(spmdkit.CheckpointError):
        spmdkit.fit(empty, spmdkit.Single(), opt, spmdkit.TrainConfig(steps=3, batch_size=16), progress=False,
                    out_dir=tmp_path / "out", log=lambda m: None,
                    checkpoint=spmdkit.CheckpointConfig(tmp_path / "ck"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()} == before


def test_finishing_an_unclosed_save_after_an_error_exits_with_that_errors_code(monkeypatch):
    # A process ending after a lost peer (end_soon armed with 4) whose unclosed save then failed
    # exited 5, the code of a failed save, hiding the cause.
    from spmdkit import _checkpoint

    class Unclosed:
        _pending = 3
        log = staticmethod(lambda m: None)

        def close(self):
            raise spmdkit.CheckpointSaveError("saving checkpoint step 3 failed: the peer is gone")

    exits = []
    monkeypatch.setattr(_checkpoint, "_UNCLOSED", {Unclosed()})
    monkeypatch.setattr(_checkpoint, "exit_now", exits.append)
    monkeypatch.setattr(_checkpoint, "armed", lambda: (4, 15.0))
    _checkpoint._close_unclosed()
    monkeypatch.setattr(_checkpoint, "armed", lambda: None)
    _checkpoint._close_unclosed()
    monkeypatch.setattr(_checkpoint, "armed", lambda: (0, 15.0))  # end_soon(0): a save that failed still says so
    _checkpoint._close_unclosed()
    assert exits == [4, 5, 5]


def test_resuming_another_tasks_checkpoint_names_the_task(tmp_path):
    spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=16),
                progress=False, checkpoint=spmdkit.CheckpointConfig(tmp_path), log=lambda m: None)
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)holds a run of task 'linreg'.*this run trains task 'digits'"
                                                  r".*resume with --task linreg"):
        spmdkit.fit(digits.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=4, batch_size=16),
                    progress=False, checkpoint=spmdkit.CheckpointConfig(tmp_path, resume=True), log=lambda m: None)


def test_resume_refuses_another_precision_and_points_out_moved_data(tmp_path):
    def run(steps, resume, **info):
        return spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=steps, batch_size=16),
                           progress=False, run_info=info, log=lambda m: None,
                           checkpoint=spmdkit.CheckpointConfig(tmp_path, resume=resume))

    run(2, False, text_dir="corpus", precision="bf16")
    # Both were resumed without a word: another precision changes every result; another path may be other data.
    with pytest.raises(spmdkit.ConfigError, match=r"written with --precision bf16, this run has --precision f32; (?s:.)*resume with --precision bf16"):
        run(4, True, text_dir="corpus")
    with pytest.warns(RuntimeWarning, match=r"written with --text-dir corpus, this run has --text-dir elsewhere"):
        assert run(4, True, text_dir="elsewhere", precision="bf16").summary["steps"] == 4
    # A run on the standard library has no --text-dir: said so, not "--text-dir None".
    with pytest.warns(RuntimeWarning, match=r"written with --text-dir elsewhere, this run has no --text-dir "
                                            r"\(the standard library's sources\)"):
        assert run(6, True, precision="bf16").summary["steps"] == 6


@pytest.mark.parametrize("leaf, fix_text", [(7, "jnp.asarray(7, jnp.int32)"), (0.5, "jnp.asarray(0.5, jnp.float32)"),
                                            ("x", "keep it in save()'s meta dict")])
def test_a_python_value_in_a_saved_state_is_named(tmp_path, leaf, fix_text):
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    with pytest.raises(spmdkit.CheckpointError, match=rf"save\(1, state\): state\['step'\] is a Python "
                                                      rf"{type(leaf).__name__}") as e:
        ckpt.save(1, {"w": jnp.ones(3), "step": leaf}, {})
    assert fix_text in str(e.value)
    assert not (tmp_path / "ck").exists() or ckpt.steps() == []


def test_a_step_not_after_the_newest_is_refused_so_a_rewind_is_never_resumed_past(tmp_path):
    # A run rewound to step 10 saved 15 beside 20 and 30: keep=3 deleted step 10, then 15, and a
    # resume took the abandoned step 30, silently. Saving step 20 again was a CheckpointSaveError
    # (exit 5) saying "free disk space", with "Earlier steps are intact: none".
    config = spmdkit.CheckpointConfig(str(tmp_path / "ck"), keep=3)
    ckpt = spmdkit.Checkpointer(config, log=lambda m: None)
    for step in (10, 20, 30):
        ckpt.save(step, {"w": jnp.full(3, float(step))}, {})
    ckpt.close()
    resumed = spmdkit.Checkpointer(dataclasses.replace(config, resume=True), log=lambda m: None).claim()
    target = {"w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=SingleDeviceSharding(jax.devices()[0]))}
    state, _ = resumed.restore(10, target)
    with pytest.raises(spmdkit.CheckpointError, match=r"save\(15, state\): .* holds step\(s\) \[20, 30\], not "
                                                      r"older than step 15: a resume would take step 30") as e:
        resumed.save(15, state, {})
    assert not isinstance(e.value, spmdkit.CheckpointSaveError) and "move spmdkit_20, spmdkit_30" in str(e.value)
    with pytest.raises(spmdkit.CheckpointError, match=r"save\(30, state\): step 30 is already saved"):
        resumed.save(30, state, {})
    resumed.save(31, state, {})
    resumed.close()
    assert resumed.steps() == [20, 30, 31] and float(resumed.restore_latest(target)[0]["w"][0]) == 10.0


def test_a_loop_resumed_by_restore_latest_saves_over_the_step_it_was_told_is_incomplete(tmp_path):
    # A kill between Orbax's commit and the manifest leaves step 2 without one. A user's loop that
    # resumes with Checkpointer(resume=True).restore_latest (a reader until it claims) fell back to
    # step 1, said [2] was left in place, then save(2) raised "step 2 is already saved": at every restart.
    config = spmdkit.CheckpointConfig(str(tmp_path / "ck"), resume=True)
    ckpt = spmdkit.Checkpointer(config, log=lambda m: None)
    for step in (1, 2):
        ckpt.save(step, {"w": jnp.full(3, float(step))}, {})
    ckpt.close()
    (tmp_path / "ck" / "manifests" / "2.json").unlink()
    target = {"w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=SingleDeviceSharding(jax.devices()[0]))}
    # A second writer holding the directory: its lock keeps this one from moving anything.
    holder = spmdkit.Checkpointer(config, log=lambda m: None).claim()
    messages = []
    resumed = spmdkit.Checkpointer(config, log=messages.append)
    state, meta = resumed.restore_latest(target)
    assert meta["step"] == 1 and "[2] left in place" in messages[-1] and "first save() does" in messages[-1]
    with pytest.raises(spmdkit.CheckpointError, match="another run"):
        resumed.save(2, {"w": state["w"] + 1}, {})
    assert resumed.steps() == [1, 2] and not list((tmp_path / "ck").glob("damaged-*"))
    holder.close()
    resumed.save(2, {"w": state["w"] + 1}, {})  # its first save claims the directory, as --resume does
    resumed.close()
    assert re.search(r"setting aside step\(s\) \[2\], damaged or incomplete \(step 2: it has no manifest", messages[-1])
    assert [p.name.rsplit("-", 1)[0] for p in (tmp_path / "ck").glob("damaged-*")] == ["damaged-spmdkit_2"]
    assert float(resumed.restore_latest(target)[0]["w"][0]) == 2.0 and resumed.steps() == [1, 2]


def test_a_resume_whose_only_steps_are_incomplete_starts_over_rather_than_refusing_every_restart(tmp_path):
    # A SIGKILL during a run's first save, after Orbax's commit: its one step has no manifest. Every
    # restart (--resume, or a loop's restore_latest) was "steps [2] are all damaged. Fix: start a new run
    # in another --checkpoint-dir": the directory was wedged by one kill at the wrong moment.
    config = spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=2, resume=True)
    spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=16),
                progress=False, log=lambda m: None, checkpoint=config)
    (tmp_path / "ck" / "manifests" / "2.json").unlink()
    target = spmdkit.Single().abstract(task_state(linreg.make(), optax.sgd(0.1)), unbox=True)
    messages = []
    loop = spmdkit.Checkpointer(config, log=messages.append)  # a reader until it saves: moves nothing
    assert loop.restore_latest(target) is None and "steps [2] are incomplete (no manifest) and left in place" in messages[-1]
    loop.close()
    assert loop.steps() == [2]
    result = spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=4, batch_size=16),
                         progress=False, log=messages.append, checkpoint=config)
    assert any("nothing intact to resume from: steps [2] are incomplete" in m for m in messages)
    assert result.summary["steps"] == 4 and result.summary["checkpoint_steps"] == [2, 4]
    assert len(list((tmp_path / "ck").glob("damaged-spmdkit_2-*"))) == 1
    # Damage a manifest vouches for is still refused: a run's history is not dropped without a word.
    (tmp_path / "ck" / "manifests" / "2.json").write_text("{")
    (tmp_path / "ck" / "manifests" / "4.json").write_text("{")
    with pytest.raises(spmdkit.CheckpointDamagedError, match=r"steps \[2, 4\] are all damaged"):
        spmdkit.Checkpointer(config, log=lambda m: None).claim().restore_latest(target)


def test_a_complete_step_in_the_way_is_never_set_aside_with_an_incomplete_one(tmp_path):
    config = spmdkit.CheckpointConfig(str(tmp_path / "ck"), resume=True)
    ckpt = spmdkit.Checkpointer(config, log=lambda m: None)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": jnp.full(3, float(step))}, {})
    ckpt.close()
    (tmp_path / "ck" / "manifests" / "3.json").unlink()
    resumed = spmdkit.Checkpointer(config, log=lambda m: None)
    with pytest.raises(spmdkit.CheckpointError, match=r"save\(2, state\): .* holds step\(s\) \[2, 3\], .* \(of "
                                                      r"those, \[3\] are damaged or incomplete; the others are complete\)"):
        resumed.save(2, {"w": jnp.zeros(3)}, {})
    resumed.close()
    assert resumed.steps() == [1, 2, 3] and not list((tmp_path / "ck").glob("damaged-*"))


def test_an_empty_leaf_is_named_before_the_save_not_taken_for_a_full_disk(tmp_path):
    # Orbax refused it in its save thread: a CheckpointSaveError (exit 5) saying "free disk space".
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    with pytest.raises(spmdkit.CheckpointError, match=r"save\(1, state\): state\['buf'\]\['x'\] has shape \(0, 3\)") as e:
        ckpt.save(1, {"w": jnp.ones(3), "buf": {"x": jnp.zeros((0, 3))}}, {})
    assert not isinstance(e.value, spmdkit.CheckpointSaveError) and "leave it out of the saved state" in str(e.value)
    assert "disk" not in str(e.value) and ckpt.steps() == []


def test_fit_names_an_empty_leaf_before_training_not_at_its_first_save(tmp_path):
    # fit trained `every` steps and then failed in save(2, state), with a fix (keep it out of the
    # saved state) that a fit user cannot act on: fit saves the whole state.
    empty = optax.GradientTransformation(lambda params: {"buf": jnp.zeros((0, 3))}, lambda u, s, params=None: (u, s))
    logged = []
    with pytest.raises(spmdkit.CheckpointError, match=r"fit\(checkpoint=...\) saves the whole train state: "
                                                      r"state\.opt_state\[1\]\['buf'\] has shape \(0, 3\)") as e:
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.chain(optax.sgd(0.1), empty),
                    spmdkit.TrainConfig(steps=4, batch_size=16), progress=False, log=logged.append,
                    checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=2))
    assert "the optimizer's init" in str(e.value) and "without checkpoint=" in str(e.value)
    assert "meta dict" not in str(e.value)
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    assert ckpt.steps() == []
    # Nor is the directory left locked or claimed: a fresh run (no resume) goes on in it. The refused
    # run's owner file, with no step, was 'holds the checkpoints of run ...: steps []. Fix: --resume'.
    spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=16),
                progress=False, log=logged.append, checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=2))
    assert ckpt.steps() == [2]


@pytest.mark.parametrize("state, first, second", [
    ({"a.b": jnp.ones(3), "a": {"b": jnp.zeros(3)}}, "['a']['b']", "['a.b']"),
    ({"x": [jnp.ones(2)], "x.0": jnp.zeros(2)}, "['x'][0]", "['x.0']"),
])
def test_two_leaves_stored_under_one_name_are_refused_not_mixed(tmp_path, state, first, second):
    # Orbax stores both in one directory (state/a.b): one overwrote the other and the restore
    # gave the same values for both leaves, silently.
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    with pytest.raises(spmdkit.CheckpointError, match="would be stored in the same file") as e:
        ckpt.save(1, state, {})
    assert f"state{first}" in str(e.value) and f"state{second}" in str(e.value) and "rename the key" in str(e.value)
    assert ckpt.steps() == []
    ckpt.save(1, {"a.b": jnp.ones(3), "c": {"b": jnp.zeros(3)}}, {})  # a '.' alone is fine
    ckpt.close()
    got, _ = ckpt.restore(1, {"a.b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=SingleDeviceSharding(jax.devices()[0])),
                             "c": {"b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=SingleDeviceSharding(jax.devices()[0]))}})
    assert np.array_equal(got["a.b"], np.ones(3)) and np.array_equal(got["c"]["b"], np.zeros(3))


@pytest.mark.parametrize("state, path, said", [
    ({"a" * 100: {"b" * 156: jnp.ones(3)}}, "['" + "a" * 100 + "']['" + "b" * 156 + "']", "is 257 bytes, longer than the 255"),
    ({"\u00f1" * 128: jnp.ones(3)}, "['" + "\u00f1" * 128 + "']", "is 256 bytes"),  # bytes, not characters
    ({"..": jnp.ones(3), "x": jnp.ones(2)}, "['..']", "'..' is not a file name"),
    ({"a/..": jnp.ones(3)}, "['a/..']", "'..' is not a file name"),  # a '/' makes a subdirectory
])
def test_a_leaf_name_that_is_no_file_name_is_refused_before_the_save(tmp_path, state, path, said):
    # Orbax stores a leaf in state/<keys joined by '.'>/: a name over 255 bytes (a deep model under
    # multi_transform) failed in its save thread with "File name too long", '..' with "Invalid file
    # path", both as a CheckpointSaveError (exit 5) saying "free disk space", with Orbax's tracebacks.
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    with pytest.raises(spmdkit.CheckpointError, match=re.escape(f"save(1, state): state{path} cannot be saved")) as e:
        ckpt.save(1, state, {})
    assert not isinstance(e.value, spmdkit.CheckpointSaveError) and said in str(e.value)
    assert "Fix: use " in str(e.value) and "ocdbt=True" in str(e.value) and "disk" not in str(e.value)
    assert ckpt.steps() == []
    ckpt.save(1, {"k" * 255: jnp.ones(3), "a/b": jnp.ones(2)}, {})  # at the limit, and a '/' alone: saved
    ckpt.close()
    # OCDBT keeps the leaves inside its files: there such names are no file names and are saved.
    packed = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "oc"), ocdbt=True), log=lambda m: None)
    packed.save(1, state, {})
    packed.close()
    assert packed.steps() == [1]


def test_fit_names_a_leaf_name_too_long_before_training(tmp_path):
    # It trained `every` steps, then failed at the first save, blamed on the disk.
    deep = optax.GradientTransformation(lambda params: {"k" * 300: jnp.zeros(1)}, lambda u, s, params=None: (u, s))
    with pytest.raises(spmdkit.CheckpointError, match=r"fit\(checkpoint=...\) saves the whole train state: "
                                                      r"state\.opt_state\[1\]\['k+'\] cannot be saved") as e:
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.chain(optax.sgd(0.1), deep),
                    spmdkit.TrainConfig(steps=4, batch_size=16), progress=False, log=lambda m: None,
                    checkpoint=spmdkit.CheckpointConfig(str(tmp_path / "ck"), every=2))
    assert "is 312 bytes" in str(e.value) and "the optimizer's nesting" in str(e.value)
    assert spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None).steps() == []


def test_a_failed_save_not_about_space_or_access_is_not_told_to_free_disk_space():
    from spmdkit._checkpoint import _os_cause, _save_fix

    too_long = _os_cause(ValueError('Error opening "zarr" driver: Failed to open: "ck/spmdkit_1/state/x": File name '
                                    "too long [os_error_code='36']"))
    assert too_long.startswith("File name too long") and "shorter keys" in _save_fix(too_long)
    for cause in (too_long, _os_cause(ValueError("Unable to cast Python instance of type str to C++ type"))):
        assert "free disk space" not in _save_fix(cause) and "--resume" in _save_fix(cause)
    for error in (OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded"),
                  ValueError("PERMISSION_DENIED: Error writing local file")):
        assert "free disk space" in _save_fix(_os_cause(error))


def test_orbax_is_imported_only_when_a_checkpoint_is_opened(tmp_path):
    # Importing it cost every start ~0.2 s, also the many that never checkpoint.
    code = ("import sys, spmdkit, spmdkit._cli\n"
            "assert not [m for m in sys.modules if m.startswith('orbax')], 'imported at import time'\n"
            "import warnings; warnings.simplefilter('error')\n"  # Orbax's own deprecation warnings are not the caller's
            f"spmdkit.Checkpointer(spmdkit.CheckpointConfig({str(tmp_path / 'ck')!r})).close()\n"
            "assert 'orbax.checkpoint' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]


def test_opening_a_directory_a_live_run_changes_is_taken_again(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from spmdkit import _checkpoint

    real, calls = ocp.CheckpointManager, []

    def flaky(*args, **kwargs):  # as when the writer's retention deletes the step being listed
        calls.append(1)
        if len(calls) <= failures:
            raise ValueError("No step path found with name=spmdkit_106")
        return real(*args, **kwargs)

    monkeypatch.setattr(ocp, "CheckpointManager", flaky)
    failures = 2
    assert spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "a"))).steps() == [] and len(calls) == 3
    failures = 99
    with pytest.raises(spmdkit.CheckpointError, match=r"(?s)kept changing while it was opened \(5 attempts; the last: "
                                                      r"ValueError: No step path found.*another process is saving"):
        spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "b")))


def test_a_step_deleted_while_listed_is_gone_not_damaged(tmp_path):
    from spmdkit._checkpoint import _ReadableSteps

    class Meta:
        step = 7

        @property
        def commit_timestamp(self):
            raise FileNotFoundError("spmdkit_7/_CHECKPOINT_METADATA")

    class Inner:
        def find_all(self, base_path):
            return [Meta()]

    names = _ReadableSteps(Inner())
    assert list(names.find_all(tmp_path)) == [] and names.unreadable == {}  # no spmdkit_7/ any more
    (tmp_path / "spmdkit_7").mkdir()
    assert list(names.find_all(tmp_path)) == [] and 7 in names.unreadable  # still there: damaged


def test_a_dtype_mismatch_from_jax_enable_x64_names_the_variable():
    # A float64 checkpoint (JAX_ENABLE_X64=1) resumed without it named the leaf but not the cause.
    from spmdkit._checkpoint import x64_hint

    assert "set JAX_ENABLE_X64=1" in x64_hint("float64", "float32")
    assert "set JAX_ENABLE_X64=1" in x64_hint("int64", "int32")
    assert "unset JAX_ENABLE_X64" in x64_hint("float32", "float64")
    assert x64_hint("bfloat16", "float32") == ""


def test_a_save_whose_directory_was_removed_says_so_and_claims_no_step_intact(tmp_path):
    # rm -rf of --checkpoint-dir while a run saved: "Earlier steps are intact: [10, 20]" (both gone)
    # and "free disk space", with Orbax's tracebacks (464 lines) around it.
    import errno
    import logging
    import shutil

    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    for step in (10, 20):
        ckpt.save(step, {"w": jnp.ones(3)}, {})
    ckpt.close()  # both committed
    (tmp_path / "ck" / step_name(10) / "_CHECKPOINT_METADATA").unlink()  # a removal half done
    error = ckpt._save_error(30, FileNotFoundError(errno.ENOENT, "No such file or directory"))
    assert "Earlier steps with all their files: [20]" in str(error) and "removed while the step was saved" in str(error)
    shutil.rmtree(tmp_path / "ck")
    error = ckpt._save_error(30, FileNotFoundError(errno.ENOENT, "No such file or directory"))
    assert re.search(r"ck is gone, removed while the run saved \(FileNotFoundError.*Earlier steps with all their "
                     r"files: none\.\n  Fix: a file or folder of the checkpoint directory was removed", str(error)), str(error)
    record = logging.LogRecord("absl", logging.ERROR, __file__, 1, "save failed", None,
                               (FileNotFoundError, FileNotFoundError(errno.ENOENT, "No such file or directory"), None))
    from spmdkit._checkpoint import _QuietOcdbtMerge
    assert _QuietOcdbtMerge().filter(record) and record.exc_info is None  # the line, not the traceback


def test_a_process_that_exits_without_close_still_finishes_its_last_save(tmp_path):
    # A user's loop that never called close(): Orbax's commit ran after the interpreter began to shut
    # down ("cannot schedule new futures after interpreter shutdown"), and the step was left
    # incomplete (spmdkit_2.orbax-checkpoint-tmp, no manifest), with Orbax's tracebacks.
    code = ("import jax.numpy as jnp, spmdkit\n"
            f"ck = spmdkit.Checkpointer(spmdkit.CheckpointConfig({str(tmp_path)!r}, every=1))\n"
            "ck.save(1, {'w': jnp.ones(1000)}, {})\n"
            "ck.save(2, {'w': jnp.full(1000, 2.0)}, {})\n")  # no close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "finishing the save of step 2 as the process exits (close() was not called" in out.stdout
    assert "Traceback" not in out.stderr and "cannot schedule" not in out.stderr, out.stderr[-2000:]
    with spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path), resume=True)) as ck:  # and as a context
        assert ck.steps() == [1, 2] and ck.problems(2) == []
        state, meta = ck.restore_latest({"w": jax.ShapeDtypeStruct((1000,), jnp.float32)})
        assert meta["step"] == 2 and float(state["w"][0]) == 2.0
        ck.save(3, state, {})
    assert spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path))).problems(3) == []  # closed by with


def test_the_checkpoints_table_leaves_blank_what_a_users_own_loop_does_not_record(tmp_path, capsys):
    # A step saved by a user's loop has no task, strategy, mesh or time of writing: shown as "None".
    from spmdkit._cli import main

    with spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3)}, {})
    capsys.readouterr()
    assert main(["checkpoints", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "None" not in out, out


@pytest.mark.parametrize("mode", ["none", "one", "lost", "raises"])
def test_processes_that_exit_without_close_finish_their_last_save_together(tmp_path, mode):
    # Over several processes the unclosed save was skipped at exit: the step was left incomplete, exit
    # 0, with 289 lines of Orbax's tracebacks; a process that did call close() (process 0 only, a
    # common habit) then waited for ever. Now each finishes its part; a peer that never does is
    # waited for a bounded time (here 10 s), and the step is named, exit 5.
    sys.path.insert(0, str(Path(__file__).parent))
    from _launch_two import run_two

    sys.path.pop(0)
    code, stdout, stderr = run_two(Path(__file__).parent / "_unclosed_mp_program.py", str(tmp_path / "ck"), mode,
                                   timeout=240)
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    if mode == "raises":
        # The process that raised ends within end_soon's grace (20 s): its line said 60 s, the
        # wait it was never given. Whether the other finished its part before the launcher
        # stopped it is timing; step 1 is whole either way.
        assert code == 1 and "RuntimeError: the user's own error" in stderr, stdout[-2000:] + stderr[-3000:]
        waits = [int(w) for w in re.findall(r"\[1\] checkpoints: finishing the save of step 2 .* waits up to "
                                            r"(\d+) s for the others", stdout)]
        assert len(waits) == 1 and 0 < waits[0] <= 20, stdout[-3000:]
        assert 1 in ckpt.steps() and ckpt.problems(1) == []
        return
    assert "Traceback" not in stderr and "cannot schedule" not in stderr, stderr[-3000:]
    if mode == "lost":
        assert code == 5, stdout[-2000:] + stderr[-3000:]
        assert re.search(r"\[0\] spmdkit: the save of step 2 did not finish within 10 s of this process's exit: "
                         r"another process did not finish its part", stderr), stderr[-3000:]
        assert ckpt.steps() == [1] and ckpt.problems(1) == []
        return
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    finishing = "finishing the save of step 2 as the process exits (close() was not called"
    assert stdout.count(finishing) == (2 if mode == "none" else 1), stdout[-3000:]
    assert ckpt.steps() == [1, 2] and ckpt.problems(2) == []


def test_a_damaged_chunk_in_the_way_is_set_aside_and_several_steps_without_manifests_are_refused(tmp_path):
    # save checked the steps in its way without their arrays: a flipped byte of a chunk counted as
    # complete, and every restart of a loop was refused "a resume would take step 20". And a whole
    # run whose manifests/ directory went missing was set aside as if one first save had been cut short.
    config = spmdkit.CheckpointConfig(str(tmp_path / "ck"), resume=True)
    with spmdkit.Checkpointer(config, log=lambda m: None) as ckpt:
        for step in (10, 20):
            ckpt.save(step, {"w": jnp.full(1000, float(step))}, {})
    chunk = next(p for p in (tmp_path / "ck" / "spmdkit_20").rglob("*") if p.is_file() and p.parent.name == "w")
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    target = {"w": jax.ShapeDtypeStruct((1000,), jnp.float32, sharding=SingleDeviceSharding(jax.devices()[0]))}
    messages = []
    with spmdkit.Checkpointer(config, log=messages.append) as loop:
        state, meta = loop.restore_latest(target)
        assert meta["step"] == 10
        loop.save(11, state, {})
    assert re.search(r"setting aside step\(s\) \[20\], damaged or incomplete \(step 20: file .* has changed bytes",
                     messages[-1]), messages
    assert loop.steps() == [10, 11]
    (tmp_path / "ck" / "manifests").rename(tmp_path / "elsewhere")
    with pytest.raises(spmdkit.CheckpointDamagedError, match=r"(?s)steps \[10, 11\] are all damaged \(none has a "
                                                               r"manifest: manifests/ is missing\).*Fix: put .* back"):
        spmdkit.Checkpointer(config, log=lambda m: None).claim().restore_latest(target)
    assert [p.name for p in (tmp_path / "ck").glob("spmdkit_*")] != []  # nothing set aside


@pytest.mark.parametrize("state, words", [
    ({"a/": jnp.ones(2), "a": jnp.zeros(2)}, r"state\['a'\] and state\['a/'\] would be stored in the same file"),
    ({"a//b": jnp.ones(2)}, r"state\['a//b'\] cannot be saved: .* is not a file name \(a NUL byte, or an empty part"),
    ({"a\0b": jnp.ones(2)}, r"is not a file name \(a NUL byte"),
], ids=["trailing_slash", "double_slash", "nul"])
def test_keys_orbax_stores_as_one_path_or_no_path_are_refused_before_the_save(tmp_path, state, words):
    # "a/" and "a" were stored in one directory and restored as one leaf's values (with or without
    # OCDBT); "a//b" and a NUL failed inside Orbax as a CheckpointSaveError about a shorter directory.
    with spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None) as ckpt:
        with pytest.raises(spmdkit.CheckpointError, match=words) as e:
            ckpt.save(1, state, {})
        assert not isinstance(e.value, spmdkit.CheckpointSaveError) and ckpt.steps() == []


@pytest.mark.parametrize("how", ["dropped", "fails"])
def test_an_unclosed_checkpointer_dropped_or_failing_at_exit(tmp_path, how):
    # Kept in a WeakSet, a Checkpointer made inside a function and dropped lost its last save (exit 0);
    # a last save that failed at exit exited 0 with the step left incomplete.
    code = ("import jax.numpy as jnp, spmdkit\n"
            "def train():\n"
            f"    ck = spmdkit.Checkpointer(spmdkit.CheckpointConfig({str(tmp_path / 'ck')!r}, every=1))\n"
            "    ck.save(1, {'w': jnp.ones(1000)}, {})\n"
            f"    ck.save(2, {{'w': jnp.full({4_000_000 if how == 'fails' else 1000}, 2.0)}}, {{}})\n"
            "train()\n"
            "import gc; gc.collect()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_")}
    limit = "ulimit -f 8000; " if how == "fails" else ""  # 8 MB a file: the 16 MB save fails
    out = subprocess.run(["bash", "-c", f'{limit}exec "$0" -c "$1"', sys.executable, code], capture_output=True,
                         text=True, timeout=120, env=env)
    assert "finishing the save of step 2 as the process exits" in out.stdout, out.stdout + out.stderr[-2000:]
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    if how == "dropped":
        assert out.returncode == 0 and ckpt.steps() == [1, 2] and ckpt.problems(2) == [], out.stderr[-2000:]
    else:
        assert out.returncode == 5 and "spmdkit: saving checkpoint step 2" in out.stderr, out.stderr[-2000:]
        assert ckpt.steps() == [1]
