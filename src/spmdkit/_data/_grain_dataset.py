"""The Grain dataset behind :func:`spmdkit.grain_batches` (defined only where Grain is installed)."""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    import grain
except ImportError:  # Python 3.11 has no Grain; grain_batches then says how to get it
    grain = None

from spmdkit._data._feed import ArrayFeed
from spmdkit._data._format import DatasetSource
from spmdkit._errors import ConfigError, fix


if grain is not None:

    class DatasetBatches(grain.MapDataset):
        """Element ``k``: process ``process_index``'s rows of global batch ``k`` of ``source``
        (made by :func:`spmdkit.grain_batches`).

        Example:
            >>> import numpy as np, spmdkit, tempfile
            >>> d = spmdkit.write_dataset(tempfile.mkdtemp() + "/ds", {"x": np.arange(10.0)})
            >>> batches = spmdkit.grain_batches(d, 4, seed=0)
            >>> len(batches), batches[0]["x"].shape, batches[0]["x"].tolist() == batches[2]["x"].tolist()
            (2, (4,), False)
            >>> halves = [spmdkit.grain_batches(d, 4, process_index=p, process_count=2)[0]["x"] for p in (0, 1)]
            >>> np.concatenate(halves).tolist() == batches[0]["x"].tolist()
            True
        """

        def __init__(self, source: DatasetSource, batch_size: int, seed: int, drop_remainder: bool, process_index: int,
                     process_count: int):
            super().__init__()
            self.source, self.batch_size, self.seed = source, batch_size, seed
            self.process_index, self.process_count = process_index, process_count
            # The order is fit's for arrays of this many examples; only the count matters to it.
            self._order = ArrayFeed({"count": np.empty((len(source), 0), np.uint8)}, batch_size, seed, drop_remainder)
            # What fixes the global order: a checkpoint written with the same resumes on any process count.
            self.spmdkit_order = {"source": "spmdkit.grain_batches", "examples": len(source), "batch_size": batch_size,
                                  "seed": seed, "drop_remainder": drop_remainder, "crc32": source.digest}

        def __len__(self) -> int:
            return self._order.steps_per_epoch

        def __getitem__(self, index: Any) -> Any:
            if isinstance(index, slice):
                return self.slice(index)
            _, idx = self._order.indices(int(index))
            share = len(idx) // self.process_count
            if len(idx) % self.process_count:  # never drop rows silently
                raise ConfigError(fix(
                    f"{self}: batch {index} holds {len(idx)} rows (the short last batch of an epoch, "
                    f"drop_remainder=False), which do not split over {self.process_count} processes.",
                    "pass drop_remainder=True, or a data set whose size leaves a last batch that splits."))
            return self.source.rows(idx[self.process_index * share:(self.process_index + 1) * share])

        def __str__(self) -> str:
            return (f"DatasetBatches({self.source.directory}, batch_size={self.batch_size}, seed={self.seed}, "
                    f"process {self.process_index} of {self.process_count})")
