"""Test set-up shared by tests/ and the doctests in src/: 8 simulated CPU devices.

It runs before any test module imports JAX work, which is the only moment the
device count of a process can be set.
"""

import spmdkit

spmdkit.use_host_devices(8)
