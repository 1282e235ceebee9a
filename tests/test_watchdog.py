"""The step watchdog's access to JAX's coordination service degrades with a warning."""

import time
import warnings

import pytest

from spmdkit._train import _watchdog


def test_single_process_has_no_client_and_no_warning():
    assert _watchdog.coordination_client() is None  # jax.distributed was not started here
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _watchdog.StepWatchdog(timeout_s=100):
            pass


def test_a_moved_client_warns_once_and_the_watchdog_still_runs(monkeypatch):
    monkeypatch.setattr(_watchdog.jax, "process_count", lambda: 2)
    monkeypatch.setattr(_watchdog, "coordination_client", lambda: None)
    with pytest.warns(RuntimeWarning, match="cannot name the process"):
        dog = _watchdog.StepWatchdog(timeout_s=100)
        with dog:
            dog.started(1)
            dog.finished(1)
    assert dog.step == 1


def test_client_lookup_tolerates_a_client_without_the_methods(monkeypatch):
    from jax._src import distributed

    class Moved:  # a client whose methods were renamed
        pass

    monkeypatch.setattr(distributed.global_state, "client", Moved())
    assert _watchdog.coordination_client() is None


def test_a_watchdog_is_refused_where_it_would_watch_nothing():
    import numpy as np

    import spmdkit

    assert spmdkit.StepWatchdog(np.float32(5)).timeout_s == 5.0
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(spmdkit.ConfigError, match="a number of seconds > 0"):
            spmdkit.StepWatchdog(bad)
    with spmdkit.StepWatchdog(5) as watchdog:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(spmdkit.ConfigError, match="steps are whole numbers counted from 1"):
                watchdog.started(bad)
        watchdog.started(1)
        watchdog.finished(np.int64(1))
    with pytest.raises(spmdkit.ConfigError, match="entered before"):
        with watchdog:
            pass


def test_the_watchdogs_clock_starts_when_it_is_entered(monkeypatch):
    import spmdkit

    watchdog = spmdkit.StepWatchdog(5)
    made = watchdog._last
    time.sleep(0.05)
    with watchdog:
        assert watchdog._last > made


def test_progress_between_steps_restarts_the_clock():
    import spmdkit

    watchdog = spmdkit.StepWatchdog(5)
    with watchdog:
        watchdog._last -= 100  # as if the last step finished long ago
        watchdog.progressed()
        assert time.monotonic() - watchdog._last < 1


def test_an_eval_longer_than_the_step_timeout_does_not_end_a_healthy_job():
    # Each eval (24 chunks, ~6 s) outlasted step_timeout=3 with every chunk on time: both processes
    # exited with code 4, "no step finished for 5 s ... no process stands out (all in step 2)".
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    try:
        from _launch_two import run_two
    finally:
        sys.path.remove(str(here))
    code, stdout, stderr = run_two(here / "_slow_eval_mp_program.py", "3", timeout=180)
    assert code == 0, stderr[-3000:]
    assert stdout.count("status completed evals 2") == 2 and "no step finished" not in stderr
