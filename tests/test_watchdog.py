"""The step watchdog's access to JAX's coordination service degrades with a warning."""

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
