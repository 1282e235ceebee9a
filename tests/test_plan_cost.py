"""The planner's price of a transposition: found in the HLO, measured on the target, charged per operation."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdkit._plan._cost import compute_time
from spmdkit._plan._hlo import Kernel, contiguous_run, kernels, parse, transposed
from spmdkit._target import Link, Target, TargetError, collective_time, from_json, measure_cache_curve


def _target(**kw) -> Target:
    return Target("t", "test", 8, {"float32": 1e12}, 1e9, {"intra_host": Link(1e-5, 1e-9)},
                  cache_bandwidth=((2**15, 8e9), (2**25, 2e9)), **kw)


# ---------------------------------------------------------------- which copies transpose
@pytest.mark.parametrize("out, src, perm, run", [
    ("f32[64,32]{1,0}", "f32[64,32]{0,1}", [0, 1], 1),  # a layout change that moves the minor dimension
    ("f32[64,32]{0,1}", "f32[32,64]{1,0}", [1, 0], 2048),  # transpose into the transposed layout: a relabelling
    ("f32[4,8,16]{2,1,0}", "f32[8,4,16]{2,1,0}", [1, 0, 2], 16),  # heads to the front: rows of 16 stay whole
    ("f32[1,64,32]{2,1,0}", "f32[1,64,32]{2,0,1}", [0, 1, 2], 2048),  # only a size-1 dimension moves
    ("f32[64,32]{1,0}", "f32[64]{0}", [0, 1], None),  # ranks differ: unknown
])
def test_contiguous_run_follows_the_layouts(out, src, perm, run):
    assert contiguous_run(out, src, perm) == run


def test_transposed_counts_runs_shorter_than_a_cache_line():
    text = """ENTRY %main (p: f32[64,32]) -> f32[64,32] {
  %p = f32[64,32]{0,1} parameter(0)
  %c = f32[64,32]{1,0} copy(%p)
  %t = f32[32,64]{0,1} transpose(%c), dimensions={1,0}
  %b = bf16[64,8]{0,1} parameter(1)
  %d = bf16[64,8]{1,0} copy(%b)
  ROOT %r = f32[64,32]{1,0} copy(%c)
}
"""
    comps, shapes, entry = parse(text)
    by_name = {i.name: i for i in comps[entry]}
    assert transposed(by_name["c"], shapes[entry]) == 2 * 64 * 32 * 4  # read and written
    assert transposed(by_name["t"], shapes[entry]) == 0  # a relabelling: the data stays in order
    assert transposed(by_name["d"], shapes[entry]) == 2 * 64 * 8 * 2
    assert transposed(by_name["r"], shapes[entry]) == 0  # a plain copy


def test_a_fusion_is_charged_its_transposition_not_its_whole_output():
    # a small transposed operand broadcast over a large output: 16 KiB moved out of order, not 256 KiB
    text = """%fused (p0: f32[64,32], p1: f32[512,64]) -> f32[512,64] {
  %p0 = f32[64,32]{0,1} parameter(0)
  %c = f32[64,32]{1,0} copy(%p0)
  %s = f32[64,1]{1,0} slice(%c), slice={[0:64], [0:1]}
  %b = f32[64]{0} bitcast(%s)
  %bb = f32[512,64]{1,0} broadcast(%b), dimensions={1}
  %p1 = f32[512,64]{1,0} parameter(1)
  ROOT %r = f32[512,64]{1,0} add(%p1, %bb)
}

ENTRY %main (a: f32[64,32], x: f32[512,64]) -> f32[512,64] {
  %a = f32[64,32]{0,1} parameter(0)
  %x = f32[512,64]{1,0} parameter(1)
  ROOT %f = f32[512,64]{1,0} fusion(%a, %x), kind=kLoop, calls=%fused
}
"""
    (k,) = kernels(text)
    assert k.strided == 2 * 64 * 32 * 4
    # and a large transposed intermediate sliced to a small output: at most twice what it writes
    sliced = text.replace("f32[512,64]", "f32[8,64]")
    (k,) = kernels(sliced)
    assert k.strided == min(2 * 64 * 32 * 4, 2 * 8 * 64 * 4) == 4096


def _step_kernels(fn, x):
    return kernels(jax.jit(fn).lower(x).compile().as_text())


def test_a_compiled_transposition_is_found_inside_its_fusion_and_a_plain_pass_is_not():
    x = jnp.ones((256, 512), jnp.float32)
    moved = sum(k.strided * k.count for k in _step_kernels(lambda a: (a * 0.5 + 1.0).T.copy() * 1.0, x))
    # XLA:CPU writes the transposed array once: 512 KiB read, 512 KiB written out of order
    assert moved >= 2 * x.nbytes
    assert sum(k.strided for k in _step_kernels(lambda a: jnp.tanh(a) * 0.5 + 1.0, x)) == 0
    # a per-head transposition whose rows stay longer than a cache line is no strided copy
    heads = jnp.ones((8, 64, 4, 32), jnp.float32)
    assert sum(k.strided for k in _step_kernels(lambda a: jnp.transpose(a, (0, 2, 1, 3)) + 1.0, heads)) == 0


# ---------------------------------------------------------------- the price
def test_a_transposition_is_priced_by_its_curve_the_rest_of_the_kernel_as_before():
    slow = _target(transpose_bandwidth=((2**15, 1e9), (2**25, 1e8)))
    plain = _target()
    k = Kernel(0.0, 2**25, 1, cold=0, strided=2**24)
    # without a curve a transposition costs what any warm byte does
    assert compute_time(0, 0, plain, "float32", 0, [k]) == pytest.approx(2**25 / 2e9)
    # with one: half the kernel's bytes at the transposition's rate for their size (16 MiB)
    rate = slow.transpose_bandwidth_for(2**24)
    assert 1e8 < rate < 1e9
    assert compute_time(0, 0, slow, "float32", 0, [k]) == pytest.approx(2**24 / 2e9 + 2**24 / rate)
    # the step's own state transposed (cold bytes, read and written in memory) pays it too
    cold = Kernel(0.0, 2**23, 1, cold=2**23, strided=2**23)
    assert compute_time(0, 0, plain, "float32", 0, [cold]) == pytest.approx(2**23 / 1e9)
    assert compute_time(0, 0, slow, "float32", 0, [cold]) == pytest.approx(2**23 / slow.transpose_bandwidth_for(2**23))
    # a matmul keeps its roofline
    mm = Kernel(1e12, 2**20, 1, strided=2**20)
    assert compute_time(0, 0, slow, "float32", 0, [mm]) == pytest.approx(1.0)


def test_a_transposition_never_costs_less_than_warm_data():
    from spmdkit._plan._cost import transposition_time

    fast = _target(transpose_bandwidth=((2**15, 1e12),))
    assert fast.transpose_bandwidth_for(2**15) == fast.bandwidth_for(2**15) == 8e9
    # a small transposition inside a large operation: the curve's rate at its own small size
    # (faster than the large operation's warm rate) must not make the operation cheaper
    slow = _target(transpose_bandwidth=((2**15, 6e9), (2**25, 1e8)))
    for k in (Kernel(0.0, 2**25, 1, strided=2**15), Kernel(0.0, 2**25, 1, cold=2**24, strided=2**15),
              Kernel(0.0, 2**16, 1, cold=2**16, strided=2**15)):
        assert transposition_time(slow, "float32", [k]) >= 0.0
        assert compute_time(0, 0, slow, "float32", 0, [k]) >= compute_time(0, 0, _target(), "float32", 0, [k])


def test_transpose_curve_goes_through_a_target_file_and_a_bad_one_names_the_fix():
    t = _target(transpose_bandwidth=((32768.0, 4e9), (8388608.0, 2e8)))
    back = from_json(json.loads(json.dumps(t.to_json())))
    assert back.transpose_bandwidth == t.transpose_bandwidth
    assert "transpose_bandwidth" not in _target().to_json()  # optional: left out when not measured
    with pytest.raises(TargetError, match=r"(?s)transpose_bandwidth\[0\] is \[32768, 0\].*Fix: write \[bytes, "
                                          r"bytes/s\] pairs.*\"transpose_bandwidth\": \[\[65536.*transpositions "
                                          r"priced as other warm data"):
        from_json({**t.to_json(), "transpose_bandwidth": [[32768, 0]]})
    with pytest.raises(TargetError, match=r"transpose_bandwidth is 'fast'"):
        from_json({**t.to_json(), "transpose_bandwidth": "fast"})
    # a rate in GB/s, as a datasheet gives it, is an error naming the unit (both curves); a size under a byte too
    for key in ("transpose_bandwidth", "cache_bandwidth"):
        with pytest.raises(TargetError, match=rf"(?s){key}\[0\] is \[65536, 15\]: 15 bytes/s, below 1e\+06.*"
                                              r"Fix: write the rate in bytes/s: e.g. \[65536, 15e9\]"):
            from_json({**t.to_json(), key: [[65536, 15]]})
    with pytest.raises(TargetError, match=r"transpose_bandwidth\[0\] is \[0.5, 1000000000.0\]"):
        from_json({**t.to_json(), "transpose_bandwidth": [[0.5, 1e9]]})


def test_transpose_curve_is_measured_on_every_device_at_once_and_slower_than_a_plain_pass():
    sizes = (64 * 1024, 1024 * 1024)
    plain = measure_cache_curve(8, sizes=sizes, repeats=3)
    turned = measure_cache_curve(8, sizes=sizes, repeats=3, transpose=True)
    assert [b for b, _ in turned] == [2 * s for s in sizes] and all(r > 0 for _, r in turned)
    # a 1 MiB transposition on 8 devices sharing the cores: several times slower (10-50x measured)
    assert turned[-1][1] < plain[-1][1] / 2


# ---------------------------------------------------------------- in the plan
@pytest.mark.parametrize("rules, mesh, more", [("dp", {"data": 8}, False), ("fsdp+sp", {"data": 4, "model": 2}, True)])
def test_sequence_parallelism_pays_transpositions_that_data_parallelism_does_not(rules, mesh, more):
    from spmdkit._mesh import make_mesh
    from spmdkit._plan._candidates import rules_table
    from spmdkit._strategies.sharded import Sharded
    from spmdkit._tasks import lm
    from spmdkit._train._steps import task_state, task_train_step

    task = lm.make(layers=2, d_model=64, heads=4, seq_len=64, text_bytes=20_000)
    opt = optax.adamw(1e-3)
    strategy = Sharded(make_mesh(**mesh), rules_table(rules))
    layout = strategy.plan(task_state(task, opt), jax.random.key(0))
    batch = jax.tree.map(lambda x: x[:32], task.train_data)
    text = strategy.step(task_train_step(task, opt, 1)).lower(layout.abstract, batch).compile().as_text()
    moved = sum(k.strided * k.count for k in kernels(text))
    # measured on this layout: sequence parallelism moves its activations between layouts
    assert (moved > 4 * 2**20) is more, moved


def test_the_plan_names_what_transpositions_cost_and_a_target_without_the_curve_charges_none():
    import spmdkit
    from spmdkit._tasks import lm
    from spmdkit._train._steps import task_state, task_train_step

    task = lm.make(layers=2, d_model=64, heads=4, seq_len=64, text_bytes=20_000)
    opt = optax.adamw(1e-3)
    batch = jax.tree.map(lambda x: x[:32], task.train_data)
    curve = ((2**15, 2e9), (2**23, 1e8))
    base = Target("t", "test", 8, {"float32": 1e10}, 1e9, {"intra_host": Link(1e-5, 1e-10)},
                  cache_bandwidth=((2**15, 8e9), (2**25, 2e9)))
    args = (task_state(task, opt), task_train_step(task, opt, 1), batch)
    rows = {}
    for name, target in (("with", dataclasses.replace(base, transpose_bandwidth=curve)), ("without", base)):
        result = spmdkit.plan(*args, target=target, rules=("dp", "fsdp+sp"))
        rows[name] = {r["label"]: r for r in result["candidates"] if r["status"] == "ok"}
        if name == "with":
            why = "\n".join(result["why"])
    sp = "fsdp+sp [data=4,model=2]"
    assert all(r["transposed_s"] == 0.0 for r in rows["without"].values())
    assert rows["with"][sp]["transposed_s"] > 2 * rows["with"]["dp [data=8]"]["transposed_s"] > 0
    # the price is compute's: the rest of the step is the same
    for label, r in rows["with"].items():
        assert r["compute_s"] - rows["without"][label]["compute_s"] == pytest.approx(r["transposed_s"])
    assert "of it transpositions" in why and "(transpositions +" in why, why


def test_a_step_that_transposes_its_state_is_priced_for_it():
    import spmdkit

    t = _target(transpose_bandwidth=((2**15, 2e9), (2**23, 1e8)))
    make_state = lambda rng: {"w": jnp.ones((512, 512))}  # noqa: E731 - 1 MiB, transposed whole every step
    batch = {"x": jnp.ones((8, 1))}
    rows = {}
    for name, step in (("copy", lambda s, b: ({"w": s["w"] * b["x"][0, 0]}, {})),
                       ("transpose", lambda s, b: ({"w": s["w"].T * b["x"][0, 0]}, {}))):
        result = spmdkit.plan(make_state, step, batch, target=t, rules=("dp",))
        rows[name] = next(r for r in result["candidates"] if r["status"] == "ok")
    assert rows["copy"]["transposed_s"] == 0.0
    # 1 MiB read and 1 MiB written out of order, at the curve's rate for 2 MiB rather than memory's 1e9 B/s
    moved = 2 * 512 * 512 * 4
    extra = moved / t.transpose_bandwidth_for(moved) - moved / t.memory_bandwidth
    assert rows["transpose"]["transposed_s"] == pytest.approx(extra, rel=0.05) and extra > 1e-3
    assert rows["transpose"]["compute_s"] > 1.5 * rows["copy"]["compute_s"]


def test_a_target_built_in_python_reads_dtype_aliases_as_a_file_does():
    from spmdkit._target import Target, TargetError, from_json

    base = dict(name="py", source="test", devices_per_host=8, memory_bandwidth=1e11,
                links={"intra_host": Link(alpha=1e-5, beta=1e-10)})
    t = Target(peak_flops={"float32": 1e9, "bf16": 1e12}, **base)
    assert t.peak_flops == {"float32": 1e9, "bfloat16": 1e12} and t.flops_for("bfloat16") == 1e12
    assert from_json(t.to_json()).peak_flops == t.peak_flops  # the plan's target.file prices the same
    with pytest.raises(TargetError, match=r"Target\('py'\): peak_flops has the key 'fast'"):
        Target(peak_flops={"fast": 1e12}, **base)
    with pytest.raises(TargetError, match="gives bfloat16 twice"):
        Target(peak_flops={"bf16": 1e12, "bfloat16": 1e12}, **base)


def test_a_target_built_with_numpy_figures_writes_a_file_that_prices_the_same():
    # Its figures were written as strings (json's default=str), which a target file refuses: the
    # plan's target.file could not be passed back with --target.
    import numpy as np

    t = Target("np", "example", np.int64(8), {"float32": np.float32(1e12), "bf16": np.float64(2e12)},
               np.float32(1e11), {"intra_host": Link(np.float32(1e-5), np.float32(1e-10),
                                                     pieces=((np.int64(4096), Link(np.float32(2e-5), 0.0)),
                                                             (None, Link(1e-5, 1e-10))))},
               memory_per_device=np.int64(2**30), op_overhead=np.float32(1e-6), collective_sync_ops={2: np.float32(1.5)},
               cache_bandwidth=((np.int64(32768), np.float32(2e10)),), transpose_bandwidth=((32768, np.float32(5e9)),))
    back = from_json(json.loads(json.dumps(t.to_json())))  # no default=: every figure a JSON number
    kernels = [Kernel(1e6, 4096, 2), Kernel(0.0, 65536, 3, cold=1000, strided=8192)]
    for dtype in ("float32", "bfloat16"):
        assert compute_time(0, 0, back, dtype, 5, kernels) == pytest.approx(compute_time(0, 0, t, dtype, 5, kernels))
    for n in (1024, 1 << 20):
        assert collective_time(back, "all_reduce", n, 8, "intra_host") == pytest.approx(
            collective_time(t, "all_reduce", n, 8, "intra_host"))
    assert back.memory_per_device == 2**30 and back.sync_ops_for(2) == 1.5
