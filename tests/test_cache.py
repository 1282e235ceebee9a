"""The persistent compilation cache: written for small steps, read by the next start."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import spmdkit
from spmdkit._cache import ENV_COMPILE_CACHE, cache_dir_from_env, default_cache_dir

CLI = [sys.executable, "-m", "spmdkit._cli"]


def _entries(path):
    return sorted(p for p in os.listdir(path) if not p.startswith("."))


def _train(tmp_path, *extra, env=None):
    out = subprocess.run(
        [*CLI, "--host-devices", "2", "train", "--task", "linreg", "--steps", "3", "--no-progress",
         "--out", str(tmp_path / "out"), *extra],
        capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})},
    )
    return out


def test_enable_writes_a_program_that_compiles_in_milliseconds(tmp_path):
    path = spmdkit.enable_compile_cache(tmp_path / "cache")
    try:
        assert _entries(path) == []
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7.0)).block_until_ready()
        # JAX's default 1 s threshold would skip this program; spmdkit's keeps it.
        assert len(_entries(path)) >= 1
    finally:
        spmdkit.disable_compile_cache()
    assert jax.config.jax_compilation_cache_dir is None


def test_second_start_reads_what_the_first_wrote(tmp_path):
    cache = tmp_path / "cache"
    first = _train(tmp_path, "--compile-cache", str(cache))
    assert first.returncode == 0, first.stderr
    written = _entries(cache)
    assert written, "the first run wrote no compiled program"
    second = _train(tmp_path, "--compile-cache", str(cache))
    assert second.returncode == 0, second.stderr
    # Every program the second start needed was already there: nothing new was written.
    assert _entries(cache) == written
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["first_step_s"] > summary["first_step_in_fit_s"] > 0


def test_no_compile_cache_writes_nothing(tmp_path):
    cache = tmp_path / "cache"
    out = _train(tmp_path, "--no-compile-cache", env={ENV_COMPILE_CACHE: str(cache)})
    assert out.returncode == 0, out.stderr
    assert not cache.exists()


def test_environment_names_the_directory_or_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_COMPILE_CACHE, str(tmp_path / "c"))
    assert cache_dir_from_env() == tmp_path / "c"
    monkeypatch.setenv(ENV_COMPILE_CACHE, "off")
    assert cache_dir_from_env() is False
    monkeypatch.delenv(ENV_COMPILE_CACHE)
    assert cache_dir_from_env() is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "spmdkit" / "jax-compile"


def test_a_directory_that_cannot_be_made_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    before = jax.config.jax_compilation_cache_dir  # an earlier test in this process may have set one
    with pytest.raises(spmdkit.ConfigError, match="--no-compile-cache") as e:
        spmdkit.enable_compile_cache(blocker / "cache")
    assert str(blocker / "cache") in str(e.value)
    assert jax.config.jax_compilation_cache_dir == before != str(blocker / "cache")  # left as it was


def test_cli_compile_cache_and_no_compile_cache_together_are_refused(tmp_path):
    # The last one given won without a word; at two levels (spmdkit --compile-cache D train ...) too.
    both = _train(tmp_path, "--compile-cache", str(tmp_path / "c"), "--no-compile-cache")
    assert both.returncode == 2 and "--no-compile-cache were both given" in both.stderr
    assert not (tmp_path / "c").exists() and not (tmp_path / "out").exists()


def test_cli_asked_directory_fails_but_default_only_warns(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    asked = _train(tmp_path, "--compile-cache", str(blocker / "c"))
    assert asked.returncode == 2
    assert "--no-compile-cache" in asked.stderr
    # The default directory is a convenience: a home without room for it still trains.
    env = {"XDG_CACHE_HOME": str(blocker)}
    env.pop(ENV_COMPILE_CACHE, None)
    defaulted = subprocess.run(
        [*CLI, "--host-devices", "2", "train", "--task", "linreg", "--steps", "2", "--no-progress",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=180,
        env={k: v for k, v in {**os.environ, **env}.items() if k != ENV_COMPILE_CACHE},
    )
    assert defaulted.returncode == 0, defaulted.stderr
    assert "running without the compile cache" in defaulted.stderr


def test_a_directory_others_can_write_to_is_refused_and_an_empty_name_is_an_error(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(spmdkit.ConfigError, match="can be written by every user .*plant") as e:
        spmdkit.enable_compile_cache(shared)
    assert "chmod 700" in str(e.value) and "--no-compile-cache" in str(e.value)
    shared.chmod(0o1777)  # sticky and ours: others cannot replace our entries
    assert spmdkit.enable_compile_cache(shared) == shared
    spmdkit.disable_compile_cache()
    with pytest.raises(spmdkit.ConfigError, match="working directory"):
        spmdkit.enable_compile_cache("")
    assert jax.config.jax_compilation_cache_dir is None
    asked = _train(tmp_path, "--compile-cache", "")
    assert asked.returncode == 2 and "--compile-cache: expected a path, got an empty string" in asked.stderr, asked.stderr


def test_jax_cache_entry_warnings_become_one_line_naming_the_directory(capsys):
    # A damaged or full cache gave one raw JAX UserWarning per program, on every start, naming
    # neither the directory nor the cure.
    import warnings

    from spmdkit._cache import cache_warning
    from spmdkit._console import short_warnings

    msg = "Error reading persistent compilation cache entry for 'jit_run': error: Error -3 while decompressing data"
    said = cache_warning(msg, "/c")
    assert "'/c'" in said and "Error -3" in said and "delete '/c'" in said and "--no-compile-cache" in said
    assert cache_warning("some other warning", "/c") is None
    with short_warnings():
        for _ in range(3):
            warnings.warn_explicit(msg, UserWarning, "/x/jax/_src/compiler.py", 826)
    err = capsys.readouterr().err
    assert err.count("warning: compile cache") == 1 and "compiler.py" not in err


_TWO_PROCESS_STEP = r"""
import os, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
jax.distributed.initialize(f"127.0.0.1:{sys.argv[2]}", 2, int(sys.argv[3]))
import jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
x = jax.make_array_from_process_local_data(rows, np.ones((4, 3), np.float32))
step = jax.jit(lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w - 1.0) ** 2))(w), out_shardings=rep)
print("ran", float(step(jax.device_put(jnp.zeros(3), rep), x).addressable_data(0)[0]), flush=True)
"""


def _two_processes_of_plain_jax(cache, seconds):
    """True when both processes of the program above finished within ``seconds``."""
    from spmdkit._launch import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESS_STEP, str(cache), str(port), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
             for i in range(2)]
    try:
        return all("\nran " in "\n" + p.communicate(timeout=seconds)[0] for p in procs)
    except subprocess.TimeoutExpired:
        return False
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


def test_the_cache_goes_off_for_several_processes_exactly_where_jax_hangs_on_it(tmp_path):
    # Plain JAX, no spmdkit: a 2-process step run twice over one cache. On jax 0.12.1 (CPU) the
    # second start hung in the first collective (process 0 loads the program it wrote itself).
    from spmdkit._cache import cache_hangs_several_processes

    assert _two_processes_of_plain_jax(tmp_path / "c", 120), "the first start (nothing cached) must run"
    hung = not _two_processes_of_plain_jax(tmp_path / "c", 40)
    assert hung == cache_hangs_several_processes(), jax.__version__


@pytest.mark.parametrize("asked", [True, False])
def test_a_job_of_two_processes_starts_twice_over_one_cache(tmp_path, asked):
    # Each start of `spmdkit launch -n 2 -- spmdkit train` over one cache: the second hung on jax
    # 0.12.1 until the distributed timeout. Off where it must be: a cache asked for says so, the
    # CLI's default one goes off without a word.
    from spmdkit._cache import cache_hangs_several_processes

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop(ENV_COMPILE_CACHE, None)
    if asked:
        env[ENV_COMPILE_CACHE] = str(tmp_path / "cache")
    for start in (1, 2):
        out = subprocess.run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--", *CLI, "train",
                              "--task", "linreg", "--steps", "3", "--no-progress", "--out", str(tmp_path / f"o{start}")],
                             capture_output=True, text=True, timeout=150, env=env)
        assert out.returncode == 0, (start, out.stderr[-3000:])
        said = "is off in this job of 2 processes" in " ".join(out.stderr.split())
        assert said == (asked and cache_hangs_several_processes()), out.stderr[-2000:]


def test_enable_after_joining_a_job_of_two_processes_goes_off_where_jax_hangs(tmp_path):
    # spmdkit.initialize() first, then enable_compile_cache(): the cache was on in the job.
    code = (f"import spmdkit, jax, warnings; spmdkit.initialize(); warnings.simplefilter('always'); "
            f"spmdkit.enable_compile_cache({str(tmp_path / 'c')!r}); "
            f"print('cache', jax.config.jax_compilation_cache_dir is not None, flush=True)")
    env = {**os.environ, "SPMDKIT_HOST_DEVICES": "1"}
    out = subprocess.run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120, env=env)
    from spmdkit._cache import cache_hangs_several_processes

    on = not cache_hangs_several_processes()
    assert out.returncode == 0 and out.stdout.count(f"cache {on}") == 2, out.stdout + out.stderr[-2000:]
    assert ("is off in this job of 2 processes" in " ".join(out.stderr.split())) == (not on)


@pytest.mark.parametrize("processes, hangs, by_default, off, warned", [
    (2, True, False, True, True),     # asked for: off, with the reason
    (2, True, True, True, False),     # the CLI's default: off without a word
    (1, True, False, False, False),   # one process: nothing to hang on
    (2, False, False, False, False),  # a jax that runs it: kept
])
def test_off_for_several_processes_turns_off_and_speaks_only_where_it_must(tmp_path, monkeypatch, processes, hangs,
                                                                          by_default, off, warned):
    import warnings

    from spmdkit import _cache

    monkeypatch.setattr(_cache, "cache_hangs_several_processes", lambda: hangs)
    path = _cache._enable(tmp_path / "c", _cache.DEFAULT_MAX_BYTES, by_default=by_default)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _cache.off_for_several_processes(processes)
        assert (jax.config.jax_compilation_cache_dir is None) == off
        said = [str(w.message) for w in seen if "is off in this job" in str(w.message)]
        assert bool(said) == warned
        if warned:
            assert str(path) in said[0] and "--no-compile-cache" in said[0] and "JAX_COMPILATION_CACHE_DIR" in said[0]
    finally:
        spmdkit.disable_compile_cache()
    _cache.off_for_several_processes(2)  # no cache at all: nothing to do, nothing said


def test_a_job_joined_by_plain_jax_then_spmdkit_initialize_goes_off_where_jax_hangs(tmp_path):
    # enable_compile_cache(), the script's own jax.distributed.initialize, then spmdkit.initialize():
    # the already-joined path returned True and left the cache on.
    from spmdkit._cache import cache_hangs_several_processes
    from spmdkit._launch import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

    code = ("import os, spmdkit, jax, warnings; warnings.simplefilter('always'); "
            f"spmdkit.enable_compile_cache({str(tmp_path / 'c')!r}); "
            f"jax.distributed.initialize(os.environ[{ENV_COORDINATOR!r}], int(os.environ[{ENV_NUM_PROCESSES!r}]), "
            f"int(os.environ[{ENV_PROCESS_ID!r}])); spmdkit.initialize(); "
            "print('cache', jax.config.jax_compilation_cache_dir is not None, flush=True)")
    env = {k: v for k, v in os.environ.items() if k != ENV_COMPILE_CACHE}
    out = subprocess.run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120, env=env)
    on = not cache_hangs_several_processes()
    assert out.returncode == 0 and out.stdout.count(f"cache {on}") == 2, out.stdout + out.stderr[-2000:]
