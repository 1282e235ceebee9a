"""Host memory that XLA:CPU reuses: what `reuse_host_memory` changes, and when it says no."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

import spmdkit
from spmdkit import _host_memory
from spmdkit._bench import lm_suite

SPMDKIT = shutil.which("spmdkit") or os.path.join(os.path.dirname(sys.executable), "spmdkit")
GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"

# A program whose temporaries (3 x 32 MiB) exceed glibc's largest mmap threshold: with glibc's
# defaults every call maps them afresh and faults every page in; reused, the pages stay.
_FAULTS = """
import json, os, resource, subprocess, sys
import spmdkit
status = spmdkit.reuse_host_memory()
import jax, jax.numpy as jnp
x = jnp.ones((8192, 256)); w = jnp.ones((256, 1024)) * 1e-3
f = jax.jit(lambda x, w: jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w.T) ** 2))(w).sum())
value = float(f(x, w))
faults, resident = [], []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert float(f(x, w)) == value  # the same result every call
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    resident.append(int(open("/proc/self/statm").read().split()[1]))
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('MALLOC_ARENA_MAX'))"],
                       capture_output=True, text=True, timeout=60).stdout.strip()
print(json.dumps({"reused": status.reused, "why": status.why, "faults": faults, "resident": resident,
                  "value": value, "child": child}))
"""


def _glibc_defaults() -> dict[str, str]:
    """This environment without any of the settings (MALLOC_* or GLIBC_TUNABLES) and no mode."""
    env = _host_memory.child_env(os.environ, _host_memory.SYSTEM)
    del env[spmdkit.ENV_HOST_ALLOCATOR]
    return {k: v for k, v in env.items() if not k.startswith("MALLOC_")}


def _run(code: str, **env: str) -> dict:
    full = _glibc_defaults()
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=full)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's; elsewhere reuse_host_memory says so (tested below)")
def test_reused_host_memory_is_not_faulted_in_again_at_every_call():
    reused = _run(_FAULTS)
    system = _run(_FAULTS, **{spmdkit.ENV_HOST_ALLOCATOR: "system"})
    assert reused["reused"] and reused["why"] == "set by spmdkit in this process"
    assert not system["reused"] and "SPMDKIT_HOST_ALLOCATOR=system" in system["why"]
    assert reused["value"] == system["value"]
    # With glibc's defaults every call faults its ~96 MiB of temporaries in (about 24,000 pages);
    # reused, the heap settles in a few calls and a settled call faults (almost) nothing. The
    # check takes the fewest faults of the last 8 calls, not their sum: a CI machine faulted the
    # whole ~96 MiB in again at half of them, between calls that faulted none. Which took those
    # pages, that kernel or the heap's layout, the resident pages in the message will tell.
    settled = reused["faults"][-8:]
    per_call_system = sorted(system["faults"][-8:])[4]
    assert per_call_system > 10_000, system["faults"]
    assert min(settled) < 0.05 * per_call_system, (
        f"reused: faults {reused['faults']}, resident pages {reused['resident']}; "
        f"system: faults {system['faults']}")
    # Processes started from a reusing process inherit the settings; from a system one, not.
    assert reused["child"] == "1" and system["child"] == "None"


@pytest.fixture
def clean(monkeypatch):
    """This process as if spmdkit had set nothing: no MALLOC_* variables, nothing applied."""
    for key in [*_host_memory.MALLOC_SETTINGS, spmdkit.ENV_HOST_ALLOCATOR, "LD_PRELOAD", "GLIBC_TUNABLES"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(_host_memory, "_applied", False)
    return monkeypatch


@pytest.mark.skipif(not GLIBC, reason="elsewhere the call returns 'not glibc' (tested below)")
def test_a_call_after_jax_started_raises_with_the_fix(clean):
    import jax

    jax.devices()  # the backends have started in this process
    with pytest.raises(spmdkit.DeviceSetupError) as e:
        spmdkit.reuse_host_memory()
    msg = str(e.value)
    assert "after JAX had started its backends" in msg and "before any JAX operation" in msg
    assert "MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0" in msg
    assert not _host_memory._apply(strict=False).reused  # the spmdkit command goes on without
    assert not spmdkit.host_memory().reused and "reuse_host_memory()" in spmdkit.host_memory().why


def test_settings_in_the_environment_count_as_reused(clean):
    for key, value in _host_memory.MALLOC_SETTINGS.items():
        clean.setenv(key, value)
    status = spmdkit.host_memory()
    assert status.reused == GLIBC and (status.why == "set in the environment" or not GLIBC)


EXACT_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"


@pytest.mark.skipif(not GLIBC, reason="elsewhere every call says 'not glibc' first")
@pytest.mark.parametrize("env, why", [
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:" + EXACT_TUNABLES},
     "GLIBC_TUNABLES' arena_max, mmap_max and trim_threshold"),
    # two through MALLOC_*, the third through GLIBC_TUNABLES: together the same settings
    ({"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=2147483647"},
     "MALLOC_ARENA_MAX, MALLOC_MMAP_MAX_ and GLIBC_TUNABLES' trim_threshold"),
    # a tunable wins over its MALLOC_* variable: glibc runs with one arena here, not four
    ({"MALLOC_ARENA_MAX": "4", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "2147483647",
      "GLIBC_TUNABLES": "glibc.malloc.arena_max=1"},
     "MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_ and GLIBC_TUNABLES' arena_max"),
    # numbers as glibc reads them; an item without "=" is skipped, as glibc skips it
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=0x1:glibc.malloc.mmap_max= 0:glibc.malloc.trim_threshold=0x7fffffff:"
                        "glibc.malloc.arena_max"}, "GLIBC_TUNABLES' arena_max, mmap_max and trim_threshold"),
])
def test_the_same_settings_through_glibc_tunables_count_as_reused(clean, env, why):
    for key, value in env.items():
        clean.setenv(key, value)
    status = spmdkit.host_memory()
    assert status.reused and status.why == "set in the environment: " + why
    assert spmdkit.reuse_host_memory() == status and not _host_memory._applied  # nothing left to set
    clean.setenv(spmdkit.ENV_HOST_ALLOCATOR, "system")  # too late: glibc read them at the start
    late = spmdkit.host_memory()
    assert late.reused and f"glibc read {why} when" in late.why and "cannot undo" in late.why


@pytest.mark.skipif(not GLIBC, reason="elsewhere every call says 'not glibc' first")
def test_a_partial_set_of_settings_is_not_claimed_as_reused(clean):
    clean.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=1")  # the other two at glibc's defaults
    status = spmdkit.host_memory()
    assert not status.reused and status.why == _host_memory.DEFAULTS_WHY


@pytest.mark.skipif(not GLIBC, reason="elsewhere every call says 'not glibc' first")
@pytest.mark.parametrize("env, why", [
    ({"SPMDKIT_HOST_ALLOCATOR": "system"}, "SPMDKIT_HOST_ALLOCATOR=system"),
    ({"SPMDKIT_HOST_ALLOCATOR": " System "}, "SPMDKIT_HOST_ALLOCATOR=system"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD names jemalloc"),
    ({"MALLOC_ARENA_MAX": "4"}, "the environment sets MALLOC_ARENA_MAX=4: left as set"),
    # glibc lets GLIBC_TUNABLES win over MALLOC_*: neither overridden here nor claimed as reused in children
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.mmap_max=65536"},
     "the environment sets GLIBC_TUNABLES=glibc.malloc.mmap_max=65536: left as set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=65536", "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
      "MALLOC_TRIM_THRESHOLD_": "2147483647"}, "GLIBC_TUNABLES=glibc.malloc.mmap_max=65536: left as set"),
])
def test_it_steps_aside_and_says_why(clean, env, why):
    for key, value in env.items():
        clean.setenv(key, value)
    status = spmdkit.reuse_host_memory()  # no error even though JAX has started: nothing to do
    assert not status.reused and why in status.why and why in str(status)


def test_a_bad_mode_names_the_variable_and_the_choices(clean):
    clean.setenv(spmdkit.ENV_HOST_ALLOCATOR, "fast")
    with pytest.raises(spmdkit.ConfigError, match=r"SPMDKIT_HOST_ALLOCATOR='fast' is not one of reuse, system"):
        spmdkit.reuse_host_memory()


def test_the_spmdkit_command_reuses_host_memory_and_says_so():
    env = _glibc_defaults()
    out = subprocess.run([SPMDKIT, "devices", "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["host_memory"] == (
        {"reused": True, "why": "set by spmdkit in this process"} if GLIBC
        else {"reused": False, "why": "the C library is not glibc; the settings are glibc's"})
    env[spmdkit.ENV_HOST_ALLOCATOR] = "wrong"
    out = subprocess.run([SPMDKIT, "devices"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "SPMDKIT_HOST_ALLOCATOR='wrong'" in out.stderr


def test_bench_workers_get_the_allocator_their_case_names(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")  # as the spmdkit command leaves it
    reuse, system = lm_suite.worker_env(lm_suite.REUSE), lm_suite.worker_env(lm_suite.SYSTEM)
    assert all(reuse[k] == v for k, v in _host_memory.MALLOC_SETTINGS.items())
    assert not any(k.startswith("MALLOC_") for k in system) and system[spmdkit.ENV_HOST_ALLOCATOR] == "system"
    cases = lm_suite.cases(quick=False, torch=True)
    assert cases[lm_suite.SYSTEM_ALLOC][2] == lm_suite.SYSTEM and cases[lm_suite.BASE][2] == lm_suite.REUSE
    assert cases["PyTorch f32, torch.compile"][2] == lm_suite.SYSTEM and cases[lm_suite.TORCH_REUSE][2] == lm_suite.REUSE


def test_a_childs_environment_names_its_allocator_from_its_start():
    env = {"HOME": "/h", "MALLOC_ARENA_MAX": "4", spmdkit.ENV_HOST_ALLOCATOR: "system"}
    reuse = _host_memory.child_env(env, "reuse")
    assert reuse == {"HOME": "/h", **_host_memory.MALLOC_SETTINGS}  # ours replace the user's, opt-out dropped
    assert _host_memory.child_env(reuse, "system") == {"HOME": "/h", spmdkit.ENV_HOST_ALLOCATOR: "system"}
    # GLIBC_TUNABLES would win over either mode: its three settings go, other tunables stay
    tuned = {"HOME": "/h", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:" + EXACT_TUNABLES}
    assert _host_memory.child_env(tuned, "system")["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert _host_memory.child_env({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=9"}, "reuse") == _host_memory.MALLOC_SETTINGS
    with pytest.raises(ValueError, match="'jemalloc' is not one of reuse, system"):
        _host_memory.child_env(env, "jemalloc")


def test_a_training_run_records_its_host_memory(tmp_path):
    import jax.numpy as jnp
    import numpy as np
    import optax

    x = np.linspace(-1, 1, 32, dtype=np.float32)
    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(())},
                        loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] - b["y"]) ** 2), {}),
                        train_data={"x": x, "y": 2 * x})
    result = spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=8),
                         out_dir=tmp_path, progress=False)
    recorded = json.loads((tmp_path / "summary.json").read_text())["host_memory"]
    assert recorded == result.summary["host_memory"] == str(spmdkit.host_memory())


def test_a_cpu_run_on_glibc_defaults_says_how_to_reuse_host_memory(clean, tmp_path):
    import jax.numpy as jnp
    import numpy as np
    import optax

    x = np.linspace(-1, 1, 32, dtype=np.float32)
    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(())},
                        loss_fn=lambda p, b, rng: (jnp.mean((p["w"] * b["x"] - b["y"]) ** 2), {}),
                        train_data={"x": x, "y": 2 * x})
    from spmdkit._train import _loop

    clean.setattr(_loop, "_hinted", False)
    said: list[str] = []
    spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=1, batch_size=8), log=said.append)
    assert any("spmdkit.reuse_host_memory()" in line and "SPMDKIT_HOST_ALLOCATOR=system" in line for line in said) == GLIBC
    said.clear()
    spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=1, batch_size=8), log=said.append)
    assert not any("reuse_host_memory" in line for line in said)  # once per process: a sweep is not 50 notes
    clean.setattr(_loop, "_hinted", False)
    clean.setenv(spmdkit.ENV_HOST_ALLOCATOR, "system")  # the user's choice: no note
    spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=1, batch_size=8), log=said.append)
    assert not any("reuse_host_memory" in line for line in said)


def test_a_training_run_refuses_a_bad_mode_before_its_first_step(clean, tmp_path):
    import jax.numpy as jnp
    import numpy as np
    import optax

    x = np.linspace(-1, 1, 32, dtype=np.float32)
    steps: list[int] = []

    def loss(p, b, rng):
        steps.append(1)  # traced only when the run gets as far as its step
        return jnp.mean((p["w"] * b["x"] - b["y"]) ** 2), {}

    task = spmdkit.Task(name="line", init=lambda rng: {"w": jnp.zeros(())}, loss_fn=loss,
                        train_data={"x": x, "y": 2 * x})
    clean.setenv(spmdkit.ENV_HOST_ALLOCATOR, "off")
    with pytest.raises(spmdkit.ConfigError, match=r"SPMDKIT_HOST_ALLOCATOR='off' is not one of reuse, system"):
        spmdkit.fit(task, spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=2, batch_size=8),
                    out_dir=tmp_path / "run", progress=False)
    assert not steps and not (tmp_path / "run").exists()


@pytest.mark.skipif(not GLIBC, reason="elsewhere every call says 'not glibc' first")
def test_opting_out_too_late_is_not_reported_as_glibc_defaults(clean):
    # A child of a reusing process inherits the MALLOC_* settings; glibc has read them before
    # any Python runs, so SPMDKIT_HOST_ALLOCATOR=system in that child cannot undo them.
    for key, value in _host_memory.MALLOC_SETTINGS.items():
        clean.setenv(key, value)
    clean.setenv(spmdkit.ENV_HOST_ALLOCATOR, "system")
    status = spmdkit.host_memory()
    assert status.reused and "SPMDKIT_HOST_ALLOCATOR=system cannot undo" in status.why
    assert "start it without them" in status.why and spmdkit.reuse_host_memory() == status


@pytest.mark.skipif(not GLIBC, reason="elsewhere every call says 'not glibc' first")
def test_another_malloc_under_any_file_name_is_left_alone(clean):
    # An allocator preloaded from a file whose name says nothing (a site's own build of jemalloc)
    # interposes malloc all the same: glibc's settings would not reach it.
    assert _host_memory._mallocs_is_glibcs()  # this test process: glibc's malloc
    clean.setenv("LD_PRELOAD", "/opt/site/lib/libfastalloc.so")
    clean.setattr(_host_memory, "_mallocs_is_glibcs", lambda: False)
    status = spmdkit.reuse_host_memory()
    assert not status.reused and "malloc here is not glibc's" in status.why and "libfastalloc.so" in status.why
    assert "MALLOC_ARENA_MAX" not in os.environ  # nothing passed on to child processes either


_RELEASE = """
import json, sys
import spmdkit
status = spmdkit.reuse_host_memory()
import numpy as np

def resident_mib():  # swapped out counts too: a machine short of memory may swap the freed pages
    with open("/proc/self/status") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("VmRSS:", "VmSwap:"))) / 1024

keep, free = [], []
for i in range(96):  # 8 MiB arrays, every other one kept: the freed ones are holes inside the heap
    (keep if i % 2 else free).append(np.ones(1 << 21, np.float32))
del free
before = resident_mib()
released = spmdkit.release_host_memory()
print(json.dumps({"reused": status.reused, "released": released, "before": before, "after": resident_mib()}))
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's; elsewhere release_host_memory returns False")
def test_release_gives_the_free_pages_of_a_reusing_process_back():
    reused = _run(_RELEASE)
    assert reused["reused"] and reused["released"]
    # 48 x 8 MiB were freed inside the heap: kept until the release, then (mostly) returned.
    assert reused["before"] - reused["after"] > 0.5 * 48 * 8, reused
    system = _run(_RELEASE, **{spmdkit.ENV_HOST_ALLOCATOR: "system"})
    assert not system["reused"] and system["released"] is False
