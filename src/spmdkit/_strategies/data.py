"""Data parallelism: parameters replicated, the batch split over a mesh axis.

``step(train_step)`` (and so ``fit``) always compiles the user's step with ``jax.jit``:
the single-device program on the global batch. The older loss-based ``train_step``
(benchmarks) has two implementations, chosen by ``impl`` (``"auto"`` is ``"jit"``):

- ``"jit"`` (default): the user's loss runs on the *global* batch inside ``jax.jit``
  with ``NamedSharding``; XLA splits the work and inserts the gradient all-reduce.
  The program is the single-device program, so results do not depend on the device
  count (random draws included: JAX's partitionable threefry gives the same bits
  whatever the layout).
- ``"shard_map"``: each device runs the loss on its own slice and the gradient sums
  are ``psum``-ed explicitly (with ``check_vma=False``, so the gradient of the
  replicated parameters is the per-device one and is not summed twice). A loss that
  draws random numbers sees per-device shapes here, so its draws depend on the
  device count; deterministic losses give the same results as ``"jit"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdkit._errors import ConfigError, MeshError, fix
from spmdkit._mesh import make_mesh
from spmdkit._strategies._compile import Placement, auto_mesh, unbox_tree
from spmdkit._strategies._base import (
    EvalFn,
    LossFn,
    Params,
    Predictor,
    StepFn,
    TrainState,
    accumulated_sum_grads,
    eval_sums,
    init_train_state,
    masked_sums,
    OneModel,
    place_batch,
    update_step,
    with_sharding,
)

IMPLS = ("auto", "jit", "shard_map")


def packed_psum(tree: Any, axis: str) -> Any:
    """psum of a whole pytree as one flat buffer: one all-reduce instead of one per leaf.

    Measured on 2 processes over gloo (shared/jax-facts.md): the per-leaf all-reduces of an
    MLP's gradients took ~32 ms, one packed buffer 13-15 ms.
    """
    flat, unravel = ravel_pytree(tree)
    return unravel(jax.lax.psum(flat, axis))


class DataParallel(OneModel, Placement):
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

    The older loss-based path (``init_state``/``train_step``) remains for ``fit``:

        >>> import optax
        >>> loss = lambda p, b, rng: (jnp.mean((b["x"] * p["w"] - b["y"]) ** 2), {})
        >>> opt = optax.sgd(0.1)
        >>> state = strategy.init_state(lambda rng: {"w": jnp.zeros(())}, opt, jax.random.key(0))
        >>> step = strategy.train_step(loss, opt)
        >>> batch, mask = strategy.put_batch({"x": np.ones(16, np.float32), "y": np.ones(16, np.float32)})
        >>> state, metrics = step(state, batch, mask, jax.random.key(1))
        >>> float(metrics["loss"])
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
                fix(f"impl={impl!r} is not a data-parallel implementation.", f"choose one of {list(IMPLS)}.")
            )
        if impl == "auto":
            # A user's step can only be compiled whole (jit): the optimizer update is inside
            # it, so no packed all-reduce of the gradients can be inserted. The loss-based
            # train_step keeps impl="shard_map" (1.5x faster across processes, BENCHMARKS.md).
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
        self.data_streams = 1
        self.mesh = mesh
        self.axis = axis
        self.impl = impl
        self._replicated = NamedSharding(mesh, P())
        self._split = NamedSharding(mesh, P(axis))
        self._init = jax.jit(init_train_state, static_argnums=(0, 1), out_shardings=self._replicated)

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

    # ---- placement ------------------------------------------------------------
    def init_state(self, init_fn: Callable[[jax.Array], Params], optimizer: optax.GradientTransformation, rng: jax.Array) -> TrainState:
        return self._init(init_fn, optimizer, rng)

    def abstract_state(self, init_fn: Callable[[jax.Array], Params], optimizer: optax.GradientTransformation) -> Any:
        shapes = jax.eval_shape(lambda k: init_train_state(init_fn, optimizer, k), jax.random.key(0))
        return with_sharding(shapes, self._replicated)

    def put_batch(self, batch: Any, size: int | None = None, *, shared: bool = False):
        return place_batch(batch, size, self.batch_shards, self._split)

    # ---- compiled steps ---------------------------------------------------------
    def _shard_map_grads(self, loss_fn: LossFn, accum: int = 1) -> Callable[..., Any]:
        """(params, batch, mask, rng) -> (grads of the global mean, sums), per device + psum."""
        axis = self.axis

        def per_device_accumulated(params, batch, mask, rng):
            # Local sums over the micro-batches, then a single psum for the step.
            grads, (s, a, c) = packed_psum(accumulated_sum_grads(loss_fn, accum)(params, batch, mask, rng), axis)
            return jax.tree.map(lambda g: g / c, grads), (s, a, c)

        def per_device(params, batch, mask, rng):
            def objective(p):
                s, a, c = masked_sums(loss_fn, p, batch, mask, rng)
                return s / jax.lax.psum(c, axis), (s, a, c)

            grads, sums = jax.grad(objective, has_aux=True)(params)
            return packed_psum((grads, sums), axis)

        return jax.shard_map(
            per_device_accumulated if accum > 1 else per_device,
            mesh=self.mesh,
            in_specs=(P(), P(axis), P(axis), P()),
            out_specs=P(),
            check_vma=False,
        )

    def train_step(self, loss_fn: LossFn, optimizer: optax.GradientTransformation, accum: int = 1) -> StepFn:
        grads = self._shard_map_grads(loss_fn, accum) if self.impl == "shard_map" else None
        r, s = self._replicated, self._split
        step = update_step(loss_fn, optimizer, grads, accum=accum)
        return jax.jit(step, in_shardings=(r, s, s, r), out_shardings=(r, r))

    def eval_step(self, loss_fn: LossFn, predictor: Predictor | None = None) -> EvalFn:
        evaluate = eval_sums(loss_fn)
        if self.impl == "shard_map":
            axis = self.axis
            evaluate = jax.shard_map(
                lambda *args: jax.lax.psum(eval_sums(loss_fn)(*args), axis),
                mesh=self.mesh, in_specs=(P(), P(axis), P(axis), P()), out_specs=P(), check_vma=False,
            )
        r, s = self._replicated, self._split
        return jax.jit(evaluate, in_shardings=(r, s, s, r), out_shardings=r)

    def __repr__(self) -> str:
        if self.name == "single":
            return f"Single(device={self.mesh.devices.flat[0]})"
        return f"DataParallel(mesh={dict(self.mesh.shape)}, axis={self.axis!r}, impl={self.impl!r})"
