"""Data parallelism: parameters replicated, the batch split over a mesh axis.

``step(train_step)`` compiles the user's whole step with ``jax.jit`` and
``NamedSharding``: the single-device program on the global batch. XLA splits the work
and inserts the gradient all-reduce, so results do not depend on the device count
(random draws included: JAX's partitionable threefry gives the same bits whatever the
layout). There is one implementation, ``impl="jit"`` (``"auto"`` is ``"jit"``): the
optimizer update is inside the user's step, so spmdkit cannot take the gradients out
to all-reduce them in one packed buffer, as a hand-written ``shard_map`` step can.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdkit._errors import ConfigError, MeshError, fix
from spmdkit._mesh import make_mesh
from spmdkit._strategies._compile import Placement, auto_mesh, unbox_tree

IMPLS = ("auto", "jit")


class DataParallel(Placement):
    """Replicated parameters, batch split over ``axis`` of ``mesh``.

    ``step(train_step)`` runs the user's single-device step on the global batch, split
    over ``axis`` (jit semantics: the results are those of one device). A batch whose
    size ``axis`` cannot split evenly is placed whole on every device instead: exact,
    only less parallel.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, spmdkit
        >>> strategy = spmdkit.DataParallel()            # every device on one 'data' axis
        >>> def train_step(state, batch):
        ...     loss = lambda w: jnp.mean((batch["x"] * w - batch["y"]) ** 2)
        ...     value, grad = jax.value_and_grad(loss)(state["w"])
        ...     return {"w": state["w"] - 0.1 * grad}, {"loss": value}
        >>> state = strategy.init(lambda rng: {"w": jnp.zeros(())}, jax.random.key(0))
        >>> step = strategy.step(train_step)
        >>> state, aux = step(state, {"x": np.ones(16, np.float32), "y": np.ones(16, np.float32)})
        >>> float(aux["loss"])
        1.0
    """

    def __init__(
        self,
        mesh: Mesh | None = None,
        *,
        axis: str = "data",
        impl: str = "auto",
        name: str = "data",
    ):
        if impl not in IMPLS:
            raise ConfigError(
                fix(f"impl={impl!r} is not a data-parallel implementation (the step is the user's whole "
                    "step, compiled with jit; no packed shard_map all-reduce can be inserted into it).",
                    f"choose one of {list(IMPLS)}.")
            )
        impl = "jit"
        mesh = make_mesh(**{axis: -1}) if mesh is None else auto_mesh(mesh)
        if axis not in mesh.axis_names:
            raise MeshError(
                fix(
                    f"the mesh has axes {list(mesh.axis_names)} but the batch axis is {axis!r}.",
                    f"pass axis= one of {list(mesh.axis_names)}, or build the mesh with "
                    f"spmdkit.make_mesh({axis}=-1, ...).",
                )
            )
        self.name = name
        self.mesh = mesh
        self.axis = axis
        self.impl = impl
        self._replicated = NamedSharding(mesh, P())
        self._split = NamedSharding(mesh, P(axis))

    @property
    def batch_shards(self) -> int:
        return self.mesh.shape[self.axis]

    # ---- placement of the user's state and batches (see Placement) --------------
    def shardings(self, abstract_state: Any) -> Any:
        """Every leaf replicated on every device of the mesh."""
        return jax.tree.map(lambda _: self._replicated, unbox_tree(abstract_state))

    def _state_shardings(self, state: Any) -> Any:
        return self._replicated

    def _batch_sharding(self, even: bool) -> NamedSharding:
        return self._split if even else self._replicated

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "impl": self.impl,
            "mesh": dict(self.mesh.shape),
            "device_count": self.mesh.size,
        }

    def __repr__(self) -> str:
        if self.name == "single":
            return f"Single(device={self.mesh.devices.flat[0]})"
        return f"DataParallel(mesh={dict(self.mesh.shape)}, axis={self.axis!r}, impl={self.impl!r})"
