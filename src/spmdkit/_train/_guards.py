"""Guards around what the training loop keeps: only known-good states are saved.

A state is known good once the loss computed *from* it came out finite (the next step
shows that), so a checkpoint is held back one step and saved only then. A run that
diverges keeps, saves and reports the same step: the newest known-good one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def state_is_finite(state: Any) -> bool:
    """Every floating-point leaf of ``state`` is free of NaN and inf.

    Example:
        >>> import jax.numpy as jnp
        >>> state_is_finite({"w": jnp.ones(2), "n": jnp.arange(2)}), state_is_finite({"w": jnp.array([1.0, jnp.inf])})
        (True, False)
    """
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        return True
    # One small reduction per leaf; a sharded leaf reduces on its devices.
    return bool(np.all(jax.device_get([jnp.isfinite(x).all() for x in leaves])))


class KnownGood:
    """The newest state whose loss was seen finite, its step, and a save held until then.

    Example:
        >>> kg = KnownGood(state="s0", step=0)
        >>> kg.hold(1, "s1", {"epoch": 0})   # a save is due after step 1
        >>> kg.confirm("s1", 1)              # step 2's loss (computed from s1) was finite
        (1, 's1', {'epoch': 0})
        >>> kg.step, kg.state
        (1, 's1')
    """

    def __init__(self, state: Any, step: int):
        self.state, self.step = state, step
        self._held: tuple[int, Any, dict[str, Any]] | None = None

    def hold(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """A save is due for ``step``: keep it until that state's loss is known."""
        self._held = (step, state, meta)

    def confirm(self, state: Any, step: int) -> tuple[int, Any, dict[str, Any]] | None:
        """The loss computed from ``state`` (after ``step`` steps) was finite; the save now due, if any."""
        self.state, self.step = state, step
        held, self._held = self._held, None
        return held if held is not None and held[0] == step else None

    def drop(self) -> None:
        """The run diverged: a held save is never made."""
        self._held = None
