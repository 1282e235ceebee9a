"""The loop's hooks used alone around a user's own loop (spmdkit._train._hooks)."""

from __future__ import annotations

import pytest

import spmdkit
from spmdkit import EvalHook, MetricsHook, StepInfo, run_hooks


@pytest.mark.parametrize("name", ["step", "split", "epoch", "steps_per_sec", "elapsed_s"])
def test_a_metric_named_like_a_row_field_is_refused_not_overwritten(name):
    # {"split": "train", "step": 3, **metrics}: a metric "step" replaced the row's step, silently.
    rows = []
    info = StepInfo(3, 0, None, {"loss": 1.0, name: 7.0})
    with pytest.raises(spmdkit.ConfigError, match=rf"(?s)MetricsHook: metric\(s\) \['{name}'\].*Fix: rename"):
        run_hooks([MetricsHook(rows.append)], info)
    with pytest.raises(spmdkit.ConfigError, match=rf"EvalHook: evaluate\(state\): metric\(s\) \['{name}'\]"):
        run_hooks([EvalHook(lambda state: {"loss": 1.0, name: 7.0}, rows.append, every=1)], info)
    assert rows == []
