"""The source archive holds the whole checkout (README, "Install"): its tests failed to collect
without tests/_user_models.py, the helper programs and conftest.py, and examples/, tools/,
BENCHMARKS.md and the constraints files that README points to were missing."""

from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _covered(path: str, rules: list[list[str]]) -> bool:
    """Whether MANIFEST.in's ``include`` / ``recursive-include`` lines (or the package) take ``path``."""
    if path.startswith("src/spmdkit/") or path in ("pyproject.toml", "MANIFEST.in"):
        return True
    for word, *args in rules:
        if word == "include" and path in args:
            return True
        if word == "recursive-include" and path.startswith(args[0] + "/"):
            if any(fnmatch.fnmatch(Path(path).name, pattern) for pattern in args[1:]):
                return True
    return False


def test_the_source_archive_takes_every_file_of_the_checkout():
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.CalledProcessError) as e:  # an unpacked archive: nothing to compare with
        pytest.skip(f"not a git checkout ({e})")
    rules = [line.split() for line in (ROOT / "MANIFEST.in").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    missing = [p for p in tracked.stdout.split() if p != ".gitignore" and not _covered(p, rules)]
    assert missing == [], f"MANIFEST.in leaves out {missing}"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
