"""The attention kernels of several attention.cu versions on one q8 KV cache: device time per
launch and whether every version's output is bit-identical to the first's. For trying a
kernel change on the H200 without a full decode (one process, one cache, the sizes of a
Qwen3-30B-A3B layer by default).

    python3 scripts/gpu/gpu_attn_bench.py old=path/to/attention.cu new=kernels/attention.cu

A version is an attention.cu in a tree's kernels/, with the committed kernels' names and
arguments; its headers are read from beside it (kernels/launch.cuh sizes its blocks: a version's
ATT_PV_THREADS is its own tree's). The times are
device time a launch: --reps launches between two events, queued behind ~1.2 ms of memset so
that they run back to back whatever Python's launch rate (~9 us a launch, more than a scores
kernel takes; before commit c558faa the figures under ~10 us were that rate). Compare versions
within one run; the exact kernels run with the exact expf and the exact q8_0 of the output.
P·V launches without the app's spread (launches.pv_spread_bytes): launched back to back from
one stream the two measured the same (git show e2fcc3f8df:final2/attn_alone.txt; e2fcc3f8df is the
run folder's git tree id in commit 731bc0e).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def define(src: str, name: str) -> int:
    """An integer #define of src, its macros expanded (ATT_PV_THREADS = (32 + ATT_PV_STAGE)...); the
    first one wins: a version's own #define ahead of an #ifndef default (main passes the version's
    text, then its module source with kernels/launch.cuh inlined)."""
    defs: dict[str, str] = {}
    for k, v in re.findall(r"^#define (\w+) ([^/\n]+)", src, flags=re.M):
        defs.setdefault(k, v)
    expr = defs[name]
    for _ in range(8):
        expr = re.sub(r"[A-Z_][A-Z0-9_]*", lambda m: f"({defs.get(m.group(0), m.group(0))})", expr)
    return int(eval(expr, {"__builtins__": {}}))


def random_cache(nh: int, nkv: int, hd: int, cap: int, rising: bool = False) -> tuple[np.ndarray, ...]:
    """(q, k, v, k scales, v scales) of one decode column over a q8 cache of cap positions, seed 0;
    rising: K scales growing with the position (the running max moves at many positions)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal(nh * hd).astype(np.float32)
    kc = rng.integers(-127, 128, (cap, nkv, hd)).astype(np.int8)
    vc = rng.integers(-127, 128, (cap, nkv, hd)).astype(np.int8)
    ks = (rng.random((cap, nkv)) * 0.02 + 0.001).astype(np.float32)
    if rising:
        ks *= np.float32(1) + np.arange(cap, dtype=np.float32)[:, None] * np.float32(8 / cap)
    vs = (rng.random((cap, nkv)) * 0.02 + 0.001).astype(np.float32)
    return q, kc, vc, ks, vs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("versions", nargs="+", help="label=attention.cu")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rising", action="store_true",
                    help="K scales growing with the position, so the running max moves at many positions"
                         " (the recurrence's rescaling steps, c != 1)")
    args = ap.parse_args()

    import pycuda.autoinit  # noqa: F401
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    from kestrel_tui.backends.cuda.runtime import NVCC_OPTIONS, compile_ptx, module_source, ptx_formats

    nh, nkv, hd, T = args.heads, args.kv_heads, args.head_dim, args.ctx
    cap, pos0 = T, T - 1
    d_q, d_kc, d_vc, d_ks, d_vs = (cuda.to_device(a) for a in random_cache(nh, nkv, hd, cap, args.rising))
    S, I = cuda.mem_alloc(nh * cap * 4), cuda.mem_alloc(nh * cap * 4)
    out, xq, xd = cuda.mem_alloc(nh * hd * 4), cuda.mem_alloc(nh * hd), cuda.mem_alloc(nh * hd // 32 * 4)
    scale = float(np.float32(hd ** -0.5))
    backlog = cuda.mem_alloc(1 << 30)
    ref = None
    for spec in args.versions:
        label, _, path = spec.partition("=")
        own = Path(path).read_text()
        text = module_source("attention", own, Path(path).resolve().parent)  # with its own tree's headers
        mod = SourceModule(text, options=NVCC_OPTIONS, no_extern_c=True)
        ka, kb = mod.get_function("attn_exact_scores_q8"), mod.get_function("attn_exact_pv_q8")
        formats = ptx_formats(compile_ptx(text, "sm_90"))  # this version's own parameter lists
        ka.prepare(formats["attn_exact_scores_q8"])
        kb.prepare(formats["attn_exact_pv_q8"])
        tile = define(own + "\n" + text, "ATT_SPLIT_TILE")
        pv_block = (define(own + "\n" + text, "ATT_PV_THREADS"), 1, 1)

        def scores():
            ka.prepared_call((nh, 1, -(-T // tile)), (tile, 1, 1), d_q, d_kc, d_ks, S, I, cap, pos0, nh, nkv, hd,
                             scale, 0)

        def pv():
            kb.prepared_call((nh, 1, hd // 32), pv_block, d_vc, d_vs, S, I, out, cap, pos0, nh, nkv, hd, 1, 0,
                             xq, xd, 2)

        times = {}
        for name, fn in (("scores", scores), ("pv", pv)):
            fn()
            for _ in range(4):  # ~1.2 ms of backlog: the timed launches queue up behind it and run
                cuda.memset_d32_async(backlog, 0, (1 << 30) // 4)  # back to back (Python's rate ~9 us)
            e0, e1 = cuda.Event(), cuda.Event()
            e0.record()
            for _ in range(args.reps):
                fn()
            e1.record()
            e1.synchronize()
            times[name] = e1.time_since(e0) * 1e3 / args.reps
        cuda.Context.synchronize()
        got = (cuda.from_device(out, (nh * hd,), np.float32).view(np.uint32),
               cuda.from_device(xq, (nh * hd,), np.int8),
               cuda.from_device(xd, (nh * hd // 32,), np.float32).view(np.uint32))
        if ref is None:
            ref, same = got, "reference"
        else:
            same = "bit-identical" if all(np.array_equal(a, b) for a, b in zip(got, ref)) else \
                f"DIFFERS ({int((got[0] != ref[0]).sum())} of {nh * hd} outputs)"
        print(f"{label:12} scores {times['scores']:6.2f} us  pv {times['pv']:6.2f} us  (block {pv_block[0]})  {same}",
              flush=True)


if __name__ == "__main__":
    main()
