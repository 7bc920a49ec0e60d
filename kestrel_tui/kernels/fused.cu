// fused.cu — launches of the decode step that string together ops of several
// families, so a 48-layer step has fewer kernels waiting on each other. Every op
// inside is the device function its own kernel calls (norm.cuh, rope.cuh,
// kvquant.cuh, moe.cuh), with the same per-op fast/exact choice, so a fused step
// gives the bits of the separate launches (tests/test_cuda.py compares every key,
// fused vs not, over toggle sets). The backend uses them outside isolate mode only:
// there each op must read the reference's inputs, which a fused launch would skip.
//
// Versions:
//   heads_fused          QK-norm -> RoPE -> KV row of every head in one launch
//                        (replaces qknorm_*, rope_*, kvquant_*; head_dim 64, 128
//                        or 256, so a lane holds both halves of its RoPE pairs
//                        at a fixed register distance; backend.py checks it).
//                        flags: 1 QK-norm exact, 2 RoPE exact, 4 KV rule exact.
//   combine_rmsnorm_*    the MoE expert sum of layer l (moe exact or fast: an
//                        argument) and the RMSNorm that follows it (the next
//                        layer's input norm, or the final norm) with its q8_0.
#include "gemv.cuh"
#include "kvquant.cuh"
#include "moe.cuh"
#include "norm.cuh"
#include "rope.cuh"

// RoPE of the pairs a lane holds: v[i] and v[i + HI] (HI = hd/64).
template <int HI>
__device__ __forceinline__ void rope_regs(float (&v)[HEAD_PER_LANE], const float *__restrict__ cos_r,
                                          const float *__restrict__ sin_r, bool exact) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < HI; i++) {
    const int j = lane + 32 * i;
    float y1, y2;
    rope_rotate(v[i], v[i + HI], cos_r[j], sin_r[j], y1, y2, exact);
    v[i] = y1;
    v[i + HI] = y2;
  }
}

// q: [M, n_q, hd] -> qn, qrope; kraw -> knorm, kpre -> k/ks (+ cache); vraw -> v/vs (+ cache).
// grid (n_q + 2*n_kv, M), block 32: q heads, then k heads, then v heads. cos_t/sin_t: [M, hd/2].
extern "C" __global__ void heads_fused(const float *__restrict__ q, float *__restrict__ qn, float *__restrict__ qrope,
                                       const float *__restrict__ q_w, const float *__restrict__ kraw,
                                       float *__restrict__ knorm, float *__restrict__ kpre,
                                       const float *__restrict__ k_w, const float *__restrict__ vraw,
                                       signed char *__restrict__ k_out, float *__restrict__ ks_out,
                                       signed char *__restrict__ v_out, float *__restrict__ vs_out,
                                       signed char *__restrict__ k_cache, float *__restrict__ ks_cache,
                                       signed char *__restrict__ v_cache, float *__restrict__ vs_cache,
                                       const float *__restrict__ cos_t, const float *__restrict__ sin_t, int n_q,
                                       int n_kv, int hd, float eps, int pos0, const int *__restrict__ dpos,
                                       int flags) {
  pdl_wait();
  if (dpos) pos0 = *dpos;
  const int h = blockIdx.x, m = blockIdx.y, lane = threadIdx.x & 31, half = hd / 2;
  const bool norm_exact = flags & 1, rope_exact = flags & 2, kv_exact = flags & 4;
  float v[HEAD_PER_LANE];
  const bool is_v = h >= n_q + n_kv;
  const int kvh = h - n_q - (is_v ? n_kv : 0);
  if (!is_v) {
    const bool is_q = h < n_q;
    const size_t row = is_q ? ((size_t)m * n_q + h) * hd : ((size_t)m * n_kv + kvh) * hd;
    const float *x = (is_q ? q : kraw) + row;
    float *nrm = (is_q ? qn : knorm) + row, *rot = (is_q ? qrope : kpre) + row;
    const float *w = is_q ? q_w : k_w;
    head_load(x, hd, v);
    const float rms = qk_rms(x, v, hd, eps, norm_exact);
#pragma unroll
    for (int i = 0; i < HEAD_PER_LANE; i++) {
      const int j = lane + 32 * i;
      if (j < hd) {
        v[i] = qk_apply(v[i], rms, w[j], norm_exact);
        nrm[j] = v[i];
      }
    }
    const float *cr = cos_t + (size_t)m * half, *sr = sin_t + (size_t)m * half;
    if (half == 32)
      rope_regs<1>(v, cr, sr, rope_exact);
    else if (half == 64)
      rope_regs<2>(v, cr, sr, rope_exact);
    else
      rope_regs<4>(v, cr, sr, rope_exact);
#pragma unroll
    for (int i = 0; i < HEAD_PER_LANE; i++)
      if (lane + 32 * i < hd) rot[lane + 32 * i] = v[i];
    if (is_q) return;
  } else {
    head_load(vraw + ((size_t)m * n_kv + kvh) * hd, hd, v);
  }
  const size_t row = (size_t)m * n_kv + kvh, crow = (size_t)(pos0 + m) * n_kv + kvh;
  signed char *qo = (is_v ? v_out : k_out) + row * hd, *qc = is_v ? v_cache : k_cache;
  float *so = (is_v ? vs_out : ks_out) + row, *sc = is_v ? vs_cache : ks_cache;
  if (kv_exact)
    kv_row_q8_regs<true>(v, qo, so, qc ? qc + crow * hd : nullptr, sc ? sc + crow : nullptr, hd);
  else
    kv_row_q8_regs<false>(v, qo, so, qc ? qc + crow * hd : nullptr, sc ? sc + crow : nullptr, hd);
}

// y: [M, k, n] expert outputs, topw: [M, k], ores: [M, n] -> moe, x: [M, n] (column m); then
// out = RMSNorm(x) * w with its q8_0 (quant as rmsnorm_*). grid M, block NORM_THREADS,
// n <= FUSED_MAX_ROW. One block sums a whole row (k*n loads): with k <= COMBINE_MAX_K a
// thread loads all its slots' values for PER elements before the first add. The norm
// reads x from shared memory (the values just written).
#define FUSED_MAX_ROW 4096
#define COMBINE_MAX_K 8
template <bool MOE_EXACT, int PER = NORM_PER>
__device__ __forceinline__ void combine_row(const float *__restrict__ y, const float *__restrict__ topw,
                                            const float *__restrict__ ores, float *__restrict__ moe,
                                            float *__restrict__ x, int n, int k, float *__restrict__ xs, int m) {
  if (k > COMBINE_MAX_K) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = moe_combine<MOE_EXACT>(y, topw, ores, moe, x, n, k, m, i);
    return;
  }
  float wk[COMBINE_MAX_K];
#pragma unroll
  for (int j = 0; j < COMBINE_MAX_K; j++) wk[j] = j < k ? topw[(size_t)m * k + j] : 0.0f;
  for (int i0 = threadIdx.x; i0 < n; i0 += PER * NORM_THREADS) {
    float yv[PER][COMBINE_MAX_K], rv[PER];
#pragma unroll
    for (int e = 0; e < PER; e++) {
      const int i = i0 + e * NORM_THREADS;
      rv[e] = i < n ? ores[(size_t)m * n + i] : 0.0f;
#pragma unroll
      for (int j = 0; j < COMBINE_MAX_K; j++) yv[e][j] = i < n && j < k ? __ldcg(y + ((size_t)m * k + j) * n + i) : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < PER; e++) {
      const int i = i0 + e * NORM_THREADS;
      if (i >= n) break;
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < COMBINE_MAX_K; j++)
        if (j < k) acc = moe_sum_step<MOE_EXACT>(acc, wk[j], yv[e][j]);
      const float xv = moe_residual<MOE_EXACT>(rv[e], acc);
      moe[(size_t)m * n + i] = acc;
      x[(size_t)m * n + i] = xv;
      xs[i] = xv;
    }
  }
}

#define COMBINE_RMSNORM_KERNEL(NAME, NORM_EXACT)                                                        \
  extern "C" __global__ void NAME(const float *__restrict__ y, const float *__restrict__ topw,          \
                                  const float *__restrict__ ores, float *__restrict__ moe,             \
                                  float *__restrict__ x, int k, int moe_exact, const float *__restrict__ w, \
                                  float *__restrict__ out, int n, float eps, signed char *__restrict__ xq, \
                                  float *__restrict__ xd, int quant) {                                 \
    pdl_wait();                                                                                        \
    __shared__ float xs[FUSED_MAX_ROW];                                                                \
    if (moe_exact)                                                                                     \
      combine_row<true>(y, topw, ores, moe, x, n, k, xs, blockIdx.x);                                              \
    else                                                                                               \
      combine_row<false>(y, topw, ores, moe, x, n, k, xs, blockIdx.x);                                             \
    __syncthreads();                                                                                   \
    rmsnorm_row<NORM_EXACT>(xs, w, out + (size_t)blockIdx.x * n, n, eps, xq, xd, quant, blockIdx.x);               \
  }

COMBINE_RMSNORM_KERNEL(combine_rmsnorm_exact, true)
COMBINE_RMSNORM_KERNEL(combine_rmsnorm_fast, false)

// ------------------------------------------------------------ GEMVs with a tail
// The op behind a GEMV that needs the GEMV's whole output (a norm over the row, the router's
// top-k, the expert sum) runs in the GEMV's last block to finish (common.cuh
// last_block_done), so the step saves a launch and the wait for one grid to drain and the
// next to start. `ticket`: a zeroed counter of its own (backend.py). The GEMV is gemv.cuh's,
// with the gemm toggle's version (the kernel name); the tail's versions are arguments.

// y = res + W x (o_proj), then out = RMSNorm(y) * nw of every column with its q8_0 into
// oq/od (the GEMV's own input buffers: every block has read them by then).
// grid (ceil(out/(GEMV_MAX_WARPS/ks)), ceil(M/GEMV_MC)), block NORM_THREADS; out <= FUSED_MAX_ROW.
static_assert(NORM_THREADS == 32 * GEMV_MAX_WARPS, "the GEMV takes the norm's block");
template <bool EXACT>
__device__ __forceinline__ void gemv_rmsnorm(const uint4 *W, const __half *D, const signed char *xq,
                                             const float *xd, const float *res, float *y, int out, int nb, int M,
                                             unsigned int *ticket, const float *nw, float *nout, float eps,
                                             signed char *oq, float *od, int quant, int norm_exact) {
  gemv_q4<EXACT>(W, D, xq, xd, res, y, out, nb, M, blockIdx.x);
  if (!last_block_done(ticket)) return;
  __shared__ float xs[FUSED_MAX_ROW];
  for (int m = 0; m < M; m++) {
    __syncthreads();
    for (int i = threadIdx.x; i < out; i += blockDim.x) xs[i] = __ldcg(y + (size_t)m * out + i);
    __syncthreads();
    if (norm_exact)
      rmsnorm_row<true>(xs, nw, nout + (size_t)m * out, out, eps, oq, od, quant, m);
    else
      rmsnorm_row<false>(xs, nw, nout + (size_t)m * out, out, eps, oq, od, quant, m);
  }
}

// logits = W x (the router), then top-k of every column (moe.cuh router). grid as gemv_q4's,
// block = E rounded up to a multiple of 128 (at most GEMV_MAX_WARPS warps).
template <bool EXACT>
__device__ __forceinline__ void gemv_router(const uint4 *W, const __half *D, const signed char *xq, const float *xd,
                                            float *logits, int E, int nb, int M, unsigned int *ticket, int *topk,
                                            float *topw, int k, int norm, int exact_exp, int moe_exact) {
  gemv_q4<EXACT>(W, D, xq, xd, nullptr, logits, E, nb, M, blockIdx.x);
  if (!last_block_done(ticket)) return;
  for (int m = 0; m < M; m++) {
    __syncthreads();
    if (moe_exact)
      router<true>(logits, topk, topw, E, k, norm, exact_exp, m);
    else
      router<false>(logits, topk, topw, E, k, norm, exact_exp, m);
  }
}

// Gate and up rows of the selected experts together, then a = silu(g)*u and its q8_0 (no
// tail: a block's 32 rows are one q8_0 block). grid (F/32, P), block 256 (8 warps x
// EXPERT_ROWS rows); F a multiple of 32. Pair p reads column p / x_div.
#define SILU_ROWS (GEMV_MAX_WARPS * EXPERT_ROWS)
static_assert(SILU_ROWS == QK, "a block's rows are one q8_0 block of a");
template <bool EXACT>
__device__ __forceinline__ void experts_silu(const uint4 *Wg, const __half *Dg, float *g, const uint4 *Wu,
                                             const __half *Du, float *u, const int *eidx, const signed char *xq,
                                             const float *xd, int x_div, int F, int nb, float *a,
                                             signed char *aq, float *ad, int exact_exp, int moe_exact, int quant) {
  __shared__ float as[SILU_ROWS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, pair = blockIdx.y, xc = pair / x_div;
  const int row0 = blockIdx.x * SILU_ROWS + warp * EXPERT_ROWS;
  const uint4 *const W[2] = {Wg, Wu};
  const __half *const D[2] = {Dg, Du};
  float acc[2][EXPERT_ROWS];
  q4_expert_rows<EXACT, 2>(W, D, eidx[pair], row0, F, nb, xq + (size_t)xc * nb * QK, xd + (size_t)xc * nb, acc);
#pragma unroll
  for (int r = 0; r < EXPERT_ROWS; r++) {
    const float av = moe_exact ? silu_mul_value<true>(acc[0][r], acc[1][r], exact_exp)
                               : silu_mul_value<false>(acc[0][r], acc[1][r], exact_exp);
    if (lane == 0) {
      const size_t o = (size_t)pair * F + row0 + r;
      g[o] = acc[0][r];
      u[o] = acc[1][r];
      a[o] = av;
      as[warp * EXPERT_ROWS + r] = av;
    }
  }
  __syncthreads();
  if (warp == 0) q8_0_warp(as[lane], (size_t)pair * F + blockIdx.x * SILU_ROWS + lane, aq, ad, quant);
}

// Down rows of the selected experts (y: [P, n], pair p reads column p of aq/ad), then the
// expert sum of every column and the RMSNorm behind it (combine_rmsnorm_*'s work) into out
// with its q8_0. grid (ceil(n/SILU_ROWS), P), block NORM_THREADS; n <= FUSED_MAX_ROW.
template <bool EXACT>
__device__ __forceinline__ void experts_combine_rmsnorm(const uint4 *W, const __half *D, float *y, const int *eidx,
                                                        const signed char *aq, const float *ad, int n, int nb,
                                                        int M, unsigned int *ticket, const float *topw,
                                                        const float *ores, float *moe, float *x, int k,
                                                        int moe_exact, const float *nw, float *out, float eps,
                                                        signed char *xq, float *xd, int quant, int norm_exact) {
  const int warp = threadIdx.x >> 5, pair = blockIdx.y;
  const int row0 = blockIdx.x * SILU_ROWS + warp * EXPERT_ROWS;
  if (row0 < n) {
    const uint4 *const Wm[1] = {W};
    const __half *const Dm[1] = {D};
    float acc[1][EXPERT_ROWS];
    q4_expert_rows<EXACT, 1>(Wm, Dm, eidx[pair], row0, n, nb, aq + (size_t)pair * nb * QK, ad + (size_t)pair * nb,
                             acc);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
      for (int r = 0; r < EXPERT_ROWS; r++)
        if (row0 + r < n) y[(size_t)pair * n + row0 + r] = acc[0][r];
  }
  if (!last_block_done(ticket)) return;
  __shared__ float xs[FUSED_MAX_ROW];
  for (int m = 0; m < M; m++) {
    __syncthreads();
    if (moe_exact)
      combine_row<true, 2>(y, topw, ores, moe, x, n, k, xs, m);
    else
      combine_row<false, 2>(y, topw, ores, moe, x, n, k, xs, m);
    __syncthreads();
    if (norm_exact)
      rmsnorm_row<true>(xs, nw, out + (size_t)m * n, n, eps, xq, xd, quant, m);
    else
      rmsnorm_row<false>(xs, nw, out + (size_t)m * n, n, eps, xq, xd, quant, m);
  }
}

#define TAIL_KERNELS(SUFFIX, EXACT)                                                                     \
  extern "C" __global__ void gemv_rmsnorm_##SUFFIX(                                                     \
      const uint4 *W, const __half *D, const signed char *xq, const float *xd, const float *res, float *y, \
      int out, int nb, int M, unsigned int *ticket, const float *nw, float *nout, float eps,            \
      signed char *oq, float *od, int quant, int norm_exact) {                                         \
    pdl_wait();                                                                                        \
    gemv_rmsnorm<EXACT>(W, D, xq, xd, res, y, out, nb, M, ticket, nw, nout, eps, oq, od, quant, norm_exact); \
  }                                                                                                    \
  extern "C" __global__ void gemv_router_##SUFFIX(                                                      \
      const uint4 *W, const __half *D, const signed char *xq, const float *xd, float *logits, int E, int nb, \
      int M, unsigned int *ticket, int *topk, float *topw, int k, int norm, int exact_exp, int moe_exact) { \
    pdl_wait();                                                                                        \
    gemv_router<EXACT>(W, D, xq, xd, logits, E, nb, M, ticket, topk, topw, k, norm, exact_exp, moe_exact); \
  }                                                                                                    \
  extern "C" __global__ void __launch_bounds__(256, 2) experts_silu_##SUFFIX(                           \
      const uint4 *Wg, const __half *Dg, float *g, const uint4 *Wu, const __half *Du, float *u,         \
      const int *eidx, const signed char *xq, const float *xd, int x_div, int F, int nb, float *a,      \
      signed char *aq, float *ad, int exact_exp, int moe_exact, int quant) {                           \
    pdl_wait();                                                                                        \
    experts_silu<EXACT>(Wg, Dg, g, Wu, Du, u, eidx, xq, xd, x_div, F, nb, a, aq, ad, exact_exp, moe_exact, quant); \
  }                                                                                                    \
  extern "C" __global__ void __launch_bounds__(256, 4) experts_combine_rmsnorm_##SUFFIX(                \
      const uint4 *W, const __half *D, float *y, const int *eidx, const signed char *aq, const float *ad, \
      int n, int nb, int M, unsigned int *ticket, const float *topw, const float *ores, float *moe,     \
      float *x, int k, int moe_exact, const float *nw, float *out, float eps, signed char *xq, float *xd, \
      int quant, int norm_exact) {                                                                     \
    pdl_wait();                                                                                        \
    experts_combine_rmsnorm<EXACT>(W, D, y, eidx, aq, ad, n, nb, M, ticket, topw, ores, moe, x, k, moe_exact, nw, \
                                   out, eps, xq, xd, quant, norm_exact);                               \
  }

TAIL_KERNELS(exact, true)
TAIL_KERNELS(fast, false)
