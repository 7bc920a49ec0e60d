// moe.cuh — the router's softmax and top-k, silu(gate)*up of one element and the weighted
// expert sum of one element, as device functions (moe.cu's kernels and fused.cu's launches
// call them, so both give the same bits). The versions: moe.cu.
#pragma once
#include "common.cuh"

// One slot's term of the expert sum, and the residual add: exact, contract L8d; fast, an FMA
// chain.
template <bool EXACT>
__device__ __forceinline__ float moe_sum_step(float acc, float w, float y) {
  return EXACT ? FADD(acc, FMUL(w, y)) : fmaf(w, y, acc);
}
template <bool EXACT>
__device__ __forceinline__ float moe_residual(float res, float acc) {
  return EXACT ? FADD(res, acc) : res + acc;
}

// x[m, i] = res[m, i] + sum_j w[m, j] * y[m, j, i]. Returns x; writes moe and x.
template <bool EXACT>
__device__ __forceinline__ float moe_combine(const float *__restrict__ y, const float *__restrict__ w,
                                             const float *__restrict__ res, float *__restrict__ moe,
                                             float *__restrict__ x, int n, int k, int m, int i) {
  float acc = 0.0f;
  for (int j = 0; j < k; j++) acc = moe_sum_step<EXACT>(acc, w[(size_t)m * k + j], y[((size_t)m * k + j) * n + i]);
  const float xv = moe_residual<EXACT>(res[(size_t)m * n + i], acc);
  moe[(size_t)m * n + i] = acc;
  x[(size_t)m * n + i] = xv;
  return xv;
}

// SwiGLU's a = silu(g) * u of one element (exact: contract T3, L8c).
template <bool EXACT>
__device__ __forceinline__ float silu_mul_value(float g, float u, int exact_exp,
                                                const unsigned long long *expT = EXPF_T) {
  const float e = expf_sel(-g, exact_exp, expT);
  const float s = EXACT ? FDIV(g, FADD(1.0f, e)) : g * __frcp_rn(1.0f + e);
  return EXACT ? FMUL(s, u) : s * u;
}

// Expert i's rank among E values v (descending, ties by index): the experts before it in the
// order the top-k takes.
__device__ __forceinline__ int router_rank(const float *__restrict__ v, int E, float p, int i) {
  int rank = 0, j = 0;
  for (; j + 4 <= E; j += 4) {  // four at a time: the loop is the router's longest chain
    const float4 q = ((const float4 *)v)[j / 4];
    rank += (q.x > p) || (q.x == p && j < i);
    rank += (q.y > p) || (q.y == p && j + 1 < i);
    rank += (q.z > p) || (q.z == p && j + 2 < i);
    rank += (q.w > p) || (q.w == p && j + 3 < i);
  }
  for (; j < E; j++) {
    const float pj = v[j];
    rank += (pj > p) || (pj == p && j < i);
  }
  return rank;
}

// Column m: logits: [M, E]; topk: [M, k] int32; topw: [M, k]. A block of E threads rounded up to a
// warp, and for the exact version one warp more, the last, which forms the ordered sum. Exact:
// contract L8a, L8b. expT: the exponential's table (expf_table_to_shared), read after the block's
// first barrier.
//
// Exact ranks by e while the sum runs: p = e / S rounded is monotone in e, so the order by p is
// the order by e with ties where rounding merges neighbours. Where the first k + 1 experts in
// e's order have strictly falling p, their ranks by p are their ranks by e; otherwise (ties in p,
// a NaN) the ranks are counted again by p, as before.
template <bool EXACT>
__device__ __forceinline__ void router(const float *__restrict__ logits, int *__restrict__ topk,
                                       float *__restrict__ topw, int E, int k, int norm, int exact_exp, int m,
                                       const unsigned long long *expT) {
  __shared__ __align__(16) float sp[MOE_MAX_EXPERTS];
  __shared__ float selp[MOE_MAX_TOPK + 1];
  __shared__ float red[32];
  __shared__ float bc;
  const int i = threadIdx.x, lane = i & 31, warp = i >> 5, nw = blockDim.x >> 5;
  const float r = i < E ? logits[(size_t)m * E + i] : -INFINITY;
  float mx = warp_max(r);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
  for (int w2 = 1; w2 < nw; w2++) mx = fmaxf(mx, red[w2]);
  const float e = i < E ? expf_sel(FSUB(r, mx), exact_exp, expT) : 0.0f;
  float p;
  int rank;
  if (EXACT) {
    if (i < E) sp[i] = e;
    __syncthreads();
    int erank = k;
    if (warp == nw - 1) {
      if (lane == 0) bc = serial_sum_shared(sp, E);
    } else if (i < E) {
      erank = router_rank(sp, E, e, i);
    }
    const bool nan_e = __syncthreads_or(i < E && isnan(e));
    p = FDIV(e, bc);
    if (i < E && erank <= k && !nan_e) selp[erank] = p;  // p in e's order, its first k + 1
    __syncthreads();
    const bool falls = i >= E || erank >= k || erank + 1 >= E || selp[erank] > selp[erank + 1];
    if (__syncthreads_and(falls && !nan_e)) {
      rank = erank;
    } else {
      if (i < E) sp[i] = p;
      __syncthreads();
      rank = i < E ? router_rank(sp, E, p, i) : k;
    }
  } else {
    __syncthreads();  // everyone has read red
    const float part = warp_sum_fast(e);
    if (lane == 0) red[warp] = part;
    __syncthreads();
    const float S = warp_sum_fast(lane < nw ? red[lane] : 0.0f);
    p = e * (1.0f / S);
    __syncthreads();
    sp[i] = p;
    __syncthreads();
    rank = i < E ? router_rank(sp, E, p, i) : k;
  }
  if (i < E && rank < k) {
    topk[(size_t)m * k + rank] = i;
    selp[rank] = p;
  }
  __syncthreads();
  if (i < k) {  // each of the k threads forms the same sum (same order), then its own weight:
                // the k divides side by side, not one after another in one thread
    float s = 0.0f;
    for (int j = 0; j < k; j++) s = EXACT ? FADD(s, selp[j]) : s + selp[j];
    topw[(size_t)m * k + i] = !norm ? selp[i] : (EXACT ? FDIV(selp[i], s) : selp[i] * (1.0f / s));
  }
}
