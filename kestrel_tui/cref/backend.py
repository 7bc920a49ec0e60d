"""The compiled reference as a backend: `cref/step.c` runs a whole decode step in one call.

The weights, the KV cache (backends/decoder.KVCache) and the probe buffers stay numpy arrays;
the C side gets their addresses. Bits are the numpy reference's (tests/test_cref_step.py), so
this backend is "cpu" like the numpy one: the same cache entries, the same name in a trace.
A step with a feed (isolation: only a subject is ever fed) runs the numpy decoder on the same
cache, since the C step has no per-op hooks.
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from ..backends.base import Backend, NumpyBackend, StepOut
from ..backends.decoder import KVCache
from ..model.weights import Linear, Model, rope_attention_factor
from ..trace.fields import BY_NAME, LAYER
from ..trace.keys import ALL_FIELDS, layer_fields, token_keys
from . import load

P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
EMB, LOGITS = BY_NAME["emb"], BY_NAME["logits"]


class Lin(ctypes.Structure):
    _fields_ = [("w", P), ("out", I64), ("inp", I64), ("q4", I32), ("expert_bytes", I64)]


class Layer(ctypes.Structure):
    _fields_ = [(n, P) for n in ("input_ln", "post_ln", "q_norm", "k_norm")] + \
               [(n, Lin) for n in ("q", "k", "v", "o")] + \
               [(n, P) for n in ("q_bias", "k_bias", "v_bias", "o_bias")] + \
               [(n, Lin) for n in ("router", "gate", "up", "down")] + \
               [(n, P) for n in ("k_cache", "v_cache", "ks_cache", "vs_cache")]


class Hashes(ctypes.Structure):
    """kc_hashes: the keys to hash after the step (cref.h)."""
    _fields_ = [("n_keys", I64), ("slots", P), ("bytes", P), ("out", P)]


class ModelC(ctypes.Structure):
    _fields_ = [(n, I64) for n in ("n_layers", "hidden", "n_heads", "n_kv", "head_dim", "vocab", "top_k")] + \
               [(n, F32) for n in ("eps", "attn_scale", "rope_scale")] + \
               [(n, I32) for n in ("norm_topk", "kv_q8", "threads")] + \
               [("embed", P), ("lm_head", P), ("norm", P), ("inv_freq", P), ("layers", P)]


@dataclass(frozen=True, eq=False)
class _Layout:
    """Where a step of M columns puts its probes: one arena, one [layers, M, *shape] block per (field, dtype,
    shape), so a position's ~530 buffers are indexings of ~20 arrays."""
    offsets: np.ndarray    # [slots] each slot's byte offset in the (64-byte aligned) arena
    size: int              # the arena's bytes
    blocks: list           # (offset, members, dtype, shape of one column) per block
    where: list            # per hashed key, in dataflow order: (block, member)
    suffixes: list         # per hashed key: its name after "t{t}_"
    hash_slots: np.ndarray  # the hashed keys in hashing order (equal lengths together) ...
    hash_bytes: np.ndarray  # ... and their bytes a column
    unsort: np.ndarray     # hashing order -> dataflow order
    hashed: list           # slot of each hashed key, dataflow order

    @classmethod
    def of(cls, slots: list, M: int, n_layers: int, deep: bool) -> "_Layout":
        groups: dict[tuple, list[int]] = {}
        for i, (f, _, dt, shape) in enumerate(slots):
            groups.setdefault((f, dt, shape), []).append(i)
        offsets, where, blocks, off = np.zeros(len(slots), np.int64), {}, [], 0
        for g, ((f, dt, shape), members) in enumerate(groups.items()):
            col = int(np.prod(shape)) * dt.itemsize
            blocks.append((off, len(members), dt, shape))
            for j, i in enumerate(members):
                offsets[i] = off + j * M * col
                where[i] = (g, j)
            off += -(-len(members) * M * col // 64) * 64  # 64-byte aligned blocks
        hashed = [0] + [1 + li * len(ALL_FIELDS) + ALL_FIELDS.index(f) for li in range(n_layers)
                        for f in layer_fields(deep)] + [len(slots) - 1]
        nbytes = np.array([int(np.prod(slots[i][3])) * slots[i][2].itemsize for i in hashed], np.int64)
        order = np.argsort(nbytes, kind="stable")
        suffixes = [k.split("_", 1)[1] for k in token_keys(0, n_layers, deep=deep)]
        return cls(offsets, off, blocks, [where[i] for i in hashed], suffixes,
                   np.ascontiguousarray(np.array(hashed, np.int64)[order]), np.ascontiguousarray(nbytes[order]),
                   np.argsort(order), hashed)


class ProbeViews(Mapping):
    """One column's probe buffers, key -> array, in dataflow order: views into the step's arena, each made
    when it is looked up (a step has ~530 of them; a caller often reads a few, or copies them all once)."""

    def __init__(self, names: list[str], blocks: list[np.ndarray], where: list, m: int):
        self._names, self._blocks, self._where, self._m = names, blocks, where, m
        self._index: dict[str, int] | None = None

    def __getitem__(self, key: str) -> np.ndarray:
        if self._index is None:
            self._index = dict(zip(self._names, range(len(self._names))))
        g, j = self._where[self._index[key]]
        return self._blocks[g][j, self._m]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def default_threads() -> int:
    """Every core this process may use: the reference splits rows, heads and columns across them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _addr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _f32(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a, dtype=np.float32)


class CompiledBackend(Backend):
    """The reference (cpu), decoded by the compiled contract."""

    name = "cpu"

    def __init__(self, model: Model, kv: str = "q8", deep: bool = False, threads: int | None = None,
                 lib_path=None):
        self.lib = load(lib_path)
        self.model, self.kv, self.deep = model, kv, deep
        self.threads = threads or default_threads()
        self.cache: KVCache | None = None
        self._keep: list = []  # every array whose address the C structs hold
        self._layouts: dict[int, _Layout] = {}
        self._arena = self._arena_layout = self._ptrs = None
        cfg = model.cfg
        self._layers = (Layer * cfg.n_layers)()
        for li, L in enumerate(model.layers):
            c = self._layers[li]
            for field, norm in (("input_ln", L.input_layernorm), ("post_ln", L.post_attention_layernorm),
                                ("q_norm", L.q_norm), ("k_norm", L.k_norm)):
                setattr(c, field, self._hold(_f32(norm)))
            for name in ("q", "k", "v", "o"):
                setattr(c, name, self._lin(getattr(L, f"{name}_proj")))
                setattr(c, f"{name}_bias", self._hold(_f32(getattr(L, f"{name}_bias"))))
            c.router = self._lin(L.gate) if L.gate is not None else Lin()
            c.gate, c.up, c.down = (self._lin(getattr(L, n)) for n in ("gate_proj", "up_proj", "down_proj"))
        self._embed, self._head = self._lin(model.embed_tokens), self._lin(model.lm_head)
        af = rope_attention_factor(cfg)
        self._c = ModelC(n_layers=cfg.n_layers, hidden=cfg.hidden, n_heads=cfg.n_heads, n_kv=cfg.n_kv_heads,
                         head_dim=cfg.head_dim, vocab=cfg.vocab, top_k=cfg.top_k or 0, eps=np.float32(cfg.eps),
                         attn_scale=model.attn_scale, rope_scale=0.0 if af is None else af,
                         norm_topk=int(bool(cfg.norm_topk_prob)), kv_q8=int(kv == "q8"), threads=self.threads,
                         embed=ctypes.addressof(self._embed), lm_head=ctypes.addressof(self._head),
                         norm=self._hold(_f32(model.norm)), inv_freq=self._hold(_f32(model.inv_freq)),
                         layers=ctypes.addressof(self._layers))

    def _hold(self, a: np.ndarray | None) -> int | None:
        if a is not None:
            self._keep.append(a)
        return _addr(a)

    def _lin(self, lin: Linear) -> Lin:
        m = np.ascontiguousarray(lin.w if lin.w is not None else lin.blocks)
        stacked = m.ndim == (3 if lin.w is not None else 4)  # [E, ...]: an expert stack
        return Lin(w=self._hold(m), out=lin.out, inp=lin.inp, q4=int(lin.w is None),
                   expert_bytes=m[0].nbytes if stacked else 0)

    def reset(self, capacity: int) -> None:
        self.cache = KVCache(self.model, self.kv, capacity)
        for li, arrs in enumerate(self.cache.layers):
            c = self._layers[li]
            c.k_cache, c.v_cache, c.ks_cache, c.vs_cache = (arrs[n].ctypes.data for n in ("k", "v", "ks", "vs"))

    def _slots(self) -> list[tuple[str, int | None, np.dtype, tuple[int, ...]]]:
        """Every probe slot in step.c's order (cref.h): (field, layer, dtype, shape of one column)."""
        cfg = self.model.cfg

        def slot(f, li):
            return f.name, li, f.np_dtype(self.kv), f.shape(cfg, li)
        return [slot(EMB, None), *(slot(f, li) for li in range(cfg.n_layers) for f in LAYER), slot(LOGITS, None)]

    def _layout(self, M: int) -> "_Layout":
        if M not in self._layouts:
            self._layouts[M] = _Layout.of(self._slots(), M, self.model.n_layers, self.deep)
        return self._layouts[M]

    def _arena_for(self, lay: "_Layout") -> tuple[np.ndarray, np.ndarray]:
        """The step's probe buffers: the last step's arena again when nothing of it is still referenced
        (its raw views and their copies are gone), else a new one. Returns (arena, slot addresses)."""
        if self._arena is not None and self._arena_layout is lay and sys.getrefcount(self._arena) == 2:
            return self._arena, self._ptrs  # 2: self._arena and getrefcount's argument
        arena = np.empty(lay.size + 64, np.uint8)
        self._arena, self._arena_layout = arena, lay
        self._ptrs = lay.offsets + (arena.ctypes.data + (-arena.ctypes.data % 64))
        return arena, self._ptrs

    def step(self, tokens: np.ndarray, pos0: int, raw: bool = True, feed=None) -> StepOut:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        M = len(tokens)
        if feed is not None:
            fallback = NumpyBackend(self.model, kv=self.kv, deep=self.deep)
            fallback.cache = self.cache
            return fallback.step(tokens, pos0, raw=raw, feed=feed)
        vocab = self.model.cfg.vocab
        if M and (tokens.min() < 0 or tokens.max() >= vocab):
            raise IndexError(f"token id {int(tokens.max() if tokens.max() >= vocab else tokens.min())} is outside"
                             f" the vocabulary (0..{vocab - 1})")
        if pos0 + M > self.cache.capacity:
            raise ValueError(f"KV cache full: positions up to {pos0 + M} > capacity {self.cache.capacity}")
        lay = self._layout(M)
        arena, ptrs = self._arena_for(lay)
        out = np.empty((M, len(lay.hashed)), np.uint64)
        hashes = Hashes(n_keys=len(lay.hashed), slots=lay.hash_slots.ctypes.data, bytes=lay.hash_bytes.ctypes.data,
                        out=out.ctypes.data)
        if self.lib.kc_step(ctypes.byref(self._c), tokens.ctypes.data, M, pos0, ptrs.ctypes.data,
                            ctypes.byref(hashes)) != 0:
            raise MemoryError("compiled reference: out of memory for the step's scratch buffers")
        base = -arena.ctypes.data % 64
        blocks = [arena[base + o:base + o + n * M * dt.itemsize * int(np.prod(shape))].view(dt).reshape(n, M, *shape)
                  for o, n, dt, shape in lay.blocks]
        g, j = lay.where[-1]
        logits = blocks[g][j].copy()  # a view would keep the whole arena alive
        by_key = out[:, lay.unsort].tolist()  # hashed in length order (fnv.c), back to dataflow order
        hashes, raws = [], [] if raw else None
        for m in range(M):
            prefix = f"t{pos0 + m}_"
            names = [prefix + suffix for suffix in lay.suffixes]
            hashes.append(dict(zip(names, by_key[m])))
            if raw:
                raws.append(ProbeViews(names, blocks, lay.where, m))
        return StepOut(logits=logits, hashes=hashes, raw=raws)

    def load_kv(self, pos0: int, raws: list[dict[str, np.ndarray]]) -> None:
        NumpyBackend.load_kv(self, pos0, raws)
