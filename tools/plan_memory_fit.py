"""Refit the lm's memory counts (``LM_FITS`` in ``src/spmdkit/_plan/_memory.py``: per program form
and jax release) to compiled figures taken by ``tools/plan_memory_table.py --json``.

The count is linear in its coefficients (arrays per layer of each kind, gathered copies),
so the fit with the least worst relative error over every candidate is a linear program:
minimise t subject to |count_i / compiled_i - 1| <= t, coefficients >= 0 (the share of the
new parameters' buffers that holds temporaries at most 1). Prints, per remat
policy, the coefficients to paste and the worst margin with them.

    python tools/plan_memory_fit.py lm.json [more.json ...]   # LM_FITS[(False, "f32")][<the files' jax>]
    python tools/plan_memory_fit.py --rolled rolled.json      # LM_FITS[(True, "f32")][...]
    python tools/plan_memory_fit.py --precision bf16 [--rolled] bf16.json   # the bf16 forms
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import plan_memory_table as table_tool
from scipy.optimize import linprog

# (section, kind): the coefficients of the unrolled counts; "gathered" has one for accumulation 1 and
# one for 2; "outputs": the share of the new parameters' buffers that holds temporaries before the
# update writes them (subtracted; at most all of them); "micro": an accumulating step's gradients of
# one micro-batch, as a share of the parameters one device holds (jax 0.12.1's programs keep 0.26
# under remat none and 0.38 under dots; without this term their fits were 7.5% and 8.3% off at worst,
# with it 6.7% and 6.9%)
TERMS = [("saved", "embed"), ("saved", "heads"), ("saved", "scores"), ("working", "embed"), ("working", "heads"),
         ("working", "scores"), ("top", "vocab"), ("kv_gathered", None), ("gathered", 0), ("gathered", 1),
         ("outputs", None), ("micro", None)]
# The rolled form's (LM_FITS[(True, ...)]): the loop gathers one layer at a time, counted by the layout (not fitted)
TERMS_ROLLED = [("saved", "embed"), ("saved", "heads"), ("saved", "scores"), ("saved", "mlp"), ("working", "embed"),
                ("working", "heads"), ("working", "scores"), ("working", "mlp"), ("top", "vocab"), ("kv_gathered", None),
                ("outputs", None)]


def bounds(terms: list) -> list[tuple[float, float | None]]:
    return [(0, 1) if term == ("outputs", None) else (0, None) for term in terms]


def unit_counts(term: tuple[str, object] | None) -> dict:
    """Counts with one coefficient 1 and the others 0 (all 0 for ``None``)."""
    counts = {"saved": {}, "working": {}, "top": {}, "kv_gathered": 0.0, "gathered": (0.0, 0.0), "micro": 0.0}
    if term is None:
        return counts
    section, kind = term
    if section in ("saved", "working", "top"):
        counts[section] = {kind: 1.0}
    elif section in ("kv_gathered", "outputs", "micro"):
        counts[section] = 1.0
    else:
        counts["gathered"] = (1.0, 0.0) if kind == 0 else (0.0, 1.0)
    return counts


def design(rows: list[dict], terms: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate: the count's basis (linear in its coefficients), its fixed part (state in
    and out, batch, and what the count adds with every coefficient 0) and the compiled figure."""
    from spmdkit._plan._memory import lm_memory

    basis, fixed, compiled = [], [], []
    for row in rows:
        args = table_tool.lm_count_args(row)
        zero = sum(lm_memory(*args, counts=unit_counts(None)).values())
        basis.append([sum(lm_memory(*args, counts=unit_counts(t)).values()) - zero for t in terms])
        fixed.append(table_tool.state_and_batch(row) + zero)
        compiled.append(row["compiled"]["total"])
    return np.array(basis, float), np.array(fixed, float), np.array(compiled, float)


def fit(basis: np.ndarray, fixed: np.ndarray, compiled: np.ndarray, bound: list) -> tuple[np.ndarray, float]:
    """Coefficients >= 0 with the least worst |count / compiled - 1|, and that worst."""
    n, k = basis.shape
    a = basis / compiled[:, None]
    b = 1 - fixed / compiled
    # variables: k coefficients, then t; a c - t <= b, -a c - t <= -b
    a_ub = np.vstack([np.hstack([a, -np.ones((n, 1))]), np.hstack([-a, -np.ones((n, 1))])])
    b_ub = np.concatenate([b, -b])
    cost = np.zeros(k + 1)
    cost[-1] = 1
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=[*bound, (0, None)], method="highs")
    if not res.success:
        raise SystemExit(f"the fit failed: {res.message}")
    return res.x[:k], float(res.x[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--rolled", action="store_true", help="fit the rolled form's counts to the rolled programs "
                   "(tools/plan_memory_table.py --scan-unroll 1)")
    p.add_argument("--precision", choices=("f32", "bf16"), default="f32",
                   help="fit the counts of this compute dtype's programs (f32)")
    a = p.parse_args()
    terms = TERMS_ROLLED if a.rolled else TERMS
    every = [r for fn in a.json for r in read_rows(fn)]
    rows = [r for r in every if r["model"] == "lm" and looped(r) == a.rolled and table_tool.precision(r) == a.precision]
    if not rows:
        raise SystemExit(nothing_to_fit(every, a.json, a.rolled, a.precision))
    releases = sorted({table_tool.jax_release(r) for r in rows})
    if len(releases) > 1:
        raise SystemExit(f"these files hold programs of {len(releases)} jax releases ({', '.join(releases)}): XLA's "
                         "buffer assignment differs between them, so each has counts of its own; fit one at a time")
    print(f"{counts_name(a.rolled, a.precision, releases[0])} (paste into src/spmdkit/_plan/_memory.py):")
    worst_of_all = 0.0
    for remat in ("none", "full", "dots"):
        got = [r for r in rows if r["remat"] == remat]
        if not got:
            continue
        basis, fixed, compiled = design(got, terms)
        coef, _ = fit(basis, fixed, compiled, bounds(terms))
        margins = (fixed + basis @ coef) / compiled - 1
        i = int(np.argmax(np.abs(margins)))
        worst_of_all = max(worst_of_all, abs(margins[i]))
        print(f"{remat}: {len(got)} candidates, worst {margins[i]:+.1%} ({got[i]['label']}, size {got[i]['size']})")
        print("   ", {f"{s}.{k}" if k is not None else s: round(float(c), 3) for (s, k), c in zip(terms, coef)})
    if worst_of_all > 0.10:
        print(f"warning: the best fit of this form is {worst_of_all:.1%} off at worst (the planner's target is 10%)")


def nothing_to_fit(rows: list[dict], paths: list[str], rolled: bool, precision: str) -> str:
    """Why ``rows`` (read from ``paths``) hold nothing to fit as asked, with what they do hold and the fix."""
    wanted = f"{'rolled' if rolled else 'unrolled'} {precision} lm"
    take = (f"take them with tools/plan_memory_table.py --only lm --precision {precision} --json FILE"
            + (" --scan-unroll 1" if rolled else ""))
    if not rows:
        return f"{', '.join(paths)}: no candidates at all; {take}"
    held: dict[tuple[str, ...], int] = {}  # (form, precision, "lm") or (model,)
    for r in rows:
        lm = r["model"] == "lm"
        kind = ("rolled" if looped(r) else "unrolled", table_tool.precision(r), "lm") if lm else (r["model"],)
        held[kind] = held.get(kind, 0) + 1
    have = ", ".join(f"{n} {' '.join(kind)}" for kind, n in sorted(held.items()))
    lm = [kind for kind in held if len(kind) == 3]
    fix = take
    if len(lm) == 1:
        form, dtype, _ = lm[0]
        fix = (f"fit those with: python tools/plan_memory_fit.py{' --rolled' if form == 'rolled' else ''} "
               f"--precision {dtype} {' '.join(paths)}")
    return f"no {wanted} candidates in {', '.join(paths)}: they hold {have}; {fix}"


def counts_name(rolled: bool, precision: str, release: str) -> str:
    """Where in ``_plan/_memory.py`` a fit of these programs goes: its form's entry of ``LM_FITS``
    for the jax release that compiled them.

        >>> counts_name(False, "bf16", "0.12.1")
        'LM_FITS[(False, "bf16")][(0, 12, 1)]'
    """
    return f'LM_FITS[({rolled}, "{precision}")][{table_tool.release_key(release)}]'


def looped(row: dict) -> bool:
    """Whether the candidate's program is the rolled form (a loop over layers), as the count decides it."""
    from spmdkit._plan._memory import lm_looped

    return lm_looped(table_tool.lm_count_args(row)[0])


def read_rows(path: str) -> list[dict]:
    """The candidates of one ``plan_memory_table.py --json`` file, or a clear exit."""
    keys = ("model", "size", "remat", "accum", "rules", "mesh", "label", "compiled", "analytic")
    try:
        with open(path) as fh:
            rows = json.load(fh)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read it as JSON ({e}); write it with tools/plan_memory_table.py --json") from e
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in keys) for r in rows):
        raise SystemExit(f"{path}: not a list of candidates with {', '.join(keys)}; write it with "
                         "tools/plan_memory_table.py --json")
    return rows


if __name__ == "__main__":
    main()
