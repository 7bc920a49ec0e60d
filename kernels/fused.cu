// fused.cu — launches of the decode step that string together ops of several
// families, so a 48-layer step has fewer kernels waiting on each other. Every op
// inside is the device function its own kernel calls (norm.cuh, rope.cuh,
// kvquant.cuh, moe.cuh, gemv.cuh), with the same per-op fast/exact choice, so a fused step
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
//   experts_swiglu_*     gate and up of the k selected experts (gemm toggle: the
//                        name) and SwiGLU's a = silu(g) * u with its q8_0 for
//                        the down projection (moe, expf and the q8_0 rule:
//                        arguments), a block a q8_0 block of a (32 rows of
//                        both matrices): one launch and one DRAM round trip of
//                        g and u fewer per MoE layer (replaces
//                        gemv_q4_experts_* of gate/up and silu_mul_*; q4_0).
//   down_combine_*       the down projection of all k selected experts of a
//                        column in one block (a warp a slot; gemm toggle: the
//                        name) and the expert sum of its rows (moe: an
//                        argument), so the sum needs no launch (q4_0, k up to
//                        COMBINE_MAX_K; else combine_rmsnorm_* adds it).
//
// Fusions tried and not kept (measured slower): docs/decisions.md, figures and
// commits in results/gpu-history.md (fused.cu).
#include "gemv.cuh"
#include "kvquant.cuh"
#include "moe.cuh"
#include "norm.cuh"
#include "rope.cuh"

// RoPE of the pairs a lane holds: v[i] and v[i + HI] (HI = hd/64), with the angles' cos and sin
// of pair lane + 32*i in c[i], s[i].
template <int HI>
__device__ __forceinline__ void rope_regs(float (&v)[HEAD_PER_LANE], const float (&c)[HEAD_PER_LANE / 2],
                                          const float (&s)[HEAD_PER_LANE / 2], bool exact) {
#pragma unroll
  for (int i = 0; i < HI; i++) {
    float y1, y2;
    rope_rotate(v[i], v[i + HI], c[i], s[i], y1, y2, exact);
    v[i] = y1;
    v[i + HI] = y2;
  }
}

// Head h of column m, by one warp (heads_fused below; scripts/gpu/gpu_heads_router_bench.py times it).
// q: [M, n_q, hd] -> qn, qrope; kraw -> knorm, kpre -> k/ks (+ cache); vraw -> v/vs (+ cache).
// h: q heads, then k heads, then v heads. cos_t/sin_t: [M, hd/2].
__device__ __forceinline__ void heads_fused_head(
    const float *__restrict__ q, float *__restrict__ qn, float *__restrict__ qrope, const float *__restrict__ q_w,
    const float *__restrict__ kraw, float *__restrict__ knorm, float *__restrict__ kpre,
    const float *__restrict__ k_w, const float *__restrict__ vraw, signed char *__restrict__ k_out,
    float *__restrict__ ks_out, signed char *__restrict__ v_out, float *__restrict__ vs_out,
    signed char *__restrict__ k_cache, float *__restrict__ ks_cache, signed char *__restrict__ v_cache,
    float *__restrict__ vs_cache, const float *__restrict__ cos_t, const float *__restrict__ sin_t, int n_q, int n_kv,
    int hd, float eps, int pos0, int flags, int h, int m) {
  const int lane = threadIdx.x & 31, half = hd / 2;
  const bool norm_exact = flags & 1, rope_exact = flags & 2, kv_exact = flags & 4;
  float v[HEAD_PER_LANE];
  const bool is_v = h >= n_q + n_kv;
  const int kvh = h - n_q - (is_v ? n_kv : 0);
  if (!is_v) {
    const bool is_q = h < n_q;
    const size_t row = is_q ? ((size_t)m * n_q + h) * hd : ((size_t)m * n_kv + kvh) * hd;
    const float *x = (is_q ? q : kraw) + row;
    float *nrm = (is_q ? qn : knorm) + row, *rot = (is_q ? qrope : kpre) + row;
    // the row, the norm's weights and the angles loaded together: read where they are used, after
    // the norm and after its stores, they were two more dependent L2 round trips
    float wv[HEAD_PER_LANE], cv[HEAD_PER_LANE / 2], sv[HEAD_PER_LANE / 2];
    head_load(x, hd, v);
    head_load(is_q ? q_w : k_w, hd, wv);
#pragma unroll
    for (int i = 0; i < HEAD_PER_LANE / 2; i++) {
      const int j = lane + 32 * i;
      cv[i] = j < half ? cos_t[(size_t)m * half + j] : 0.0f;
      sv[i] = j < half ? sin_t[(size_t)m * half + j] : 0.0f;
    }
    const float rms = qk_rms(v, hd, eps, norm_exact);
#pragma unroll
    for (int i = 0; i < HEAD_PER_LANE; i++) {
      const int j = lane + 32 * i;
      if (j < hd) {
        v[i] = qk_apply(v[i], rms, wv[i], norm_exact);
        nrm[j] = v[i];
      }
    }
    if (half == 32)
      rope_regs<1>(v, cv, sv, rope_exact);
    else if (half == 64)
      rope_regs<2>(v, cv, sv, rope_exact);
    else
      rope_regs<4>(v, cv, sv, rope_exact);
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

// grid (n_q + 2*n_kv, M), block 32: a head a block.
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
  heads_fused_head(q, qn, qrope, q_w, kraw, knorm, kpre, k_w, vraw, k_out, ks_out, v_out, vs_out, k_cache, ks_cache,
                   v_cache, vs_cache, cos_t, sin_t, n_q, n_kv, hd, eps, pos0, flags, blockIdx.x, blockIdx.y);
}

// y: [M, k, n] expert outputs, topw: [M, k], ores: [M, n] -> moe, x: [M, n] (column m); then
// out = RMSNorm(x) * w with its q8_0 (quant as rmsnorm_*). grid M, block NORM_THREADS,
// n <= FUSED_MAX_ROW. One block sums a whole row (k*n loads): with k <= COMBINE_MAX_K a
// thread loads all its slots' values for NORM_PER elements before the first add. The norm
// reads x from shared memory (the values just written).
template <bool MOE_EXACT>
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
  for (int i0 = threadIdx.x; i0 < n; i0 += NORM_PER * NORM_THREADS) {
    float yv[NORM_PER][COMBINE_MAX_K], rv[NORM_PER];
#pragma unroll
    for (int e = 0; e < NORM_PER; e++) {
      const int i = i0 + e * NORM_THREADS;
      rv[e] = i < n ? ores[(size_t)m * n + i] : 0.0f;
#pragma unroll
      for (int j = 0; j < COMBINE_MAX_K; j++) yv[e][j] = i < n && j < k ? y[((size_t)m * k + j) * n + i] : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < NORM_PER; e++) {
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
      combine_row<true>(y, topw, ores, moe, x, n, k, xs, blockIdx.x);                                    \
    else                                                                                               \
      combine_row<false>(y, topw, ores, moe, x, n, k, xs, blockIdx.x);                                   \
    __syncthreads();                                                                                   \
    rmsnorm_row<NORM_EXACT>(xs, w, out + (size_t)blockIdx.x * n, n, eps, xq, xd, quant, blockIdx.x);     \
  }

COMBINE_RMSNORM_KERNEL(combine_rmsnorm_exact, true)
COMBINE_RMSNORM_KERNEL(combine_rmsnorm_fast, false)

// ------------------------------------------------------------ down projection + expert sum
// The down rows of all k slots of a column in one block (warp j = slot j, EXPERT_ROWS rows),
// so the block holds every term of its rows' expert sums and adds them in rank order
// (contract L8d; moe.cuh, moe toggle: moe_exact), with no launch of its own.
// grid (ceil(n/EXPERT_ROWS), M), block 32*k (k <= COMBINE_MAX_K); y: [M*k, n].
template <bool EXACT>
__device__ __forceinline__ void down_combine(const uint4 *W, const __half *D, float *y, const int *eidx,
                                             const signed char *aq, const float *ad, int n, int nb, int k,
                                             const float *topw, const float *ores, float *moe, float *x,
                                             int moe_exact) {
  __shared__ float ys[COMBINE_MAX_K][EXPERT_ROWS];
  const int j = threadIdx.x >> 5, m = blockIdx.y, pair = m * k + j, row0 = blockIdx.x * EXPERT_ROWS;
  float acc[EXPERT_ROWS];
  q4_expert_rows<EXACT>(W, D, eidx[pair], row0, n, nb, aq + (size_t)pair * nb * QK, ad + (size_t)pair * nb, acc);
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int r = 0; r < EXPERT_ROWS; r++) {
      ys[j][r] = acc[r];
      if (row0 + r < n) y[(size_t)pair * n + row0 + r] = acc[r];
    }
  __syncthreads();
  const int r = threadIdx.x, i = row0 + r;
  if (r < EXPERT_ROWS && i < n) {
    float s = 0.0f;
    for (int jj = 0; jj < k; jj++)
      s = moe_exact ? moe_sum_step<true>(s, topw[(size_t)m * k + jj], ys[jj][r])
                    : moe_sum_step<false>(s, topw[(size_t)m * k + jj], ys[jj][r]);
    const size_t o = (size_t)m * n + i;
    moe[o] = s;
    x[o] = moe_exact ? moe_residual<true>(ores[o], s) : moe_residual<false>(ores[o], s);
  }
}

// The lines of a warp's EXPERT_ROWS weight rows (contiguous in W and in D) into L2, ahead of the
// kernel's wait: eidx is the router's, two launches back, final since before this grid started
// (its launch waits for experts_swiglu's blocks to pass their own wait); read past L1. With the
// early trigger the blocks resident while experts_swiglu runs fetch their rows meanwhile.
__device__ __forceinline__ void down_rows_to_l2(const uint4 *W, const __half *D, const int *eidx, int n, int nb,
                                                int k) {
  const int lane = threadIdx.x & 31, pair = blockIdx.y * k + (threadIdx.x >> 5), row0 = blockIdx.x * EXPERT_ROWS;
  const size_t first = ((size_t)__ldcg(eidx + pair) * n + row0) * nb, count = (size_t)min(EXPERT_ROWS, n - row0) * nb;
  const uintptr_t w0 = (uintptr_t)(W + first) & ~(uintptr_t)127, w1 = (uintptr_t)(W + first + count) - 1;
  const uintptr_t d0 = (uintptr_t)(D + first) & ~(uintptr_t)127, d1 = (uintptr_t)(D + first + count) - 1;
  const int wl = (int)((w1 - w0) >> 7) + 1, dl = (int)((d1 - d0) >> 7) + 1;
  for (int i = lane; i < wl + dl; i += 32)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(i < wl ? w0 + 128 * (uintptr_t)i : d0 + 128 * (uintptr_t)(i - wl)));
}

#define DOWN_COMBINE_KERNEL(SUFFIX, EXACT)                                                              \
  extern "C" __global__ void __launch_bounds__(256, 4)                                                 \
      down_combine_##SUFFIX(const uint4 *W, const __half *D, float *y, const int *eidx, const signed char *aq, \
                            const float *ad, int n, int nb, int k, const float *topw, const float *ores,      \
                            float *moe, float *x, int moe_exact) {                                           \
    down_rows_to_l2(W, D, eidx, n, nb, k);                                                             \
    pdl_wait();                                                                                        \
    down_combine<EXACT>(W, D, y, eidx, aq, ad, n, nb, k, topw, ores, moe, x, moe_exact);               \
  }

DOWN_COMBINE_KERNEL(exact, true)
DOWN_COMBINE_KERNEL(fast, false)

// ------------------------------------------------------------ gate and up + SwiGLU
// One block: the 32 rows (one q8_0 block of a) of gate and of up of one (column, slot) pair,
// warps 0..7 the gate rows and warps 8..15 the same rows of up, EXPERT_ROWS a warp, each by
// q4_expert_rows as gemv_q4_experts computes it (gemm toggle: the name): the launch has as
// many warps as the unfused one, each with its rows' weight loads issued together (a warp
// doing gate then up would wait on memory twice). Then warp 0 takes the 32 (g, u) pairs from
// shared memory and writes a = silu(g) * u (silu_mul_value; moe toggle: moe_exact; exp:
// exact_exp) and its q8_0 (q8_0_warp, the rule silu_mul uses: exact_quant), element
// i = pair*out + row as silu_mul numbers it. g and u never reach memory: nothing after silu
// reads them.
// grid (out/32, P), block SWIGLU_THREADS; out a multiple of 32. eidx, xq/xd, x_div as
// gemv_q4_experts; a: [P, out], aq: [P, out], ad: [P, out/32].
static_assert(SWIGLU_THREADS == 2 * (QK / EXPERT_ROWS) * 32, "a warp per EXPERT_ROWS rows of gate and of up");
template <bool EXACT>
__device__ __forceinline__ void experts_swiglu(const uint4 *Wg, const __half *Dg, const uint4 *Wu, const __half *Du,
                                               const int *eidx, const signed char *xq, const float *xd, int x_div,
                                               int out, int nb, float *a, signed char *aq, float *ad, int moe_exact,
                                               int exact_exp, int exact_quant, const unsigned long long *expT) {
  __shared__ float gu[2][QK];  // g, u of the block's rows
  constexpr int HALF = QK / EXPERT_ROWS;  // warps a matrix
  const int warp = threadIdx.x >> 5, up = warp >= HALF, r0 = (warp % HALF) * EXPERT_ROWS;
  const int pair = blockIdx.y, xc = pair / x_div, row0 = blockIdx.x * QK;
  float acc[EXPERT_ROWS];
  q4_expert_rows<EXACT>(up ? Wu : Wg, up ? Du : Dg, eidx[pair], row0 + r0, out, nb, xq + (size_t)xc * nb * QK,
                        xd + (size_t)xc * nb, acc);
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int r = 0; r < EXPERT_ROWS; r++) gu[up][r0 + r] = acc[r];
  __syncthreads();
  if (warp) return;
  const int lane = threadIdx.x;
  const size_t i = (size_t)pair * out + row0 + lane;
  const float av = moe_exact ? silu_mul_value<true>(gu[0][lane], gu[1][lane], exact_exp, expT)
                             : silu_mul_value<false>(gu[0][lane], gu[1][lane], exact_exp, expT);
  a[i] = av;
  q8_0_warp(av, i, aq, ad, exact_quant ? 2 : 1);
}

// (launch bounds: two 16-warp blocks an SM, so a 30B-A3B decode layer's blocks fit in one wave)
#define EXPERTS_SWIGLU_KERNEL(SUFFIX, EXACT)                                                            \
  extern "C" __global__ void __launch_bounds__(SWIGLU_THREADS, 2)                                     \
      experts_swiglu_##SUFFIX(const uint4 *Wg, const __half *Dg, const uint4 *Wu, const __half *Du,          \
                              const int *eidx, const signed char *xq, const float *xd, int x_div, int out,   \
                              int nb, float *a, signed char *aq, float *ad, int moe_exact, int exact_exp,    \
                              int exact_quant) {                                                           \
    __shared__ unsigned long long expT[EXPF_TABLE_LEN];                                               \
    if (exact_exp) expf_table_to_shared(expT); /* final: ahead of the wait */                          \
    pdl_wait(); /* then: the weights' addresses depend on the router's eidx */                         \
    experts_swiglu<EXACT>(Wg, Dg, Wu, Du, eidx, xq, xd, x_div, out, nb, a, aq, ad, moe_exact, exact_exp,      \
                          exact_quant, expT);                                                           \
  }

EXPERTS_SWIGLU_KERNEL(exact, true)
EXPERTS_SWIGLU_KERNEL(fast, false)
