"""The planner's analytic memory count (spmdkit._plan._memory) against the compiled figure."""

from __future__ import annotations

import json

import jax
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
                   accum: frozenset[int] = frozenset({1, 2})) -> None:
    """Every ok candidate's analytic count within ``within`` of the compiled figure."""
    ok = [r for r in plan["candidates"] if r["status"] == "ok"]
    assert {r["rules"] for r in ok} == rules and {r["accum"] for r in ok} == accum
    for r in ok:
        mem = r["memory"]
        analytic, compiled = mem["analytic"]["total"], mem["compiled"]["total"]
        assert mem["margin"] == pytest.approx(analytic / compiled - 1)
        assert mem["per_device"] == max(analytic, compiled)  # the budget uses the larger
        assert mem["analytic"]["activations"] == sum(mem["analytic"]["activation_parts"].values()) > 0
    off = {r["label"]: f"{r['memory']['margin']:+.3f}" for r in ok if abs(r["memory"]["margin"]) > within}
    assert not off, f"analytic count outside +-{within:.0%} of the compiled figure: {off}"


# The lm at its small size under every remat policy, accumulation under remat none only, to
# keep the compile time down. The sweep of three sizes x policies x accumulation 1 and 2
# (BENCHMARKS.md, "plan: analytic memory count vs compiled figure") is
# tools/plan_memory_table.py, outside the tests: it compiles ~220 candidates.
# Under remat full the fitted count's worst over the seven sizes of the fit is 10.3% on jax
# 0.12.0.1 and 10.95% on 0.12.1 (BENCHMARKS.md): that policy is held to 11%, the others to 10%.
# On jax 0.10.2 it is 17.5%: that XLA keeps remat's savings in the unrolled lm under some layouts
# and not others (README, "Remat on jax 0.10.2 saves little in the unrolled lm"), which a count
# per layer cannot follow.
# Mixed precision (bfloat16 compute, float32 parameters) makes other programs: XLA:CPU computes
# most bfloat16 operations in float32 and keeps both, so the float32 counts at bfloat16's 2
# bytes were up to 44% under (38% at this size). It has counts of its own.
FULL_WITHIN = 0.18 if jax.__version_info__ < (0, 12) else 0.11


@pytest.mark.parametrize(("remat", "accum", "within", "precision"),
                         [("none", "1,2", 0.10, "f32"), ("full", "1", FULL_WITHIN, "f32"), ("dots", "1", 0.10, "f32"),
                          ("none", "1,2", 0.10, "bf16")])
def test_lm_analytic_memory_within_10_percent_of_compiled(tmp_path, capsys, remat, accum, within, precision):
    plan, printed = _plan(tmp_path, capsys, "--task", "lm", "--layers", "2", "--d-model", "32", "--heads", "8",
                          "--seq-len", "32", "--batch-size", "16", "--remat-options", remat,
                          "--precision", precision, accum=accum)
    assert {r["remat"] for r in plan["candidates"]} == {remat}
    _check_margins(plan, set(ALL_RULES.split(",")), within, {int(a) for a in accum.split(",")})
    assert "margin" in printed
    assert "analytic count: state in and out, batch share, and the model's activations" in printed


# The unrolled lm under FSDP holds every layer's gathered parameters whatever the rows per
# device (here 16): a count that added them only up to 8 rows was 11.8% under.
def test_lm_count_holds_fsdp_gathers_at_many_rows_per_device(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--devices", "8", "--rules", "dp,fsdp", "--target", "h100x8", "--task", "lm", "--layers", "2",
                 "--d-model", "32", "--heads", "8", "--seq-len", "32", "--batch-size", "128",
                 "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    _check_margins(plan, {"dp", "fsdp"}, accum=frozenset({1}))
    fsdp = next(r for r in plan["candidates"] if r["rules"] == "fsdp" and r["mesh"] == {"data": 8})["memory"]
    assert fsdp["analytic"]["activation_parts"]["gathered"] > 0


# The new parameters' buffers hold at most the temporaries there are: with remat full and
# accumulation over many layers the fitted share of the parameters exceeded the step's
# activations, and the plan showed a negative count of them (-412 kB at 8 layers).
def test_lm_activation_count_is_never_negative():
    from spmdkit._plan._candidates import Candidate
    from spmdkit._plan._memory import LM_FITS, held_in_new_parameters, lm_activations, lm_memory
    from spmdkit._tasks.lm import LMConfig

    cfg = LMConfig(layers=8, d_model=64)
    table = list(rules_table("dp").table)
    raw = lm_memory(cfg, 8, "full", 2, table, {"data": 8}, counts=LM_FITS[(False, "f32")][(0, 12, 1)]["full"])
    assert sum(raw.values()) < 0  # the fitted count alone (jax 0.12.1's)
    parts = held_in_new_parameters(raw)
    assert sum(parts.values()) == 0 and parts["in_new_parameters"] < 0
    assert all(v >= 0 for k, v in parts.items() if k != "in_new_parameters")
    # what the planner counts with the running jax's fit
    parts = lm_activations(cfg, 16)(Candidate((("data", 8),), "dp", "full", 2), 8, 8)
    assert sum(parts.values()) >= 0 and all(v >= 0 for k, v in parts.items() if k != "in_new_parameters")


def test_mlp_analytic_memory_within_10_percent_of_compiled(tmp_path, capsys):
    plan, _ = _plan(tmp_path, capsys, "--task", "mlp")  # the default size: 4 layers 128 -> 512 -> 128, batch 64
    _check_margins(plan, set(ALL_RULES.split(",")) - {"fsdp+sp"})  # the mlp has no sequence to split


# Where XLA keeps an FSDP layer's gathered weights: in temporaries of their own while the new
# state's stacked leaf on one device holds less than one gathered layer (4 layers over
# data=8: +4 MiB at 1024 x 256), in that leaf's buffer once it holds as much (8 layers). A
# count that followed the rows per device instead was 38% under at 4 layers.
@pytest.mark.parametrize("layers", [4, 8])
def test_mlp_count_follows_where_xla_keeps_the_gathered_weights(tmp_path, capsys, layers):
    out = tmp_path / "plan.json"
    assert main(["plan", "--devices", "8", "--rules", "fsdp", "--target", "h100x8", "--grad-accum", "1,2",
                 "--task", "mlp", "--layers", str(layers), "--depth", "1024", "--embed", "256", "--batch-size", "128",
                 "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    _check_margins(plan, {"fsdp"})
    step = next(r for r in plan["candidates"] if r["accum"] == 1)["memory"]
    gathered = step["analytic"]["activation_parts"]["gathered"]
    assert (gathered > 3 * 2**20) == (layers == 4)  # two 1 MiB matrices, forward and backward, less the share held
    assert (step["compiled"]["temp"] > 3 * 2**20) == (layers == 4)


def test_gathered_weights_are_hosted_once_the_stacked_share_holds_a_layer():
    from spmdkit._plan._memory import hosted, layer_parts

    layer = [(("embed", "hidden"), 4096), (("hidden", "embed"), 4096)]
    fsdp, fsdp_tp = list(rules_table("fsdp").table), list(rules_table("fsdp+tp").table)
    assert not hosted(layer, 4, fsdp, {"data": 8}) and hosted(layer, 8, fsdp, {"data": 8})
    assert hosted(layer, 4, fsdp_tp, {"data": 4, "model": 2}) and not hosted(layer, 2, fsdp_tp, {"data": 4, "model": 2})
    assert hosted(layer, 1, list(rules_table("dp").table), {"data": 8})  # nothing is gathered
    extra = 2 * (4096 - 512)
    assert layer_parts(layer, 4, 1, fsdp, {"data": 8}) == {"gathered": 2 * extra, "micro_gradients": 0}
    assert layer_parts(layer, 8, 1, fsdp, {"data": 8}) == {"gathered": 0, "micro_gradients": 0}
    # accumulating, the running gradient's gathered layer stays in a temporary of its own
    assert layer_parts(layer, 8, 2, fsdp, {"data": 8}) == {"gathered": extra, "micro_gradients": 1024}


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


def test_lm_count_follows_the_program_form():
    from spmdkit._plan._memory import lm_counts, lm_looped, lm_memory, lm_params
    from spmdkit._tasks.lm import LMConfig

    unrolled, rolled = LMConfig(layers=4, d_model=32, heads=4), LMConfig(layers=4, d_model=32, heads=4, scan_unroll=1)
    assert not lm_looped(unrolled) and lm_looped(rolled) and lm_looped(LMConfig(layers=4, scan_unroll=2))
    table, mesh = list(rules_table("fsdp").table), {"data": 8}
    whole = sum(nbytes for _, nbytes in lm_params(unrolled))
    # 8 rows on 8 devices: XLA gathers. Unrolled, every layer's parameters at once; in a loop, one layer's.
    got = lm_memory(unrolled, 8, "none", 1, table, mesh)
    assert got["gathered"] == int(lm_counts(unrolled, "none")["gathered"][0] * (whole - whole // 8))
    layer = lm_memory(rolled, 8, "none", 1, table, mesh)["gathered"]
    assert 0 < layer < (whole - whole // 8) / 2  # one layer and the embeddings, not four layers
    assert lm_counts(rolled, "none") != lm_counts(unrolled, "none")


def test_cli_scan_unroll_plans_and_counts_the_rolled_program(tmp_path, capsys):
    # --scan-unroll 1: the planner must compile the rolled program the run will train, and count it
    # with the rolled fit (the two keep different activations), not the default's unrolled one.
    from spmdkit._plan._candidates import Candidate
    from spmdkit._plan._memory import lm_activations, lm_looped
    from spmdkit._tasks.lm import LMConfig

    sizes = {"layers": 2, "d_model": 32, "heads": 8, "seq_len": 32}
    flags = ["--task", "lm", *(f for k, v in sizes.items() for f in (f"--{k.replace('_', '-')}", str(v))),
             "--batch-size", "16"]
    rows = {}
    for form, extra in (("rolled", ["--scan-unroll", "1"]), ("unrolled", [])):
        out = tmp_path / f"{form}.json"
        assert main(["plan", "--devices", "8", "--rules", "fsdp", "--target", "h100x8", "--json", str(out),
                     *flags, *extra]) == 0
        plan = json.loads(out.read_text())
        _check_margins(plan, {"fsdp"}, accum=frozenset({1}))
        rows[form] = plan["candidates"][0]["memory"]
    rolled = LMConfig(**sizes, scan_unroll=1)
    assert lm_looped(rolled) and not lm_looped(LMConfig(**sizes))
    want = lm_activations(rolled, 16)(Candidate((("data", 8),), "fsdp", "none", 1), 8, 8)
    assert rows["rolled"]["analytic"]["activation_parts"] == want != rows["unrolled"]["analytic"]["activation_parts"]
    # the compiled programs differ too: the flag reached the step compiled, not the count alone
    assert rows["rolled"]["compiled"]["temp"] != rows["unrolled"]["compiled"]["temp"]


def test_lm_counts_follow_the_compute_dtype():
    from spmdkit._plan._memory import LM_FITS, fitted_release, lm_counts
    from spmdkit._tasks.lm import LMConfig

    for cfg, form in ((LMConfig(layers=4), (False, "f32")), (LMConfig(layers=4, precision="bf16"), (False, "bf16")),
                      (LMConfig(layers=4, scan_unroll=1), (True, "f32")),
                      (LMConfig(layers=4, scan_unroll=1, precision="bf16"), (True, "bf16"))):
        counts = LM_FITS[form][fitted_release(LM_FITS[form], jax.__version_info__)]
        assert all(lm_counts(cfg, remat) is counts[remat] for remat in ("none", "full", "dots"))


# XLA's buffer assignment changes between releases, so counts are per release they were fitted
# to: jax 0.12.1's XLA:CPU keeps 7-21% fewer temporaries for the same steps.
def test_lm_counts_are_those_of_the_running_jax_release():
    from spmdkit._plan._memory import LM_FITS, fitted_release, lm_counts
    from spmdkit._tasks.lm import LMConfig

    # every form fitted to the same releases, each with every policy and term the count reads
    assert {frozenset(fits) for fits in LM_FITS.values()} == {frozenset({(0, 10, 2), (0, 12, 0, 1), (0, 12, 1)})}
    for (rolled, _), fits in LM_FITS.items():
        for counts in fits.values():
            assert set(counts) == {"none", "full", "dots"}
            keys = {"saved", "working", "top", "kv_gathered", "outputs"} | (set() if rolled else {"gathered", "micro"})
            assert all(keys <= set(c) for c in counts.values())
    unrolled = LM_FITS[(False, "f32")]
    assert unrolled[(0, 12, 1)]["none"] != unrolled[(0, 12, 0, 1)]["none"]
    cfg = LMConfig(layers=4)
    # an older jax takes the oldest fit; a post-release (0.12.0.1) counts as its release (0.12.0)
    for version, release in (((0, 10, 1), (0, 10, 2)), ((0, 10, 2), (0, 10, 2)), ((0, 11, 0), (0, 10, 2)),
                             ((0, 12, 0), (0, 12, 0, 1)), ((0, 12, 0, 1), (0, 12, 0, 1)), ((0, 12, 0, 2), (0, 12, 0, 1)),
                             ((0, 12, 1), (0, 12, 1)), ((0, 13, 0), (0, 12, 1))):
        assert fitted_release(unrolled, version) == release
        assert lm_counts(cfg, "full", version) is unrolled[release]["full"]
    assert lm_counts(cfg, "none") is unrolled[fitted_release(unrolled, jax.__version_info__)]["none"]
