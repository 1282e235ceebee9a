"""Test set-up shared by tests/ and the doctests in src/: 8 simulated CPU devices.

It runs before any test module imports JAX work, which is the only moment the
device count of a process can be set.
"""

import os
import tempfile

import spmdkit

spmdkit.use_host_devices(8)
# As the spmdkit command does, before JAX starts: tests run steps as users' runs do.
spmdkit.reuse_host_memory()
# The commands that tests start keep their compiled programs here, not in the user's
# home; later tests (and later runs) start faster from it.
os.environ.setdefault(
    "SPMDKIT_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), f"spmdkit-test-compile-cache-{os.getuid()}")
)
