"""The backend interface shared by cpu, sim and cuda, and the numpy implementation.

A backend owns a model's weights and KV cache and runs decode steps over M
columns. Per step it returns the logits and, per column, the hash of every
probe key (always) and the raw buffers (when asked) — the cuda backend hashes
on the device, the numpy backends hash on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.weights import Model
from ..trace.fnv import fnv1a64
from ..trace.keys import Key, parse_key, token_keys
from .decoder import EXACT, KVCache, Ops, step

KV_FIELDS = ("k", "ks", "v", "vs")


def key_of(t: int, field_name: str, layer: int | None) -> str:
    return Key(t, layer, field_name).name


@dataclass
class StepOut:
    logits: np.ndarray  # [M, vocab] f32
    hashes: list[dict[str, int]]  # per column, key -> FNV-1a 64, dataflow order
    raw: list[dict[str, np.ndarray]] | None = None  # per column, key -> buffer


class Backend:
    """What the session needs from a backend (cpu, sim, cuda)."""

    name = "?"
    model: Model

    def reset(self, capacity: int) -> None:
        raise NotImplementedError

    def step(self, tokens: np.ndarray, pos0: int, raw: bool = True, feed=None) -> StepOut:
        raise NotImplementedError

    def load_kv(self, pos0: int, raws: list[dict[str, np.ndarray]]) -> None:
        """Write another backend's KV rows (its k/ks/v/vs keys) for positions pos0..
        — how a prefill placed on the reference reaches the subject's cache."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class NumpyBackend(Backend):
    """cpu (all ops exact: the reference) and sim (some ops GPU-style fast)."""

    def __init__(self, model: Model, kv: str = "q8", ops: Ops = EXACT, name: str = "cpu", deep: bool = False):
        self.model, self.kv, self.ops, self.name, self.deep = model, kv, ops, name, deep
        self.cache: KVCache | None = None

    def reset(self, capacity: int) -> None:
        self.cache = KVCache(self.model, self.kv, capacity)

    def step(self, tokens: np.ndarray, pos0: int, raw: bool = True, feed=None) -> StepOut:
        bufs: dict[tuple[str, int | None], np.ndarray] = {}

        def emit(field_name, layer, data):
            bufs[field_name, layer] = data

        def from_feed(field_name, layer):  # feed: per column, key -> reference buffer; None: not fed
            cols = [feed[m].get(key_of(pos0 + m, field_name, layer)) for m in range(len(tokens))]
            return None if any(c is None for c in cols) else np.stack(cols)

        feed_fn = from_feed if feed is not None else None
        logits = step(self.model, self.cache, np.asarray(tokens), pos0, self.ops, emit, feed_fn, self.deep)
        n_layers = self.model.n_layers
        hashes, raws = [], []
        for m in range(len(tokens)):
            t = pos0 + m
            col: dict[str, np.ndarray] = {}
            for key in token_keys(t, n_layers, deep=self.deep):
                k = parse_key(key)
                col[key] = np.ascontiguousarray(bufs[k.field, k.layer][m])
            hashes.append({key: fnv1a64(buf) for key, buf in col.items()})
            raws.append(col)
        return StepOut(logits=logits, hashes=hashes, raw=raws if raw else None)

    def load_kv(self, pos0: int, raws: list[dict[str, np.ndarray]]) -> None:
        cfg = self.model.cfg
        for m, col in enumerate(raws):
            t = pos0 + m
            for li in range(cfg.n_layers):
                rows = {f: col[key_of(t, f, li)][None] for f in KV_FIELDS}  # k/v [1, n_kv, hd], ks/vs [1, n_kv]
                self.cache.write(li, t, rows)

