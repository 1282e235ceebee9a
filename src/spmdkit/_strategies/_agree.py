"""What the processes of one program must give alike, checked across them.

Under ``jax.distributed`` every process passes its own copy of a value that the strategy
takes as one global value: the init key (every process builds its part of one global state
from it) and the global batch (each process hands JAX its devices' rows of it). JAX never
compares the copies, so processes that differ train on silently apart. Each check here is
one small collective of a digest (a second, to name what differs, only when they differ),
which every process runs at the same point: a check only some processes ran would wait
for the others forever. A strategy whose mesh does not span every process (a process's own
``Single(jax.local_devices()[0])``) runs independent programs: nothing is compared.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from spmdkit._errors import DataError, ProcessMismatchError, fix
from spmdkit._process import disagreement

_SHOWN = 8  # key words named in the error


def spans_processes(mesh: Mesh) -> bool:
    """Whether ``mesh`` holds devices of every process (of several): one program over all of them."""
    if jax.process_count() == 1:
        return False
    return len({d.process_index for d in mesh.devices.flat}) == jax.process_count()


def _key_words(key: jax.Array) -> np.ndarray:
    data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    if isinstance(data, jax.Array) and not data.is_fully_addressable:
        data = data.addressable_data(0)
    return np.asarray(data)


def check_same_key(key: jax.Array, mesh: Mesh, call: str) -> None:
    """Refuse an init key that differs between the processes of ``mesh``'s program."""
    if not spans_processes(mesh):
        return
    words = _key_words(key)
    every = disagreement(words.tobytes() + str((words.shape, words.dtype)).encode(),
                         lambda: [int(w) for w in words.ravel()[:_SHOWN]] + (["..."] if words.size > _SHOWN else []),
                         f"{call}: the init key")
    if every is None:
        return
    differ = [p for p, w in enumerate(every) if w != every[0]]
    shown = ", ".join(f"process {p} {every[p]}" for p in [0, *differ][:4])
    raise ProcessMismatchError(fix(
        f"{call}(make_state, rng): rng differs between processes (key data: {shown}). Every process builds "
        f"its part of one global state from it (replicated parameters, an ensemble's members, a sharded "
        f"layout): with different keys the processes' parts do not belong to one state, and they train "
        f"apart, silently.",
        "pass the same key in every process, e.g. rng=jax.random.key(0), not jax.random.key(jax.process_index()); "
        "for per-process randomness after init, use jax.random.fold_in(key, jax.process_index())."))


def batch_signature(batch: Any) -> list[list[Any]]:
    """``[path, shape, dtype]`` of every leaf of ``batch``, in order."""
    return [[jax.tree_util.keystr(path), list(np.shape(x)), str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)]
            for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]]


def signature_or_error(abstract: Callable[[], Any], who: str) -> Any:
    """:func:`batch_signature` of ``abstract()``, or ``"<who> raised <error type>"``: a process
    whose state cannot be built still takes part in the comparison (its own checks then raise),
    instead of leaving the others waiting in it."""
    try:
        return batch_signature(abstract())
    except Exception as e:  # noqa: BLE001 - named by the caller's own checks, in every process
        return f"{who} raised {type(e).__name__}"


def first_difference(a: Any, b: Any, name: str = "") -> tuple[str, str]:
    """Two values as said in an error: for signatures (``[path, shape, dtype]`` lists) the first
    leaf that differs, not two whole lists.

    Example:
        >>> first_difference([["['w']", [2, 3], "float32"]], [["['w']", [2, 4], "float32"]], "state")
        ("state['w'] (2, 3) float32", "state['w'] (2, 4) float32")
        >>> first_difference([["['w']", [2], "float32"]], [], "batch")
        ("batch['w'] (2,) float32", "no batch['w']")
    """
    def leaves(v: Any) -> dict | None:
        if isinstance(v, list) and all(isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) for x in v):
            return {path: f"{name}{path} {tuple(shape)} {dtype}" for path, shape, dtype in v}
        return None

    x, y = leaves(a), leaves(b)
    if x is None or y is None:
        return repr(a)[:300], repr(b)[:300]
    path = next((k for k in [*x, *y] if x.get(k) != y.get(k)), None)
    if path is None:  # the same leaves in another order
        return f"the leaves {list(x)[:4]}", f"{list(y)[:4]}"
    return x.get(path, f"no {name}{path}"), y.get(path, f"no {name}{path}")


def check_same_state(abstract: Callable[[], Any], mesh: Mesh, call: str) -> Any:
    """``abstract()`` (the state ``make_state`` builds, as shapes), refused when its leaves'
    shapes or dtypes differ between the processes of ``mesh``'s program: each process builds
    its part of one global state, and parts of other shapes met in no collective, every
    process waiting in its first step for ever. An error ``abstract()`` raises is raised
    after the comparison (a process that raised before it left the others waiting in it)."""
    if not spans_processes(mesh):
        return abstract()
    try:
        value, error = abstract(), None
        signature: Any = batch_signature(value)
    except Exception as e:  # noqa: BLE001 - raised below, once every process has compared
        value, error, signature = None, e, f"make_state raised {type(e).__name__}"
    every = disagreement(json.dumps(signature).encode(), lambda: signature, f"{call}: the state make_state builds")
    if every is not None:
        p = next(p for p, s in enumerate(every) if s != every[0])
        first, other = first_difference(every[0], every[p], "state")
        raise ProcessMismatchError(fix(
            f"{call}(make_state, rng): make_state builds another state in process {p} than in process 0: {first} "
            f"in process 0, {other} in process {p}. Every process builds its part of one global state: parts of "
            "other shapes meet in no collective, and every process would wait in its first step for ever.",
            "build the same state in every process (the same model sizes, optimizer and dtypes; not drawn from "
            "jax.process_index())."))
    if error is not None:
        raise error
    return value


def check_same_settings(settings: Callable[[], dict[str, Any]], mesh: Mesh | None, call: str,
                        describe: Callable[[str, Any, Any], str | None] | None = None,
                        fixes: dict[str, str] | None = None) -> None:
    """Refuse ``settings()`` (JSON-able by name; a nested dict's entries as ``outer.inner``, and
    the dict itself as given or None) that differ between the processes of ``mesh``'s program,
    naming the first that differs; built only when the mesh spans processes.
    ``describe(name, process 0's, the other's)`` says how two values differ (default: both, or
    for lists of ``[path, shape, dtype]`` the first leaf that differs); ``fixes[name]``, the fix."""
    if mesh is None or not spans_processes(mesh):
        return
    flat = {}
    for name, value in settings().items():
        if isinstance(value, dict):  # "given" first (sorted before its entries): None in one process is named as such
            flat.update({name: "given", **{f"{name}.{k}": v for k, v in value.items()}})
        else:
            flat[name] = value
    plain = json.loads(json.dumps(flat, sort_keys=True, default=str))
    every = disagreement(json.dumps(plain, sort_keys=True).encode(), lambda: plain, f"{call}: its settings")
    if every is None:
        return
    p = next(p for p, e in enumerate(every) if e != every[0])
    name = next(k for k in [*every[0], *every[p]] if every[0].get(k) != every[p].get(k))
    a, b = every[0].get(name), every[p].get(name)
    said = describe(name, a, b) if describe else None
    if said:
        said += f" (from process 0's to process {p}'s)"
    else:
        shown = lambda v: "one" if v == "given" else "none" if v is None else repr(v)[:200]  # noqa: E731
        x, y = first_difference(a, b, name) if isinstance(a, list) and isinstance(b, list) else (shown(a), shown(b))
        said = f"process 0 has {x}, process {p} has {y}"
    raise ProcessMismatchError(fix(
        f"{call}: {name} differs between processes: {said}. Every process runs one program, step for step: with "
        "other settings they part ways, one waiting for ever in a collective the others never reach.",
        (fixes or {}).get(name, f"give every process the same {name} (on the command line: the same flags in every "
                                "process).")))


def check_same_batch(batch: Any, mesh: Mesh, call: str, argument: str = "batch") -> None:
    """Refuse a global batch whose structure, shapes or dtypes differ between the processes
    of ``mesh``'s program (each would hand JAX rows of another global array)."""
    if not spans_processes(mesh):
        return
    signature = batch_signature(batch)
    every = disagreement(json.dumps(signature).encode(), lambda: signature, f"{call}: the {argument}'s layout")
    if every is None:
        return
    p = next(p for p, s in enumerate(every) if s != every[0])
    first, other = ({path: (shape, dtype) for path, shape, dtype in s} for s in (every[0], every[p]))
    path = next((k for k in [*first, *other] if first.get(k) != other.get(k)), None)

    def has(leaves: dict, process: int) -> str:
        if path not in leaves:
            return f"process {process} has no {argument}{path}"
        shape, dtype = leaves[path]
        return f"process {process} has shape {tuple(shape)} {dtype}"

    where = f"{argument}{path}" if path is not None else f"the leaf order of {argument}"
    raise ProcessMismatchError(fix(
        f"{call}: {where} differs between processes: {has(first, 0)}, {has(other, p)}. Each process passes "
        f"the one global {argument} (its devices take their rows of it): processes that disagree compute on "
        "different arrays, silently.",
        f"give every process the same global {argument} (the same rows, shapes and dtypes, e.g. drawn from a "
        "seed every process shares); each process's own rows are taken from it for you."))


def check_same_data(data: dict[str, Any], mesh: Mesh | None, call: str) -> None:
    """Refuse training or eval arrays that differ between the processes of ``mesh``'s program.

    ``data`` maps a name (``task.train_data``) to what each process passes. Each process takes its
    devices' rows of every global batch from its own copy, drawn in an order from the seed and
    the row count: copies of other lengths or contents train on a mix of both, silently. Only
    arrays in memory are compared (a pipeline or a list of batches is each process's own share; a
    data set directory is checksummed when loaded); a process whose copy is not arrays compares
    nothing.
    """
    if mesh is None or not spans_processes(mesh):
        return
    digests = {name: arrays_digest_and_rows(value) for name, value in data.items()}
    every = disagreement(json.dumps(digests).encode(), lambda: digests, f"{call}: the data in memory")
    if every is None:
        return
    for name in data:
        seen = [e[name] for e in every]
        if any(s is None for s in seen) or all(s == seen[0] for s in seen):
            continue
        p = next(p for p, s in enumerate(seen) if s != seen[0])

        def has(process: int) -> str:
            rows, crc = seen[process]
            return f"process {process} has {rows} rows (CRC-32 {crc})"

        raise ProcessMismatchError(fix(
            f"{call}: {name} differs between processes: {has(0)}, {has(p)}. Each process takes its devices' rows "
            "of every global batch from its own copy, in an order drawn from the seed and the row count: copies "
            "that differ train on a mix of both, silently.",
            f"give every process the same {name} (load the same files, or draw it from a seed every process "
            "shares, not from jax.process_index()); for data of which each process holds only its share, pass a "
            "pipeline that yields that share of every batch (batch_size / process_count rows)."))


def check_distinct_shares(share: list[Any] | None, mesh: Mesh | None, call: str, name: str, rows: int,
                          batch_size: int) -> None:
    """Refuse a pipeline that yields the same rows in several processes.

    Each process's pipeline yields its share of every global batch (``rows`` of ``batch_size``):
    one not split per process (a list of batches, or a Grain pipeline without
    ``ShardByJaxProcess``, the same in every process) trained on every example as many times as
    there are processes, a smaller batch than asked for, silently. ``share`` is this process's
    ``[CRC-32, rows differ]`` of its first batch, None where there is nothing to compare; every
    process of ``mesh``'s program calls this at the same point.
    """
    if mesh is None or not spans_processes(mesh):
        return
    every = disagreement(json.dumps(share).encode(), lambda: share, f"{call}: the first batch of each process's {name}")
    every = every or [share] * jax.process_count()
    seen: dict[str, int] = {}
    for p, s in enumerate(every):
        if s is None or not s[1]:  # nothing to compare, or rows all alike (zeros): alike by chance
            continue
        if s[0] in seen:
            alike = [q for q, t in enumerate(every) if t == s]
            raise DataError(fix(
                f"{call}: {name}'s first batch is the same in processes {', '.join(map(str, alike))} (CRC-32 {s[0]}). "
                f"Each process's pipeline yields its own share of every global batch ({rows} of batch_size="
                f"{batch_size} rows): the same share in {len(alike)} processes trains on each of its examples "
                f"{len(alike)} times, a smaller batch than asked for, silently.",
                "split the pipeline per process: a Grain sampler with shard_options=grain.ShardByJaxProcess(), "
                "spmdkit.grain_batches(DIR, batch_size) (splits for you), or rows "
                f"[i * {rows}:(i + 1) * {rows}] of each global batch in process i = jax.process_index(); or pass "
                "the arrays themselves (or a data set directory), of which each process reads its rows."))
        seen[s[0]] = p


def arrays_digest_and_rows(tree: Any) -> list[Any] | None:
    """``[rows, crc32]`` of arrays in memory, else None (see :func:`spmdkit._data._feed.arrays_digest`)."""
    from spmdkit._data._feed import arrays_digest

    crc = arrays_digest(tree)
    if crc is None:
        return None
    leaves = jax.tree.leaves(tree)
    return [int(np.shape(leaves[0])[0]) if np.ndim(leaves[0]) else 1, crc]
