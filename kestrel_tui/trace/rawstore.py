"""Where a run's raw buffers live: in memory up to a budget, then on disk.

A 48-layer trace holds ~530 buffers a position; at real widths a few hundred
positions of two traces are many GiB. Positions past the budget are written
as one file each (buffers back to back) in a temporary folder and read back one key at
a time, so memory stays bounded by the budget however long the run is. The
folder goes when the store is garbage-collected (or at exit).
"""
from __future__ import annotations

import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

DEFAULT_BUDGET = 256 * 2**20  # bytes of raw buffers kept in memory per trace (results/raw-memory.md)


class SpilledRaw(Mapping):
    """One position's raw buffers in one file, back to back; each lookup reads that one array."""

    def __init__(self, path: Path, index: dict[str, tuple[int, np.dtype, tuple[int, ...]]]):
        self.path, self._index = path, index  # key -> (byte offset, dtype, shape)

    def __getitem__(self, key: str) -> np.ndarray:
        offset, dtype, shape = self._index[key]
        count = int(np.prod(shape, dtype=np.int64))
        return np.fromfile(self.path, dtype=dtype, count=count, offset=offset).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class RawStore:
    def __init__(self, budget: int | None = None, folder: str | Path | None = None):
        self.budget = DEFAULT_BUDGET if budget is None else budget  # read here: a benchmark may change it
        self.in_memory = 0  # bytes held in memory
        self.on_disk = 0    # bytes spilled
        self._folder_arg = folder
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._n = 0

    def _folder(self) -> Path:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kestrel-raw-", dir=self._folder_arg)
            weakref.finalize(self, self._tmp.cleanup)
        return Path(self._tmp.name)

    def keep(self, raw: Mapping[str, np.ndarray] | None) -> Mapping[str, np.ndarray] | None:
        """Take one position's buffers; return them (in memory) or their on-disk stand-in."""
        if raw is None or isinstance(raw, SpilledRaw):
            return raw
        size = sum(int(np.asarray(a).nbytes) for a in raw.values())
        if self.in_memory + size <= self.budget:
            self.in_memory += size
            # a view keeps its whole base alive (a step's [M, ...] buffer, a reader's chunk): own the bytes,
            # so the budget counts what is really held
            return {k: (a.copy() if isinstance(a, np.ndarray) and a.base is not None else a) for k, a in raw.items()}
        path = self._folder() / f"p{self._n}.raw"
        self._n += 1
        index, offset = {}, 0
        with open(path, "wb") as f:
            for key, a in raw.items():
                a = np.ascontiguousarray(a)
                f.write(a.data)
                index[key] = (offset, a.dtype, a.shape)
                offset += a.nbytes
        self.on_disk += size
        return SpilledRaw(path, index)
