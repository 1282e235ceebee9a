"""Fixtures that several test modules share."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest

SPMDKIT = shutil.which("spmdkit") or os.path.join(os.path.dirname(sys.executable), "spmdkit")


class BenchRun(NamedTuple):
    json: Path  # one SUITE.json per suite
    markdown: Path  # one SUITE.md per suite
    done: subprocess.CompletedProcess


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that reads ``bench_all_quick`` runs in one pytest-xdist worker (``make test``
    runs two, ``--dist loadgroup``): a session fixture is made once per worker, and this one
    takes 6 minutes."""
    for item in items:
        if "bench_all_quick" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("bench_all_quick"))


@pytest.fixture(scope="session")
def bench_all_quick(tmp_path_factory) -> BenchRun:
    """One ``spmdkit bench --all --quick`` run (about 6 minutes on 2 cores): each suite's tests
    read its own report from it instead of running the suite a second time."""
    out = tmp_path_factory.mktemp("bench-all-quick")
    env = {k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"}
    cmd = [SPMDKIT, "bench", "--all", "--quick", "--json", str(out / "json"), "--markdown", str(out / "md")]
    # Its own session: the multiprocess and lm suites start workers of their own, and a
    # timeout kills them all with the bench.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=2400)
    except subprocess.TimeoutExpired:
        pytest.fail("spmdkit bench --all --quick took over 40 minutes")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return BenchRun(out / "json", out / "md", subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))


@contextlib.contextmanager
def _own_group(command: Sequence[str], *, sigint: bool = False, **popen: object) -> Iterator[subprocess.Popen]:
    """``command`` in a session (process group) of its own, output piped as text; SIGKILL to the
    whole group on the way out when it still runs (what it started dies with it).

    ``sigint=True``: started with SIGINT at its default, for a test that sends Ctrl-C: pytest
    started as ``cmd &`` from a script has SIGINT ignored, which a child inherits.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if sigint else None
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, **popen)
    finally:
        if sigint:
            signal.signal(signal.SIGINT, previous)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def own_group():
    """``with own_group(command, sigint=False, **popen) as proc``: see :func:`_own_group`."""
    return _own_group


class StoppedAtStart(Exception):
    """Raised by a ``fit`` that ``stop_fit_at_start`` ended before its first step."""


@pytest.fixture
def stop_fit_at_start(monkeypatch):
    """``fit`` ends once its start is done (--out taken, before any step), as a kill there would
    leave it: it raises :class:`StoppedAtStart`, which the fixture returns."""
    from spmdkit._train import _loop

    def stopped(self, checkpoint):
        raise StoppedAtStart

    monkeypatch.setattr(_loop._Run, "_hooks", stopped)
    return StoppedAtStart
