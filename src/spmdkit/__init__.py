"""spmdkit: write a step for one device, run it on many.

The public surface is this module; everything else lives in private modules.
"""

from spmdkit._devices import (
    ENV_HOST_DEVICES,
    device_table,
    host_devices_from_env,
    suggest_mesh,
    use_host_devices,
)
from spmdkit._errors import (
    AxisNameError,
    BatchSizeError,
    DeviceSetupError,
    MappedAxisError,
    MeshError,
    SpmdkitError,
    TreeMismatchError,
)
from spmdkit._mesh import make_mesh
from spmdkit._pmap import ShardedBatch, pmap, replicate, shard, unreplicate

__version__ = "0.1.0"

__all__ = [
    "ENV_HOST_DEVICES",
    "AxisNameError",
    "BatchSizeError",
    "DeviceSetupError",
    "MappedAxisError",
    "MeshError",
    "ShardedBatch",
    "SpmdkitError",
    "TreeMismatchError",
    "device_table",
    "host_devices_from_env",
    "make_mesh",
    "pmap",
    "replicate",
    "shard",
    "suggest_mesh",
    "unreplicate",
    "use_host_devices",
]
