"""Several processes joined by ``jax.distributed``: the local launcher and the start-up.

``spmdkit launch -n P -- spmdkit train ...`` starts P copies of a command on this
machine, tells each its place through the environment (coordinator address on
127.0.0.1 and a free port, process count, process id, devices per process),
prefixes their output with the process index, and ends them all (SIGKILL after a
grace period: JAX catches SIGTERM) as soon as one fails. The children die with the
launcher: each runs in its own process group, which the launcher signals, and asks
the kernel for SIGKILL should the launcher die without a word (``kill -9``). With
``max_restarts`` a failed group is restarted from its last good checkpoint.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import jax

from spmdkit._cache import off_for_several_processes
from spmdkit._errors import DeviceSetupError, SpmdkitError, fix
from spmdkit._process import EXIT_GRACE_S, end_soon, joined_as


class LaunchError(SpmdkitError, OSError):
    """The processes of a launch cannot be started as asked."""

ENV_COORDINATOR = "SPMDKIT_COORDINATOR"
ENV_NUM_PROCESSES = "SPMDKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "SPMDKIT_PROCESS_ID"
ENV_RESUME = "SPMDKIT_RESUME"  # set on a restart: spmdkit train then resumes from its --checkpoint-dir
# The launcher's pid, for its processes: a timing in one of them counts the whole launch as its own load.
ENV_LAUNCHER_PID = "SPMDKIT_LAUNCHER_PID"


# Seconds the processes get after a SIGTERM the launcher forwarded (a preemption notice: spmdkit
# train saves a checkpoint, which can take long), before the launcher sends SIGTERM again.
SIGTERM_WAIT_S = 60.0
# Seconds the processes get to end before SIGKILL: after that second SIGTERM, after a forwarded
# SIGINT, and when one process failed. SIGTERM alone may not end them: JAX catches it.
STOP_GRACE_S = 5.0
BACKOFF_S = 1.0  # the first restart's wait; it doubles per restart, at most 30 s


# In process 0's error when the coordinator's port is taken: the launcher, which picked the port,
# then starts the group again on another (the port was free when picked; another program took it).
PORT_TAKEN = "already listens on port"
_PORT_RETRIES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_detected() -> bool:
    """A multi-task SLURM or Open MPI job, or JAX's own ``JAX_COORDINATOR_ADDRESS``
    (with ``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``): jax.distributed reads them by itself."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        try:
            if int(os.environ.get(name, "1")) > 1:
                return True
        except ValueError:
            pass
    return False


def check_coordinator(address: str) -> str:
    """``HOST:PORT`` with a port in 1..65535; returns the host."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DeviceSetupError(fix(f"--coordinator {address!r} is not HOST:PORT.",
                                   "pass e.g. --coordinator node0:1234 (process 0's host and a free port)."))
    return host.strip("[]")


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _check_port_free(host: str, port: int) -> None:
    """Process 0 serves the coordinator: a port another program listens on made JAX crash
    (SIGSEGV after gRPC's "Address already in use"), with nothing that names the port."""
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return  # JAX binds elsewhere than the coordinator's address says
    where = ("127.0.0.1" if host == "localhost" else host) if _is_loopback(host) else "0.0.0.0"
    family = socket.AF_INET6 if ":" in where else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR as gRPC sets it: a port left in TIME_WAIT by an earlier run is free to it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((where, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # JAX will say what is wrong with the address
            raise DeviceSetupError(fix(
                f"process 0 serves the coordinator at {host}:{port}, but another program {PORT_TAKEN} {port} "
                "of this machine.",
                "pick a free port for --coordinator (the same address in every process), or stop the program "
                "using it (`ss -ltnp` names it). spmdkit launch, which picks the port, starts again on another."
            )) from None


def heartbeat_timeout(timeout_s: int) -> int:
    """JAX's heartbeat timeout for a run whose step watchdog waits ``timeout_s`` seconds.

    The watchdog starts with the training loop, after start-up (data, init, the first
    compile) that can take many seconds on a busy machine; a peer that stops during
    another's start-up must still be named by the watchdog, not end the job through
    JAX's abort.

    >>> heartbeat_timeout(100)
    330
    """
    return 3 * timeout_s + 30


def _check_same_as_launch(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Under ``spmdkit launch`` a flag that contradicts what it set for the process: the
    processes then waited for a peer that never came (``--num-processes 3`` of 2 launched:
    108 s, then an abort with C++ stack traces)."""
    for flag, given, name in (("--coordinator", coordinator, ENV_COORDINATOR),
                              ("--num-processes", num_processes, ENV_NUM_PROCESSES),
                              ("--process-id", process_id, ENV_PROCESS_ID)):
        if given is not None and name in os.environ and not _same(flag, str(given), os.environ[name]):
            raise DeviceSetupError(fix(
                f"{flag} {given} (argument {flag[2:].replace('-', '_')}) differs from {os.environ[name]}, which "
                f"spmdkit launch set for this process ({name}).",
                f"drop {flag}: under spmdkit launch every process takes its coordinator, count and id from the "
                "launcher (spmdkit launch -n N sets the count); or start the processes yourself."))


def _same(flag: str, given: str, launched: str) -> bool:
    if given == launched or flag != "--coordinator":
        return given == launched
    # One place spelt two ways (localhost:N and 127.0.0.1:N) is the same coordinator.
    (host, _, port), (host0, _, port0) = given.rpartition(":"), launched.rpartition(":")
    return port == port0 and bool(_addresses(host) & _addresses(host0))


def _addresses(host: str) -> set[str]:
    host = host.strip("[]")
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return {host}  # not resolvable here: only the same spelling is the same place


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: int = 100,
) -> bool:
    """Join a process group, if there is one; False when this is a single process.

    Sources, first found wins: the arguments (``--coordinator`` ...), the variables
    ``spmdkit launch`` sets, JAX's ``JAX_COORDINATOR_ADDRESS`` variables, a SLURM /
    Open MPI job (auto-detected by JAX). TPU pods are not auto-detected: pass the flags.
    The training loop's step watchdog uses ``timeout_s``; the coordination service's
    heartbeat timeout, the backstop, is :func:`heartbeat_timeout` of it.
    """
    _check_same_as_launch(coordinator, num_processes, process_id)
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if coordinator:
        host = check_coordinator(coordinator)
        try:
            count = num_processes if num_processes is not None else int(os.environ[ENV_NUM_PROCESSES])
            index = process_id if process_id is not None else int(os.environ[ENV_PROCESS_ID])
        except (KeyError, ValueError):
            raise DeviceSetupError(
                fix(f"a coordinator ({coordinator}) is given but the process count or id is missing.",
                    "pass --num-processes and --process-id (or start the processes with spmdkit launch).")
            ) from None
        if not 0 <= index < count:
            raise DeviceSetupError(fix(f"--process-id {index} with --num-processes {count}: ids run from 0 to {count - 1}.",
                                       f"give each process its own id in 0..{count - 1}."))
        if index == 0:
            _check_port_free(host, int(coordinator.rpartition(":")[2]))
        # A loopback coordinator serves this machine only: bind it there, not on every
        # interface (JAX's default). Elsewhere JAX binds where JAX_COORDINATOR_BIND_ADDRESS says.
        bind = {"coordinator_bind_address": coordinator} if _is_loopback(host) else {}
        # The heartbeat is the backstop; the step watchdog (which names the process that
        # fell behind) gets to speak first.
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=index,
                                   initialization_timeout=max(timeout_s, 60), heartbeat_timeout_seconds=heartbeat_timeout(timeout_s),
                                   **bind)
        if count > 1:
            note_joined(index, timeout_s)
        return True
    if num_processes is not None or process_id is not None:
        raise DeviceSetupError(fix("--num-processes/--process-id need --coordinator HOST:PORT.",
                                   "pass the address of process 0, e.g. --coordinator node0:1234."))
    if _cluster_detected():
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout(timeout_s))
        note_joined(None, timeout_s)
        return True
    return False


def end_soon_on_uncaught_exception() -> None:
    """In a job of several processes: a process whose main thread raises an uncaught
    exception exits as usual, but within the grace :func:`spmdkit.end_soon` gives (20 s
    by default), with exit code 1.

    Python runs the exit handlers after the traceback: the user's (and file buffers are
    flushed) when every process failed alike, but then JAX's, whose shutdown barrier waits
    for every peer, and a peer waiting for this process in a collective never comes: a
    script that raised in one of 2 processes ended 306 s later, with a SIGABRT and a native
    stack dump. The hook arms :func:`spmdkit.end_soon` after the traceback, so
    ``spmdkit launch`` can stop the others and name this one. ``KeyboardInterrupt`` and an
    error typed at an interactive prompt keep the usual behaviour, as does ``sys.exit``
    (which is not an uncaught exception: a peer waiting in a collective still holds it;
    ``sys.exit(spmdkit.end_soon(code))`` leaves within the grace too). A
    ``sys.excepthook`` installed before this one is called first; one installed after
    replaces it. Nothing happens until :func:`joined_as` noted a group.
    """
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        previous(kind, value, tb)
        if issubclass(kind, KeyboardInterrupt) or hasattr(sys, "ps1") or sys.flags.interactive:
            return
        end_soon(1, f"this uncaught {kind.__name__}")

    if not getattr(sys.excepthook, "_spmdkit_ends_soon", False):
        hook._spmdkit_ends_soon = True  # type: ignore[attr-defined]
        sys.excepthook = hook


def note_joined(index: int | None, timeout_s: float) -> None:
    """This process is one of several: failures that only it meets end it soon (see end_soon), and
    the compile cache goes off where loading a program of several processes hangs."""
    # Half the step watchdog's timeout at most: a peer's watchdog must not end first and be named.
    joined_as("this process" if index is None else f"process {index}", min(EXIT_GRACE_S, timeout_s / 2))
    end_soon_on_uncaught_exception()
    off_for_several_processes(jax.process_count(), stacklevel=4)  # the compile cache, where it hangs


# Failures of JAX's runtime whose own words do not say what to do: (marks that must all be on
# one line a process printed, what happened, the fix). Printed once after the launch stops.
KNOWN_FAILURES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("Gloo context initialization failed", "GetKeyValue() timed out"),
     "the processes reached a collective over a new set of devices more than 30 s apart: gloo (JAX's "
     "CPU collectives) waits 30 s for the other process when it first sets up that set, and the "
     "early one gave up. One was still loading, compiling or saving, or starved on a busy machine",
     "have every process do the same work before its first collective (the built-in tasks do), run "
     "again on a quieter machine, or pass --max-restarts N to start every process again"),
    # JAX's own words then suggest uninstalling a plugin, which is not the cause.
    (("Getting local topologies failed", "GetKeyValue() timed out"),
     "a process started JAX's CPU backend and waited for another's, which did not start it in time "
     "(2 minutes by default): the other failed before its first JAX operation (see its output above) "
     "or spent that long before it (loading data, a slow file system)",
     "mend the other process's error; if it was only slow, have every process do the same work "
     "before its first JAX operation, or give it longer: JAX_CPU_GET_LOCAL_TOPOLOGY_TIMEOUT_MINUTES=M "
     "in every process's environment (default 2; keep it below JAX_CPU_GET_GLOBAL_TOPOLOGY_TIMEOUT_MINUTES, "
     "default 5)"),
    # JAX's words: a native abort ("Terminating process because the JAX distributed service detected
    # fatal errors ... DEADLINE_EXCEEDED ... RegisterTask") and a stack dump, 100 s after the start.
    (("DEADLINE_EXCEEDED", "RegisterTask"),
     "a process waited for every process to join the job (jax.distributed.initialize, which "
     "spmdkit.initialize() and spmdkit train call) and one did not join in time (spmdkit.initialize's "
     "timeout_s, 100 s by default, at least 60): it exited or failed before joining, never called "
     "spmdkit.initialize(), or did that much work before it",
     "call spmdkit.initialize() in every process, first, before loading data (see the other processes' "
     "output above)"),
)


def known_failure(line: str) -> str | None:
    """What to tell the user about a line a process printed, or None.

    Example:
        >>> known_failure("jax.errors.JaxRuntimeError: UNKNOWN: Gloo context initialization failed: "
        ...               "DEADLINE_EXCEEDED: GetKeyValue() timed out with key: cpu:gloo/0,2048/0").split(":")[0]
        'the processes reached a collective over a new set of devices more than 30 s apart'
        >>> known_failure("step 10: loss 0.31") is None
        True
    """
    for marks, what, how in KNOWN_FAILURES:
        if all(m in line for m in marks):
            return fix(what + ".", how + ".")
    return None


def _pump(stream, prefix: str, sink, seen: dict[str, None], port_taken: threading.Event) -> None:
    # A runtime error's marks can fall on two lines (a wrapped status, a traceback's note):
    # match over the last few lines, not one.
    recent: collections.deque[str] = collections.deque(maxlen=4)
    writable = True
    for line in iter(stream.readline, ""):
        if writable:
            # A last line with no newline would have the next process's prefixed line glued to it.
            end = "" if line.endswith("\n") else "\n"
            writable = _forward(sink, f"{prefix}{line}{end}")
        recent.append(line.rstrip("\n"))
        hint = known_failure(" ".join(recent))
        if hint is not None:
            seen.setdefault(hint)  # one call: two pumps finding it at once keep one entry
        if PORT_TAKEN in line:
            port_taken.set()


def _forward(sink, text: str) -> bool:
    """Write ``text`` to ``sink``; False once the sink is gone (``spmdkit launch ... | head``).

    The pump must keep reading the child's pipe even then: a pump that stopped would leave
    the child blocked on a full pipe, and the launch would hang.
    """
    try:
        sink.write(text)
        sink.flush()
        return True
    except (OSError, ValueError):  # BrokenPipeError; a closed file
        return False


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies, however it dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the process group and the forwarded signals still end the children


# Run by a helper process: at EOF on stdin without "done" (the launcher died, kill -9 included)
# it kills the process groups named in argv. PR_SET_PDEATHSIG reaches the launcher's children
# only: what they started themselves lived on as orphans after a kill -9 of the launcher.
_REAPER = ("import os, signal, sys\n"
           "if sys.stdin.read() != 'done':\n"
           "    for g in sys.argv[1:]:\n"
           "        try: os.killpg(int(g), signal.SIGKILL)\n"
           "        except OSError: pass\n")


def _start_reaper(groups: list[int]) -> subprocess.Popen | None:
    try:  # its own session: a signal to the launcher's group must not end it first
        # -P: a signal.py in the working directory is not imported in place of Python's.
        return subprocess.Popen([sys.executable, "-P", "-c", _REAPER, *map(str, groups)], stdin=subprocess.PIPE,
                                text=True, start_new_session=True, stdout=subprocess.DEVNULL)
    except OSError:
        return None  # the children still die with the launcher; only what they started may not


def _end_reaper(reaper: subprocess.Popen | None) -> None:
    if reaper is None or reaper.poll() is not None:
        return
    try:
        reaper.stdin.write("done")
        reaper.stdin.close()
        reaper.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        reaper.kill()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _why_not_started(program: str, error: OSError) -> str:
    """The OS says "Permission denied" for a directory as for a file without the execute bit.
    A name without a slash is looked up on PATH: what sits in the working directory is no cause."""
    if error.errno not in (errno.EACCES, errno.EISDIR) or os.sep not in program:
        return str(error.strerror or error)
    if os.path.isdir(program):
        return "it is a directory, not a program"
    if os.path.isfile(program) and not os.access(program, os.X_OK):
        hint = f" (run a script as: python {program} ...)" if program.endswith(".py") else ""
        return f"the file is not executable{hint}"
    return str(error.strerror or error)


class _Group:
    """One start of P processes: started together, watched, stopped together."""

    def __init__(self, command: Sequence[str], processes: int, devices_per_process: int | None, restart: bool = False):
        self.port = port = free_port()
        self.port_taken = threading.Event()  # process 0 found the port taken (see PORT_TAKEN)
        self.procs: list[subprocess.Popen] = []
        self.reaper: subprocess.Popen | None = None
        self.pumps: list[threading.Thread] = []
        self.hints: dict[str, None] = {}  # known_failure of what the processes printed, in order
        # When each process exited: of processes seen failed together, the first is the cause
        # (a peer's collective then fails too). Not when its output ends: a child it started
        # may hold its pipes open.
        self.ended: dict[int, float] = {}
        for i in range(processes):
            env = {**os.environ, ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(processes),
                   ENV_PROCESS_ID: str(i), ENV_LAUNCHER_PID: str(os.getpid())}
            if devices_per_process is not None:
                env["SPMDKIT_HOST_DEVICES"] = str(devices_per_process)
            if restart:
                env[ENV_RESUME] = "1"
            try:
                # The launcher's stdin goes to process 0 alone: shared, the processes split it
                # between them by chance (one read it all, the other got nothing).
                stdin = None if i == 0 else subprocess.DEVNULL
                proc = subprocess.Popen(list(command), env=env, stdin=stdin, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE,
                                        text=True, bufsize=1, start_new_session=True,
                                        # A byte that is not UTF-8 (a Latin-1 file name) must not
                                        # stop the pump: the child would block on a full pipe.
                                        encoding="utf-8", errors="replace",
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            except OSError as e:
                self.stop(0.0)
                raise LaunchError(fix(f"cannot start {command[0]!r}: {_why_not_started(command[0], e)}.",
                                      "check the command after -- (a path or a program on PATH).")) from None
            self.procs.append(proc)
        # Threads only once every child is forked: preexec_fn and threads do not mix.
        for i, proc in enumerate(self.procs):
            for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, f"[{i}] ", sink, self.hints, self.port_taken),
                                     daemon=True)
                t.start()
                self.pumps.append(t)
            threading.Thread(target=self._note_exit, args=(i, proc), daemon=True).start()
        self.reaper = _start_reaper([p.pid for p in self.procs])

    def _note_exit(self, index: int, proc: subprocess.Popen) -> None:
        proc.wait()  # sets proc.returncode before the time is noted
        self.ended[index] = time.monotonic()

    def wait(self, stop: threading.Event) -> tuple[int, int] | None:
        """None when all exited 0; else ``(index, code)`` of the first to fail (-1 if stopped)."""
        while True:
            ended = dict(self.ended)
            bad = [(i, self.procs[i].returncode) for i in ended if self.procs[i].returncode != 0]
            if bad:
                return min(bad, key=lambda ic: (ended[ic[0]], ic[0]))  # the first to exit
            if len(ended) == len(self.procs):
                return None
            if stop.is_set():
                return (-1, 0)
            stop.wait(0.1)

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, sig)

    def running(self) -> list[int]:
        """The indices of the processes that have not exited."""
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def wait_ended(self, seconds: float) -> None:
        """Until every process has exited, or ``seconds`` have passed."""
        deadline = time.time() + seconds
        while time.time() < deadline and self.running():
            time.sleep(0.1)

    def stop(self, grace_s: float, sigterm: bool = True) -> list[int]:
        """SIGTERM to every group, SIGKILL after ``grace_s`` (JAX may catch SIGTERM); the
        indices of the processes still running then, which the SIGKILL ended. ``sigterm=False``:
        SIGKILL alone, for processes that had their SIGTERMs already."""
        if sigterm:
            self.signal(signal.SIGTERM)
        self.wait_ended(grace_s)
        killed = self.running()
        for p in self.procs:
            _signal_group(p, signal.SIGKILL)  # also what a child left behind in its group
        for p in self.procs:
            p.wait()
        for t in self.pumps:
            t.join(timeout=5)
        _end_reaper(self.reaper)
        return killed


def _end_forwarded(group: _Group, sig: int, grace_s: float, sigterm_wait_s: float) -> int:
    """A signal forwarded to every process: wait for them, then SIGKILL the rest, each named;
    the exit code a shell gives for ``sig``.

    SIGTERM is a preemption notice (spmdkit train saves a checkpoint): ``sigterm_wait_s``, then
    SIGTERM again and ``grace_s`` more. SIGINT (Ctrl-C): ``grace_s``, in which a process reports
    what it has (``spmdkit plan --measure`` prints its rounds so far); one still running then is
    stuck (in a collective a peer left), and a SIGTERM would not reach it either: JAX catches it.
    Further signals to the launcher meanwhile only land in ``forward`` (noted, nothing else):
    they neither shorten these waits nor are forwarded again.
    """
    group.signal(sig)
    waited = grace_s
    if sig == signal.SIGTERM:
        group.wait_ended(sigterm_wait_s)
        group.signal(signal.SIGTERM)
        waited += sigterm_wait_s
    group.wait_ended(grace_s)
    for i in group.running():
        sys.stderr.write(f"spmdkit launch: process {i} was still running {waited:g} s after "
                         f"{signal.Signals(sig).name}; killed it (SIGKILL)\n")
    sys.stderr.flush()
    # No third SIGTERM before the SIGKILL: a process that handles it (a checkpoint save begun) got
    # one more than the documented two, which a loaded machine let it act on (tests/test_launch.py).
    group.stop(0.0, sigterm=False)
    return 128 + sig


def _report_failure(group: _Group, processes: int, index: int, code: int, attempt: int,
                    max_restarts: int, killed: Sequence[int] = (), grace_s: float = STOP_GRACE_S) -> int | None:
    """Say which process failed and how, and which of the others had to be killed (one stuck in
    a collective with the failed one); the launch's exit code when it gives up, None to restart."""
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    sys.stderr.write(f"spmdkit launch: process {index} {how}; stopped the other {processes - 1}\n")
    # A process that left with 0 while the others still needed it (one that never joined the job):
    # the failure is the others', the cause is its.
    failed_at = group.ended.get(index)
    for i, at in sorted(group.ended.items(), key=lambda ia: ia[1]):
        if i != index and failed_at is not None and at < failed_at and group.procs[i].returncode == 0:
            sys.stderr.write(f"spmdkit launch: process {i} had exited with code 0 {failed_at - at:.0f} s before "
                             f"process {index} failed\n")
    for i in killed:
        sys.stderr.write(f"spmdkit launch: process {i} was still running {grace_s:g} s after SIGTERM "
                         f"(sent when process {index} failed); killed it (SIGKILL)\n")
    for hint in group.hints:  # complete: stop() has waited for the output pumps
        sys.stderr.write(f"spmdkit launch: {hint}\n")
    if attempt < max_restarts and code != 2:
        return None
    if max_restarts and code != 2:  # else the last line reads like any first failure
        sys.stderr.write(f"spmdkit launch: giving up: all {max_restarts} restart(s) of --max-restarts "
                         f"{max_restarts} failed too\n")
    elif max_restarts:
        sys.stderr.write("spmdkit launch: not restarted: exit code 2 is bad input, which a restart "
                         "would meet again\n")
    # A child killed by signal N exits as a shell reports it: 128 + N (137 for SIGKILL).
    return code if code > 0 else 128 - code


_WAITS = {"grace_s": STOP_GRACE_S, "backoff_s": BACKOFF_S, "sigterm_wait_s": SIGTERM_WAIT_S}  # launch()'s defaults


def _check_launch(command: Sequence[str], processes: int, max_restarts: int, **seconds: float) -> None:
    for name, value in seconds.items():  # a NaN wait never ended; a negative one was taken as none
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise DeviceSetupError(fix(f"{name}={value!r}: a wait in seconds must be a finite number >= 0.",
                                       f"pass e.g. {name}={_WAITS[name]!r} (the default), or 0 for no wait."))
    if processes < 1:
        raise DeviceSetupError(fix(f"-n {processes}: need at least one process.", "pass -n 2."))
    if max_restarts < 0:
        raise DeviceSetupError(fix(f"max_restarts={max_restarts}: restarts cannot be fewer than none.",
                                   "pass 0 for no restarts, or N to restart up to N times (--max-restarts N)."))
    if not command:
        raise DeviceSetupError(fix("no command to launch.", "write it after --, e.g. spmdkit launch -n 2 -- spmdkit train"))


def own_spmdkit(command: Sequence[str]) -> list[str]:
    """``command`` with a bare ``spmdkit`` run as the launcher's own: found on PATH, it was
    another install's (or none, from a venv not activated: "cannot start 'spmdkit'").

    >>> own_spmdkit(["spmdkit", "train"])[1:]
    ['-P', '-m', 'spmdkit', 'train']
    >>> own_spmdkit(["./my_spmdkit", "train"])
    ['./my_spmdkit', 'train']
    """
    if command and command[0] == "spmdkit":
        # -P: no working directory on the path, as for the console script (a user's rich.py or
        # logging.py there would be imported in place of the library's).
        return [sys.executable, "-P", "-m", "spmdkit", *command[1:]]
    return list(command)


def launch(command: Sequence[str], processes: int, devices_per_process: int | None = None, grace_s: float = STOP_GRACE_S,
           max_restarts: int = 0, backoff_s: float = BACKOFF_S, sigterm_wait_s: float = SIGTERM_WAIT_S) -> int:
    """Run ``command`` in ``processes`` local processes; the exit code of the first to fail (128 + N if
    signal N killed it, as a shell says), else 0. A bare ``spmdkit`` runs as this spmdkit
    (``python -P -m spmdkit`` with this Python), not as whichever ``spmdkit`` comes first on PATH.

    When one fails and ``max_restarts`` allows, every process is stopped and the group is
    started again after a back-off (1 s, 2 s, 4 s ... at most 30 s), resuming from the last good
    checkpoint (``SPMDKIT_RESUME=1`` makes ``spmdkit train --checkpoint-dir D`` resume). Exit code 2 (bad
    input) is never retried, except when process 0 found the port picked for it taken by another
    program: then the group starts again on another port (up to 3 times, besides ``max_restarts``).
    SIGTERM/SIGINT to the launcher go to every process; the launcher then exits with 143/130
    once they have ended. After SIGTERM they get ``sigterm_wait_s`` (60 s: a preemption notice,
    spmdkit train saves a checkpoint), then SIGTERM again and SIGKILL ``grace_s`` (5 s) later;
    after SIGINT, SIGKILL ``grace_s`` later. Each process killed is named on stderr. A second
    signal to the launcher meanwhile changes nothing.
    """
    _check_launch(command, processes, max_restarts, grace_s=grace_s, backoff_s=backoff_s,
                  sigterm_wait_s=sigterm_wait_s)
    command = own_spmdkit(command)
    stop = threading.Event()
    received: list[int] = []

    def forward(signum, frame):
        # Only noted: the main thread forwards the first (_end_forwarded); a later one changes nothing.
        received.append(signum)
        stop.set()

    main = threading.current_thread() is threading.main_thread()
    # An ignored SIGINT (`spmdkit launch ... &` in a script) stays ignored, here and in the children.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    caught = (signal.SIGTERM,) if ignored else (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, forward) for s in caught} if main else {}
    try:
        attempt = port_retries = 0
        while True:
            t_start = time.time()
            group = _Group(command, processes, devices_per_process, restart=attempt > 0)
            failed = group.wait(stop)
            if failed == (-1, 0):
                return _end_forwarded(group, received[0], grace_s, sigterm_wait_s)
            if failed is None:
                group.stop(0.0)
                return 0
            killed = group.stop(grace_s)
            index, code = failed
            if index == 0 and code == 2 and group.port_taken.is_set() and port_retries < _PORT_RETRIES:
                port_retries += 1  # not a restart of the user's job: nothing of it ran
                sys.stderr.write(f"spmdkit launch: port {group.port}, free when picked, was taken by another program "
                                 f"before process 0 could serve on it; starting the {processes} processes again on "
                                 "another port\n")
                continue
            final = _report_failure(group, processes, index, code, attempt, max_restarts, killed, grace_s)
            if final is not None:
                return final
            attempt += 1
            wait = min(backoff_s * 2 ** (attempt - 1), 30.0)
            sys.stderr.write(f"spmdkit launch: restart {attempt}/{max_restarts} of all {processes} processes in "
                             f"{wait:.0f} s, from the last good checkpoint ({time.time() - t_start:.1f} s after start)\n")
            sys.stderr.flush()
            if stop.wait(wait):
                return 128 + received[0]
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
