"""Host memory that XLA:CPU reuses from step to step instead of taking it from the kernel anew.

XLA:CPU allocates a compiled program's temporary buffers with ``malloc`` at every execution
and frees them at its end. With glibc's defaults, buffers larger than its mmap threshold (at
most 32 MiB), and the per-thread arenas' heaps that XLA's worker threads use, go back to the
kernel when freed, so the next step faults every page in again and the kernel zeroes it. The
language model of ``spmdkit bench --suite lm`` paid about 72,000 page faults per training step
that way (its 280 MiB of temporaries), about a quarter of its step time. One arena, no mmap
and no trimming make glibc keep that memory and hand the same pages out again: no faults, the
same results (``BENCHMARKS.md``, "lm").

The price: the process keeps its high-water mark of host memory until it exits (it is reused,
not returned), as a caching allocator does, and more when large arrays are freed inside the
heap and replaced by larger ones that their holes cannot hold (README, "Host memory on CPU";
glibc's ``malloc_trim(0)`` gives free pages back). ``SPMDKIT_HOST_ALLOCATOR=system`` keeps
glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from spmdkit._errors import ConfigError, DeviceSetupError, fix

ENV_HOST_ALLOCATOR = "SPMDKIT_HOST_ALLOCATOR"
REUSE, SYSTEM = "reuse", "system"  # the modes: glibc set as spmdkit sets it, or its defaults
_MODES = (REUSE, SYSTEM)
# glibc's environment names for the same settings: read once, at a process's start, so they
# carry the settings to every process this one starts (workers, `spmdkit launch`'s processes).
MALLOC_SETTINGS = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
# mallopt(3) parameter numbers (malloc.h) of the same settings, for this process.
_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_MAX_": -4, "MALLOC_TRIM_THRESHOLD_": -1}
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
# GLIBC_TUNABLES' names of the same settings: glibc lets them win over the MALLOC_* names.
_TUNABLES = {"glibc.malloc.arena_max": "MALLOC_ARENA_MAX", "glibc.malloc.mmap_max": "MALLOC_MMAP_MAX_",
             "glibc.malloc.trim_threshold": "MALLOC_TRIM_THRESHOLD_"}

_applied = False
# What host_memory() says when reuse could apply but nobody asked for it (fit's note keys on it).
DEFAULTS_WHY = "glibc's defaults: call spmdkit.reuse_host_memory() before the first JAX operation"


@dataclass(frozen=True)
class HostMemory:
    """Whether this process reuses its host memory, and why (or why not)."""

    reused: bool
    why: str

    def __str__(self) -> str:
        return f"{'reused' if self.reused else 'system default'} ({self.why})"


def _mode() -> str:
    mode = os.environ.get(ENV_HOST_ALLOCATOR, "").strip().lower() or "reuse"
    if mode not in _MODES:
        raise ConfigError(fix(
            f"{ENV_HOST_ALLOCATOR}={os.environ[ENV_HOST_ALLOCATOR]!r} is not one of {', '.join(_MODES)}.",
            f"set {ENV_HOST_ALLOCATOR}=reuse (the default: XLA:CPU reuses its buffers) or "
            f"{ENV_HOST_ALLOCATOR}=system (glibc's defaults), or unset it.",
        ))
    return mode


def _not_applicable() -> str | None:
    """Why these settings do not apply to this process, or None if they do."""
    if _mode() == "system":
        return f"{ENV_HOST_ALLOCATOR}=system"
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return "the C library is not glibc; the settings are glibc's"
    preloaded = [a for a in _OTHER_ALLOCATORS if a in os.environ.get("LD_PRELOAD", "")]
    if preloaded:
        return f"LD_PRELOAD names {preloaded[0]}, which manages host memory itself"
    if not _mallocs_is_glibcs():
        preload = os.environ.get("LD_PRELOAD")
        return ("malloc here is not glibc's" + (f" (LD_PRELOAD={preload!r})" if preload else "")
                + "; that allocator manages host memory itself")
    foreign = [f"GLIBC_TUNABLES={t}={v}" if t else f"{k}={v}" for k, (t, v) in _given().items()
               if not _same(v, MALLOC_SETTINGS[k])]
    if foreign:
        return "the environment sets " + ", ".join(foreign) + ": left as set"
    return None


def _given() -> dict[str, tuple[str | None, str]]:
    """The settings the environment gives glibc at a process's start, as glibc takes them:
    ``{MALLOC_* name: (the GLIBC_TUNABLES name it came through, or None, value)}``, a
    ``GLIBC_TUNABLES`` item winning over its ``MALLOC_*`` variable, and the last of a tunable
    given twice."""
    given: dict[str, tuple[str | None, str]] = {k: (None, os.environ[k]) for k in MALLOC_SETTINGS if k in os.environ}
    for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, eq, value = item.partition("=")
        if eq and name in _TUNABLES:  # glibc skips an item without "="
            given[_TUNABLES[name]] = (name, value)
    return given


def _same(value: str, ours: str) -> bool:
    """Whether glibc reads ``value`` as the number ``ours`` (it takes " 1", "0x1" and "01" as 1)."""
    text = value.strip()
    digits = text.lstrip("+")
    try:
        if digits[:2].lower() == "0x":
            number = int(digits[2:], 16)
        else:
            number = int(digits, 8 if digits.startswith("0") and len(digits) > 1 else 10)
    except ValueError:
        return text == ours
    return number == int(ours)


def _inherited() -> str | None:
    """Where the environment gives glibc every one of these settings at its start, as spmdkit
    sets them (``MALLOC_*``, ``GLIBC_TUNABLES`` or both), or None when it does not."""
    given = _given()
    if set(given) != set(MALLOC_SETTINGS) or not all(_same(v, MALLOC_SETTINGS[k]) for k, (_, v) in given.items()):
        return None
    names = [k for k, (t, _) in given.items() if t is None]
    tuned = [t.rpartition(".")[2] for t, _ in given.values() if t]
    return _spoken(names + ([f"GLIBC_TUNABLES' {_spoken(tuned)}"] if tuned else []))


def _spoken(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _mallocs_is_glibcs() -> bool:
    """Whether this process's malloc is glibc's (an allocator under any file name can interpose)."""
    first = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    return first == ctypes.cast(ctypes.CDLL("libc.so.6").malloc, ctypes.c_void_p).value


def _backends_started() -> bool:
    try:  # the public API has no "have backends started" question; every JAX from 0.10 has this one
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:  # moved in a later JAX: settings made late are harmless, only ineffective
        return False
    return backends_are_initialized()


def _settled() -> HostMemory | None:
    """The setting when nothing is left to do (not applicable, or already in effect), else None."""
    why_not = _not_applicable()
    inherited = _inherited()
    if inherited and _mode() == "system":
        # glibc read them when the process started (a child of a reusing process): too late to opt out.
        return HostMemory(True, f"set in the environment; glibc read {inherited} when this process "
                          f"started, so {ENV_HOST_ALLOCATOR}=system cannot undo them: start it without them")
    if why_not:
        return HostMemory(False, why_not)
    if _applied:
        return HostMemory(True, "set by spmdkit in this process")
    if inherited:
        return HostMemory(True, "set in the environment" + (f": {inherited}" if "GLIBC_TUNABLES" in inherited else ""))
    return None


def _apply(strict: bool) -> HostMemory:
    global _applied
    settled = _settled()
    if settled is not None:
        return settled
    if _backends_started():
        # XLA's threads already hold their own arenas: settings made now would not reach them.
        if not strict:
            return HostMemory(False, "JAX had started its backends first")
        raise DeviceSetupError(fix(
            "reuse_host_memory() was called after JAX had started its backends; XLA's threads "
            "already have their own malloc arenas, which the settings would not reach.",
            "call spmdkit.reuse_host_memory() right after `import spmdkit`, before any JAX "
            "operation (creating an array, jax.devices(), a jit call); or start Python with "
            + " ".join(f"{k}={v}" for k, v in MALLOC_SETTINGS.items()) + " in the environment.",
        ))
    libc = ctypes.CDLL(None)
    failed = [k for k, v in MALLOC_SETTINGS.items() if libc.mallopt(_MALLOPT[k], int(v)) != 1]
    if failed:
        return HostMemory(False, f"glibc refused mallopt for {', '.join(failed)}")
    os.environ.update(MALLOC_SETTINGS)
    _applied = True
    return HostMemory(True, "set by spmdkit in this process")


def child_env(env: Mapping[str, str], mode: str) -> dict[str, str]:
    """``env`` for a child process whose glibc malloc is set as spmdkit sets it (``"reuse"``)
    or left at glibc's defaults (``"system"``) from its start: glibc reads the settings once,
    before the child's first thread, and a ``spmdkit`` command in the child keeps to the mode.
    ``GLIBC_TUNABLES`` keeps every tunable but these three settings.

    Example:
        >>> from spmdkit._host_memory import child_env
        >>> child_env({"MALLOC_ARENA_MAX": "1", "HOME": "/h"}, "system")
        {'HOME': '/h', 'SPMDKIT_HOST_ALLOCATOR': 'system'}
    """
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r} is not one of {', '.join(_MODES)}")
    out = {k: v for k, v in env.items() if k not in MALLOC_SETTINGS and k != ENV_HOST_ALLOCATOR}
    # GLIBC_TUNABLES wins over MALLOC_*: its values of these three settings go too, the rest stays.
    rest = [item for item in out.pop("GLIBC_TUNABLES", "").split(":") if item and item.partition("=")[0] not in _TUNABLES]
    if rest:
        out["GLIBC_TUNABLES"] = ":".join(rest)
    if mode == REUSE:
        out.update(MALLOC_SETTINGS)
    else:
        out[ENV_HOST_ALLOCATOR] = mode
    return out


def reuse_host_memory() -> HostMemory:
    """Make XLA:CPU reuse its host buffers from step to step (glibc: one arena, no mmap, no trim).

    Call it once, before the first JAX operation: XLA's threads take their malloc arenas
    when JAX starts its backends. A CPU training step then no longer faults its temporary
    buffers in from the kernel at every execution (the bench language model: about 72,000
    faults per step before, none after, and about 1.3x the tokens per second). The process
    keeps its high-water mark of host memory until it exits, and more when large arrays
    are freed and replaced by larger ones (README, "Host memory on CPU"). The ``spmdkit``
    command does this itself; processes started from this one inherit the settings through
    the environment. It does nothing, and says why, when ``SPMDKIT_HOST_ALLOCATOR=system`` is
    set, the C library is not glibc, another allocator's malloc comes first, or the
    environment already sets other ``MALLOC_*`` values (or ``GLIBC_TUNABLES`` other
    ``glibc.malloc.arena_max``, ``mmap_max`` or ``trim_threshold`` values). Called after
    JAX has started, it raises :class:`DeviceSetupError` with the fix.

    Example:
        >>> import spmdkit
        >>> try:
        ...     status = spmdkit.reuse_host_memory()  # first thing, before any JAX work
        ... except spmdkit.DeviceSetupError:  # JAX had started first: the error says what to do
        ...     status = spmdkit.host_memory()
        >>> isinstance(status.reused, bool)
        True
    """
    return _apply(strict=True)


def host_memory() -> HostMemory:
    """This process's host-memory setting, without changing it.

    Example:
        >>> import spmdkit
        >>> isinstance(spmdkit.host_memory().reused, bool)
        True
    """
    return _settled() or HostMemory(False, DEFAULTS_WHY)


def release_host_memory() -> bool:
    """Give a reusing process's free host pages back to the kernel (glibc's ``malloc_trim(0)``).

    The settings stay: later steps take the pages back from the kernel once, then reuse
    them again. :func:`spmdkit.fit` calls it when a run ends, so a process that trains
    several models in turn, or goes on with other work, does not keep a run's high-water
    mark. Returns whether memory went back (False when host memory is not reused here).

    Example:
        >>> import spmdkit
        >>> isinstance(spmdkit.release_host_memory(), bool)
        True
    """
    if not host_memory().reused:
        return False
    return bool(ctypes.CDLL(None).malloc_trim(0))
