"""The launches of one decode step, in the dataflow order of backends/decoder.py `step`.

`plan` lists a step's launches for a Target (launches.py: the buffers and stream they go to):
the embedding and the step's RoPE table; per layer the attention block (input norm, q/k/v,
QK-norm, RoPE and the KV rows, attention, o_proj) and the FFN block (post-attention norm, then
the router, the experts and their sum, or the dense MLP); the head (final norm, lm_head). Every
probe buffer is written into the arena (layout.py), fused where kernels/fused.cu has a launch
for several ops (outside isolate mode, where each op reads the reference's inputs; the fuse
option turns them off). Each part appends its launches to the step's Step, which holds what
they read and the choices fixed for the whole step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..base import KV_FIELDS
from .launches import (ATT_FAST_TILE, ATT_FAST_WARPS, ATT_PV_THREADS, ATT_SPLIT_TILE, COMBINE_MAX_K, EXPERT_ROWS,
                       FED, FUSED_MAX_ROW, HASH_BODY, SWIGLU_THREADS, Copy, Kernels, Launch, Target, blocks_for,
                       q4_rows_a_block)
from .layout import Layout
from .weights import DeviceLinear


@dataclass(frozen=True)
class ExpertSum:
    """A MoE layer's expert sum, left to the norm behind it (combine_rmsnorm_*)."""
    y: int
    topw: int
    res: int
    moe: int
    x: int
    k: int


@dataclass(frozen=True)
class Step:
    """One step being planned: what its launches read, the fusions fixed for it, and `items`,
    its launches so far."""
    b: object              # the CudaBackend: model, device weights, cache, kernels
    lay: Layout
    T: Target
    pos0: int
    isolate: bool
    feed: int | None       # isolate: the reference's buffers, laid out as the arena
    fuse_all: bool         # q4_0: the norms quantize their own output for the GEMV behind them
    fuse_q: bool           # the input norm too (in isolate mode its GEMVs read the reference's nrm)
    fused: bool            # fused.cu's launches
    fuse_heads: bool       # QK-norm, RoPE and the KV rows in one launch
    fuse_swiglu: bool      # a MoE layer's gate, up and silu in one launch (experts_swiglu_*)
    # how a MoE layer adds its expert sum (a dense layer's down GEMV adds its output itself):
    fold_combine: bool     # the down GEMV adds the expert sum (down_combine_*)
    fuse_combine: bool     # else the sum goes with the norm behind it (combine_rmsnorm_*)
    items: list = field(default_factory=list)

    @property
    def K(self) -> Kernels:
        return self.b.kernels

    @property
    def q4(self) -> bool:
        return self.b.dm.fmt == "q4_0"

    @property
    def qmode(self) -> int:
        """The quantize argument of a kernel that writes its output's q8_0 (1 fast, 2 exact)."""
        return 2 if self.K.quant_exact else 1

    def emit(self, k, grid, block, *args, shared: int = 0) -> None:
        self.items.append(Launch(k, grid, block, args, shared))

    def A(self, name: str, layer: int | None = None) -> int:
        """The subject's own buffer."""
        return self.T.base + self.lay.offset(name, layer)

    def In(self, name: str, layer: int | None = None) -> int:
        """An op's input: the reference's buffer in isolate mode."""
        if self.feed is not None and name in FED:
            return self.feed + self.lay.offset(name, layer)
        return self.A(name, layer)


def plan(b, lay: Layout, T: Target, pos0: int, isolate: bool = False, hash_body: bool = False) -> list:
    """The launches of one step, in order: Launch and Copy items, and HASH_BODY where the hash of
    every key but the logits may start on a second stream (overlapping the final norm and
    lm_head; backend.hash then adds the logits' hash and joins the streams)."""
    s = _step(b, lay, T, pos0, isolate)
    embedding(s)
    pending = None
    for li, W in enumerate(b.dm.layers):
        x_in = s.In("emb") if li == 0 else s.In("x", li - 1)
        attention_block(s, li, W, x_in, pending)
        pending = ffn_block(s, li, W)
    head(s, pending, hash_body)
    return s.items


def _step(b, lay: Layout, T: Target, pos0: int, isolate: bool) -> Step:
    cfg, h, hd = b.model.cfg, b.model.cfg.hidden, b.model.cfg.head_dim
    feed = T.feed if isolate else None
    fuse_all = b.dm.fmt == "q4_0" and h % 32 == 0
    fused = b.fuse and feed is None
    fold_combine = fused and fuse_all and cfg.is_moe and cfg.top_k <= COMBINE_MAX_K
    return Step(b, lay, T, pos0, isolate, feed, fuse_all=fuse_all, fuse_q=fuse_all and feed is None, fused=fused,
                fuse_heads=fused and b.kv == "q8" and hd in (64, 128, 256),  # fused.cu rope_regs: hd/64 in 1, 2, 4
                # a block of experts_swiglu writes one q8_0 block (32 rows) of a pair's activations (q4_0
                # weights cut moe_intermediate into 32-blocks anyway: Config.validate)
                fuse_swiglu=fused and b.dm.fmt == "q4_0" and cfg.is_moe and cfg.moe_intermediate % 32 == 0,
                fold_combine=fold_combine,
                fuse_combine=fused and cfg.is_moe and h <= FUSED_MAX_ROW and not fold_combine)


def embedding(s: Step) -> None:
    """The tokens' embeddings and the step's RoPE table."""
    dm, K, M, h = s.b.dm, s.K, s.lay.M, s.b.model.cfg.hidden
    if s.q4:
        s.emit(K.embed, (blocks_for(h, 256), M, 1), (256, 1, 1), dm.embed.w, dm.embed.d, s.T.tokens, s.A("emb"),
               h // 32)
    else:
        s.emit(K.embed, (blocks_for(h, 256), M, 1), (256, 1, 1), dm.embed.w, s.T.tokens, s.A("emb"), h)
    half = s.b.model.cfg.head_dim // 2
    s.emit(K.rope_table, (blocks_for(half, 64), M, 1), (64, 1, 1), dm.inv_freq, s.A("cos"), s.A("sin"), s.pos0, half,
           s.T.dpos)


def attention_block(s: Step, li: int, W, x_in: int, pending: ExpertSum | None) -> None:
    """Layer li's input norm (or the previous layer's expert sum with it), q/k/v, the heads, the
    attention and o_proj with the residual x_in."""
    cfg, K, M, A, In = s.b.model.cfg, s.K, s.lay.M, s.A, s.In
    nh, hd = cfg.n_heads, cfg.head_dim
    xq, xd = A("xq"), A("xd")
    nrm = In("nrm", li)
    if s.fuse_q:  # the norm writes the q8_0 of its output too
        norm(s, x_in, W["input_layernorm"], A("nrm", li), (xq, xd, s.qmode), pending)
    else:  # isolate: the GEMVs quantize the reference's nrm
        norm(s, x_in, W["input_layernorm"], A("nrm", li), (0, 0, 0), pending)
        quant(s, nrm, M, cfg.hidden)
    if s.q4:  # q, k and v in one launch
        lq, lk, lv = W["q_proj"], W["k_proj"], W["v_proj"]
        rpb = q4_rows_a_block(M, bool(K.quant_exact))
        s.emit(K.gemv_q4_x3, (sum(blocks_for(lin.out, rpb) for lin in (lq, lk, lv)), blocks_for(M, 4), 1),
               (128, 1, 1), lq.w, lq.d, A("q"), lq.out, lk.w, lk.d, A("kraw", li), lk.out,
               lv.w, lv.d, A("vraw"), lv.out, xq, xd, lq.nb, M)
    else:
        gemv(s, W["q_proj"], nrm, A("q"))
        gemv(s, W["k_proj"], nrm, A("kraw", li))
        gemv(s, W["v_proj"], nrm, A("vraw"))
    heads(s, li, W)
    attn = In("attn", li)
    if s.fused and s.q4 and K.attn_split:  # the attention kernels quantize their own output
        attention(s.b, s.T, s.emit, In("qrope", li), A("attn", li), li, s.pos0, M, xq, xd, s.qmode)
    else:
        attention(s.b, s.T, s.emit, In("qrope", li), A("attn", li), li, s.pos0, M)
        quant(s, attn, M, nh * hd)
    gemv(s, W["o_proj"], attn, A("ores", li), res=x_in)


def heads(s: Step, li: int, W) -> None:
    """QK-norm and RoPE of the q and k heads, the KV rows into the cache (isolate: the reference's
    rows, copied)."""
    cfg, K, M, A, In = s.b.model.cfg, s.K, s.lay.M, s.A, s.In
    nh, nkv, hd, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, float(np.float32(cfg.eps))
    c = s.b.cache[li]
    cache_ptrs = (0, 0, 0, 0) if s.isolate else (c["k"], c["ks"], c["v"], c["vs"])
    if s.fuse_heads:
        s.emit(K.heads, (nh + 2 * nkv, M, 1), (32, 1, 1), A("q"), A("qn"), A("qrope", li),
               W["q_norm"], A("kraw", li), A("knorm", li), A("kpre", li), W["k_norm"], A("vraw"), A("k", li),
               A("ks", li), A("v", li), A("vs", li), *cache_ptrs, A("cos"), A("sin"), nh, nkv, hd, eps,
               s.pos0, s.T.dpos, K.heads_flags)
    else:
        s.emit(K.qknorm, (nh + nkv, M, 1), (32, 1, 1), A("q"), A("qn"), W["q_norm"],
               In("kraw", li), A("knorm", li), W["k_norm"], nh, nkv, hd, eps)
        s.emit(K.rotate, (nh + nkv, M, 1), (blocks_for(hd // 2, 32) * 32, 1, 1), A("qn"), A("qrope", li),
               In("knorm", li), A("kpre", li), A("cos"), A("sin"), nh, nkv, hd)
        k_in = In("kpre", li) if s.b.deep else A("kpre", li)
        s.emit(K.kv_rows, (2 * nkv, M, 1), (32, 1, 1), k_in, A("vraw"), A("k", li), A("ks", li),
               A("v", li), A("vs", li), *cache_ptrs, s.pos0, nkv, hd, s.T.dpos)
    if s.isolate:  # the cache holds the reference's rows
        for f in KV_FIELDS:
            rb = s.b._row_bytes[f]
            s.items.append(Copy(c[f] + s.pos0 * rb, In(f, li), M * rb))


def ffn_block(s: Step, li: int, W) -> ExpertSum | None:
    """Layer li's post-attention norm and its MoE or dense MLP (cfg.layer_is_moe: a qwen3_moe model
    may have dense layers) with the residual; the expert sum where the next norm adds it
    (fuse_combine), whatever kind of layer that norm belongs to."""
    cfg, K, M, A = s.b.model.cfg, s.K, s.lay.M, s.A
    h, F = cfg.hidden, cfg.layer_ffn_dim(li)
    xq, xd = A("xq"), A("xd")
    ores = s.In("ores", li)
    pnrm = A("pnrm", li)
    norm(s, ores, W["post_attention_layernorm"], pnrm, (xq, xd, s.qmode) if s.fuse_all else (0, 0, 0))
    if not s.fuse_all:
        quant(s, pnrm, M, h)
    aq, ad = (A("aq"), A("ad")) if s.q4 else (0, 0)
    if not cfg.layer_is_moe(li):
        gemv(s, W["gate_proj"], pnrm, A("g"))
        gemv(s, W["up_proj"], pnrm, A("u"))
        silu(K, s.emit, A("g"), A("u"), A("a"), aq, ad, M * F)
        # the down projection reads silu's own quantization of its output
        if s.b.deep:  # the deep key moe is the MLP output alone: the same GEMV without the residual
            gemv(s, W["down_proj"], A("a"), A("moe", li), x_q=A("aq"), x_d=A("ad"))
        gemv(s, W["down_proj"], A("a"), A("x", li), res=ores, x_q=A("aq"), x_d=A("ad"))
        return None
    k, E = cfg.top_k, cfg.n_experts
    gemv(s, W["gate"], pnrm, A("router", li))
    # the exact router's extra warp forms the ordered sum while the others rank (moe.cuh)
    s.emit(K.router, (M, 1, 1), (blocks_for(E, 32) * 32 + 32 * bool(K.moe_exact), 1, 1), A("router", li),
           A("topk", li), A("topw", li), E, k, int(cfg.norm_topk_prob), K.exp_exact)
    P = M * k
    if s.fuse_swiglu:  # g and u stay inside the launch: nothing after silu reads them
        lg, lu = W["gate_proj"], W["up_proj"]
        s.emit(K.experts_swiglu, (F // 32, P, 1), (SWIGLU_THREADS, 1, 1), lg.w, lg.d, lu.w, lu.d, A("topk", li),
               xq, xd, k, F, lg.nb, A("a"), aq, ad, K.moe_exact, K.exp_exact, K.quant_exact)
    else:
        gemv_experts(s, W["gate_proj"], A("g"), W["up_proj"], A("u"), A("topk", li), pnrm, xq, xd, k, P)
        silu(K, s.emit, A("g"), A("u"), A("a"), aq, ad, P * F)
    if s.fold_combine:  # a block takes its rows of all k slots and adds them up
        ld = W["down_proj"]
        s.emit(K.down_combine, (blocks_for(h, EXPERT_ROWS), M, 1), (32 * k, 1, 1), ld.w, ld.d,
               A("y"), A("topk", li), A("aq"), A("ad"), h, ld.nb, k, A("topw", li), ores, A("moe", li),
               A("x", li), K.moe_exact)
        return None
    gemv_experts(s, W["down_proj"], A("y"), None, 0, A("topk", li), A("a"), A("aq"), A("ad"), 1, P)
    if s.fuse_combine:  # done by the norm behind it
        return ExpertSum(A("y"), A("topw", li), ores, A("moe", li), A("x", li), k)
    s.emit(K.combine, (blocks_for(h, 256), M, 1), (256, 1, 1), A("y"), A("topw", li),
           ores, A("moe", li), A("x", li), h, k)
    return None


def head(s: Step, pending: ExpertSum | None, hash_body: bool) -> None:
    """The final norm (with the last layer's expert sum, if left to it) and lm_head; HASH_BODY once
    the last key but the logits is written."""
    cfg, A = s.b.model.cfg, s.A
    last_fused = pending is not None  # the last layer's x comes out of the final norm's launch
    if hash_body and not last_fused:
        s.items.append(HASH_BODY)
    x_last = s.In("x", cfg.n_layers - 1)
    norm(s, x_last, s.b.dm.norm, A("fnrm"), (A("xq"), A("xd"), s.qmode) if s.fuse_all else (0, 0, 0), pending)
    if not s.fuse_all:
        quant(s, A("fnrm"), s.lay.M, cfg.hidden)
    if hash_body and last_fused:
        s.items.append(HASH_BODY)
    gemv(s, s.b.dm.lm_head, A("fnrm"), A("logits"))


def norm(s: Step, x: int, w: int, out: int, quant_args: tuple, pending: ExpertSum | None = None) -> None:
    """RMSNorm of x (or of the pending expert sum) into out, with its q8_0 if asked."""
    K, M, h, eps = s.K, s.lay.M, s.b.model.cfg.hidden, float(np.float32(s.b.model.cfg.eps))
    if pending is not None:
        p = pending
        s.emit(K.combine_rmsnorm, (M, 1, 1), (256, 1, 1), p.y, p.topw, p.res, p.moe, p.x, p.k,
               K.moe_exact, w, out, h, eps, *quant_args)
    else:
        s.emit(K.rmsnorm, (M, 1, 1), (256, 1, 1), x, w, out, h, eps, *quant_args)


def quant(s: Step, x: int, rows: int, n: int) -> None:
    """The q8_0 of x for the q4_0 GEMV behind it (f32 weights read x itself)."""
    if s.q4:
        total = rows * n
        s.emit(s.K.quantize, (blocks_for(total, 256), 1, 1), (256, 1, 1), x, s.A("xq"), s.A("xd"), total)


def gemv(s: Step, lin: DeviceLinear, x: int, y: int, res: int = 0, x_q: int | None = None,
         x_d: int | None = None) -> None:
    """y[M, out] = (res +) lin @ x; x: the f32 input (q4_0 reads its quantization x_q/x_d, by default
    the step's xq/xd)."""
    K, M, q4 = s.K, s.lay.M, s.q4
    grid = (blocks_for(lin.out, q4_rows_a_block(M, bool(K.quant_exact)) if q4 else 4), blocks_for(M, 4), 1)
    if q4:
        x_q = s.A("xq") if x_q is None else x_q
        x_d = s.A("xd") if x_d is None else x_d
        s.emit(K.gemv, grid, (128, 1, 1), lin.w, lin.d, x_q, x_d, res, y, lin.out, lin.nb, M)
    else:
        s.emit(K.gemv, grid, (128, 1, 1), lin.w, x, res, y, lin.out, lin.inp, M)


def gemv_experts(s: Step, l0: DeviceLinear, y0: int, l1: DeviceLinear | None, y1: int, eidx: int, x: int,
                 x_q: int, x_d: int, x_div: int, pairs: int) -> None:
    """The selected experts' l0 (and l1, in the same launch) of `pairs` (column, slot) pairs."""
    K = s.K
    grid = (blocks_for(l0.out, 4 * (EXPERT_ROWS if s.q4 else 1)), pairs, 2 if l1 is not None else 1)
    if s.q4:
        s.emit(K.gemv_experts, grid, (128, 1, 1), l0.w, l0.d, y0, l1.w if l1 else 0,
               l1.d if l1 else 0, y1, eidx, x_q, x_d, x_div, l0.out, l0.nb)
    else:
        s.emit(K.gemv_experts, grid, (128, 1, 1), l0.w, y0, l1.w if l1 else 0, y1, eidx, x,
               x_div, l0.out, l0.inp)


def attention(b, T: Target, emit, q: int, out: int, layer: int, pos0: int, M: int, xq: int = 0, xd: int = 0,
              quant: int = 0) -> None:
    """Attention of M columns at positions pos0.. over the layer's cache (q, out: [M, n_q*hd]).
    quant (1 fast, 2 exact; split kernels only): also write out's q8_0 to xq/xd."""
    cfg, K = b.model.cfg, b.kernels
    c = b.cache[layer]
    if K.attn_split:
        nh, nkv, hd, cap = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, max(1, b.capacity)
        scale = float(b.model.attn_scale)
        # a graph (dpos set) replays at any position: its grid covers the whole cache
        span = cap if T.dpos else pos0 + M
        sc = int(T.scores)
        if K.attn_exact:
            tiles = blocks_for(span, ATT_SPLIT_TILE)
            S, I = sc, sc + M * nh * cap * 4
            emit(K.split_tiles, (nh, M, tiles), (ATT_SPLIT_TILE, 1, 1), q, c["k"], c["ks"], S, I,
                 cap, pos0, nh, nkv, hd, scale, T.dpos)
            emit(K.split_reduce, (nh, M, hd // 32), (ATT_PV_THREADS, 1, 1), c["v"], c["vs"], S, I,
                 out, cap, pos0, nh, nkv, hd, K.exp_exact, T.dpos, xq, xd, quant, shared=K.pv_spread)
        else:
            tcap = blocks_for(cap, ATT_FAST_TILE)
            warps = min(nh // nkv, ATT_FAST_WARPS)  # a block: one kv head's query heads
            emit(K.split_tiles, (nkv, M, blocks_for(span, ATT_FAST_TILE)), (32 * warps, 1, 1),
                 q, c["k"], c["ks"], c["v"],
                 c["vs"], sc, tcap, pos0, nh, nkv, hd, scale, K.exp_exact, T.dpos)
            emit(K.split_reduce, (nh, M, 1), (blocks_for(hd, 32) * 32, 1, 1), sc, out, tcap, pos0, nh,
                 hd, K.exp_exact, T.dpos, xq, xd, quant)
        return
    args = (q, c["k"], c["ks"], c["v"], c["vs"], out)
    tail = (pos0, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, float(b.model.attn_scale), K.exp_exact,
            T.dpos)
    if K.attn_exact:  # tiles of up to 256 positions for the parallel part
        emit(K.attn, (cfg.n_heads, M, 1), (256, 1, 1), *args, *tail)
    else:
        emit(K.attn, (cfg.n_heads, M, 1), (256, 1, 1), *args, int(T.scores), T.cap_s or pos0 + M, *tail)


def silu(K: Kernels, emit, g: int, u: int, a: int, aq: int, ad: int, n: int) -> None:
    emit(K.silu_mul, (blocks_for(n, 256), 1, 1), (256, 1, 1), g, u, a, aq, ad, n, K.exp_exact,
         K.quant_exact)
