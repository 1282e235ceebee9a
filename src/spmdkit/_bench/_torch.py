"""The Python that runs a suite's PyTorch cases: this one, or another named by the user.

PyTorch may have no wheel yet for the Python that runs JAX; the multiprocess and lm suites
then run their PyTorch workers with an interpreter named by ``$SPMDKIT_TORCH_PYTHON`` (or
``--torch-python``), checked here by running a line of code in it.
"""

from __future__ import annotations

import subprocess

TORCH_PYTHON_ENV = "SPMDKIT_TORCH_PYTHON"


class ProbeFailed(Exception):
    """The interpreter did not start or hung (``cannot_run``), or ``code`` failed: its last error line."""

    def __init__(self, detail: str, cannot_run: bool):
        super().__init__(detail)
        self.cannot_run = cannot_run


def probe_python(python: str, code: str, env: dict[str, str] | None = None) -> str:
    """Run ``code`` with the interpreter ``python``; its stdout, stripped. ProbeFailed says why not.

    Example:
        >>> import sys
        >>> probe_python(sys.executable, "print(6 * 7)")
        '42'
    """
    try:
        out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProbeFailed(str(e), cannot_run=True) from e
    if out.returncode:
        raise ProbeFailed((out.stderr.strip().splitlines() or ["?"])[-1], cannot_run=False)
    return out.stdout.strip()
