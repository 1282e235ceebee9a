"""Pytree helpers that keep track of paths, so errors can name the leaf at fault."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit._errors import TreeMismatchError, fix

KeyPath = tuple[Any, ...]


def bad_dtype(x: Any) -> Any:
    """The dtype of a numpy array or scalar that JAX cannot hold (strings, objects, dates,
    records), or None: numbers and bools (bfloat16 and the other ml_dtypes too) are fine."""
    if not isinstance(x, (np.ndarray, np.generic)):
        return None
    dtype = x.dtype
    return None if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number) else dtype


def abstract_rows(x: Any, rows: int | None = None) -> jax.ShapeDtypeStruct:
    """``x``'s abstract value (with ``rows`` examples if given) in the dtype JAX holds it as:
    without x64, NumPy's default int64 labels become int32 as they do on the device. Naming
    int64 made JAX warn "int64 ... will be truncated to dtype int32" at every start of a run.
    A PRNG key array (per-example keys in a batch) keeps its key dtype.

    >>> abstract_rows(np.zeros((10, 3), np.int64), 4)
    ShapeDtypeStruct(shape=(4, 3), dtype=int32)
    """
    shape = tuple(np.shape(x)) if rows is None else (rows, *np.shape(x)[1:])
    return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True))


def keystr(root: str, path: KeyPath) -> str:
    """``args`` + ``(SequenceKey(1), DictKey('w'))`` -> ``args[1]['w']``."""
    return root + jax.tree_util.keystr(path)


def _one_level(node: Any):
    # is_leaf on every child stops the flatten one level down.
    return jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)


def _is_pytree_leaf(node: Any) -> bool:
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(node)) and node is not None


def describe(node: Any) -> str:
    """A short human description of a pytree node, for error messages."""
    if node is None:
        return "None"
    if _is_pytree_leaf(node):
        shape = getattr(node, "shape", None)
        if shape is not None:
            return f"an array of shape {tuple(shape)}"
        return f"a leaf of type {type(node).__name__}"
    kids, _ = _one_level(node)
    keys = [jax.tree_util.keystr(k) for k, _ in kids]
    return f"a {type(node).__name__} with children {', '.join(keys)}"


def broadcast_prefix(
    prefix: Any,
    tree: Any,
    *,
    prefix_name: str,
    tree_name: str,
    is_prefix_leaf: Callable[[Any], bool],
    example: str,
    _path: KeyPath = (),
) -> list[tuple[KeyPath, Any]]:
    """Expand a pytree prefix to one ``(path, value)`` per leaf of ``tree``.

    Like ``jax.tree_util.broadcast_prefix`` but a mismatch raises
    :class:`TreeMismatchError` naming the first path where the two differ.
    ``is_prefix_leaf`` says which prefix values are leaves (e.g. ints and None).
    """
    if is_prefix_leaf(prefix):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [(_path + p, prefix) for p, _ in leaves]
    p_kids, p_def = _one_level(prefix)
    t_kids, t_def = ((), None) if (tree is None or _is_pytree_leaf(tree)) else _one_level(tree)
    if t_def is None or p_def != t_def:
        where = keystr(tree_name, _path)
        raise TreeMismatchError(
            fix(
                f"{prefix_name} does not match {tree_name} at {where}: {prefix_name} has "
                f"{describe(prefix)} there, but {where} is {describe(tree)}.",
                f"make {prefix_name} a prefix of the structure of {tree_name}: the same "
                f"containers down to where it holds a single value for a whole subtree "
                f"({example}).",
            )
        )
    out: list[tuple[KeyPath, Any]] = []
    for (pk, pv), (_, tv) in zip(p_kids, t_kids):
        out.extend(
            broadcast_prefix(
                pv,
                tv,
                prefix_name=prefix_name,
                tree_name=tree_name,
                is_prefix_leaf=is_prefix_leaf,
                example=example,
                _path=_path + pk,
            )
        )
    return out
