"""The loop's hooks used alone around a user's own loop (spmdkit._train._hooks)."""

from __future__ import annotations

import json

import numpy as np
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


@pytest.mark.parametrize("every", [0, -2, 2.5, True, None, "5"])
@pytest.mark.parametrize("make", [
    lambda every: MetricsHook([].append, every=every),
    lambda every: EvalHook(lambda state: {"loss": 1.0}, [].append, every=every),
    lambda every: spmdkit.CheckpointHook(spmdkit.Checkpointer.__new__(spmdkit.Checkpointer), every=every,
                                         meta=lambda info: {}),
    lambda every: spmdkit.ProgressHook(10, "t", every=every),
    lambda every: spmdkit.NaNGuard(every=every),
], ids=["MetricsHook", "EvalHook", "CheckpointHook", "ProgressHook", "NaNGuard"])
def test_every_that_is_not_a_whole_number_of_steps_is_named(make, every):
    # every=0 was a bare ZeroDivisionError at the first step; -2 ran at every even step and
    # 2.5 at every fifth, silently.
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)\(every=.*\): every must be a whole number of steps >= 1"):
        make(every)


def test_run_hooks_takes_plain_functions_as_every_step_hooks_and_names_a_bad_every():
    seen = []
    for step in (1, 2, 3):
        run_hooks([seen.append, MetricsHook([].append, every=2)], StepInfo(step, 0, None, {"loss": 1.0}))
    assert [info.step for info in seen] == [1, 2, 3]  # was AttributeError: no attribute 'every'

    class Mine:
        every = 0

        def __call__(self, info):
            pass

    with pytest.raises(spmdkit.ConfigError, match=r"run_hooks: hooks\[1\] is Mine\(every=0\)"):
        run_hooks([seen.append, Mine()], StepInfo(1, 0, None, {}))


def test_close_writes_the_steps_since_the_last_row():
    # A loop of 7 steps with every=5 recorded steps 1-5 only: steps 6 and 7 were lost.
    rows = []
    hook = MetricsHook(rows.append, every=5)
    for step in range(1, 8):
        info = StepInfo(step, 0, None, {"loss": float(step)})
        hook.add(info)
        run_hooks([hook], info)
    hook.close(info, "completed")
    hook.close(info, "completed")  # nothing twice
    assert [(row["step"], row["loss"]) for row in rows] == [(5, 3.0), (7, 6.5)]


def test_metrics_hook_alone_in_run_hooks_gives_window_means_and_the_steps_rate(monkeypatch):
    """The module's own example (MetricsHook(rows.append, every=5) in run_hooks, no add) wrote
    each row with the last step's metrics alone and a steps_per_sec of 1 step over 5 steps' time."""
    from spmdkit._train import _hooks

    now = [0.0]
    monkeypatch.setattr(_hooks.time, "perf_counter", lambda: now[0])
    rows = []
    hooks = [MetricsHook(rows.append, every=5)]
    for step in range(1, 11):
        now[0] += 1.0  # one second a step
        run_hooks(hooks, StepInfo(step, 0, None, {"loss": float(step)}))
    assert [(r["step"], r["loss"], r["steps_per_sec"]) for r in rows] == [(5, 3.0, 1.0), (10, 8.0, 1.0)]


def test_metrics_hook_counts_a_step_once_and_each_metric_over_the_steps_that_gave_it():
    # add() every step, as the docstring once asked, and run_hooks: counted twice, halving nothing but the rate.
    rows = []
    hook = MetricsHook(rows.append, every=4)
    for step in range(1, 5):
        info = StepInfo(step, 0, None, {"loss": 1.0, **({"acc": 1.0} if step % 2 else {})})
        hook.add(info)
        run_hooks([hook], info)
    assert rows[0]["loss"] == 1.0 and rows[0]["acc"] == 1.0  # acc read 0.5: its 2 values over 4 steps
    assert hook._count == 0 and rows[0]["steps_per_sec"] > 0


def test_metrics_hook_subclass_add_is_what_run_hooks_counts_and_a_hand_call_repeats_its_step():
    seen = []

    class Counting(MetricsHook):
        def add(self, info):
            seen.append(info.step)
            super().add(info)

    rows = []
    hook = Counting(rows.append, every=2)
    for step in (1, 2):
        run_hooks([hook], StepInfo(step, 0, None, {"loss": float(step)}))
    assert seen == [1, 2] and rows[-1]["loss"] == 1.5
    hook(StepInfo(2, 0, None, {"loss": 2.0}))  # by hand, at the same step again: that step's metrics, not an empty row
    assert rows[-1]["step"] == 2 and rows[-1]["loss"] == 2.0


def test_metrics_hook_names_a_metric_whose_shape_changes_within_a_row():
    import numpy as np

    hook = MetricsHook([].append, every=2)
    run_hooks([hook], StepInfo(1, 0, None, {"hist": np.ones(3)}))
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)metric 'hist' has shape \(4,\) at step 2.*\(3,\).*Fix: give"):
        run_hooks([hook], StepInfo(2, 0, None, {"hist": np.ones(4)}))


def test_nested_metrics_are_flattened_and_a_non_number_is_named():
    import jax.numpy as jnp

    rows = []
    info = StepInfo(1, 0, None, {"loss": jnp.float32(1.0), "grad_norm": {"w": jnp.float32(2.0), "b": 3}})
    run_hooks([MetricsHook(rows.append)], info)  # was TypeError: float() argument ... not 'dict'
    assert rows[0]["grad_norm/w"] == 2.0 and rows[0]["grad_norm/b"] == 3.0
    with pytest.raises(spmdkit.ConfigError, match=r"(?s)metric 'tag' is str 'abc', not a number.*Fix: leave 'tag'"):
        run_hooks([MetricsHook(rows.append)], StepInfo(1, 0, None, {"loss": 1.0, "tag": "abc"}))


@pytest.mark.parametrize("step, metrics, words", [
    (1, None, r"StepInfo.metrics is NoneType None; it must be a dict"),
    (1, 0.5, r"StepInfo.metrics is float 0.5; it must be a dict"),
    (1, (0.5, 0.9), r"StepInfo.metrics is tuple \(0.5, 0.9\)"),
    (None, {"loss": 1.0}, r"StepInfo.step=None must be the steps done"),
    (1.5, {"loss": 1.0}, r"StepInfo.step=1.5"),
    (-1, {"loss": 1.0}, r"StepInfo.step=-1"),
])
def test_a_step_info_of_the_wrong_kind_is_named(step, metrics, words):
    # A bare loss as metrics was AttributeError: 'float' object has no attribute 'get' in NaNGuard.
    with pytest.raises(spmdkit.ConfigError, match=words):
        run_hooks([spmdkit.NaNGuard(), MetricsHook([].append)], StepInfo(step, 0, None, metrics))


def test_eval_rows_hold_python_numbers_as_metrics_rows_do():
    # A record that json.dumps each row (a user's own writer) failed on EvalHook's rows: they held
    # the evaluate's device arrays and NumPy scalars as given, where MetricsHook's hold floats.
    import json

    import jax.numpy as jnp

    rows = []
    hook = EvalHook(lambda state: {"loss": jnp.float32(0.5), "acc": np.float32(0.25), "per": {"a": jnp.ones(())}},
                    rows.append, every=1)
    run_hooks([hook], StepInfo(1, 0, None, {}))
    assert rows == [{"split": "eval", "step": 1, "loss": 0.5, "acc": 0.25, "per/a": 1.0}]
    assert all(type(v) is float for k, v in rows[0].items() if k not in ("split", "step"))
    json.dumps(rows[0])

def test_metrics_hook_window_resumes_a_row_and_flush_keeps_it():
    # A run stopped between rows: its window, resumed, gives the row an uninterrupted hook gives.
    rows, whole = [], []
    hook, ref = MetricsHook(rows.append, every=4), MetricsHook(whole.append, every=4)
    for step in range(1, 9):
        info = StepInfo(step, 0, None, {"loss": float(step), "member": [step, -step]})
        run_hooks([ref], info)
        if step <= 6:
            run_hooks([hook], info)
    hook.flush(StepInfo(6, 0, None, {}))  # a row at the stop, the steps kept counted
    hook.flush(StepInfo(6, 0, None, {}))  # nothing twice
    window = json.loads(json.dumps(hook.window()))  # as a checkpoint's meta keeps it
    again = MetricsHook(rows.append, every=4)
    again.resume(window)
    for step in (7, 8):
        run_hooks([again], StepInfo(step, 0, None, {"loss": float(step), "member": [step, -step]}))
    assert [r["step"] for r in rows] == [4, 6, 8] and rows[1]["loss"] == 5.5
    assert rows[2]["loss"] == whole[1]["loss"] == 6.5 and rows[2]["member_member"] == whole[1]["member_member"]
    assert rows[2]["elapsed_s"] >= window["elapsed_s"]
    MetricsHook([].append).resume({"sums": "not a window"})  # an older checkpoint's meta: ignored


def test_a_step_given_again_or_going_back_is_said_and_not_written_twice():
    # Steps 1, 2, 2, 3, 4, 1, 2 (a retried step, a restarted loop) wrote rows at 2, 2, 4, 2 without
    # a word, the second "step 2" row repeating its metrics as if it had run twice.
    rows = []
    hook = MetricsHook(rows.append, every=2)
    with pytest.warns(RuntimeWarning, match=r"MetricsHook: step 2 was given again: the rows follow the steps as "
                                            r"given, so they repeat steps"):
        for step in (1, 2, 2, 3, 4):
            run_hooks([hook], StepInfo(step, 0, None, {"loss": float(step)}))
    assert [(r["step"], r["loss"]) for r in rows] == [(2, 1.5), (4, 3.5)]
    restarted = MetricsHook([].append, every=2)
    with pytest.warns(RuntimeWarning, match=r"MetricsHook: step 1 came after step 4"):
        for step in (1, 2, 3, 4, 1, 2):
            run_hooks([restarted], StepInfo(step, 0, None, {"loss": 1.0}))


def test_close_with_no_step_since_the_last_row_writes_nothing():
    rows = []
    hook = MetricsHook(rows.append, every=2)
    hook.close(StepInfo(0, 0, None, {}), "completed")  # no step at all: it wrote a row of no metrics
    for step in (1, 2):
        run_hooks([hook], StepInfo(step, 0, None, {"loss": 1.0}))
    hook.close(StepInfo(2, 0, None, {"loss": 1.0}), "completed")
    run_hooks([hook], StepInfo(3, 0, None, {"loss": 3.0}))
    hook.close(StepInfo(3, 0, None, {"loss": 3.0}), "completed")
    assert [(r["step"], r["loss"]) for r in rows] == [(2, 1.0), (3, 3.0)]
    by_hand = []
    hook = MetricsHook(by_hand.append, every=2)
    hook(StepInfo(1, 0, None, {"loss": 1.0}))
    hook.close(StepInfo(2, 0, None, {"loss": 2.0}), "completed")  # a hand call's last row: still written
    assert [(r["step"], r["loss"]) for r in by_hand] == [(1, 1.0), (2, 2.0)]
