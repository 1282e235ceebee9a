"""spmdkit launch: processes joined by jax.distributed give the single-process results."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

CLI = [sys.executable, "-m", "spmdkit._cli"]


def env():
    return {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_")}


def run(args, timeout=300):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env())


@pytest.mark.parametrize("task, steps", [("linreg", 50), ("digits", 20)])
def test_two_processes_of_four_devices_equal_one_process_of_eight(tmp_path, task, steps):
    train = ["train", "--task", task, "--steps", str(steps), "--no-progress"]
    multi = run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "4", "--", *CLI, *train,
                 "--out", str(tmp_path / "multi")])
    assert multi.returncode == 0, multi.stderr[-3000:]
    assert "[0] " in multi.stdout and "[1] " in multi.stderr + multi.stdout
    single = run([*CLI, "--host-devices", "8", *train, "--out", str(tmp_path / "single")])
    assert single.returncode == 0, single.stderr
    with np.load(tmp_path / "multi" / "params.npz") as a, np.load(tmp_path / "single" / "params.npz") as b:
        assert a.files == b.files
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "extra",
    [
        ["--task", "digits", "--strategy", "ensemble", "--members", "8"],
        # SGD: Adam's first steps turn rounding-level differences of the cross-process
        # reductions into ~1e-5 (see the sharded layout test); SGD shows the math agrees.
        ["--task", "mlp", "--layers", "2", "--strategy", "sharded", "--rules", "fsdp+tp", "--optimizer", "sgd",
         "--lr", "0.05"],
    ],
    ids=["ensemble", "sharded"],
)
def test_other_strategies_across_two_processes(tmp_path, extra):
    train = ["train", *extra, "--steps", "10", "--no-progress"]
    multi = run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "4", "--", *CLI, *train,
                 "--out", str(tmp_path / "multi")])
    assert multi.returncode == 0, multi.stderr[-3000:]
    single = run([*CLI, "--host-devices", "8", *train, "--out", str(tmp_path / "single")])
    assert single.returncode == 0, single.stderr
    with np.load(tmp_path / "multi" / "params.npz") as a, np.load(tmp_path / "single" / "params.npz") as b:
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6)


def test_a_dead_process_stops_the_launch_within_60_s(tmp_path):
    # Process 1 is SIGKILLed mid-run; process 0 then waits in a collective forever.
    script = (f'if [ "$SPMDKIT_PROCESS_ID" = 1 ]; then (sleep 9; kill -9 $$) & fi; '
              f'exec {sys.executable} -m spmdkit._cli train --task digits --steps 100000 --no-progress '
              f'--out {tmp_path / "o"}')
    t0 = time.time()
    out = run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "2", "--", "sh", "-c", script], timeout=120)
    assert out.returncode == 137, out.stderr[-2000:]  # 128 + SIGKILL, as a shell reports it
    assert time.time() - t0 < 60 + 15
    assert "process 1 was killed by signal 9" in out.stderr
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "o")], capture_output=True, text=True).stdout.split()
    assert left == [], "orphan processes remain"


def test_a_failing_process_gives_its_exit_code():
    code = "import os, sys, time; i = os.environ['SPMDKIT_PROCESS_ID']; sys.exit(3) if i == '1' else time.sleep(60)"
    t0 = time.time()
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=90)
    assert out.returncode == 3 and time.time() - t0 < 30
    assert "process 1 exited with code 3; stopped the other 1" in out.stderr
    assert "still running" not in out.stderr  # process 0 ended at the SIGTERM: nothing to kill


def test_a_process_that_outlives_the_sigterm_after_a_failure_is_killed_and_named(tmp_path, own_group):
    # It was SIGKILLed without a word: "stopped the other 1" read as if every process had ended by itself.
    child = ("import os, pathlib, signal, sys, time\n"
             "if os.environ['SPMDKIT_PROCESS_ID'] == '1':\n"
             f"    while not pathlib.Path({str(tmp_path)!r}, 'up').exists(): time.sleep(0.05)\n"
             "    sys.exit(3)\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as JAX catches it, stuck in a collective\n"
             f"pathlib.Path({str(tmp_path)!r}, 'up').touch()\n"
             "time.sleep(120)\n")
    launcher = ("import sys\nfrom spmdkit._launch import launch\n"
                f"sys.exit(launch([sys.executable, '-c', {child!r}], 2, grace_s=1.0))\n")
    t0 = time.time()
    with own_group([sys.executable, "-c", launcher], env=env()) as proc:
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3 and time.time() - t0 < 40, stderr[-2000:]
    assert "spmdkit launch: process 1 exited with code 3; stopped the other 1" in stderr
    assert ("spmdkit launch: process 0 was still running 1 s after SIGTERM (sent when process 1 failed); "
            "killed it (SIGKILL)") in stderr, stderr[-2000:]


@pytest.mark.parametrize("name, value", [("grace_s", -1.0), ("sigterm_wait_s", float("nan")),
                                         ("backoff_s", float("inf")), ("grace_s", "5")])
def test_a_wait_that_is_not_a_finite_number_of_seconds_is_refused_by_name(name, value):
    # A negative wait was taken as none, a NaN one never ended, a string failed deep in a comparison.
    from spmdkit import DeviceSetupError
    from spmdkit._launch import launch

    with pytest.raises(DeviceSetupError, match=rf"(?s){name}={value!r}: a wait in seconds must be a finite "
                                                      rf"number >= 0\..*pass e\.g\. {name}="):
        launch([sys.executable, "-c", "pass"], 1, **{name: value})


@pytest.mark.parametrize("before, after, named, fix", [
    # Before launch they set up no JAX in the launcher and reached no launched process, without a word.
    (["--host-devices", "8"], [], "--host-devices 8", "--host-devices-per-process 4"),
    (["--compile-cache", "/tmp/cc"], [], "--compile-cache /tmp/cc", "SPMDKIT_COMPILE_CACHE=/tmp/cc"),
    (["--no-compile-cache"], [], "--no-compile-cache", "SPMDKIT_COMPILE_CACHE=off"),
    # After launch, --host-devices 8 was taken as --host-devices-per-process 8: 16 devices, not 8.
    ([], ["--host-devices", "8"], "--host-devices 8", "--host-devices-per-process 4"),
])
def test_device_and_cache_flags_given_to_the_launcher_are_an_error_naming_their_place(before, after, named, fix):
    code = "import os; print('ran with', os.environ.get('SPMDKIT_HOST_DEVICES'))"
    out = run([*CLI, *before, "launch", "-n", "2", *after, "--", sys.executable, "-c", code], timeout=90)
    assert out.returncode == 2, out.stdout + out.stderr[-2000:]
    assert "ran with" not in out.stdout
    assert f"error: {named} is not an option of spmdkit launch" in out.stderr and fix in out.stderr
    assert "put it after -- on the launched command" in out.stderr and "Traceback" not in out.stderr


def test_a_negative_max_restarts_is_refused_by_name():
    # It was taken as 0 without a word (and launch(max_restarts=-1), on a failure, said "all -1 restart(s)
    # failed too").
    # In a process of its own with a hard timeout: without the check, both would start processes.
    code = "print('ran')"
    out = run([*CLI, "launch", "-n", "2", "--max-restarts", "-1", "--", sys.executable, "-c", code], timeout=60)
    assert out.returncode == 2 and "ran" not in out.stdout
    assert "argument --max-restarts: expected a whole number >= 0, got -1: pass --max-restarts 0" in out.stderr
    api = f"from spmdkit._launch import launch; launch([{sys.executable!r}, '-c', {code!r}], 1, max_restarts=-1)"
    out = run([sys.executable, "-c", api], timeout=60)
    assert "ran" not in out.stdout
    assert "DeviceSetupError: max_restarts=-1: restarts cannot be fewer than none." in out.stderr
    assert "--max-restarts N" in out.stderr


@pytest.mark.parametrize("sig", [9, 15])
def test_a_process_killed_by_a_signal_gives_128_plus_its_number(sig):
    # It gave 1: a script could not tell an OOM kill (9) or a stop (15) from a Python error.
    code = (f"import os, time; i = os.environ['SPMDKIT_PROCESS_ID']; "
            f"os.kill(os.getpid(), {sig}) if i == '1' else time.sleep(60)")
    t0 = time.time()
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=90)
    assert out.returncode == 128 + sig and time.time() - t0 < 30, out.stderr[-2000:]
    assert f"process 1 was killed by signal {sig}; stopped the other 1" in out.stderr


@pytest.mark.parametrize("line, what, how", [
    # What JAX prints when gloo's setup of a collective times out (seen on a busy machine).
    ("jax.errors.JaxRuntimeError: UNKNOWN: Gloo context initialization failed: DEADLINE_EXCEEDED: "
     "GetKeyValue() timed out with key: cpu:gloo/0,2048/0 and duration: 29.99s",
     "the processes reached a collective over a new set of devices more than 30 s apart",
     "Fix: have every process do the same work before its first collective"),
    # What JAX prints in a process whose peer never started its backend (it had failed first).
    ("RuntimeError: Unable to initialize backend 'cpu': INTERNAL: Getting local topologies failed: "
     "Error 1: GetKeyValue() timed out with key: cpu:local_topology/cpu/1 and duration: 2m (you may "
     "need to uninstall the failing plugin package, or set JAX_PLATFORMS=cpu to skip this backend.)",
     "a process started JAX's CPU backend and waited for another's",
     "Fix: mend the other process's error"),
    # The same gloo failure with its status wrapped onto the next line.
    ("jax.errors.JaxRuntimeError: UNKNOWN: Gloo context initialization failed:\n"
     "  DEADLINE_EXCEEDED: GetKeyValue() timed out with key: cpu:gloo/0,2048/0",
     "the processes reached a collective over a new set of devices more than 30 s apart",
     "Fix: have every process do the same work before its first collective"),
])
def test_a_known_runtime_failure_is_explained_once_with_its_fix(line, what, how):
    code = f"import sys; print({line!r}, file=sys.stderr); sys.exit(1)"
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=90)
    assert out.returncode == 1
    assert out.stderr.count(f"spmdkit launch: {what}") == 1, out.stderr
    assert how in out.stderr


def test_a_bad_input_in_one_process_ends_the_launch_soon_with_code_2(tmp_path):
    # Process 1's copy of the data set is damaged (as a file on one host may be): it fails its
    # check before its first JAX operation, while process 0 waits for its backend. Before,
    # process 1 sat in JAX's exit for 2 minutes and process 0 ended with JAX's advice to
    # uninstall a plugin.
    made = run([*CLI, "data", "write", str(tmp_path / "d0"), "--task", "digits"], timeout=120)
    assert made.returncode == 0, made.stderr
    shutil.copytree(tmp_path / "d0", tmp_path / "d1")
    with open(tmp_path / "d1" / "train" / "image.npy", "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    script = (f'exec {sys.executable} -m spmdkit._cli train --task digits --steps 20 --no-progress '
              f'--data {tmp_path}/d$SPMDKIT_PROCESS_ID --out {tmp_path / "o"}')
    t0 = time.time()
    out = run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--", "sh", "-c", script],
              timeout=200)
    assert out.returncode == 2, out.stderr[-2000:]
    assert time.time() - t0 < 90  # 124 s before
    assert "[1] error: " in out.stderr and "image.npy: checksum" in out.stderr
    assert "process 1 ends within 20 s after this error (exit code 2)" in out.stderr
    assert "process 1 exited with code 2; stopped the other 1" in out.stderr
    assert "uninstall" not in out.stderr


@pytest.mark.parametrize("flag, value, named", [("--num-processes", "3", "differs from 2"),
                                                ("--process-id", "0", "differs from 1")])
def test_a_process_flag_that_contradicts_the_launcher_is_refused_at_once(tmp_path, flag, value, named):
    # --num-processes 3 of 2 launched waited 108 s for a third process, then aborted with C++
    # stack traces (exit 134); --process-id 0 in both was "another program listens on port N".
    out = run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--", *CLI, "train", "--task", "linreg",
               "--steps", "2", "--no-progress", "--out", str(tmp_path / "o"), flag, value], timeout=200)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"error: {flag} {value} (argument {flag[2:].replace('-', '_')}) {named}, which spmdkit launch set" in out.stderr
    assert "drop " + flag in out.stderr


@pytest.mark.parametrize("given, ok", [("localhost:4321", True), ("127.0.0.1:4321", True),
                                       ("[::1]:4321", False), ("localhost:4322", False),
                                       ("no-such-host.invalid:4321", False)])
def test_a_coordinator_spelt_another_way_is_the_launchers_own(monkeypatch, given, ok):
    # localhost:N under a launch that set 127.0.0.1:N names the same place: it was refused.
    # ::1 is another address than 127.0.0.1, where the coordinator does not listen.
    from spmdkit._errors import DeviceSetupError
    from spmdkit._launch import ENV_COORDINATOR, _check_same_as_launch
    monkeypatch.setenv(ENV_COORDINATOR, "127.0.0.1:4321")
    if ok:
        _check_same_as_launch(given, None, None)
    else:
        with pytest.raises(DeviceSetupError, match=f"--coordinator {re.escape(given)} .*differs from 127.0.0.1:4321"):
            _check_same_as_launch(given, None, None)


def test_an_uncaught_exception_in_one_process_ends_the_launch_soon():
    # Process 1 raises while process 0 waits for it in a collective; JAX's exit handler would
    # hold process 1 in its shutdown barrier for 5 minutes.
    code = ("import spmdkit, jax, jax.numpy as jnp\n"
            "spmdkit.initialize(host_devices=1)\n"
            "from jax.experimental import multihost_utils\n"
            "multihost_utils.sync_global_devices('joined')\n"
            "if jax.process_index() == 1:\n"
            "    raise ValueError('a bug in process 1')\n"
            "multihost_utils.sync_global_devices('never')\n")
    t0 = time.time()
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert time.time() - t0 < 60
    assert "[1] ValueError: a bug in process 1" in out.stderr
    assert "process 1 ends within 20 s after this uncaught ValueError" in out.stderr
    assert "process 1 exited with code 1; stopped the other 1" in out.stderr


@pytest.mark.parametrize("raise_, ends_soon", [
    ("raise ValueError('boom')", True),
    ("raise KeyboardInterrupt", False),  # Ctrl-C reaches every process: the usual exit
    ("sys.ps1 = '>>> '; raise ValueError('typed at a prompt')", False),  # a session must go on
])
def test_which_uncaught_exceptions_end_a_process_soon(tmp_path, raise_, ends_soon):
    # An exit handler registered first runs last and hangs, as JAX's does when a peer waits for
    # this process in a collective; the user's, registered later, runs first and flushes a file.
    log = tmp_path / "metrics.csv"
    code = ("import atexit, sys, time\n"
            "from spmdkit._launch import end_soon_on_uncaught_exception\n"
            "from spmdkit._process import joined_as\n"
            "atexit.register(lambda: time.sleep(0 if sys.flags.interactive else 8))\n"
            "joined_as('process 1', grace_s=2)\n"
            "end_soon_on_uncaught_exception()\n"
            "end_soon_on_uncaught_exception()  # twice: one hook\n"
            "atexit.register(lambda: print('user exit handler ran', flush=True))\n"
            f"f = open({str(log)!r}, 'w'); f.write('step,loss\\n1,0.5\\n')\n"
            "print('raised at', time.time(), flush=True)\n"
            f"{raise_}\n")
    out = run([sys.executable, "-c", code], timeout=120)
    # From the raise, not from the start: importing spmdkit took up to 5 s on a loaded machine.
    took = time.time() - float(re.search(r"raised at (\S+)", out.stdout).group(1))
    assert "user exit handler ran" in out.stdout, out.stdout + out.stderr
    assert ("process 1 ends within 2 s after this uncaught ValueError" in out.stderr) == ends_soon
    assert out.stderr.count("Traceback (most recent call last)") == 1
    if ends_soon:
        assert out.returncode == 1 and took < 6, (out.returncode, took)  # 2 s of grace; the hang is 8 s
    else:
        assert took >= 8  # the hanging handler ran to its end: nothing cut it short


def test_end_soon_keeps_the_exit_code_the_exit_handlers_and_unclosed_files(tmp_path):
    # sys.exit(spmdkit.end_soon(code)) in a process of a group: the user's exit handlers run,
    # a hanging one (JAX's, when a peer waits in a collective) is cut at the grace, and a file
    # left open keeps what was written to it (Python flushes those only after the handlers).
    log = tmp_path / "metrics.csv"
    code = ("import atexit, sys, time, spmdkit\n"
            "from spmdkit._process import joined_as\n"
            "atexit.register(lambda: time.sleep(30))\n"
            "atexit.register(lambda: print('user exit handler ran', flush=True))\n"
            f"f = open({str(log)!r}, 'w'); f.write('step,loss\\n' * 100)\n"
            "joined_as('process 1', grace_s=3)\n"
            "spmdkit.end_soon(5)  # a second call changes the code, keeps the deadline\n"
            "sys.exit(spmdkit.end_soon(3, grace_s=1))\n")
    t0 = time.time()
    out = run([sys.executable, "-c", code], timeout=60)
    assert out.returncode == 3 and time.time() - t0 < 20, (out.returncode, out.stderr)
    assert "user exit handler ran" in out.stdout
    assert out.stderr.count("spmdkit: process 1 ends within 3 s after this error (exit code 5)") == 1, out.stderr
    assert log.read_text() == "step,loss\n" * 100


def test_exit_now_is_not_held_by_a_write_blocked_on_a_full_pipe():
    # Its flush of open files gets 5 s; a pipe nobody reads must not hold the exit it bounds.
    code = ("import os, sys\n"
            "from spmdkit._process import exit_now\n"
            "r, w = os.pipe()\n"
            "f = os.fdopen(w, 'wb', buffering=1 << 20)\n"
            "f.write(b'x' * (1 << 19))  # more than the pipe holds: its flush blocks\n"
            "exit_now(7)\n")
    t0 = time.time()
    out = run([sys.executable, "-c", code], timeout=60)
    assert out.returncode == 7 and time.time() - t0 < 20, (out.returncode, out.stderr)


@pytest.mark.parametrize("call, words", [
    ("spmdkit.end_soon('disk full')", r"end_soon\(code='disk full'\): an exit code is an int from 0 to 255"),
    ("spmdkit.end_soon(None)", r"end_soon\(code=None\)"),
    ("spmdkit.end_soon(2, grace_s=0)", r"end_soon\(grace_s=0\): the grace is seconds > 0"),
    ("threading.Thread(target=lambda: errors.append(catch(lambda: spmdkit.end_soon(2)))).start()",
     r"called from thread .*only the main thread's exit ends the process"),
])
def test_end_soon_refuses_what_would_not_bound_the_exit(call, words):
    code = ("import re, sys, threading, time, spmdkit\n"
            "from spmdkit._process import joined_as\n"
            "joined_as('process 1', grace_s=1)\n"
            "errors = []\n"
            "def catch(f):\n"
            "    try: f()\n"
            "    except spmdkit.ConfigError as e: return str(e)\n"
            "try:\n"
            f"    {call}\n"
            "except spmdkit.ConfigError as e:\n"
            "    errors.append(str(e))\n"
            "time.sleep(3)  # nothing was armed: the process is still here\n"
            "print('REFUSED', errors)\n")
    out = run([sys.executable, "-c", code], timeout=60)
    assert out.returncode == 0 and "REFUSED" in out.stdout, out.stdout + out.stderr
    assert re.search(words, out.stdout), out.stdout


def test_end_soon_at_an_interactive_prompt_arms_nothing():
    code = ("import sys, time, spmdkit\n"
            "from spmdkit._process import joined_as\n"
            "joined_as('process 1', grace_s=1)\n"
            "sys.ps1 = '>>> '\n"
            "try:\n"
            "    sys.exit(spmdkit.end_soon(2))\n"
            "except SystemExit:\n"
            "    pass  # a notebook or a prompt goes on\n"
            "time.sleep(3)\n"
            "print('still here')\n")
    out = run([sys.executable, "-c", code], timeout=60)
    assert out.returncode == 0 and "still here" in out.stdout, out.stderr
    assert "ends within" not in out.stderr


def test_every_process_failing_alike_exits_as_usual_with_files_flushed(tmp_path):
    code = ("import spmdkit, os\n"
            "spmdkit.initialize(host_devices=1)\n"
            f"f = open(os.path.join({str(tmp_path)!r}, 'm' + os.environ['SPMDKIT_PROCESS_ID']), 'w')\n"
            "f.write('step,loss\\n')\n"
            "raise KeyError('a config bug in every process')\n")
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert [(tmp_path / f"m{i}").read_text() for i in (0, 1)] == ["step,loss\n"] * 2


def test_the_process_that_failed_first_is_named_though_its_child_holds_its_output():
    code = ("import spmdkit, jax, subprocess, sys\n"
            "spmdkit.initialize(host_devices=1)\n"
            "from jax.experimental import multihost_utils\n"
            "multihost_utils.sync_global_devices('joined')\n"
            "if jax.process_index() == 1:\n"
            "    subprocess.Popen(['sleep', '300'])  # inherits the output pipes\n"
            "    raise ValueError('a bug in process 1')\n"
            "multihost_utils.sync_global_devices('never')\n")
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "process 1 exited with code 1; stopped the other 1" in out.stderr


def test_an_unknown_failure_gets_no_hint():
    code = "import sys; print('ValueError: my own bug', file=sys.stderr); sys.exit(1)"
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=90)
    assert out.returncode == 1 and "exited with code 1" in out.stderr
    assert "Fix:" not in out.stderr


def test_an_inherited_ignored_sigint_stays_ignored_by_the_launcher_and_its_processes(tmp_path):
    # `spmdkit launch ... &` in a script: SIGINT is ignored for it. The launcher caught it anyway
    # and stopped its processes (130); they, started under a handler, had it back at its default.
    up = tmp_path / "up"
    code = f"import pathlib, time; pathlib.Path({str(up)!r}).touch(); time.sleep(4)"
    import signal

    proc = subprocess.Popen([*CLI, "launch", "-n", "1", "--", sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not up.exists():
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert up.exists() and proc.returncode == 0, stderr


def test_explicit_flags_join_two_processes(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen([*CLI, "--host-devices", "2", "train", "--task", "linreg", "--steps", "20", "--no-progress",
                          "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                          "--out", str(tmp_path / "o")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env())
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:]
    import json

    assert json.loads((tmp_path / "o" / "summary.json").read_text())["device_count"] == 4


def test_process_id_without_coordinator_is_an_error():
    out = run([*CLI, "train", "--process-id", "1", "--no-progress"])
    assert out.returncode == 2 and "--num-processes/--process-id need --coordinator" in out.stderr


@pytest.mark.parametrize("first_multi", [True, False], ids=["2-processes-then-1", "1-then-2-processes"])
def test_checkpoints_move_between_two_processes_and_one(tmp_path, first_multi):
    def train(multi, steps, resume):
        args = [*CLI, "train", "--task", "linreg", "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ck"),
                "--checkpoint-every", "10", "--out", str(tmp_path / "o"), "--no-progress"] + (["--resume"] if resume else [])
        if multi:
            return run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "4", "--", *args])
        return run([args[0], *args[1:3], "--host-devices", "8", *args[3:]])

    first = train(first_multi, 20, False)
    assert first.returncode == 0, first.stderr[-2000:]
    second = train(not first_multi, 40, True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 20" in second.stdout
    straight = run([*CLI, "--host-devices", "8", "train", "--task", "linreg", "--steps", "40", "--no-progress",
                    "--out", str(tmp_path / "straight")])
    assert straight.returncode == 0
    with np.load(tmp_path / "o" / "params.npz") as a, np.load(tmp_path / "straight" / "params.npz") as b:
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6)


def test_a_hung_process_is_named_and_every_process_exits(tmp_path):
    # SIGSTOP: process 1 stays alive but makes no progress (nor heartbeats) - a hang. It stops once
    # steps are running (process 0 has written a step's metrics), not at a fixed time: stopped
    # before it joined jax.distributed, it would leave process 0 in initialize (a start-up error,
    # not the hang this test is about), which a slower machine reached at 9 s.
    metrics = tmp_path / "o" / "metrics.jsonl"
    script = (f'if [ "$SPMDKIT_PROCESS_ID" = 1 ]; then (for i in $(seq 600); do [ -s {metrics} ] && break; '
              f'sleep 0.2; done; kill -STOP $$) & fi; '
              f'exec {sys.executable} -m spmdkit._cli train --task digits --steps 100000 --no-progress '
              f'--distributed-timeout 10 --out {tmp_path / "o"}')
    # The bound that matters is the watchdog's own: it reports how long no step finished, which must be
    # near the 10 s timeout (not a 20-minute runtime timeout). Wall time also counts two JAX start-ups
    # and a compile, which a loaded CI machine stretches; the run's hard timeout bounds that.
    out = run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "2", "--", "sh", "-c", script], timeout=180)
    assert out.returncode != 0
    assert "no step finished for" in out.stderr and "behind: process 1 not answering" in out.stderr
    assert "(dead, stopped, or not training yet" in " ".join(out.stderr.split())
    idle = [int(s) for s in re.findall(r"no step finished for (\d+) s", out.stderr)]
    assert idle and max(idle) < 40, out.stderr[-2000:]
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "o")], capture_output=True, text=True).stdout.split()
    assert left == [], "orphan processes remain"


def test_a_coordinator_port_in_use_is_named_not_a_crash():
    # JAX crashed with SIGSEGV after gRPC's "Address already in use", naming no port.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run([*CLI, "train", "--task", "linreg", "--steps", "2", "--no-progress", "--coordinator",
                   f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"], timeout=90)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"another program already listens on port {port}" in out.stderr and "Fix: pick a free port" in out.stderr


def _launch_with_ports(tmp_path, always_taken: bool):
    """spmdkit launch -n 2 of a short run, whose first picked port (or every one) another program took."""
    code = ("import socket, sys\n"
            "import spmdkit._launch as L\n"
            "taken = socket.socket(); taken.bind(('127.0.0.1', 0)); taken.listen()\n"
            "port = taken.getsockname()[1]; print('taken', port, file=sys.stderr)\n"
            "picks, real = iter([port]), L.free_port\n"
            f"L.free_port = (lambda: port) if {always_taken} else (lambda: next(picks, None) or real())\n"
            f"sys.exit(L.launch([sys.executable, '-m', 'spmdkit._cli', 'train', '--task', 'linreg', '--steps', '2',\n"
            f"                   '--no-progress', '--out', {str(tmp_path / 'o')!r}], 2, devices_per_process=1))\n")
    out = run([sys.executable, "-c", code], timeout=240)
    port = re.search(r"taken (\d+)", out.stderr).group(1)
    return out, port


def test_launch_starts_again_on_another_port_when_its_pick_was_taken(tmp_path):
    out, port = _launch_with_ports(tmp_path, always_taken=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count(f"spmdkit launch: port {port}, free when picked, was taken by another program") == 1
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["steps"] == 2


def test_launch_gives_up_on_a_port_that_stays_taken(tmp_path):
    out, port = _launch_with_ports(tmp_path, always_taken=True)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count(f"port {port}, free when picked, was taken") == 3  # then the error stands
    assert f"[0] error: process 0 serves the coordinator at 127.0.0.1:{port}" in out.stderr


def test_a_watchdog_around_a_users_own_loop_ends_a_job_with_a_stuck_process():
    # Process 1 stays alive (its heartbeat goes on) but stops stepping, as a data reader waiting
    # forever would: without a watchdog process 0 waited in the next collective for ever.
    code = ("import sys, time, jax, spmdkit\n"
            "from jax.experimental import multihost_utils\n"
            "spmdkit.initialize()\n"
            "with spmdkit.StepWatchdog(timeout_s=8) as watchdog:\n"
            "    for i in range(1, 1000):\n"
            "        if jax.process_index() == 1 and i == 3:\n"
            "            time.sleep(600)\n"
            "        watchdog.started(i)\n"
            "        multihost_utils.sync_global_devices(f'step {i}')  # the step's collective\n"
            "        watchdog.finished(i)\n")
    t0 = time.time()
    out = run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--", sys.executable, "-c", code],
              timeout=180)
    assert out.returncode == 4, out.stderr[-2000:]
    assert "behind: process 1 has not started step 3 (hung at step 2)" in out.stderr, out.stderr[-2000:]
    assert "raise StepWatchdog(timeout_s=...) if steps are just slow" in out.stderr
    assert time.time() - t0 < 120


def test_an_ensemble_over_two_processes_spreads_its_members_over_both(tmp_path):
    # Its members sat on the first devices, all of process 0: the run failed with bare Python errors.
    train = ["train", "--task", "linreg", "--strategy", "ensemble", "--steps", "10", "--no-progress"]
    multi = run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "2", "--", *CLI, *train, "--members", "2",
                 "--out", str(tmp_path / "multi")], timeout=240)
    assert multi.returncode == 0, multi.stderr[-3000:]
    single = run([*CLI, "--host-devices", "2", *train, "--members", "2", "--out", str(tmp_path / "single")])
    assert single.returncode == 0, single.stderr[-2000:]
    with np.load(tmp_path / "multi" / "params.npz") as a, np.load(tmp_path / "single" / "params.npz") as b:
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k])
    odd = run([*CLI, "launch", "-n", "2", "--host-devices-per-process", "2", "--", *CLI, *train, "--members", "3",
               "--out", str(tmp_path / "odd")], timeout=240)
    assert odd.returncode == 2, odd.stderr[-3000:]
    assert "Ensemble(members=3) over 2 processes: the members must be spread evenly" in odd.stderr + odd.stdout


def test_output_that_is_not_utf8_is_passed_on_and_does_not_hang_the_launch():
    # The pump decoded strictly: a Latin-1 byte killed its thread, the child then blocked on a
    # full pipe and the launch hung with all later output lost.
    code = ("import sys\n"
            "sys.stdout.buffer.write(b'caf\\xe9\\n'); sys.stdout.flush()\n"
            "for i in range(5000): print('line', i, 'x' * 40)\n"
            "print('DONE')\n")
    out = run([*CLI, "launch", "-n", "1", "--", sys.executable, "-c", code], timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[0] caf\ufffd" in out.stdout and "[0] DONE" in out.stdout
    assert "Traceback" not in out.stderr


def test_a_reader_that_goes_away_does_not_hang_the_launch():
    # `spmdkit launch ... | head`: a pump whose write failed stopped reading the child's pipe.
    code = "for i in range(20000): print('line', i, 'x' * 40)"
    proc = subprocess.Popen([*CLI, "launch", "-n", "1", "--", sys.executable, "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    try:
        proc.stdout.readline()
        proc.stdout.close()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


def test_a_last_line_without_a_newline_keeps_its_own_line():
    # "[1] last-1[0] first-0": the next process's line was glued to an unfinished one.
    code = ("import os, sys, time\n"
            "i = os.environ['SPMDKIT_PROCESS_ID']\n"
            "time.sleep(0.2 if i == '1' else 1.0)\n"
            "sys.stdout.write(f'first-{i}\\nlast-{i}'); sys.stdout.flush()\n")
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[1] first-1", "[1] last-1", "[0] first-0", "[0] last-0"]


def test_stdin_goes_to_process_0_alone():
    # Shared, the processes split the launcher's stdin by chance.
    code = "import os, sys; print(os.environ['SPMDKIT_PROCESS_ID'], repr(sys.stdin.read()))"
    out = subprocess.run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], input="hello\n",
                         capture_output=True, text=True, timeout=60, env=env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(out.stdout.splitlines()) == ["[0] 0 'hello\\n'", "[1] 1 ''"]


def test_a_bare_spmdkit_after_the_dashes_is_the_launchers_own(tmp_path):
    # It was looked up on PATH: another install's spmdkit ran (here a stand-in that says so), or
    # none from a venv not activated ("cannot start 'spmdkit'").
    other = tmp_path / "spmdkit"
    other.write_text("#!/bin/sh\necho 'another spmdkit'\n")
    other.chmod(0o755)
    out = subprocess.run([*CLI, "launch", "-n", "2", "--", "spmdkit", "devices", "--json"], capture_output=True,
                         text=True, timeout=120, env={**env(), "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "another spmdkit" not in out.stdout and sorted({line[:4] for line in out.stdout.splitlines()}) == ["[0] ", "[1] "]


def test_a_launch_whose_restarts_all_fail_says_it_gave_up():
    out = run([*CLI, "launch", "-n", "1", "--max-restarts", "1", "--", sys.executable, "-c",
               "import sys; sys.exit(1)"], timeout=60)
    assert out.returncode == 1
    assert "restart 1/1" in out.stderr and "giving up: all 1 restart(s) of --max-restarts 1 failed too" in out.stderr
    bad = run([*CLI, "launch", "-n", "1", "--max-restarts", "3", "--", sys.executable, "-c",
               "import sys; sys.exit(2)"], timeout=60)
    assert bad.returncode == 2 and "not restarted: exit code 2 is bad input" in bad.stderr


def test_what_a_process_started_dies_with_a_killed_launcher(tmp_path):
    # PR_SET_PDEATHSIG reaches the launcher's children only: a `sleep` a child started lived on
    # as an orphan after `kill -9` of the launcher.
    import signal

    pids = tmp_path / "pids"
    code = ("import os, subprocess, time, pathlib\n"
            "p = subprocess.Popen(['sleep', '300'])\n"
            f"pathlib.Path({str(pids)!r} + os.environ['SPMDKIT_PROCESS_ID']).write_text(str(p.pid))\n"
            "time.sleep(300)\n")
    proc = subprocess.Popen([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    grandchildren = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not all((tmp_path / f"pids{i}").exists() for i in (0, 1)):
            time.sleep(0.1)
        time.sleep(0.3)  # the file is written; let its writer close it
        grandchildren = [int((tmp_path / f"pids{i}").read_text()) for i in (0, 1)]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(p) for p in grandchildren):
            time.sleep(0.1)
        assert not any(_alive(p) for p in grandchildren)
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in grandchildren:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:  # a zombie (not yet reaped by init) counts as dead
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_kills_and_names_a_process_still_running_5_s_later(tmp_path, own_group):
    # After SIGINT the launcher waited 5 s, then sent SIGTERM (which JAX catches) and waited 5 s
    # more before SIGKILL, naming no process it had to kill.
    import signal

    code = ("import os, pathlib, signal, time\n"
            "i = os.environ['SPMDKIT_PROCESS_ID']\n"
            "if i == '1':\n"
            "    signal.signal(signal.SIGINT, signal.SIG_IGN)  # stuck, as in a collective a peer left\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as JAX catches it\n"
            f"pathlib.Path({str(tmp_path)!r}, 'up' + i).touch()\n"
            "time.sleep(120)\n")
    with own_group([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], sigint=True, env=env()) as proc:
        deadline = time.time() + 60
        while time.time() < deadline and not all((tmp_path / f"up{i}").exists() for i in (0, 1)):
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "spmdkit launch: process 1 was still running 5 s after SIGINT; killed it (SIGKILL)" in stderr, stderr[-2000:]
    assert "process 0 was still running" not in stderr


def test_sigterm_waits_then_sigterm_again_then_sigkill_and_a_second_sigterm_changes_nothing(tmp_path, own_group):
    # The wait after SIGTERM (a preemption notice) was a bare 60 in _end_forwarded, the rest of the
    # timing undocumented. Short waits here through launch()'s parameters (60 s and 5 s by default).
    import signal

    terms = tmp_path / "terms"
    child = ("import os, pathlib, signal, time\n"
             f"log = pathlib.Path({str(terms)!r})\n"
             "def note(*_):\n"
             "    with log.open('a') as fh: fh.write(f'{time.time()}\\n')\n"
             "signal.signal(signal.SIGTERM, note)  # as JAX catches it: never ends by itself\n"
             "log.touch()\n"
             "while True: time.sleep(0.05)\n")
    launcher = ("import sys\nfrom spmdkit._launch import launch\n"
                f"sys.exit(launch([sys.executable, '-c', {child!r}], 1, grace_s=1.0, sigterm_wait_s=4.0))\n")
    with own_group([sys.executable, "-c", launcher], env=env()) as proc:
        deadline = time.time() + 60
        while time.time() < deadline and not terms.exists():
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        while time.time() < deadline and not terms.read_text():
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # a second one, during the wait
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-2000:]
    got = [float(t) for t in terms.read_text().split()]
    # Forwarded once, then once more after the wait: the second SIGTERM to the launcher was
    # neither forwarded nor cut the wait short (a lower bound: the wait is 4 s, 1 s of slack).
    assert len(got) == 2 and got[1] - got[0] >= 3.0, got
    assert "spmdkit launch: process 0 was still running 5 s after SIGTERM; killed it (SIGKILL)" in stderr, stderr
    assert "Traceback" not in stderr


def test_launch_help_states_the_signal_timing():
    out = run([*CLI, "launch", "--help"], timeout=60)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    assert "get 60 s to end, then SIGTERM again and SIGKILL 5 s later (65 s in all); launch exits 143" in text, text
    assert "SIGKILL 5 s later; launch exits 130" in text and "neither shortens nor repeats" in text


def test_a_process_that_never_joins_is_named_with_the_fix():
    # Process 1 left (exit 0) without spmdkit.initialize(); process 0 waited 100 s for it in
    # jax.distributed.initialize and died of a native abort (exit 134, a stack dump), no word
    # of why. Here process 0 prints JAX's words of that abort and aborts at once.
    code = ("import os, signal, sys, time\n"
            "if os.environ['SPMDKIT_PROCESS_ID'] == '1':\n"
            "    sys.exit(0)\n"
            "time.sleep(1)\n"
            "print('F1206 client.h:86] Terminating process because the JAX distributed service detected fatal '\n"
            "      'errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\\n\\n'\n"
            "      'RPC: /xla.coordination.CoordinationService/RegisterTask', file=sys.stderr, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGABRT)\n")
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=90)
    assert out.returncode == 134, out.stderr[-2000:]
    assert "process 0 was killed by signal 6" in out.stderr
    assert re.search(r"process 1 had exited with code 0 \d+ s before process 0 failed", out.stderr), out.stderr
    assert "one did not join in time" in out.stderr and "Fix: call spmdkit.initialize() in every process" in out.stderr


def test_initialize_again_with_another_place_in_the_job_is_refused():
    # Joined as process i of 2, initialize("...", 3, 2) returned True: the script went on
    # believing it was process 2 of 3.
    code = ("import spmdkit\n"
            "assert spmdkit.initialize(host_devices=1)\n"
            "assert spmdkit.initialize()  # again, no arguments: still True\n"
            "try:\n"
            "    spmdkit.initialize('10.0.0.9:1234', 3, 2)\n"
            "    print('ACCEPTED')\n"
            "except spmdkit.DeviceSetupError as e:\n"
            "    print('REFUSED', e)\n")
    out = run([*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("REFUSED initialize(num_processes=3): this process has already joined a job as process") == 2, \
        out.stdout
    assert "ACCEPTED" not in out.stdout
