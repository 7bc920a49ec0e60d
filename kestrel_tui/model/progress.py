"""Loading progress: tensors done of the total and bytes read, for the CLI's and the app's bars.

A real checkpoint takes tens of seconds to read and quantize; the loaders count
what they read and call a `Progress` callback at most every PERIOD seconds
(and once at the end), from the loading thread.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

PERIOD = 0.1  # seconds between reports: a bar needs no more, and the app's message queue stays short


@dataclass(frozen=True)
class LoadStep:
    tensors_done: int
    tensors_total: int
    bytes_read: int
    bytes_total: int

    def line(self) -> str:
        return (f"{self.tensors_done}/{self.tensors_total} tensors,"
                f" {self.bytes_read / 1e9:.2f}/{self.bytes_total / 1e9:.2f} GB read")


Progress = Callable[[LoadStep], None]


class Tally:
    """Counts a loader's reads against the checkpoint's totals and reports them to `progress`."""

    def __init__(self, progress: Progress | None, tensors_total: int, bytes_total: int):
        self.progress, self.tensors_total, self.bytes_total = progress, tensors_total, bytes_total
        self.tensors_done = self.bytes_read = 0
        self._last = 0.0

    def read(self, nbytes: int, tensor_done: bool) -> None:
        self.bytes_read += nbytes
        self.tensors_done += tensor_done
        now = time.monotonic()
        if self.progress is not None and now - self._last >= PERIOD:
            self._last = now
            self.progress(self.step())

    def finish(self) -> None:
        """Everything is in (tensors the model does not use, a tied lm_head, count as read)."""
        self.tensors_done, self.bytes_read = self.tensors_total, self.bytes_total
        if self.progress is not None:
            self.progress(self.step())

    def step(self) -> LoadStep:
        return LoadStep(min(self.tensors_done, self.tensors_total), self.tensors_total,
                        min(self.bytes_read, self.bytes_total), self.bytes_total)
