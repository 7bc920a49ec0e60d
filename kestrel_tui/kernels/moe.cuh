// moe.cuh — the weighted expert sum of one element (moe.cu combine_*, and fused.cu's
// combine + RMSNorm launch use it, so both give the same bits).
#pragma once
#include "common.cuh"

// One slot's term of the expert sum, and the residual add: exact, every product and add
// rounded in rank order (the sum starts at 0); fast, an FMA chain.
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
