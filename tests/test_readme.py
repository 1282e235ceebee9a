"""The README's Python examples run as written, in order, in one namespace."""

from __future__ import annotations

import ast
import os
import pathlib
import platform
import re
import subprocess
import sys

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
        for expression, stated in _stated_values(block):
            got = eval(expression, namespace)
            np.testing.assert_equal(np.asarray(got).tolist(), np.asarray(stated).tolist(), err_msg=expression)
    assert namespace["out"][0].tolist() == [11.0, 20.0, 29.0]
    assert namespace["grads"].shape == (8, 3)
    assert int(namespace["mask"].sum()) == 13
    assert namespace["result"].summary["eval_loss"] < 0.05
    assert str(namespace["layout"].leaves[1].spec) == "P(None, 'data', 'model')"


def test_readme_py_block_runs_first_thing_in_a_fresh_python():
    # The ``py`` block must run before JAX starts, which the one session above cannot give it.
    blocks = re.findall(r"```py\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    # As a user's shell: none of the settings that make the call say "set in the environment".
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "SPMDKIT_"))}
    out = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    stated = re.search(r"print\(spmdkit.host_memory\(\)\)\s+# (.*)", blocks[0]).group(1)
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        assert out.stdout.strip() == stated, (out.stdout, stated)
    else:  # elsewhere the call says why it changed nothing (tests/test_host_memory.py)
        assert out.stdout.startswith("system default ("), out.stdout


def _literal(text: str):
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return None


def _stated_values(block: str) -> list[tuple[str, object]]:
    """An expression whose value the README states: ``expr  # 2`` (the whole comment a literal),
    or ``expr`` with the literal on the next line's comment. The layout example's comment showed
    the leaf at [1] as the list's first, where [0] is state.step: the block ran, the comment was
    never compared."""
    found = []
    lines = block.splitlines()
    for i, line in enumerate(lines):
        code, _, comment = line.partition("  #")
        code = code.strip()
        if not code or line.startswith((" ", "#")) or re.match(r"^[\w.\[\]\"', ]+ =[^=]", code):
            continue
        try:
            ast.parse(code, mode="eval")
        except SyntaxError:
            continue
        stated = _literal(comment) if comment else None
        if stated is None and i + 1 < len(lines) and lines[i + 1].startswith("# "):
            stated = _literal(lines[i + 1][2:])
        if stated is not None:
            found.append((code, stated))
    return found
