"""Which kernel each op of a step runs, and how a step's launches are queued.

CudaBackend (backend.py) owns the buffers, the graph and the hashing; `select_kernels` picks each
op's kernels for the toggles, a loop over the op registry (backends/toggles.py: each op's kernels
by role, each role a kernel of each version, and the bits its exact version sets in the step's
flags), then the choices the formats make (q4_0 or f32 weights, a q8 or f32 cache), into a frozen
Kernels; plan.py lists a step's launches for a Target (the buffers and stream they go to) and
`run` queues them. A direct step and a graph capture (graph.py) run the same plan. Grids, blocks
and scratch are sized by the kernels' own constants (kernels/launch.cuh, read below).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import UsageError
from ...model.config import Config, cuda_unsupported
from ..base import KV_FIELDS
from ..toggles import REGISTRY
from .runtime import KERNEL_DIR


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
SCAN_THREADS = _C["SCAN_THREADS"]  # fnv_scan's block
MAX_EXPERTS = _C["MOE_MAX_EXPERTS"]  # the router's block
MAX_TOPK = _C["MOE_MAX_TOPK"]  # the router's selection
SCAN_SEG = _C["SCAN_SEG"]  # bytes a thread of fnv_scan
FUSED_MAX_ROW = _C["FUSED_MAX_ROW"]  # combine_rmsnorm_*: hidden sizes up to
COMBINE_MAX_K = _C["COMBINE_MAX_K"]  # down_combine_*: a warp a slot
SWIGLU_THREADS = _C["SWIGLU_THREADS"]  # experts_swiglu_*'s block
# fields whose reference buffer replaces the subject's as the next op's input (isolate mode)
FED = frozenset({"emb", "x", "nrm", "kraw", "knorm", "kpre", "qrope", "attn", "ores", *KV_FIELDS})


def refuse_unsupported(cfg: Config) -> None:
    """The one-line UsageError for a model the cuda subject would decode as another model: a feature its
    kernels do not implement (model/config.py cuda_unsupported) or a size their fixed blocks cannot hold.
    Asked before any device work (engines/decoders.py check_decoder) and by the backend itself."""
    problem = cuda_unsupported(cfg)
    if problem is None and (cfg.head_dim % 16 or cfg.head_dim > 256):
        problem = f"head_dim {cfg.head_dim} is not supported (needs a multiple of 16, at most 256)"
    if problem is None and cfg.n_experts > MAX_EXPERTS:
        problem = f"{cfg.n_experts} experts are not supported (at most {MAX_EXPERTS})"
    if problem is None and cfg.n_experts and cfg.top_k > MAX_TOPK:
        problem = f"top_k {cfg.top_k} is not supported (at most {MAX_TOPK})"
    if problem:
        raise UsageError(f"cuda subject: {problem}; the sim subject is the fallback (--subject sim)")


def blocks_for(n: int, per: int) -> int:
    """The blocks of ``per`` that cover ``n`` (a grid's size)."""
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
    """The kernels a step launches and the flags they pass, for one toggle set: what select_kernels
    chose, fixed for the backend's life. A field named like a registry role holds that role's
    kernel of the version the toggles ask for; the others say which role the formats chose."""
    embed: object                 # gemv.cu embed_q4 | embed_f32 (no versions)
    quantize: object
    gemv: object                  # gemv_q4 | gemv_f32
    gemv_q4_x3: object | None     # q, k and v in one launch (q4_0)
    gemv_experts: object          # gemv_q4_experts | gemv_f32_experts
    rmsnorm: object
    qknorm: object
    rope_table: object
    rotate: object
    kv_rows: object               # kv_rows_q8 | kv_rows_f32
    heads: object                 # fused.cu heads_fused: QK-norm, RoPE and the KV rows (no versions)
    attn_split: bool              # split_tiles and split_reduce (q8 cache, head_dim a multiple of 32)
    attn: object                  # single_q8 | single_f32: one kernel (the other caches and head_dims)
    split_tiles: object | None
    split_reduce: object | None
    pv_spread: int                # dynamic shared memory of the exact P.V kernel (pv_spread_bytes)
    router: object
    silu_mul: object
    combine: object
    experts_swiglu: object | None  # fused.cu: gate and up of the experts with silu(g)*u and its q8_0 (q4_0)
    down_combine: object | None   # fused.cu: the down GEMV adds the expert sum (q4_0)
    combine_rmsnorm: object       # fused.cu: the expert sum with the norm behind it
    # the flags (the registry's op.flags: each op's exact version sets its bits)
    exp_exact: int
    quant_exact: int
    heads_flags: int
    moe_exact: int
    attn_exact: int


def select_kernels(rt, model, kv: str, exact: frozenset[str], options) -> Kernels:
    """Each op's kernels of the version the toggles `exact` ask for, and the flags they set, by the
    op registry (backends/toggles.py); then the roles the formats choose: q4_0 or f32 weights, a q8
    or f32 cache (split attention needs a q8 cache and a head_dim a multiple of 32).
    options: backends/cuda/options.py."""
    names: dict[str, tuple[str, str]] = {}  # role -> (module, kernel)
    flags: dict[str, int] = {}
    for op in REGISTRY:
        on = op.name in exact
        names.update({role: (k.module, k.version(on)) for role, k in op.kernels.items()})
        for flag, bits in op.flags.items():
            flags[flag] = flags.get(flag, 0) | (bits if on else 0)

    def pick(role: str):
        return rt.kernel(*names[role])

    q4, q8 = model.fmt == "q4_0", kv == "q8"
    attn_split = q8 and model.cfg.head_dim % 32 == 0
    split_reduce = pick("split_reduce") if attn_split else None
    pv_spread = pv_spread_bytes(rt, options.pv_spread) if attn_split and flags["attn_exact"] else 0
    if pv_spread:  # past 48 KB less the static memory a kernel must opt in (pdl.py: its own load)
        split_reduce.set_attribute(rt.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, pv_spread)
    return Kernels(
        embed=rt.kernel("gemv", "embed_q4" if q4 else "embed_f32"),
        quantize=pick("quantize"),
        gemv=pick("gemv_q4" if q4 else "gemv_f32"),
        gemv_q4_x3=pick("gemv_q4_x3") if q4 else None,
        gemv_experts=pick("gemv_q4_experts" if q4 else "gemv_f32_experts"),
        rmsnorm=pick("rmsnorm"),
        qknorm=pick("qknorm"),
        rope_table=pick("rope_table"),
        rotate=pick("rotate"),
        kv_rows=pick("kv_rows_q8" if q8 else "kv_rows_f32"),
        heads=rt.kernel("fused", "heads_fused"),
        attn_split=attn_split,
        attn=pick("single_q8" if q8 else "single_f32"),
        split_tiles=pick("split_tiles") if attn_split else None,
        split_reduce=split_reduce,
        pv_spread=pv_spread,
        router=pick("router"),
        silu_mul=pick("silu_mul"),
        combine=pick("combine"),
        experts_swiglu=pick("experts_swiglu") if q4 else None,
        down_combine=pick("down_combine") if q4 else None,
        combine_rmsnorm=pick("combine_rmsnorm"),
        **flags,
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


def scratch_bytes(b, M: int) -> int:
    """The attention scratch (Target.scores) an M-column step needs at any position of the cache."""
    cfg, cap, K = b.model.cfg, max(1, b.capacity), b.kernels
    nh, hd = cfg.n_heads, cfg.head_dim
    if K.attn_split:
        return (2 * M * nh * cap * 4 if K.attn_exact  # S, I
                else M * nh * blocks_for(cap, ATT_FAST_TILE) * (hd + 2) * 4)
    return 4 if K.attn_exact else M * nh * cap * 4
