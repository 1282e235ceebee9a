"""Files written whole or not at all: the one helper every writer of spmdkit goes through."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from spmdkit._atomic import is_temporary, replace_text, replace_whole, temporary_name


def test_replace_text_writes_and_replaces(tmp_path):
    p = tmp_path / "a.json"
    replace_text(p, "old")
    replace_text(p, "new")
    assert p.read_text() == "new"
    assert os.listdir(tmp_path) == ["a.json"]  # no temporary file left


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "a.json"
    p.write_text("old")

    def half(tmp):
        with open(tmp, "w") as fh:
            fh.write("ha")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        replace_whole(p, half)
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.json"]


def test_keyboard_interrupt_also_removes_the_temporary(tmp_path):
    p = tmp_path / "plot.png"

    def interrupted(tmp):
        open(tmp, "w").close()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_whole(p, interrupted)
    assert os.listdir(tmp_path) == []


def test_a_write_that_creates_nothing_is_an_error_and_leaves_the_old_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("old")
    with pytest.raises(FileNotFoundError):
        replace_whole(p, lambda tmp: None)
    assert p.read_text() == "old"


def test_the_temporary_keeps_the_suffix_and_is_recognised(tmp_path):
    tmp = temporary_name(tmp_path / "plan.png")
    name = os.path.basename(tmp)
    assert os.path.dirname(tmp) == str(tmp_path)
    assert name.endswith(".png") and name.startswith(".plan.")  # matplotlib picks the format by the suffix
    assert is_temporary(name)
    assert is_temporary(os.path.basename(temporary_name(tmp_path / "manifest")))
    for other in ("plan.png", ".hidden", "x.tmp", "manifest.json", ".a.b.tmp.json"):
        assert not is_temporary(other), other


def test_numpy_through_a_handle_keeps_the_exact_name(tmp_path):
    p = tmp_path / "params"  # np.savez appends ".npz" to a *name* without it; through a handle it cannot

    def write(tmp):
        with open(tmp, "wb") as fh:
            np.savez(fh, w=np.arange(3))

    replace_whole(p, write)
    assert sorted(os.listdir(tmp_path)) == ["params"]
    np.testing.assert_array_equal(np.load(p)["w"], np.arange(3))


def test_a_killed_writer_leaves_the_old_file(tmp_path):
    """SIGKILL in the middle of the write: the old file is whole; only a temporary is left."""
    p = tmp_path / "summary.json"
    p.write_text('{"old": 1}')
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.join(os.path.dirname(__file__), "..", "src")!r})
        from spmdkit._atomic import replace_whole
        def slow(tmp):
            with open(tmp, "w") as fh:
                fh.write('{{"new": ')
                fh.flush()
                print("writing", flush=True)
                time.sleep(60)
        replace_whole({str(p)!r}, slow)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert p.read_text() == '{"old": 1}'
    left = [n for n in os.listdir(tmp_path) if n != "summary.json"]
    assert len(left) == 1 and is_temporary(left[0])


def test_a_fifo_is_written_in_place_and_a_symbolic_link_is_kept(tmp_path):
    # The rename put a regular file where the node was: `spmdkit plan --json /dev/stdout` run as
    # root replaced /dev/stdout itself, for every later process, and wrote nothing to the output.
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    replace_text(fifo, "through the pipe")
    reader.join(10)
    assert got == ["through the pipe"] and fifo.is_fifo()
    # A link to a file: the file it names is replaced whole, the link stays a link.
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(real)
    replace_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert not [p for p in os.listdir(tmp_path) if is_temporary(p)]
