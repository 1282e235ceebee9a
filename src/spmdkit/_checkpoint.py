"""Checkpoints on Orbax: asynchronous saves, verified restores onto any layout.

Each step directory (``spmdkit_<step>``) is Orbax's (``PyTreeSave`` of the train state,
``JsonSave`` of the run's position and config); nothing is pickled. A checkpoint
directory belongs to one run: ``spmdkit-run.json`` names it, every step's manifest
(``manifests/<step>.json``: the run id and every file with its size and CRC-32,
written atomically once Orbax has committed the step) records which run wrote it, and
``spmdkit.lock`` keeps a second writer out. spmdkit lists, verifies and deletes only
what it wrote: a user's ``1/`` or ``notes.txt`` beside the steps is left alone (and
said so). Restores always take an explicit target (the abstract state with the
*current* strategy's shardings), which is what lets a checkpoint written on 8 devices
resume on 4, 2 or 1, or from a data-parallel layout into a sharded one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import reprlib
import shutil
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmdkit import _checkpoint_read as _read
from spmdkit._atomic import is_temporary, replace_text
from spmdkit._crc import crc32_file
from spmdkit._errors import SpmdkitError, fix
from spmdkit._lockfile import OUT_LOCK, OUT_RUN_FILE, DirLock, held_now, refusal
from spmdkit._process import armed, broadcast, disagreement, exit_now, gather_json

if TYPE_CHECKING:
    import orbax.checkpoint as ocp


_ORBAX_IMPORT = threading.Lock()


def _orbax():
    """Orbax, imported when a checkpoint directory is first opened: at import time it cost every
    start ~0.28 s, also the many that never checkpoint (``spmdkit train`` without --checkpoint-dir).
    Its import warns of JAX deprecations it uses; imported late, under a caller's
    ``warnings.simplefilter("error")``, that warning became an error opening a checkpoint."""
    if "orbax.checkpoint" not in sys.modules:
        with _ORBAX_IMPORT, warnings.catch_warnings():  # the lock: catch_warnings is process-wide
            warnings.simplefilter("ignore", DeprecationWarning)
            import orbax.checkpoint  # noqa: F401
    import orbax.checkpoint as ocp  # waits for another thread's import to finish

    return ocp

_TMP_MARK = ".orbax-checkpoint-tmp"
STEP_PREFIX = "spmdkit"
OWNER_FILE = "spmdkit-run.json"
LOCK_FILE = "spmdkit.lock"
MANIFESTS = "manifests"
_ASIDE = "damaged-"  # a step of ours set aside after a fallback: kept, never listed as a step


class CheckpointError(SpmdkitError, RuntimeError):
    """A checkpoint is damaged, missing, or does not fit the model being trained."""


class CheckpointDamagedError(CheckpointError):
    """A step's files are damaged, incomplete or unreadable (names the step and the file);
    other steps may be intact: ``restore_latest`` falls back past such a step."""


class CheckpointSaveError(CheckpointError, OSError):
    """A save failed (disk full, read-only, removed directory); earlier steps are intact."""

    exit_code = 5  # the CLI's code for an I/O failure


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint, how many to keep, and whether to resume.

    ``overwrite=True`` lets a fresh run (no ``resume``) take over a directory another
    run wrote: that run's steps are deleted first (nothing spmdkit did not write).
    """

    directory: str
    every: int = 100
    keep: int = 3
    resume: bool = False
    # Measured (BENCHMARKS.md): zstd compression saves ~8% on float weights and costs most of
    # the save time on 2 cores; OCDBT packs files for multi-host scale at a further cost here.
    compress: bool = False
    ocdbt: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)) or not os.fspath(self.directory):
            # "" would be the working directory, whose numbered folders Orbax takes for steps.
            raise CheckpointError(fix(f"checkpoint directory={self.directory!r} must be a non-empty path.",
                                      "e.g. CheckpointConfig('runs/ckpt') (--checkpoint-dir runs/ckpt)."))
        full = os.path.abspath(os.fspath(self.directory))
        try:
            full.encode("utf-8") if isinstance(full, str) else full.decode("utf-8")
        except UnicodeError as e:
            # TensorStore takes paths as UTF-8 text: the first save, after `every` steps of training, failed with
            # pybind11's "Unable to cast Python instance of type str to C++ type" and "free disk space".
            byte = os.fsencode(full[e.start:e.end]) if isinstance(full, str) else full[e.start:e.end]
            raise CheckpointError(fix(f"checkpoint directory {os.fsdecode(full)!r} holds a byte that is not UTF-8 "
                                      f"({byte!r} at position {e.start}); the checkpoint writer (TensorStore) takes "
                                      "paths as UTF-8 text and cannot save there.",
                                      "pass a --checkpoint-dir whose full path is UTF-8 (rename the folder).")) from None
        for name in ("every", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(fix(f"checkpoint {name}={value!r} must be a whole number >= 1.", f"e.g. {name}=10."))
        for name in ("resume", "compress", "ocdbt", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointError(fix(f"checkpoint {name}={getattr(self, name)!r} must be True or False.",
                                          f"e.g. {name}=True (in a config file: {name} = true, unquoted)."))
        if self.resume and self.overwrite:
            raise CheckpointError(fix("resume and overwrite were both asked for.",
                                      "pass --resume to continue the run, or --overwrite-checkpoints to replace it."))


def leaf_table(state: Any) -> dict[str, list]:
    """``{path: [shape, dtype]}`` of every leaf as stored (a PRNG key as its uint32 data):
    what a restore target must match."""
    return {
        jax.tree_util.keystr(path): [list(np.shape(leaf)), str(np.dtype(leaf.dtype))]
        for path, leaf in jax.tree_util.tree_flatten_with_path(keys_as_data(state))[0]
    }


def is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def keys_as_data(tree: Any) -> Any:
    """Typed PRNG key leaves (``jax.random.key``: a dropout key, NNX's ``Rngs``) as their
    uint32 data, which Orbax and NumPy can store; abstract leaves likewise."""
    def one(x: Any) -> Any:
        if not is_prng_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            data = jax.eval_shape(jax.random.key_data, x)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
        return jax.random.key_data(x)

    return jax.tree.map(one, tree)


def key_impls(state: Any) -> dict[str, str]:
    """``{path: implementation}`` of a state's typed PRNG key leaves, to wrap them again."""
    return {jax.tree_util.keystr(path): _impl_name(x)
            for path, x in jax.tree_util.tree_flatten_with_path(state)[0] if is_prng_key(x)}


def _impl_name(key: Any) -> str:
    # A key array's implementation; a target's ShapeDtypeStruct carries it only in its dtype.
    name = getattr(getattr(key.dtype, "_impl", None), "name", None)  # "threefry2x32", as key_impl says
    return str(name) if name is not None else str(jax.random.key_impl(key))


def _keys_again(restored: Any, target: Any, impls: dict[str, str], prefix: str) -> Any:
    """The leaves ``target`` holds as typed keys, wrapped again from their restored data."""
    def one(path: Any, x: Any, like: Any) -> Any:
        if not is_prng_key(like):
            return x
        # A key saved as raw data (a jax.random.PRNGKey, key_data) becomes a key of the target's implementation.
        return jax.random.wrap_key_data(x, impl=impls.get(prefix + jax.tree_util.keystr(path), _impl_name(like)))

    return jax.tree_util.tree_map_with_path(one, restored, target)


_OPEN_ATTEMPTS = 5
_READ_PASSES = 3  # listings of a directory whose writer deletes steps under a reader
_KEY = re.compile(r"\.(\w+)|\['([^'\\]*)'\]")


def _places(saved: dict[str, list], want: dict[str, list]) -> list[str]:
    """Every path prefix under which a saved state holds exactly the leaves ``want`` names."""
    first = next(iter(want))
    found = []
    for path in saved:
        if not path.endswith(first):
            continue
        prefix = path[: len(path) - len(first)]
        if {p for p in saved if p.startswith(prefix)} == {prefix + w for w in want}:
            found.append(prefix)
    return found


def _by_keys(prefix: str) -> bool:
    """A prefix of dict keys and attributes alone (``['params']``, ``.ema``), not list indices."""
    return "".join(m.group(0) for m in _KEY.finditer(prefix)) == prefix


def _head(step: int, directory: Path | str | None) -> str:
    """How an error names a step: with its directory, since one job may read several."""
    return f"checkpoint step {step}" + (f" in {directory}" if directory else "")


def _indexed_part(step: int, places: list[str], directory: Path | str | None = None) -> CheckpointError:
    """A target that is a part of the state under a list or tuple index, which a restore cannot
    take alone (it was "has no leaf" or "none does")."""
    return CheckpointError(fix(
        f"{_head(step, directory)}: the target's leaves are found in the saved state at {' and '.join(map(repr, places))}, "
        "under a list or tuple index; a restore takes a part under dict keys or attributes only.",
        "restore the whole state (a target of all of it, e.g. strategy.abstract(make_state)) and take that part "
        "from it, or keep such parts in a dict keyed by name."))


def part_of(step: int, saved: dict[str, list], want: dict[str, list], part: str | None = None,
            directory: Path | str | None = None) -> tuple[str, list[str]] | None:
    """The part of a saved state a restore target stands for: its path prefix and keys
    (``(".params", ["params"])``), or None for the whole state.

    A bare subtree carries no position: a target shaped like two places of the state (the
    parameters and their EMA, a DQN's online and target networks) matches both. The places whose
    shapes and dtypes match too decide; if several remain, ``part`` must name one, never a guess.
    """
    # Path prefixes where the saved state holds exactly the target's leaves ([".params"] for the
    # parameters alone); none when the target is the whole state.
    places = _places(saved, want) if want and set(want) != set(saved) else []
    found = [p for p in places if _by_keys(p)]
    indexed = [p for p in places if not _by_keys(p)]
    if indexed and (not found or (part is not None and part not in found)):
        raise _indexed_part(step, indexed, directory)
    if part is not None:
        if part not in found:
            raise CheckpointError(fix(
                f"{_head(step, directory)}: part={part!r} is not a place of the saved state holding exactly the "
                f"target's leaves ({', '.join(map(repr, found)) or 'none does'}).",
                "pass one of those as part= (a path as jax.tree_util.keystr prints it), or a target of that part."))
        found = [part]
    exact = [p for p in found if all(saved[p + w] == list(v) for w, v in want.items())]
    if len(exact) > 1 or (not exact and len(found) > 1):
        ambiguous = exact or found
        raise CheckpointError(fix(
            f"{_head(step, directory)}: the target matches {len(ambiguous)} places of the saved state, "
            f"{', '.join(map(repr, ambiguous))} (the same leaves, shapes and dtypes), so which one it asks for is "
            "ambiguous.",
            f"name it: restore({step}, target, part={ambiguous[-1]!r})."))
    if not found:
        return None
    prefix = (exact or found)[0]
    return prefix, [m.group(1) or m.group(2) for m in _KEY.finditer(prefix)]


_TOP = re.compile(r"\.\w+|\['[^'\\]*'\]|\[\d+\]")


def _missing_leaf(step: int, saved: dict[str, list], want: dict[str, list], at: str, path: str,
                  directory: Path | str | None = None) -> str:
    """Why a target leaf is not in the checkpoint, with the way to the target that fits."""
    head = f"{_head(step, directory)} has no leaf state{at}{path} (the target has it)"
    bare = path.removesuffix(".value")
    if bare != path and bare in saved:  # a Flax box (nn.Partitioned, an NNX Variable) around a saved array
        return fix(f"{head}; it holds state{at}{bare}, the same array without Flax's box around it.",
                   "restore into an unboxed target: strategy.abstract(make_state, unbox=True), or "
                   "flax.linen.meta.unbox(target).")
    # The other way round: a state saved as strategy.init returned it, with Flax's boxes (any of the
    # target's leaves, since an unannotated one, a bias, has no box to find).
    boxed = [(p, w) for w in [path, *want] if not w.endswith(".value") for p in saved if p.endswith(w + ".value")]
    if boxed:
        return fix(f"{head}; it holds state{boxed[0][0]}, the same array inside Flax's box as the target's "
                   f"{boxed[0][1]} (the state was saved boxed, as strategy.init returns a Flax model's state).",
                   "restore into a boxed target: strategy.abstract(make_state) without unbox=True (or its "
                   ".params), or save the state unboxed (flax.linen.meta.unbox(state)) as fit does.")
    if not set(want) & set(saved):  # another structure altogether (task.init's tree for fit's whole state)
        tops = sorted({m.group(0) for p in saved if (m := _TOP.match(p))})
        return fix(f"{head}, nor any other of the target's {len(want)} leaves: the saved state holds "
                   f"{', '.join('state' + t for t in tops)}.",
                   "restore into a target of that state: strategy.abstract(make_state) of the make_state it was "
                   "saved from (a run of fit: spmdkit.task_state(task, optimizer), with unbox=True), or a part of it "
                   "(its .params).")
    what = "optimizer" if path.startswith(".opt_state") else "model (task and options)"
    return fix(f"{head}.", f"resume with the {what} the checkpoint was written with (from Python: restore into a "
               "target of that state).")


def _without_step(message: str, step: int, directory: Path | str | None = None) -> str:
    """An error's first line without its leading ``checkpoint step N in DIR:``, for a log line that
    names the step."""
    for head in (f"{_head(step, directory)}: ", f"{_head(step, directory)} is damaged: "):
        if message.startswith(head):
            return message[len(head):]
    return message


def step_name(step: int) -> str:
    """The directory of ``step`` inside a checkpoint directory."""
    return f"{STEP_PREFIX}_{step}"


def parse_step(name: str) -> int | None:
    """The step of a committed step directory of ours, else None."""
    head, sep, tail = name.partition("_")
    return int(tail) if head == STEP_PREFIX and sep and tail.isdigit() else None


def _files(step_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(step_dir)): p.stat().st_size for p in sorted(step_dir.rglob("*")) if p.is_file()}


def _crc32s(paths: list[Path]) -> list[str]:
    """The checksums of many files, read in parallel: the CRC releases the GIL, so a save's
    or a restore's checksums use every core."""
    big = [p for p in paths if p.stat().st_size >= 1 << 20] if len(paths) > 1 else []
    if len(big) < 2:
        return [crc32_file(p) for p in paths]
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="spmdkit-crc") as pool:
        return list(pool.map(crc32_file, paths))


def read_manifest(root: Path, step: int) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)``, ``(None, None)`` if there is none, or ``(None, what is wrong)``."""
    path = root / MANIFESTS / f"{step}.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"manifest {MANIFESTS}/{step}.json cannot be read ({e.strerror})"
    text = raw.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
        files = data["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("crc32"), str)
            for v in files.values()
        ):
            raise ValueError("bad file table")
        return data, None
    except (ValueError, KeyError, TypeError):
        what = "empty" if not text.strip() else "not a manifest (garbage or cut short)"
        return None, f"manifest {MANIFESTS}/{step}.json is {what}"


def verify_step(root: Path, step: int, manifest: dict[str, Any],
                checksum: Callable[[str], bool] | None = None) -> list[str]:
    """Every file of the manifest present, of its size and (where ``checksum(name)``) its
    checksum; what differs, named."""
    step_dir = root / step_name(step)
    have = _files(step_dir) if step_dir.is_dir() else {}
    out, summed = [], []
    for name, want in manifest["files"].items():
        where = f"{step_name(step)}/{name}"
        if name not in have:
            out.append(f"file {where} is missing")
        elif have[name] != want["bytes"]:
            out.append(f"file {where} has {have[name]} bytes, expected {want['bytes']} (truncated or overwritten)")
        elif checksum is None or checksum(name):
            summed.append(name)
    for name, crc in zip(summed, _crc32s([step_dir / name for name in summed])):
        if crc != manifest["files"][name]["crc32"]:
            out.append(f"file {step_name(step)}/{name} has changed bytes (checksum differs)")
    return out


def _not_chunk(name: str) -> bool:
    return not _read.is_chunk_file(name)


_VERDICT_BYTES = 4096


def _from_process_0(verdict: dict[str, str]) -> dict[str, str]:
    """Process 0's ``verdict`` on every process (it alone passes a non-empty one)."""
    if jax.process_count() == 1:
        return verdict
    raw = json.dumps(verdict).encode()[: _VERDICT_BYTES - 8]
    buf = np.zeros(_VERDICT_BYTES, np.uint8)
    buf[:8] = np.frombuffer(len(raw).to_bytes(8, "little"), np.uint8)
    buf[8: 8 + len(raw)] = np.frombuffer(raw, np.uint8)
    got = np.asarray(broadcast(buf, "process 0's word on the checkpoint directory"))
    size = int.from_bytes(got[:8].tobytes(), "little")
    try:
        return json.loads(got[8: 8 + size].tobytes().decode())
    except ValueError:  # a message cut at the buffer's end
        return {"error": got[8: 8 + size].tobytes().decode(errors="replace"), "kind": "refused"}


def check_savable(state: Any, where: str, in_fit: bool = False, name_max: int | None = None) -> None:
    """``state`` can be saved: every leaf an array with elements, no two leaves stored under one
    name, and (``name_max``: the file system's limit on a file name, None with OCDBT) every stored
    name a file name. ``fit`` asks at its start (``in_fit``: the fixes then speak of the task and
    optimizer), so a run learns it before its first save rather than at it, ``every`` steps later."""
    _check_array_leaves(state, where, in_fit)
    _check_stored_names(state, where, in_fit, name_max)


def _check_array_leaves(state: Any, where: str, in_fit: bool = False) -> None:
    """Every leaf an array with elements: a bare Python number has no dtype to store or to check a
    restore target against (it raised an AttributeError naming no leaf); Orbax refuses an empty one."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            dtype = {bool: "jnp.bool_", int: "jnp.int32", float: "jnp.float32"}.get(type(leaf))
            as_array = f"make it an array in the state, jnp.asarray({leaf!r}, {dtype}), or " if dtype else ""
            raise CheckpointError(fix(
                f"{where}: state{jax.tree_util.keystr(path)} is a Python {type(leaf).__name__} "
                f"({reprlib.repr(leaf)}), not an array: a checkpoint stores arrays of a known dtype.",
                f"{as_array}keep it in save()'s meta dict."))
        if 0 in tuple(leaf.shape):
            # Orbax refuses it in its background thread, which read as a failed disk ("free disk space").
            remedy = ("give it at least one element where it is made (the task's init or the optimizer's init: fit "
                      "saves the whole train state), or train without checkpoint= (--checkpoint-dir)." if in_fit else
                      "leave it out of the saved state (rebuild it after a restore; its shape can go in save()'s "
                      "meta dict), or give it at least one element.")
            raise CheckpointError(fix(
                f"{where}: state{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}, no elements: "
                "Orbax cannot store an empty array.", remedy))


def _check_stored_names(state: Any, where: str, in_fit: bool = False, name_max: int | None = None) -> None:
    """Every leaf its own directory: Orbax stores a leaf under its keys joined by ``.``, so
    ``{"a.b": x, "a": {"b": y}}`` wrote both into ``state/a.b`` and either came back for both."""
    seen: dict[str, str] = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = ".".join(str(_read._key_name(k)) for k in path)
        here = jax.tree_util.keystr(path)
        if name_max is not None:
            _check_file_name(name, here, where, in_fit, name_max)
        # A '/' in a key is a path separator to Orbax, with or without OCDBT: "a/" and "a" are one leaf.
        stored = "/".join(part for part in name.split("/") if part)
        if stored in seen:
            raise CheckpointError(fix(
                f"{where}: state{seen[stored]} and state{here} would be stored in the same file "
                f"(Orbax names a leaf by its keys joined with '.', a '/' separating directories: {stored!r}), and "
                "one would overwrite the other.",
                "rename the key that contains a '.' or a '/' (e.g. 'a.b' -> 'a_b') so that no two leaves join to "
                "one name."))
        seen[stored] = here


def _check_file_name(name: str, here: str, where: str, in_fit: bool, name_max: int) -> None:
    """A leaf's stored name is a directory of the step (``state/<name>/``, a ``/`` in a key making
    subdirectories): a part longer than the file system allows, or one that is ``.`` or ``..``,
    failed in Orbax's save thread as "File name too long" or "Invalid file path", taken for a
    full disk, at the first save after ``every`` steps of training."""
    parts = name.split("/")
    for i, part in enumerate(parts):
        size = len(part.encode("utf-8", "surrogatepass"))
        if "\0" in part or (not part and 0 < i < len(parts) - 1):  # a NUL, or "a//b"
            what, rename = "is not a file name (a NUL byte, or an empty part between two '/')", "keys without them"
            part = name
        elif size > name_max:
            what = f"is {size} bytes, longer than the {name_max} bytes a file name may have here"
            rename = ("shorter keys on that path (the module and parameter names of the task's init, or the "
                      "optimizer's nesting: fit saves the whole train state)" if in_fit else "shorter keys on that path")
        elif part in (".", ".."):
            what, rename = "is not a file name", f"a key other than {part!r}"
        else:
            continue
        raise CheckpointError(fix(
            f"{where}: state{here} cannot be saved: Orbax stores a leaf in a directory named by its keys joined "
            f"with '.', and its name {reprlib.repr(part)} {what}.",
            f"use {rename}, or CheckpointConfig(ocdbt=True), which stores the leaves inside a few files rather "
            "than a directory each."))


def name_limit(directory: Path) -> int:
    """The longest file name, in bytes, the file system of ``directory`` allows (255 on Linux's)."""
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows), or no answer
        return 255


_WATCHING: list[bool] = []


def _no_hang_at_exit(code: int = 5) -> None:
    """After a failed save, end the process at exit instead of waiting for Orbax.

    A save that fails in Orbax's background thread can leave Orbax's signalling threads
    (not daemons) waiting for a commit that will never come, for up to its 20-minute
    timeout, and Python waits for every such thread before it exits. A daemon watcher
    sees the main thread finish; if only Orbax's threads remain 2 s later, it flushes the
    output and ends the process with ``code`` (the CLI's code for a failed save).
    """
    if _WATCHING:
        return
    _WATCHING.append(True)

    def orbax_only() -> bool:
        rest = [t for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]
        return bool(rest) and all(type(t).__module__.startswith("orbax") for t in rest)

    def watch() -> None:
        main = threading.main_thread()
        while main.is_alive():
            time.sleep(0.2)
        deadline = time.time() + 2.0
        while time.time() < deadline:
            if not orbax_only():
                return  # nothing of Orbax's left waiting (or a user's own thread still runs)
            time.sleep(0.1)
        exit_now(code)

    threading.Thread(target=watch, name="spmdkit-no-hang-at-exit", daemon=True).start()


def _os_cause(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    for code, name in ((errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system"),
                       (errno.EACCES, "Permission denied"), (errno.EFBIG, "File too large"),
                       (errno.EDQUOT, "Disk quota exceeded"), (errno.ENAMETOOLONG, "File name too long")):
        if getattr(e, "errno", None) == code or name in str(e):
            return f"{name} ({text[:300]})"
    return text[:400]


# How a full, read-only or forbidden file system shows in Orbax's and TensorStore's errors.
# A directory removed under a save (rm -rf of --checkpoint-dir) is one too, as is a name longer than a file
# name may be (one check_savable missed: a leaf's is refused before the save).
_FS_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EFBIG, errno.ENOENT)
_FS_TEXTS = ("No space left on device", "Read-only file system", "Permission denied", "PERMISSION_DENIED",
             "RESOURCE_EXHAUSTED", "File too large", "No such file or directory", "File name too long")
# The causes "free disk space or make the directory writable" fixes; any other was told it too.
_SPACE_OR_ACCESS = ("No space left on device", "Read-only file system", "Permission denied", "PERMISSION_DENIED",
                    "RESOURCE_EXHAUSTED", "Disk quota exceeded", "not writable")


class _QuietOcdbtMerge(logging.Filter):
    """Drops Orbax's one warning that every save without OCDBT logs (nothing to merge), and
    the tracebacks (not the lines) of Orbax's background-save errors caused by the file
    system (full, read-only, no permission, a file size limit): spmdkit reports those itself,
    naming the directory, the cause and the fix. Also on asyncio's logger, where each of a
    failed save's other chunk writes logs "Task exception was never retrieved"."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "Skipping merge of OCDBT checkpoints" in str(record.msg):
            return False
        error = record.exc_info[1] if record.exc_info else None
        if record.name == "asyncio" and "orbax" not in str(record.msg):
            return True  # a task of the user's own: left as it is
        if error is not None and (getattr(error, "errno", None) in _FS_ERRNOS or any(m in str(error) for m in _FS_TEXTS)):
            record.msg = f"{record.msg} ({type(error).__name__}: {error})"
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_orbax() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietOcdbtMerge) for f in logger.filters):
            logger.addFilter(_QuietOcdbtMerge())
    if not getattr(sys.unraisablehook, "_spmdkit", False):
        sys.unraisablehook = _closed_loop_callbacks_dropped(sys.unraisablehook)


def _closed_loop_callbacks_dropped(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """``sys.unraisablehook`` without the tracebacks of TensorStore writes that finish after a
    failed save closed Orbax's event loop (``RuntimeError: Event loop is closed`` from
    ``call_soon_threadsafe``, six lines each): noise after the save's own error."""
    def hook(unraisable: Any) -> None:
        error, tb = unraisable.exc_value, unraisable.exc_traceback
        last = traceback.extract_tb(tb)[-2:] if tb is not None else []
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
                and any(f.name == "call_soon_threadsafe" for f in last)):
            previous(unraisable)

    hook._spmdkit = True  # type: ignore[attr-defined]
    return hook


class _ReadableSteps:
    """Orbax's step names, minus steps whose ``_CHECKPOINT_METADATA`` Orbax cannot read.

    Orbax reads every step's commit time when a manager opens a directory and raises on a
    metadata file that is JSON but not its layout: one damaged step would stop every
    resume. Such a step is left out of Orbax's listing and reported as damaged
    (``unreadable``), so a resume falls back past it like past any other damage.
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.unreadable: dict[int, str] = {}

    def build_name(self, step: int) -> str:
        return self.inner.build_name(step)

    def find_step(self, base_path: Any, step: int) -> Any:
        return self.inner.find_step(base_path, step)

    def find_all(self, base_path: Any) -> Any:
        for metadata in self.inner.find_all(base_path):
            try:
                metadata.commit_timestamp  # what the manager reads first: raises on a damaged file
            except Exception as e:  # Orbax raises ValueError, TypeError, KeyError on such files
                if not (Path(str(base_path)) / step_name(metadata.step)).exists():
                    continue  # deleted meanwhile by the retention of a run writing here: gone, not damaged
                self.unreadable[metadata.step] = (f"Orbax's {step_name(metadata.step)}/_CHECKPOINT_METADATA "
                                                  f"cannot be read ({type(e).__name__}: {str(e)[:120]})")
                continue
            yield metadata


def x64_hint(saved: str, target: str) -> str:
    """Why a 64-bit leaf meets its 32-bit twin: JAX_ENABLE_X64 differs between the two runs.

    >>> x64_hint("float64", "float32")
    ' The checkpoint was written with 64-bit types on (JAX_ENABLE_X64=1) and this run has them off: set JAX_ENABLE_X64=1 to resume it.'
    """
    twins = {("float64", "float32"), ("int64", "int32"), ("uint64", "uint32"), ("complex128", "complex64")}
    if (saved, target) in twins:
        return (" The checkpoint was written with 64-bit types on (JAX_ENABLE_X64=1) and this run has them off: "
                "set JAX_ENABLE_X64=1 to resume it.")
    if (target, saved) in twins:
        return (" The checkpoint was written with 64-bit types off and this run has them on (JAX_ENABLE_X64): "
                "unset JAX_ENABLE_X64 to resume it.")
    return ""


def _members_hint(saved: tuple, shape: tuple, members: int | None) -> str:
    """Why a leaf's shape differs when the difference is an ensemble's member axis."""
    if saved[1:] == shape:
        return (f" Every saved leaf has a leading axis of {saved[0]} here: an Ensemble({saved[0]}) checkpoint. "
                f"Restore it into Ensemble({saved[0]}).abstract(make_state) (--members {saved[0]}), then take "
                "member m as jax.tree.map(lambda x: x[m], state).")
    if shape[1:] == saved:
        return (f" The target has a leading axis of {shape[0]} the checkpoint lacks: a single model's checkpoint "
                "restored into an ensemble. Restore it into the single model's target.")
    if members is not None and saved and shape and saved[0] != shape[0]:
        return (f" The leading axis is the ensemble's member count: the checkpoint has "
                f"{saved[0]} members, this run {shape[0]}; use --members {saved[0]} "
                f"(Ensemble({saved[0]}) from Python).")
    return ""


def _check_key_impls(step: int, saved: dict[str, str], target: dict[str, str], prefix: str,
                     directory: Path | str | None = None) -> None:
    """A PRNG key saved as one implementation, restored as another (threefry and rbg keys
    differ in size, which read as a change of model size)."""
    for path, impl in target.items():
        was = saved.get(prefix + path)
        if was is not None and was != impl:
            raise CheckpointError(fix(
                f"{_head(step, directory)}: leaf state{path} is a {was} PRNG key in the checkpoint but a {impl} key "
                "in the target.",
                f"make that key with the implementation it was saved with: jax.random.key(seed, impl={was!r})."))


_HOOKED: list[bool] = []
_UNCLOSED: set = set()  # Checkpointers with a save that may be in flight (held: one dropped unclosed still finishes)


# How long a process of several waits at exit for the others to finish an unclosed save with it.
UNCLOSED_WAIT_S = 120.0


def _finish_at_exit(ckpt: Checkpointer) -> None:
    """Have ``ckpt``'s last save finished when the process exits without ``close()``.

    Run by threading's exit hooks, which come before the thread pools shut down (Python's own
    ``atexit`` comes after them, too late for Orbax's commit thread). Hooks run last-registered
    first, and Orbax's pools registered theirs before the first save registers this one."""
    if not _HOOKED:  # once per process (the set empties whenever every Checkpointer closed)
        try:
            threading._register_atexit(_close_unclosed)  # private, Python >= 3.9
        except (AttributeError, RuntimeError):  # another Python, or already shutting down
            return
        _HOOKED.append(True)
    _UNCLOSED.add(ckpt)


def _close_unclosed() -> None:
    """Finish the unclosed saves; one that fails (or a Ctrl-C) ends the process with its code: the
    exit code was 0 with the step left incomplete. Nothing is left to raise to at exit.

    With several processes every one writes its part of the step, and the save finishes when all
    have: each waits for the others, for at most ``UNCLOSED_WAIT_S``. Skipped there, the step was
    left incomplete without a word (Orbax's commit failing in 289 lines of its own tracebacks),
    and a process that did call ``close()`` waited for ever for one that did not."""
    code, step = 0, None
    try:
        for ckpt in list(_UNCLOSED):
            step = ckpt._pending
            if step is None:
                continue
            several = jax.process_count() > 1
            # A process ending after an error (end_soon) has less: the wait its timer allows, less a
            # margin, so that this process's verdict and code (not the timer's) end it.
            ending = armed()
            wait = UNCLOSED_WAIT_S if ending is None else min(UNCLOSED_WAIT_S, max(ending[1] - 2.0, 0.0))
            ckpt.log(f"checkpoints: finishing the save of step {step} as the process exits (close() was not "
                     "called: call it, or use `with Checkpointer(...) as ckpt`"
                     + (f"; every process finishes its part, this one waits up to {wait:.0f} s for the "
                        "others)" if several else ")"))
            try:
                _within(ckpt.close, wait if several else None, step)
            except Exception as e:
                sys.stderr.write(f"spmdkit: {str(e).splitlines()[0]}\n")
                # The error that ended the process (a lost peer: exit 4; an uncaught one: 1) is the cause.
                code = code or (ending[0] if ending and ending[0] else CheckpointSaveError.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write(f"spmdkit: interrupted while finishing the save of step {step} at exit: it is left "
                         "incomplete (a resume sets it aside)\n")
        code = 130
    if code:
        exit_now(code)


def _within(close: Callable[[], None], seconds: float | None, step: int) -> None:
    """``close()``, given at most ``seconds`` (None: as long as it takes): a peer process that
    ended, or never reaches its own exit, would hold this one in Orbax's barrier for 20 minutes."""
    if seconds is None:
        return close()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            close()
        except BaseException as e:  # noqa: BLE001 - raised in the exiting thread below
            failed.append(e)

    worker = threading.Thread(target=run, name="spmdkit-finish-save-at-exit", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():  # read before `failed`: a failure landing in between is not a success
        raise CheckpointSaveError(fix(
            f"the save of step {step} did not finish within {seconds:g} s of this process's exit: another process "
            "did not finish its part (it ended, or it has not reached the end of its program), or this process's "
            "own write took longer. The step is left incomplete; a resume sets it aside and takes the step before.",
            "call close() (or use `with Checkpointer(...) as ckpt`) in every process before it exits."))
    if failed:
        raise failed[0]


class Checkpointer:
    """Save and restore train states in ``directory`` (one run, one process group).

    Example:
        >>> import tempfile, jax.numpy as jnp, spmdkit
        >>> ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(tempfile.mkdtemp(), every=1))
        >>> ckpt.save(1, {"w": jnp.ones(3)}, {"step": 1})
        >>> ckpt.close()
        >>> ckpt.steps()
        [1]
    """

    def __init__(self, config: CheckpointConfig, log: Callable[[str], None] = print):
        if not isinstance(config, CheckpointConfig):
            raise CheckpointError(fix(f"Checkpointer({config!r:.60}): needs a spmdkit.CheckpointConfig.",
                                      f"pass spmdkit.Checkpointer(spmdkit.CheckpointConfig({config!r:.40}))"
                                      if isinstance(config, (str, os.PathLike)) else
                                      "pass spmdkit.Checkpointer(spmdkit.CheckpointConfig('runs/ckpt'))."))
        self.config = config
        self.directory = Path(config.directory).absolute()
        self.log = log
        self.primary = jax.process_index() == 0
        self.run_id: str | None = None  # set by claim(): a reader owns nothing
        self._lockfile = DirLock(self.directory / LOCK_FILE, log, "checkpoints")
        self._pending: int | None = None
        self._deleting: list[threading.Thread] = []
        self.blocked: list[float] = []  # seconds the caller waited per save
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            # A place that refuses the write is an I/O failure (exit 5), as a refused save is; a
            # file in the way of the path is bad input (2).
            kind = CheckpointSaveError if e.errno in _FS_ERRNOS else CheckpointError
            raise kind(fix(f"checkpoint directory {self.directory} cannot be created: {_os_cause(e)}.",
                           "pass a --checkpoint-dir that is (or can be made) a writable directory.")) from None
        if jax.process_count() > 1:
            self._check_same_config()
        _quiet_orbax()
        self._names = _ReadableSteps(_orbax().step.standard_name_format(step_prefix=STEP_PREFIX))
        # A leaf is a directory of its own unless OCDBT packs the leaves into files: its name is a file name.
        self.name_max = None if config.ocdbt else name_limit(self.directory)
        self.manager = self._open_manager()

    def _check_same_config(self) -> None:
        """Every process opens the directory alike. Orbax's manager opens with a barrier of every
        process: a process elsewhere (one that built no Checkpointer, as in "only process 0 saves")
        left this one waiting for ever. Another ``keep`` in one process was dropped without a word
        (process 0's deleted the steps), and another ``resume`` had one process restore while the
        other started afresh."""
        mine = {f.name: getattr(self.config, f.name) for f in fields(self.config) if f.name != "directory"}
        every = disagreement(json.dumps(mine, sort_keys=True).encode(), lambda: mine,
                             "spmdkit.Checkpointer(...), opening a checkpoint directory")
        if every is None:
            return  # the directories are compared when the directory is claimed, resolved
        p = next(p for p, c in enumerate(every) if c != every[0])
        name = next(k for k in every[0] if every[0][k] != every[p].get(k))
        raise CheckpointError(fix(
            f"the processes opened the checkpoint directory with another CheckpointConfig.{name}: process 0 "
            f"{every[0][name]!r}, process {p} {every[p].get(name)!r}. Every process writes its part of each step, "
            "and process 0 alone deletes old steps and decides whether to resume.",
            f"give every process the same CheckpointConfig (the same {name}; on the command line the same flags)."))

    def _open_manager(self) -> ocp.CheckpointManager:
        """Orbax's manager of the directory. Opening lists the steps and reads the newest one's
        metadata: in a directory a live run saves to, its retention may delete a step in between
        (Orbax then raised a bare ValueError), so the listing is taken again."""
        ocp = _orbax()
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                return ocp.CheckpointManager(
                    self.directory,
                    options=ocp.CheckpointManagerOptions(
                        # Retention is ours: Orbax's keep-N would delete any integer-named directory.
                        max_to_keep=None, enable_async_checkpointing=True, create=True, step_name_format=self._names,
                    ),
                    item_handlers={
                        "state": ocp.PyTreeCheckpointHandler(use_compression=self.config.compress,
                                                             use_ocdbt=self.config.ocdbt),
                        "meta": ocp.JsonCheckpointHandler(),
                    },
                )
            except (ValueError, FileNotFoundError) as e:
                cause = f"{type(e).__name__}: {str(e)[:200]}"
                time.sleep(0.1 * (attempt + 1))
        raise CheckpointError(fix(
            f"checkpoint directory {self.directory} kept changing while it was opened ({_OPEN_ATTEMPTS} attempts; "
            f"the last: {cause}): another process is saving or deleting steps in it.",
            "open it again (a reader following a live run retries on CheckpointError), or read a copy."))

    def claim(self) -> Checkpointer:
        """Take the directory for writing (every process calls it; returns ``self``).

        A fresh run (``resume=False``) into a directory another run wrote is refused unless
        ``overwrite``; a second writer is refused while the first holds ``spmdkit.lock``.
        """
        if self.run_id is None:
            self._check_same_directory()
            self.run_id = self._claim(self.config.resume)
            self.manager.reload()
        return self

    def _check_same_directory(self) -> None:
        """Every process writes its shards of a step into one directory: given different ones
        (a temporary directory made in each process), each waited for the others' files forever."""
        paths = ([str(self.directory)] if jax.process_count() == 1
                 else gather_json(str(self.directory), "the checkpoint directory"))
        if len(set(paths)) > 1:
            listed = "; ".join(f"process {i}: {p}" for i, p in enumerate(paths))
            raise CheckpointError(fix(
                f"the processes were given different checkpoint directories ({listed}), but each step is one "
                "checkpoint that every process writes its shards into.",
                "pass every process the same directory, on a file system they all reach (the same "
                "--checkpoint-dir; CheckpointConfig(directory=...) from Python)."))

    # ---- ownership ---------------------------------------------------------------
    def _claim(self, resume: bool) -> str:
        """Lock the directory, clear interrupted saves, and settle whose run this is.

        Process 0 decides alone and tells every process (run id, or the error to raise), so
        a refusal ends every process at once instead of leaving the others waiting for it.
        """
        verdict: dict[str, str] = {}
        if self.primary:
            try:
                verdict = {"run_id": self._claim_primary(resume)}
            except CheckpointError as e:
                verdict = {"error": str(e), "kind": "save" if isinstance(e, CheckpointSaveError) else "refused"}
            except Exception as e:  # anything else still ends every process, not only this one
                verdict = {"error": f"claiming checkpoint directory {self.directory} failed: "
                                    f"{type(e).__name__}: {str(e)[:400]}", "kind": "refused"}
        verdict = _from_process_0(verdict)
        if "error" in verdict:
            raise (CheckpointSaveError if verdict["kind"] == "save" else CheckpointError)(verdict["error"])
        return verdict["run_id"]

    def _claim_primary(self, resume: bool) -> str:
        owner_path = self.directory / OWNER_FILE
        owner = None
        if owner_path.exists():
            try:
                owner = json.loads(owner_path.read_text())
                owner = owner if isinstance(owner, dict) else {}
            except (OSError, ValueError):
                owner = {}
        ours = self.steps()
        # An owner with no step (its run ended before its first save, or was refused at its start)
        # has nothing a fresh run could mix with: it was "holds the checkpoints of run ...: steps []".
        if not resume and ours and not self.config.overwrite:
            who = f"run {owner.get('run_id')} (started {owner.get('created', '?')})" if owner else "another run"
            raise CheckpointError(fix(
                f"{self.directory} holds the checkpoints of {who}: steps {ours}. A fresh run would mix "
                "its steps with that run's.",
                "pass --resume to continue that run, another --checkpoint-dir for a new one, or "
                "--overwrite-checkpoints to delete that run's checkpoints (CheckpointConfig(resume=True / "
                "overwrite=True) from Python)."))
        run_id = (owner or {}).get("run_id") if resume else None
        run_id = run_id or uuid.uuid4().hex[:12]
        try:
            self._lock(run_id)
            self._clear_interrupted()
            if not resume and ours:
                for step in ours:
                    self._remove_step(step)
                self.log(f"checkpoints: deleted steps {ours} of the previous run (overwrite asked for)")
            foreign = sorted(p.name for p in self.directory.iterdir() if not self._is_ours(p.name))
            if foreign:
                self.log(f"checkpoints: leaving {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} spmdkit "
                         f"did not write alone in {self.directory}: {', '.join(foreign[:5])}")
            if owner is None or not resume or owner.get("run_id") != run_id:
                replace_text(owner_path, json.dumps(
                    {"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "format": 1}))
        except OSError as e:
            self._release()
            raise CheckpointSaveError(fix(
                f"checkpoint directory {self.directory} is not writable: {_os_cause(e)}.",
                "free space or fix the permissions, or pass another --checkpoint-dir.")) from None
        except BaseException:
            self._release()
            raise
        return str(run_id)

    def _is_ours(self, name: str) -> bool:
        return (name in (MANIFESTS, OWNER_FILE, LOCK_FILE, OUT_LOCK, OUT_RUN_FILE) or parse_step(name) is not None
                or name.startswith((f"{STEP_PREFIX}_", _ASIDE, f".{OWNER_FILE}.")) or is_temporary(name))

    def _lock(self, run_id: str) -> None:
        self._lockfile.take(run_id, lambda other: CheckpointError(refusal(
            other, self._lockfile.path, f"checkpoints to {self.directory}", "two writers would destroy each other's steps",
            "another --checkpoint-dir")))

    def _release(self) -> None:
        self._lockfile.release()

    def _clear_interrupted(self) -> None:
        for p in sorted(self.directory.iterdir()):
            if _TMP_MARK in p.name and p.name.startswith(f"{STEP_PREFIX}_"):
                # An interrupted save of ours (a crash, a kill): never a checkpoint, safe to remove.
                shutil.rmtree(p, ignore_errors=True)
                self.log(f"checkpoints: removed {p.name}, left by {_interrupted_what(p.name)}")

    def _remove_step(self, step: int) -> None:
        """Delete one of our steps: renamed to a temporary name first, so a crash leaves no half step.

        The files go in a background thread (a save is committed without waiting for an
        older step's deletion); :meth:`close` waits for it, and a deletion cut short by the
        process's end is finished by the next run's :meth:`claim`.
        """
        path = self.directory / step_name(step)
        if path.exists():
            doomed = path.with_name(f"{path.name}{_TMP_MARK}-deleting")
            os.replace(path, doomed)
            thread = threading.Thread(target=shutil.rmtree, args=(doomed,), kwargs={"ignore_errors": True},
                                      name="spmdkit-delete-step", daemon=True)
            thread.start()
            self._deleting.append(thread)
        (self.directory / MANIFESTS / f"{step}.json").unlink(missing_ok=True)

    def _deleted(self) -> None:
        """Wait for the deletions :meth:`_remove_step` started."""
        while self._deleting:
            self._deleting.pop().join()

    # ---- saving ----------------------------------------------------------------
    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an asynchronous save; returns once the arrays are copied off the devices.

        A failure (of this save or of the previous one, found here) raises
        :class:`CheckpointSaveError` naming the directory and the cause; the steps saved
        before it stay intact.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise CheckpointError(fix(f"save(step={step!r}): a step is a whole number >= 0.", "pass the step count, e.g. save(100, state, {})."))
        check_savable(state, f"save({step}, state)", name_max=self.name_max)
        t0 = time.perf_counter()
        self.claim()
        self._finish_pending()
        self._check_newest(step)
        meta = {**meta, "step": step, "run_id": self.run_id, "leaves": leaf_table(state), "key_impls": key_impls(state)}
        ocp = _orbax()
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(keys_as_data(state)),
                                                            meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:
            raise self._save_error(step, e) from None
        self._pending = step
        _finish_at_exit(self)
        self.blocked.append(time.perf_counter() - t0)

    def _check_newest(self, step: int) -> None:
        """A save is the directory's newest step. Orbax refused an existing one as if the disk had
        failed; an older one (a run rewound to step 10 saving 15 beside 20 and 30) was kept below
        the abandoned steps, and --keep deleted it first, so a resume took the abandoned step 30.

        Steps in the way that are all damaged or incomplete (a kill between Orbax's commit and the
        manifest) are set aside, as ``--resume`` does: this Checkpointer holds the lock, so none is a
        save still in flight, and nothing could restore them. A loop of the user's that resumed
        with ``restore_latest`` before claiming (which only reads) was refused "already saved" for
        the step it had just been told was damaged, at every restart."""
        newer = [s for s in self.steps() if s >= step]
        if not newer:
            return
        verdict: dict[str, str] = {}
        if self.primary:  # process 0 decides for every process: the set-aside below is collective
            damaged = {s: p[0] for s in newer if (p := self._blocking_problems(s))}
            verdict = ({"aside": ",".join(map(str, newer)), "why": "; ".join(f"step {s}: {p}" for s, p in damaged.items())}
                       if len(damaged) == len(newer) else {"error": self._not_newest(step, newer, sorted(damaged))})
        verdict = _from_process_0(verdict)
        if "error" in verdict:
            raise CheckpointError(verdict["error"])
        aside = [int(s) for s in verdict["aside"].split(",")]
        self.log(f"checkpoints: setting aside step(s) {aside}, damaged or incomplete ({verdict['why']}), to save step "
                 f"{step} (renamed {_ASIDE}{step_name(aside[0])}-<time>, as --resume does; never deleted)")
        self._set_aside(aside)

    def _blocking_problems(self, step: int) -> list[str]:
        """What is wrong with a step in a save's way, its arrays' checksums too: a flipped byte of a
        chunk counted as complete, and every restart was refused "a resume would take step N"."""
        try:
            return self.problems(step)
        except (CheckpointError, OSError) as e:
            return [str(e).splitlines()[0]]

    def _not_newest(self, step: int, newer: list[int], damaged: list[int]) -> str:
        what = (f"step {step} is already saved in {self.directory}" if newer == [step] else
                f"{self.directory} holds step(s) {newer}, not older than step {step}: a resume would take step "
                f"{newer[-1]}, not this one (and retention deletes the oldest steps first)")
        if damaged:
            what += f" (of those, {damaged} are damaged or incomplete; the others are complete)"
        return fix(
            f"save({step}, state): {what}. Checkpoint steps are never overwritten.",
            f"save under a step after {newer[-1]}, or, to continue from an earlier step (a rewind), first move "
            f"{', '.join(step_name(s) for s in newer)} (and manifests/<step>.json) out of the directory, or use "
            "another checkpoint directory.")

    def _save_error(self, step: int, e: BaseException) -> CheckpointSaveError:
        _no_hang_at_exit(CheckpointSaveError.exit_code)
        intact = [s for s in self.steps() if s != step and not self._missing_files(s)]
        cause = _os_cause(e)
        if not self.directory.is_dir():
            cause = f"{self.directory} is gone, removed while the run saved ({cause})"
        return CheckpointSaveError(fix(
            f"saving checkpoint step {step} in {self.directory} failed: {cause}. "
            f"Earlier steps with all their files: {intact or 'none'}.", _save_fix(cause)))

    def _missing_files(self, step: int) -> bool:
        """Whether files of ``step`` are gone (a directory removed under the run): a claim
        that earlier steps are intact must not rest on a listing alone."""
        try:
            return bool(self.problems(step, arrays=False))
        except (CheckpointError, OSError):
            return True

    def _finish_pending(self) -> None:
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
            if step is not None and self.primary:
                self._write_manifest(step)
                self._retain()
        except Exception as e:
            if step is None:
                raise
            raise self._save_error(step, e) from None

    def _write_manifest(self, step: int) -> None:
        step_dir = self.directory / step_name(step)
        if not step_dir.is_dir():
            raise OSError(errno.ENOENT, f"Orbax reported step {step} saved but {step_dir} does not exist")
        sizes = _files(step_dir)
        crcs = _crc32s([step_dir / name for name in sizes])
        files = {name: {"bytes": size, "crc32": crc} for (name, size), crc in zip(sizes.items(), crcs)}
        (self.directory / MANIFESTS).mkdir(exist_ok=True)
        replace_text(self.directory / MANIFESTS / f"{step}.json",
                     json.dumps({"run_id": self.run_id, "step": step, "files": files}))

    def _retain(self) -> None:
        """Keep the newest ``keep`` steps this run wrote; nothing else is ever deleted."""
        self._deleted()  # the previous save's, long done in a training loop
        mine = [s for s in self.steps() if self._writer(s) == self.run_id]
        for step in mine[: -self.config.keep]:
            self._remove_step(step)

    def _writer(self, step: int) -> str | None:
        """The run that wrote ``step``: its manifest says, else (killed before the manifest) its metadata."""
        manifest = read_manifest(self.directory, step)[0]
        if manifest is not None:
            return manifest.get("run_id")
        try:
            return self.meta(step).get("run_id")
        except CheckpointError:
            return None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the last save to finish (call before the process exits, or use ``with``); then unlock.

        A process that exits without it still finishes the last save (with a log line), as the
        interpreter shuts down: Orbax's commit then failed ("cannot schedule new futures after
        interpreter shutdown") and the step was left incomplete. With several processes each
        waits there up to ``UNCLOSED_WAIT_S`` (120 s) for the others to finish theirs, then exits
        5 with the step named."""
        _UNCLOSED.discard(self)
        try:
            self._finish_pending()
        finally:
            try:
                self.manager.close()
            except Exception:  # a failed save was already reported by _finish_pending
                pass
            self._deleted()
            self._release()

    def abandon(self) -> None:
        """After a failed save: stop waiting for Orbax, unlock; never raises, never hangs."""
        _UNCLOSED.discard(self)
        self._pending = None
        try:
            self.manager.close()
        except Exception:
            pass
        self._deleted()
        self._release()

    # ---- reading ---------------------------------------------------------------
    def steps(self) -> list[int]:
        """The committed steps spmdkit wrote in the directory (a user's ``1/`` is not one)."""
        if not self.directory.is_dir():
            return []
        return sorted(s for p in self.directory.iterdir() if (s := parse_step(p.name)) is not None and p.is_dir())

    def problems(self, step: int, arrays: bool = True) -> list[str]:
        """What is wrong with a step, from its manifest ([] if intact).

        A step without a manifest counts as damaged: Orbax committed it, but the process
        was stopped before its files were checksummed, so nothing vouches for its bytes.
        ``arrays=False`` checks the array files' presence and sizes but not their bytes
        (a restore checks those as it reads them).
        """
        if step in self._names.unreadable:
            return [self._names.unreadable[step]]
        manifest, bad = read_manifest(self.directory, step)
        if bad:
            return [bad]
        if manifest is None:
            return [f"it has no manifest ({MANIFESTS}/{step}.json): its save was cut short before its files "
                    "were checksummed, so they cannot be verified"]
        return verify_step(self.directory, step, manifest, checksum=None if arrays else _not_chunk)

    def meta(self, step: int) -> dict[str, Any]:
        path = self.directory / step_name(step) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_text())
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
            return meta
        except (OSError, ValueError) as e:
            self._check_step_exists(step)  # a step that is not there is not a damaged one
            raise CheckpointDamagedError(fix(f"{_head(step, self.directory)}: {path} cannot be read ({e}).",
                                      "the step is damaged; resume from another step.")) from None

    def check_target(self, step: int, target: Any, members: int | None = None, part: str | None = None) -> None:
        """The saved leaves have the target's paths, shapes and dtypes; the first difference is named."""
        saved = self.meta(step).get("leaves", {})
        want = leaf_table(target)
        found = part_of(step, saved, want, part, self.directory)
        self._check_leaves(step, saved, want, found[0] if found else "", members)

    def _check_leaves(self, step: int, saved: dict[str, list], want: dict[str, list], at: str, members: int | None) -> None:
        """``want``'s leaves against the saved ones under the place ``at`` ("" for the whole
        state); errors name a leaf by its place in the saved state."""
        if at:  # a part of the saved state (the parameters alone): compare with that part
            saved = {p[len(at):]: v for p, v in saved.items() if p.startswith(at)}
        for path, (shape, dtype) in want.items():
            if path not in saved:
                raise CheckpointError(_missing_leaf(step, saved, want, at, path, self.directory))
            if list(saved[path][0]) != list(shape):
                hint = _members_hint(tuple(saved[path][0]), tuple(shape), members)
                raise CheckpointError(
                    fix(f"{_head(step, self.directory)}: leaf state{at}{path} has shape {tuple(saved[path][0])} in the "
                        f"checkpoint but {tuple(shape)} in the target.{hint}",
                        "resume with the same model size and member count, or start a new run.")
                )
            if len(saved[path]) > 1 and saved[path][1] != dtype:
                # Orbax would cast silently: a float32 step counter, bfloat16 weights rounded.
                raise CheckpointError(
                    fix(f"{_head(step, self.directory)}: leaf state{at}{path} is {saved[path][1]} in the checkpoint but "
                        f"{dtype} in the target.{x64_hint(str(saved[path][1]), str(dtype))}",
                        f"restore into a target of the saved dtypes ({saved[path][1]} here) and cast after: "
                        "jax.tree.map(lambda x: x.astype(...), state).")
                )
        extra = sorted(set(saved) - set(want))
        if extra:
            what = "optimizer" if extra[0].startswith(".opt_state") else "model (task and options)"
            raise CheckpointError(
                fix(f"{_head(step, self.directory)} has leaves the target lacks, e.g. state{at}{extra[0]}.",
                    f"resume with the {what} the checkpoint was written with (from Python: restore into a "
                    "target of that state, or of one part of it).")
            )

    def _check_step_exists(self, step: int) -> None:
        if not (self.directory / step_name(step)).exists():
            have = self.steps()
            raise CheckpointError(fix(f"{self.directory} holds no checkpoint step {step} (it holds "
                                      f"{'steps ' + str(have) if have else 'no steps'}).",
                                      "restore one of those (ckpt.steps()[-1] is the newest), or check the directory."))

    def restore(self, step: int, target: Any, part: str | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` onto ``target`` (a pytree of ShapeDtypeStruct with shardings), verified.

        ``target`` is the whole saved state or a part of it: ``strategy.abstract(make_state).params``
        restores the parameters alone (inference), onto any mesh. Where the target's leaves fit two
        places of the state (parameters and their EMA), ``part`` names the one meant, as
        ``jax.tree_util.keystr`` prints its path (``part="['ema']"``); without it that is an error.
        Every file of the step is checked against its manifest (sizes, CRC-32) before its bytes are used.
        """
        self._check_step_exists(step)
        problems = self.problems(step, arrays=False)
        if problems:
            raise self._damaged(step, problems)
        try:
            meta = self.meta(step)
            saved, impls = meta.get("leaves"), meta.get("key_impls", {})
        except CheckpointError:
            saved, impls = None, {}  # the restore below reports what is wrong with the step
        typed, target = target, keys_as_data(target)
        want = leaf_table(target)
        part = part_of(step, saved, want, part, self.directory) if saved else None
        keys = part[1] if part else []
        _check_key_impls(step, impls, key_impls(typed), part[0] if part else "", self.directory)
        if saved:  # paths, shapes and dtypes: the first difference named
            self._check_leaves(step, saved, want, part[0] if part else "", None)
        item = target
        for key in reversed(keys):
            item = {key: item}
        manifest, bad = read_manifest(self.directory, step)
        if manifest is None:  # deleted since problems() read it (a writer's retention), or damaged meanwhile
            raise self._damaged(step, [bad or f"its manifest {MANIFESTS}/{step}.json is gone"])
        files = manifest["files"]
        leaves = _read.plan(self.directory / step_name(step), item, files)
        if leaves is not None:
            state, meta = self._read_verified(step, item, leaves, files)
        else:
            state, meta = self._orbax_restore(step, item, bool(keys))
        for key in keys:
            state = state[key]
        return _keys_again(state, typed, impls, part[0] if part else ""), meta

    def _damaged(self, step: int, problems: list[str]) -> CheckpointDamagedError:
        return CheckpointDamagedError(fix(f"{_head(step, self.directory)} is damaged: {'; '.join(problems)}.",
                                   "resume from an earlier step (spmdkit does so with --resume)."))

    def _read_verified(self, step: int, item: Any, leaves: list[_read.Leaf], files: dict[str, Any]) -> tuple[Any, Any]:
        """Orbax's uncompressed format read in one pass, each chunk file checked as it is read;
        then the chunk files this process did not need (other processes' shards, leaves
        outside a partial target), so every process finds the same damage."""
        reader = _read.Reader(self.directory / step_name(step), files)
        try:
            arrays = reader.leaves(leaves)
        except _read.Damaged as e:
            raise self._damaged(step, [str(e)]) from None
        finally:
            reader.close()
        problems = verify_step(self.directory, step, {"files": {n: w for n, w in files.items()
                                                                if _read.is_chunk_file(n) and n not in reader.read}})
        if problems:
            raise self._damaged(step, problems)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(item), arrays), self.meta(step)

    def _orbax_restore(self, step: int, item: Any, partial: bool) -> tuple[Any, Any]:
        """Any other format (compressed, OCDBT, a cast): the array files verified, then Orbax reads."""
        problems = self.problems(step)
        if problems:
            raise self._damaged(step, problems)
        ocp = _orbax()
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                        partial_restore=partial,
                    ),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # Orbax / TensorStore raise many kinds on damaged data
            raise CheckpointDamagedError(
                fix(f"{_head(step, self.directory)} could not be read: {type(e).__name__}: {str(e)[:300]}",
                    "resume from an earlier step (spmdkit does so with --resume).")
            ) from None
        return restored["state"], restored["meta"]

    def restore_latest(self, target: Any, members: int | None = None) -> tuple[Any, dict[str, Any]] | None:
        """The newest intact step restored onto ``target``, falling back past damaged ones (and saying which)."""
        steps = self.steps()
        legacy = [] if steps else self._legacy_steps()
        if legacy:
            # Resuming "from nothing" here would silently start the run over.
            raise CheckpointError(fix(
                f"{self.directory} holds checkpoints in the layout of earlier spmdkit versions (steps "
                f"{legacy} in directories named by number); this version writes and reads spmdkit_<step>/ "
                "directories with checksummed manifests and cannot vouch for those files.",
                "resume them with the spmdkit version that wrote them, or start a new run in another "
                "--checkpoint-dir (CheckpointConfig(directory=...) from Python)."))
        for _ in range(_READ_PASSES):
            restored, damaged, gone = self._newest_intact(steps, target, members)
            if restored is not None:
                if self.run_id is not None:
                    if damaged:
                        self.log(f"checkpoints: resuming from step {restored[1]['step']}, the newest intact one "
                                 f"(damaged: {sorted(damaged)}, set aside)")
                    # Called damage seen or not: in a job, process 0 may have found a step damaged that
                    # it would rename before another process listed it (see _set_aside).
                    self._set_aside(damaged)
                elif damaged:
                    # Only the run that owns the directory moves steps: to a reader (a sidecar evaluating
                    # a live run) a step without its manifest yet may be a save still in flight.
                    self.log(f"checkpoints: restored step {restored[1]['step']}, the newest intact one; "
                             f"{sorted(damaged)} left in place (this Checkpointer only reads until it claims the "
                             "directory: its first save() does, or claim(), and a save sets aside the damaged steps "
                             "in its way)")
                return restored
            if not gone:
                break
            # A run writing here deleted steps under the reader (its retention): list them again.
            steps = self.steps()
        return self._nothing_intact(steps) if steps else None

    def _nothing_intact(self, steps: list[int]) -> None:
        """No step restores. A lone step that is incomplete (no manifest: a kill during the run's first
        save) holds nothing anyone vouched for, so a resume starts over as from an empty directory:
        every restart was refused "all damaged" and told to use another directory. Damaged ones
        (files that fail their checksums), and several without a manifest (a manifests/ directory
        lost), are still refused: a run's history is not dropped silently."""
        # One step: a save holds back the next until its manifest is written, so a kill leaves at most
        # one step without it. Several (a manifests/ directory lost) are a run's history: refused.
        incomplete = len(steps) == 1 and read_manifest(self.directory, steps[0]) == (None, None)
        if not incomplete or not (self.config.resume or self.run_id is not None):
            lost = len(steps) > 1 and not (self.directory / MANIFESTS).is_dir()
            raise CheckpointDamagedError(
                fix(f"no intact checkpoint in {self.directory}: steps {steps} are all damaged"
                    + (f" (none has a manifest: {MANIFESTS}/ is missing)." if lost else "."),
                    (f"put {self.directory / MANIFESTS} back if it was moved; else " if lost else "")
                    + "start a new run in another --checkpoint-dir (or --overwrite-checkpoints).")
            )
        if self.run_id is None:  # a reader moves nothing (see restore_latest)
            self.log(f"checkpoints: nothing intact to restore: steps {steps} are incomplete (no manifest) and left in "
                     "place; this Checkpointer's first save() claims the directory and sets aside those in its way")
            return None
        self.log(f"checkpoints: nothing intact to resume from: steps {steps} are incomplete (no manifest: their saves "
                 "were cut short), set aside")
        self._set_aside(steps)
        return None

    def _newest_intact(self, steps: list[int], target: Any, members: int | None) -> tuple[Any, list[int], list[int]]:
        """The newest of ``steps`` that restores onto ``target`` (None if none does), the steps
        found damaged on the way, and those deleted meanwhile (gone, not damaged)."""
        damaged: list[int] = []
        gone: list[int] = []
        for step in reversed(steps):
            try:
                problem = self._why_not(step, target, members)
            except (CheckpointError, OSError):
                if (self.directory / step_name(step)).exists():
                    raise  # a target that does not fit, or a file the step still holds: not a deletion
                problem = "deleted"  # its files vanished as they were listed (said below)
            if problem is None:
                try:
                    return self.restore(step, target), damaged, gone
                except (CheckpointError, OSError) as e:
                    if isinstance(e, OSError) and (self.directory / step_name(step)).exists():
                        raise
                    problem = _without_step(str(e).splitlines()[0], step, self.directory)
            if not (self.directory / step_name(step)).exists():
                self.log(f"checkpoints: step {step} was deleted while being read (the run writing here keeps "
                         "fewer steps); trying the next")
                gone.append(step)
                continue
            in_flight = self.run_id is None and "no manifest" in problem
            self.log(f"checkpoints: step {step} {'is not complete yet, or damaged' if in_flight else 'is damaged'} "
                     f"({problem}); falling back to an earlier step")
            damaged.append(step)
        return None, damaged, gone

    def _why_not(self, step: int, target: Any, members: int | None) -> str | None:
        """Why ``step`` cannot be restored, found before reading its arrays; None if nothing is seen."""
        problems = self.problems(step, arrays=False)  # the array files: checked as restore() reads them
        if problems:
            return problems[0]
        try:
            self.meta(step)
        except CheckpointError as e:
            return _without_step(str(e).splitlines()[0], step, self.directory)
        self.check_target(step, target, members)  # a target that does not fit is the caller's error
        return None

    def _legacy_steps(self) -> list[int]:
        """Steps saved in the older layout: numbered Orbax step directories (never a user's own)."""
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return []
        return sorted(int(p.name) for p in entries
                      if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").is_file()
                      and (self.directory / MANIFESTS / f"{p.name}.json").is_file())

    def _set_aside(self, steps: list[int]) -> None:
        """Damaged steps newer than the resumed one would block its saves: renamed, not deleted.

        In a job of several processes, every process calls this after its own search, so
        the first exchange below is reached only once every process has read its steps:
        process 0 renames none before another process listed it (which then restored
        without seeing the damage, skipped this exchange and waited for the others in the
        first step, while process 0 waited here). Process 0's list is the one acted on."""
        if jax.process_count() > 1:
            agreed = _from_process_0({"steps": ",".join(map(str, steps))} if self.primary else {})
            steps = [int(s) for s in agreed.get("steps", "").split(",") if s]
        if not steps:
            return
        verdict: dict[str, str] = {}
        if self.primary:
            try:
                for step in steps:
                    path = self.directory / step_name(step)
                    os.replace(path, path.with_name(f"{_ASIDE}{path.name}-{int(time.time())}"))
                    (self.directory / MANIFESTS / f"{step}.json").unlink(missing_ok=True)
            except OSError as e:
                verdict = {"error": fix(f"damaged checkpoint steps {steps} in {self.directory} cannot be set aside: "
                                        f"{_os_cause(e)}.", "make the directory writable, or move them away.")}
        verdict = _from_process_0(verdict)
        if "error" in verdict:  # every process, not only process 0, stops here
            raise CheckpointSaveError(verdict["error"])
        self.manager.reload()


def describe_directory(directory: str | Path, verify: bool = True) -> list[dict[str, Any]]:
    """Rows for ``spmdkit checkpoints DIR``: every step spmdkit wrote, complete or not, with its config.

    With ``verify`` every file's checksum is compared with the step's manifest. A step that a
    run writing the directory renames or deletes while it is read (its save committing, its
    retention) is left out, as it would be had it been listed a moment later.
    """
    root = Path(directory)
    if not root.exists():
        raise CheckpointError(fix(f"{root} does not exist.", "pass the --checkpoint-dir of a run."))
    if not root.is_dir():
        raise CheckpointError(fix(f"{root} is not a directory.", "pass the --checkpoint-dir of a run."))
    rows = []
    entries = []
    for entry in sorted(root.iterdir(), key=lambda p: (len(p.name), p.name)):
        step_text = entry.name[len(STEP_PREFIX) + 1:].split(".")[0]
        if entry.is_dir() and entry.name.startswith(f"{STEP_PREFIX}_") and step_text.isdigit():
            entries.append((entry, int(step_text)))
    # The newest step of a run writing here now may lack its manifest only because the run is
    # checksumming it: that is no damage (a sidecar checking the directory must not fail on it).
    writing = held_now(root / LOCK_FILE)
    newest = max((step for entry, step in entries if _TMP_MARK not in entry.name), default=None)
    for entry, step in entries:
        try:
            rows.append(_step_row(root, entry, step, verify, in_flight=bool(writing) and step == newest,
                                  maybe_live=writing is None and (root / LOCK_FILE).exists()))
        except FileNotFoundError:
            if entry.exists() and _TMP_MARK not in entry.name:
                raise  # a file missing from a step that stays: not a race (verify_step names such files)
    rows.extend(_set_aside_rows(root))
    return sorted(rows, key=lambda r: (r["step"], bool(r.get("set_aside"))))


def _set_aside_rows(root: Path) -> list[dict[str, Any]]:
    """Steps a resume set aside as damaged (``damaged-spmdkit_<step>-<time>``): listed, so a user
    who misses a step finds where it went; never counted (nothing restores them)."""
    rows = []
    for entry in root.iterdir():
        step = parse_step(entry.name[len(_ASIDE):].rsplit("-", 1)[0]) if entry.name.startswith(_ASIDE) else None
        if step is None or not entry.is_dir():
            continue
        try:
            files = _files(entry)
        except FileNotFoundError:
            continue  # removed while listed
        rows.append({"step": step, "bytes": sum(files.values()), "files": len(files), "set_aside": True,
                     "status": f"set aside as damaged by a resume ({entry.name}: kept to inspect, never restored; "
                               "delete it when done)"})
    return rows


def _interrupted_what(name: str) -> str:
    """What left a temporary step directory: a save, or the deletion of an old step (``keep``),
    whose directory is renamed ``..-deleting`` first; both were "an interrupted save"."""
    return ("the deletion of an old step (keep) cut short" if name.endswith(f"{_TMP_MARK}-deleting")
            else "an interrupted save")


def _step_row(root: Path, entry: Path, step: int, verify: bool, in_flight: bool = False,
              maybe_live: bool = False) -> dict[str, Any]:
    """One row of :func:`describe_directory`. ``in_flight``: the newest step while a run holds the
    directory's lock; ``maybe_live``: a lock file whose holder the system cannot tell."""
    files = _files(entry)
    row: dict[str, Any] = {"step": step, "bytes": sum(files.values()), "files": len(files)}
    if _TMP_MARK in entry.name:
        # Never a step: nothing restores it, so --verify does not count it against the directory.
        row["status"] = f"incomplete ({_interrupted_what(entry.name)}; removed on the next start)"
        row["temporary"] = True
        return row
    manifest, bad = read_manifest(root, step)
    row["run_id"] = (manifest or {}).get("run_id")
    if bad:
        row["status"] = f"damaged ({bad})"
    elif manifest is None and in_flight:
        row["status"] = ("being saved (the run holding spmdkit.lock is checksumming it; its manifest comes "
                         "next)")
        row["in_flight"] = True
    elif manifest is None:
        live = ", or a run writing here (spmdkit.lock) is checksumming it now" if maybe_live else ""
        row["status"] = f"incomplete (no manifest: the save was cut short before its files were checksummed{live}; " \
                        "a resume skips it)"
    else:
        problems = verify_step(root, step, manifest) if verify else [
            f"file {n}" for n, w in manifest["files"].items() if files.get(n) != w["bytes"]]
        row["status"] = (f"damaged ({len(problems)} file(s), e.g. {problems[0]})" if problems
                         else "complete, verified" if verify else "complete, sizes match")
    try:
        meta = json.loads((entry / "meta" / "metadata").read_text())
        row["task"] = meta.get("task")
        row["strategy"] = (meta.get("strategy") or {}).get("strategy")
        row["mesh"] = (meta.get("strategy") or {}).get("mesh")
        row["config"] = meta.get("config")
        row["written"] = meta.get("written")
    except FileNotFoundError:
        if not entry.exists():
            raise  # the step went while it was read
        row["status"] += ", meta unreadable"
    except (OSError, ValueError, AttributeError):
        row["status"] += ", meta unreadable"
    return row


_PEER_GONE = ("closed by peer", "connection reset", "gloo", "socket closed", "unavailable:")


def _save_fix(cause: str) -> str:
    """The fix for a failed save: a peer process that died mid-save (its collective
    failed) is not a disk problem."""
    if any(word in cause.lower() for word in _PEER_GONE):
        return ("another process of the job stopped during the save (its connection closed): see its error; "
                "then resume with --resume.")
    if "removed while the run saved" in cause or "No such file or directory" in cause:
        return ("a file or folder of the checkpoint directory was removed while the step was saved (another program, "
                "or the directory itself deleted): keep --checkpoint-dir in place while the run writes it; to start "
                "over, run without --resume, or resume from the steps left.")
    if "File too large" in cause:
        return ("a file of the step is larger than a limit allows: the process's (ulimit -f) or the file "
                "system's (FAT32: 4 GiB); raise the limit or pass a --checkpoint-dir on another file system, "
                "then resume with --resume.")
    if "File name too long" in cause or "Invalid file path" in cause:
        return ("a path of the step is not one the file system takes: for a leaf's name, use shorter keys (or "
                "CheckpointConfig(ocdbt=True)); for the directory, pass a shorter --checkpoint-dir; then resume with "
                "--resume.")
    if not any(text in cause for text in _SPACE_OR_ACCESS):
        return ("see the cause above (not a full disk or a permission); the steps named are intact: once it is "
                "fixed, resume with --resume (or pass another --checkpoint-dir).")
    return ("free disk space or make the directory writable, then resume with --resume "
            "(or pass another --checkpoint-dir).")
