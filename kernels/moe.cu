// moe.cu — the sparse MoE block around the expert GEMVs: router softmax and
// top-k, SwiGLU's silu(gate)*up (with the q8_0 quantization of its output for
// the down projection), and the weighted expert sum. Toggle: moe (their
// exponentials follow the expf toggle; the q8_0 rule follows gemm).
//
// Versions:
//   router_exact   contract L8a, L8b. The top-k by rank: each thread counts the
//                  experts ranked before it, so the selection is order-free and
//                  parallel. It counts by e while one warp more forms the ordered
//                  sum S, and by p = e / S only where e's order does not settle
//                  the top k (moe.cuh says when): the count is off the sum's chain.
//   router_fast    warp-shuffle tree sum, p = e * (1/S), renormalised by a
//                  reciprocal multiply.
//   silu_mul_exact contract T3, L8c: a = silu(g) * u, every op rounded.
//   silu_mul_fast  a = (g * (1/(1 + expf(-g)))) * u.
//                  Both optionally quantize a to q8_0 in the same pass (one
//                  warp = one 32-block), with the exact or the fast rule.
//   combine_exact  contract L8d, then x = ores + moe.
//   combine_fast   FMA chain over the slots.
//                  (Deterministic on purpose: an atomicAdd scatter from the down
//                  projection would make two fast runs differ from each other,
//                  and the debugger compares runs.)
#include "common.cuh"
#include "moe.cuh"

extern "C" __global__ void router_exact(const float *logits, int *topk, float *topw, int E, int k, int norm,
                                        int exact_exp) {
  __shared__ unsigned long long expT[EXPF_TABLE_LEN];
  if (exact_exp) expf_table_to_shared(expT);
  pdl_wait();
  router<true>(logits, topk, topw, E, k, norm, exact_exp, blockIdx.x, expT);
}
extern "C" __global__ void router_fast(const float *logits, int *topk, float *topw, int E, int k, int norm,
                                       int exact_exp) {
  __shared__ unsigned long long expT[EXPF_TABLE_LEN];
  if (exact_exp) expf_table_to_shared(expT);
  pdl_wait();
  router<false>(logits, topk, topw, E, k, norm, exact_exp, blockIdx.x, expT);
}

// g, u, a: [n_total] f32; aq/ad: q8_0 of a ([n_total] int8, [n_total/32] f32) or null
// (then n_total need not be a multiple of 32). grid ceil(n_total/256), block 256.
template <bool EXACT>
__device__ __forceinline__ void silu_mul(const float *__restrict__ g, const float *__restrict__ u,
                                         float *__restrict__ a, signed char *__restrict__ aq,
                                         float *__restrict__ ad, int n_total, int exact_exp, int exact_quant) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i - (threadIdx.x & 31) >= n_total) return;  // whole warps only
  const bool in = i < n_total;
  float av = 0.0f;
  if (in) {
    av = silu_mul_value<EXACT>(g[i], u[i], exact_exp);
    a[i] = av;
  }
  if (aq) q8_0_warp(av, i, aq, ad, exact_quant ? 2 : 1);  // n_total is a multiple of 32 here: every lane is in
}

extern "C" __global__ void silu_mul_exact(const float *g, const float *u, float *a, signed char *aq, float *ad,
                                          int n_total, int exact_exp, int exact_quant) {
  pdl_wait();
  silu_mul<true>(g, u, a, aq, ad, n_total, exact_exp, exact_quant);
}
extern "C" __global__ void silu_mul_fast(const float *g, const float *u, float *a, signed char *aq, float *ad,
                                         int n_total, int exact_exp, int exact_quant) {
  pdl_wait();
  silu_mul<false>(g, u, a, aq, ad, n_total, exact_exp, exact_quant);
}

// y: [M, k, n] expert outputs in rank order; w: [M, k]; res (ores), moe, x: [M, n].
// grid (ceil(n/256), M), block 256.
#define COMBINE_KERNEL(NAME, EXACT)                                                                   \
  extern "C" __global__ void NAME(const float *__restrict__ y, const float *__restrict__ w,            \
                                  const float *__restrict__ res, float *__restrict__ moe,            \
                                  float *__restrict__ x, int n, int k) {                             \
    pdl_wait();                                                                                      \
    const int i = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;                             \
    if (i < n) moe_combine<EXACT>(y, w, res, moe, x, n, k, m, i);                                    \
  }

COMBINE_KERNEL(combine_exact, true)
COMBINE_KERNEL(combine_fast, false)
