"""Where the exact heads_fused's and the exact router's extra time over fast goes: the committed
device functions (fused.cu heads_fused_head, moe.cuh router) on one head and one router column,
timed in SM cycles inside the kernel (a one-block launch is shorter than Python's launch rate, so
device time a launch would time the launches).

In the graph (gpu_step_timeline.py) heads_fused's exact share is ~1.1 µs a layer above fast's,
its QK-norm alone ~0.6, and the exact router's ~0.8 above fast's, half of it the exponential.
Here each toggle of heads_fused's flags is set alone (1 QK-norm, 2 RoPE, 4 KV rule: the flags
the cuda step passes), on a q, a k and a v head; and the router runs fast and exact, with the
device expf or contract T1's, whose table is read from global memory (L2) or from the block's
copy in shared memory (expf_table_to_shared, made before the clock starts, as the kernels make
it ahead of their wait).

    python3 scripts/gpu/gpu_heads_router_bench.py [--reps 200] [--experts 128] [--top-k 8] [--logit-std 2 50]

The router's logits are N(0, std²) for each --logit-std: 50 is what the full-size synthetic model's
routers give (most experts' e underflow to tiny or zero values there), 2 a trained router's scale.

Each row: cycles of thread 0 from entry to after the block's last store, min and median over
--reps launches; and whether the outputs are the bits of the row the variant should match (the
same toggles with the other table).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROBE = r"""
// heads_fused_head on head h (column 0); cyc[0]: lane 0's cycles from entry to after its last store.
extern "C" __global__ void heads_timed(const float *q, float *qn, float *qrope, const float *q_w, const float *kraw,
                                       float *knorm, float *kpre, const float *k_w, const float *vraw,
                                       signed char *k_out, float *ks_out, signed char *v_out, float *vs_out,
                                       const float *cos_t, const float *sin_t, int n_q, int n_kv, int hd, float eps,
                                       int flags, int h, long long *cyc) {
  const long long c0 = clock64();
  heads_fused_head(q, qn, qrope, q_w, kraw, knorm, kpre, k_w, vraw, k_out, ks_out, v_out, vs_out, nullptr, nullptr,
                   nullptr, nullptr, cos_t, sin_t, n_q, n_kv, hd, eps, 0, flags, h, 0);
  __syncwarp();
  if (threadIdx.x == 0) cyc[0] = clock64() - c0;
}

// router<exact> on one column; the table: the block's shared copy (made before the clock starts)
// or EXPF_T in global memory.
extern "C" __global__ void router_timed(const float *logits, int *topk, float *topw, int E, int k, int exact,
                                        int exact_exp, int shared_table, long long *cyc) {
  __shared__ unsigned long long expT[EXPF_TABLE_LEN];
  if (shared_table) expf_table_to_shared(expT);
  __syncthreads();
  const long long c0 = clock64();
  const unsigned long long *T = shared_table ? expT : EXPF_T;
  if (exact)
    router<true>(logits, topk, topw, E, k, 1, exact_exp, 0, T);
  else
    router<false>(logits, topk, topw, E, k, 1, exact_exp, 0, T);
  __syncthreads();
  if (threadIdx.x == 0) cyc[0] = clock64() - c0;
}
"""

HEADS = (  # (label, head kind, flags)
    ("k fast", "k", 0), ("k QK-norm exact", "k", 1), ("k RoPE exact", "k", 2), ("k KV rule exact", "k", 4),
    ("k exact", "k", 7), ("q fast", "q", 0), ("q exact", "q", 3), ("v fast", "v", 0), ("v exact", "v", 4))
ROUTERS = (  # (label, exact, exact_exp, shared_table)
    ("fast, device expf", 0, 0, 0), ("fast, T1 global", 0, 1, 0), ("fast, T1 shared", 0, 1, 1),
    ("exact, device expf", 1, 0, 0), ("exact, T1 global", 1, 1, 0), ("exact, T1 shared", 1, 1, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--logit-std", type=float, nargs="+", default=[2.0, 50.0])
    args = ap.parse_args()

    import pycuda.autoinit  # noqa: F401
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    from kestrel_tui.backends.cuda.runtime import KERNEL_DIR, NVCC_OPTIONS, module_source

    mod = SourceModule(module_source("fused", (KERNEL_DIR / "fused.cu").read_text() + PROBE),
                       options=NVCC_OPTIONS, no_extern_c=True)
    rng = np.random.default_rng(0)
    n_q, n_kv, hd, E, k = 32, 4, 128, args.experts, args.top_k

    def dev(a):
        return cuda.to_device(np.ascontiguousarray(a, dtype=a.dtype))

    f32 = np.float32
    q, kraw, vraw = (dev(rng.standard_normal(n * hd).astype(f32)) for n in (n_q, n_kv, n_kv))
    q_w, k_w = (dev((1 + 0.1 * rng.standard_normal(hd)).astype(f32)) for _ in range(2))
    ang = rng.random(hd // 2).astype(f32) * f32(6)
    cos_t, sin_t = dev(np.cos(ang).astype(f32)), dev(np.sin(ang).astype(f32))
    outs = [cuda.mem_alloc(4 * n_q * hd) for _ in range(4)]  # qn, qrope, knorm, kpre
    k_out, v_out = cuda.mem_alloc(n_kv * hd), cuda.mem_alloc(n_kv * hd)
    ks_out, vs_out = cuda.mem_alloc(4 * n_kv), cuda.mem_alloc(4 * n_kv)
    cyc = cuda.mem_alloc(8)
    head_of = {"q": 0, "k": n_q, "v": n_q + n_kv}
    name = cuda.Context.get_device().name()
    print(f"{name}: one warp a head (n_q {n_q}, n_kv {n_kv}, head_dim {hd}); cycles inside the kernel"
          f" (lane 0, entry to its last store), {args.reps} launches")
    fn = mod.get_function("heads_timed")

    def timed(launch) -> list[int]:
        out = []
        for _ in range(args.reps):
            launch()
            cuda.Context.synchronize()
            out.append(int(cuda.from_device(cyc, (1,), np.int64)[0]))
        return out

    for label, kind, flags in HEADS:
        c = timed(lambda: fn(q, outs[0], outs[1], q_w, kraw, outs[2], outs[3], k_w, vraw, k_out, ks_out, v_out,
                             vs_out, cos_t, sin_t, np.int32(n_q), np.int32(n_kv), np.int32(hd), f32(1e-6),
                             np.int32(flags), np.int32(head_of[kind]), cyc, block=(32, 1, 1), grid=(1, 1)))
        print(f"  heads {label:18} cycles min {min(c):6d}  median {int(np.median(c)):6d}")

    topk, topw = cuda.mem_alloc(4 * k), cuda.mem_alloc(4 * k)
    rfn = mod.get_function("router_timed")
    warps = -(-E // 32)
    z = rng.standard_normal(E)
    for std in args.logit_std:
        logits = dev((std * z).astype(f32))
        print(f"router: {E} experts, top {k}, renormalised, logits N(0, {std:g}²); block {32 * warps} threads fast,"
              f" {32 * warps + 32} exact")
        ref = {}
        for label, exact, exact_exp, shared in ROUTERS:
            block = 32 * (warps + exact)
            c = timed(lambda: rfn(logits, topk, topw, np.int32(E), np.int32(k), np.int32(exact),
                                  np.int32(exact_exp), np.int32(shared), cyc, block=(block, 1, 1), grid=(1, 1)))
            got = cuda.from_device(topk, (k,), np.int32).tobytes() + cuda.from_device(topw, (k,), f32).tobytes()
            key = (exact, exact_exp)
            same = "" if key not in ref else ("  same bits as with the global table" if ref[key] == got else
                                              "  DIFFERS from the global table's")
            ref.setdefault(key, got)
            print(f"  router {label:18} cycles min {min(c):6d}  median {int(np.median(c)):6d}{same}")


if __name__ == "__main__":
    main()
