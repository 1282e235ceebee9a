"""Errors about training data: each names the data set, the file or pytree path, and the fix."""

from __future__ import annotations

from spmdkit._errors import DataError


class DatasetFileError(DataError, FileNotFoundError):
    """A file of an on-disk data set is missing or unreadable (or the directory is not a data set)."""


class DatasetWriteError(DataError, OSError):
    """A data set cannot be written: a read-only or missing place, or a full disk."""

    exit_code = 5  # the CLI's code for an I/O failure


class DatasetCorruptError(DataError):
    """A file of an on-disk data set is truncated or its checksum does not match."""


class DatasetLayoutError(DataError):
    """An on-disk data set's manifest is unreadable or does not describe its files
    (wrong version, shape, dtype or count)."""


class BatchError(DataError):
    """A batch from a pipeline does not have the form the run expects: wrong structure,
    a wrong number of rows (a ragged batch) or a leaf whose shape or dtype changed."""


class DataExhaustedError(DataError):
    """A one-shot iterator ended before the run's last step."""
