"""Where exact RMSNorm's extra time over fast goes: the committed kernels and diagnostic variants of
the exact one, on one row of the hidden size, timed in SM cycles inside the kernel (a launch of a
one-block kernel is shorter than Python's launch rate, so device time a launch would time the
launches).

ncu puts rmsnorm_exact ~1.1 µs a launch above rmsnorm_fast at full size (results/gpu-h200-speed.md,
2026-12-06, second set). The exact kernel differs from fast in three places; each variant changes
one of them to fast's way, so the cycles it saves are that place's share:

  exact          rmsnorm_row_exact (norm.cuh): terms of 8-blocks read again from global memory,
                 one thread's ordered chain over the hidden/8 terms (R2), 1/sqrt(ss/n + eps) with
                 IEEE divide and square root
  fast           rmsnorm_row_fast: FMA partial sums from registers, warp-shuffle tree, rsqrtf
  tree           exact with the chain replaced by fast's shuffle tree over the same terms
  rsqrt          exact with rsqrtf(ss * (1/n) + eps) instead of the IEEE divides and square root
  regs           exact with the terms formed from a second register copy loaded with the row
                 (no global read between the row's loads and the chain)

Only exact and fast give the contract's bits; the others are timing diagnostics (their outputs
are compared with exact's and the count of differing elements is printed).

    python3 scripts/gpu/gpu_norm_bench.py [--hidden 2048] [--reps 200]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("exact", "fast", "tree", "rsqrt", "regs")

SRC = r"""
#include "norm.cuh"

// rmsnorm_row_exact with one place changed (V: 2 tree, 3 rsqrt, 4 regs); see the module docstring.
template <int V>
__device__ __forceinline__ void rmsnorm_row_variant(const float *__restrict__ xr, const float *__restrict__ w,
                                                    float *__restrict__ yr, int n, float eps,
                                                    signed char *__restrict__ xq, float *__restrict__ xd,
                                                    int quant) {
  __shared__ __align__(16) float terms[NORM_MAX_TERMS];
  __shared__ float partial[NORM_THREADS / 32];
  __shared__ float rms_s;
  NormRow r;
  norm_load(xr, w, n, r);
  float own[8];
  if (V == 4 && threadIdx.x < n / 8) {
#pragma unroll
    for (int k = 0; k < 8; k++) own[k] = xr[8 * threadIdx.x + k];
  }
  const int n8 = n & ~7;
  for (int b = threadIdx.x; b < n8 / 8; b += blockDim.x) {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = V == 4 && b == threadIdx.x ? own[k] : xr[8 * b + k];
    float lo[4];
#pragma unroll
    for (int k = 0; k < 4; k++) lo[k] = FADD(FMUL(v[k], v[k]), FMUL(v[4 + k], v[4 + k]));
    terms[b] = FADD(FADD(lo[0], lo[1]), FADD(lo[2], lo[3]));
  }
  __syncthreads();
  if (V == 2) {
    float acc = 0.0f;
    for (int b = threadIdx.x; b < n8 / 8; b += blockDim.x) acc += terms[b];
    const float ss = norm_block_sum_fast(acc, partial);
    if (threadIdx.x == 0) rms_s = norm_rms_exact(ss, n, eps);
  } else if (threadIdx.x == 0) {
    const float ss = serial_sum_shared(terms, n8 / 8);
    rms_s = V == 3 ? norm_rms_fast(ss, n, eps) : norm_rms_exact(ss, n, eps);
  }
  __syncthreads();
  norm_store<true>(xr, w, n, r, rms_s, yr, xq, xd, quant, 0);
}

// One row by one block; cyc[0]: thread 0's cycles from entry to after the block's last store.
template <int V>
__device__ __forceinline__ void timed(const float *x, const float *w, float *y, int n, float eps,
                                      signed char *xq, float *xd, long long *cyc) {
  const long long c0 = clock64();
  if (V == 0) rmsnorm_row_exact(x, w, y, n, eps, xq, xd, 2, 0);
  else if (V == 1) rmsnorm_row_fast(x, w, y, n, eps, xq, xd, 1, 0);
  else rmsnorm_row_variant<V>(x, w, y, n, eps, xq, xd, 2);
  __syncthreads();
  if (threadIdx.x == 0) cyc[0] = clock64() - c0;
}
#define TIMED(V)                                                                                       \
  extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                           \
  norm_v##V(const float *x, const float *w, float *y, int n, float eps, signed char *xq, float *xd,   \
            long long *cyc) {                                                                          \
    timed<V>(x, w, y, n, eps, xq, xd, cyc);                                                            \
  }
TIMED(0)
TIMED(1)
TIMED(2)
TIMED(3)
TIMED(4)
"""


def source() -> str:
    """SRC with kernels/norm.cuh and what it includes inlined (what nvcc compiles)."""
    from kestrel_tui.backends.cuda.runtime import module_source

    return module_source("norm_bench", SRC)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()

    import pycuda.autoinit  # noqa: F401
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    from kestrel_tui.backends.cuda.runtime import NVCC_OPTIONS

    n = args.hidden
    mod = SourceModule(source(), options=NVCC_OPTIONS, no_extern_c=True)
    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal(n).astype(np.float32))
    w = cuda.to_device((1 + 0.1 * rng.standard_normal(n)).astype(np.float32))
    y, xq, xd, cyc = cuda.mem_alloc(4 * n), cuda.mem_alloc(n), cuda.mem_alloc(4 * (n // 32)), cuda.mem_alloc(8)
    eps = np.float32(1e-6)
    print(f"{cuda.Context.get_device().name()}: one row of {n}, a block of 256 threads; cycles inside the kernel"
          f" (thread 0, entry to the last store), {args.reps} launches")
    ref = None
    for v, name in enumerate(VARIANTS):
        fn = mod.get_function(f"norm_v{v}")
        cycles = []
        for _ in range(args.reps):
            fn(x, w, y, np.int32(n), eps, xq, xd, cyc, block=(256, 1, 1), grid=(1, 1))
            cuda.Context.synchronize()
            cycles.append(int(cuda.from_device(cyc, (1,), np.int64)[0]))
        out = cuda.from_device(y, (n,), np.float32).view(np.uint32)
        ref = out if ref is None else ref
        print(f"  {name:6} cycles min {min(cycles):6d}  median {int(np.median(cycles)):6d}"
              f"   elements differing from exact: {int((out != ref).sum())}")


if __name__ == "__main__":
    main()
