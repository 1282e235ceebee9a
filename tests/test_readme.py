"""The README's Python examples run as written, in order, in one namespace."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["out"][0].tolist() == [11.0, 20.0, 29.0]
    assert namespace["grads"].shape == (8, 3)
    assert int(namespace["mask"].sum()) == 13
    assert namespace["result"].summary["eval_loss"] < 0.05
    assert str(namespace["layout"].leaves[1].spec) == "P(None, 'data', 'model')"
