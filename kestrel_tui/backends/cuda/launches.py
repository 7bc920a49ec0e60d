"""Which kernel each op of a step runs, and the launch sequence of one decode step.

CudaBackend (backend.py) owns the buffers, the graph and the hashing; this module turns one
step of backends/decoder.py into kernel launches on its stream: `select_kernels` picks each
op's fast or exact kernel by the toggles (kernels/*.cu list the versions), `forward` launches
a step's ops in order — every probe buffer written into the arena (layout.py) — fused where
kernels/fused.cu has a launch for several ops (outside isolate mode, KESTREL_CUDA_FUSE=0 turns
them off). Grid shapes mirror the kernels' constants below.
"""
from __future__ import annotations

import os

import numpy as np

from ..base import KV_FIELDS
from . import pdl
from .layout import Layout
from .weights import DeviceLinear

ATT_SPLIT_TILE = 256  # kernels/attention.cu ATT_SPLIT_TILE (the exact scores' tiles)
ATT_FAST_TILE = 32  # kernels/attention.cu ATT_FAST_TILE (the fast flash-decoding tiles)
ATT_FAST_WARPS = 8  # kernels/attention.cu ATT_FAST_WARPS (query heads a part block works on at once)
ATT_PV_THREADS = 32 + 128  # kernels/attention.cu ATT_PV_THREADS (attn_exact_pv_q8's block)
EXPERT_ROWS = 4  # kernels/gemv.cuh EXPERT_ROWS (rows a warp of gemv_q4_experts_*)
GEMV_ROWS1 = 4  # kernels/gemv.cuh GEMV_ROWS1 (rows a warp of the q4_0 dense GEMVs at M = 1)
FUSED_MAX_ROW = 4096  # kernels/fused.cu FUSED_MAX_ROW (combine_rmsnorm_*: hidden sizes up to)
COMBINE_MAX_K = 8  # kernels/fused.cu COMBINE_MAX_K (down_combine_*: a warp a slot)
# fields whose reference buffer replaces the subject's as the next op's input (isolate mode)
FED = frozenset({"emb", "x", "nrm", "kraw", "knorm", "kpre", "qrope", "attn", "ores", *KV_FIELDS})


def _blocks(n: int, per: int) -> int:
    return -(-n // per)


def launch(k, grid, block, stream, *args, shared: int = 0) -> None:
    """One kernel launch on `stream` (None: the default stream); with PDL while a decode graph
    captures on it (pdl.py). shared: dynamic shared memory bytes (the kernel has opted in to
    them: select_kernels)."""
    if pdl.route(k, grid, block, stream, args, shared):
        return
    extra = {"shared_size": shared} if shared else {}
    if stream is None:
        k.prepared_call(grid, block, *args, **extra)
    else:
        k.prepared_async_call(grid, block, stream, *args, **extra)


def gemv_split(M: int, exact: bool) -> int:
    """Warps per output row of the q4_0 dense GEMV (mirror of kernels/gemv.cu gemv_split):
    the fast kernel splits K over 2 warps at M = 2..4 (and orders its lanes differently at
    M = 1 and from M = 5) like a tiled engine; the exact one never splits."""
    return 1 if exact else (2 if 2 <= M <= 4 else 1)


def q4_rows_a_block(M: int, exact: bool) -> int:
    """Output rows a 4-warp block of the q4_0 dense GEMVs takes (kernels/gemv.cuh gemv_q4):
    GEMV_ROWS1 a warp at M = 1, else 4 / gemv_split."""
    return 4 * GEMV_ROWS1 if M == 1 else 4 // gemv_split(M, exact)


def pv_spread_bytes(rt) -> int:
    """Dynamic shared memory (unused) for attn_exact_pv_q8 so that no two of its blocks share an
    SM: half the SM's shared memory. A P·V block is one latency-bound serial warp and its
    producers, and blocks sharing an SM slow each other down. That happens when the kernel is
    launched early (the PDL trigger, kernels/common.cuh) onto the SMs the scores kernel leaves
    free: exact +0.62 ms a full-size step; with the spread the trigger makes both paths faster.
    Without the trigger (the default) the spread is worth ~0.02 ms a step of exact
    (results/gpu-h200-issue6.md, session 7). 0 (no spread) where the runtime does not know the
    SMs' shared memory, where an SM has 96 KB or less (there half of it plus the kernel's ~36 KB
    of static memory can pass what one block may have), or with KESTREL_PV_SPREAD=0."""
    per_sm = int(getattr(rt, "smem_per_sm", 0) or 0)
    if os.environ.get("KESTREL_PV_SPREAD", "1") == "0" or per_sm <= 2 * 48 * 1024:
        return 0
    return per_sm // 2


def select_kernels(b) -> None:
    """Set b.k_* to each op's kernel for b's toggles (b.exact), and the flags the launches pass."""
    ex, k = b.exact, b.rt.kernel

    def pick(on: str) -> str:
        return "exact" if on in ex else "fast"

    q4 = b.model.fmt == "q4_0"
    g = pick("gemm")
    b.k_quant = k("gemv", f"quantize_q8_0_{g}")
    b.k_gemv = k("gemv", f"gemv_q4_{g}") if q4 else k("gemv", f"gemv_f32_{g}")
    b.k_gemv3 = k("gemv", f"gemv_q4_x3_{g}") if q4 else None
    b.k_gemv_e = k("gemv", f"gemv_q4_experts_{g}") if q4 else k("gemv", f"gemv_f32_experts_{g}")
    b.k_embed = k("gemv", "embed_q4") if q4 else k("gemv", "embed_f32")
    b.k_rms = k("norm", f"rmsnorm_{pick('norm')}")
    b.k_qkn = k("norm", f"qknorm_{pick('norm')}")
    b.k_rtab = k("rope", f"rope_table_{pick('rope')}")
    b.k_rope = k("rope", f"rope_{pick('rope')}")
    b.k_kv = k("kvquant", f"kvquant_{pick('kvquant')}") if b.kv == "q8" else k("kvquant", "kv_rows_f32")
    kvt = "q8" if b.kv == "q8" else "f32"
    b.attn_exact = "attention" in ex
    b.k_attn = k("attention", f"attn_exact_{kvt}") if b.attn_exact else k("attention", f"attn_fast_{kvt}")
    # the split attention kernels (q8 cache, head_dim a multiple of 32); KESTREL_ATTN_SPLIT=0: the
    # single-kernel versions
    hd = b.model.cfg.head_dim
    b.attn_split = (b.kv == "q8" and hd % 32 == 0 and os.environ.get("KESTREL_ATTN_SPLIT", "1") != "0")
    if b.attn_split:
        if b.attn_exact:
            b.k_att_a, b.k_att_b = k("attention", "attn_exact_scores_q8"), k("attention", "attn_exact_pv_q8")
        else:
            b.k_att_a, b.k_att_b = k("attention", "attn_fast_part_q8"), k("attention", "attn_fast_combine")
    b.pv_spread = pv_spread_bytes(b.rt) if b.attn_split and b.attn_exact else 0
    if b.pv_spread:  # past 48 KB less the static memory a kernel must opt in (pdl.py: its own load)
        b.k_att_b.set_attribute(b.rt.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, b.pv_spread)
    b.k_router = k("moe", f"router_{pick('moe')}")
    b.k_silu = k("moe", f"silu_mul_{pick('moe')}")
    b.k_combine = k("moe", f"combine_{pick('moe')}")
    b.exp_exact = int("expf" in ex)
    b.quant_exact = int("gemm" in ex)
    b.k_heads = k("fused", "heads_fused")
    if q4:
        b.k_down_comb = k("fused", f"down_combine_{g}")
    b.k_comb_rms = k("fused", f"combine_rmsnorm_{pick('norm')}")
    b.heads_flags = (1 if "norm" in ex else 0) | (2 if "rope" in ex else 0) | (4 if "kvquant" in ex else 0)
    b.moe_exact = int("moe" in ex)


def forward(b, lay: Layout, pos0: int, isolate: bool = False, hash_body: bool = False) -> None:
    """Launch the kernels of one step (inside rt.active()). hash_body: once the last layer is
    queued, hash every key but the logits on a second stream, overlapping the final norm
    and lm_head (hash() then adds the logits' hash and joins the streams)."""
    cfg, dm, cuda = b.model.cfg, b.dm, b.rt.cuda
    M = lay.M
    h, hd, nh, nkv = cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    eps = float(np.float32(cfg.eps))
    base = b.base
    feed = b.feed_base if isolate else None

    def A(name, layer=None):  # the subject's own buffer
        return base + lay.offset(name, layer)

    def In(name, layer=None):  # an op's input: the reference's buffer in isolate mode
        if feed is not None and name in FED:
            return feed + lay.offset(name, layer)
        return A(name, layer)

    q4 = dm.fmt == "q4_0"
    xq, xd = A("xq"), A("xd")

    # q4_0: the norms quantize their own output for the GEMV behind them (one launch less);
    # in isolate mode the input norm's GEMVs read the reference's nrm, so it stays apart
    fuse_all = q4 and h % 32 == 0
    fuse_q = fuse_all and feed is None
    qmode = 2 if b.quant_exact else 1

    def quant(x: int, rows: int, n: int) -> None:
        if q4:
            total = rows * n
            launch(b.k_quant, (_blocks(total, 256), 1, 1), (256, 1, 1), b.stream, x, xq, xd, total)

    def gemv(lin: DeviceLinear, x: int, y: int, res: int = 0, x_q: int = xq, x_d: int = xd) -> None:
        """y[M, out] = (res +) lin @ x; x: the f32 input (q4_0 reads its quantization x_q/x_d)."""
        grid = (_blocks(lin.out, q4_rows_a_block(M, bool(b.quant_exact)) if q4 else 4), _blocks(M, 4), 1)
        if q4:
            launch(b.k_gemv, grid, (128, 1, 1), b.stream, lin.w, lin.d, x_q, x_d, res, y, lin.out, lin.nb, M)
        else:
            launch(b.k_gemv, grid, (128, 1, 1), b.stream, lin.w, x, res, y, lin.out, lin.inp, M)

    def gemv_experts(l0: DeviceLinear, y0: int, l1: DeviceLinear | None, y1: int, eidx: int, x: int,
                     x_q: int, x_d: int, x_div: int, pairs: int) -> None:
        grid = (_blocks(l0.out, 4 * (EXPERT_ROWS if q4 else 1)), pairs, 2 if l1 is not None else 1)
        if q4:
            launch(b.k_gemv_e, grid, (128, 1, 1), b.stream, l0.w, l0.d, y0, l1.w if l1 else 0,
                   l1.d if l1 else 0, y1, eidx, x_q, x_d, x_div, l0.out, l0.nb)
        else:
            launch(b.k_gemv_e, grid, (128, 1, 1), b.stream, l0.w, y0, l1.w if l1 else 0, y1, eidx, x,
                   x_div, l0.out, l0.inp)

    # embedding and the step's RoPE table
    if q4:
        launch(b.k_embed, (_blocks(h, 256), M, 1), (256, 1, 1), b.stream, dm.embed.w, dm.embed.d,
               b.tokens_ptr, A("emb"), h // 32)
    else:
        launch(b.k_embed, (_blocks(h, 256), M, 1), (256, 1, 1), b.stream, dm.embed.w, b.tokens_ptr,
               A("emb"), h)
    half = hd // 2
    launch(b.k_rtab, (_blocks(half, 64), M, 1), (64, 1, 1), b.stream, dm.inv_freq, A("cos"), A("sin"),
           pos0, half, b.dpos)
    # fused launches (kernels/fused.cu): never in isolate mode, where each op reads the
    # reference's inputs
    fused = b.fuse and feed is None
    fuse_heads = fused and b.kv == "q8" and hd in (64, 128, 256)  # fused.cu rope_regs: hd/64 in 1, 2, 4
    # the down GEMV adds the expert sum (fused.cu down_combine_*); else the sum goes with the
    # norm behind it (combine_rmsnorm_*)
    fold_combine = fused and fuse_all and cfg.is_moe and cfg.top_k <= COMBINE_MAX_K and "combine" in b.folds
    fuse_combine = fused and cfg.is_moe and h <= FUSED_MAX_ROW and not fold_combine
    pending = None  # a MoE layer's expert sum, left to the norm behind it (fuse_combine)

    def norm(x: int, w: int, out: int, quant_args: tuple) -> None:
        """RMSNorm of x (or of the pending expert sum) into out, with its q8_0 if asked."""
        nonlocal pending
        if pending is not None:
            y, topw, res, moe, xo, k = pending
            launch(b.k_comb_rms, (M, 1, 1), (256, 1, 1), b.stream, y, topw, res, moe, xo, k,
                   b.moe_exact, w, out, h, eps, *quant_args)
            pending = None
        else:
            launch(b.k_rms, (M, 1, 1), (256, 1, 1), b.stream, x, w, out, h, eps, *quant_args)

    for li, W in enumerate(dm.layers):
        x_in = In("emb") if li == 0 else In("x", li - 1)
        nrm = In("nrm", li)
        if fuse_q:  # the norm writes the q8_0 of its output too
            norm(x_in, W["input_layernorm"], A("nrm", li), (xq, xd, qmode))
        else:  # isolate: the GEMVs quantize the reference's nrm
            norm(x_in, W["input_layernorm"], A("nrm", li), (0, 0, 0))
            quant(nrm, M, h)
        if q4:  # q, k and v in one launch
            lq, lk, lv = W["q_proj"], W["k_proj"], W["v_proj"]
            rpb = q4_rows_a_block(M, bool(b.quant_exact))
            launch(b.k_gemv3, (sum(_blocks(lin.out, rpb) for lin in (lq, lk, lv)), _blocks(M, 4), 1),
                   (128, 1, 1), b.stream, lq.w, lq.d, A("q"), lq.out, lk.w, lk.d, A("kraw", li), lk.out,
                   lv.w, lv.d, A("vraw"), lv.out, xq, xd, lq.nb, M)
        else:
            gemv(W["q_proj"], nrm, A("q"))
            gemv(W["k_proj"], nrm, A("kraw", li))
            gemv(W["v_proj"], nrm, A("vraw"))
        c = b.cache[li]
        cache_ptrs = (0, 0, 0, 0) if isolate else (c["k"], c["ks"], c["v"], c["vs"])
        if fuse_heads:  # QK-norm, RoPE and the KV rows in one launch
            launch(b.k_heads, (nh + 2 * nkv, M, 1), (32, 1, 1), b.stream, A("q"), A("qn"), A("qrope", li),
                   W["q_norm"], A("kraw", li), A("knorm", li), A("kpre", li), W["k_norm"], A("vraw"), A("k", li),
                   A("ks", li), A("v", li), A("vs", li), *cache_ptrs, A("cos"), A("sin"), nh, nkv, hd, eps,
                   pos0, b.dpos, b.heads_flags)
        else:
            launch(b.k_qkn, (nh + nkv, M, 1), (32, 1, 1), b.stream, A("q"), A("qn"), W["q_norm"],
                   In("kraw", li), A("knorm", li), W["k_norm"], nh, nkv, hd, eps)
            launch(b.k_rope, (nh + nkv, M, 1), (_blocks(half, 32) * 32, 1, 1), b.stream, A("qn"), A("qrope", li),
                   In("knorm", li), A("kpre", li), A("cos"), A("sin"), nh, nkv, hd)
            k_in = In("kpre", li) if b.deep else A("kpre", li)
            launch(b.k_kv, (2 * nkv, M, 1), (32, 1, 1), b.stream, k_in, A("vraw"), A("k", li), A("ks", li),
                   A("v", li), A("vs", li), *cache_ptrs, pos0, nkv, hd, b.dpos)
        if isolate:  # the cache holds the reference's rows
            for f in KV_FIELDS:
                rb = b._row_bytes[f]
                cuda.memcpy_dtod(c[f] + pos0 * rb, In(f, li), M * rb)
        attn = In("attn", li)
        if fused and q4 and b.attn_split:  # the attention kernels quantize their own output
            attention(b, In("qrope", li), A("attn", li), li, pos0, M, xq, xd, qmode)
        else:
            attention(b, In("qrope", li), A("attn", li), li, pos0, M)
            quant(attn, M, nh * hd)
        gemv(W["o_proj"], attn, A("ores", li), res=x_in)
        ores = In("ores", li)
        pnrm = A("pnrm", li)
        F = cfg.ffn_dim
        norm(ores, W["post_attention_layernorm"], pnrm, (xq, xd, qmode) if fuse_all else (0, 0, 0))
        if not fuse_all:
            quant(pnrm, M, h)
        if cfg.is_moe:
            k, E = cfg.top_k, cfg.n_experts
            gemv(W["gate"], pnrm, A("router", li))
            launch(b.k_router, (M, 1, 1), (_blocks(E, 32) * 32, 1, 1), b.stream, A("router", li),
                   A("topk", li), A("topw", li), E, k, int(cfg.norm_topk_prob), b.exp_exact)
            P = M * k
            gemv_experts(W["gate_proj"], A("g"), W["up_proj"], A("u"), A("topk", li), pnrm, xq, xd, k, P)
            silu(b, A("g"), A("u"), A("a"), A("aq") if q4 else 0, A("ad") if q4 else 0, P * F)
            if fold_combine:  # a block takes its rows of all k slots and adds them up
                ld = W["down_proj"]
                launch(b.k_down_comb, (_blocks(h, EXPERT_ROWS), M, 1), (32 * k, 1, 1), b.stream, ld.w, ld.d,
                       A("y"), A("topk", li), A("aq"), A("ad"), h, ld.nb, k, A("topw", li), ores, A("moe", li),
                       A("x", li), b.moe_exact)
            else:
                gemv_experts(W["down_proj"], A("y"), None, 0, A("topk", li), A("a"), A("aq"), A("ad"), 1, P)
                if fuse_combine:  # done by the norm behind it
                    pending = (A("y"), A("topw", li), ores, A("moe", li), A("x", li), k)
                else:
                    launch(b.k_combine, (_blocks(h, 256), M, 1), (256, 1, 1), b.stream, A("y"), A("topw", li),
                           ores, A("moe", li), A("x", li), h, k)
        else:
            gemv(W["gate_proj"], pnrm, A("g"))
            gemv(W["up_proj"], pnrm, A("u"))
            silu(b, A("g"), A("u"), A("a"), A("aq") if q4 else 0, A("ad") if q4 else 0, M * F)
            # the down projection reads silu's own quantization of its output
            gemv(W["down_proj"], A("a"), A("x", li), res=ores, x_q=A("aq"), x_d=A("ad"))
    last_fused = pending is not None  # the last layer's x comes out of the final norm's launch
    if hash_body and not last_fused:
        b._launch_body_hash(lay)
    x_last = In("x", cfg.n_layers - 1)
    norm(x_last, dm.norm, A("fnrm"), (xq, xd, qmode) if fuse_all else (0, 0, 0))
    if not fuse_all:
        quant(A("fnrm"), M, h)
    if hash_body and last_fused:
        b._launch_body_hash(lay)
    gemv(dm.lm_head, A("fnrm"), A("logits"))


def scratch_bytes(b, M: int) -> int:
    """The attention scratch (b._scores) an M-column step needs at any position of the cache."""
    cfg, cap = b.model.cfg, max(1, b.capacity)
    nh, hd = cfg.n_heads, cfg.head_dim
    if b.attn_split:
        return (2 * M * nh * cap * 4 if b.attn_exact  # S, I
                else M * nh * _blocks(cap, ATT_FAST_TILE) * (hd + 2) * 4)
    return 4 if b.attn_exact else M * nh * cap * 4


def attention(b, q: int, out: int, layer: int, pos0: int, M: int, xq: int = 0, xd: int = 0,
              quant: int = 0) -> None:
    """Attention of M columns at positions pos0.. over the layer's cache (q, out: [M, n_q*hd]).
    quant (1 fast, 2 exact; split kernels only): also write out's q8_0 to xq/xd."""
    cfg = b.model.cfg
    c = b.cache[layer]
    if b.attn_split:
        nh, nkv, hd, cap = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, max(1, b.capacity)
        scale = float(b.model.attn_scale)
        # a graph (dpos set) replays at any position: its grid covers the whole cache
        span = cap if b.dpos else pos0 + M
        sc = int(b._scores)
        if b.attn_exact:
            tiles = _blocks(span, ATT_SPLIT_TILE)
            S, I = sc, sc + M * nh * cap * 4
            launch(b.k_att_a, (nh, M, tiles), (ATT_SPLIT_TILE, 1, 1), b.stream, q, c["k"], c["ks"], S, I,
                   cap, pos0, nh, nkv, hd, scale, b.dpos)
            launch(b.k_att_b, (nh, M, hd // 32), (ATT_PV_THREADS, 1, 1), b.stream, c["v"], c["vs"], S, I,
                   out, cap, pos0, nh, nkv, hd, b.exp_exact, b.dpos, xq, xd, quant, shared=b.pv_spread)
        else:
            tcap = _blocks(cap, ATT_FAST_TILE)
            warps = min(nh // nkv, ATT_FAST_WARPS)  # a block: one kv head's query heads
            launch(b.k_att_a, (nkv, M, _blocks(span, ATT_FAST_TILE)), (32 * warps, 1, 1), b.stream,
                   q, c["k"], c["ks"], c["v"],
                   c["vs"], sc, tcap, pos0, nh, nkv, hd, scale, b.exp_exact, b.dpos)
            launch(b.k_att_b, (nh, M, 1), (_blocks(hd, 32) * 32, 1, 1), b.stream, sc, out, tcap, pos0, nh,
                   hd, b.exp_exact, b.dpos, xq, xd, quant)
        return
    args = (q, c["k"], c["ks"], c["v"], c["vs"], out)
    tail = (pos0, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, float(b.model.attn_scale), b.exp_exact,
            b.dpos)
    if b.attn_exact:  # tiles of up to 256 positions for the parallel part
        launch(b.k_attn, (cfg.n_heads, M, 1), (256, 1, 1), b.stream, *args, *tail)
    else:
        launch(b.k_attn, (cfg.n_heads, M, 1), (256, 1, 1), b.stream, *args, int(b._scores), b.cap_s or pos0 + M, *tail)


def silu(b, g: int, u: int, a: int, aq: int, ad: int, n: int) -> None:
    launch(b.k_silu, (_blocks(n, 256), 1, 1), (256, 1, 1), b.stream, g, u, a, aq, ad, n, b.exp_exact,
           b.quant_exact)
