"""JAX's persistent compilation cache, with thresholds that keep small steps.

JAX writes a compiled program to its disk cache only when compiling it took at least
``jax_persistent_cache_min_compile_time_secs`` (1 s by default): most training steps of
small and medium models compile faster than that and would be compiled again on every
start. spmdkit turns the cache on with no time or size threshold, so a second start of
the same run loads every program it compiled the first time.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from spmdkit._errors import ConfigError, fix

ENV_COMPILE_CACHE = "SPMDKIT_COMPILE_CACHE"
# Past this size JAX evicts the least recently used programs.
DEFAULT_MAX_BYTES = 2 * 2**30
_OFF = {"0", "off", "no", "false", "none", ""}


def default_cache_dir() -> Path:
    """Where the cache lives unless told otherwise: ``$XDG_CACHE_HOME/spmdkit/jax-compile``
    (``~/.cache/spmdkit/jax-compile`` without ``XDG_CACHE_HOME``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spmdkit" / "jax-compile"


def cache_dir_from_env() -> Path | None | bool:
    """``$SPMDKIT_COMPILE_CACHE``: a directory, ``off`` (False), or unset (None)."""
    value = os.environ.get(ENV_COMPILE_CACHE)
    if value is None:
        return None
    if value.strip().lower() in _OFF:
        return False
    return Path(value)


def enable_compile_cache(directory: str | os.PathLike | None = None, *,
                         max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Turn on JAX's persistent compilation cache in ``directory`` and return it.

    Every program compiled from then on is written there (no minimum compile time or
    size), and a later process that compiles the same program on the same devices loads
    it instead. ``directory`` defaults to ``$SPMDKIT_COMPILE_CACHE`` or
    :func:`default_cache_dir`. The cache runs code it reads, so a directory another user
    can write to is refused (see :func:`check_private`); it is created with mode 0o700.

    A damaged entry (a cut-short or changed file) is never run: JAX warns "Error reading
    persistent compilation cache entry" and compiles afresh, but keeps the file, so the
    warning comes back on every start. JAX's warning names the program, not the file:
    delete the cache directory (it holds nothing that is not compiled again).

    In a job of several processes on CPU with jax 0.12.1 the cache goes off again once the
    process has joined the job (with a warning): loading a program of several processes from it
    hangs there (README "Compile cache").

    >>> import tempfile, spmdkit
    >>> path = spmdkit.enable_compile_cache(tempfile.mkdtemp())
    >>> path.is_dir()
    True
    >>> spmdkit.disable_compile_cache()
    """
    return _enable(directory, max_bytes, by_default=False)


def _enable(directory: str | os.PathLike | None, max_bytes: int, by_default: bool) -> Path:
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if directory is not None and not str(directory).strip():
        raise ConfigError(fix(
            f"compile cache directory {str(directory)!r} is blank: JAX would write compiled programs into the "
            "working directory.",
            "pass a directory (Python: enable_compile_cache(dir) or None for the default; CLI: --compile-cache "
            "DIR), or run without the cache (CLI: --no-compile-cache, env: SPMDKIT_COMPILE_CACHE=off).",
        ))
    if directory is None:
        env = cache_dir_from_env()
        directory = env if isinstance(env, Path) else default_cache_dir()
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise ConfigError(fix(
            f"compile cache directory {str(path)!r} cannot be created: {e.strerror or e}.",
            "pass another directory (Python: enable_compile_cache(dir); CLI: --compile-cache DIR), "
            "or run without the cache (CLI: --no-compile-cache, env: SPMDKIT_COMPILE_CACHE=off).",
        )) from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(fix(
            f"compile cache directory {str(path)!r} is not a writable directory.",
            "pass another directory (Python: enable_compile_cache(dir); CLI: --compile-cache DIR), "
            "or run without the cache (CLI: --no-compile-cache, env: SPMDKIT_COMPILE_CACHE=off).",
        ))
    check_private(path)
    # A cache that JAX already opened keeps its old directory unless it is reset.
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", int(max_bytes))
    _BY_DEFAULT[0] = by_default
    if jax.distributed.is_initialized():  # joined already: off again where it would hang
        off_for_several_processes(jax.process_count(), stacklevel=4)
    return path


_BY_DEFAULT = [False]  # the cache is on because the CLI turns it on, not because it was asked for


def enable_default_cache() -> Path:
    """The CLI's own cache (no flag, no variable): as ``enable_compile_cache()``, but where it
    must go off (several processes) it goes off without a word."""
    return _enable(None, DEFAULT_MAX_BYTES, by_default=True)


def cache_hangs_several_processes() -> bool:
    """jax 0.12.1 on CPU: process 0 of a job of several processes waits forever in the first
    collective of a program of several processes that it loaded from the persistent cache (the
    entry it wrote itself at an earlier start; its peers may compile or load theirs). jax 0.10.2
    to 0.12.0.1 run it; tests/test_cache.py checks the installed jax against this."""
    import jax

    return jax.__version_info__ >= (0, 12, 1) and jax.default_backend() == "cpu"


def off_for_several_processes(processes: int, stacklevel: int = 3) -> None:
    """Called once a process has joined a job of ``processes``: where loading a program of several
    processes from the cache hangs, the cache goes off for this process (results are unchanged, every
    program is compiled afresh); a cache that was asked for says so."""
    import warnings

    import jax

    directory = jax.config.jax_compilation_cache_dir
    if processes < 2 or not directory or not cache_hangs_several_processes():
        return
    disable_compile_cache()
    if not _BY_DEFAULT[0]:
        warnings.warn(
            f"the compile cache ({directory}) is off in this job of {processes} processes: with jax "
            f"{jax.__version__} on CPU, process 0 waits forever in the first collective of a program that it "
            "loads from the cache. Every program is compiled afresh; results are unchanged. To say so "
            "yourself: --no-compile-cache (SPMDKIT_COMPILE_CACHE=off), or in Python no "
            "spmdkit.enable_compile_cache() in a job of several processes (and no JAX_COMPILATION_CACHE_DIR "
            "or jax_compilation_cache_dir of your own).", RuntimeWarning, stacklevel=stacklevel)


def check_private(path: Path) -> None:
    """Refuse a cache directory that another user can write to: they could plant a program.

    Accepted: a directory of this user that no one else can write to, or one of this
    user's with the sticky bit (others may add files there but not replace this user's).
    """
    info = path.stat()
    uid = os.geteuid() if hasattr(os, "geteuid") else info.st_uid
    mine = info.st_uid == uid
    shared = bool(info.st_mode & stat.S_IWOTH)
    sticky = bool(info.st_mode & stat.S_ISVTX)
    if mine and (not shared or sticky):
        return
    why = (f"belongs to user id {info.st_uid}, not to this user ({uid})" if not mine
           else f"can be written by every user (mode {stat.S_IMODE(info.st_mode):#o}, no sticky bit)")
    raise ConfigError(fix(
        f"compile cache directory {str(path)!r} {why}: another user could plant a compiled program there "
        "that this process would load and run.",
        f"use a directory of your own that only you can write (chmod 700 {path}), or pass another "
        "--compile-cache DIR (Python: enable_compile_cache(dir)), or run without the cache "
        "(--no-compile-cache, env: SPMDKIT_COMPILE_CACHE=off).",
    ))


def disable_compile_cache() -> None:
    """Stop reading and writing the persistent compilation cache in this process."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", None)


def cache_warning(message: str, directory: str | None) -> str | None:
    """spmdkit's warning for JAX's "Error reading/writing persistent compilation cache entry", else None.

    JAX names the program, not the directory, and warns once per program on every start
    (a damaged entry stays on disk; a full disk leaves empty ones): the user learns neither
    where the cache is nor that deleting it is the cure. The run's results are unchanged:
    JAX compiles afresh whatever it cannot read.
    """
    if "persistent compilation cache entry" not in message:
        return None
    where = repr(directory) if directory else "the compile cache directory"
    cause = message.split(": ", 1)[1] if ": " in message else message
    return fix(
        f"compile cache {where}: {cause} (JAX compiles afresh, results are unchanged; further "
        "such warnings of this run are not shown).",
        f"delete {where} (it holds nothing that is not compiled again) or free space there, pass another "
        "--compile-cache DIR, or run with --no-compile-cache (env: SPMDKIT_COMPILE_CACHE=off).",
    )
