"""Which kernel each op of a step runs, and the launches of one decode step as a plan.

CudaBackend (backend.py) owns the buffers, the graph and the hashing; this module turns one
step of backends/decoder.py into a list of kernel launches: `select_kernels` picks each op's
fast or exact kernel by the toggles (a frozen Kernels; kernels/*.cu list the versions), `plan`
lists a step's launches in order for a Target (the buffers and stream they go to) — every
probe buffer written into the arena (layout.py), fused where kernels/fused.cu has a launch for
several ops (outside isolate mode; the fuse option turns them off) — and `run` queues a plan.
A direct step and a graph capture (graph.py) run the same plan. Grids, blocks and scratch are
sized by the kernels' own constants (kernels/launch.cuh, read below).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..base import KV_FIELDS
from ..toggles import BY_NAME, kernel
from .layout import Layout
from .runtime import KERNEL_DIR
from .weights import DeviceLinear



def _launch_constants() -> dict[str, int]:
    """kernels/launch.cuh's #defines (each a number or an expression of earlier ones)."""
    values: dict[str, int] = {}
    for name, expr in re.findall(r"^#define (\w+) ([^/\n]+)", (KERNEL_DIR / "launch.cuh").read_text(), flags=re.M):
        for known, v in values.items():
            expr = re.sub(rf"\b{known}\b", str(v), expr)
        if not re.fullmatch(r"[\d\s()+*-]+", expr):
            raise ValueError(f"kernels/launch.cuh {name}: {expr!r} is not an integer expression")
        values[name] = int(eval(expr))  # digits, + - * and parentheses only (checked above)
    return values


_C = _launch_constants()
ATT_SPLIT_TILE = _C["ATT_SPLIT_TILE"]  # the exact scores' tiles
ATT_FAST_TILE = _C["ATT_FAST_TILE"]  # the fast flash-decoding tiles
ATT_FAST_WARPS = _C["ATT_FAST_WARPS"]  # query heads a part block works on at once
ATT_PV_THREADS = _C["ATT_PV_THREADS"]  # attn_exact_pv_q8's block
EXPERT_ROWS = _C["EXPERT_ROWS"]  # rows a warp of gemv_q4_experts_*
GEMV_ROWS1 = _C["GEMV_ROWS1"]  # rows a warp of the q4_0 dense GEMVs at M = 1
FUSED_MAX_ROW = _C["FUSED_MAX_ROW"]  # combine_rmsnorm_*: hidden sizes up to
COMBINE_MAX_K = _C["COMBINE_MAX_K"]  # down_combine_*: a warp a slot
# fields whose reference buffer replaces the subject's as the next op's input (isolate mode)
FED = frozenset({"emb", "x", "nrm", "kraw", "knorm", "kpre", "qrope", "attn", "ores", *KV_FIELDS})


def _blocks(n: int, per: int) -> int:
    return -(-n // per)


def launch(k, grid, block, stream, *args, shared: int = 0, launcher=None) -> None:
    """One kernel launch on `stream` (None: the default stream); through `launcher` (a PdlLauncher,
    while a decode graph captures with PDL) or PyCUDA. shared: dynamic shared memory bytes (the
    kernel has opted in to them: select_kernels)."""
    if launcher is not None:
        from .pdl import stream_handle

        launcher.launch(k, grid, block, stream_handle(stream), args, shared)
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


def pv_spread_bytes(rt, enabled: bool = True) -> int:
    """Dynamic shared memory (unused) for attn_exact_pv_q8 so that no two of its blocks share an
    SM: half the SM's shared memory. A P·V block is one latency-bound serial warp and its
    producers, and blocks sharing an SM slow each other down. That happens when the kernel is
    launched early (the PDL trigger, kernels/common.cuh) onto the SMs the scores kernel leaves
    free (figures: results/gpu-h200-speed.md). 0 (no spread) where the runtime does not know the
    SMs' shared memory, where an SM has 96 KB or less (there half of it plus the kernel's ~36 KB
    of static memory can pass what one block may have), or with the pv_spread option off."""
    per_sm = int(getattr(rt, "smem_per_sm", 0) or 0)
    if not enabled or per_sm <= 2 * 48 * 1024:
        return 0
    return per_sm // 2


@dataclass(frozen=True)
class Kernels:
    """Each op's kernel for one toggle set (kernels/*.cu list the versions) and the flags its launches
    pass: what select_kernels chose, fixed for the backend's life."""
    quant: object
    gemv: object
    gemv3: object | None   # q, k and v in one launch (q4_0)
    gemv_e: object         # expert stacks
    embed: object
    rms: object
    qkn: object
    rtab: object
    rope: object
    kv: object
    attn: object           # the single-kernel attention (f32 cache, or head_dim not a multiple of 32)
    attn_exact: bool
    attn_split: bool       # scores and P.V in two kernels (q8 cache, head_dim a multiple of 32)
    att_a: object | None
    att_b: object | None
    pv_spread: int         # dynamic shared memory of the exact P.V kernel (pv_spread_bytes)
    router: object
    silu: object
    combine: object
    heads: object          # fused.cu: QK-norm, RoPE and the KV rows
    down_comb: object | None  # fused.cu: the down GEMV adds the expert sum (q4_0)
    comb_rms: object       # fused.cu: the expert sum with the norm behind it
    exp_exact: int
    quant_exact: int
    heads_flags: int
    moe_exact: int


def select_kernels(rt, model, kv: str, exact: frozenset[str], options) -> Kernels:
    """Each op's fast or exact kernel for the toggles `exact`, by the op registry (backends/toggles.py:
    an op's kernels of each version); options: backends/cuda/options.py."""
    k = rt.kernel
    q4 = model.fmt == "q4_0"
    kvt = "q8" if kv == "q8" else "f32"
    attn_exact = "attention" in exact
    att = BY_NAME["attention"].cuda["exact" if attn_exact else "fast"]
    attn_split = kv == "q8" and model.cfg.head_dim % 32 == 0
    att_a = att_b = None
    if attn_split:
        att_a, att_b = (k("attention", name) for name in att[2:])  # the split pair of the version
    pv_spread = pv_spread_bytes(rt, options.pv_spread) if attn_split and attn_exact else 0
    if pv_spread:  # past 48 KB less the static memory a kernel must opt in (pdl.py: its own load)
        att_b.set_attribute(rt.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, pv_spread)
    def pick(module: str, stem: str):
        return k(module, kernel(stem, exact))

    return Kernels(
        quant=pick("gemv", "quantize_q8_0"),
        gemv=pick("gemv", "gemv_q4" if q4 else "gemv_f32"),
        gemv3=pick("gemv", "gemv_q4_x3") if q4 else None,
        gemv_e=pick("gemv", "gemv_q4_experts" if q4 else "gemv_f32_experts"),
        embed=k("gemv", "embed_q4") if q4 else k("gemv", "embed_f32"),
        rms=pick("norm", "rmsnorm"),
        qkn=pick("norm", "qknorm"),
        rtab=pick("rope", "rope_table"),
        rope=pick("rope", "rope"),
        kv=pick("kvquant", "kvquant") if kv == "q8" else k("kvquant", "kv_rows_f32"),
        attn=k("attention", att[0] if kvt == "q8" else att[1]),  # the single-kernel versions
        attn_exact=attn_exact, attn_split=attn_split, att_a=att_a, att_b=att_b, pv_spread=pv_spread,
        router=pick("moe", "router"),
        silu=pick("moe", "silu_mul"),
        combine=pick("moe", "combine"),
        heads=k("fused", "heads_fused"),
        down_comb=pick("fused", "down_combine") if q4 else None,
        comb_rms=pick("fused", "combine_rmsnorm"),
        exp_exact=int("expf" in exact),
        quant_exact=int("gemm" in exact),
        heads_flags=(1 if "norm" in exact else 0) | (2 if "rope" in exact else 0) | (4 if "kvquant" in exact else 0),
        moe_exact=int("moe" in exact),
    )


@dataclass(frozen=True)
class Target:
    """Where a step's launches go and what they read: a direct step's buffers (backend.prepare) or a
    captured graph's own (graph.py). dpos: a device int holding the position (graphs replay at any
    position; 0: the position is an argument); cap_s: the fast attention's scores stride (0: the
    step's span)."""
    stream: object          # None: the default stream
    base: int               # the arena (layout.py)
    tokens: int             # int32 [M]
    scores: int             # the attention scratch
    feed: int | None = None  # isolate: the reference's buffers, laid out as the arena
    dpos: int = 0
    cap_s: int = 0


@dataclass(frozen=True)
class Launch:
    kernel: object
    grid: tuple
    block: tuple
    args: tuple
    shared: int = 0


@dataclass(frozen=True)
class Copy:  # device to device (isolate: the reference's KV rows into the cache)
    dst: int
    src: int
    n: int


HASH_BODY = "hash body"  # where the hash of every key but the logits starts, on the hash stream


def run(rt, plan: list, stream, launcher=None, on_hash_body=None) -> None:
    """Queue a step's plan on `stream`: through `launcher` (pdl.py: a capture with PDL) or PyCUDA."""
    for item in plan:
        if isinstance(item, Launch):
            launch(item.kernel, item.grid, item.block, stream, *item.args, shared=item.shared, launcher=launcher)
        elif isinstance(item, Copy):
            rt.cuda.memcpy_dtod(item.dst, item.src, item.n)
        elif on_hash_body is not None:
            on_hash_body()


def plan(b, lay: Layout, T: Target, pos0: int, isolate: bool = False, hash_body: bool = False) -> list:
    """The launches of one step, in order: Launch and Copy items, and HASH_BODY where the hash of
    every key but the logits may start on a second stream (overlapping the final norm and
    lm_head; backend.hash then adds the logits' hash and joins the streams)."""
    cfg, dm, K = b.model.cfg, b.dm, b.kernels
    M = lay.M
    steps: list = []

    def emit(k, grid, block, *args, shared: int = 0) -> None:
        steps.append(Launch(k, grid, block, args, shared))

    h, hd, nh, nkv = cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    eps = float(np.float32(cfg.eps))
    base = T.base
    feed = T.feed if isolate else None

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
    qmode = 2 if K.quant_exact else 1

    def quant(x: int, rows: int, n: int) -> None:
        if q4:
            total = rows * n
            emit(K.quant, (_blocks(total, 256), 1, 1), (256, 1, 1), x, xq, xd, total)

    def gemv(lin: DeviceLinear, x: int, y: int, res: int = 0, x_q: int = xq, x_d: int = xd) -> None:
        """y[M, out] = (res +) lin @ x; x: the f32 input (q4_0 reads its quantization x_q/x_d)."""
        grid = (_blocks(lin.out, q4_rows_a_block(M, bool(K.quant_exact)) if q4 else 4), _blocks(M, 4), 1)
        if q4:
            emit(K.gemv, grid, (128, 1, 1), lin.w, lin.d, x_q, x_d, res, y, lin.out, lin.nb, M)
        else:
            emit(K.gemv, grid, (128, 1, 1), lin.w, x, res, y, lin.out, lin.inp, M)

    def gemv_experts(l0: DeviceLinear, y0: int, l1: DeviceLinear | None, y1: int, eidx: int, x: int,
                     x_q: int, x_d: int, x_div: int, pairs: int) -> None:
        grid = (_blocks(l0.out, 4 * (EXPERT_ROWS if q4 else 1)), pairs, 2 if l1 is not None else 1)
        if q4:
            emit(K.gemv_e, grid, (128, 1, 1), l0.w, l0.d, y0, l1.w if l1 else 0,
                 l1.d if l1 else 0, y1, eidx, x_q, x_d, x_div, l0.out, l0.nb)
        else:
            emit(K.gemv_e, grid, (128, 1, 1), l0.w, y0, l1.w if l1 else 0, y1, eidx, x,
                 x_div, l0.out, l0.inp)

    # embedding and the step's RoPE table
    if q4:
        emit(K.embed, (_blocks(h, 256), M, 1), (256, 1, 1), dm.embed.w, dm.embed.d,
             T.tokens, A("emb"), h // 32)
    else:
        emit(K.embed, (_blocks(h, 256), M, 1), (256, 1, 1), dm.embed.w, T.tokens,
             A("emb"), h)
    half = hd // 2
    emit(K.rtab, (_blocks(half, 64), M, 1), (64, 1, 1), dm.inv_freq, A("cos"), A("sin"),
         pos0, half, T.dpos)
    # fused launches (kernels/fused.cu): never in isolate mode, where each op reads the
    # reference's inputs
    fused = b.fuse and feed is None
    fuse_heads = fused and b.kv == "q8" and hd in (64, 128, 256)  # fused.cu rope_regs: hd/64 in 1, 2, 4
    # the down GEMV adds the expert sum (fused.cu down_combine_*); else the sum goes with the
    # norm behind it (combine_rmsnorm_*)
    fold_combine = fused and fuse_all and cfg.is_moe and cfg.top_k <= COMBINE_MAX_K
    fuse_combine = fused and cfg.is_moe and h <= FUSED_MAX_ROW and not fold_combine
    pending = None  # a MoE layer's expert sum, left to the norm behind it (fuse_combine)

    def norm(x: int, w: int, out: int, quant_args: tuple) -> None:
        """RMSNorm of x (or of the pending expert sum) into out, with its q8_0 if asked."""
        nonlocal pending
        if pending is not None:
            y, topw, res, moe, xo, k = pending
            emit(K.comb_rms, (M, 1, 1), (256, 1, 1), y, topw, res, moe, xo, k,
                 K.moe_exact, w, out, h, eps, *quant_args)
            pending = None
        else:
            emit(K.rms, (M, 1, 1), (256, 1, 1), x, w, out, h, eps, *quant_args)

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
            rpb = q4_rows_a_block(M, bool(K.quant_exact))
            emit(K.gemv3, (sum(_blocks(lin.out, rpb) for lin in (lq, lk, lv)), _blocks(M, 4), 1),
                 (128, 1, 1), lq.w, lq.d, A("q"), lq.out, lk.w, lk.d, A("kraw", li), lk.out,
                 lv.w, lv.d, A("vraw"), lv.out, xq, xd, lq.nb, M)
        else:
            gemv(W["q_proj"], nrm, A("q"))
            gemv(W["k_proj"], nrm, A("kraw", li))
            gemv(W["v_proj"], nrm, A("vraw"))
        c = b.cache[li]
        cache_ptrs = (0, 0, 0, 0) if isolate else (c["k"], c["ks"], c["v"], c["vs"])
        if fuse_heads:  # QK-norm, RoPE and the KV rows in one launch
            emit(K.heads, (nh + 2 * nkv, M, 1), (32, 1, 1), A("q"), A("qn"), A("qrope", li),
                 W["q_norm"], A("kraw", li), A("knorm", li), A("kpre", li), W["k_norm"], A("vraw"), A("k", li),
                 A("ks", li), A("v", li), A("vs", li), *cache_ptrs, A("cos"), A("sin"), nh, nkv, hd, eps,
                 pos0, T.dpos, K.heads_flags)
        else:
            emit(K.qkn, (nh + nkv, M, 1), (32, 1, 1), A("q"), A("qn"), W["q_norm"],
                 In("kraw", li), A("knorm", li), W["k_norm"], nh, nkv, hd, eps)
            emit(K.rope, (nh + nkv, M, 1), (_blocks(half, 32) * 32, 1, 1), A("qn"), A("qrope", li),
                 In("knorm", li), A("kpre", li), A("cos"), A("sin"), nh, nkv, hd)
            k_in = In("kpre", li) if b.deep else A("kpre", li)
            emit(K.kv, (2 * nkv, M, 1), (32, 1, 1), k_in, A("vraw"), A("k", li), A("ks", li),
                 A("v", li), A("vs", li), *cache_ptrs, pos0, nkv, hd, T.dpos)
        if isolate:  # the cache holds the reference's rows
            for f in KV_FIELDS:
                rb = b._row_bytes[f]
                steps.append(Copy(c[f] + pos0 * rb, In(f, li), M * rb))
        attn = In("attn", li)
        if fused and q4 and K.attn_split:  # the attention kernels quantize their own output
            attention(b, T, emit, In("qrope", li), A("attn", li), li, pos0, M, xq, xd, qmode)
        else:
            attention(b, T, emit, In("qrope", li), A("attn", li), li, pos0, M)
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
            emit(K.router, (M, 1, 1), (_blocks(E, 32) * 32, 1, 1), A("router", li),
                 A("topk", li), A("topw", li), E, k, int(cfg.norm_topk_prob), K.exp_exact)
            P = M * k
            gemv_experts(W["gate_proj"], A("g"), W["up_proj"], A("u"), A("topk", li), pnrm, xq, xd, k, P)
            silu(K, emit, A("g"), A("u"), A("a"), A("aq") if q4 else 0, A("ad") if q4 else 0, P * F)
            if fold_combine:  # a block takes its rows of all k slots and adds them up
                ld = W["down_proj"]
                emit(K.down_comb, (_blocks(h, EXPERT_ROWS), M, 1), (32 * k, 1, 1), ld.w, ld.d,
                     A("y"), A("topk", li), A("aq"), A("ad"), h, ld.nb, k, A("topw", li), ores, A("moe", li),
                     A("x", li), K.moe_exact)
            else:
                gemv_experts(W["down_proj"], A("y"), None, 0, A("topk", li), A("a"), A("aq"), A("ad"), 1, P)
                if fuse_combine:  # done by the norm behind it
                    pending = (A("y"), A("topw", li), ores, A("moe", li), A("x", li), k)
                else:
                    emit(K.combine, (_blocks(h, 256), M, 1), (256, 1, 1), A("y"), A("topw", li),
                         ores, A("moe", li), A("x", li), h, k)
        else:
            gemv(W["gate_proj"], pnrm, A("g"))
            gemv(W["up_proj"], pnrm, A("u"))
            silu(K, emit, A("g"), A("u"), A("a"), A("aq") if q4 else 0, A("ad") if q4 else 0, M * F)
            # the down projection reads silu's own quantization of its output
            gemv(W["down_proj"], A("a"), A("x", li), res=ores, x_q=A("aq"), x_d=A("ad"))
    last_fused = pending is not None  # the last layer's x comes out of the final norm's launch
    if hash_body and not last_fused:
        steps.append(HASH_BODY)
    x_last = In("x", cfg.n_layers - 1)
    norm(x_last, dm.norm, A("fnrm"), (xq, xd, qmode) if fuse_all else (0, 0, 0))
    if not fuse_all:
        quant(A("fnrm"), M, h)
    if hash_body and last_fused:
        steps.append(HASH_BODY)
    gemv(dm.lm_head, A("fnrm"), A("logits"))
    return steps


def scratch_bytes(b, M: int) -> int:
    """The attention scratch (Target.scores) an M-column step needs at any position of the cache."""
    cfg, cap, K = b.model.cfg, max(1, b.capacity), b.kernels
    nh, hd = cfg.n_heads, cfg.head_dim
    if K.attn_split:
        return (2 * M * nh * cap * 4 if K.attn_exact  # S, I
                else M * nh * _blocks(cap, ATT_FAST_TILE) * (hd + 2) * 4)
    return 4 if K.attn_exact else M * nh * cap * 4


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
            tiles = _blocks(span, ATT_SPLIT_TILE)
            S, I = sc, sc + M * nh * cap * 4
            emit(K.att_a, (nh, M, tiles), (ATT_SPLIT_TILE, 1, 1), q, c["k"], c["ks"], S, I,
                 cap, pos0, nh, nkv, hd, scale, T.dpos)
            emit(K.att_b, (nh, M, hd // 32), (ATT_PV_THREADS, 1, 1), c["v"], c["vs"], S, I,
                 out, cap, pos0, nh, nkv, hd, K.exp_exact, T.dpos, xq, xd, quant, shared=K.pv_spread)
        else:
            tcap = _blocks(cap, ATT_FAST_TILE)
            warps = min(nh // nkv, ATT_FAST_WARPS)  # a block: one kv head's query heads
            emit(K.att_a, (nkv, M, _blocks(span, ATT_FAST_TILE)), (32 * warps, 1, 1),
                 q, c["k"], c["ks"], c["v"],
                 c["vs"], sc, tcap, pos0, nh, nkv, hd, scale, K.exp_exact, T.dpos)
            emit(K.att_b, (nh, M, 1), (_blocks(hd, 32) * 32, 1, 1), sc, out, tcap, pos0, nh,
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
    emit(K.silu, (_blocks(n, 256), 1, 1), (256, 1, 1), g, u, a, aq, ad, n, K.exp_exact,
         K.quant_exact)
