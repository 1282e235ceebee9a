"""The planner's analytic memory count (spmdkit._plan._memory) against the compiled figure."""

from __future__ import annotations

import json

import pytest

from spmdkit._cli import main
from spmdkit._plan._candidates import rules_table
from spmdkit._plan._memory import Kept, gathered_bytes, kept_bytes, pieces

# Every rules preset the planner tries by default, on 8 devices.
ALL_RULES = "dp,fsdp,tp,dp+tp,fsdp+tp,fsdp+sp,hsdp+tp"


def _plan(tmp_path, capsys, *flags: str, accum: str = "1,2") -> tuple[dict, str]:
    out = tmp_path / "plan.json"
    code = main(["plan", "--devices", "8", "--rules", ALL_RULES, "--target", "h100x8", "--grad-accum", accum,
                 "--json", str(out), *flags])
    assert code == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def _check_margins(plan: dict, rules: set[str], within: float = 0.10,
                   accum: frozenset[int] = frozenset({1, 2}), over: float | None = None) -> None:
    """Every ok candidate's analytic count within ``within`` of the compiled figure; with
    ``over``, it may exceed the compiled figure by up to ``over`` (never fall short by more
    than ``within``: a count under the real need would admit a layout that does not fit)."""
    ok = [r for r in plan["candidates"] if r["status"] == "ok"]
    assert {r["rules"] for r in ok} == rules and {r["accum"] for r in ok} == accum
    for r in ok:
        mem = r["memory"]
        analytic, compiled = mem["analytic"]["total"], mem["compiled"]["total"]
        assert mem["margin"] == pytest.approx(analytic / compiled - 1)
        assert mem["per_device"] == max(analytic, compiled)  # the budget uses the larger
        assert mem["analytic"]["activations"] == sum(mem["analytic"]["activation_parts"].values()) > 0
    high = within if over is None else over
    off = {r["label"]: f"{r['memory']['margin']:+.3f}" for r in ok
           if not -within <= r["memory"]["margin"] <= high}
    assert not off, f"analytic count outside -{within:.0%}..+{high:.0%} of the compiled figure: {off}"


# Not yet the 10% the planner aims at. The lm's per-kind counts were fitted on its rolled
# layer scan; the lm now unrolls its layers by default, and XLA keeps less alive across
# unrolled layers, so under remat none the count is over by up to 30% (never under): the
# bound below guards that, until the counts are refitted on the unrolled program. Under
# remat full and dots it is within 16% (plain data parallelism is over the most).
# Accumulation is tried under remat none only (the count of its extra gradients does not
# depend on the policy), to keep the compile time down.
@pytest.mark.parametrize(("remat", "within", "over", "accum"),
                         [("none", 0.10, 0.35, "1,2"), ("full", 0.16, None, "1"), ("dots", 0.16, None, "1")])
def test_lm_analytic_memory_close_to_compiled(tmp_path, capsys, remat, within, over, accum):
    plan, printed = _plan(tmp_path, capsys, "--task", "lm", "--layers", "2", "--d-model", "32", "--heads", "8",
                          "--seq-len", "32", "--batch-size", "16", "--remat-options", remat, accum=accum)
    assert {r["remat"] for r in plan["candidates"]} == {remat}
    _check_margins(plan, set(ALL_RULES.split(",")), within, {int(a) for a in accum.split(",")}, over)
    assert "margin" in printed
    assert "analytic count: state in and out, batch share, and the model's activations" in printed


def test_mlp_analytic_memory_within_10_percent_of_compiled(tmp_path, capsys):
    plan, _ = _plan(tmp_path, capsys, "--task", "mlp")  # the default size: 4 layers 128 -> 512 -> 128, batch 64
    _check_margins(plan, set(ALL_RULES.split(",")) - {"fsdp+sp"})  # the mlp has no sequence to split


def test_pieces_follow_the_rules_in_order_as_flax_does():
    mesh = {"data": 2, "fsdp": 2, "model": 2, "sequence": 1}
    residual = ("batch", "length", "embed")
    # FSDP maps batch and embed both to "data": batch, the earlier rule, takes it.
    assert pieces(residual, rules_table("fsdp").table, {"data": 8}) == 8
    assert pieces(residual, rules_table("fsdp+sp").table, {"data": 2, "model": 4}) == 8  # batch and length
    assert pieces(residual, rules_table("tp").table, {"model": 8}) == 1  # tensor parallel: the stream is whole
    assert pieces(("batch", "length", "heads", "kv"), rules_table("hsdp+tp").table, mesh) == 8
    rows = kept_bytes([Kept(residual, 10, 4, count=3)], 16, rules_table("dp").table, {"data": 8})
    assert rows == 3 * 16 * 10 * 4 // 8


def test_gathered_parameters_are_whole_over_batch_axes_only():
    w = [(("embed", "mlp"), 4096)]
    assert gathered_bytes(w, rules_table("fsdp").table, {"data": 8}) == 4096  # FSDP gathers the whole matrix
    assert gathered_bytes(w, rules_table("fsdp+tp").table, {"data": 2, "model": 4}) == 1024  # still split over model
    assert gathered_bytes(w, rules_table("tp").table, {"model": 8}) == 512
