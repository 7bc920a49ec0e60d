// moe.cuh — the weighted expert sum of one element (moe.cu combine_*, and fused.cu's
// combine + RMSNorm launch use it, so both give the same bits).
#pragma once
#include "common.cuh"

// x[m, i] = res[m, i] + sum_j w[m, j] * y[m, j, i]: exact, every product and add rounded in
// rank order (moe = 0 first); fast, an FMA chain. Returns x; writes moe and x.
template <bool EXACT>
__device__ __forceinline__ float moe_combine(const float *__restrict__ y, const float *__restrict__ w,
                                             const float *__restrict__ res, float *__restrict__ moe,
                                             float *__restrict__ x, int n, int k, int m, int i) {
  float acc = 0.0f;
  for (int j = 0; j < k; j++) {
    const float wj = w[(size_t)m * k + j], yj = y[((size_t)m * k + j) * n + i];
    acc = EXACT ? FADD(acc, FMUL(wj, yj)) : fmaf(wj, yj, acc);
  }
  const float xv = EXACT ? FADD(res[(size_t)m * n + i], acc) : res[(size_t)m * n + i] + acc;
  moe[(size_t)m * n + i] = acc;
  x[(size_t)m * n + i] = xv;
  return xv;
}
