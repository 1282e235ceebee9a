"""Faults and bad input: nothing is lost, nothing hangs, every mistake gets a clear error.

Every process a test starts has a hard timeout and is SIGKILLed (with its process group)
in teardown. A full disk and a read-only directory are real (a small tmpfs) where the
machine lets us mount one, and an injected OSError(ENOSPC / EROFS) otherwise.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmdkit
from spmdkit._checkpoint import CheckpointSaveError, parse_step, step_name
from spmdkit._checkpoint_read import is_chunk_file
from spmdkit._cli import main as cli_main
from spmdkit._tasks import linreg
from spmdkit._train._validate import TaskError, validate_task
from spmdkit._train._steps import task_state

CLI = [sys.executable, "-m", "spmdkit._cli"]
OPT = optax.sgd(0.05)


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPMDKIT_")}


@pytest.fixture
def procs():
    """Popen objects to SIGKILL (whole process group) however the test ends."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
        p.wait(timeout=30)


def spawn(procs, args, **kw) -> subprocess.Popen:
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         **{"env": env(), **kw})
    procs.append(p)
    return p


def fit(ck, steps=40, every=10, keep=3, resume=False, overwrite=False, lr=0.05, out=None, log=None):
    return spmdkit.fit(linreg.make(), spmdkit.DataParallel(), optax.sgd(lr), spmdkit.TrainConfig(steps=steps),
                       out_dir=out, progress=False, log=log or (lambda m: None),
                       checkpoint=spmdkit.CheckpointConfig(str(ck), every=every, keep=keep, resume=resume,
                                                           overwrite=overwrite))


def target():
    return spmdkit.DataParallel().abstract(task_state(linreg.make(), OPT), unbox=True)


def reader(ck, log=None):
    return spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(ck)), log=log or (lambda m: None))


# ---- ownership -------------------------------------------------------------------------

def test_directories_spmdkit_did_not_write_are_left_alone(tmp_path):
    ck = tmp_path / "ck"
    for name in ("1", "2", "5", "1000"):
        (ck / name).mkdir(parents=True)
        (ck / name / "mine.txt").write_text(name)
    messages: list[str] = []
    result = fit(ck, keep=2, log=messages.append)
    for name in ("1", "2", "5", "1000"):
        assert (ck / name / "mine.txt").read_text() == name
    assert result.summary["checkpoint_steps"] == [30, 40]
    assert any("did not write alone" in m and "1000" in m for m in messages)
    resumed = fit(ck, steps=50, keep=2, resume=True)
    assert resumed.summary["resumed_from_step"] == 40


def test_a_fresh_run_into_another_runs_directory_is_refused(tmp_path):
    ck = tmp_path / "ck"
    fit(ck)
    run_a = json.loads((ck / "spmdkit-run.json").read_text())["run_id"]
    with pytest.raises(spmdkit.CheckpointError) as e:
        fit(ck, steps=20, lr=0.01)
    msg = str(e.value)
    assert "--resume" in msg and "another --checkpoint-dir" in msg and "--overwrite-checkpoints" in msg
    b = fit(ck, steps=20, lr=0.01, overwrite=True)
    assert b.summary["checkpoint_steps"] == [10, 20]
    manifests = [json.loads((ck / "manifests" / f"{s}.json").read_text()) for s in (10, 20)]
    assert {m["run_id"] for m in manifests} == {json.loads((ck / "spmdkit-run.json").read_text())["run_id"]} != {run_a}
    assert not (ck / step_name(40)).exists()


def test_a_second_writer_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    ck = tmp_path / "ck"
    fit(ck, steps=10)
    first = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(ck), resume=True), log=lambda m: None).claim()
    t0 = time.time()
    with pytest.raises(spmdkit.CheckpointError, match=rf"another run \(pid {os.getpid()} .*is writing checkpoints"):
        fit(ck, steps=20, resume=True)
    assert time.time() - t0 < 30
    first.close()
    (ck / "spmdkit.lock").write_text(json.dumps({"pid": 2**22 + 7, "host": os.uname().nodename}))
    messages: list[str] = []
    assert fit(ck, steps=20, resume=True, log=messages.append).summary["steps"] == 20
    assert any("took over the lock of an ended run" in m for m in messages)


def test_a_second_run_into_the_same_out_is_refused_and_leaves_the_first_runs_files(tmp_path):
    from spmdkit._train._artifacts import OUT_LOCK, lock_out_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("the first run's line\n")
    first = lock_out_dir(out, log=lambda m: None)  # the first run, still writing
    with pytest.raises(spmdkit.ConfigError, match=rf"another run \(pid {os.getpid()} .*is writing to --out {out}") as e:
        fit(tmp_path / "ck", steps=10, out=out)
    assert "pass another --out" in str(e.value) and str(out / OUT_LOCK) in str(e.value)
    assert (out / "metrics.jsonl").read_text() == "the first run's line\n"
    assert not (tmp_path / "ck" / "spmdkit.lock").exists()  # nothing of the refused run stays locked
    first.release()
    assert not (out / OUT_LOCK).exists()

    # A run killed with its lock in place: the next one takes the lock over, and the lock goes with the run.
    (out / OUT_LOCK).write_text(json.dumps({"pid": 2**22 + 7, "host": os.uname().nodename}))
    messages: list[str] = []
    assert fit(tmp_path / "ck", steps=10, out=out, log=messages.append).summary["steps"] == 10
    assert any(m.startswith("out: took over the lock of an ended run (pid 4194311)") for m in messages), messages
    assert not (out / OUT_LOCK).exists() and (out / "summary.json").exists()


def test_a_refused_resume_unlocks_the_out_directory(tmp_path):
    from spmdkit._train._artifacts import OUT_LOCK

    fit(tmp_path / "ck", steps=10)
    with pytest.raises(spmdkit.CheckpointError, match="--resume"):
        fit(tmp_path / "ck", steps=10, out=tmp_path / "out")  # a fresh run into a used checkpoint directory
    assert not (tmp_path / "out" / OUT_LOCK).exists()
    assert fit(tmp_path / "ck", steps=20, out=tmp_path / "out", resume=True).summary["steps"] == 20


def test_out_may_be_the_checkpoint_directory_too(tmp_path):
    assert fit(tmp_path / "run", steps=10, out=tmp_path / "run").summary["checkpoint_steps"] == [10]
    assert fit(tmp_path / "run", steps=20, out=tmp_path / "run", resume=True).summary["steps"] == 20


# ---- integrity -----------------------------------------------------------------------

def largest_file(ck, step) -> Path:
    return max((p for p in (ck / step_name(step)).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["bytes", "chunk-bytes", "truncate", "delete", "manifest-garbage", "manifest-empty",
                                    "manifest-cut", "metadata", "orbax-metadata", "no-manifest"])
def test_any_damage_falls_back_to_the_newest_intact_step(tmp_path, damage):
    ck = tmp_path / "ck"
    fit(ck, steps=20)
    manifest = ck / "manifests" / "20.json"
    victim = largest_file(ck, 20)
    if damage == "chunk-bytes":  # an array's bytes: found as the restore reads them
        victim = next(p for p in sorted((ck / step_name(20)).rglob("*"))
                      if p.is_file() and is_chunk_file(str(p.relative_to(ck / step_name(20)))))
    if damage in ("bytes", "chunk-bytes"):  # same size, changed content: only a checksum sees it
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif damage == "delete":
        victim.unlink()
    elif damage == "manifest-garbage":
        manifest.write_bytes(os.urandom(64))
    elif damage == "manifest-empty":
        manifest.write_text("")
    elif damage == "manifest-cut":
        manifest.write_text(manifest.read_text()[:40])
    elif damage == "orbax-metadata":  # valid JSON, not Orbax's layout: Orbax itself raised on opening
        (ck / step_name(20) / "_CHECKPOINT_METADATA").write_text("[1, 2]")
    elif damage == "no-manifest":  # a kill after Orbax's commit, before the checksums: nothing vouches
        manifest.unlink()
    else:
        (ck / step_name(20) / "meta" / "metadata").write_text("{not json")
    messages: list[str] = []
    state, meta = reader(ck, messages.append).restore_latest(target())
    assert meta["step"] == 10 and int(state.step) == 10
    assert any("step 20" in m and "falling back" in m for m in messages), messages
    assert not any("checkpoint step 20" in m for m in messages), messages  # the step named once per line
    # A reader moves nothing: to it a step without its manifest may be a save still in flight.
    assert any("restored step 10" in m and "[20] left in place" in m for m in messages), messages
    assert (ck / step_name(20)).exists()


def test_a_resumed_run_sets_a_damaged_step_aside_and_a_reader_does_not(tmp_path):
    ck = tmp_path / "ck"
    fit(ck, steps=20)
    (ck / "manifests" / "20.json").unlink()  # a kill after Orbax's commit: as a save in flight looks
    reader(ck).restore_latest(target())
    assert (ck / step_name(20)).exists()
    messages: list[str] = []
    assert fit(ck, steps=30, resume=True, log=messages.append).summary["resumed_from_step"] == 10
    assert any("resuming from step 10" in m and "set aside" in m for m in messages), messages
    assert [p.name.rsplit("-", 1)[0] for p in ck.glob("damaged-*")] == [f"damaged-{step_name(20)}"]


def test_checkpoints_lists_a_step_set_aside_without_counting_it(tmp_path, capsys):
    # spmdkit checkpoints did not list it: a user missing step 20 was not told where it went.
    ck = tmp_path / "ck"
    fit(ck, steps=20)
    (ck / "manifests" / "20.json").unlink()
    fit(ck, steps=30, resume=True)
    assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], bool(r.get("set_aside"))) for r in rows][-2:] == [(20, True), (30, False)]
    aside = next(ck.glob("damaged-*")).name
    assert rows[-2]["status"] == (f"set aside as damaged by a resume ({aside}: kept to inspect, never restored; "
                                 "delete it when done)") and rows[-2]["bytes"] > 0
    assert cli_main(["checkpoints", str(ck)]) == 0
    assert "set aside" in capsys.readouterr().out


def test_a_reader_whose_steps_the_writer_deletes_reads_the_newer_ones(tmp_path, monkeypatch):
    # A sidecar polling a live run: the writer's retention deleted every step the reader had
    # listed, and saved a newer one meanwhile. The reader called them all damaged and gave up.
    ck = tmp_path / "ck"
    fit(ck, steps=30, keep=3)
    later = tmp_path / "later"
    shutil.move(ck / step_name(30), later)  # not yet saved when the reader lists the steps
    shutil.move(ck / "manifests" / "30.json", tmp_path / "30.json")
    problems = spmdkit.Checkpointer.problems

    def retention_meanwhile(self, step, arrays=True):
        if step in (10, 20):  # deleted as the reader looks at it; the newer step committed
            shutil.rmtree(ck / step_name(step), ignore_errors=True)
            if later.exists():
                shutil.move(tmp_path / "30.json", ck / "manifests" / "30.json")
                shutil.move(later, ck / step_name(30))
        return problems(self, step, arrays=arrays)

    monkeypatch.setattr(spmdkit.Checkpointer, "problems", retention_meanwhile)
    messages: list[str] = []
    state, meta = reader(ck, messages.append).restore_latest(target())
    assert meta["step"] == 30 and int(state.step) == 30
    assert any("step 20 was deleted while being read" in m for m in messages), messages
    assert not any("damaged" in m for m in messages), messages


@pytest.mark.parametrize("when", ["listing its files", "after its checks"])
def test_a_step_deleted_in_the_middle_of_a_read_is_gone_not_a_raw_error(tmp_path, monkeypatch, when):
    # A sidecar reading a live run with --keep 1: the writer renamed the step away while the reader
    # listed its files (a raw FileNotFoundError) or after its checks (TypeError: 'NoneType' object is
    # not subscriptable, the manifest gone); both escaped restore_latest.
    from spmdkit import _checkpoint

    ck = tmp_path / "ck"
    fit(ck, steps=30, keep=3)

    def writer_deletes(step):
        os.replace(ck / step_name(step), ck / f"{step_name(step)}.orbax-checkpoint-tmp-deleting")
        (ck / "manifests" / f"{step}.json").unlink()

    if when == "listing its files":
        files = _checkpoint._files

        def listing(step_dir):
            if step_dir.name == step_name(30):
                writer_deletes(30)
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(step_dir / "state"))
            return files(step_dir)

        monkeypatch.setattr(_checkpoint, "_files", listing)
    else:
        impls = _checkpoint._check_key_impls

        def checked(step, *a):  # restore's last look before it reads the manifest
            if step == 30:
                writer_deletes(30)
            return impls(step, *a)

        monkeypatch.setattr(_checkpoint, "_check_key_impls", checked)
    messages: list[str] = []
    state, meta = reader(ck, messages.append).restore_latest(target())
    assert meta["step"] == 20 and int(state.step) == 20
    assert any("step 30 was deleted while being read" in m for m in messages), messages
    assert not any("damaged" in m for m in messages), messages


def test_a_reader_says_a_step_without_its_manifest_may_be_in_flight(tmp_path):
    ck = tmp_path / "ck"
    fit(ck, steps=20)
    (ck / "manifests" / "20.json").unlink()
    messages: list[str] = []
    reader(ck, messages.append).restore_latest(target())
    assert any("step 20 is not complete yet, or damaged (it has no manifest" in m for m in messages), messages


def test_checkpoints_beside_a_live_run_skip_steps_that_go_while_listed(tmp_path, capsys, monkeypatch):
    # spmdkit checkpoints --verify beside a run saving every step with --keep 1: a step deleted (or a
    # save's temporary directory committed) between the listing and the reading of its files was a
    # FileNotFoundError traceback, exit 1.
    from spmdkit import _checkpoint

    ck = tmp_path / "ck"
    fit(ck, steps=30, keep=3)
    (ck / f"{step_name(40)}.orbax-checkpoint-tmp").mkdir()
    files = _checkpoint._files

    def writer_meanwhile(step_dir):
        if step_dir.name in (step_name(10), f"{step_name(40)}.orbax-checkpoint-tmp"):
            shutil.rmtree(step_dir)  # retention; a save committing renames its temporary directory away
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(step_dir / "state"))
        return files(step_dir)

    monkeypatch.setattr(_checkpoint, "_files", writer_meanwhile)
    assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [20, 30]


def test_checkpoints_verify_finds_changed_bytes(tmp_path, capsys):
    ck = tmp_path / "ck"
    fit(ck, steps=20)
    assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 0
    assert all(r["status"] == "complete, verified" for r in json.loads(capsys.readouterr().out))
    victim = largest_file(ck, 10)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 6
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["status"].startswith("damaged") and "checksum differs" in rows[0]["status"]


def test_checkpoints_verify_counts_an_incomplete_step_as_one_a_restore_refuses(tmp_path, capsys):
    ck = tmp_path / "ck"
    fit(ck, steps=20)
    (ck / "manifests" / "20.json").unlink()  # a kill between Orbax's commit and the manifest
    assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 6
    rows = {r["step"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert rows[20].startswith("incomplete") and rows[10] == "complete, verified"
    assert cli_main(["checkpoints", str(ck), "--json"]) == 0  # listing alone never fails


def test_checkpoints_verify_beside_a_live_run_does_not_count_the_step_it_is_saving(tmp_path, capsys):
    # A sidecar running --verify while a run saved exited 6 at every save: the newest step has no
    # manifest until the run has checksummed its files. Only that step of a run holding the lock
    # now is spared; the lock is another process's (a real flock), as a run's is.
    from spmdkit._lockfile import held_now

    ck = tmp_path / "ck"
    fit(ck, steps=30, keep=3)
    (ck / "manifests" / "30.json").unlink()  # the newest step, as in the middle of its save
    lock = ck / "spmdkit.lock"
    lock.write_text("")
    assert held_now(lock) is False
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(lock)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert held_now(lock) is True
        assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 0
        rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows[30]["status"].startswith("being saved (the run holding spmdkit.lock") and rows[30]["in_flight"]
        (ck / "manifests" / "20.json").unlink()  # not the step being saved: incomplete, as without a run
        assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 6
        rows = {r["step"]: r["status"] for r in json.loads(capsys.readouterr().out)}
        assert rows[20].startswith("incomplete (no manifest") and rows[30].startswith("being saved")
    finally:
        holder.kill()
        holder.wait()
    assert held_now(lock) is False  # the lock went with its process: the same step now counts
    assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 6
    rows = {r["step"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert rows[30].startswith("incomplete (no manifest")


def test_checkpoints_verify_lists_an_interrupted_saves_temporary_directory_without_failing(tmp_path, capsys):
    # It exited 6 as if a step were damaged: a script checking the directory after a crash mid-save
    # saw a failure though every step was intact (nothing restores a temporary directory).
    ck = tmp_path / "ck"
    fit(ck, steps=20)
    (ck / "spmdkit_30.orbax-checkpoint-tmp-1234").mkdir()
    assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[30]["status"].startswith("incomplete (an interrupted save") and rows[30]["temporary"]
    assert rows[10]["status"] == rows[20]["status"] == "complete, verified"
    (ck / "spmdkit_10").rename(ck / "spmdkit_10.orbax-checkpoint-tmp-deleting")  # keep's deletion cut short
    (ck / "manifests" / "10.json").unlink()
    assert cli_main(["checkpoints", str(ck), "--verify", "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[10]["status"] == "incomplete (the deletion of an old step (keep) cut short; removed on the next start)"


# ---- never a non-finite state; params and summary agree ------------------------------

@pytest.mark.parametrize("end", ["mid-run", "at-the-last-step"])
def test_a_diverging_run_saves_and_reports_only_known_good_states(tmp_path, end):
    ck, out = tmp_path / "ck", tmp_path / "out"
    with pytest.raises(spmdkit.NonFiniteLossError) as e:
        fit(ck, steps=50, every=1, keep=50, lr=1e6, out=out)
    if end == "at-the-last-step":
        # Every loss of this run is finite, but the one its last state would give is not.
        bad_loss_at = e.value.step
        ck, out = tmp_path / "ck2", tmp_path / "out2"
        with pytest.raises(spmdkit.NonFiniteLossError) as e:
            fit(ck, steps=bad_loss_at - 1, every=1, keep=50, lr=1e6, out=out)
        assert e.value.step == bad_loss_at
    summary = json.loads((out / "summary.json").read_text())
    # The loss reported at step k is computed from the state after k - 1 updates: the loss of
    # step e.step came from a bad state, so the newest known-good state is 2 updates back.
    assert summary["status"] == "diverged" and summary["steps"] == e.value.step - 2
    newest = max(reader(ck).steps())
    assert newest == summary["steps"]
    state, _ = reader(ck).restore(newest, target())
    task = linreg.make()
    loss, _ = task.loss_fn(state.params, task.train_data, None)
    assert np.isfinite(float(loss)), "the newest checkpoint holds a state whose loss is not finite"
    saved = spmdkit.load_params(out / "params.npz", like=jax.device_get(state.params))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(a, b)


# ---- full and read-only disks --------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs (None where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                        timeout=10).returncode == 0 if os.geteuid() == 0 else False
    yield mnt if ok else None
    if ok:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def fill(mnt: Path) -> None:
    with open(mnt / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_full_disk_ends_the_run_with_an_error_and_keeps_the_last_good_step(tmp_path, small_fs, monkeypatch):
    ck = (small_fs or tmp_path) / "ck"
    fit(ck, steps=10, every=5)
    if small_fs is not None:
        fill(small_fs)
        filler = small_fs / "filler"
        os.truncate(filler, filler.stat().st_size - 8192)  # room for the lock, not for a step
    else:  # no tmpfs here: the same failure, injected where Orbax starts a save
        import orbax.checkpoint as ocp

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    out = tmp_path / "out"
    t0 = time.time()
    with pytest.raises(CheckpointSaveError) as e:
        fit(ck, steps=30, every=5, resume=True, out=out)
    assert time.time() - t0 < 60
    assert "No space left on device" in str(e.value) and str(ck) in str(e.value)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "No space left" in summary["error"]
    assert (out / "params.npz").exists()
    (ck.parent / "filler").unlink(missing_ok=True)
    monkeypatch.undo()
    r = reader(ck)
    assert 10 in r.steps() and r.problems(10) == []
    assert int(r.restore(10, target())[0].step) == 10


def test_a_full_disk_under_checkpoints_and_out_reports_the_failed_save(tmp_path, small_fs, monkeypatch):
    # Both on one disk: writing --out's params.npz failed too, and that error (naming --out, not the
    # checkpoint step that failed nor the steps intact) was the one raised.
    disk = small_fs or tmp_path
    ck, out = disk / "ck", disk / "out"
    fit(ck, steps=10, every=5)
    import orbax.checkpoint as ocp

    from spmdkit._train import _artifacts

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    def out_full(path, *a, **k):
        raise _artifacts.ArtifactError(f"cannot write {path}: No space left on device (errno 28).")

    monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    monkeypatch.setattr(_artifacts, "save_params", out_full)
    messages: list[str] = []
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint step 15 .*Earlier steps with all their files: \[5, 10\]"):
        fit(ck, steps=30, every=5, resume=True, out=out, log=messages.append)
    assert any(m.startswith(f"linreg: cannot write {out / 'params.npz'}: No space left on device") and
               "the run had already failed" in m for m in messages), messages


def test_a_read_only_directory_is_an_error_within_seconds(tmp_path, small_fs, monkeypatch):
    ck = (small_fs or tmp_path) / "ck"
    fit(ck, steps=10, every=5)
    if small_fs is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True, timeout=10)
    else:
        real_open = os.open

        def read_only(path, flags, *a, **k):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and str(ck) in str(path):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real_open(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", read_only)
    t0 = time.time()
    with pytest.raises(CheckpointSaveError, match="Read-only file system"):
        fit(ck, steps=20, every=5, resume=True)
    assert time.time() - t0 < 30


def test_a_directory_turned_read_only_mid_run_ends_with_no_traceback(tmp_path, small_fs, monkeypatch):
    ck = (small_fs or tmp_path) / "ck"
    messages: list[str] = []
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(ck)), log=messages.append).claim()
    ckpt.save(1, {"w": jnp.ones(3)}, {})
    ckpt.close()
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(ck), resume=True), log=messages.append).claim()
    if small_fs is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True, timeout=10)
    else:
        real_unlink = Path.unlink

        def read_only(self, *a, **k):
            if self.name == "spmdkit.lock":
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return real_unlink(self, *a, **k)

        monkeypatch.setattr(Path, "unlink", read_only)
    ckpt.close()  # the lock cannot be removed: said, not raised (a dead pid's lock is taken over)
    assert any("could not remove" in m and "Read-only file system" in m for m in messages), messages


@pytest.mark.parametrize("waiter", ["orbax", "user"])
def test_after_a_failed_save_only_orbax_threads_are_not_waited_for_at_exit(waiter):
    # Orbax's signalling threads of a save that failed in the background wait up to 20 min.
    code = textwrap.dedent(f"""
        import threading, time
        from spmdkit._checkpoint import _no_hang_at_exit
        class Waiter(threading.Thread):
            pass
        Waiter.__module__ = {'orbax.checkpoint._src.futures.future' if waiter == 'orbax' else '__main__'!r}
        Waiter(target=time.sleep, args=({300 if waiter == 'orbax' else 4},)).start()
        _no_hang_at_exit(5)
        print("main done", flush=True)
    """)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env())
    assert "main done" in out.stdout and time.time() - t0 < 60, out.stderr
    # Orbax's waiter: ended with the failed save's exit code; a user's thread: waited for, exit 0.
    assert out.returncode == (5 if waiter == "orbax" else 0), out.stderr


# ---- bad input -----------------------------------------------------------------------

def bad_task(**kw):
    base = dict(name="t", init=lambda rng: {"w": jnp.zeros(3)},
                loss_fn=lambda p, b, rng: (jnp.mean(b["x"] @ p["w"]), {}),
                train_data={"x": np.ones((16, 3), np.float32)})
    return spmdkit.Task(**{**base, **kw})


@pytest.mark.parametrize("kw, message", [
    (dict(loss_fn=lambda p, b, rng: (b["x"] @ p["w"], {})), "loss has shape (8,)"),
    (dict(loss_fn=lambda p, b, rng: jnp.mean(b["x"] @ p["w"])), "returned a bare array of shape ()"),
    (dict(loss_fn=lambda p, b, rng: [jnp.mean(b["x"] @ p["w"]), {}]), "returned a list of 2"),
    (dict(init=lambda rng: {"w": jnp.zeros(3, jnp.int32)}), "params['w'] of dtype int32"),
    (dict(init=lambda rng: None), "returned None, which holds no arrays"),
    (dict(train_data={"x": np.array(["a"] * 16)}), "train_data['x'] has dtype <U1 (strings)"),
])
def test_a_task_that_cannot_train_is_named_before_tracing(kw, message):
    with pytest.raises(TaskError) as e:
        validate_task(bad_task(**kw), 8)
    assert message in str(e.value) and "Fix:" in str(e.value)
    assert isinstance(e.value, (spmdkit.SpmdkitError, TypeError))


def test_params_files_str_paths_and_pickled_arrays(tmp_path):
    path = str(tmp_path / "p.npz")
    spmdkit.save_params(path, {"w": np.ones(2)})
    assert spmdkit.load_params(path)["['w']"].tolist() == [1.0, 1.0]
    np.savez(tmp_path / "obj.npz", w=np.array([{"a": 1}], dtype=object))
    with pytest.raises(spmdkit.DataError, match="object arrays"):
        spmdkit.load_params(tmp_path / "obj.npz")


@pytest.mark.parametrize("args, message", [
    (["--out", "FILE"], "is a file, not a directory"),
    (["--out", "FILE/sub"], "cannot write"),
    (["--checkpoint-dir", "FILE"], "cannot be created"),
    (["--coordinator", "notaport", "--num-processes", "2", "--process-id", "0"], "is not HOST:PORT"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "5"], "ids run from 0 to 1"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--resume", "--checkpoint-every", "5"], "--checkpoint-every, --resume need --checkpoint-dir"),
])
def test_cli_mistakes_are_clear_errors_with_exit_code_2(tmp_path, capsys, args, message):
    (tmp_path / "FILE").write_text("x")
    args = [a.replace("FILE", str(tmp_path / "FILE")) for a in args]
    code = cli_main(["train", "--task", "linreg", "--steps", "2", "--no-progress", *args])
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert (code, message in err, "Traceback" in err) == (2, True, False), err


@pytest.mark.parametrize("what, why", [
    ("missing", "No such file or directory"),
    # A directory and a script without the execute bit were both "Permission denied".
    ("directory", "it is a directory, not a program"),
    ("script", "the file is not executable (run a script as: python "),
    # Looked up on PATH, not in the working directory, which holds a directory of that name.
    ("name of a directory here", "No such file or directory"),
])
def test_launch_of_a_command_that_cannot_start_says_why(tmp_path, what, why):
    program = {"missing": "/no/such/command", "directory": str(tmp_path), "script": str(tmp_path / "train.py"),
               "name of a directory here": "spmdkit-no-such-tool"}[what]
    if what == "script":
        (tmp_path / "train.py").write_text("print('ran')\n")
    (tmp_path / "spmdkit-no-such-tool").mkdir()
    out = subprocess.run([*CLI, "launch", "-n", "2", "--", program], capture_output=True, text=True,
                         timeout=60, env=env(), cwd=tmp_path)
    err = " ".join(out.stderr.split())
    assert out.returncode == 2 and f"cannot start '{program}': {why}" in err, err
    assert "Traceback" not in out.stderr


# ---- processes: kills, launcher death, SIGTERM, restarts -----------------------------

def train_args(ck, out, steps, *extra):
    return [*CLI, "train", "--task", "linreg", "--host-devices", "2", "--steps", str(steps), "--checkpoint-dir",
            str(ck), "--checkpoint-every", "25", "--out", str(out), "--no-progress", *extra]


def params_of(out):
    with np.load(out / "params.npz") as f:
        return {k: f[k] for k in f.files}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def straight_linreg(steps):
    """The same run in this process, never stopped (2 devices, the task's defaults)."""
    mesh = spmdkit.make_mesh(data=2, devices=jax.devices()[:2])
    task = linreg.make()
    result = spmdkit.fit(task, spmdkit.DataParallel(mesh), optax.sgd(0.005), spmdkit.TrainConfig(steps=steps, batch_size=128),
                         progress=False, log=lambda m: None)
    return {k: np.asarray(v) for k, v in spmdkit._train._artifacts.flat_params(result.params).items()}


def newest(ck):
    return max((parse_step(p.name) or 0 for p in ck.iterdir()), default=0) if ck.exists() else 0


def _fit_killed_at(tmp_path, steps, resume, where, nth=1):
    """``fit`` of linreg in a child process that SIGKILLs itself at the ``nth`` call of ``where``
    (a function of ``spmdkit._train._artifacts``, or ``MetricsWriter.write``), as a kill fuzzer did."""
    code = textwrap.dedent(f"""
        import os, signal, optax, spmdkit
        from spmdkit._tasks import linreg
        from spmdkit._train import _artifacts
        owner, name = ({where!r}.split(".") + [None])[:2] if "." in {where!r} else ("", {where!r})
        holder = getattr(_artifacts, owner) if owner else _artifacts
        name = name or {where!r}
        real, calls = getattr(holder, name), []
        def killed(*args, **kw):
            calls.append(1)
            if len(calls) == {nth}:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kw)
        setattr(holder, name, killed)
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps={steps}, batch_size=16),
                    progress=False, out_dir={str(tmp_path / "out")!r}, log=lambda m: None,
                    checkpoint=spmdkit.CheckpointConfig({str(tmp_path / "ck")!r}, every=3, resume={resume}))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env())
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]


def _fit_linreg_out(tmp_path, steps, resume, log=None):
    return spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=steps, batch_size=16),
                       progress=False, out_dir=tmp_path / "out", log=log or (lambda m: None),
                       checkpoint=spmdkit.CheckpointConfig(tmp_path / "ck", every=3, resume=resume))


def _train_steps(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["split"] == "train"]


def test_a_resume_killed_while_it_rewrites_the_kept_metrics_loses_none_of_them(tmp_path):
    _fit_linreg_out(tmp_path, 6, False)
    # Killed at the resume's second row: the file was truncated and the kept rows written back one
    # by one, so a kill there left step 1 alone, and the next resume kept only that.
    _fit_killed_at(tmp_path, 9, True, "MetricsWriter.write", nth=2)
    assert _train_steps(tmp_path / "out")[:6] == [1, 2, 3, 4, 5, 6]
    _fit_linreg_out(tmp_path, 9, True)
    assert _train_steps(tmp_path / "out") == list(range(1, 10))


@pytest.mark.parametrize("where", ["plot_history", "params"])
def test_a_complete_run_whose_files_were_not_all_written_gets_them_at_the_resume(tmp_path, monkeypatch, where):
    from spmdkit._train import _artifacts

    (tmp_path / "ref").mkdir()
    reference = _fit_linreg_out(tmp_path / "ref", 6, False)
    if where == "plot_history":  # killed while plotting, after params.npz (and, before, the summary)
        _fit_killed_at(tmp_path, 6, False, "plot_history")
    else:  # params.npz refused by a full disk: the summary says failed
        def full(path, params):
            raise _artifacts._cannot_write(path, OSError(errno.ENOSPC, "No space left on device"))
        monkeypatch.setattr(_artifacts, "save_params", full)
        with pytest.raises(spmdkit.ArtifactError):
            _fit_linreg_out(tmp_path, 6, False)
        monkeypatch.undo()
    out = tmp_path / "out"
    assert not (out / ("loss.png" if where == "plot_history" else "params.npz")).exists()
    said = []
    again = _fit_linreg_out(tmp_path, 6, True, log=said.append)
    # Both were "already complete at step 6; ... left as it was": no plot, or no params.npz, for good.
    assert not any("already complete" in m for m in said), said
    assert (out / "loss.png").stat().st_size and (out / "params.npz").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == again.summary["status"] == "completed"
    assert summary["params_digest"] == reference.summary["params_digest"]
    assert summary["final_train_loss"] == reference.summary["final_train_loss"] is not None
    assert _train_steps(out) == list(range(1, 7))
    with np.load(out / "params.npz") as f:
        np.testing.assert_array_equal(f["['weight']"], np.asarray(reference.params["weight"]))


def test_killed_during_save_and_restore_then_sigterm_resumes_bit_equal(tmp_path, procs):
    ck, out, total = tmp_path / "ck", tmp_path / "o", 1000
    rng = random.Random(1)
    deadline = time.time() + 240
    p = spawn(procs, train_args(ck, out, total))
    # Past step 25 and with one step's manifest written, so an intact step exists before the kills.
    while (newest(ck) < 25 or not any((ck / "manifests").glob("*.json"))) and p.poll() is None \
            and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.3))  # saves take most of each step's time here: mostly mid-save
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    # Killed again while it restores (start-up, verification, Orbax's read).
    p = spawn(procs, train_args(ck, out, total, "--resume"))
    time.sleep(rng.uniform(1.0, 3.0))
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    r = reader(ck)
    # A kill between Orbax's commit and the manifest leaves a step a resume skips; nothing else.
    assert any(r.problems(s) == [] for s in r.steps())
    assert all(r.problems(s) == [] or "no manifest" in r.problems(s)[0] for s in r.steps())
    # A preemption notice: save at the next step boundary, exit 0, status "preempted".
    p = spawn(procs, train_args(ck, out, total, "--resume"))
    start = newest(ck)
    while newest(ck) <= start and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, "the run ended before the preemption notice; raise total"
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    summary = json.loads((out / "summary.json").read_text())
    assert p.returncode == 0 and summary["status"] == "preempted", stderr[-2000:]
    assert summary["steps"] < total and newest(ck) == summary["steps"] and time.time() - t0 < 60
    final = subprocess.run(train_args(ck, out, total, "--resume"), capture_output=True, text=True, timeout=300,
                           env=env())
    assert final.returncode == 0, final.stderr
    assert f"resumed from step {summary['steps']}" in final.stdout
    assert_same(params_of(out), straight_linreg(total))


def test_children_die_with_a_killed_launcher(tmp_path, procs):
    pids = tmp_path / "pids"
    code = f"import os, time; open({str(pids)!r} + os.environ['SPMDKIT_PROCESS_ID'], 'w').write(str(os.getpid())); time.sleep(300)"
    for sig in (signal.SIGKILL, signal.SIGTERM):
        launcher = spawn(procs, [*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code])
        deadline = time.time() + 60
        while not all(Path(f"{pids}{i}").exists() for i in (0, 1)) and time.time() < deadline:
            time.sleep(0.05)
        children = [int(Path(f"{pids}{i}").read_text()) for i in (0, 1)]
        os.kill(launcher.pid, sig)
        launcher.wait(timeout=60)
        end = time.time() + 15
        while any(alive(c) for c in children) and time.time() < end:
            time.sleep(0.05)
        assert not any(alive(c) for c in children), f"orphans after {sig.name} to the launcher"
        if sig == signal.SIGTERM:
            assert launcher.returncode == 128 + signal.SIGTERM
        for i in (0, 1):
            Path(f"{pids}{i}").unlink()


def test_a_refusal_on_process_0_ends_every_process_at_once(tmp_path, procs):
    # Only process 0 takes the lock: the others learn its verdict instead of waiting for it.
    ck = tmp_path / "ck"
    ck.mkdir()
    from spmdkit._lockfile import DirLock

    held = DirLock(ck / "spmdkit.lock", lambda m: None, "checkpoints")  # another run, alive: this test
    held.take("other", lambda other: AssertionError(other))
    p = spawn(procs, [*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--", *CLI, "train", "--task",
                      "linreg", "--steps", "5", "--checkpoint-dir", str(ck), "--resume", "--out", str(tmp_path / "o"),
                      "--no-progress", "--distributed-timeout", "100"])
    stdout, stderr = p.communicate(timeout=150)  # before the fix: a hang until the heartbeat (330 s)
    text = stdout + stderr
    assert p.returncode == 2, text[-3000:]
    assert "[0] error: another run" in text and "[1] error: another run" in text, text[-3000:]
    held.release()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_launch_restarts_every_process_from_the_last_good_checkpoint(tmp_path, procs):
    ck, out, marker = tmp_path / "ck", tmp_path / "o", tmp_path / f"killed-{uuid.uuid4().hex[:6]}"
    train = (f"{sys.executable} -m spmdkit._cli train --task linreg --steps 400 --checkpoint-dir {ck} "
             f"--checkpoint-every 50 --out {out} --no-progress")
    script = (f'if [ "$SPMDKIT_PROCESS_ID" = 1 ] && [ ! -e {marker} ]; then '
              f'(while [ ! -d {ck}/{step_name(100)} ]; do sleep 0.1; done; touch {marker}; kill -9 $$) & fi; '
              f'exec {train} "$@"')
    launcher = spawn(procs, [*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--max-restarts", "2",
                             "--", "sh", "-c", script, "sh"])
    stdout, stderr = launcher.communicate(timeout=400)
    assert launcher.returncode == 0, stderr[-3000:]
    assert marker.exists() and "restart 1/2 of all 2 processes" in stderr
    assert "resumed from step" in stdout
    a, b = params_of(out), straight_linreg(400)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6)


_SLOW_PROCESS_1 = """
import importlib.abc, importlib.util, os, sys, time
if os.environ.get("SPMDKIT_PROCESS_ID") == "1":
    class Hook(importlib.abc.MetaPathFinder):  # once spmdkit._checkpoint is loaded, slow its resume down
        def find_spec(self, name, path, target=None):
            if name != "spmdkit._train._loop":
                return None
            sys.meta_path.remove(self)
            from spmdkit import _checkpoint as c
            restore_latest = c.Checkpointer.restore_latest
            def slow(self, *a, **k):
                time.sleep(3)  # a slow host or file system: process 0 has set the damaged step aside
                return restore_latest(self, *a, **k)
            c.Checkpointer.restore_latest = slow
            return importlib.util.find_spec(name)
    sys.meta_path.insert(0, Hook())
"""


def test_processes_that_list_a_damaged_step_at_different_times_resume_together(tmp_path, procs):
    """Process 0 set a damaged step aside before process 1 listed the directory: process 1
    resumed without seeing it, skipped the exchange on it and waited in the first step while
    process 0 waited in that exchange, until the step watchdog ended the job (exit 4)."""
    ck, out, site = tmp_path / "ck", tmp_path / "o", tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_PROCESS_1)
    train = [*CLI, "train", "--task", "linreg", "--checkpoint-dir", str(ck), "--checkpoint-every", "25",
             "--out", str(out), "--no-progress", "--distributed-timeout", "60"]
    launch = [*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--"]
    first = spawn(procs, [*launch, *train, "--steps", "50"])
    assert first.communicate(timeout=300)[0] is not None and first.returncode == 0
    (ck / "manifests" / "50.json").unlink()  # a kill after Orbax's commit
    resumed = spawn(procs, [*launch, *train, "--steps", "75", "--resume"],
                    env={**env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))})
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, (stdout + stderr)[-3000:]
    assert "[0] checkpoints: resuming from step 25" in stdout and "[1] checkpoints: resumed from step 25" in stdout, stdout
    assert [p.name.rsplit("-", 1)[0] for p in ck.glob("damaged-*")] == [f"damaged-{step_name(50)}"]


@pytest.mark.skipif(shutil.which("ss") is None or shutil.which("pgrep") is None,
                    reason="reads the listening sockets with ss (iproute2) and the children with pgrep (procps)")
def test_a_local_coordinator_listens_on_loopback_only(tmp_path, procs):
    # The children wait long enough for a stalled machine's ss and /proc reads; procs kills them.
    code = ("import spmdkit, jax, time; spmdkit.use_host_devices(1); "
            "from spmdkit._launch import initialize_distributed; initialize_distributed(); "
            "print(jax.process_count(), flush=True); time.sleep(120)")
    launcher = spawn(procs, [*CLI, "launch", "-n", "2", "--", sys.executable, "-c", code])
    line = launcher.stdout.readline()
    assert "2" in line, launcher.stderr.read() if launcher.poll() is not None else line
    port = None
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10).stdout
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    for c in children:
        text = Path(f"/proc/{c}/environ").read_bytes().split(b"\0")
        port = next((v.split(b":")[-1].decode() for v in text if v.startswith(b"SPMDKIT_COORDINATOR=")), port)
    assert port is not None
    binds = [row.split()[3] for row in listening.splitlines() if row.split()[3].endswith(f":{port}")]
    assert binds and all(b.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for b in binds), binds


def test_data_write_past_a_file_size_limit_names_the_likely_limit(tmp_path):
    # numpy's short write carries no errno: the message said "(errno None)" and nothing of why.
    import resource

    np.savez(tmp_path / "in.npz", x=np.zeros((20000, 64), np.float32))
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2 ** 20, 2 ** 20))  # noqa: E731
    out = subprocess.run([*CLI, "data", "write", "--npz", str(tmp_path / "in.npz"), str(tmp_path / "ds")],
                         capture_output=True, text=True, timeout=120, env=env(), preexec_fn=limit)
    err = " ".join(out.stderr.split())
    assert out.returncode == 5, err
    assert "a short write, as a file size limit (ulimit -f) or a full disk gives" in err and "errno None" not in err


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_out_on_a_read_only_or_full_disk_is_an_io_error(tmp_path, small_fs, monkeypatch, capsys, how):
    out = (small_fs or tmp_path) / "out"
    if small_fs is not None and how == "full":
        fill(small_fs)
    elif small_fs is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True, timeout=10)
    else:  # no tmpfs here: the same failure, injected
        code = errno.EROFS if how == "read-only" else errno.ENOSPC

        def refuse(self, *a, **k):
            raise OSError(code, os.strerror(code), str(self))

        monkeypatch.setattr(Path, "write_text", refuse)
    assert cli_main(["train", "--task", "linreg", "--steps", "2", "--no-progress", "--out", str(out)]) == 5
    err = " ".join(capsys.readouterr().err.split())
    assert "cannot write" in err and ("Read-only" in err or "No space left" in err) and "Traceback" not in err


def test_a_checkpoint_dir_to_make_on_a_read_only_disk_is_an_io_error(tmp_path, small_fs, monkeypatch, capsys):
    # It exited 2, bad input, where --out on the same disk exits 5 (README, exit codes).
    ck = (small_fs or tmp_path) / "new" / "ck"
    if small_fs is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True, timeout=10)
    else:  # no tmpfs here: the same failure, injected
        real_mkdir = Path.mkdir

        def refuse(self, *a, **k):
            if str(self).startswith(str(tmp_path / "new")):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return real_mkdir(self, *a, **k)

        monkeypatch.setattr(Path, "mkdir", refuse)
    code = cli_main(["train", "--task", "linreg", "--steps", "2", "--no-progress", "--checkpoint-dir", str(ck),
                     "--out", str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 5 and f"checkpoint directory {ck} cannot be created: Read-only file system" in err, err
    assert "Traceback" not in err


def test_sigterm_to_the_launcher_is_a_preemption_notice_for_every_process(tmp_path, procs):
    ck, out = tmp_path / "ck", tmp_path / "o"
    launcher = spawn(procs, [*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--", *CLI, "train",
                             "--task", "linreg", "--steps", "100000", "--checkpoint-dir", str(ck),
                             "--checkpoint-every", "100", "--out", str(out), "--no-progress"])
    deadline = time.time() + 180
    while newest(ck) < 100 and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    # JAX's preemption service agreed on one step: both processes saved it together.
    assert summary["status"] == "preempted" and newest(ck) == summary["steps"] > 100
    assert reader(ck).problems(summary["steps"]) == []


def _launched_process(launcher_pid: int, index: int) -> int | None:
    """The pid of process ``index`` that ``spmdkit launch`` (``launcher_pid``) started, or None yet."""
    marks = {f"SPMDKIT_LAUNCHER_PID={launcher_pid}".encode(), f"SPMDKIT_PROCESS_ID={index}".encode()}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marks <= set(f.read().split(b"\0")):
                    return int(entry)
        except (OSError, ValueError):
            continue
    return None


@pytest.mark.parametrize("index", [1, 0])
def test_ctrl_c_to_one_process_of_two_stops_both_at_one_step(tmp_path, procs, index):
    # A SIGINT to one process alone (kill -INT of its pid, a terminal on one host) stopped that one:
    # the other went on stepping and waited for it, it waited in its final save, both until the
    # distributed timeout (116 s, exit 4, a native crash dump). Now it is a preemption notice for all.
    ck, out = tmp_path / "ck", tmp_path / "o"
    launcher = spawn(procs, [*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--", *CLI, "train",
                             "--task", "linreg", "--steps", "100000", "--checkpoint-dir", str(ck),
                             "--checkpoint-every", "100", "--out", str(out), "--no-progress",
                             "--distributed-timeout", "300"])
    deadline = time.time() + 180
    while newest(ck) < 100 and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    pid = _launched_process(launcher.pid, index)
    assert pid is not None and launcher.poll() is None
    os.kill(pid, signal.SIGINT)
    stdout, stderr = launcher.communicate(timeout=120)  # far below the 300 s a process would wait
    assert launcher.returncode == 130, stderr[-2000:]
    assert f"[{index}] Ctrl-C: every process stops at one step agreed with the others" in stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    # Process 0 writes the summary: its own Ctrl-C is an interrupt, its peer's a preemption notice.
    assert summary["status"] == ("interrupted" if index == 0 else "preempted")
    assert newest(ck) == summary["steps"] > 100 and reader(ck).problems(summary["steps"]) == []
    assert "Traceback" not in stderr and "timed out" not in stderr + stdout


# ---- a resume must continue the same run -----------------------------------------------

def test_a_resume_that_would_not_continue_the_run_is_refused_and_says_how(tmp_path, capsys):
    ck = tmp_path / "ck"
    fit(ck, steps=20)
    with pytest.raises(spmdkit.ConfigError, match="at step 20, already past this run's 10 steps"):
        fit(ck, steps=10, resume=True)
    assert fit(ck, steps=30, resume=True).summary["resumed_from_step"] == 20  # the refusal left no lock
    cli = ["train", "--task", "linreg", "--steps", "4", "--no-progress", "--checkpoint-dir", str(tmp_path / "c2"),
           "--out", str(tmp_path / "o")]
    assert cli_main([*cli, "--lr", "0.05"]) == 0
    capsys.readouterr()
    assert cli_main([*cli[:4], "8", *cli[5:], "--lr", "0.5", "--resume"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "written with --lr 0.05, this run has --lr 0.5" in err and "another --checkpoint-dir" in err, err


def test_a_grad_accum_fix_fits_the_data():
    with pytest.raises(spmdkit.ConfigError) as e:
        spmdkit.fit(linreg.make(), spmdkit.DataParallel(), OPT, spmdkit.TrainConfig(steps=1, batch_size=128,
                                                                                   grad_accum=256), progress=False)
    assert "use grad_accum=128" in str(e.value) and "batch_size=256" not in str(e.value)


def test_processes_given_different_checkpoint_directories_are_told_at_once(tmp_path, procs):
    # A temporary directory made in each process: every process waited for the others' shards forever.
    code = textwrap.dedent(f"""
        import sys, jax, spmdkit
        spmdkit.initialize()
        d = {str(tmp_path)!r} + "/ck" + str(jax.process_index())
        try:
            spmdkit.Checkpointer(spmdkit.CheckpointConfig(d), log=lambda m: None).claim()
        except spmdkit.CheckpointError as e:
            print("refused:", str(e).splitlines()[0], flush=True)
    """)
    p = spawn(procs, [*CLI, "launch", "-n", "2", "--host-devices-per-process", "1", "--", sys.executable, "-c", code])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    for i in (0, 1):
        assert (f"[{i}] refused: the processes were given different checkpoint directories (process 0: "
                f"{tmp_path}/ck0; process 1: {tmp_path}/ck1)") in out, out + err[-2000:]


def test_runs_racing_for_a_stale_lock_never_both_hold_it(tmp_path, procs):
    # Each racer judged the old lock stale and deleted it, and a slow one could delete the lock a
    # fast one had just taken: both wrote one --out (1 try in 9). The kernel's lock admits one.
    lock = tmp_path / "spmdkit-out.lock"
    code = textwrap.dedent(f"""
        import sys, time
        from spmdkit._lockfile import DirLock
        start = float(sys.argv[1])
        time.sleep(max(0.0, start - time.time()))
        d = DirLock({str(lock)!r}, lambda m: None, "out")
        try:
            d.take("r", lambda other: RuntimeError("refused"))
        except RuntimeError:
            print("refused", flush=True)
            sys.exit(0)
        print("held", flush=True)
        time.sleep(3)
        d.release()
    """)
    for attempt in range(3):
        lock.write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename}))  # our own pid: reused
        start = time.time() + 2
        racers = [spawn(procs, [sys.executable, "-c", code, str(start)]) for _ in range(4)]
        said = [r.communicate(timeout=60)[0].strip() for r in racers]
        assert sorted(said) == ["held", "refused", "refused", "refused"], said
        assert not lock.exists()


def test_a_kill_between_rows_resumes_with_the_rows_of_an_uninterrupted_run(tmp_path):
    # --log-every 4, checkpoints every 5, killed at step 13: the resume from step 10 wrote a row 12 of
    # steps 11-12 alone; the checkpoint's meta now keeps the metrics of steps 9-10 for it.
    code = textwrap.dedent(f"""
        import os, signal, time, optax, spmdkit
        from pathlib import Path
        from spmdkit._tasks import linreg
        from spmdkit._train import _loop
        real = _loop._Run._stepped
        def stepped(self, info):
            if info.step == 13:  # once step 10's save is on disk
                deadline = time.time() + 60
                while not Path({str(tmp_path / "ck" / "manifests" / "10.json")!r}).exists() and time.time() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, info)
        _loop._Run._stepped = stepped
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), spmdkit.TrainConfig(steps=16, batch_size=16, log_every=4),
                    progress=False, out_dir={str(tmp_path / "out")!r}, log=lambda m: None,
                    checkpoint=spmdkit.CheckpointConfig({str(tmp_path / "ck")!r}, every=5))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env())
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]

    def losses(out):
        return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if r["split"] == "train"}

    config = spmdkit.TrainConfig(steps=16, batch_size=16, log_every=4)
    for ck, out, resume in ((tmp_path / "ck", tmp_path / "out", True), (tmp_path / "ck2", tmp_path / "whole", False)):
        spmdkit.fit(linreg.make(), spmdkit.Single(), optax.sgd(0.1), config, progress=False, out_dir=out,
                    log=lambda m: None, checkpoint=spmdkit.CheckpointConfig(ck, every=5, resume=resume))
    resumed, whole = losses(tmp_path / "out"), losses(tmp_path / "whole")
    assert sorted(resumed) == sorted(whole) == [4, 8, 12, 16]
    for step in whole:
        assert resumed[step] == pytest.approx(whole[step], abs=1e-6)


def test_metrics_jsonl_past_a_file_size_limit_fails_the_run_but_keeps_its_state_and_files(tmp_path):
    # The ArtifactError of metrics.jsonl was not among the errors a run ends on: exit 5 with no
    # summary.json, loss.png or params.npz, the steps since the last checkpoint lost, and a cut last line.
    import resource

    out, ck = tmp_path / "out", tmp_path / "ck"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))  # noqa: E731
    p = subprocess.run([*CLI, "train", "--task", "linreg", "--steps", "600", "--out", str(out), "--checkpoint-dir",
                        str(ck), "--checkpoint-every", "100", "--no-progress"],
                       capture_output=True, text=True, timeout=240, env=env(), preexec_fn=limit)
    assert p.returncode == 5, p.stderr[-2000:]
    assert "metrics.jsonl: File too large" in " ".join(p.stderr.split())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # whole lines only
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "metrics.jsonl" in summary["error"]
    assert (out / "loss.png").stat().st_size and (out / "params.npz").is_file()
    assert summary["steps"] > rows[-1]["step"] - 1 and max(reader(ck).steps()) == summary["steps"] > 200
