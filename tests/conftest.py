"""Fixtures that several test modules share."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

SPMDKIT = shutil.which("spmdkit") or os.path.join(os.path.dirname(sys.executable), "spmdkit")


class BenchRun(NamedTuple):
    json: Path  # one SUITE.json per suite
    markdown: Path  # one SUITE.md per suite
    done: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def bench_all_quick(tmp_path_factory) -> BenchRun:
    """One ``spmdkit bench --all --quick`` run (about 6 minutes on 2 cores): each suite's tests
    read its own report from it instead of running the suite a second time."""
    out = tmp_path_factory.mktemp("bench-all-quick")
    env = {k: v for k, v in os.environ.items() if k != "SPMDKIT_HOST_DEVICES"}
    cmd = [SPMDKIT, "bench", "--all", "--quick", "--json", str(out / "json"), "--markdown", str(out / "md")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=2400, env=env)
    except subprocess.TimeoutExpired:  # subprocess.run kills the child (SIGKILL) before raising
        pytest.fail("spmdkit bench --all --quick took over 40 minutes")
    return BenchRun(out / "json", out / "md", done)
