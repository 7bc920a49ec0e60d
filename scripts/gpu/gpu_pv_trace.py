"""Where the exact P·V kernel's time goes, stage by stage: attn_exact_pv_q8 of an attention.cu,
copied with clock64 trace points, run at Qwen3-30B-A3B sizes (32 q heads, 4 kv heads, head_dim 128)
on gpu_attn_bench.py's random q8 cache. For two blocks it prints, per stage of ATT_PV_STAGE
positions, the cycles warp 0 (serial) is busy, the cycles the first producer thread is busy, and
when the block leaves the stage's barrier; and the SM clock (clock64 against %globaltimer).

    python3 scripts/gpu/gpu_pv_trace.py [CTX] [path/to/attention.cu]

The trace points go in by text: the kernel's stage loop, its serial/producer branches and its
final barrier keep the shapes they have in kernels/attention.cu (an assert says when not).
"""
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

TRACE_DECLS = """
__device__ long long g_tr[2][64][6];
__device__ long long g_hd[2][6];
__device__ __forceinline__ int trb() { return blockIdx.x == 0 && blockIdx.z == 0 ? 0 : (blockIdx.x == 17 && blockIdx.z == 2 ? 1 : -1); }
#ifndef PROD0  // a version may place its producers elsewhere
#define PROD0 (blockDim.x - ATT_PV_STAGE)  // the first producer thread, after the serial warp(s)
#endif
__device__ __forceinline__ long long gtime() { long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
"""
LOOP = "  for (int c0 = 0, buf = 0; c0 < T; c0 += ATT_PV_STAGE, buf ^= 1) {\n"


def traced(src: str) -> str:
    """attn_exact_pv_q8 of src as attn_pv_trace, with its trace points (g_tr: per stage, serial warp
    start and end, first producer start and end, last producer end, barrier out; g_hd: entry clock
    and time, first stage ready, exit clock and time, stages)."""
    m = re.search(r'extern "C" __global__ void __launch_bounds__\(ATT_PV_THREADS\)\nattn_exact_pv_q8.*?\n}\n', src, re.S)
    k = m.group(0).replace("attn_exact_pv_q8(", "attn_pv_trace(")
    k = k.replace("  pdl_wait();\n", "  const int tb = trb(); if (tb >= 0 && threadIdx.x == 0) { g_hd[tb][0] = clock64(); g_hd[tb][1] = gtime(); }\n  pdl_wait();\n", 1)
    assert LOOP in k
    k = k.replace(LOOP, "  if (tb >= 0 && threadIdx.x == 0) g_hd[tb][2] = clock64();\n  int st = 0;\n" + LOOP
                  + "    if (tb >= 0 && st < 64) { if (threadIdx.x == 0) g_tr[tb][st][0] = clock64(); if (threadIdx.x == PROD0) g_tr[tb][st][2] = clock64(); }\n", 1)
    k = k.replace("    } else if (c0 + ATT_PV_STAGE < T) {\n", "      if (tb >= 0 && st < 64 && threadIdx.x == 0) g_tr[tb][st][1] = clock64();\n    } else if (c0 + ATT_PV_STAGE < T) {\n", 1)
    k = k.replace("    __syncthreads();\n  }\n", "    if (tb >= 0 && st < 64 && threadIdx.x == PROD0) g_tr[tb][st][3] = clock64();\n    if (tb >= 0 && st < 64 && threadIdx.x == blockDim.x - 1) g_tr[tb][st][4] = clock64();\n    __syncthreads();\n    if (tb >= 0 && st < 64 && threadIdx.x == 0) g_tr[tb][st][5] = clock64();\n    st++;\n  }\n", 1)
    k = k.replace("    q8_0_warp(y, o, xq, xd, quant);\n  }\n}", "    q8_0_warp(y, o, xq, xd, quant);\n    if (tb >= 0 && threadIdx.x == 0) { __syncwarp(); g_hd[tb][3] = clock64(); g_hd[tb][4] = gtime(); g_hd[tb][5] = st; }\n  }\n}")
    assert k.count("g_tr") >= 6, k
    return src + TRACE_DECLS + k


def main() -> None:
    import pycuda.autoinit  # noqa: F401
    import pycuda.driver as cuda
    from gpu_attn_bench import define, random_cache
    from pycuda.compiler import SourceModule

    from kestrel_tui.backends.cuda.runtime import NVCC_OPTIONS, module_source

    T = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    path = Path(sys.argv[2] if len(sys.argv) > 2 else ROOT / "kernels/attention.cu").resolve()
    own = path.read_text()
    text = module_source("attention", traced(own), path.parent)  # with its own tree's headers
    tile, pv_block = define(own + "\n" + text, "ATT_SPLIT_TILE"), define(own + "\n" + text, "ATT_PV_THREADS")
    mod = SourceModule(text, options=NVCC_OPTIONS, no_extern_c=True)
    ka, kb = mod.get_function("attn_exact_scores_q8"), mod.get_function("attn_pv_trace")
    nh, nkv, hd = 32, 4, 128
    cap, pos0 = T, T - 1
    d_q, d_kc, d_vc, d_ks, d_vs = (cuda.to_device(a) for a in random_cache(nh, nkv, hd, cap))
    S, I = cuda.mem_alloc(nh * cap * 4), cuda.mem_alloc(nh * cap * 4)
    out, xq, xd = cuda.mem_alloc(nh * hd * 4), cuda.mem_alloc(nh * hd), cuda.mem_alloc(nh * hd // 32 * 4)
    i32 = np.int32
    ka(d_q, d_kc, d_ks, S, I, i32(cap), i32(pos0), i32(nh), i32(nkv), i32(hd), np.float32(hd ** -0.5), np.intp(0),
       grid=(nh, 1, -(-T // tile)), block=(tile, 1, 1))
    for _ in range(3):  # the last launch's trace is read
        kb(d_vc, d_vs, S, I, out, i32(cap), i32(pos0), i32(nh), i32(nkv), i32(hd), i32(1), np.intp(0), xq, xd, i32(2),
           grid=(nh, 1, hd // 32), block=(pv_block, 1, 1))
    cuda.Context.synchronize()
    tr = cuda.from_device(mod.get_global("g_tr")[0], (2, 64, 6), np.int64)
    h = cuda.from_device(mod.get_global("g_hd")[0], (2, 6), np.int64)
    for b in range(2):
        c0 = h[b, 0]
        cyc, ns = h[b, 3] - c0, h[b, 4] - h[b, 1]
        print(f"block {b}: {cyc} cycles, {ns} ns -> {cyc / ns:.3f} GHz; entry->first stage ready {h[b, 2] - c0} cyc;"
              f" stages {h[b, 5]}")
        print("  stage: serial_start serial_busy  prod0_busy prod_last_end  barrier_out (cycles from entry)")
        for s in range(int(h[b, 5])):
            r = tr[b, s]
            prod = r[3] - r[2] if r[3] else 0
            last = r[4] - c0 if r[4] else 0
            print(f"  {s:2d}: start {r[0] - c0:6d} serial {r[1] - r[0]:5d} prod0 {prod:5d} p_last_end {last:6d}"
                  f" bar_out {r[5] - c0:6d}")


if __name__ == "__main__":
    main()
