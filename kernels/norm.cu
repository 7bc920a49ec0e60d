// norm.cu — RMSNorm over the hidden size and QK-norm (RMSNorm per head over
// head_dim). Toggle: norm.
//
// Versions:
//   rmsnorm_exact   contract L1 (R2). The per-block terms are computed in
//                   parallel; only the chain over the n/8 block terms is serial.
//   rmsnorm_fast    what engines do: per-thread FMA partial sums, warp-shuffle
//                   tree, rsqrtf(ss*(1/d) + eps), out = x*(rms*w).
//   qknorm_exact    contract L3 (R3); one warp per head, lane 0 sums.
//   qknorm_fast     warp-shuffle tree with FMAs and rsqrtf.
//
// Both qknorm kernels normalise the q heads and the k heads of M columns in one
// launch: grid (n_q + n_kv, M), head h < n_q is a q head.
#include "norm.cuh"

// x, out: [M, n] row-major; grid = M blocks of NORM_THREADS. xq/xd: the q8_0 of out
// ([M, n] int8, [M, n/32]; n a multiple of 32) when quant != 0 (common.cuh q8_0_warp: one
// warp is 32 consecutive, 32-aligned elements, because element j = tid + k*NORM_THREADS).
extern "C" __global__ void rmsnorm_exact(const float *__restrict__ x, const float *__restrict__ w,
                                         float *__restrict__ out, int n, float eps, signed char *__restrict__ xq,
                                         float *__restrict__ xd, int quant) {
  pdl_wait();
  rmsnorm_row<true>(x + (size_t)blockIdx.x * n, w, out + (size_t)blockIdx.x * n, n, eps, xq, xd, quant, blockIdx.x);
}

extern "C" __global__ void rmsnorm_fast(const float *__restrict__ x, const float *__restrict__ w,
                                        float *__restrict__ out, int n, float eps, signed char *__restrict__ xq,
                                        float *__restrict__ xd, int quant) {
  pdl_wait();
  rmsnorm_row<false>(x + (size_t)blockIdx.x * n, w, out + (size_t)blockIdx.x * n, n, eps, xq, xd, quant, blockIdx.x);
}

// q_in/q_out: [M, n_q, hd]; k_in/k_out: [M, n_kv, hd]. grid (n_q + n_kv, M), block 32.
#define QKNORM_KERNEL(NAME, EXACT)                                                                     \
  extern "C" __global__ void NAME(const float *__restrict__ q_in, float *__restrict__ q_out,           \
                                  const float *__restrict__ q_w, const float *__restrict__ k_in,      \
                                  float *__restrict__ k_out, const float *__restrict__ k_w, int n_q,  \
                                  int n_kv, int hd, float eps) {                                     \
    pdl_wait();                                                                                      \
    const int h = blockIdx.x, m = blockIdx.y;                                                        \
    const bool is_q = h < n_q;                                                                       \
    const size_t row = is_q ? ((size_t)m * n_q + h) * hd : ((size_t)m * n_kv + (h - n_q)) * hd;      \
    const float *x = (is_q ? q_in : k_in) + row;                                                     \
    float *y = (is_q ? q_out : k_out) + row;                                                         \
    const float *w = is_q ? q_w : k_w;                                                               \
    float v[HEAD_PER_LANE];                                                                          \
    head_load(x, hd, v);                                                                             \
    const float rms = qk_rms(v, hd, eps, EXACT);                                                  \
    for (int i = 0; i < HEAD_PER_LANE; i++) {                                                        \
      const int j = threadIdx.x + 32 * i;                                                            \
      if (j < hd) y[j] = qk_apply(v[i], rms, w[j], EXACT);                                           \
    }                                                                                                \
  }

QKNORM_KERNEL(qknorm_exact, true)
QKNORM_KERNEL(qknorm_fast, false)
