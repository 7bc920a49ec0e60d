"""The Qwen3 / Qwen3-MoE decode step over M columns, composed from an op table.

One step consumes M tokens at consecutive positions (M=1: decode; M=P: prefill
of a P-token prompt; M>1 after a prompt: speculative batch-verify). Every op
works column by column, so each column is bit-identical to an M=1 step.

Probes: `emit(field, layer, data)` is called with each key's buffer for all M
columns (`data[m]` belongs to position pos0+m). With a `feed` (the reference's
raw buffers for the same columns) the step runs in *isolate* mode: every op
takes its inputs from the feed, so a DIFF in its output originates in that op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..model.weights import Model, rope_attention_factor
from ..numerics import transcend
from . import ops_exact

F32 = np.float32
Emit = Callable[[str, "int | None", np.ndarray], None]
Feed = Callable[[str, "int | None"], np.ndarray]


@dataclass(frozen=True)
class Ops:
    """One implementation per toggle-able op (docs/toggles in backends/toggles.py)."""

    rmsnorm: Callable = ops_exact.rmsnorm  # norm
    qknorm: Callable = ops_exact.qknorm  # norm
    project: Callable = ops_exact.project  # gemm
    project_experts: Callable = ops_exact.project_experts  # gemm
    rope_cos_sin: Callable = ops_exact.rope_cos_sin  # rope
    rope: Callable = ops_exact.rope  # rope
    expf: Callable = transcend.expf  # expf
    kvquant: Callable = ops_exact.kvquant  # kvquant
    attention: Callable = ops_exact.attention  # attention
    route: Callable = ops_exact.route  # moe
    combine: Callable = ops_exact.combine  # moe
    silu: Callable = ops_exact.silu  # moe (its exp is the expf toggle)


EXACT = Ops()


class KVCache:
    """Per layer: k/v [cap, n_kv, hd] (int8 for q8, f32) and ks/vs [cap, n_kv] f32."""

    def __init__(self, model: Model, kv: str, capacity: int):
        cfg = model.cfg
        dt = np.int8 if kv == "q8" else F32
        shape = (capacity, cfg.n_kv_heads, cfg.head_dim)
        self.kv = kv
        self.layers = [dict(k=np.zeros(shape, dt), v=np.zeros(shape, dt),
                            ks=np.zeros(shape[:2], F32), vs=np.zeros(shape[:2], F32))
                       for _ in range(cfg.n_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.layers[0]["k"].shape[0]

    def view(self, layer: int, length: int) -> dict:
        return {name: arr[:length] for name, arr in self.layers[layer].items()}

    def write(self, layer: int, pos0: int, rows: dict) -> None:
        for name, data in rows.items():
            self.layers[layer][name][pos0:pos0 + len(data)] = data


def step(model: Model, cache: KVCache, tokens: np.ndarray, pos0: int, ops: Ops = EXACT,
         emit: Emit | None = None, feed: Feed | None = None, deep: bool = False) -> np.ndarray:
    """Run M = len(tokens) columns at positions pos0..pos0+M-1; return logits [M, vocab]."""
    cfg = model.cfg
    M = len(tokens)
    if pos0 + M > cache.capacity:
        raise ValueError(f"KV cache full: positions up to {pos0 + M} > capacity {cache.capacity}")
    emit = emit or (lambda *a: None)
    pos = np.arange(pos0, pos0 + M)
    expf = ops.expf
    def own(field, layer, value):  # the fed value where the feed has one (isolate: all; a graft: its sites)
        fed = None if feed is None else feed(field, layer)
        return value if fed is None else fed.reshape(value.shape)

    x = model.embed_tokens.rows(np.asarray(tokens))  # [M, hidden]
    emit("emb", None, x)
    cos, sin = ops.rope_cos_sin(pos, model.inv_freq)  # [M, hd/2], reused by every layer
    rope_scale = rope_attention_factor(cfg)
    if rope_scale is not None:  # yarn: HF scales its cos/sin tables (one f32 multiply each)
        cos, sin = cos * rope_scale, sin * rope_scale
    for li, L in enumerate(model.layers):
        x = own("x", li - 1, x) if li else own("emb", None, x)
        nrm = ops.rmsnorm(x, L.input_layernorm, cfg.eps)  # [M, hidden]
        emit("nrm", li, nrm)
        nrm = own("nrm", li, nrm)
        q, kraw, vraw = ops.project((L.q_proj, L.k_proj, L.v_proj), nrm)
        if L.q_bias is not None:  # attention_bias: nn.Linear adds it to the product (one f32 add)
            q, kraw, vraw = q + L.q_bias, kraw + L.k_bias, vraw + L.v_bias
        emit("kraw", li, kraw)
        kraw = own("kraw", li, kraw).reshape(M, cfg.n_kv_heads, cfg.head_dim)
        knorm = ops.qknorm(kraw, L.k_norm, cfg.eps)  # [M, n_kv, hd]
        emit("knorm", li, knorm)
        knorm = own("knorm", li, knorm).reshape(M, cfg.n_kv_heads, cfg.head_dim)
        kpre = ops.rope(knorm, cos, sin)
        if deep:
            emit("kpre", li, kpre)
        qn = ops.qknorm(q.reshape(M, cfg.n_heads, cfg.head_dim), L.q_norm, cfg.eps)
        qrope = ops.rope(qn, cos, sin)  # [M, n_heads, hd]
        vrow = vraw.reshape(M, cfg.n_kv_heads, cfg.head_dim)
        if cache.kv == "q8":
            if deep:
                kpre = own("kpre", li, kpre)
            k, ks = ops.kvquant(kpre)
            v, vs = ops.kvquant(vrow)
        else:
            k, ks, v, vs = kpre, np.ones((M, cfg.n_kv_heads), F32), vrow, np.ones((M, cfg.n_kv_heads), F32)
        rows = dict(k=k, ks=ks, v=v, vs=vs)
        for name, data in rows.items():
            emit(name, li, data)
        if feed is not None:  # isolate (or a graft of k or v): the cache holds the reference's rows
            rows = {name: own(name, li, data) for name, data in rows.items()}
        cache.write(li, pos0, rows)
        emit("qrope", li, qrope)
        qrope = own("qrope", li, qrope).reshape(M, cfg.n_heads, cfg.head_dim)
        attn = ops.attention(qrope, cache.view(li, pos0 + M), pos, model.attn_scale, expf)
        emit("attn", li, attn)
        attn = own("attn", li, attn)
        (o,) = ops.project((L.o_proj,), attn)
        if L.o_bias is not None:
            o = o + L.o_bias  # before the residual add, as HF's o_proj(attn) + residual
        ores = x + o
        emit("ores", li, ores)
        ores = own("ores", li, ores)
        x = ores + _ffn(model, L, ores, ops, emit if deep else None, li)
        emit("x", li, x)
    x = own("x", cfg.n_layers - 1, x)
    (logits,) = ops.project((model.lm_head,), ops.rmsnorm(x, model.norm, cfg.eps))
    emit("logits", None, logits)
    return logits


def _ffn(model: Model, L, h_in: np.ndarray, ops: Ops, emit: Emit | None, li: int) -> np.ndarray:
    cfg = model.cfg
    h = ops.rmsnorm(h_in, L.post_attention_layernorm, cfg.eps)  # [M, hidden]
    if L.gate is None:  # a dense MLP: every qwen3 layer, a qwen3_moe layer in mlp_only_layers / off-step
        g, u = ops.project((L.gate_proj, L.up_proj), h)
        (moe,) = ops.project((L.down_proj,), ops.silu(g, ops.expf) * u)
        # the deep keys of a dense layer (docs/decisions.md): no router, so router/topk/topw are
        # empty [M, 0] buffers; moe is the MLP output that is added to the residual
        router = w = np.zeros((len(h), 0), F32)
        idx = router.astype(np.int32)
    else:
        (router,) = ops.project((L.gate,), h)  # [M, E]
        idx, w = ops.route(router, cfg.top_k, cfg.norm_topk_prob, ops.expf)  # [M, k]
        hx = h[:, None, :]  # [M, 1, hidden], shared by the k experts
        g, u = ops.project_experts((L.gate_proj, L.up_proj), hx, idx)  # [M, k, ffn] each
        a = ops.silu(g, ops.expf) * u
        (y,) = ops.project_experts((L.down_proj,), a, idx)  # [M, k, hidden]
        moe = ops.combine(y, w)
    if emit is not None:
        for name, value in (("pnrm", h), ("router", router), ("topk", idx.astype(np.int32)), ("topw", w),
                            ("moe", moe)):
            emit(name, li, value)
    return moe
