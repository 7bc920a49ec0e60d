// norm.cuh — the RMSNorm and QK-norm arithmetic as device functions (norm.cu's kernels and
// fused.cu's launches call them, so both give the same bits). The versions: norm.cu.
#pragma once
#include "common.cuh"

#define NORM_THREADS 256  // the block of every RMSNorm launch: the element loops step by it
#define NORM_MAX_TERMS 4096  // hidden sizes up to 32768

// A single block per row is bound by load latency, not bandwidth: the row (x and w) is read
// into registers once, every load issued before the first use, and both passes work from
// there (rows past NORM_PER * NORM_THREADS elements take the rest from memory in the same
// order). The arithmetic and its order are the versions', so the bits are too.
#define NORM_PER 8  // elements a thread keeps in registers: hidden 2048 at 256 threads

struct NormRow {
  float x[NORM_PER], w[NORM_PER];
};

__device__ __forceinline__ void norm_load(const float *__restrict__ xr, const float *__restrict__ w, int n,
                                          NormRow &r) {
#pragma unroll
  for (int k = 0; k < NORM_PER; k++) {
    const int j = threadIdx.x + k * NORM_THREADS;
    r.x[k] = j < n ? xr[j] : 0.0f;
    r.w[k] = j < n ? w[j] : 0.0f;
  }
}

// y = out row; the value of element j is f(x[j], w[j]) for the version's f.
template <bool EXACT>
__device__ __forceinline__ float norm_apply(float x, float w, float rms) {
  return EXACT ? FMUL(FMUL(x, rms), w) : x * (rms * w);
}

template <bool EXACT>
__device__ __forceinline__ void norm_store(const float *__restrict__ xr, const float *__restrict__ w, int n,
                                           const NormRow &r, float rms, float *__restrict__ yr,
                                           signed char *__restrict__ xq, float *__restrict__ xd, int quant,
                                           int row) {
  const size_t row0 = (size_t)row * n;
  float v[NORM_PER];
  int n_valid = 0;  // whole warps: j < n is the same for a warp's lanes (n is a multiple of 32 when quant)
#pragma unroll
  for (int k = 0; k < NORM_PER; k++) {
    const int j = threadIdx.x + k * NORM_THREADS;
    v[k] = norm_apply<EXACT>(r.x[k], r.w[k], rms);
    if (j < n) {
      yr[j] = v[k];
      n_valid = k + 1;
    }
  }
  q8_0_warp_n<NORM_PER>(v, row0 + threadIdx.x, NORM_THREADS, n_valid, xq, xd, quant);
  for (int j = threadIdx.x + NORM_PER * NORM_THREADS; j < n; j += NORM_THREADS) {
    const float v = norm_apply<EXACT>(xr[j], w[j], rms);
    yr[j] = v;
    q8_0_warp(v, row0 + j, xq, xd, quant);
  }
}

// 1/sqrt(ss/n + eps): contract L1/L3, every op rounded (exact); rsqrtf of the FMA form (fast).
__device__ __forceinline__ float norm_rms_exact(float ss, int n, float eps) {
  return FDIV(1.0f, FSQRT(FADD(div_by_count(ss, n), eps)));
}
__device__ __forceinline__ float norm_rms_fast(float ss, int n, float eps) { return rsqrtf(ss * (1.0f / (float)n) + eps); }

// The fast block sum of one value a thread (NORM_THREADS): warp trees, then one warp over the
// warps' sums; thread 0 holds the total. partial: NORM_THREADS / 32 floats of shared memory.
__device__ __forceinline__ float norm_block_sum_fast(float acc, float *partial) {
  acc = warp_sum_fast(acc);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
  __syncthreads();
  float v = 0.0f;
  if (threadIdx.x < 32) {
    v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    v = warp_sum_fast(v);
  }
  return v;
}

// One row (xr -> yr, the q8_0 of yr to xq/xd when quant != 0) by a block of NORM_THREADS;
// row: its index in xq/xd. Contract L1 (exact) or the fast version (norm.cu).
__device__ __forceinline__ void rmsnorm_row_exact(const float *__restrict__ xr, const float *__restrict__ w,
                                                  float *__restrict__ yr, int n, float eps,
                                                  signed char *__restrict__ xq, float *__restrict__ xd, int quant,
                                                  int row) {
  __shared__ __align__(16) float terms[NORM_MAX_TERMS];
  __shared__ float rms_s;
  NormRow r;
  norm_load(xr, w, n, r);
  const int n8 = n & ~7;
  for (int b = threadIdx.x; b < n8 / 8; b += blockDim.x) {
    const float *v = xr + 8 * b;
    float lo[4];
#pragma unroll
    for (int k = 0; k < 4; k++) lo[k] = FADD(FMUL(v[k], v[k]), FMUL(v[4 + k], v[4 + k]));
    terms[b] = FADD(FADD(lo[0], lo[1]), FADD(lo[2], lo[3]));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float ss = serial_sum_shared(terms, n8 / 8);
    for (int j = n8; j < n; j++) ss = FADD(ss, FMUL(xr[j], xr[j]));
    rms_s = norm_rms_exact(ss, n, eps);
  }
  __syncthreads();
  norm_store<true>(xr, w, n, r, rms_s, yr, xq, xd, quant, row);
}

__device__ __forceinline__ void rmsnorm_row_fast(const float *__restrict__ xr, const float *__restrict__ w,
                                                 float *__restrict__ yr, int n, float eps,
                                                 signed char *__restrict__ xq, float *__restrict__ xd, int quant,
                                                 int row) {
  __shared__ float partial[NORM_THREADS / 32];
  __shared__ float rms_s;
  NormRow r;
  norm_load(xr, w, n, r);
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < NORM_PER; k++) acc = fmaf(r.x[k], r.x[k], acc);  // zeros past n add nothing
  for (int j = threadIdx.x + NORM_PER * NORM_THREADS; j < n; j += NORM_THREADS) acc = fmaf(xr[j], xr[j], acc);
  const float ss = norm_block_sum_fast(acc, partial);
  if (threadIdx.x == 0) rms_s = norm_rms_fast(ss, n, eps);
  __syncthreads();
  norm_store<false>(xr, w, n, r, rms_s, yr, xq, xd, quant, row);
}

template <bool EXACT>
__device__ __forceinline__ void rmsnorm_row(const float *__restrict__ xr, const float *__restrict__ w,
                                            float *__restrict__ yr, int n, float eps, signed char *__restrict__ xq,
                                            float *__restrict__ xd, int quant, int row) {
  if (EXACT)
    rmsnorm_row_exact(xr, w, yr, n, eps, xq, xd, quant, row);
  else
    rmsnorm_row_fast(xr, w, yr, n, eps, xq, xd, quant, row);
}

// QK-norm of one head held by one warp (the block), v[i] = x[lane + 32 i] (hd <= 32 *
// HEAD_PER_LANE, a multiple of 16): returns rms. Exact: contract L3 (R3); fast: FMA partial
// sums per lane in i order and the warp tree.
#define HEAD_PER_LANE 8  // head_dim <= 256
__device__ __forceinline__ float qk_rms(const float (&v)[HEAD_PER_LANE], int hd,
                                        float eps, bool exact) {
  if (exact) {  // the lanes form the products, lane 0 adds them in order from shared memory
    __shared__ __align__(16) float sq[32 * HEAD_PER_LANE];
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < HEAD_PER_LANE; i++)
      if (lane + 32 * i < hd) sq[lane + 32 * i] = FMUL(v[i], v[i]);
    __syncwarp();
    float ss = lane == 0 ? serial_sum_shared(sq, hd) : 0.0f;
    ss = __shfl_sync(FULL_MASK, ss, 0);
    return norm_rms_exact(ss, hd, eps);
  }
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < HEAD_PER_LANE; i++) acc = fmaf(v[i], v[i], acc);  // zeros past hd add nothing
  acc = warp_sum_fast(acc);
  return norm_rms_fast(acc, hd, eps);
}

__device__ __forceinline__ float qk_apply(float x, float rms, float w, bool exact) {
  return exact ? FMUL(FMUL(x, rms), w) : x * (rms * w);
}

__device__ __forceinline__ void head_load(const float *__restrict__ x, int hd, float (&v)[HEAD_PER_LANE]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < HEAD_PER_LANE; i++) v[i] = lane + 32 * i < hd ? x[lane + 32 * i] : 0.0f;
}
