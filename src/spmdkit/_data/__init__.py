"""Training data: arrays, pipelines (iterables, Grain), the on-disk format, prefetch.

Below the training loop: ``fit`` asks :func:`open_feed` for its batches; nothing here
knows about tasks, losses or the loop.
"""

from spmdkit._data._errors import (
    BatchError,
    DataExhaustedError,
    DatasetCorruptError,
    DatasetFileError,
    DatasetLayoutError,
    DatasetWriteError,
)
from spmdkit._errors import DataError
from spmdkit._data._feed import ArrayFeed, PipelineFeed, is_pipeline, open_feed, resolve_train_data
from spmdkit._data._format import DatasetSource, is_dataset_dir, load_dataset, write_dataset
from spmdkit._data._grain import grain_batches
from spmdkit._data._prefetch import Prefetch, to_devices

__all__ = [
    "ArrayFeed",
    "BatchError",
    "DataError",
    "DataExhaustedError",
    "DatasetCorruptError",
    "DatasetFileError",
    "DatasetLayoutError",
    "DatasetWriteError",
    "DatasetSource",
    "PipelineFeed",
    "Prefetch",
    "grain_batches",
    "is_dataset_dir",
    "is_pipeline",
    "load_dataset",
    "open_feed",
    "resolve_train_data",
    "to_devices",
    "write_dataset",
]
