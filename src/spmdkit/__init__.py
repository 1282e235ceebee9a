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
from spmdkit._cache import disable_compile_cache, enable_compile_cache
from spmdkit._host_memory import (
    ENV_HOST_ALLOCATOR,
    HostMemory,
    host_memory,
    release_host_memory,
    reuse_host_memory,
)
from spmdkit._calibrate import calibrate
from spmdkit._checkpoint import CheckpointConfig, Checkpointer, CheckpointError
from spmdkit._config import OptimizerConfig, RunConfig, TrainConfig
from spmdkit._data import (
    BatchError,
    DataExhaustedError,
    DatasetCorruptError,
    DatasetFileError,
    DatasetLayoutError,
    DatasetWriteError,
    DatasetSource,
    grain_batches,
    load_dataset,
    write_dataset,
)
from spmdkit._errors import (
    AxisNameError,
    BatchSizeError,
    ConfigError,
    DataError,
    DeviceSetupError,
    DonatedStateError,
    MappedAxisError,
    MeshError,
    NonFiniteLossError,
    PeerLostError,
    ProcessMismatchError,
    ReplicationError,
    SignatureError,
    SpmdkitError,
    StepOutputError,
    TreeMismatchError,
)
from spmdkit._initialize import initialize
from spmdkit._mesh import make_mesh
from spmdkit._pmap import ShardedBatch, pmap, replicate, shard, unreplicate
from spmdkit._strategies import (
    DataParallel,
    Ensemble,
    MembersMismatchError,
    Predictor,
    Sharded,
    Single,
    Strategy,
    TrainState,
    get_strategy,
)
from spmdkit._rules import PRESETS, AxisRules, LayoutError, ReplicationWarning
from spmdkit._tasks import Task, get_task
from spmdkit._train import (
    CheckpointHook,
    EvalHook,
    FitResult,
    MetricsHook,
    NaNGuard,
    ProgressHook,
    StepInfo,
    StepWatchdog,
    fit,
    load_params,
    run_hooks,
    save_params,
    task_state,
)
from spmdkit._checkpoint import CheckpointDamagedError, CheckpointSaveError
from spmdkit._train._artifacts import ArtifactError
from spmdkit._train._validate import TaskError, validate_task
from spmdkit._process import end_soon
from spmdkit._sample import sample
from spmdkit._plan import plan
from spmdkit._plan._report import MeasureFailed, MeasureInterrupted
from spmdkit._plan._search import PlanStepError
from spmdkit._target import Link, Target, TargetError, load_target

__version__ = "0.1.0"

__all__ = [
    "ENV_HOST_ALLOCATOR",
    "HostMemory",
    "host_memory",
    "release_host_memory",
    "reuse_host_memory",
    "BatchError",
    "DataExhaustedError",
    "DatasetCorruptError",
    "DatasetFileError",
    "DatasetLayoutError",
    "DatasetWriteError",
    "DatasetSource",
    "grain_batches",
    "load_dataset",
    "write_dataset",
    "ENV_HOST_DEVICES",
    "CheckpointHook",
    "EvalHook",
    "MetricsHook",
    "NaNGuard",
    "ProgressHook",
    "StepInfo",
    "StepWatchdog",
    "run_hooks",
    "PRESETS",
    "AxisRules",
    "LayoutError",
    "ReplicationWarning",
    "Sharded",
    "AxisNameError",
    "BatchSizeError",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointDamagedError",
    "CheckpointSaveError",
    "ArtifactError",
    "TaskError",
    "validate_task",
    "Checkpointer",
    "ConfigError",
    "DataError",
    "DataParallel",
    "DeviceSetupError",
    "DonatedStateError",
    "Ensemble",
    "FitResult",
    "MappedAxisError",
    "MembersMismatchError",
    "MeshError",
    "NonFiniteLossError",
    "OptimizerConfig",
    "Predictor",
    "RunConfig",
    "ShardedBatch",
    "Single",
    "PeerLostError",
    "ProcessMismatchError",
    "ReplicationError",
    "SignatureError",
    "SpmdkitError",
    "StepOutputError",
    "Strategy",
    "Task",
    "TrainConfig",
    "TrainState",
    "TreeMismatchError",
    "calibrate",
    "device_table",
    "disable_compile_cache",
    "enable_compile_cache",
    "fit",
    "sample",
    "get_strategy",
    "get_task",
    "initialize",
    "end_soon",
    "host_devices_from_env",
    "load_params",
    "make_mesh",
    "pmap",
    "plan",
    "load_target",
    "Link",
    "MeasureFailed",
    "MeasureInterrupted",
    "PlanStepError",
    "Target",
    "TargetError",
    "replicate",
    "save_params",
    "task_state",
    "shard",
    "suggest_mesh",
    "unreplicate",
    "use_host_devices",
]
