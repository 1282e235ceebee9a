"""The checksum of checkpoints and data sets: zlib's CRC-32, computed by zlib-ng."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from spmdkit import _crc


def test_the_dependency_is_what_computes_it():
    # zlib-ng is a dependency so that every save and restore checksums at the CRC
    # instructions' speed; the fallback is for a platform where it did not install.
    assert _crc.IMPLEMENTATION == "zlib-ng"


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 3 * 2**20 + 5])
def test_it_is_zlibs_crc32_whole_chained_and_of_a_file(size, tmp_path):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert _crc.crc32(data) == zlib.crc32(data)
    chained = 0
    for start in range(0, size, 1000):  # files are checksummed in pieces, as they are read
        chained = _crc.crc32(memoryview(data)[start:start + 1000], chained)
    assert chained == zlib.crc32(data)
    (tmp_path / "f").write_bytes(data.tobytes())  # read in 4 MiB pieces into one reused buffer
    assert _crc.crc32_file(tmp_path / "f") == f"{zlib.crc32(data):08x}"


def test_a_checkpoint_written_with_zlibs_checksums_still_verifies_and_restores(tmp_path, monkeypatch):
    # Steps saved before zlib-ng (or on a platform without it) carry the same CRC-32 values.
    import jax.numpy as jnp

    import spmdkit
    from spmdkit import _checkpoint, _checkpoint_read

    monkeypatch.setattr(_crc, "crc32", zlib.crc32)  # what crc32_file calls: the save's manifest
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    ckpt.save(1, {"w": jnp.arange(4096.0)}, {})
    ckpt.close()
    monkeypatch.undo()
    assert _checkpoint_read.crc32 is _crc.crc32 and _crc.crc32 is not zlib.crc32
    assert _checkpoint.describe_directory(tmp_path / "ck", verify=True)[0]["status"] == "complete, verified"
    ckpt = spmdkit.Checkpointer(spmdkit.CheckpointConfig(str(tmp_path / "ck")), log=lambda m: None)
    restored, _ = ckpt.restore(1, {"w": jnp.zeros(4096)})
    ckpt.close()
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4096.0))


def test_without_zlib_ng_the_standard_librarys_crc32_gives_the_same_checksums():
    import subprocess
    import sys

    code = ("import sys; sys.modules['zlib_ng'] = None; sys.modules['zlib_ng.zlib_ng'] = None\n"
            "from spmdkit import _crc; print(_crc.IMPLEMENTATION, f'{_crc.crc32(b\"spmdkit\", 7):08x}')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["zlib", f"{zlib.crc32(b'spmdkit', 7):08x}"]
