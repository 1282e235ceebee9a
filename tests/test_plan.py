"""spmdkit plan: targets, the HLO reader, candidates, memory, flags, the Python API and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import spmdkit
from spmdkit._cli import main
from spmdkit._errors import ConfigError
from spmdkit._plan._candidates import enumerate_candidates, factorisations
from spmdkit._plan._hlo import Kernel, analyse
from spmdkit._console import readable_bytes
from spmdkit._target import Link, Target, TargetError, collective_time, example_targets, from_json, load_target


# ---------------------------------------------------------------- targets
def test_example_targets_load_and_alpha_beta_formula():
    h100 = load_target("h100x8")
    assert h100.devices_per_host == 8 and h100.flops_for("bfloat16") == 989e12 and "datasheet" in h100.source
    assert h100.flops_for("float16") == h100.peak_flops["float32"]  # falls back to float32
    assert load_target(example_targets()["tpu-v5e-16"]).memory_per_device == 16e9
    t = Target("t", "test", 4, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 1e-9), "inter_host": Link(1e-4, 1e-8)},
               collectives={"all_gather": {"intra_host": Link(2e-5, 2e-9)}})
    n, b = 4, 1000.0
    assert collective_time(t, "all_reduce", b, n, "intra_host") == pytest.approx(6 * 1e-5 + 1.5 * b * 1e-9)
    assert collective_time(t, "all_gather", b, n, "intra_host") == pytest.approx(3 * 2e-5 + 0.75 * b * 2e-9)  # override
    assert collective_time(t, "reduce_scatter", b, n, "inter_host") == pytest.approx(3 * 1e-4 + 0.75 * b * 1e-8)
    assert collective_time(t, "collective_permute", b, n, "intra_host") == pytest.approx(1e-5 + b * 1e-9)
    assert collective_time(t, "all_reduce", b, 1, "intra_host") == 0.0
    assert from_json(json.loads(json.dumps(t.to_json()))) == t  # the file format round-trips


def test_a_misspelt_target_field_is_named_not_dropped(tmp_path):
    # "memory_per_devices" left the memory budget None, silently; "inter-host" dropped the link.
    good = json.loads((Path(spmdkit.__file__).parent / "targets" / "h100x8.json").read_text())
    for change, words in [
        (lambda t: t.update(memory_per_devices=t.pop("memory_per_device")),
         r"(?s)'memory_per_devices' is not a field of a target file \(did you mean 'memory_per_device'\?\)"),
        (lambda t: t["links"].update({"inter-host": t["links"].pop("inter_host")}),
         r"(?s)links: 'inter-host' is not a field.*did you mean 'inter_host'.*Fix: use \['intra_host', 'inter_host'\]"),
    ]:
        target = json.loads(json.dumps(good))
        change(target)
        (tmp_path / "t.json").write_text(json.dumps(target))
        with pytest.raises(TargetError, match=words):
            spmdkit.load_target(tmp_path / "t.json")


def _h100(change):
    target = json.loads((Path(spmdkit.__file__).parent / "targets" / "h100x8.json").read_text())
    change(target)
    return target


@pytest.mark.parametrize("change, words", [
    # Raw AttributeError / TypeError before: the field is named now.
    (lambda t: t.update(collectives=[1]), r"collectives is \[1\], not an object"),
    (lambda t: t.update(measurements=5), r"measurements is 5, not a list"),
    # Pieces out of order, after the catch-all, or a misspelt key: sizes were priced by another
    # piece's line without a word ("max_byte" made its piece the one for every size).
    (lambda t: t["links"]["intra_host"].update(pieces=[{"max_bytes": 1e9, "alpha": 1e-6, "beta": 0},
                                                       {"max_bytes": 1e3, "alpha": 1.0, "beta": 0}]),
     r"(?s)pieces\[1\] \(max_bytes 1000\) comes after a piece that ends at max_bytes 1e\+09.*increasing max_bytes"),
    (lambda t: t["links"]["intra_host"].update(pieces=[{"alpha": 1e-6, "beta": 0}, {"max_bytes": 1e3, "alpha": 1, "beta": 0}]),
     r"pieces\[1\] \(max_bytes 1000\) comes after a piece that has no max_bytes"),
    (lambda t: t["links"]["intra_host"].update(pieces=[{"max_byte": 1e3, "alpha": 1.0, "beta": 0}, {"alpha": 0, "beta": 0}]),
     r"pieces\[0\]: 'max_byte' is not a field of a link \(did you mean 'max_bytes'\?\)"),
    (lambda t: t["links"]["inter_host"].update(per_operands=True), r"'per_operands' is not a field of a link"),
    # Finite but overflowing figures: the table printed inf and nan-inf step times and ranked by them.
    (lambda t: t["links"]["intra_host"].update(alpha=1e308), r"(?s)'alpha' is 1e\+308, not a finite number in \[0, 1e\+30\]"),
    (lambda t: t.update(memory_bandwidth=1e-300), r"'memory_bandwidth' is 1e-300, not a finite number in \[1e-30"),
    # A "bf16" rate was never looked up: bf16 steps priced at the float32 rate.
    (lambda t: t["peak_flops"].update(float33=1e12), r"peak_flops has the key 'float33', which is no dtype name"),
    (lambda t: t["peak_flops"].update(bf16=1e15), r"peak_flops gives bfloat16 twice"),
    # Falsy but no list: read as "no pieces" without a word.
    (lambda t: t["links"]["intra_host"].update(pieces={}), r"links.intra_host.pieces is \{\}, not a list"),
    (lambda t: t["links"]["intra_host"].update(pieces=0), r"links.intra_host.pieces is 0, not a list"),
    # A non-ASCII digit ended in a raw ValueError from int().
    (lambda t: t.update(collective_sync_ops={"\u00b2": 1.0}), r"collective_sync_ops has the key '\u00b2', not a group size"),
])
def test_a_target_file_broken_by_hand_is_named(change, words):
    with pytest.raises(TargetError, match=words):
        from_json(_h100(change))


@pytest.mark.parametrize("change, words", [
    (lambda t: t["peak_flops"].update(float32=67), r"'float32' is 67 FLOP/s, below 1e\+06.*67e12 for 67 TFLOPS"),
    (lambda t: t["links"]["intra_host"].update(alpha=5), r"'alpha' is 5 seconds, above 1.*5e-6 for 5 us"),
    (lambda t: t["links"]["inter_host"].update(beta=50), r"inter_host: 'beta' is 50 seconds per byte, above 1e-06"),
    (lambda t: t.update(memory_bandwidth=3.35), r"'memory_bandwidth' is 3.35 bytes/s"),
    (lambda t: t.update(memory_per_device=80), r"'memory_per_device' is 80 bytes, below 1e\+06.*80e9 for 80 GB"),
    (lambda t: t.update(op_overhead=5), r"'op_overhead' is 5 seconds, above 0.01.*5e-6 for 5 us"),
])
def test_a_target_figure_in_another_unit_is_named_with_the_unit(change, words):
    # A datasheet's figure in its own unit loaded: "peak_flops": {"float32": 67} priced every
    # step at 611 s, "alpha": 5 every collective at 5 s, without a word.
    with pytest.raises(TargetError, match=f"(?s){words}"):
        from_json(_h100(change))


def test_a_target_file_peak_flops_alias_is_the_dtype():
    target = from_json(_h100(lambda t: t.update(peak_flops={"fp32": 67e12, "bf16": 989e12})))
    assert target.peak_flops == {"float32": 67e12, "bfloat16": 989e12}
    assert target.flops_for("bfloat16") == 989e12


def test_bad_target_file_is_named(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"format": "spmdkit-target", "version": 1, "devices_per_host": 8,
                               "peak_flops": {"float32": -1}, "memory_bandwidth": 1e12,
                               "links": {"intra_host": {"alpha": 1e-6, "beta": 1e-12}}}))
    with pytest.raises(TargetError, match="peak_flops"):
        load_target(bad)
    with pytest.raises(ValueError, match="neither a file nor a known target"):
        load_target(tmp_path / "missing.json")


_GOOD = {"format": "spmdkit-target", "version": 1, "devices_per_host": 8, "peak_flops": {"float32": 1e12},
         "memory_bandwidth": 1e11, "links": {"intra_host": {"alpha": 1e-5, "beta": 1e-9}}}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1e-3])
@pytest.mark.parametrize("field,example", [
    (("links", "intra_host", "beta"), "2e-12"), (("links", "intra_host", "alpha"), "5e-6"),
    (("collectives", "all_reduce", "intra_host", "beta"), "2e-12"), (("memory_bandwidth",), "2e12"),
    (("peak_flops", "float32"), "67e12"), (("op_overhead",), "5e-6"), (("memory_per_device",), "80e9")])
def test_target_number_not_finite_or_negative_is_named_with_a_sensible_value(tmp_path, field, value, example):
    data = json.loads(json.dumps(_GOOD))
    data["collectives"] = {"all_reduce": {"intra_host": {"alpha": 1e-5, "beta": 1e-9}}}
    node = data
    for key in field[:-1]:
        node = node.setdefault(key, {})
    node[field[-1]] = value
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))  # NaN / Infinity as Python's json writes them
    with pytest.raises(TargetError, match=f"{field[-1]}.*not a finite number") as err:
        load_target(path)
    assert isinstance(err.value, ValueError) and f"{field[-1]}\": {example}" in str(err.value)


def test_target_file_without_collective_sync_ops_loads_and_prices_no_wait(tmp_path):
    old = {"format": "spmdkit-target", "version": 1, "devices_per_host": 8, "peak_flops": {"float32": 1e12},
           "memory_bandwidth": 1e11, "links": {"intra_host": {"alpha": 1e-5, "beta": 1e-9}}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    t = load_target(path)
    assert t.collective_sync_ops == {} and t.sync_ops_for(8) == 0.0 and "collective_sync_ops" not in t.to_json()
    with_sync = dict(old, collective_sync_ops={"2": 1.0, "8": 7.0})
    t2 = from_json(with_sync)
    assert t2.collective_sync_ops == {2: 1.0, 8: 7.0}
    assert t2.sync_ops_for(1) == 0.0 and t2.sync_ops_for(4) == pytest.approx(3.0)  # linear in n - 1 between 2 and 8
    assert from_json(json.loads(json.dumps(t2.to_json()))) == t2  # the file format round-trips
    for bad in ({"1": 1.0}, {"eight": 1.0}, {"8": -1.0}, [1.0]):
        with pytest.raises(TargetError, match="collective_sync_ops"):
            from_json(dict(old, collective_sync_ops=bad))


def test_per_operand_link_pays_alpha_per_operand_and_round_trips(tmp_path):
    """A link whose runtime runs a combined collective as one call per operand (gloo between
    processes) pays alpha per operand; bytes on the wire are the same either way."""
    once = Target("t", "test", 4, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 1e-9)})
    per = Target("t", "test", 4, {"float32": 1e12}, 1e11,
                 {"intra_host": Link(1e-5, 1e-9, per_operand=True),
                  "inter_host": Link(1e-4, 1e-8, pieces=((2048.0, Link(2e-4, 0.0)), (None, Link(1e-4, 1e-8))),
                                     per_operand=True)})
    n, b = 4, 1000.0
    assert collective_time(once, "all_reduce", b, n, "intra_host", operands=16) == pytest.approx(
        collective_time(once, "all_reduce", b, n, "intra_host"))  # alpha once: as before
    assert collective_time(per, "all_reduce", b, n, "intra_host", operands=16) == pytest.approx(
        16 * 6 * 1e-5 + 1.5 * b * 1e-9)
    assert collective_time(per, "all_gather", b, n, "inter_host", operands=3) == pytest.approx(3 * 3 * 2e-4)  # piece
    assert from_json(json.loads(json.dumps(per.to_json()))) == per  # the file format round-trips
    assert per.to_json()["links"]["intra_host"]["per_operand"] is True
    assert "per_operand" not in once.to_json()["links"]["intra_host"]  # files without it read as before
    data = once.to_json()
    data["links"]["intra_host"]["per_operand"] = "yes"
    with pytest.raises(TargetError, match="per_operand"):
        from_json(data)


def test_link_groups_price_their_group_size_and_round_trip():
    """A link measured over a group of 2 (a pair of one process's devices, which the ring's step
    count prices at a third of the whole process's group) prices groups of 2; other sizes scale
    from the link itself; the file format keeps it and refuses a bad one by its path."""
    pair = Link(3e-4, 2e-9, per_operand=True)
    t = Target("t", "test", 4, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-4, 1e-9, per_operand=True,
                                                                            groups=((2, pair),))})
    plain = Target("t", "test", 4, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-4, 1e-9, per_operand=True)})
    b = 1000.0
    assert collective_time(t, "all_reduce", b, 2, "intra_host") == pytest.approx(2 * 3e-4 + b * 2e-9)
    assert collective_time(t, "all_reduce", b, 2, "intra_host", operands=3) == pytest.approx(3 * 2 * 3e-4 + b * 2e-9)
    assert collective_time(t, "all_gather", b, 4, "intra_host") == collective_time(plain, "all_gather", b, 4, "intra_host")
    data = json.loads(json.dumps(t.to_json()))
    assert data["links"]["intra_host"]["groups"] == {"2": {"alpha": 3e-4, "beta": 2e-9}}  # per_operand: the link's
    assert from_json(data) == t and "groups" not in plain.to_json()["links"]["intra_host"]
    for bad, words in (({"1": {"alpha": 1e-4, "beta": 0.0}}, "not a group size >= 2"),
                       ({"two": {"alpha": 1e-4, "beta": 0.0}}, "not a group size >= 2"),
                       ([1e-4], "not an object"),
                       ({"2": {"alpha": 1e-4, "beta": 0.0, "groups": {}}}, "has groups of its own"),
                       ({"2": {"alpha": -1.0, "beta": 0.0}}, r"groups\['2'\]")):
        data["links"]["intra_host"]["groups"] = bad
        with pytest.raises(TargetError, match=words):
            from_json(data)
    for bad, words in (({"2": {"alpha": 1e-4, "beta": 0.0}, "02": {"alpha": 2e-4, "beta": 0.0}}, "size 2 twice"),
                       ({"\u00b2": {"alpha": 1e-4, "beta": 0.0}}, "not a group size"),  # '2' superscript: isdigit()
                       ({"2": {"alpha": 1e-4, "beta": 0.0, "per_operand": True}}, "group pays alpha as its link")):
        data["links"]["intra_host"]["groups"] = bad
        with pytest.raises(TargetError, match=words):
            from_json(data)
    data["links"]["intra_host"] = {"alpha": 1e-4, "beta": 0.0, "pieces": [{"alpha": 1e-4, "beta": 0.0, "groups": {}}]}
    with pytest.raises(TargetError, match="pieces.0. has groups"):
        from_json(data)
    # Like alpha and beta, a kind's own entry replaces the link whole: a kind whose sub-group
    # added nothing measurable at plan start keeps its ring price, not another kind's group.
    kinds = Target("t", "test", 4, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-4, 1e-9, groups={2: Link(3e-4, 2e-9)})},
                   collectives={"all_gather": {"intra_host": Link(2e-4, 0.0)},
                                "all_reduce": {"intra_host": Link(2e-4, 0.0, groups={2: Link(5e-4, 0.0)})}})
    assert collective_time(kinds, "all_gather", b, 2, "intra_host") == pytest.approx(2e-4)
    assert collective_time(kinds, "all_reduce", b, 2, "intra_host") == pytest.approx(2 * 5e-4)
    assert collective_time(kinds, "reduce_scatter", b, 2, "intra_host") == pytest.approx(3e-4 + 0.5 * b * 2e-9)


def test_link_groups_from_python_are_checked():
    """A Target built in Python: a group given as {"2": link} was priced without it (and its file
    with it); sizes and links are checked, NumPy and float sizes taken as whole numbers."""
    g = Link(3e-4, 0.0)
    assert Link(1e-5, 0.0, groups={np.int64(2): g, 4.0: g}).groups == ((2, g), (4, g))
    assert Link(1e-5, 0.0, groups=None).groups == () and Link(1e-5, 0.0, groups=[[2, g]]).groups == ((2, g),)
    assert Link(1e-5, 0.0, per_operand=True, groups={2: g}).groups[0][1].per_operand  # the link's
    both = Link(1e-5, 0.0, per_operand=True, groups={2: g})
    assert not dataclasses.replace(both, per_operand=False).groups[0][1].per_operand  # carried along
    for bad, words in (({"2": g}, "not a group size"), ({1: g}, "not a group size"), ((2, g), "not .group size, Link"),
                       (5, "not .group size, Link"), ({2: Link(1e-4, 0.0, groups={2: g})}, "without groups"),
                       (((2, g), (2.0, g)), "given twice")):
        with pytest.raises(TargetError, match=words):
            Link(1e-5, 0.0, groups=bad)


def test_operand_cost_is_paired_round_by_round():
    """Each round's 8-array all-reduce against its own one-array call: a slow spell of the
    one-array case in some rounds does not read as a cost per operand."""
    from spmdkit._plan._processes import LINK_OPERANDS, _operand_ratio

    one = [1e-3, 1e-3, 1e-3, 3e-3, 3e-3]  # a 3x slow spell from round 3 on, which the 8 arrays met first
    many = [1.1e-3, 1.1e-3, 3.3e-3, 3.3e-3, 3.3e-3]  # +10% in every round but that one
    assert _operand_ratio(one, many) == pytest.approx(0.1 / (LINK_OPERANDS - 1))  # medians apart would say 0.33
    per = [o * (1 + 0.8 * (LINK_OPERANDS - 1)) for o in one]
    assert _operand_ratio(one, per) == pytest.approx(0.8)


def test_a_subgroup_measured_at_nothing_keeps_the_ring_price():
    """The between-computation figures are differences of noisy times: a group whose collective
    added nothing at the small payload gets no link of its own, and a large payload that cost no
    more takes the whole group's beta (no wire is free)."""
    from spmdkit._plan._processes import LINK_SIZES, _subgroup_link

    small, large = LINK_SIZES
    whole = Link(6e-4, 2e-9)
    seen = lambda a, b, c, d: {("sub", 2, "all_reduce", small): a, ("sub", 2, None, small): b,  # noqa: E731
                               ("sub", 2, "all_reduce", large): c, ("sub", 2, None, large): d}
    assert _subgroup_link(seen(1e-3, 1e-3, 5e-3, 1e-3), "all_reduce", 2, whole) is None
    flat = _subgroup_link(seen(4e-3, 1e-3, 3e-3, 1e-3), "all_reduce", 2, whole)
    assert flat.alpha == pytest.approx(3e-3 / 2) and flat.beta == whole.beta
    fit = _subgroup_link(seen(4e-3, 1e-3, 6e-3, 1e-3), "all_reduce", 2, whole)
    assert fit.beta == pytest.approx(2e-3 / (large - small))


def test_a_group_priced_by_its_own_link_adds_no_wait():
    """A group's own link is timed between computation, its waits in it: collective_sync_ops is
    added to the other group sizes only."""
    from spmdkit._plan._cost import collective_costs
    from spmdkit._plan._hlo import Collective, Program

    t = Target("t", "test", 4, {"float32": 1e12}, 1e11,
               {"intra_host": Link(1e-4, 1e-9, groups=((2, Link(3e-4, 2e-9)),))}, collective_sync_ops={2: 5.0, 4: 5.0})
    pair = Collective("all_reduce", 1000, 2, ("model",), 3, ((0, 1), (2, 3)), "ar.1")
    whole = Collective("all_reduce", 1000, 4, ("model",), 1, ((0, 1, 2, 3),), "ar.2")
    a, b = collective_costs(Program([pair, whole], 0.0, 0.0, 0.0, 0), t, 4, op_seconds=1e-3)
    assert a["sync_seconds"] == 0 and a["seconds"] == pytest.approx(3 * (2 * 3e-4 + 1000 * 2e-9))
    assert b["sync_seconds"] == pytest.approx(5e-3) and b["seconds"] == pytest.approx(6e-4 + 1500e-9 + 5e-3)


def test_combined_all_reduce_counts_its_operands_and_is_priced_per_operand():
    from spmdkit._plan._cost import collective_costs

    mesh = spmdkit.make_mesh(data=8)
    f = jax.jit(jax.shard_map(lambda *xs: tuple(jax.lax.psum(list(xs), "data")), mesh=mesh,
                              in_specs=(P("data"),) * 3, out_specs=(P(),) * 3, check_vma=False))
    xs = [jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, P("data")))] * 3
    program = analyse(f.lower(*xs).compile().as_text(), dict(mesh.shape))
    (ar,) = program.collectives
    assert (ar.kind, ar.operands, ar.bytes) == ("all_reduce", 3, 3 * 8 * 4)  # one all-reduce of 3 arrays
    once = Target("t", "test", 8, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 0.0)})
    per = Target("t", "test", 8, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 0.0, per_operand=True)})
    (a,), (b,) = collective_costs(program, once, 8), collective_costs(program, per, 8)
    assert a["operands"] == 3 and a["seconds"] == pytest.approx(14 * 1e-5) and b["seconds"] == pytest.approx(3 * 14e-5)


def test_process_links_are_measured_only_over_processes():
    from spmdkit._plan._processes import agreed_target, with_process_links

    t = Target("t", "test", 8, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 1e-9)})
    assert with_process_links(t) is t and agreed_target("cpu") == "cpu"  # a lone process: as given


def test_plan_over_processes_without_running_them_says_which_links_are_guesses():
    from spmdkit._plan._processes import links_note

    make_state = lambda rng: {"w": jnp.zeros((16, 32))}  # noqa: E731
    step = lambda s, b: ({"w": s["w"] - 0.1 * b["x"].T @ (b["x"] @ s["w"])}, {})  # noqa: E731
    result = spmdkit.plan(make_state, step, {"x": jnp.ones((16, 16))}, rules=("dp",), target="h100x8", processes=2)
    assert "not measured in a multi-process program" in result["target"]["links_note"]
    assert "inter_host is a fixed guess" in links_note("cpu", "measured at plan time")
    assert links_note("cpu", "x; links measured at plan start in this 2-process program").startswith("measured")
    assert "links_note" not in spmdkit.plan(make_state, step, {"x": jnp.ones((16, 16))}, rules=("dp",),
                                            target="h100x8")["target"]  # one process: nothing to say


# ---------------------------------------------------------------- HLO
def test_psum_over_one_axis_is_one_all_reduce_over_that_axis():
    mesh = spmdkit.make_mesh(data=2, model=4)
    f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "model"), mesh=mesh, in_specs=P("data", "model"),
                              out_specs=P("data")))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    program = analyse(f.lower(x).compile().as_text(), dict(mesh.shape))
    (c,) = program.collectives
    assert (c.kind, c.axes, c.group_size, c.count, c.bytes) == ("all_reduce", ("model",), 4, 1, 4 * 16 * 4)


def test_collectives_in_a_loop_are_counted_per_trip():
    mesh = spmdkit.make_mesh(data=2, model=4)

    def body(a):
        return jax.lax.fori_loop(0, 5, lambda i, v: jax.lax.psum(v, "data") * 0.5, a)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "model"), out_specs=P(None, "model"), check_vma=False))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    program = analyse(f.lower(x).compile().as_text(), dict(mesh.shape))
    assert [(c.kind, c.axes, c.count) for c in program.collectives] == [("all_reduce", ("data",), 5)]


@pytest.mark.parametrize("mesh, chosen, groups", [
    ("'data'=2,'model'=4", "'model'", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("'data'=2,'model'=4", "'data'", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("'data'=2,'model'=4", "", [[i] for i in range(8)]),
    ("'data'=8", "'data':(1)2", [[0, 4], [1, 5], [2, 6], [3, 7]]),  # the major factor of 2
    ("'data'=8", "'data':(2)4", [[0, 1, 2, 3], [4, 5, 6, 7]]),  # the minor factor of 4
    ("'data'=8", "'data':(2)2", [[0, 2], [1, 3], [4, 6], [5, 7]]),  # the middle one
    ("'data'=4,'model'=2", "'data':(1)2, 'model'", [[0, 1, 4, 5], [2, 3, 6, 7]]),
])
def test_replica_groups_over_mesh_axes_and_sub_axes_are_read(mesh, chosen, groups):
    # A sub-axis ('data':(1)2, as a step that reshapes its batch into micro-batches splits the batch's
    # axis) crashed the whole plan with "ValueError: '1' is not in list".
    from spmdkit._plan._hlo import groups_of

    assert groups_of(f"replica_groups=mesh[{mesh}] {{{chosen}}}, dimensions={{0}}", 8) == groups


def test_a_step_that_splits_its_batch_into_micro_batches_plans_under_fsdp():
    # Found by a user's step (gradient accumulation by reshape and scan): the gather over the major
    # factor of the batch's axis is a sub-axis in the HLO, which the reader did not know.
    def make_state(rng):
        return {"w": jnp.zeros((64, 64))}

    def step(s, b):
        def body(g, x):
            return g + jax.grad(lambda w: jnp.mean((x @ w) ** 2))(s["w"]), None

        g = jax.lax.scan(body, jnp.zeros_like(s["w"]), b["x"].reshape(2, -1, 64))[0]
        return {"w": s["w"] - 0.1 * g}, {}

    result = spmdkit.plan(make_state, step, {"x": np.ones((32, 64), np.float32)}, rules=("fsdp",), target="h100x8",
                          state_axes={"w": ("embed", "hidden")})
    (row,) = result["candidates"]
    assert row["status"] == "ok" and row["step_s"] > 0
    # over sub-axes of data: the micro-batches' factor of 2 and the factor of 4 within each
    assert {(c["kind"], tuple(c["axes"])) for c in row["collectives"]} >= {("all_gather", ("data",))}
    assert {c["group_size"] for c in row["collectives"]} == {2, 4}


def test_link_is_inter_host_when_a_group_spans_processes():
    from spmdkit._plan._cost import link_of
    from spmdkit._plan._hlo import Collective

    over_data = Collective("all_reduce", 64, 2, ("data",), 1, ((0, 4), (1, 5), (2, 6), (3, 7)), "ar")
    over_model = Collective("all_reduce", 64, 4, ("model",), 1, ((0, 1, 2, 3), (4, 5, 6, 7)), "ar")
    assert link_of(over_data, 8) == link_of(over_model, 8) == "intra_host"  # one process
    assert (link_of(over_data, 4), link_of(over_model, 4)) == ("inter_host", "intra_host")  # 2 processes x 4


# ---------------------------------------------------------------- cost model
def _sync_target(sync_ops: dict[int, float]) -> Target:
    return Target("t", "test", 8, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 1e-9)},
                  collective_sync_ops=sync_ops)


def _gather_loop(trips: int):
    """A tiny all-gather over 'data' after a matmul, ``trips`` times in a loop, as HLO analysed."""
    mesh = spmdkit.make_mesh(data=8)

    def body(a, w):
        def trip(i, v):
            return v @ w + jax.lax.all_gather(v[:1], "data", tiled=True).mean(0)

        return jax.lax.fori_loop(0, trips, trip, a)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False))
    x = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
    return analyse(f.lower(x, w).compile().as_text(), dict(mesh.shape))


def test_collective_wait_priced_per_execution_including_loop_trips():
    from spmdkit._plan._cost import collective_costs, step_time

    target, plain = _sync_target({2: 1.0, 8: 7.0}), _sync_target({})
    op_s = 1e-4  # the step's mean seconds per operation
    priced = {}
    for trips in (1, 10):
        program = _gather_loop(trips)
        (gather,) = [c for c in program.collectives if c.kind == "all_gather"]
        assert gather.count == trips and gather.group_size == 8
        with_sync, without = collective_costs(program, target, 8, op_s), collective_costs(program, plain, 8, op_s)
        row = next(c for c in with_sync if c["kind"] == "all_gather")
        assert row["sync_seconds"] == pytest.approx(trips * 7 * op_s)  # count x 7 operation times (a group of 8)
        assert row["seconds"] == pytest.approx(next(c for c in without if c["kind"] == "all_gather")["seconds"]
                                               + trips * 7 * op_s)
        comm, sync = sum(c["seconds"] for c in with_sync), sum(c["sync_seconds"] for c in with_sync)
        priced[trips] = step_time(1e6, 1e6, comm, target, "float32", program.ops, sync)
    # Ten waits cost more than one by nine waits at least, whatever else the loop adds.
    assert priced[10]["step_s"] - priced[1]["step_s"] >= 9 * 7 * op_s
    assert priced[10]["sync_s"] == pytest.approx(10 * 7 * op_s)
    # A group of 4 (between the measured 2 and 8) waits 3 operation times; without a figure, none.
    assert target.sync_ops_for(4) == pytest.approx(3.0) and all(c["sync_seconds"] == 0 for c in without)


def test_only_parameter_gathers_overlap_compute():
    from spmdkit._plan._cost import step_time

    t = _sync_target({8: 5.0})
    # compute 10 ms (1e10 FLOPs at 1e12 FLOP/s); collectives 2 ms, of which 1 ms waits
    s = step_time(1e10, 0.0, 2e-3, t, "float32", 0, 1e-3)
    assert s["compute_s"] == pytest.approx(1e-2)
    # an activation's all-reduce or the gradients' reduction takes what computation made: no overlap
    assert s["step_s_overlapped"] == s["step_s_serial"] == pytest.approx(1.2e-2)
    # FSDP's parameter gathers need nothing the step computes: they (and their waits) hide under compute
    s = step_time(1e10, 0.0, 2e-3, t, "float32", 0, 1e-3, prefetched_seconds=1.5e-3)
    assert s["step_s_overlapped"] == pytest.approx(1.05e-2) and s["step_s_serial"] == pytest.approx(1.2e-2)
    # more to gather than to compute: the gathers set the pace
    s = step_time(1e9, 0.0, 2e-3, t, "float32", 0, 0.0, prefetched_seconds=2e-3)
    assert s["step_s_overlapped"] == pytest.approx(2e-3) and s["step_s_serial"] == pytest.approx(3e-3)


def test_fsdp_parameter_gathers_are_marked_prefetched():
    from spmdkit._plan._cost import collective_costs
    from spmdkit._plan._hlo import Collective, Program

    gather = Collective("all_gather", 4096, 8, ("data",), 3, (tuple(range(8)),), "ag")
    reduce = Collective("all_reduce", 4096, 8, ("data",), 1, (tuple(range(8)),), "ar")
    model = Collective("all_gather", 4096, 8, ("model",), 1, (tuple(range(8)),), "sp")
    logits = Collective("all_gather", 2048, 8, ("data",), 1, (tuple(range(8)),), "contrastive")
    t = _sync_target({8: 5.0})
    program = Program([gather, reduce, model, logits], 0.0, 0.0, 0.0, 0)
    got = collective_costs(program, t, 8, 1e-4, ("data",), {4096})
    # a parameter's gather; a reduction; a gather over another axis; a gather of something the step computed
    assert [c["prefetched"] for c in got] == [True, False, False, False]
    assert not any(c["prefetched"] for c in collective_costs(program, t, 8, 1e-4, ("data",), set()))


def test_a_contrastive_loss_gathering_its_logits_under_dp_gathers_no_parameter():
    """Under dp no parameter is split over the batch's axes: nothing is a parameter gather."""
    from spmdkit._plan import plan

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16)(x)

    def make_state(rng):
        return {"params": Net().init(rng, jnp.zeros((1, 8)))["params"]}

    def step(state, batch):
        def loss(params):
            out = Net().apply({"params": params}, batch["x"])
            return jax.nn.logsumexp(out @ out.T, axis=1).mean()  # every row against every row: a gather over data

        grads = jax.grad(loss)(state["params"])
        return {"params": jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)}, {}

    batch = {"x": np.ones((32, 8), np.float32)}
    result = plan(make_state, step, batch, rules=("dp",), target="h100x8")
    ok = [r for r in result["candidates"] if r["status"] == "ok"]
    gathers = [c for r in ok for c in r["collectives"] if c["kind"] == "all_gather"]
    assert gathers and not any(c["prefetched"] for c in gathers)
    assert all(r["prefetched_s"] == 0 for r in ok)


def test_compute_priced_per_operation_memory_bound_ones_add_to_matmuls():
    from spmdkit._plan._cost import compute_time, step_time

    t = Target("t", "test", 8, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 1e-9)}, op_overhead=1e-6)
    # a matmul of 10 ms (compute-bound) and an elementwise op of 10 ms (memory-bound), three times
    ops = [Kernel(1e10, 10**6, 1), Kernel(0.0, 10**9, 3)]
    assert compute_time(1e10, 3.001e9, t, "float32", 4, ops) == pytest.approx(1e-2 + 3e-2 + 4e-6)
    # one roofline over the totals hid the memory-bound time under the matmul's (or the other way)
    assert compute_time(1e10, 3.001e9, t, "float32", 4) == pytest.approx(3.001e-2 + 4e-6)
    assert step_time(1e10, 3.001e9, 0.0, t, "float32", 4, 0.0, ops)["compute_s"] == pytest.approx(4.0004e-2)


def test_warm_bytes_are_priced_by_the_cache_curve_cold_ones_and_matmuls_at_memory_bandwidth():
    from spmdkit._plan._cost import compute_time

    curve = ((2**15, 8e11), (2**25, 2e11))  # 32 KiB: 8x memory's rate; 32 MiB: 2x
    t = Target("t", "test", 8, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 1e-9)}, cache_bandwidth=curve)
    plain = dataclasses.replace(t, cache_bandwidth=())
    small, large = Kernel(0.0, 2**15, 1), Kernel(0.0, 2**25, 1)
    assert compute_time(0, 0, t, "float32", 0, [small]) == pytest.approx(2**15 / 8e11)
    assert compute_time(0, 0, t, "float32", 0, [large]) == pytest.approx(2**25 / 2e11)
    assert compute_time(0, 0, plain, "float32", 0, [small]) == pytest.approx(2**15 / 1e11)  # no curve: memory's rate
    # half of it the step's state: that half at memory bandwidth, the other from the cache
    half = Kernel(0.0, 2**25, 1, cold=2**24)
    assert compute_time(0, 0, t, "float32", 0, [half]) == pytest.approx(2**24 / 1e11 + 2**24 / 2e11)
    # a matmul's roofline keeps memory bandwidth, warm or not
    mm = Kernel(1e3, 2**25, 1)
    assert compute_time(0, 0, t, "float32", 0, [mm]) == pytest.approx(2**25 / 1e11)


def test_cache_curve_goes_through_a_target_file_and_a_bad_one_names_the_fix():
    t = Target("t", "test", 8, {"float32": 1e12}, 1e9, {"intra_host": Link(1e-5, 1e-9)},
               cache_bandwidth=((32768.0, 8e9), (33554432.0, 2e9)))
    back = from_json(json.loads(json.dumps(t.to_json())))
    assert back.cache_bandwidth == t.cache_bandwidth
    assert back.bandwidth_for(2**20) == pytest.approx(t.bandwidth_for(2**20)) and 2e9 < back.bandwidth_for(2**20) < 8e9
    bad = {**t.to_json(), "cache_bandwidth": [[32768, -1]]}
    with pytest.raises(TargetError, match=r"(?s)cache_bandwidth\[0\] is \[32768, -1\].*Fix: write \[bytes, bytes/s\] pairs"):
        from_json(bad)
    # JSON's Infinity and a number past float's range are no rates; a size given twice is ambiguous
    for entry, shown in (([[32768, float("inf")]], r"cache_bandwidth\[0\] is \[32768, inf\]"),
                         ([[1024, 8e9], [1e400, 2e9]], r"cache_bandwidth\[1\] is \[inf, 2000000000.0\]"),
                         ([[1024, 8e9], [1024, 2e9]], r"gives the size 1024 bytes more than once")):
        with pytest.raises(TargetError, match=r"(?s)" + shown + r".*Fix: write \[bytes, bytes/s\] pairs of finite"):
            from_json({**t.to_json(), "cache_bandwidth": entry})
    assert from_json({**t.to_json(), "cache_bandwidth": []}).cache_bandwidth == ()
    with pytest.raises(TargetError, match=r"cache_bandwidth\[0\] is \[1000"):  # a 400-digit size: no OverflowError
        from_json({**t.to_json(), "cache_bandwidth": [[10**400, 8e9]]})
    with pytest.raises(TargetError, match=r"'memory_bandwidth' is 1000.*not a finite number"):
        from_json({**t.to_json(), "memory_bandwidth": 10**400})


def test_warm_data_never_costs_more_than_memory_bandwidth():
    # a curve timed on a read and a write can end below a streaming read's rate
    t = Target("t", "test", 8, {"float32": 1e12}, 3e9, {}, cache_bandwidth=((2**15, 8e9), (2**25, 2e9)))
    assert t.bandwidth_for(2**15) == 8e9
    assert t.bandwidth_for(2**25) == t.bandwidth_for(2**30) == 3e9
    assert 3e9 <= t.bandwidth_for(2**22) < 8e9


def test_optimizer_updates_read_and_write_their_arrays_and_a_scan_write_only_its_slice():
    from spmdkit._plan._hlo import kernels

    def update(mu, g, stack, row):  # Adam's first moment, and a scan's write of one layer's row
        return mu * 0.9 + g * 0.1, jax.lax.dynamic_update_slice(stack, row, (3, 0))

    mu = jnp.ones((256, 256), jnp.float32)
    stack, row = jnp.ones((16, 4096), jnp.float32), jnp.ones((1, 4096), jnp.float32)
    text = jax.jit(update, donate_argnums=(2,)).lower(mu, mu, stack, row).compile().as_text()
    found = sorted(kernels(text), key=lambda k: -k.bytes)
    assert len(found) == 2, found
    moment, write = found
    # the moment: two arrays read and one written, all of them the step's inputs and outputs
    # (an output of an operand's type is not an update in place: it once priced this at 0 bytes)
    assert moment.bytes == moment.cold == 3 * mu.nbytes
    # the scan's write: its row (and the two offsets) read and written, not the whole stack
    assert write.bytes == 2 * (row.nbytes + 2 * 4)


def test_an_update_of_a_computed_buffer_writes_all_of_it():
    from spmdkit._plan._hlo import kernels

    a, row = jnp.ones((256, 256), jnp.float32), jnp.ones((1, 256), jnp.float32)
    fresh = jax.jit(lambda x, r: jax.lax.dynamic_update_slice(x * 2, r, (3, 0))).lower(a, row).compile().as_text()
    # (x * 2).at[3].set(r): x read, a whole new array written (once priced as the row alone)
    assert sum(k.bytes * k.count for k in kernels(fresh)) >= 2 * a.nbytes
    donated = jax.jit(lambda x, r: jax.lax.dynamic_update_slice(x, r, (3, 0)), donate_argnums=(0,))
    assert sum(k.bytes * k.count for k in kernels(donated.lower(a, row).compile().as_text())) < 4 * row.nbytes


_MULTI_OUTPUT = """
HloModule m

%fused_update (param_0: f32[1024], param_1: f32[1024]) -> (f32[1024], f32[1024]) {
  %param_0 = f32[1024]{0} parameter(0)
  %param_1 = f32[1024]{0} parameter(1)
  %add.0 = f32[1024]{0} add(%param_0, %param_1)
  %mul.0 = f32[1024]{0} multiply(%param_0, %param_1)
  ROOT %tuple.0 = (f32[1024]{0}, f32[1024]{0}) tuple(%add.0, %mul.0)
}

%fused_other (param_0.1: f32[1024]) -> f32[1024] {
  %param_0.1 = f32[1024]{0} parameter(0)
  ROOT %neg.0 = f32[1024]{0} negate(%param_0.1)
}

ENTRY %main (p: f32[1024], g: f32[1024]) -> (f32[1024], f32[1024], f32[32,32]) {
  %p = f32[1024]{0} parameter(0)
  %g = f32[1024]{0} parameter(1)
  %fusion.1 = (f32[1024]{0}, f32[1024]{0}) fusion(%p, %g), kind=kLoop, calls=%fused_update
  %gte.0 = f32[1024]{0} get-tuple-element(%fusion.1), index=0
  %gte.1 = f32[1024]{0} get-tuple-element(%fusion.1), index=1
  %fusion.2 = f32[1024]{0} fusion(%gte.0), kind=kLoop, calls=%fused_other
  %bitcast.9 = f32[32,32]{1,0} bitcast(%fusion.2)
  ROOT %tuple.1 = (f32[1024]{0}, f32[1024]{0}, f32[32,32]{1,0}) tuple(%gte.0, %gte.1, %bitcast.9)
}
"""


_UPDATE_FROM_ITS_WHOLE_BUFFER = """
HloModule m
%fc (param_0: f32[1024,1024]) -> f32[1024,1024] {
  %param_0 = f32[1024,1024]{1,0} parameter(0)
  %zero = f32[] constant(0)
  %sum = f32[1,1024]{1,0} reduce(%param_0, %zero), dimensions={0}, to_apply=%add
  %i = s32[] constant(0)
  ROOT %dus = f32[1024,1024]{1,0} dynamic-update-slice(%param_0, %sum, %i, %i)
}
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
ENTRY %main (x: f32[1024,1024]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  ROOT %f = f32[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fc
}
"""


def test_an_update_computed_from_its_whole_buffer_reads_all_of_it():
    from spmdkit._plan._hlo import kernels

    # x.at[0].set(x.sum(0)) fused: the reduce reads all 4 MiB of the buffer it updates
    assert sum(k.bytes * k.count for k in kernels(_UPDATE_FROM_ITS_WHOLE_BUFFER)) >= 4 * 2**20


def test_outputs_reached_through_views_are_cold_writes():
    from spmdkit._plan._hlo import kernels

    found = sorted(kernels(_MULTI_OUTPUT), key=lambda k: -k.bytes)
    # the multi-output fusion reads the two inputs and writes two outputs (through
    # get-tuple-element): all cold; the negate reads a warm value and writes the third output
    # (through a bitcast): half cold
    assert [(k.bytes, k.cold) for k in found] == [(4 * 4096, 4 * 4096), (2 * 4096, 4096)]


def test_a_loop_reads_one_layer_of_a_stacked_array_and_a_called_loop_is_priced():
    from spmdkit._plan._hlo import analyse, kernels

    def scan_mm(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    x, ws = jnp.ones((64, 256), jnp.float32), jnp.ones((8, 256, 256), jnp.float32)
    found = kernels(jax.jit(scan_mm).lower(x, ws).compile().as_text())
    per_trip = [k for k in found if k.count == 8]
    # no operation of a trip moves the whole stack (2 MiB): its layer (256 KiB) is read
    assert per_trip and max(k.bytes for k in per_trip) < 3 * ws.nbytes // 8

    def scan2(c):  # XLA:CPU wraps this loop in a call(to_apply=...)
        return jax.lax.scan(lambda c, _: (jnp.sin(c), (c, c * 2)), c, None, length=8)

    text = jax.jit(scan2).lower(x).compile().as_text()
    assert sum(k.count for k in kernels(text)) >= 8 * 2 and analyse(text, {"data": 1}).ops >= 8 * 2


def test_convolutions_count_their_flops():
    from spmdkit._plan._hlo import analyse, kernels

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (2, 2), "VALID", feature_group_count=4,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    x, w = jnp.ones((8, 28, 28, 32), jnp.float32), jnp.ones((3, 3, 8, 64), jnp.float32)
    text = jax.jit(conv).lower(x, w).compile().as_text()
    expected = 2 * (8 * 13 * 13 * 64) * (3 * 3 * 8)  # every output: a 3x3 window of its group's 8 features
    assert sum(k.flops * k.count for k in kernels(text)) == pytest.approx(expected)
    assert analyse(text, {"data": 1}).dot_flops == pytest.approx(expected)


@pytest.mark.parametrize("name", ["same", "transposed", "rhs_dilated", "nchw", "gradient"])
def test_convolution_flops_count_only_window_positions_on_real_input(name):
    from spmdkit._plan._hlo import kernels

    nhwc = ("NHWC", "HWIO", "NHWC")
    x, w = jnp.ones((2, 16, 16, 8), jnp.float32), jnp.ones((3, 3, 8, 4), jnp.float32)
    convs = {
        "same": lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=nhwc),
        # a stride-2 transposed convolution dilates its input: 3 of 4 window positions hit holes
        "transposed": lambda x, w: jax.lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=nhwc),
        "rhs_dilated": lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", rhs_dilation=(2, 2),
                                                                 dimension_numbers=nhwc),
        "nchw": lambda x, w: jax.lax.conv_general_dilated(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), (1, 1),
                                                          ((1, 2), (0, 1))),
        "gradient": jax.grad(lambda x, w: jax.lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                                                       dimension_numbers=nhwc).sum(), argnums=(0, 1)),
    }
    compiled = jax.jit(convs[name]).lower(x, w).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ours = sum(k.flops * k.count for k in kernels(compiled.as_text()))
    # XLA's count adds an elementwise FLOP here and there (a transpose's, a sum's): within 3%
    assert ours > 0 and ours == pytest.approx(cost["flops"], rel=0.03)


def test_slices_read_their_part_and_a_loops_layer_read_is_cold():
    from spmdkit._plan._hlo import kernels

    h = jnp.ones((16, 1024, 128), jnp.float32)
    last = kernels(jax.jit(lambda h: h[:, -1] * 2).lower(h).compile().as_text())  # a transformer's last token
    assert sum(k.bytes * k.count for k in last) <= 4 * 16 * 128 * 4

    def scan_mm(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    x, ws = jnp.ones((64, 256), jnp.float32), jnp.ones((8, 256, 256), jnp.float32)
    found = kernels(jax.jit(scan_mm).lower(x, ws).compile().as_text())
    # the layer a trip reads comes from the step's input, not from the last operation's output
    assert sum(k.cold * k.count for k in found if k.count == 8) >= ws.nbytes


def test_a_recurrence_in_place_counts_its_read_of_the_buffer():
    from spmdkit._plan._hlo import kernels

    def recur(b):  # b[i + 1] = f(b[i]): one row read and one written per trip, not the whole buffer
        return jax.lax.fori_loop(0, 63, lambda i, b: b.at[i + 1].set(jnp.sin(b[i])), b)

    b = jnp.ones((64, 4096), jnp.float32)
    found = kernels(jax.jit(recur, donate_argnums=0).lower(b).compile().as_text())
    row = 4096 * 4
    # the update's fusion reads b[i] from the buffer it updates, and writes b[i + 1]: three rows
    update = max(k.bytes for k in found if k.count == 63)
    assert 3 * row <= update < 4 * row


def test_kernels_count_each_operation_with_loop_trips_and_leave_collectives_out():
    from spmdkit._plan._hlo import kernels

    mesh = spmdkit.make_mesh(data=8)
    trips = 5

    def body(a, w):
        def trip(i, v):
            return jnp.tanh(v @ w) + jax.lax.all_gather(v[:1], "data", tiled=True).mean(0)

        return jax.lax.fori_loop(0, trips, trip, a)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False))
    x = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
    text = f.lower(x, w).compile().as_text()
    found, program = kernels(text), analyse(text, dict(mesh.shape))
    # every trip's matmul (8 rows of 16 by 16 per device), counted once per trip
    assert sum(k.flops * k.count for k in found) == pytest.approx(trips * 2 * 8 * 16 * 16) == program.dot_flops
    assert any(k.flops == 0 and k.bytes > 0 for k in found)  # elementwise work: bytes, no matmul FLOPs
    collectives = sum(c.count for c in program.collectives)
    assert collectives >= trips and sum(k.count for k in found) == program.ops - collectives
    # inside the loop nothing is the step's input or output: no cold bytes there
    assert all(k.cold == 0 for k in found if k.count == trips)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_collectives_are_measured_over_a_device_count_that_does_not_divide_the_payload(kind):
    # --devices 7: the 1 MB payload (2**18 floats a device) split 7 ways lost elements, and the
    # measuring program failed to trace (a raw TypeError from inside `spmdkit plan`).
    from spmdkit._target import measure_collective

    link = measure_collective(kind, 7, loops=1)
    assert link is not None and link.alpha > 0 and link.beta >= 0


def test_cpu_target_measures_the_wait_at_a_collective_between_computation():
    from spmdkit._target import measure_collective_sync

    seen = measure_collective_sync(8, loops=2, rounds=1, rows=8, width=16)
    assert sorted(seen.extra) == [2, 4, 8] and all(s >= 0.0 for s in seen.extra.values()) and seen.op_seconds > 0
    assert measure_collective_sync(1).extra == {}


def test_cpu_target_in_one_process_prices_each_group_by_a_link_timed_between_computation(monkeypatch):
    """A loop of nothing but collectives priced an all-reduce over 2 of 8 devices at a fraction
    of what a step between computation paid: in a lone process the all-reduce and all-gather
    over every group size get links timed between computation, their waits in them (no
    collective_sync_ops on top); reduce-scatter, all-to-all and collective permute keep the
    loop's link and the wait. Over processes the planner measures its own links instead."""
    from spmdkit import _target
    from spmdkit._plan._cost import collective_costs
    from spmdkit._plan._hlo import Collective, Program

    loop = Link(1e-5, 1e-10)
    own = {"all_reduce": ((2, Link(4e-5, 5e-10)), (8, Link(2e-5, 3e-10))), "all_gather": ((4, Link(5e-5, 2e-10)),)}
    asked = []
    monkeypatch.setattr(_target, "measure_group_links", lambda n, loops: asked.append((n, loops)) or own)
    monkeypatch.setattr(_target, "measure_cpu", lambda: (1e11, 1e10))  # the rest as measured: only wiring here
    monkeypatch.setattr(_target, "measure_collective", lambda kind, n: loop)
    monkeypatch.setattr(_target, "measure_op_overhead", lambda n: 1e-6)
    monkeypatch.setattr(_target, "measure_cache_curve", lambda n, *a, **k: ((1e3, 1e10),))
    monkeypatch.setattr(_target, "measure_collective_sync",
                        lambda n: _target.SyncMeasurement({2: 1e-4, 4: 1e-4, 8: 1e-4}, 1e-4))
    t = _target.cpu_target(8)
    assert [(n, sorted(loops)) for n, loops in asked] == [(8, ["all_gather", "all_reduce"])]
    assert t.link("all_reduce", "intra_host").groups == own["all_reduce"]
    assert t.link("all_gather", "intra_host").groups == own["all_gather"]
    assert not t.link("reduce_scatter", "intra_host").groups and not t.links["intra_host"].groups
    assert "between computation" in t.source and "all_reduce 2: 4e-05, 5e-10, 8: 2e-05, 3e-10" in t.source
    again = from_json(t.to_json())  # a plan's target file, passed back with --target, prices the same
    assert again.link("all_reduce", "intra_host").groups == own["all_reduce"]
    pairs = [Collective(kind, 1000, 2, ("model",), 3, ((0, 1),), kind)
             for kind in ("all_reduce", "reduce_scatter", "all_to_all", "collective_permute")]
    priced = collective_costs(Program(pairs, 0.0, 0.0, 0.0, 0), t, 8, op_seconds=1e-3)
    wait = t.sync_ops_for(2) * 1e-3
    assert priced[0]["sync_seconds"] == 0 and priced[0]["seconds"] == pytest.approx(3 * (2 * 4e-5 + 1000 * 5e-10))
    assert wait > 0 and all(p["sync_seconds"] == pytest.approx(3 * wait) for p in priced[1:])
    # Over processes nothing is timed here: with_process_links measures the links as that program routes them.
    asked.clear()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert not _target.cpu_target(8).link("all_reduce", "intra_host").groups and not asked


def test_group_links_are_never_priced_below_the_loop(monkeypatch):
    """The figures are differences of noisy medians: a group whose collective added nothing at
    4 KiB keeps the loop's price and wait; one that added a nanosecond is priced at the loop's
    alpha and beta at least, not nearly free."""
    from spmdkit import _target

    loop = Link(1e-5, 1e-10)
    added = {2: (-1e-9, 1e-3), 4: (1e-9, 1e-9), 8: (3e-4, 9e-4)}  # seconds a trip, at 4 KiB and at 1 MiB
    monkeypatch.setattr(_target, "_between_case", lambda kind, devices, g, size: (kind, g, size))
    monkeypatch.setattr(_target, "_interleaved", lambda cases, rounds: {
        (g, kind, size): [1e-3 + (added[g][_target.LINK_SIZES.index(size)] if kind else 0.0)]
        for g, kind, size in cases})
    got = dict(_target.measure_group_links(8, {"all_reduce": loop})["all_reduce"])
    assert sorted(got) == [4, 8]  # the pair: nothing measurable, the ring's price and the wait stand
    assert (got[4].alpha, got[4].beta) == (loop.alpha, loop.beta)  # not 1e-9 / 6 steps
    steps, wire = _target.steps_and_wire("all_reduce", 8, _target.LINK_SIZES[1] - _target.LINK_SIZES[0])
    assert got[8].alpha == pytest.approx(3e-4 / steps) and got[8].beta == pytest.approx(6e-4 / wire)
    # A calibrated loop fit in pieces (a dearer large piece): the floor holds piece by piece, since the
    # group's link replaces the loop's at its size; a floor at the overall line priced 64 MiB at a quarter.
    pieced = Link(1e-5, 1e-10, pieces=((2**21, Link(1e-5, 1e-10)), (None, Link(1e-4, 4e-9))))
    got = dict(_target.measure_group_links(8, {"all_reduce": pieced})["all_reduce"])
    t = Target("t", "test", 8, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 1e-10)},
               collectives={"all_reduce": {"intra_host": dataclasses.replace(pieced, groups=tuple(got.items()))}})
    loop_only = dataclasses.replace(t, collectives={"all_reduce": {"intra_host": pieced}})
    for n in (4, 8):
        for nbytes in (4096, 2**20, 64 * 2**20):
            assert collective_time(t, "all_reduce", nbytes, n, "intra_host") >= \
                collective_time(loop_only, "all_reduce", nbytes, n, "intra_host") * (1 - 1e-12)
    assert got[8].at(64 * 2**20).beta == 4e-9 and got[8].at(4096).beta == pytest.approx(6e-4 / wire)
    again = from_json(t.to_json())  # a target file holds the pieces of a group
    assert again.link("all_reduce", "intra_host").for_group(8).at(64 * 2**20).beta == 4e-9


def test_group_links_run_between_computation_on_a_process_s_devices():
    from spmdkit._target import measure_group_links

    loop = Link(1e-5, 1e-10)
    seen = measure_group_links(4, {"all_reduce": loop, "all_gather": loop}, rounds=1)
    assert set(seen) == {"all_reduce", "all_gather"}  # a size whose collective added nothing may be missing
    assert all(g in (2, 4) and ab.alpha >= loop.alpha and ab.beta >= loop.beta and not ab.groups
               for own in seen.values() for g, ab in own)


def test_cache_curve_measures_each_size_on_every_device_at_once():
    from spmdkit._target import measure_cache_curve

    curve = measure_cache_curve(8, sizes=(16 * 1024, 4 * 2**20), repeats=1)
    # keyed by the bytes one operation reads and writes on a device: twice its array's
    assert [b for b, _ in curve] == [32 * 1024, 8 * 2**20] and all(r > 0 for _, r in curve)


def test_cpu_rates_are_the_best_over_a_window_and_stream_from_memory(monkeypatch, tmp_path):
    from spmdkit import _target

    # a clock: the window opens at 0; calls of 1.0, 0.1, 0.02 and 0.1 s; the window is over at 1.6
    calls, ticks = [], iter([0.0, 0.0, 1.0, 1.0, 1.1, 1.1, 1.1, 1.12, 1.2, 1.2, 1.3, 1.6])
    best = _target._best_seconds(lambda: calls.append(1), repeats=2, window=1.5, clock=lambda: next(ticks))
    assert best == pytest.approx(0.02) and len(calls) == 1 + 4  # a warm-up, 2 repeats, 2 more in the window
    # the sum streams from memory: 4x the largest cache level Linux reports, 256 MiB at least, 1 GiB at most
    for level, size in ((1, "48K"), (2, "2048K"), (3, "96M")):
        (tmp_path / f"index{level}").mkdir()
        (tmp_path / f"index{level}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{level}" / "size").write_text(size + "\n")
    assert _target.last_level_cache_bytes(str(tmp_path)) == 96 * 2**20
    assert _target.last_level_cache_bytes(str(tmp_path / "none")) is None
    assert _target.stream_bytes(96 * 2**20) == 384 * 2**20 and _target.stream_bytes(None or 0) == 256 * 2**20
    assert _target.stream_bytes(2**30) == 2**30
    # measure_cpu takes both figures over the window and sums stream_bytes()
    seen, real = [], _target._best_seconds
    monkeypatch.setattr(_target, "stream_bytes", lambda: 2**20)  # a quick test: the rule is checked above
    monkeypatch.setattr(_target, "MEASURE_WINDOW", 0.01)
    monkeypatch.setattr(_target, "_best_seconds", lambda fn, **kw: seen.append(kw) or real(fn, **kw))
    flops, bandwidth = _target.measure_cpu(64)
    assert flops > 0 and bandwidth > 0 and seen == [{"window": 0.01}, {"window": 0.01}]


# ---------------------------------------------------------------- candidates
def test_candidates_enumerated_and_pruned_with_reasons():
    assert sorted(factorisations(8, 2)) == [(2, 4), (4, 2)]
    kept, pruned = enumerate_candidates(8, ("dp", "dp+tp", "hsdp+tp"), ("none",), (1, 2), batch_size=12)
    labels = {c.label for c in kept}
    assert "dp+tp [data=2,model=4] accum=2" in labels and "hsdp+tp [data=2,fsdp=2,model=2]" in labels
    reasons = {c.label: why for c, why in pruned}
    assert "not divisible by 8 batch shard(s)" in reasons["dp [data=8]"]
    assert "4 batch shard(s) x 2 accumulation step(s) = 8" in reasons["dp+tp [data=4,model=2] accum=2"]


# ---------------------------------------------------------------- the Python API on a user's own model
class UserMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        w1 = self.param("w_in", nn.with_logical_partitioning(nn.initializers.normal(0.1), ("embed", "hidden")), (32, 256))
        w2 = self.param("w_out", nn.with_logical_partitioning(nn.initializers.normal(0.1), ("hidden", "embed")), (256, 32))
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)), (32,))
        h = nn.with_logical_constraint(jax.nn.relu(x @ w1), ("batch", "hidden"))
        return h @ w2 + bias


def _user_program():
    model, tx = UserMLP(), optax.sgd(0.1)

    def make_state(rng):
        params = model.init(rng, jnp.zeros((1, 32)))["params"]
        return {"params": params, "opt": tx.init(params)}

    def train_step(state, batch):
        def loss(p):
            return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}

    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 32)).astype(np.float32), "y": rng.standard_normal((16, 32)).astype(np.float32)}
    return make_state, train_step, batch


@pytest.fixture(scope="module")
def user_plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("rules")
    # Shards only the small bias: the two large matrices stay whole on every device.
    (d / "replicate.toml").write_text('batch = "data"\nembed = "none"\nhidden = "none"\nvocab = "model"\n')
    (d / "idle.toml").write_text('batch = "data"\nembed = "data"\nhidden = "none"\nvocab = "none"\nheads = "model"\n')
    (d / "clash.toml").write_text('batch = "data"\nembed = "model"\nhidden = "model"\n')
    make_state, train_step, batch = _user_program()
    rules = ("dp", "fsdp+tp", str(d / "replicate.toml"), str(d / "clash.toml"), str(d / "idle.toml"))
    return spmdkit.plan(make_state, train_step, batch, rules=rules, target="h100x8", memory_per_device=100_000,
                        measure=2, measure_steps=2, measure_rounds=1)


def test_plan_on_a_users_step_ranks_flags_and_excludes(user_plan):
    rows = {r["label"]: r for r in user_plan["candidates"]}
    ok = [r for r in user_plan["candidates"] if r["status"] == "ok"]
    assert [r["rank"] for r in ok] == list(range(1, len(ok) + 1))
    assert all(a["step_s"] <= b["step_s"] for a, b in zip(ok, ok[1:]))
    assert user_plan["frontier"] and user_plan["why"][0].startswith("winner: " + ok[0]["label"])
    # Data parallel pays an all-reduce of the gradients over "data" and nothing else.
    dp = rows["dp [data=8]"]
    assert {(c["kind"], tuple(c["axes"])) for c in dp["collectives"]} == {("all_reduce", ("data",))}
    # Two names mapped to one mesh axis: reported by parameter and names.
    clash = next(r for r in user_plan["candidates"] if r["rules"].endswith("clash.toml"))
    assert clash["status"] == "pruned" and "['embed', 'hidden']" in clash["reason"] and "w_in" in clash["reason"]
    # A rules file that leaves the large parameters replicated: flagged by name.
    rep = next(r for r in user_plan["candidates"] if r["rules"].endswith("replicate.toml"))
    assert {f["path"] for f in rep["replicated"]} == {"state['params']['w_in']", "state['params']['w_out']"}
    # A mesh axis that only names the model lacks would repeat work: excluded, saying so.
    idle = next(r for r in user_plan["candidates"] if r["rules"].endswith("idle.toml"))
    assert idle["status"] == "pruned" and "mesh axis 'model' splits nothing" in idle["reason"]


def test_plan_memory_within_10_percent_of_compiled_and_over_budget_excluded(user_plan):
    for r in user_plan["candidates"]:
        if r["status"] in ("ok", "over_budget"):
            mem = r["memory"]
            assert mem["per_device"] == max(mem["analytic"]["total"], mem["compiled"]["total"])
            assert abs(mem["per_device"] / mem["compiled"]["total"] - 1) <= 0.10, r["label"]
            assert mem["analytic"]["activations"] is None and "no activations" in mem["analytic"]["counted"]
    over = [r for r in user_plan["candidates"] if r["status"] == "over_budget"]
    assert over, "the 100 kB budget excludes the replicated layouts"
    for r in over:
        assert f"needs {readable_bytes(r['memory']['per_device'])} per device" in r["reason"] and r["memory"]["per_device"] > 100_000


def test_plan_measure_compares_predicted_and_measured(user_plan):
    runs = user_plan["measured"]["runs"]
    assert [m["rank"] for m in runs] == [1, 2]
    assert all(m["measured_s"] > 0 and m["measured_memory"] > 0 and m["measured_memory_source"] for m in runs)
    assert user_plan["measured"]["spearman"] is None  # fewer than 3 runs: no rank correlation claimed
    assert user_plan["measured"]["ties"] == []  # one round each: no spread to judge a tie by


def test_measured_order_is_paired_by_round_not_by_overall_medians():
    from spmdkit._plan._report import measure

    # a beats b in two of three rounds; b's overall median is lower only because a's slow
    # rounds fell where b's were fast: the rounds' own comparison decides
    rounds = {"a": [1.0, 10.0, 10.0], "b": [2.0, 2.0, 20.0]}
    row = {"status": "ok", "step_s": 1.0, "step_s_overlapped": 1.0, "step_s_serial": 1.0,
           "memory": {"analytic": {"total": 1}, "per_device": 1}}
    plan = {"candidates": [{**row, "label": k, "rank": i + 1} for i, k in enumerate(rounds)]}

    def prepare(r):
        left = list(rounds[r["label"]])
        return (lambda steps: [left.pop(0)] * steps), 1, "compiled"

    got = measure(plan, 2, prepare, steps=1, rounds=3)
    a, b = got["runs"]
    assert a["measured_s"] > b["measured_s"]  # overall medians: 10 against 2
    assert a["measured_relative"] < 1 < b["measured_relative"]
    assert got["measured_fastest"] == "a" and got["measured_fastest_predicted_rank"] == 1
    assert a["measured_relative_rounds"] == pytest.approx([2 ** -0.5, 5 ** 0.5, 2 ** -0.5])


def test_measured_ties_are_the_candidates_whose_rounds_overlap(capsys):
    from rich.console import Console

    from spmdkit._plan._report import print_measured, ties

    rounds = {"a": [1.00, 1.05, 1.02, 0.98, 1.01], "b": [1.01, 1.04, 0.99, 1.03, 1.06], "c": [1.50, 1.55, 1.52, 1.49, 1.51]}
    runs = [{"label": k, "rank": i + 1, "predicted_s": 1.0 + i, "measured_s": float(np.median(v)),
             "measured_spread_s": [min(v), max(v)], "measured_rounds_s": v, "predicted_memory": 1,
             "measured_memory": 1, "measured_memory_source": "compiled"} for i, (k, v) in enumerate(rounds.items())]
    assert ties(runs) == [["a", "b"]]  # 3% apart with +-3% rounds: a tie; c is 50% slower
    print_measured({"runs": runs, "spearman": 1.0, "measured_fastest": "a", "measured_fastest_predicted_rank": 1,
                    "ties": ties(runs)}, Console(width=200))
    out = capsys.readouterr().out
    assert "a ~ b" in out and "is noise" in out and "c ~" not in out
    assert "one round only" not in out
    print_measured({"runs": runs, "rounds": 1, "spearman": 1.0, "measured_fastest": "a",
                    "measured_fastest_predicted_rank": 1, "ties": []}, Console(width=200))
    assert "one round only: no spread to judge ties by" in " ".join(capsys.readouterr().out.split())


def test_measure_all_runs_every_candidate_and_judges_the_measurement_against_itself(capsys):
    from rich.console import Console

    from spmdkit._plan._report import measure, print_measured

    # three candidates whose rounds agree on the order (a < b < c), and a fourth priced last
    rounds = {k: [t, t + 0.1] * 4 for k, t in (("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 2.5))}
    row = {"status": "ok", "step_s": 1.0, "step_s_overlapped": 1.0, "step_s_serial": 1.0,
           "memory": {"analytic": {"total": 1}, "per_device": 1}}
    plan = {"candidates": [{**row, "label": k, "rank": i + 1, "step_s": float(i + 1)} for i, k in enumerate(rounds)]
            + [{**row, "label": "e", "status": "pruned"}]}

    def prepare(r):
        left = list(rounds[r["label"]])
        return (lambda steps: [left.pop(0)] * steps), 1, "compiled"

    got = measure(plan, "all", prepare, steps=1, rounds=8)
    assert [m["label"] for m in got["runs"]] == ["a", "b", "c", "d"]  # every ok candidate, none pruned
    assert got["reproducibility"] == pytest.approx(1.0)  # both halves order them alike
    assert got["spearman"] == pytest.approx(0.8)  # d priced last, measured third
    print_measured(got, Console(width=200))
    out = " ".join(capsys.readouterr().out.split())
    assert "one half of its rounds' order against the other's): 1.000" in out and "partly noise" not in out

    # a and b trade places after the first rotation: the measurement does not reproduce its own order
    rounds = {"a": [1.0] * 3 + [2.0] * 3, "b": [2.0] * 3 + [1.0] * 3, "c": [1.5] * 6}
    plan = {"candidates": [{**row, "label": k, "rank": i + 1, "step_s": float(i + 1)} for i, k in enumerate(rounds)]}
    got = measure(plan, "all", prepare, steps=1, rounds=6)
    assert got["reproducibility"] < 0
    print_measured(got, Console(width=200))
    assert "partly noise" in " ".join(capsys.readouterr().out.split())
    # fewer than two whole rotations (2 x 3 candidates): not judged, and said so
    rounds = {k: v[:5] for k, v in rounds.items()}
    got = measure(plan, "all", prepare, steps=1, rounds=5)
    assert got["reproducibility"] is None
    print_measured(got, Console(width=200))
    assert "other's): n/a (fewer than 3 runs, or --measure-rounds below twice the runs)" in " ".join(
        capsys.readouterr().out.split())


@pytest.mark.parametrize("n", [3, 4, 5])
def test_reproducibility_halves_see_every_candidate_at_every_place_in_a_round(n):
    from spmdkit._plan._report import reproducibility

    # The candidates take turns, each round one place later; whoever runs first in a round pays
    # 10% (the machine's state left by the round before). Halves that put a candidate first in
    # one half only (odd against even rounds, pairs of rounds for 4 candidates) read that as
    # disagreement; whole rotations taken in turn do not, also with a part rotation left over.
    base = [1.0 + 0.02 * i for i in range(n)]
    for rounds in (2 * n, 4 * n, 4 * n + 2):
        relative = [[base[i] * (1.1 if (i - r) % n == 0 else 1.0) for r in range(rounds)] for i in range(n)]
        assert reproducibility(relative) == pytest.approx(1.0)
    assert reproducibility([[1.0] * (2 * n - 1)] * n) is None


# ---------------------------------------------------------------- the CLI
def test_cli_plan_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--devices", "--processes", "--memory-per-device", "--target", "--measure", "--json", "--png"):
        assert flag in out


def test_cli_plan_measure_takes_a_count_or_all(capsys):
    from spmdkit._cli import build_parser

    from spmdkit._plan._processes import check_processes
    from spmdkit._plan_cli import _check_args

    args = build_parser().parse_args(["plan", "--devices", "8", "--measure", " ALL "])
    assert args.measure == "all"
    _check_args(args)  # "all" is not compared with a number
    with pytest.raises(ConfigError, match="measure='all'"):  # a lone process cannot measure over 2
        check_processes(2, "all", running=1)
    assert build_parser().parse_args(["plan", "--devices", "8", "--measure", "4"]).measure == 4
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["plan", "--devices", "8", "--measure", "most"])
    assert e.value.code == 2
    assert "'most' is neither a count of candidates nor 'all'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["", ",", " ; "])
def test_cli_plan_rules_that_name_nothing_are_refused_in_flag_terms(value, capsys):
    # The planner's error spoke of "plan(rules=()) ... e.g. rules=('dp', 'fsdp')", a call the user never wrote.
    from spmdkit._cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["plan", "--devices", "8", "--rules", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --rules: expected rules separated by commas" in err
    assert "e.g. --rules dp,fsdp+tp" in err and "plan(rules" not in err


def test_plan_json_records_the_corpus_as_read(tmp_path, monkeypatch):
    # A relative --text-dir was recorded as typed (meaningless from another directory) and
    # --text-bytes not at all.
    from spmdkit._plan_cli import _model

    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(task="lm", layers=1, d_model=16, heads=2, seq_len=8, precision=None, scan_unroll=None,
                              text_dir="corpus", text_bytes=None, batch_size=None)
    model = _model(args)
    assert model["text_dir"] == str(tmp_path / "corpus") and model["text_bytes"] == 20_000
    assert _model(argparse.Namespace(**{**vars(args), "text_bytes": 123_456}))["text_bytes"] == 123_456


def test_cli_plan_lm_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--task", "lm", "--devices", "8", "--layers", "1", "--d-model", "16", "--heads", "2",
                 "--seq-len", "8", "--batch-size", "8", "--rules", "fsdp,tp", "--target", "h100x8",
                 "--memory-per-device", "64MiB", "--json", str(out)])
    assert code == 0
    plan = json.loads(out.read_text())
    rows = {r["label"]: r for r in plan["candidates"]}
    assert rows["fsdp [data=8]"]["status"] == "ok"
    kinds = {(c["kind"], tuple(c["axes"])) for c in rows["fsdp [data=8]"]["collectives"]}
    assert ("all_gather", ("data",)) in kinds  # FSDP gathers its parameters
    mem = rows["fsdp [data=8]"]["memory"]
    assert abs(mem["per_device"] / mem["compiled"]["total"] - 1) <= 0.10
    assert rows["tp [model=8]"]["status"] == "pruned" and "cannot split evenly" in rows["tp [model=8]"]["reason"]
    assert "winner: fsdp [data=8]" in capsys.readouterr().out
    # What it planned, every size resolved (the defaults too), and the figures it priced with as a
    # target file: passed back with --target, the same prices.
    assert plan["model"] == {"layers": 1, "d_model": 16, "heads": 2, "seq_len": 8, "mlp_ratio": 4, "precision": "f32",
                             "scan_unroll": 1, "text_dir": None, "text_bytes": 20_000}, plan["model"]
    (tmp_path / "target.json").write_text(json.dumps(plan["target"]["file"]))
    assert main(["plan", "--task", "lm", "--devices", "8", "--layers", "1", "--d-model", "16", "--heads", "2",
                 "--seq-len", "8", "--batch-size", "8", "--rules", "fsdp,tp", "--target", str(tmp_path / "target.json"),
                 "--memory-per-device", "64MiB", "--json", str(out)]) == 0
    again = {r["label"]: r for r in json.loads(out.read_text())["candidates"]}
    assert {k: r.get("step_s") for k, r in again.items()} == {k: r.get("step_s") for k, r in rows.items()}
    assert again["fsdp [data=8]"]["step_s"] > 0


def test_cli_plan_a_corpus_smaller_than_a_batch_says_more_text_not_more_text_bytes(tmp_path, capsys):
    # "give a smaller --batch-size (or, for lm, more --text-bytes)": no --text-bytes adds text to a corpus all read.
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text("some text " * 30)
    args = ["plan", "--task", "lm", "--devices", "8", "--layers", "1", "--d-model", "16", "--heads", "2",
            "--seq-len", "8", "--batch-size", "128", "--text-dir", str(tmp_path), "--target", "h100x8"]
    assert main(args) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "give a smaller --batch-size, or more text in --text-dir (its training files hold about" in said, said
    assert "--text-bytes" not in said
    assert main([*args, "--text-bytes", "200"]) == 2  # cut short by --text-bytes: that is the lever
    assert "(or more --text-bytes)" in " ".join(capsys.readouterr().err.split())


def test_cli_plan_records_the_mlp_sizes_it_planned_with_their_defaults():
    from argparse import Namespace

    from spmdkit._plan_cli import _model

    assert _model(Namespace(task="mlp", layers=None, depth=None, embed=None)) == {"layers": 4, "depth": 512, "embed": 128}
    assert _model(Namespace(task="mlp", layers=2, depth=None, embed=8)) == {"layers": 2, "depth": 512, "embed": 8}


def test_cli_plan_bad_target_names_the_fix(tmp_path, capsys):
    code = main(["plan", "--task", "mlp", "--devices", "8", "--layers", "1", "--depth", "16", "--embed", "8",
                 "--rules", "dp", "--target", str(tmp_path / "nope.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert "nope.json" in err and "h100x8" in err


# ---------------------------------------------------------------- several processes
def test_processes_argument_checked_against_the_processes_running():
    from spmdkit._plan._processes import check_processes

    assert check_processes(None, 2, running=2) == 2  # taken from jax.process_count()
    assert check_processes(2, 0, running=1) == 2  # priced as 2 hosts, nothing run
    with pytest.raises(spmdkit.ConfigError, match=r"processes=3\), but this is one of 2 processes") as e:
        check_processes(3, 0, running=2)
    assert "pass processes=2" in str(e.value) and isinstance(e.value, ValueError)
    make_state, train_step, batch = _user_program()
    with pytest.raises(spmdkit.ConfigError, match=r"processes=2, measure=1\) in a single process") as e:
        spmdkit.plan(make_state, train_step, batch, rules=("dp",), target="h100x8", processes=2, measure=1)
    assert "spmdkit launch -n 2" in str(e.value) and "measure=0" in str(e.value)


def test_cli_plan_processes_errors_name_the_flags(capsys):
    base = ["plan", "--task", "mlp", "--layers", "1", "--depth", "16", "--embed", "8", "--rules", "dp", "--target", "h100x8"]
    assert main([*base, "--devices", "8", "--processes", "3", "--measure", "1"]) == 2
    err = capsys.readouterr().err
    assert "--devices 8" in err and "--processes 3" in err and "Fix" in err
    assert main([*base, "--devices", "8", "--measure", "-1"]) == 2
    assert "--measure -1" in capsys.readouterr().err


def test_cli_plan_measures_over_two_processes(tmp_path):
    """One command starts 2 processes x 4 devices, runs the 2 best candidates in both, and
    process 0 writes the plan: collectives over the axis that spans the processes are inter_host."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "plan.json"
    env = _unjoined_env()
    command = [sys.executable, "-m", "spmdkit._cli", "plan", "--task", "mlp", "--layers", "1", "--depth", "16",
               "--embed", "8", "--batch-size", "16", "--rules", "dp,dp+tp", "--devices", "8", "--processes", "2",
               "--measure", "all", "--measure-steps", "1", "--measure-rounds", "1", "--measure-timeout", "200",
               "--json", str(out)]
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the command and the launcher; the workers die with it
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.count("predicted vs measured (2 processes") == 1, stdout  # process 0 alone prints
    plan = json.loads(out.read_text())
    assert (plan["processes"], plan["devices"], plan["devices_per_host"]) == (2, 8, 4)
    runs = plan["measured"]["runs"]
    assert [m["rank"] for m in runs] == [1, 2, 3] and plan["measured"]["processes"] == 2  # --measure all
    assert all(np.isfinite(m["measured_s"]) and m["measured_s"] > 0 and m["steps"] == 1 for m in runs)
    ok = [r for r in plan["candidates"] if r["status"] == "ok"]
    assert {r["label"] for r in ok} == {"dp [data=8]", "dp+tp [data=2,model=4]", "dp+tp [data=4,model=2]"}
    # "data" is every mesh's outer axis: its groups take devices of both processes, "model"'s one process's.
    links = [(tuple(c["axes"]), c["link"]) for r in ok for c in r["collectives"]]
    assert links and all(link == ("inter_host" if "data" in axes else "intra_host") for axes, link in links), links
    assert {link for _, link in links} == {"inter_host", "intra_host"}
    # The links were measured in the 2 processes at plan start, as their runtime routes them.
    assert "links measured at plan start in this 2-process program" in plan["target"]["source"], plan["target"]
    assert plan["target"]["links_note"].startswith("measured at plan start")
    # Pairs of one process's devices (model=2) have their own link, measured between computation,
    # and the plan priced every collective by the file it wrote.
    target = from_json(plan["target"]["file"])
    assert [g for g, _ in target.link("all_reduce", "intra_host").groups] == [2]
    assert "over 2 of a process's devices, between computation" in plan["target"]["source"]
    pairs = 0
    for r in ok:
        for c in r["collectives"]:
            each = collective_time(target, c["kind"], c["bytes"], c["group_size"], c["link"], c["operands"])
            assert (c["seconds"] - c["sync_seconds"]) / c["count"] == pytest.approx(each), (r["label"], c)
            pairs += c["link"] == "intra_host" and c["group_size"] == 2
    assert pairs, "dp+tp [data=4,model=2] has collectives over pairs of one process's devices"


def test_cli_plan_two_processes_report_a_process_error_and_the_timeout(tmp_path):
    """A process's error (bad input) is the command's; past --measure-timeout every process is killed."""
    import signal
    import subprocess
    import sys

    env = _unjoined_env()
    base = [sys.executable, "-m", "spmdkit._cli", "plan", "--task", "mlp", "--layers", "1", "--depth", "16", "--embed",
            "8", "--batch-size", "16", "--rules", "dp", "--devices", "8", "--processes", "2", "--measure", "1"]
    for extra, code, words in ((["--target", "nope.json"], 2, "'nope.json' is neither a file"),
                               (["--measure-timeout", "2"], 4, "did not finish in 2 s; killed")):
        proc = subprocess.Popen([*base, *extra], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == code and words in " ".join(stderr.split()), stderr[-2000:]
        assert "Traceback" not in stderr
    # SIGKILL is delivered at once; a busy kernel may take a while to reap (up to 15 s allowed)
    left = _left_running(tmp_path, 15)
    assert not left, f"processes left running in {tmp_path}: {left}"


def test_cli_plan_two_processes_ctrl_c_prints_the_partial_plan_and_exits_130(tmp_path, own_group):
    """Ctrl-C to the command's process group (as a terminal sends it) while the processes measure:
    the command killed the launcher at once, and its processes with it: no ranking, no rounds,
    only a traceback. Now process 0 prints what it has and the command exits 130."""
    import signal
    import time

    env = _unjoined_env()
    out = tmp_path / "plan.json"
    command = _measuring_for_ever("dp,dp+tp", "--json", str(out))
    with own_group(command, sigint=True, env=env) as proc:
        lines = _until_measuring(proc)
        time.sleep(5)  # into the measurement (its candidates compiling, or rounds)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    stdout = "".join(lines) + stdout
    assert proc.returncode == 130, stdout[-2000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "interrupted: measurement interrupted after" in " ".join(stdout.split()), stdout[-2000:]
    assert "winner:" in stdout  # the ranking
    plan = json.loads(out.read_text())
    assert plan["candidates"][0]["status"] == "ok"
    if "measured" in plan:  # whole rounds were measured before the Ctrl-C
        assert plan["measured"]["interrupted"]["rounds_done"] >= 1 and plan["measured"]["processes"] == 2


@pytest.mark.parametrize("processes", [1, 2])
def test_cli_plan_sigterm_while_measuring_shows_the_ranking_and_the_rounds_and_exits_143(tmp_path, own_group,
                                                                                         processes):
    """SIGTERM to the command (a batch scheduler's time limit, ``kill PID``) while it measures: it
    died where the signal fell, the rounds measured lost and no table shown. It now stops as
    Ctrl-C does, with the shell's code for a SIGTERM."""
    import signal
    import time

    env = _unjoined_env()
    out = tmp_path / "plan.json"
    command = _measuring_for_ever("dp,dp+tp", "--json", str(out))
    command[command.index("--processes") + 1] = str(processes)
    with own_group(command, env=env, cwd=tmp_path) as proc:
        lines = _until_measuring(proc)
        time.sleep(10)  # into the measurement's rounds (its candidates compile first)
        proc.send_signal(signal.SIGTERM)  # the command alone, as kill PID does
        stdout, stderr = proc.communicate(timeout=120)
    stdout = "".join(lines) + stdout
    assert proc.returncode == 143, stdout[-2000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "terminated (SIGTERM): measurement interrupted after" in " ".join(stdout.split()), stdout[-2000:]
    assert "Ctrl-C)" not in stdout  # not "interrupted (Ctrl-C)" under the measured table
    assert "winner:" in stdout  # the ranking
    plan = json.loads(out.read_text())
    assert plan["candidates"][0]["status"] == "ok"
    done = int(re.search(r"interrupted after (\d+) of", stdout).group(1))
    if done:  # whole rounds before the SIGTERM (under load the candidates may still be compiling): kept
        assert plan["measured"]["interrupted"]["rounds_done"] == done and plan["measured"]["runs"]
    assert not _left_running(tmp_path, 15)


def test_sigterm_in_a_plan_is_one_ctrl_c_and_the_handler_is_put_back():
    import signal

    from spmdkit._plan_cli import _sigterm_as_ctrl_c

    before = signal.getsignal(signal.SIGTERM)
    seen = []
    previous_int = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with _sigterm_as_ctrl_c() as term:
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)  # a scheduler's, and the launcher's passed on: one stop
        assert term == [signal.SIGTERM] and seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous_int)
    assert signal.getsignal(signal.SIGTERM) == before

    class CtrlC:  # main()'s SIGINT handler, after a Ctrl-C
        seen = True

        def __call__(self, signum, frame):
            raise AssertionError("a second stop while the first one's rounds are summarised")

    previous_int = signal.signal(signal.SIGINT, CtrlC())
    try:
        with _sigterm_as_ctrl_c() as term:
            signal.raise_signal(signal.SIGTERM)  # SIGINT and SIGTERM together (a terminal's and a scheduler's)
        assert term == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGINT, previous_int)


def _environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_cli_plan_two_processes_shows_the_ranking_when_process_0_dies_while_measuring(tmp_path, own_group):
    """Process 0 killed while the processes measure (SIGKILL, out of memory): it printed and wrote
    the plan only at the end, so minutes of compiling and pricing were lost with it. It saves the
    priced plan before measuring; the command prints it, then the failure, and --json holds it."""
    import signal
    import time

    env = _unjoined_env()
    out = tmp_path / "plan.json"
    command = _measuring_for_ever("dp,dp+tp", "--json", str(out))
    with own_group(command, env=env, cwd=tmp_path) as proc:
        lines = _until_measuring(proc)
        assert out.exists() and "wrote " in "".join(lines), "".join(lines)[-2000:]
        deadline = time.monotonic() + 30
        zero = []
        while not zero and time.monotonic() < deadline:
            zero = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cwd(pid) == str(tmp_path)
                    and _environ(pid).get("SPMDKIT_PROCESS_ID") == "0"]
        assert zero, "process 0 not found"
        time.sleep(1)
        os.kill(int(zero[0]), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    stdout = " ".join(("".join(lines) + stdout).split())
    assert proc.returncode not in (0, 130), stdout[-2000:] + stderr[-3000:]
    assert "nothing measured: the processes stopped before process 0 reported" in stdout, stdout[-2000:]
    assert f"the ranking above (in {out})" in stdout and "winner:" in stdout
    assert "failed" in stderr and "Traceback" not in stderr, stderr[-3000:]
    plan = json.loads(out.read_text())
    assert [c["status"] for c in plan["candidates"]] == ["ok"] * 3 and "measured" not in plan
    assert plan["task"] == "mlp" and plan["model"] == {"layers": 1, "depth": 16, "embed": 8}


def test_plan_outcome_shows_the_saved_ranking_when_process_0_did_not_report(capsys):
    # A Ctrl-C while a candidate compiled in several processes (the launcher's grace ran out before
    # process 0 reached a point all processes agree to stop at), a second Ctrl-C, or
    # --measure-timeout: process 0 was killed, and nothing was shown.
    from rich.console import Console

    from spmdkit._plan._processes import PlanRunError
    from spmdkit._plan_cli import _outcome

    make_state, step, batch = _tiny()
    ranking = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")
    args = argparse.Namespace(json="plan.json", png=None, processes=2, measure_timeout=30)
    wide = Console(width=200)
    assert _outcome(None, ranking, "interrupted", 130, [], args, wide, ["plan.json"]) == 130
    out = " ".join(capsys.readouterr().out.split())
    assert "winner: dp [data=8]" in out
    assert "nothing measured: interrupted (Ctrl-C) before process 0 reported; the ranking above (in plan.json)" in out
    assert _outcome(None, ranking, "stopped", -9, [], args, wide) == 130
    assert "interrupted (Ctrl-C twice) before" in capsys.readouterr().out
    with pytest.raises(PlanRunError, match="did not finish in 30 s"):
        _outcome(None, ranking, "timeout", -9, [], args, wide)
    assert "killed at --measure-timeout before process 0 reported" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(KeyboardInterrupt):  # nothing to show: main() says "interrupted"
        _outcome(None, None, "interrupted", 130, [], args, wide)
    assert _outcome({"candidates": [{"status": "ok"}]}, None, "interrupted", 130, [], args, wide) == 130
    # SIGTERM: to the command (passed on), or to the launcher or a process alone (the command saw it end 143)
    assert _outcome({"candidates": [{"status": "ok"}]}, None, "terminated", 143, [], args, wide) == 143
    assert _outcome({"candidates": [{"status": "ok"}]}, None, "done", 143, [], args, wide) == 143
    assert _outcome(None, ranking, "terminated", -9, [], args, wide) == 143
    assert "nothing measured: terminated (SIGTERM) before process 0 reported" in " ".join(capsys.readouterr().out.split())
    # the launcher alone sent SIGTERM, before process 0 reported or saved anything: still 143, said
    assert _outcome(None, None, "done", 143, [], args, wide) == 143
    assert "terminated (SIGTERM)" in capsys.readouterr().err
    # Process 0 reported (and removed its saved ranking), then failed writing --png or was killed:
    # the failure alone, not its ranking again under "nothing measured".
    with pytest.raises(PlanRunError, match="exit code 4"):
        _outcome(None, None, "done", 4, ["[0] error: --png cannot be written\n"], args, wide)
    assert "nothing measured" not in capsys.readouterr().out


def test_plan_failure_names_the_first_error_and_a_kill_from_outside():
    from spmdkit._plan._processes import PlanRunError
    from spmdkit._plan_cli import _raise_failure

    noise = [f"[1] @ 0x7f{i} absl::LogMessage::Flush()\n" for i in range(30)]
    with pytest.raises(PlanRunError) as err:
        _raise_failure(5, ["[0] error: --json 'x/p.json' cannot be written: No such file or directory.\n", *noise], 2)
    assert "--json 'x/p.json' cannot be written" in str(err.value)  # not pushed out by process 1's trace
    killed = [*noise, "spmdkit launch: process 0 was killed by signal 9; stopped the other 1\n"]
    with pytest.raises(PlanRunError) as err:
        _raise_failure(1, killed, 2)
    assert "killed from outside" in str(err.value) and "can join here" not in str(err.value)
    assert str(err.value).split("\n")[1].startswith("spmdkit launch: process 0 was killed by signal 9")  # the cause first
    survivor = ["[0] error: another process of the job ended while this one gathered a digest\n", *noise]
    with pytest.raises(PlanRunError) as err:  # a crash of its own (SIGSEGV) is not "from outside"
        _raise_failure(1, [*survivor, "spmdkit launch: process 1 was killed by signal 11; stopped the other 1\n"], 2)
    message = str(err.value)
    assert message.split("\n")[1].startswith("spmdkit launch: process 1 was killed by signal 11")  # not the symptom
    assert "process 1 crashed (signal 11)" in message and "killed from outside" not in message
    assert "can join here" not in message and message.count("killed by signal 11") == 1


def test_the_ranking_saved_before_measuring_skips_a_fifo_and_survives_a_file_it_cannot_write(tmp_path, capsys):
    # A FIFO's reader took the early ranking and left: the final write then blocked forever. A
    # --json that could not be written then stopped the plan: no table, no measurement, no --png.
    from rich.console import Console

    from spmdkit._plan_cli import _save_ranked

    make_state, step, batch = _tiny()
    ranking = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    args = argparse.Namespace(task="mlp", layers=1, depth=16, embed=8, json=str(fifo), png=str(tmp_path / "p.png"))
    _save_ranked(args, Console(width=200))(dict(ranking))  # would block on the FIFO
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {tmp_path / 'p.png'}: the ranking" in " ".join(capsys.readouterr().out.split())
    gone = argparse.Namespace(**{**vars(args), "json": str(tmp_path / "gone" / "p.json"), "png": str(tmp_path / "q.png")})
    _save_ranked(gone, Console(width=200))(dict(ranking))
    out = " ".join(capsys.readouterr().out.split())
    assert "warning: the ranking was not saved before measuring: --json" in out and (tmp_path / "q.png").exists()


def test_process_0_removes_its_saved_ranking_when_it_reports(tmp_path, monkeypatch):
    from rich.console import Console

    from spmdkit._plan_cli import ENV_PLAN_RANKED, _write

    make_state, step, batch = _tiny()
    ranking = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")
    saved = tmp_path / "ranked.json"
    saved.write_text("{}")
    monkeypatch.setenv(ENV_PLAN_RANKED, str(saved))
    _write(ranking, argparse.Namespace(json=None, png=None), Console(width=200))
    assert not saved.exists()


def test_cli_plan_two_processes_end_when_the_command_alone_is_killed(tmp_path, own_group):
    """kill -9 of the command's pid alone (not its group): the launcher and both processes ran on,
    measuring for --measure-timeout and more."""
    import signal

    env = _unjoined_env()
    command = _measuring_for_ever("dp")
    with own_group(command, env=env, cwd=tmp_path) as proc:
        _until_measuring(proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = _left_running(tmp_path, 20)
    assert not left, f"processes left running in {tmp_path}: {left}"


def test_plan_gives_on_ranked_the_priced_plan_before_measuring(monkeypatch):
    # A run killed while measuring (minutes, for every candidate) lost its ranking with it.
    from spmdkit import _plan

    seen = []

    def fake_measure(result, *args, **kwargs):
        assert seen or not any(r["status"] == "ok" for r in result["candidates"]), "measured before on_ranked"
        return {"runs": [], "rounds": 0}

    monkeypatch.setattr(_plan, "_measure", fake_measure)
    make_state, step, batch = _tiny()
    result = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", measure=1, on_ranked=seen.append)
    assert len(seen) == 1 and "measured" not in seen[0] and "measured" in result
    assert seen[0]["candidates"] == result["candidates"] and seen[0] is not result
    seen.clear()
    spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", on_ranked=seen.append)
    assert seen == []  # nothing measured: the plan is returned at once
    spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", measure=1, memory_per_device=16,
                 on_ranked=seen.append)
    assert seen == []  # nothing fits: nothing to measure
    with pytest.raises(spmdkit.SignatureError, match="on_ranked"):
        spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", measure=1, on_ranked=lambda: None)


def _unjoined_env() -> dict[str, str]:
    """This environment without a job's variables: the command starts its own processes."""
    return {k: v for k, v in os.environ.items()
            if k not in ("SPMDKIT_COORDINATOR", "SPMDKIT_NUM_PROCESSES", "SPMDKIT_PROCESS_ID", "SPMDKIT_HOST_DEVICES")}


def _measuring_for_ever(rules: str, *flags: str) -> list[str]:
    """A tiny mlp plan over 2 processes whose measurement outlasts any test (a signal ends it)."""
    import sys

    return [sys.executable, "-m", "spmdkit._cli", "plan", "--task", "mlp", "--layers", "1", "--depth", "16",
            "--embed", "8", "--batch-size", "16", "--rules", rules, "--devices", "8", "--processes", "2",
            "--measure", "all", "--measure-steps", "1", "--measure-rounds", "100000", "--measure-timeout", "200",
            "--no-compile-cache", *flags]


def _until_measuring(proc) -> list[str]:
    """The command's lines up to process 0's "measuring every candidate(s): ..."."""
    lines = []
    for line in iter(proc.stdout.readline, ""):
        lines.append(line)
        if line.startswith("measuring every candidate(s): 100000 round(s)"):
            break
    return lines


def _left_running(path: Path, seconds: float) -> list[str]:
    """Processes whose working directory is ``path``, waited for up to ``seconds`` (SIGKILL is
    delivered at once; a busy kernel may take a while to reap)."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cwd(pid) == str(path)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _cwd(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


# ---------------------------------------------------------------- arguments checked before any work
def _tiny():
    make_state = lambda rng: {"w": jnp.zeros((16, 32))}  # noqa: E731
    step = lambda s, b: ({"w": s["w"] - 0.1 * b["x"].T @ (b["x"] @ s["w"])}, {})  # noqa: E731
    return make_state, step, {"x": jnp.ones((16, 16))}


@pytest.mark.parametrize("kwargs,words", [
    ({"memory_per_device": float("nan")}, "memory_per_device=nan"), ({"memory_per_device": -10}, "memory_per_device=-10"),
    ({"memory_per_device": 0}, "memory_per_device=0"), ({"memory_per_device": "abc"}, "(?s)'abc'.*'512MiB'"),
    ({"memory_per_device": "-1"}, "memory_per_device='-1'"), ({"measure": -1}, "measure=-1"),
    ({"measure": "every"}, "(?s)measure='every'.*measure=\"all\""),
    ({"measure": 1, "measure_steps": 0}, "measure_steps=0"), ({"measure": 1, "measure_rounds": 0}, "measure_rounds=0"),
    ({"accum": (0,), "step_for": lambda r, a: None}, "accum=0"),
    ({"dtype": "fp8"}, "dtype='fp8'.*'bfloat16', 'float32'"),
    ({"remat": ()}, r"remat=\(\)\) leaves no candidate"), ({"accum": ()}, r"accum=\(\)\) leaves no candidate")])
def test_plan_bad_numbers_and_dtype_are_named(kwargs, words):
    make_state, step, batch = _tiny()
    with pytest.raises(ConfigError, match=words) as err:
        spmdkit.plan(make_state, step, batch, rules=("dp",), target="h100x8", **kwargs)
    assert isinstance(err.value, ValueError) and "Fix:" in str(err.value)


def test_plan_takes_the_memory_budget_as_the_command_line_writes_it():
    # "512MiB" was refused from Python as "need a finite number of bytes > 0".
    make_state, step, batch = _tiny()
    for text, nbytes in (("512MiB", 512 * 2**20), ("0.5GB", 5e8), ("2 KiB", 2048)):
        got = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", memory_per_device=text)
        assert got["memory_budget"] == nbytes
    assert got["candidates"][0]["status"] == "over_budget"


@pytest.mark.parametrize("args, kwargs, error, words", [
    ((lambda: {"w": jnp.zeros(3)}, None, None), {}, "SignatureError", "make_state must take one argument"),
    (({"w": 1}, None, None), {}, "SignatureError", "make_state must be a function rng -> state, not dict"),
    ((None, None, {"x": [[1.0] * 16] * 16}), {}, "BatchSizeError", r"batch\['x'\]\[0\]\[0\] is float"),
    ((None, None, None), {}, "BatchSizeError", r"plan\(batch=None\) holds no arrays"),
    ((None, None, {"x": np.zeros((0, 16), np.float32)}), {}, "BatchSizeError", r"batch\['x'\] has shape \(0, 16\): no examples"),
    ((None, None, None), {"progress": True}, "SignatureError", "progress must be a function"),
    # A step written like a Task's loss_fn: each candidate's reason (one: a "pruned" line), not the error.
    ((None, lambda params, batch, rng: (params, {}), None), {}, "SignatureError",
     r"train_step must take two arguments, the state and the batch"),
    ((None, None, None), {"target": {"peak_flops": 1}}, "ConfigError", r"plan\(target=\{'peak_flops': 1\}\)"),
])
def test_plan_names_a_function_batch_or_target_of_the_wrong_kind(args, kwargs, error, words):
    # Each failed deep inside (a TypeError, AttributeError or IndexError) before.
    make_state, step, batch = _tiny()
    given = [a if a is not None else d for a, d in zip(args, (make_state, step, batch))]
    if args == (None, None, None) and "progress" not in kwargs and "target" not in kwargs:
        given[2] = None
    with pytest.raises(getattr(spmdkit, error), match=words):
        spmdkit.plan(*given, rules="dp", **{"target": "h100x8", **kwargs})


@pytest.mark.parametrize("kwargs, error, words", [
    ({"step_for": lambda remat: None}, "SignatureError", r"(?s)plan calls step_for with 2 argument\(s\).*\(remat\)"),
    ({"step_for": lambda remat, accum: "full"}, "SignatureError",
     r"step_for\('none', 1\) returned str, not a train step"),
    ({"activations": lambda cand, shards: 0}, "SignatureError", "plan calls activations with 3 argument"),
    ({"activations": lambda c, s, n: "1 MiB"}, "StepOutputError", r"(?s)returned '1 MiB'.*byte count >= 0"),
    ({"activations": lambda c, s, n: -5}, "StepOutputError", r"returned -5"),
    ({"activations": lambda c, s, n: {"saved": None}}, "StepOutputError", r"returned \{'saved': None\}"),
    ({"progress": lambda: None}, "SignatureError", "plan calls progress with 1 argument"),
])
def test_plan_names_a_callback_of_the_wrong_shape(kwargs, error, words):
    # A raw TypeError from deep inside the search before (or a string added to the memory).
    make_state, step, batch = _tiny()
    with pytest.raises(getattr(spmdkit, error), match=words):
        spmdkit.plan(make_state, None if "step_for" in kwargs else step, batch, rules="dp", target="h100x8", **kwargs)


@pytest.mark.parametrize("broken, error, words", [
    (lambda: (_ for _ in ()).throw(ValueError("no full remat here")), "PlanStepError",
     r"(?s)step_for\('full', 1\) raised ValueError: no full remat here.*leave that one out of remat="),
    (lambda: None, "SignatureError", r"step_for\('full', 1\) returned NoneType, not a train step"),
])
def test_plan_checks_every_step_for_variant_before_compiling(broken, error, words):
    # A step_for that raised for one remat escaped as the bare ValueError, and either failure came
    # only when that candidate's turn came, after the others had compiled.
    make_state, step, batch = _tiny()
    compiled = []
    with pytest.raises(getattr(spmdkit._plan._search, error, None) or getattr(spmdkit, error), match=words) as err:
        spmdkit.plan(make_state, None, batch, rules="dp", target="h100x8", remat=("none", "full"),
                     step_for=lambda remat, accum: broken() if remat == "full" else step, progress=compiled.append)
    assert compiled == []
    assert isinstance(err.value, spmdkit.SpmdkitError)


def test_plan_takes_activations_as_bytes_or_named_parts():
    make_state, step, batch = _tiny()
    bare = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")["candidates"][0]["memory"]["analytic"]
    for act, parts in ((lambda c, s, n: 2**20, None), (lambda c, s, n: {"saved": 2**19, "working": 2**19}, 2)):
        got = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", activations=act)
        analytic = got["candidates"][0]["memory"]["analytic"]
        assert analytic["total"] - bare["total"] == 2**20
        assert (analytic["activation_parts"] is None) == (parts is None)


def test_plan_batch_and_state_of_prng_keys_are_counted_in_their_bytes():
    # Per-example keys in the batch ended the plan in JAX's "Internal: canonicalize_dtype called on
    # extended dtype key<fry>"; an rbg key in the state was counted as 8 bytes, not its 16.
    step = lambda s, b: ({"w": s["w"] - 0.1 * jax.vmap(  # noqa: E731
        lambda k: jax.random.normal(k, (16,)))(b["key"]).T @ (b["x"] @ s["w"]), "k": s["k"]}, {})
    make_state = lambda rng: {"w": jnp.zeros((16, 32)), "k": jax.random.split(jax.random.key(0, impl="rbg"), 64)}  # noqa: E731
    batch = {"x": np.ones((16, 16), np.float32), "key": jax.random.split(jax.random.key(0), 16)}
    got = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")["candidates"][0]
    assert got["status"] == "ok", got["reason"]
    assert got["memory"]["analytic"]["batch"] == (16 * 16 * 4 + 16 * 8) // 8  # x and threefry keys, split 8 ways
    assert got["memory"]["analytic"]["new_state"] == 16 * 32 * 4 + 64 * 16
    # Given as shapes, measured: the keys to run with were made by np.zeros ("Cannot interpret 'key<fry>'").
    shapes = {"x": jax.ShapeDtypeStruct((16, 16), jnp.float32), "key": jax.ShapeDtypeStruct((16,), batch["key"].dtype)}
    ran = spmdkit.plan(make_state, step, shapes, rules="dp", target="h100x8", measure=1, measure_rounds=1, measure_steps=1)
    assert ran["measured"]["runs"][0]["measured_s"] > 0


def test_a_target_without_the_plans_dtype_nor_float32_is_named_before_compiling():
    # Found after the first candidate compiled, as "gives peak_flops for ['bfloat16'], neither 'float32' nor float32".
    make_state, step, batch = _tiny()
    bf16_only = Target(name="bf16 only", source="test", devices_per_host=8, peak_flops={"bfloat16": 1e15},
                       memory_bandwidth=1e12, links={"intra_host": Link(alpha=1e-6, beta=1e-11)})
    said = []
    with pytest.raises(TargetError, match=r"(?s)gives peak_flops for \['bfloat16'\], not 'float32' \(the rate a "
                       r"float32 step.*Fix: add \"float32\".*plan\(dtype='bfloat16'\)"):
        spmdkit.plan(make_state, step, batch, rules="dp", target=bf16_only, progress=said.append)
    assert said == []
    assert spmdkit.plan(make_state, step, batch, rules="dp", target=bf16_only, dtype="bf16")["candidates"][0]["step_s"] > 0


@pytest.mark.parametrize("change, words", [
    ({"peak_flops": {"float32": 67}}, r"peak_flops: 'float32' is 67 FLOP/s.*67e12 for 67 TFLOPS"),
    ({"links": {"intra_host": Link(5, 2e-12)}}, r"links.intra_host: 'alpha' is 5 seconds, above 1.*5e-6 for 5 us"),
    ({"memory_per_device": 80}, r"'memory_per_device' is 80 bytes.*80e9 for 80 GB"),
    ({"links": {"intra_host": Link(5e-6, None)}}, r"links\['intra_host'\].beta is None \(NoneType\), not a number"),
    ({"collectives": {"all_reduce": {"intra_host": Link(float("nan"), 1e-9)}}},
     r"collectives.all_reduce.intra_host: 'alpha' is nan, not a finite number"),
    ({"devices_per_host": 8.7}, r"devices_per_host is 8.7 \(float\), not a whole number >= 1.*devices_per_host=8"),
    ({"devices_per_host": True}, r"devices_per_host is True \(bool\)"),
    ({"peak_flops": 67e12}, r"peak_flops is 67000000000000.0 \(float\), not a dict.*peak_flops=\{'float32': 67e12\}"),
    ({"links": {"intra_host": (5e-6, 2e-12)}}, r"links\['intra_host'\] is \(5e-06, 2e-12\) \(tuple\), not a Link"),
    ({"peak_flops": {"float32": 10**400}}, r"peak_flops\['float32'\] is .* \(int\), not a number a float holds"),
    ({"collective_sync_ops": {2: "0.5"}}, r"collective_sync_ops\[2\] is '0.5' \(str\), not a number"),
    ({"collective_sync_ops": [0.5]}, r"collective_sync_ops is \[0.5\] \(list\), not a dict"),
    ({"cache_bandwidth": ((32768, "fast"),)}, r"cache_bandwidth\[0\] is 'fast' \(str\), not a number"),
    ({"transpose_bandwidth": {32768: 1e10}}, r"transpose_bandwidth is .* \(dict\), not \(bytes, bytes/s\) pairs"),
    ({"op_overhead": 5}, r"'op_overhead' is 5 seconds, above 0.01"),
])
def test_a_target_built_in_python_is_checked_as_a_file_is_before_compiling(change, words):
    # A datasheet's TFLOPS typed into a Target (not a file) priced every step at minutes without a word.
    make_state, step, batch = _tiny()
    fields = {"name": "gpu", "source": "datasheet", "devices_per_host": 8, "peak_flops": {"float32": 67e12},
              "memory_bandwidth": 3.35e12, "links": {"intra_host": Link(5e-6, 2e-12)}, **change}
    compiled = []
    with pytest.raises(TargetError, match=f"(?s)plan\\(target=Target.*{words}"):
        spmdkit.plan(make_state, step, batch, rules="dp", target=Target(**fields), progress=compiled.append)
    assert compiled == []


def test_a_target_built_in_python_with_sound_figures_plans_as_its_file_does(tmp_path):
    make_state, step, batch = _tiny()
    gpu = Target("gpu", "datasheet", 8, {"float32": 67e12, "bf16": 989e12}, 3.35e12,
                 {"intra_host": Link(5e-6, 2e-12, groups={2: Link(7e-6, 3e-12)})}, memory_per_device=80e9)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(gpu.to_json()))
    by_object = spmdkit.plan(make_state, step, batch, rules=("dp", "fsdp"), target=gpu)
    by_file = spmdkit.plan(make_state, step, batch, rules=("dp", "fsdp"), target=str(path))
    assert [(c["label"], c["step_s"]) for c in by_object["candidates"]] == \
        [(c["label"], c["step_s"]) for c in by_file["candidates"]]
    # every kind's link under collectives and none under links: a Target may (a file may not)
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
    per_kind = dataclasses.replace(gpu, links={}, collectives={k: {"intra_host": gpu.links["intra_host"]} for k in kinds})
    assert [c["step_s"] for c in spmdkit.plan(make_state, step, batch, rules=("dp", "fsdp"), target=per_kind)[
        "candidates"]] == [c["step_s"] for c in by_object["candidates"]]


def test_plan_no_rules_and_a_bad_rng_are_named():
    make_state, step, batch = _tiny()
    with pytest.raises(spmdkit.LayoutError, match=r"(?s)rules=\(\)\) leaves no layout.*Fix: pass at least one"):
        spmdkit.plan(make_state, step, batch, rules=(), target="h100x8")
    with pytest.raises(spmdkit.SignatureError, match="rng must be a PRNG key") as err:
        spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", rng="seed")
    assert isinstance(err.value, TypeError)


@pytest.mark.parametrize("rules, words", [
    (5, r"(?s)plan\(rules=5\): rules is int, not a rules name.*Fix: pass a name such as \"dp\""),
    (None, r"(?s)plan\(rules=None\): rules is NoneType.*leave rules out for the default \('dp'"),
    (b"dp", r"plan\(rules=b'dp'\): rules is bytes"),
    (spmdkit.AxisRules, r"rules is the class AxisRules, not a rules name"),
    (("dp", "fsdp", "dp"), r"(?s)plan\(rules=...\) lists 'dp' twice.*Fix: list each rules table once: drop the second"),
    (({"batch": "data"}, {"batch": "data"}), r"lists 'batch=data' twice"),
    (("dp", {}), r"(?s)holds an empty rules table.*Fix: give it rules"),
])
def test_plan_rules_of_the_wrong_kind_or_listed_twice_are_named(rules, words):
    # A non-iterable raised Python's bare TypeError, bytes named the byte 100, and a name
    # listed twice was compiled and ranked twice.
    make_state, step, batch = _tiny()
    with pytest.raises(spmdkit.LayoutError, match=words):
        spmdkit.plan(make_state, step, batch, rules=rules, target="h100x8")


def test_plan_rules_written_as_the_command_lines_comma_list_say_how_to_list_them():
    # Refused as "--rules 'dp,tp' is neither a preset, a TOML file nor name=axis pairs": a flag
    # the Python caller never used, and no word of the sequence that was meant.
    make_state, step, batch = _tiny()
    with pytest.raises(spmdkit.LayoutError, match=r"(?s)plan\(rules='dp, fsdp\+tp'\) is one entry.*rules=\('dp', 'fsdp\+tp'\)"):
        spmdkit.plan(make_state, step, batch, rules="dp, fsdp+tp", target="h100x8")
    # inline pairs keep their commas: one table
    got = spmdkit.plan(make_state, step, batch, rules="batch=data,embed=none", target="h100x8",
                       state_axes={"w": ("embed", None)})
    assert [c["rules"] for c in got["candidates"]] == ["batch=data,embed=none"]


def test_plan_with_both_train_step_and_step_for_is_named():
    # train_step was ignored without a word: each candidate's step came from step_for.
    make_state, step, batch = _tiny()
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)got both train_step and step_for.*Fix: pass train_step=None"):
        spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", step_for=lambda remat, accum: step)


def test_plan_dtype_alias_rules_string_and_dict():
    make_state, step, batch = _tiny()
    one = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", dtype="bf16")
    assert one["dtype"] == "bfloat16" and [c["label"] for c in one["candidates"]] == ["dp [data=8]"]
    lone = spmdkit.plan(make_state, None, batch, rules="dp", target="h100x8", remat="full", accum=2,
                        step_for=lambda remat, accum: step)
    assert [c["label"] for c in lone["candidates"]] == ["dp [data=8] remat=full accum=2"]
    table = spmdkit.plan(make_state, step, batch, rules=({"batch": "data", "embed": None, "hidden": None},),
                         target="h100x8")
    assert [c["label"] for c in table["candidates"]] == ["batch=data,embed=none,hidden=none [data=8]"]
    assert table["candidates"][0]["step_s"] == pytest.approx(
        spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")["candidates"][0]["step_s"])


def test_plan_keeps_an_axis_rules_replicate_unknown():
    # AxisRules(..., replicate_unknown=True) lost the flag: the name it was asked to replicate pruned the
    # candidate ("do not map"), and the same table without the flag was refused as listed twice.
    make_state = lambda rng: {"w": jnp.zeros((16, 32)), "v": jnp.zeros((64, 64))}  # noqa: E731
    step = lambda s, b: ({**s, "w": s["w"] - 0.1 * b["x"].T @ (b["x"] @ s["w"])}, {})  # noqa: E731
    table = (("batch", "data"), ("embed", "data"), ("hidden", None))
    rules = (spmdkit.AxisRules(table, "mine", replicate_unknown=True), spmdkit.AxisRules(table, "strict"))
    got = spmdkit.plan(make_state, step, {"x": jnp.ones((16, 16))}, rules=rules, target="h100x8",
                       state_axes={"w": ("embed", "hidden"), "v": ("mystery", None)})
    rows = {r["label"]: r for r in got["candidates"]}
    lenient = rows["batch=data,embed=data,hidden=none (unknown names replicated) [data=8]"]
    assert lenient["status"] == "ok" and [r["path"] for r in lenient["replicated"]] == ["state['v']"]
    assert "'mystery', which rules" in rows["batch=data,embed=data,hidden=none [data=8]"]["reason"]


def test_cli_remat_options_are_lms_policies(capsys):
    # "--remat-options none,ful" reached the planner: "step_for('ful', 1) raised ConfigError ... make step_for
    # build a step for every remat policy", a function the command line user never wrote.
    with pytest.raises(SystemExit) as err:
        main(["plan", "--task", "lm", "--devices", "2", "--remat-options", "none,ful"])
    assert err.value.code == 2
    assert "'ful' is not a remat policy: give some of none,full,dots" in capsys.readouterr().err


def test_cli_memory_per_device_must_be_positive():
    from spmdkit._plan_cli import parse_bytes

    assert parse_bytes("512MiB") == 512 * 2**20
    with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
        parse_bytes("0")
    assert parse_bytes("1E10") == parse_bytes("1e+10") == 1e10
    # A negative exponent was "expected bytes like 16e9", a second point float's ValueError ("invalid
    # parse_bytes value"), and 1e400 (inf) an error naming plan(memory_per_device=inf) after JAX started.
    assert parse_bytes("2.5e-1TB") == 250e9 and parse_bytes(".5GB") == 5e8
    with pytest.raises(argparse.ArgumentTypeError, match="expected bytes like 16e9"):
        parse_bytes("1.5.3GB")
    with pytest.raises(argparse.ArgumentTypeError, match="finite budget > 0 bytes"):
        parse_bytes("1e400")
    # "1G" as docker and ulimit take it: which one is meant, 10^9 or 2^30, is asked, not guessed.
    with pytest.raises(argparse.ArgumentTypeError, match=r"'1G' could mean 1GB \(10\^9 bytes\) or 1GiB \(2\^30"):
        parse_bytes("1G")


def test_raise_failure_of_a_killed_process_is_a_plan_run_error():
    from spmdkit._plan._processes import PlanRunError
    from spmdkit._plan_cli import _raise_failure

    with pytest.raises(PlanRunError, match=r"(?s)2 processes measuring the plan failed \(exit code -9\).*worker died"):
        _raise_failure(-9, ["[1] worker died\n"], 2)
    with pytest.raises(ConfigError, match="--rules nope"):
        _raise_failure(2, ["[1] error: --rules nope is unknown\n"], 2)


def test_cli_plan_unwritable_json_and_png_fail_before_planning(tmp_path, capsys):
    from spmdkit._plan_cli import PlanFileError, check_out

    check_out(str(tmp_path / "plan.json"), "--json")  # writable: nothing to say
    with pytest.raises(PlanFileError, match="--png .*does not exist") as err:
        check_out(str(tmp_path / "missing" / "f.png"), "--png")
    assert isinstance(err.value, OSError)
    code = main(["plan", "--task", "mlp", "--devices", "8", "--target", "h100x8", "--json", str(tmp_path)])
    assert code == 2 and "is a directory" in capsys.readouterr().err  # a wrong path: bad input (5 was the disk's)
    # A file where a folder belongs: the fix was "mkdir -p" of it, which cannot work.
    (tmp_path / "afile").write_text("")
    (tmp_path / "nowhere").symlink_to(tmp_path / "gone")
    for given, said in (("afile/p.json", f"{tmp_path / 'afile'} is a file, not a directory."),
                        ("afile/sub/p.json", f"{tmp_path / 'afile'} is a file, not a directory."),
                        ("nowhere/p.json", f"{tmp_path / 'nowhere'} is a symbolic link to {tmp_path / 'gone'}, which "
                                           "does not exist.")):
        with pytest.raises(PlanFileError, match=r"(?s)") as err:
            check_out(str(tmp_path / given), "--json")
        assert said in str(err.value) and "mkdir" not in str(err.value), str(err.value)
        assert "Fix: pass a path whose folders are directories, e.g. --json plan.json." in str(err.value)
        assert err.value.exit_code == 2
    # --json a link to a file in a missing folder: checked only beside the link, it failed after the plan,
    # with "free disk space" and exit code 5
    (tmp_path / "dangling.json").symlink_to(tmp_path / "gone" / "x.json")
    with pytest.raises(PlanFileError) as err:
        check_out(str(tmp_path / "dangling.json"), "--json")
    assert err.value.exit_code == 2 and f"(a symbolic link to {tmp_path / 'gone' / 'x.json'}): directory " \
        f"{tmp_path / 'gone'} does not exist" in str(err.value) and "mkdir -p" in str(err.value), str(err.value)


def test_cli_plan_json_in_a_place_that_refuses_the_write_is_an_io_failure(tmp_path, monkeypatch):
    import tempfile

    from spmdkit._plan_cli import PlanFileError, check_out

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)  # as a read-only directory answers (root ignores modes)
    with pytest.raises(PlanFileError, match="cannot write in") as err:
        check_out(str(tmp_path / "plan.json"), "--json")
    assert err.value.exit_code == 5


@pytest.mark.parametrize("task, args, wrong", [
    ("mlp", ["--d-model", "32", "--heads", "3", "--precision", "bf16", "--text-dir", "/nonexistent"],
     "['d_model', 'heads', 'precision', 'text_dir'] (--d-model, --heads, --precision, --text-dir)"),
    ("mlp", ["--scan-unroll", "1"], "['scan_unroll'] (--scan-unroll)"),
    ("lm", ["--depth", "7"], "['depth'] (--depth)"),
])
def test_cli_plan_refuses_another_tasks_options_as_train_does(task, args, wrong, capsys):
    code = main(["plan", "--task", task, "--devices", "8", "--rules", "dp", *args])
    err = capsys.readouterr().err
    assert code == 2 and f"task {task!r} does not take option(s) {wrong}" in err and "compiling" not in err


def test_plan_step_failing_for_every_candidate_raises_its_error():
    from spmdkit._plan._search import PlanStepError

    make_state, _, batch = _tiny()

    def bad(s, b):
        raise KeyError("boom in my step")

    with pytest.raises(PlanStepError, match="every candidate .* KeyError: 'boom in my step'") as err:
        spmdkit.plan(make_state, bad, batch, rules=("dp", "fsdp"), target="h100x8")
    assert isinstance(err.value, RuntimeError) and isinstance(err.value.__cause__, KeyError)


def test_a_failure_that_names_each_candidates_mesh_is_still_one_failure():
    # Flax's DenseGeneral constrains its flat 2-D kernel with the 3 logical names of the 3-D one:
    # JAX's error names each candidate's mesh and spec, so no two read alike, and the plan was
    # "no candidate fits" without the traceback that finds the layer.
    class Heads(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "heads", "kv"))
            return nn.DenseGeneral((4, 4), kernel_init=init)(x)

    # Every candidate now fails with the same LayoutError, which names the layer's cause and the fix
    # (Flax's raw ValueError before), raised as it is, as spmdkit's own errors are.
    make_state = lambda rng: Heads().init(rng, jnp.zeros((1, 16)))  # noqa: E731
    with pytest.raises(spmdkit.LayoutError, match=r"(?s)\(rank 3\) was applied to a value of rank 2.*"
                                                  r"nn.DenseGeneral with several features.*nn.Dense\(heads \* kv\)"):
        spmdkit.plan(make_state, lambda s, b: (s, {}), {"x": jnp.ones((16, 16))}, rules=("dp", "fsdp+tp"),
                     target="h100x8")


def test_an_object_in_aux_for_every_candidate_is_one_failure():
    # Its repr's address differs between the candidates' traces: "no candidate fits" before.
    make_state, step, batch = _tiny()
    with pytest.raises(spmdkit.StepOutputError, match=r"returned aux\['m'\] = <object object at 0x"):
        spmdkit.plan(make_state, lambda s, b: (step(s, b)[0], {"m": object()}), batch, rules=("dp", "fsdp"),
                     target="h100x8", state_axes={"w": ("embed", None)})


def test_plan_step_failing_for_every_layout_the_rules_can_take_raises_its_error():
    # With one candidate a LayoutError (12 rows over model=8) and the others all failing alike in
    # the step, the plan was "no candidate fits" with the fix "model sizes the mesh axes divide".
    from spmdkit._plan._search import PlanStepError

    make_state = lambda rng: {"w": jnp.zeros((12, 32))}  # noqa: E731

    def bad(s, b):
        raise KeyError("boom in my step")

    with pytest.raises(PlanStepError, match=r"every candidate \(2 of 3; the other 1 the rules could not lay out\) "
                       r"failed .* KeyError: 'boom in my step'") as err:
        spmdkit.plan(make_state, bad, {"x": jnp.ones((16, 16))}, rules=("dp", "fsdp", "tp"), target="h100x8",
                     state_axes={"w": ("embed", "hidden")})
    assert isinstance(err.value.__cause__, KeyError)


def test_a_long_compile_error_keeps_its_end_in_the_reason():
    # JAX's sharding errors name what is wrong last, after two meshes' reprs: the reason was cut at
    # 300 characters and read "... Sharding NamedSharding(mesh=AbstractMesh('data': 8, axis_types=(Auto,), dev".
    make_state, _, batch = _tiny()

    def step(s, b):
        raise ValueError("NamedSharding(mesh=AbstractMesh(...)) " * 20 + "was applied to a value of rank 2.")

    row = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")["candidates"][0]
    assert row["status"] == "pruned" and row["reason"].startswith("does not compile: ValueError: NamedSharding")
    assert row["reason"].endswith("was applied to a value of rank 2.") and " ... " in row["reason"], row["reason"]
    assert len(row["reason"]) < 340


def test_a_loop_of_unknown_trip_count_is_said_to_be_priced_once():
    # A while_loop on data: its 20 all-reduces under dp were priced as 1, and "unknown_loops" said so
    # in the dict alone: no flag in the table, no word in why.
    from rich.console import Console

    from spmdkit._plan import print_plan

    make_state, _, _ = _tiny()
    batch = {"x": jnp.ones((16, 16)), "n": jnp.full((16,), 20)}

    def step(s, b):
        def body(c):
            return c[0] - 1e-3 * b["x"].T @ (b["x"] @ c[0]), c[1] + 1

        return {"w": jax.lax.while_loop(lambda c: c[1] < b["n"][0], body, (s["w"], 0))[0]}, {}

    got = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")
    assert got["candidates"][0]["unknown_loops"] == 1
    assert any("priced for one trip" in line for line in got["why"]), got["why"]
    console = Console(record=True, width=300)
    print_plan(got, console)
    assert "1 loop(s) priced for one trip" in console.export_text()
    fixed = lambda s, b: ({"w": jax.lax.fori_loop(0, 20, lambda i, w: w - 1e-3 * b["x"].T @ (b["x"] @ w), s["w"])}, {})  # noqa: E731
    assert not any("one trip" in line for line in spmdkit.plan(make_state, fixed, batch, rules="dp", target="h100x8")["why"])


def test_plan_names_an_unmapped_logical_name_and_an_unused_rule():
    make_state, step, batch = _tiny()
    typo = spmdkit.plan(make_state, step, batch, rules=("dp", "tp"), target="h100x8",
                        state_axes={"w": ("embed", "hiddn")})
    reasons = [c["reason"] for c in typo["candidates"]]
    assert all("state['w'] has logical name 'hiddn'" in r for r in reasons), reasons  # not "model splits nothing"
    unused = spmdkit.plan(make_state, step, batch, rules=({"batch": "data", "embed": None, "hiden": "model"},),
                          target="h100x8", state_axes={"w": ("embed", None)})
    reason = unused["candidates"][0]["reason"]
    assert "mesh axis 'model' splits nothing" in reason and "rule(s) ['hiden'] map to it" in reason, reason
    # Two names unmapped, one of them a rule's typo: only the first was named, the typo hidden behind it.
    both = spmdkit.plan(make_state, step, batch, rules=({"batch": "data", "embd": "data", "hidden": "model"},),
                        target="h100x8", state_axes={"w": ("layer", "embed")})
    reason = both["candidates"][0]["reason"]
    assert "name 'layer', which rules" in reason and "nor do they map ['embed']" in reason, reason
    assert "rule 'embd' maps no array's name: meant 'embed'?" in reason, reason


def test_cli_plan_inline_rules_stay_one_table(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["plan", "--task", "mlp", "--layers", "1", "--depth", "16", "--embed", "8", "--batch-size", "16",
                 "--devices", "8", "--target", "h100x8", "--json", "plan.json", "--rules",
                 "dp,batch=data,layer=none,embed=none,hidden=none"])
    capsys.readouterr()
    plan = json.load(open("plan.json"))
    assert plan["model"] == {"layers": 1, "depth": 16, "embed": 8}
    labels = [c["label"] for c in plan["candidates"] if c["status"] == "ok"]
    assert code == 0 and sorted(labels) == ["batch=data,layer=none,embed=none,hidden=none [data=8]", "dp [data=8]"], labels


def _row(label, comm, step):
    return {"label": label, "status": "ok", "step_s": step, "step_s_overlapped": step, "step_s_serial": step,
            "compute_s": 1e-3, "comm_s": sum(c["seconds"] for c in comm), "memory": {"per_device": 2**20},
            "collectives": comm}


def _coll(kind, axes, seconds):
    return {"kind": kind, "axes": [axes], "bytes": 1024, "count": 1, "seconds": seconds, "link": "intra_host"}


def test_explain_runner_up_part_never_exceeds_its_total_and_empty_plans_point_nowhere():
    from spmdkit._plan import explain

    win = _row("a", [_coll("all_reduce", "data", 0.2e-3)], 1.2e-3)
    run = _row("b", [_coll("all_gather", "model", 0.35e-3)], 1.35e-3)  # +0.15 ms in all: +0.35 less 0.2
    line = explain({"candidates": [win, run]})[-1]
    assert "collectives +0.150 ms" in line and "most of it" not in line, line
    assert "all_gather over model +0.350 ms less all_reduce over data -0.200 ms" in line, line
    assert "most of it all_gather" in explain({"candidates": [_row("a", [], 1e-3), run]})[-1]
    assert "above" not in explain({"candidates": []})[0]
    over = dict(win, status="over_budget")
    assert explain({"candidates": [over]}) == ["no candidate fits: all 1 were excluded (0 pruned, 1 over the memory "
                                               "budget); each one's reason is in its \"reason\" (printed as "
                                               "\"excluded ...\"). Fix: a budget of at least 1 MiB per device "
                                               "(--memory-per-device), or more devices."]
    # 66180 B reads "64.6 KiB", which, passed back, is 66150 B: still excluded. The fix rounds up.
    odd = dict(over, memory={**over["memory"], "per_device": 66180})
    assert "a budget of at least 64.7 KiB per device" in explain({"candidates": [odd]})[0]


def test_an_exclusion_whose_need_and_budget_read_alike_gives_the_bytes():
    make_state, step, batch = _tiny()
    need = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")["candidates"][0]["memory"]["per_device"]
    (row,) = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8",
                          memory_per_device=need - 1)["candidates"]
    assert row["status"] == "over_budget" and f"({need:,.0f} B) per device, over the budget of" in row["reason"]
    assert f"({need - 1:,.0f} B)" in row["reason"]


def test_a_layout_that_one_candidate_alone_cannot_take_is_its_reason_with_a_fix(capsys):
    # 2 heads over a model axis of 8, the only candidate: the plan ended with that layout's error
    # as if the model itself were wrong (as with --devices 7, where only tp [model=7] is left).
    code = main(["plan", "--task", "lm", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16",
                 "--devices", "8", "--rules", "tp,dp", "--batch-size", "12", "--target", "h100x8"])
    out = " ".join(capsys.readouterr().out.split())  # the console wraps lines
    assert code == 2, out  # bad input: it was 1, a crash's code
    assert "excluded tp [model=8]: state.params" in out and "cannot split evenly" in out, out
    fixes = out[out.index("no candidate fits"):]
    assert "e.g. 16 rows (--batch-size 16)" in fixes and "--heads or --d-model a multiple" in fixes, fixes


def test_a_budget_no_candidate_fits_is_bad_input(capsys):
    # --memory-per-device 1B (or --devices 7 for a batch of 32) exited 1, the code of a crash.
    code = main(["plan", "--task", "lm", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16",
                 "--devices", "8", "--rules", "dp", "--memory-per-device", "1B", "--target", "h100x8"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 2 and "no candidate fits" in out and "--memory-per-device" in out, out


def test_no_fit_batch_hint_counts_the_accumulation_steps():
    # 16 rows, 8 devices x 3 accumulation steps: the fix said "e.g. 16 rows", the batch given.
    make_state, step, batch = _tiny()
    got = spmdkit.plan(make_state, None, batch, rules="dp", target="h100x8", accum=3, step_for=lambda r, a: step)
    assert "e.g. 24 rows (--batch-size 24)" in " ".join(got["why"]), got["why"]


@pytest.mark.parametrize("key", ["params", "model", "variables"])
def test_parameters_of_a_state_that_does_not_name_them_params_leave_the_optimizer_out(key):
    # {"model": params, "opt": adam}: Adam's moments were counted as parameters, 3x the parameters'
    # bytes, and again as an accumulating step's gradients (the figure over the compiled one), and
    # a replicated parameter was listed three times (it and its moments).
    # "variables": {"params": ...} and an optimizer initialised on all of it, whose moments' paths say params.
    tx = optax.adam(1e-3)
    params = lambda: {"big": jnp.zeros((128, 128)), "w": jnp.zeros((16, 128))}  # noqa: E731
    wrap = (lambda p: {"params": p}) if key == "variables" else (lambda p: p)  # noqa: E731
    make_state = lambda rng: {key: wrap(params()), "opt": tx.init(wrap(params()))}  # noqa: E731

    inner = (lambda v: v["params"]) if key == "variables" else (lambda v: v)  # noqa: E731

    def step(s, b):
        g = jax.grad(lambda v: ((b["x"] @ inner(v)["w"] @ inner(v)["big"]) ** 2).mean())(s[key])
        u, o = tx.update(g, s["opt"], s[key])
        return {key: optax.apply_updates(s[key], u), "opt": o}, {}

    got = spmdkit.plan(make_state, None, {"x": jnp.ones((16, 16))}, rules="fsdp", target="h100x8", accum=2,
                       step_for=lambda r, a: step, state_axes={"big": (None, None), "w": ("embed", None)})
    row = got["candidates"][0]
    assert row["memory"]["analytic"]["params"] == (128 * 128 + 16 * 128 // 8) * 4
    assert row["memory"]["analytic"]["gradients"] == row["memory"]["analytic"]["params"]
    big = "['params']['big']" if key == "variables" else "['big']"
    assert [r["path"] for r in row["replicated"]] == [f"state['{key}']{big}"]


def test_many_small_replicated_parameters_holding_most_of_the_memory_are_flagged():
    # 24 weights of 4% each, all left replicated by rules that shard another name: none reached the
    # 5% a parameter needs to be flagged, so the plan flagged nothing while 99% stayed replicated.
    make_state = lambda rng: {"params": {**{f"w{i:02}": jnp.zeros((32, 32)) for i in range(24)},  # noqa: E731
                                         "v": jnp.zeros((8,))}}
    axes = {"params": {**{f"w{i:02}": ("embed", "hidden") for i in range(24)}, "v": ("vocab",)}}
    got = spmdkit.plan(make_state, lambda s, b: (s, {}), {"x": jnp.ones((16, 16))}, target="h100x8",
                       rules=({"batch": "data", "vocab": "data", "embed": None, "hidden": None},), state_axes=axes)
    row = got["candidates"][0]
    assert row["status"] == "ok" and len(row["replicated"]) == 5, row
    assert all(r["shape"] == [32, 32] for r in row["replicated"])


def test_a_state_with_no_logical_names_is_said_in_why():
    # fsdp and tp ranked beside dp for a state that names nothing (the same programs but for the
    # batch), and only the "replicated" flag hinted at why.
    make_state = lambda rng: {"w": jnp.zeros((256, 256)), "b": jnp.zeros((256,))}  # noqa: E731
    step = lambda s, b: ({"w": s["w"] - 0.1 * b["x"].T @ (b["x"] @ s["w"]), "b": s["b"]}, {})  # noqa: E731
    got = spmdkit.plan(make_state, step, {"x": jnp.ones((64, 256))}, rules=("dp", "fsdp"), target="h100x8")
    note = [line for line in got["why"] if "carry no logical names" in line]
    assert len(note) == 1 and "(state['w'])" in note[0] and "state_axes=" in note[0], got["why"]
    named = spmdkit.plan(make_state, step, {"x": jnp.ones((64, 256))}, rules=("dp", "fsdp"), target="h100x8",
                         state_axes={"w": ("embed", "hidden"), "b": ("hidden",)})
    assert not any("carry no logical names" in line for line in named["why"]), named["why"]


def test_parameters_of_an_nnx_optimizers_state_leave_its_moments_out():
    # nnx.split((model, nnx.Optimizer(model, adam))): no 'params' in the paths and no optax tuples (NNX keeps
    # its own Variables under opt_state), so the moments counted as parameters, 3x their bytes.
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                                           ("embed", "hidden")), rngs=rngs)

    def make_state(rng):
        with nnx.use_eager_sharding(False):
            model = Net(nnx.Rngs(rng))
            return nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))[1]

    got = spmdkit.plan(make_state, lambda s, b: (s, {}), {"x": jnp.ones((16, 16))}, rules="dp", target="h100x8")
    analytic = got["candidates"][0]["memory"]["analytic"]
    assert analytic["params"] <= (16 * 64 + 64) * 4 + 8 and analytic["optimizer_and_rest"] >= 2 * (16 * 64 + 64) * 4


def test_over_budget_reason_in_readable_units():
    make_state, step, batch = _tiny()
    row = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", memory_per_device=100)["candidates"][0]
    assert row["status"] == "over_budget" and "KiB per device, over the budget of 100 B" in row["reason"], row["reason"]
    from rich.console import Console

    from spmdkit._plan import print_plan

    console = Console(record=True, width=200)
    print_plan(spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", memory_per_device=100), console)
    text = console.export_text()
    assert "budget 100 B per device" in text
    per_device = readable_bytes(row["memory"]["per_device"])
    assert "KiB" in per_device and per_device in text and " 0.00 " not in text  # a tiny model's memory, not 0.00 MiB


def test_a_table_no_mesh_fits_is_labelled_by_its_axes():
    kept, pruned = enumerate_candidates(6, ("hsdp+tp",), ("none",), (1,), 12)
    assert not kept and [c.label for c, _ in pruned] == ["hsdp+tp [data,fsdp,model]"]
    assert "6 devices cannot be split over axes ['data', 'fsdp', 'model']" in pruned[0][1]


def test_plan_state_axes_of_the_wrong_rank_names_path_and_both_ranks():
    from spmdkit._rules import LayoutError

    make_state, step, batch = _tiny()
    with pytest.raises(LayoutError, match=r"\('embed',\) \(1 name\(s\)\) for state\['w'\], an array of rank 2"):
        spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", state_axes={"w": ("embed",)})


def test_plan_takes_state_axes_as_lists_and_a_lone_string_as_sharded_does():
    # Sharded reads ["embed", None] as names; plan's own pass over the names did not, and said
    # "state_axes names ('e', 'm', 'b', 'e', 'd') (5 name(s)) for state['w']" before compiling anything.
    make_state, step, batch = _tiny()
    make_vector = lambda rng: {"w": jnp.zeros((16, 32)), "b": jnp.zeros(16)}  # noqa: E731
    for make, axes in ((make_state, {"w": ["embed", None]}), (make_vector, {"w": ("embed", None), "b": "embed"})):
        got = spmdkit.plan(make, lambda s, b: (s, {}), batch, rules="fsdp", target="h100x8", state_axes=axes)
        row = got["candidates"][0]
        assert row["status"] == "ok", row["reason"]
        assert row["memory"]["analytic"]["params"] == sum(x.size * 4 for x in jax.tree.leaves(make(0))) // 8


def test_plan_batch_leaves_of_different_lengths_are_named_before_compiling():
    # With one candidate it was that candidate's reason and the plan "no candidate fits".
    make_state, step, _ = _tiny()
    with pytest.raises(spmdkit.BatchSizeError, match=r"(?s)batch\['x'\] has 16, batch\['y'\] has 8.*same leading size"):
        spmdkit.plan(make_state, step, {"x": jnp.ones((16, 16)), "y": jnp.ones(8)}, rules="dp", target="h100x8")


def test_plan_batch_of_strings_is_named_by_path():
    # JAX's raw "TypeError: Dtype <U1 is not a valid JAX array type" from inside the plan before.
    make_state, step, _ = _tiny()
    batch = {"x": np.ones((16, 16), np.float32), "name": np.array(["a"] * 16)}
    with pytest.raises(spmdkit.SignatureError, match=r"batch\['name'\] has numpy dtype <U1 \(shape \(16,\)\)"):
        spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")


def test_plan_make_state_with_a_non_array_leaf_is_named():
    from spmdkit._plan._search import StateLeafError

    _, step, batch = _tiny()
    with pytest.raises(StateLeafError, match=r"make_state returned a value of type str at state\['name'\]") as err:
        spmdkit.plan(lambda rng: {"w": jnp.zeros((16, 32)), "name": "hello"}, step, batch, rules="dp", target="h100x8")
    assert isinstance(err.value, TypeError) and "Fix:" in str(err.value)
    # a numpy array of strings: JAX's own "returned a value of type <class 'numpy.ndarray'> ... not a valid JAX type"
    with pytest.raises(StateLeafError, match=r"type ndarray of dtype <U1 at state\['name'\], not an array of numbers"):
        spmdkit.plan(lambda rng: {"w": jnp.zeros((16, 32)), "name": np.array(["a", "b"])}, step, batch, rules="dp",
                     target="h100x8")


@pytest.mark.parametrize("state", [None, {}, {"params": {}}])
def test_plan_make_state_with_no_arrays_is_named(state):
    # It was pruned, or raised for two candidates, as "Sharded.step/apply got a state this
    # strategy has not laid out", naming neither make_state nor the fix.
    from spmdkit._plan._search import StateLeafError

    _, step, batch = _tiny()
    with pytest.raises(StateLeafError, match=r"make_state returned .* which holds no arrays") as err:
        spmdkit.plan(lambda rng: state, lambda s, b: (s, {}), batch, rules=("dp", "fsdp"), target="h100x8")
    assert "forgot `return`" in str(err.value)


def test_cli_plan_prints_a_calibrated_target_files_warnings(tmp_path, capsys):
    data = dict(_GOOD, warnings=["machine busy: other processes used 100% of the 2 cores",
                                 "only 3 round(s) (figures need >= 5): a smoke run"])
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    assert load_target(path).warnings == tuple(data["warnings"])
    assert from_json(json.loads(json.dumps(load_target(path).to_json()))) == load_target(path)
    code = main(["plan", "--task", "mlp", "--layers", "1", "--depth", "16", "--embed", "8", "--batch-size", "16",
                 "--devices", "8", "--target", str(path), "--rules", "dp"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "note: the target file's calibration warned 2 time(s): machine busy" in out, out
    assert "a smoke run" in out


def test_plan_checks_the_rules_against_an_nnx_models_sharding_names():
    # nnx.with_partitioning names: the rule checks read them as Sharded does (a rules name
    # maps by the rule, a mesh axis stands for itself), so a typo, a clash or an axis that
    # splits nothing is named before compiling, as for a Flax model.
    from tests._user_models import nnx_make_state, nnx_train_step  # kernels ("embed", "hidden"), ("hidden", "embed")
    batch = {"x": np.ones((16, 16), np.float32), "label": np.zeros((16,), np.int32)}
    leaves = {leaf.path: leaf for leaf in spmdkit._plan._search.logical_leaves(nnx_make_state, jax.random.key(0))}
    kernel = "state['params']['linear1']['kernel']"
    assert leaves[kernel].names == ("embed", "hidden") and leaves[kernel].direct and leaves[kernel].bytes == 16 * 32 * 4

    def reasons(rules):
        result = spmdkit.plan(nnx_make_state, nnx_train_step, batch, rules=(rules,), target="h100x8")
        return {c["label"]: (c["status"], c["reason"], c["conflicts"]) for c in result["candidates"]}

    typo = reasons({"batch": "data", "embed": None, "hiden": "model"})
    assert all(status == "pruned" and "has sharding name 'hidden'" in why for status, why, _ in typo.values()), typo
    clash = reasons({"batch": "data", "embed": "model", "hidden": "model"})
    assert any(c and c[0]["names"] == ["embed", "hidden"] and c[0]["axis"] == "model" for _, _, c in clash.values())
    fine = reasons({"batch": "data", "embed": None, "hidden": "model"})
    assert any(status == "ok" and "model=" in label for label, (status, _, _) in fine.items()), fine

    def direct_state(rng):  # a kernel sharded over the mesh axis "model" by its own name
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "model"))
        with nnx.use_eager_sharding(False):
            return {"params": nnx.state(nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(rng)), nnx.Param)}

    def direct_step(state, batch):
        return state, {"loss": jnp.zeros(())}

    # "model" is no rules name: it names the mesh axis, so it is neither unmapped nor idle there,
    # and a mesh without that axis names it.
    result = spmdkit.plan(direct_state, direct_step, batch, rules=({"batch": "data", "embed": None, "mlp": "model"},
                                                                   {"batch": "data", "embed": None}), target="h100x8")
    rows = {c["label"]: c for c in result["candidates"]}
    assert any(r["status"] == "ok" and r["mesh"].get("model", 1) > 1 for r in rows.values()), rows
    assert any(r["status"] == "pruned" and "mesh {'data': 8} has no axis of that name" in r["reason"]
               for r in rows.values()), rows


def test_readable_bytes_writes_1000_to_1023_of_a_unit_without_an_exponent():
    # :.3g alone wrote 1023 B as "1.02e+03 B" and a 1023.4 KiB memory column as "1.02e+03 KiB".
    assert readable_bytes(1023) == "1023 B" and readable_bytes(2**20 - 600) == "1023 KiB"
    assert readable_bytes(1000 * 2**20) == "1000 MiB" and readable_bytes(5 * 2**50) == "5120 TiB"
    assert readable_bytes(999) == "999 B" and readable_bytes(5000) == "4.88 KiB" and readable_bytes(2**20) == "1 MiB"
    assert readable_bytes(-(2**20 - 600)) == "-1023 KiB"


def test_hlo_printed_without_sigils_reads_the_same():
    # XLA may print HLO without the '%' before value names; the operands were then lost and a
    # step's matmul FLOPs read 16x too low, without a word.
    from spmdkit._plan._hlo import analyse, kernels

    mesh = spmdkit.make_mesh(data=2, model=4)

    def body(a, w):
        return jax.lax.fori_loop(0, 5, lambda i, v: jnp.tanh(v @ w) + jax.lax.all_gather(v[:1], "data", tiled=True).mean(0), a)

    looped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False))
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])),
                   in_shardings=({"w1": NamedSharding(mesh, P(None, "model")), "w2": NamedSharding(mesh, P("model", None))},
                                 NamedSharding(mesh, P("data"))))
    texts = [looped.lower(jnp.ones((64, 16)), jnp.ones((16, 16))).compile().as_text(),
             grad.lower({"w1": jnp.ones((16, 64)), "w2": jnp.ones((64, 8))}, jnp.ones((32, 16))).compile().as_text()]
    for text in texts:
        assert "%" in text
        bare = text.replace("%", "")
        assert analyse(bare, dict(mesh.shape)) == analyse(text, dict(mesh.shape))
        assert kernels(bare) == kernels(text)
        assert analyse(text, dict(mesh.shape)).dot_flops > 0


def test_parameters_partitioned_over_mesh_axes_as_written_use_those_axes():
    # nn.with_partitioning names mesh axes, which Sharded uses as written; plan's reading of the names
    # skipped them, so tp and dp+tp were pruned as "mesh axis 'model' splits nothing".
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(64, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")))(x)
            return nn.Dense(4, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)))(x)

    make_state = lambda rng: Model().init(rng, jnp.zeros((1, 16)))  # noqa: E731

    def step(s, b):
        g = jax.grad(lambda v: (Model().apply(v, b["x"]) ** 2).mean())(s)
        return jax.tree.map(lambda p, d: p - 0.1 * d, s, g), {}

    got = spmdkit.plan(make_state, step, {"x": jnp.ones((16, 16))}, rules=("tp", "dp+tp"), target="h100x8")
    rows = {r["label"]: r for r in got["candidates"]}
    assert all(r["status"] == "ok" for r in rows.values()), {k: r["reason"] for k, r in rows.items()}
    assert rows["tp [model=8]"]["memory"]["analytic"]["params"] == (16 * 64 + 64 * 4) * 4 // 8 + (64 + 4) * 4


def test_a_misspelt_mesh_axis_of_with_partitioning_is_named_not_an_idle_axis():
    # "modle" was dropped as no axis of the mesh, and tp/fsdp+tp were pruned as "mesh axis 'model'
    # splits nothing", which pointed away from the typo.
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "modle")))(x)

    make_state = lambda rng: Model().init(rng, jnp.zeros((1, 16)))  # noqa: E731
    got = spmdkit.plan(make_state, lambda s, b: (s, {}), {"x": jnp.ones((16, 16))}, rules=("tp", "fsdp+tp"),
                       target="h100x8")
    reasons = [r["reason"] for r in got["candidates"]]
    assert all("['Dense_0']['kernel']: dimension 1 is sharded over mesh axis 'modle'" in r for r in reasons), reasons


def test_mesh_axes_in_state_axes_are_named_as_mesh_axes_as_sharded_names_them():
    # Reported as "has logical name 'data', which rules do not map", where Sharded says a mesh
    # axis stands where a logical name belongs and lists the logical names mapped to it.
    make_state, step, batch = _tiny()
    got = spmdkit.plan(make_state, step, batch, rules="fsdp+tp", target="h100x8", state_axes={"w": ("data", "model")})
    reasons = [r["reason"] for r in got["candidates"]]
    assert reasons and all("state['w'] names mesh axes ['data', 'model']" in r and "'data' (size" in r
                           and "'batch', 'embed'" in r for r in reasons), reasons


def test_a_plain_state_without_names_prunes_an_axis_that_splits_nothing():
    # Ranked "ok" beside plain data parallelism before, though every device repeated the work.
    make_state, step, batch = _tiny()
    result = spmdkit.plan(make_state, step, batch, rules=("dp", "tp"), target="h100x8")
    status = {c["label"]: (c["status"], c.get("reason", "")) for c in result["candidates"]}
    assert status["dp [data=8]"][0] == "ok"
    assert status["tp [model=8]"] == ("pruned", "mesh axis 'model' splits nothing: no parameter's logical name nor the "
                                                "batch maps to it under rules 'tp' (only activations could use it)")


def test_a_step_time_range_prints_once_when_its_ends_agree():
    from spmdkit._plan._report import _ms_range

    assert _ms_range(0.004981, 0.0049812) == "4.981"  # no collective to overlap: one figure
    assert _ms_range(0.004981, 0.0061) == "4.981-6.100"


def _two_processes(code: str, timeout: float) -> subprocess.CompletedProcess:
    """``code`` in 2 processes of 2 devices under ``spmdkit launch``; past ``timeout`` the launcher
    and both processes get SIGKILL (the launcher has a session of its own)."""
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_")}
    argv = [sys.executable, "-m", "spmdkit._cli", "launch", "-n", "2", "--host-devices-per-process", "2", "--",
            sys.executable, "-c", code]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def test_plan_over_two_processes_refuses_arguments_that_differ_between_them():
    # Every process returns process 0's plan: process 1's own rules were dropped without a word;
    # its own state_axes or state shapes too, and measuring them hung for ever (collectives that never met).
    code = ("import jax, jax.numpy as jnp, spmdkit\n"
            "spmdkit.initialize()\n"
            "one = jax.process_index() == 1\n"
            "cases = {'rules': dict(rules='fsdp' if one else 'dp'),\n"
            "         'state_axes': dict(rules='fsdp', state_axes={'w': ('hidden', 'embed') if one else ('embed', 'hidden')},\n"
            "                            measure=1),\n"
            "         'make_state': dict(rules='fsdp', state_axes={'w': ('embed', 'hidden')}, measure=1, width=32 if one else 16)}\n"
            "for name, kw in cases.items():\n"
            "    width = kw.pop('width', 16)\n"
            "    try:\n"
            "        spmdkit.plan(lambda rng: {'w': jax.random.normal(rng, (16, width))},\n"
            "                     lambda s, b: (s, {'loss': jnp.mean(b['x'] @ s['w'])}), {'x': jnp.zeros((8, 16))},\n"
            "                     memory_per_device=2**30, measure_rounds=1, measure_steps=1, **kw)\n"
            "        print(name, 'planned', flush=True)\n"
            "    except spmdkit.ProcessMismatchError as e:\n"
            "        print('refused:', str(e).splitlines()[0], flush=True)\n")
    out = _two_processes(code, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout + out.stderr[-2000:]
    for i in (0, 1):
        assert (f"[{i}] refused: plan(rules=...) differs between processes: process 0 gave ['dp'], process 1 gave "
                "['fsdp']") in out.stdout, said
        assert (f"[{i}] refused: plan(state_axes['w']=...) differs between processes: process 0 gave ('embed', "
                "'hidden'), process 1 gave ('hidden', 'embed')") in out.stdout, said
        assert (f"[{i}] refused: plan(make_state=...) builds another state in process 1 than in process 0: "
                "state['w'] (16, 16) float32 in process 0, state['w'] (16, 32) float32 in process 1") in out.stdout, said


@pytest.mark.parametrize("when, doing", [("len(calls) > 3", r"running its step in round \d"),
                                         ("len(calls) == 1", "preparing its step")], ids=["running", "warm_up"])
def test_a_step_failing_in_one_process_while_measured_fails_in_every_process(when, doing):
    # Process 0's step failed (its callback), process 0 raised MeasureFailed, and process 1 ran on into
    # the next step's collectives: both hung until JAX's shutdown barrier aborted them, 5 minutes on.
    code = ("import sys, jax, jax.numpy as jnp, spmdkit\n"
            "spmdkit.initialize()\n"
            "calls = []\n"
            "def check(x):\n"
            "    calls.append(x)\n"
            f"    if {when}:\n"
            "        raise RuntimeError('the user check failed')\n"
            "def step(s, b):\n"
            "    g = jax.grad(lambda w: jnp.mean((b['x'] @ w) ** 2))(s['w'])\n"
            "    jax.debug.callback(check, g.sum())\n"
            "    return {'w': s['w'] - 0.1 * g}, {'loss': jnp.mean(g)}\n"
            "try:\n"
            "    spmdkit.plan(lambda rng: {'w': jax.random.normal(rng, (16, 16))}, step, {'x': jnp.ones((8, 16))},\n"
            "                 memory_per_device=2**30, rules='dp', measure=1, measure_rounds=3, measure_steps=3)\n"
            "except spmdkit.MeasureFailed as e:\n"
            "    print('failed:', str(e).splitlines()[0], bool(e.plan), flush=True)\n")
    out = _two_processes(code, timeout=150)
    said = out.stdout + out.stderr[-2000:]
    assert out.returncode == 0, said
    # the callback runs in the process of the program's first device: process 0
    assert re.search(rf"\[0\] failed: measuring dp \[data=4\] \(rank 1\) failed {doing}: "
                     r"JaxRuntimeError: .*the user check failed True", said), said
    assert re.search(rf"\[1\] failed: measuring dp \[data=4\] \(rank 1\) failed {doing}: "
                     r"StepFailedElsewhere: process 0's step failed: JaxRuntimeError: .*the user check failed True",
                     said), said


def test_plan_on_one_device_for_a_target_of_several_warns_with_the_fix():
    # A script that forgot to simulate devices planned "h100x8" for the one CPU device: every candidate
    # data=1, no collective, and the README's own example printed "winner: dp [data=1]" without a word.
    import subprocess
    import sys

    code = ("import warnings, jax, jax.numpy as jnp, spmdkit\n"
            "warnings.simplefilter('error', UserWarning)\n"
            "args = (lambda rng: {'w': jax.random.normal(rng, (16, 16))},\n"
            "        lambda s, b: (s, {'loss': jnp.mean(b['x'] @ s['w'])}), {'x': jnp.zeros((8, 16))})\n"
            "spmdkit.plan(*args, rules='dp', target='cpu')\n"  # a target of this machine: nothing to say
            "try:\n"
            "    spmdkit.plan(*args, rules='dp', target='h100x8')\n"
            "except UserWarning as w:\n"
            "    print(w)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_") and k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    said = " ".join(out.stdout.split())
    assert out.returncode == 0, out.stderr[-2000:]
    assert "plan compiles every candidate on jax.device_count() = 1 device, where a host of the target" in said, said
    assert "Fix: to plan for 8 devices on this machine, call spmdkit.use_host_devices(8) before JAX starts" in said


class _Quiet:
    def print(self, *args, **kwargs):
        pass


def test_plan_json_and_png_are_written_whole_and_strict(tmp_path, monkeypatch):
    # --json opened the file for writing first: an interrupted dump left half a file in place of
    # the previous plan; a NaN or infinite figure was written as NaN / Infinity (not JSON).
    from spmdkit import _plan
    from spmdkit._plan_cli import _write

    monkeypatch.setattr(_plan, "print_plan", lambda result, console: None)
    out, png = tmp_path / "a plan.json", tmp_path / "a plan.png"
    out.write_text('{"previous": "plan"}')
    png.write_bytes(b"old image")

    class Interrupt:
        def __str__(self):
            raise KeyboardInterrupt  # Ctrl-C in the middle of the encoding

    with pytest.raises(KeyboardInterrupt):
        _write({"candidates": [{"x": list(range(500))}], "late": Interrupt()},
               argparse.Namespace(json=str(out), png=None), _Quiet())
    assert out.read_text() == '{"previous": "plan"}'

    def half_png(result, path):
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(_plan, "save_png", half_png)
    with pytest.raises(KeyboardInterrupt):
        _write({"candidates": []}, argparse.Namespace(json=None, png=str(png)), _Quiet())
    assert png.read_bytes() == b"old image"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a plan.json", "a plan.png"]  # no temporary left
    _write({"candidates": [], "spearman": float("nan"), "step_s": [float("inf"), 1.5]},
           argparse.Namespace(json=str(out), png=None), _Quiet())
    assert json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in --json")) == {
        "candidates": [], "spearman": None, "step_s": [None, 1.5]}


def test_plan_png_without_a_suffix_is_a_png_and_another_suffix_its_format(tmp_path, monkeypatch):
    # "--png plan" was written first as ".plan.<pid>.tmp", and matplotlib refused the format 'tmp'
    # with a raw ValueError (exit code 1) after the plan was printed and its --json written.
    from spmdkit import _plan
    from spmdkit._plan_cli import _write

    monkeypatch.setattr(_plan, "print_plan", lambda result, console: None)
    make_state, step, batch = _tiny()
    result = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8")
    for name, magic in (("plan", b"\x89PNG"), ("plan.out", b"\x89PNG"), ("plan.svg", b"<?xml")):
        _write(result, argparse.Namespace(json=None, png=str(tmp_path / name)), _Quiet())
        assert (tmp_path / name).read_bytes().startswith(magic), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan", "plan.out", "plan.svg"]  # no temporary left


def test_cli_plan_json_dash_is_refused_and_a_fifo_or_link_is_written_through(tmp_path, capsys, monkeypatch):
    # "--json -" wrote a file named "-"; "--json /dev/stdout" (as root) renamed a file over
    # /dev/stdout itself, and a link given as --json was replaced by a plain file.
    from spmdkit._errors import unwritable

    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--task", "mlp", "--devices", "8", "--json", "-"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--json '-': the plan's table is what goes to stdout" in err and "--json plan.json" in err, err
    assert not (tmp_path / "-").exists()
    os.mkfifo(tmp_path / "pipe")
    assert unwritable(str(tmp_path / "pipe"), "--json 'pipe'", "--json plan.json") is None
    (tmp_path / "out").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "out" / "plan.json")
    assert main(["plan", "--task", "mlp", "--layers", "1", "--depth", "16", "--embed", "8", "--batch-size", "16",
                 "--devices", "8", "--target", "h100x8", "--rules", "dp", "--json", "link.json"]) == 0
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "out" / "plan.json").read_text())["candidates"]


def test_cli_plan_json_and_png_naming_one_file_is_an_error(tmp_path, capsys):
    # The PNG was written over the JSON just written: the plan's JSON lost without a word.
    same = str(tmp_path / "plan.out")
    assert main(["plan", "--task", "mlp", "--devices", "8", "--json", same, "--png", str(tmp_path / "." / "plan.out")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--json and --png name the same file" in err and "Fix: give each its own name" in err, err
    assert not (tmp_path / "plan.out").exists()


def test_plan_output_in_a_missing_directory_with_a_space_gives_a_command_that_makes_it(tmp_path):
    # The fix said "mkdir -p /tmp/out dir": two directories, neither of them the one missing.
    from spmdkit._plan_cli import PlanFileError, check_out

    with pytest.raises(PlanFileError, match=r"mkdir -p '.*/out dir'\)") as err:
        check_out(str(tmp_path / "out dir" / "p.json"), "--json")
    assert "--json" in str(err.value)


def test_ctrl_c_while_measuring_keeps_the_priced_plan_and_the_whole_rounds(monkeypatch):
    # Ctrl-C during --measure was a raw KeyboardInterrupt traceback: the compiled and priced plan
    # and every round measured so far were lost (no table, no --json).
    from spmdkit._plan._report import MeasureInterrupted, measure

    rows = [{"label": f"c{i}", "rank": i + 1, "status": "ok", "step_s": 1e-3 * (i + 1), "step_s_overlapped": 1e-3,
             "step_s_serial": 2e-3, "memory": {"analytic": {"total": 10}, "per_device": 10}} for i in range(3)]
    calls = []

    def prepare(row):
        def run(steps):
            calls.append(row["label"])
            if len(calls) == 3 * 4 + 2:  # in the 5th round
                raise KeyboardInterrupt
            return [float(row["rank"])] * steps
        return run, 10, "compiled"

    with pytest.raises(KeyboardInterrupt) as err:  # a script still stops
        measure({"candidates": rows}, "all", prepare, steps=2, rounds=10)
    stop = err.value
    assert isinstance(stop, MeasureInterrupted) and stop.done == 4
    assert stop.measured["interrupted"] == {"rounds_done": 4, "rounds_asked": 10} and stop.measured["rounds"] == 4
    assert [len(m["measured_rounds_s"]) for m in stop.measured["runs"]] == [4, 4, 4]  # the part round left out
    assert stop.measured["measured_fastest"] == "c0"

    make_state, step, batch = _tiny()
    from spmdkit import _plan

    monkeypatch.setattr(_plan, "_measure", lambda *a, **k: (_ for _ in ()).throw(MeasureInterrupted(None, 0, 3)))
    with pytest.raises(MeasureInterrupted) as err:
        spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", measure=1)
    assert err.value.plan["candidates"][0]["status"] == "ok" and "measured" not in err.value.plan


@pytest.mark.parametrize("fails", ["in_a_callback", "while_preparing"])
def test_a_step_that_fails_when_measured_names_the_candidate_and_keeps_the_ranking(fails, monkeypatch):
    # JAX's bare JaxRuntimeError came out, naming no candidate, the priced plan lost with it, and JAX's
    # exit handler printed the callback's error once more ("Exception ignored in atexit callback").
    from spmdkit._plan._report import MeasureFailed

    make_state, step, batch = _tiny()
    calls = []

    def callback(x):
        calls.append(x)
        if len(calls) > 2:
            raise RuntimeError("the user's own check failed")

    def checked(s, b):
        out = step(s, b)
        jax.debug.callback(callback, out[0]["w"].sum())
        return out

    if fails == "while_preparing":
        from spmdkit import _plan

        monkeypatch.setattr(_plan, "_preparer", lambda *a: (lambda row: (_ for _ in ()).throw(ValueError("no"))))
    with pytest.raises(MeasureFailed) as err:
        spmdkit.plan(make_state, checked, batch, rules="dp", target="h100x8", measure=1, measure_rounds=3,
                     measure_steps=1)
    said = str(err.value)
    if fails == "in_a_callback":
        assert re.match(r"measuring dp \[data=8\] \(rank 1\) failed running its step in round \d: "
                        r"JaxRuntimeError: .*RuntimeError: the user's own check failed", said), said
        jax.effects_barrier()  # nothing of it left pending for JAX's exit handler
    else:
        assert said.startswith("measuring dp [data=8] (rank 1) failed preparing its step: ValueError: no"), said
    assert "measure=0 (--measure 0) prices only" in said and isinstance(err.value, spmdkit.SpmdkitError)
    assert err.value.plan["candidates"][0]["status"] == "ok" and err.value.__cause__ is not None


def test_measure_says_what_it_did_not_run(capsys):
    # With every candidate over budget --measure printed an empty table and "measured fastest: None
    # (planner's rank None)"; --measure 5 with one ranked candidate measured it without a word.
    from rich.console import Console

    from spmdkit._plan._report import measure, print_measured

    over = [{"label": "dp", "status": "over_budget"}]
    none = measure({"candidates": over}, 2, lambda row: pytest.fail("ran an unranked candidate"), steps=1, rounds=3)
    assert none["runs"] == [] and none["rounds"] == 0 and none["asked"] == 2
    print_measured(none, Console(width=200))
    out = capsys.readouterr().out
    assert "nothing measured: --measure runs ranked candidates only" in out and "None" not in out
    row = {"label": "dp", "rank": 1, "status": "ok", "step_s": 1e-3, "step_s_overlapped": 1e-3, "step_s_serial": 1e-3,
           "memory": {"analytic": {"total": 10}, "per_device": 10}}
    one = measure({"candidates": [row]}, 5, lambda r: ((lambda steps: [1e-3] * steps), 10, "compiled"), steps=1, rounds=2)
    print_measured(one, Console(width=200))
    assert "measured 1 of the 5 asked: only 1 candidate(s) are ranked" in capsys.readouterr().out


def test_a_target_with_fewer_devices_per_host_and_no_inter_host_link_is_named_before_compiling():
    # Found at the first collective, after compiling, with the fix "plan for fewer processes" for a
    # run of one process: the target (calibrated on 2 devices) holds fewer devices per host.
    make_state, step, batch = _tiny()
    small = Target("calibrated", "example", 2, {"float32": 1e12}, 1e11, {"intra_host": Link(1e-5, 1e-9)})
    compiled = []
    with pytest.raises(TargetError, match=r"(?s)8 devices span 4 hosts of 2.*devices_per_host to 8.*--devices 8"):
        spmdkit.plan(make_state, step, batch, rules="dp", target=small, progress=compiled.append)
    assert compiled == []


def test_devices_that_do_not_fill_whole_hosts_are_named_before_compiling():
    # A target of 3 devices per host planned 8 devices as hosts of 3, 3 and 2, with no word.
    make_state, step, batch = _tiny()
    three = Target("three", "example", 3, {"float32": 1e12}, 1e11,
                   {"intra_host": Link(1e-5, 1e-9), "inter_host": Link(1e-4, 1e-8)})
    compiled = []
    with pytest.raises(TargetError, match=r"(?s)'three' has 3 devices per host, which 8 devices do not fill: "
                                          r"8 = 3 x 2 \+ 2.*6 or 9 devices.*devices_per_host"):
        spmdkit.plan(make_state, step, batch, rules="dp", target=three, progress=compiled.append)
    assert compiled == []


@pytest.mark.parametrize("kwargs, words", [
    ({"remat": ("none", "none")}, r"(?s)remat=\('none', 'none'\)\) \(--remat-options\) lists 'none' twice.*--remat-options none\)"),
    ({"accum": (1, 2, 1)}, r"(?s)accum=\(1, 2, 1\)\) \(--grad-accum\) lists 1 twice.*accum=\(1, 2\) \(--grad-accum 1,2\)"),
])
def test_a_remat_or_accum_listed_twice_is_named(kwargs, words):
    # The same candidate compiled twice and was ranked twice (dp [data=2] at ranks 1 to 4).
    make_state, step, batch = _tiny()
    with pytest.raises(ConfigError, match=words):
        spmdkit.plan(make_state, None, batch, rules="dp", target="h100x8", step_for=lambda r, a: step, **kwargs)


def test_plan_measured_with_this_machine_says_whether_its_links_changed_under_the_rounds(monkeypatch):
    """The cpu target times its all-reduce once, at plan start; the machine's links may change in
    the minutes the rounds take (this host has two regimes, 4x apart), and the collective-heavy
    candidates then measure at another price than they were ranked by, with nothing saying so.
    The all-reduce is timed again just before and after the rounds, and a change of more than
    1.5x is said; a target file (other hardware, on purpose) is not re-timed."""
    from rich.console import Console

    from spmdkit import _target
    from spmdkit._plan import _report

    make_state, step, batch = _tiny()
    now = dataclasses.replace(load_target("h100x8"), name="this machine",
                              source="measured at plan time on test",
                              collectives={"all_reduce": {"intra_host": Link(1e-5, 1e-9)}})
    timed = iter([Link(1e-5, 1.1e-9), Link(1e-5, 2.5e-10)])  # before the rounds; after them: 4x faster
    monkeypatch.setattr(_target, "measure_collective", lambda kind, n: (kind, n) == ("all_reduce", 8) and next(timed))
    result = spmdkit.plan(make_state, step, batch, rules="dp", target=now, measure=1, measure_rounds=2,
                          measure_steps=1)
    seen = result["measured"]["links"]
    assert seen["devices"] == 8 and seen["bytes"] == 2**20 and seen["changed"]
    assert seen["after_rounds_s"] < seen["priced_s"] / 3 < seen["before_rounds_s"]
    console = Console(record=True, width=400)
    _report.print_measured(result["measured"], console)
    said = console.export_text()
    assert "1 MiB all-reduce over 8 devices, priced at 1.975 ms, took 2.159 ms just before the rounds and " \
           "0.599 ms just after them - more than 1.5 times apart: the machine changed between pricing and measuring" in said
    # Within 1.5x: said, without the warning.
    timed = iter([Link(1e-5, 1.1e-9), Link(1e-5, 0.8e-9)])
    result = spmdkit.plan(make_state, step, batch, rules="dp", target=now, measure=1, measure_rounds=2,
                          measure_steps=1)
    assert not result["measured"]["links"]["changed"]
    # A target file describes other hardware: nothing to re-time.
    timed = iter([])
    result = spmdkit.plan(make_state, step, batch, rules="dp", target="h100x8", measure=1, measure_rounds=2,
                          measure_steps=1)
    assert "links" not in result["measured"]


def test_a_ctrl_c_while_timing_the_links_around_the_rounds_is_an_interrupted_measurement():
    from spmdkit._plan._drift import watched
    from spmdkit._plan._report import MeasureInterrupted

    about = {"source": "measured at plan time on test",
             "file": {"collectives": {"all_reduce": {"intra_host": {"alpha": 1e-5, "beta": 1e-9}}}}}

    def stop(n):
        raise KeyboardInterrupt

    with pytest.raises(MeasureInterrupted) as e:  # before the rounds: none measured
        watched(about, 8, 3, lambda: pytest.fail("measured after a Ctrl-C"), stop)
    assert e.value.measured is None
    calls = []

    def once(n):  # timed before the rounds; Ctrl-C after them
        calls.append(n)
        return Link(1e-5, 1e-9) if len(calls) == 1 else stop(n)

    with pytest.raises(MeasureInterrupted) as e:  # after them: every round kept
        watched(about, 8, 3, lambda: {"runs": [], "rounds": 3}, once)
    assert e.value.measured["rounds"] == 3 and "interrupted" not in e.value.measured  # every round ran: none cut short
