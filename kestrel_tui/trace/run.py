"""What a run returns: a Trace of Positions, and Cancelled when it is stopped.

Below both the session layer and the engines, so an engine can build a trace without importing the
session that reads it.

A run of P prompt tokens and N generated tokens covers P+N positions: the
prefill consumes the prompt (positions 0..P-1), then each generated token is
consumed at the next position, so every generated token has its keys in the
trace. Every position's logits give its top-1; `generated` lists the top-1s
from position P-1 on (N+1 of them — the last one is predicted, not consumed).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .rawstore import RawStore


class Cancelled(Exception):
    """The run was cancelled (the app's worker checks this between positions)."""


@dataclass
class Position:
    t: int
    token: int  # consumed at this position
    prompt: bool
    hashes: dict[str, int]
    raw: Mapping[str, np.ndarray] | None  # a dict, or a RawStore's on-disk stand-in
    logits: np.ndarray | None  # [vocab] f32; None: the engine reports no logits

    @property
    def top1(self) -> int:
        """The greedy next token; -1 when the engine reports no logits."""
        return -1 if self.logits is None else int(np.argmax(self.logits))  # ties: the lowest id


@dataclass
class Trace:
    backend: str
    prompt: list[int]
    positions: list[Position] = field(default_factory=list)
    store: RawStore | None = field(default=None, repr=False)  # keeps the raw buffers' spill folder alive

    @property
    def generated(self) -> list[int]:
        return [p.top1 for p in self.positions[len(self.prompt) - 1:]]

    def hashes(self, n_positions: int | None = None) -> dict[str, int]:
        """Every key's hash, in dataflow order (of the first n_positions only, if given)."""
        out: dict[str, int] = {}
        for p in self.positions[:n_positions]:
            out.update(p.hashes)
        return out

    def raw(self, key: str) -> np.ndarray | None:
        t = int(key[1:key.index("_")])
        if t < len(self.positions) and self.positions[t].raw is not None:
            return self.positions[t].raw.get(key)
        return None
