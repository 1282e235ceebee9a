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


def one_level(node: Any):
    """``([(path, child), ...], treedef)`` of ``node``'s own children (an array: itself)."""
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
    kids, _ = one_level(node)
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
    p_kids, p_def = one_level(prefix)
    t_kids, t_def = ((), None) if (tree is None or _is_pytree_leaf(tree)) else one_level(tree)
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


def tree_difference(got: Any, returned: Any, path: tuple = ()) -> str:
    """Where two pytrees first differ, in words: the path, and the keys or kinds on each side (a
    whole PyTreeDef of a large state, twice, hid the one key that differed)."""
    def children(x: Any) -> list | None:
        flat = one_level(x)[0]
        return None if len(flat) == 1 and flat[0][1] is x else flat

    a, b = children(got), children(returned)
    where = "state" + jax.tree_util.keystr(path)
    if a is None or b is None or type(got) is not type(returned):
        kind = lambda x, c: "an array" if c is None else "None" if x is None else type(x).__name__  # noqa: E731
        return f"{where} was {kind(got, a)}, returned {kind(returned, b)}"
    keys_a, keys_b = [k for (k,), _ in a], [k for (k,), _ in b]
    if keys_a != keys_b:
        gone = [jax.tree_util.keystr((k,)) for k in keys_a if k not in keys_b]
        new = [jax.tree_util.keystr((k,)) for k in keys_b if k not in keys_a]
        said = "; ".join(part for part in (f"{', '.join(gone)} missing" if gone else "",
                                            f"{', '.join(new)} added" if new else "") if part)
        return f"{where} had {len(keys_a)} entries, returned {len(keys_b)}: " + (said or "in another order")
    for ((k,), x), (_, y) in zip(a, b):
        if jax.tree.structure(x) != jax.tree.structure(y):
            return tree_difference(x, y, (*path, k))
    # Same keys, same children: the node's own static data (a TrainState's apply_fn or tx, fields
    # that are not arrays) changed.
    return (f"{where} is a {type(got).__name__} whose static fields (not arrays: a function, an optimizer, "
            "a config kept in the pytree's structure) differ from the state's")
