"""Where a run's raw buffers live: in memory up to a budget, then on disk.

A 48-layer trace holds ~530 buffers a position; at real widths a few hundred
positions of two traces are many GiB. Positions past the budget are written
as one uncompressed .npz each in a temporary folder and read back one key at
a time, so memory stays bounded by the budget however long the run is. The
folder goes when the store is garbage-collected (or at exit).
"""
from __future__ import annotations

import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

DEFAULT_BUDGET = 512 * 2**20  # bytes of raw buffers kept in memory per trace


class SpilledRaw(Mapping):
    """One position's raw buffers in an .npz file; each lookup reads that one array."""

    def __init__(self, path: Path, keys: tuple[str, ...]):
        self.path, self._keys = path, keys
        self._index = {k: f"a{i}" for i, k in enumerate(keys)}  # npz member names must be file-name safe

    def __getitem__(self, key: str) -> np.ndarray:
        member = self._index[key]
        with np.load(self.path, allow_pickle=False) as z:
            return z[member]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class RawStore:
    def __init__(self, budget: int = DEFAULT_BUDGET, folder: str | Path | None = None):
        self.budget = budget
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
            return raw
        keys = tuple(raw)
        path = self._folder() / f"p{self._n}.npz"
        self._n += 1
        np.savez(path, **{f"a{i}": np.ascontiguousarray(raw[k]) for i, k in enumerate(keys)})
        self.on_disk += size
        return SpilledRaw(path, keys)
