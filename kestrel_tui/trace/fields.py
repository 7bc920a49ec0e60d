"""The field registry: every probe field once, in dataflow order.

A field is one buffer of a decode step that gets a key: ``emb`` and ``logits`` once per position,
the others once per layer (trace/keys.py names them). An entry says whether the field is in the
default probe set or only in the opt-in deep one, its element type, the shape of one position's
buffer from the model's config, and what the buffer is. The key schema (keys.py), the toggles'
ownership table (backends/toggles.py), the compiled reference's probe slots (cref/backend.py, in
cref.h's order) and the cuda arena (backends/cuda/layout.py) are built from REGISTRY; the engines'
key maps (engines/hf_hooks.py, engines/llamacpp.py) are checked against it by
tests/test_field_registry.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..model.config import Config

_DTYPES = {"f32": np.dtype(np.float32), "i32": np.dtype(np.int32)}


@dataclass(frozen=True)
class Field:
    name: str
    per_layer: bool       # t{t}_l{l}_{name}; else t{t}_{name}, once per position
    deep: bool            # only in the opt-in deep probe set
    dtype: str            # "f32", "i32", or "kv": the KV cache's element (int8 under q8, f32 under f32)
    shape: Callable[[Config, int | None], tuple[int, ...]]  # (config, layer) -> one position's buffer shape
    meaning: str
    gemv_input: str | None = None  # the field a q4_0 GEMV quantizes to q8_0 to make this one

    def np_dtype(self, kv: str) -> np.dtype:
        if self.dtype == "kv":
            return np.dtype(np.int8 if kv == "q8" else np.float32)
        return _DTYPES[self.dtype]


def _hidden(c, li):
    return (c.hidden,)


def _kv_heads(c, li):
    return (c.n_kv_heads, c.head_dim)


def _kv_scales(c, li):
    return (c.n_kv_heads,)


def _routed(n: Callable[[Config], int]):
    # a dense layer has no router: its buffers are empty, so every layer keeps the same keys
    return lambda c, li: (n(c),) if c.layer_is_moe(li) else (0,)


def _f(name, per_layer, deep, dtype, shape, meaning, gemv_input=None) -> Field:
    return Field(name, per_layer, deep, dtype, shape, meaning, gemv_input)


REGISTRY: tuple[Field, ...] = (
    _f("emb", False, False, "f32", _hidden, "the token's embedding row"),
    _f("nrm", True, False, "f32", _hidden, "the attention block's RMSNorm of the layer input"),
    _f("kraw", True, False, "f32", lambda c, li: (c.n_kv_heads * c.head_dim,), "k_proj output, before QK-norm",
       "nrm"),
    _f("knorm", True, False, "f32", _kv_heads, "K after the per-head RMSNorm, before RoPE"),
    _f("kpre", True, True, "f32", _kv_heads, "K after RoPE, before q8 quantization: what k and ks are made from"),
    _f("k", True, False, "kv", _kv_heads, "K as the cache holds it (q8 codes, or f32)"),
    _f("ks", True, False, "f32", _kv_scales, "the K rows' q8 scales (ones under an f32 cache)"),
    _f("v", True, False, "kv", _kv_heads, "V as the cache holds it (q8 codes, or f32)", "nrm"),
    _f("vs", True, False, "f32", _kv_scales, "the V rows' q8 scales (ones under an f32 cache)"),
    _f("qrope", True, False, "f32", lambda c, li: (c.n_heads, c.head_dim), "Q after QK-norm and RoPE", "nrm"),
    _f("attn", True, False, "f32", lambda c, li: (c.n_heads * c.head_dim,),
       "softmax(QK^T scale) V per head, what o_proj takes"),
    _f("ores", True, False, "f32", _hidden, "the residual plus o_proj(attn)", "attn"),
    _f("pnrm", True, True, "f32", _hidden, "the FFN's RMSNorm (the MoE input)"),
    _f("router", True, True, "f32", _routed(lambda c: c.n_experts), "router logits", "pnrm"),
    _f("topk", True, True, "i32", _routed(lambda c: c.top_k), "the chosen experts' ids, in rank order"),
    _f("topw", True, True, "f32", _routed(lambda c: c.top_k), "the chosen experts' weights, renormalised"),
    _f("moe", True, True, "f32", _hidden, "the weighted expert sum (a dense layer: the MLP output) before the"
                                          " residual add"),
    _f("x", True, False, "f32", _hidden, "the layer's output: ores + the FFN's"),
    _f("logits", False, False, "f32", lambda c, li: (c.vocab,), "lm_head of the final norm"),
)

BY_NAME: dict[str, Field] = {f.name: f for f in REGISTRY}
NAMES: tuple[str, ...] = tuple(BY_NAME)
LAYER: tuple[Field, ...] = tuple(f for f in REGISTRY if f.per_layer)
TOKEN: tuple[Field, ...] = tuple(f for f in REGISTRY if not f.per_layer)
