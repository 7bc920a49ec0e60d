// norm.cu — RMSNorm over the hidden size and QK-norm (RMSNorm per head over
// head_dim). Toggle: norm.
//
// Versions:
//   rmsnorm_exact   contract step 1: ss = block-8 sum of squares (8-element
//                   blocks lo[k]=x[b+k]^2, hi[k]=x[b+4+k]^2, lo+=hi,
//                   (lo0+lo1)+(lo2+lo3), blocks added in ascending order, tail
//                   element by element); rms = 1/sqrt(ss/d + eps) with IEEE
//                   divide and sqrt; out = (x*rms)*w. The per-block terms are
//                   computed in parallel, only the 256-term chain is serial.
//   rmsnorm_fast    what engines do: per-thread FMA partial sums, warp-shuffle
//                   tree, rsqrtf(ss*(1/d) + eps), out = x*(rms*w).
//   qknorm_exact    contract step 3: ss = sequential sum of x[j]*x[j] over the
//                   head, same rms formula; one warp per head, lane 0 sums.
//   qknorm_fast     warp-shuffle tree with FMAs and rsqrtf.
//
// Both qknorm kernels normalise the q heads and the k heads of M columns in one
// launch: grid (n_q + n_kv, M), head h < n_q is a q head.
#include "common.cuh"

#define NORM_THREADS 256
#define NORM_MAX_TERMS 4096  // hidden sizes up to 32768

// A single block per row is bound by load latency, not bandwidth: the row (x and w) is read
// into registers once, every load issued before the first use, and both passes work from
// there (rows past NORM_PER * NORM_THREADS elements take the rest from memory in the same
// order). The arithmetic and its order are the versions' above, so the bits are too.
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
                                           signed char *__restrict__ xq, float *__restrict__ xd, int quant) {
  const size_t row0 = (size_t)blockIdx.x * n;
#pragma unroll
  for (int k = 0; k < NORM_PER; k++) {
    const int j = threadIdx.x + k * NORM_THREADS;
    if (j < n) {
      const float v = norm_apply<EXACT>(r.x[k], r.w[k], rms);
      yr[j] = v;
      q8_0_warp(v, row0 + j, xq, xd, quant);
    }
  }
  for (int j = threadIdx.x + NORM_PER * NORM_THREADS; j < n; j += NORM_THREADS) {
    const float v = norm_apply<EXACT>(xr[j], w[j], rms);
    yr[j] = v;
    q8_0_warp(v, row0 + j, xq, xd, quant);
  }
}

// x, out: [M, n] row-major; grid = M blocks of NORM_THREADS. xq/xd: the q8_0 of out
// ([M, n] int8, [M, n/32]; n a multiple of 32) when quant != 0 (common.cuh q8_0_warp: one
// warp is 32 consecutive, 32-aligned elements, because element j = tid + k*NORM_THREADS).
extern "C" __global__ void rmsnorm_exact(const float *__restrict__ x, const float *__restrict__ w,
                                         float *__restrict__ out, int n, float eps, signed char *__restrict__ xq,
                                         float *__restrict__ xd, int quant) {
  pdl_wait();
  __shared__ float terms[NORM_MAX_TERMS];
  __shared__ float rms_s;
  const float *xr = x + (size_t)blockIdx.x * n;
  float *yr = out + (size_t)blockIdx.x * n;
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
    float ss = 0.0f;
    for (int b = 0; b < n8 / 8; b++) ss = FADD(ss, terms[b]);
    for (int j = n8; j < n; j++) ss = FADD(ss, FMUL(xr[j], xr[j]));
    rms_s = FDIV(1.0f, FSQRT(FADD(FDIV(ss, (float)n), eps)));
  }
  __syncthreads();
  norm_store<true>(xr, w, n, r, rms_s, yr, xq, xd, quant);
}

extern "C" __global__ void rmsnorm_fast(const float *__restrict__ x, const float *__restrict__ w,
                                        float *__restrict__ out, int n, float eps, signed char *__restrict__ xq,
                                        float *__restrict__ xd, int quant) {
  pdl_wait();
  __shared__ float partial[NORM_THREADS / 32];
  __shared__ float rms_s;
  const float *xr = x + (size_t)blockIdx.x * n;
  float *yr = out + (size_t)blockIdx.x * n;
  NormRow r;
  norm_load(xr, w, n, r);
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < NORM_PER; k++) acc = fmaf(r.x[k], r.x[k], acc);  // zeros past n add nothing
  for (int j = threadIdx.x + NORM_PER * NORM_THREADS; j < n; j += NORM_THREADS) acc = fmaf(xr[j], xr[j], acc);
  acc = warp_sum_fast(acc);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    v = warp_sum_fast(v);
    if (threadIdx.x == 0) rms_s = rsqrtf(v * (1.0f / (float)n) + eps);
  }
  __syncthreads();
  norm_store<false>(xr, w, n, r, rms_s, yr, xq, xd, quant);
}

// q_in/q_out: [M, n_q, hd]; k_in/k_out: [M, n_kv, hd]. grid (n_q + n_kv, M), block 32.
extern "C" __global__ void qknorm_exact(const float *__restrict__ q_in, float *__restrict__ q_out,
                                        const float *__restrict__ q_w, const float *__restrict__ k_in,
                                        float *__restrict__ k_out, const float *__restrict__ k_w,
                                        int n_q, int n_kv, int hd, float eps) {
  pdl_wait();
  const int h = blockIdx.x, m = blockIdx.y;
  const bool is_q = h < n_q;
  const float *x = is_q ? q_in + ((size_t)m * n_q + h) * hd : k_in + ((size_t)m * n_kv + (h - n_q)) * hd;
  float *y = is_q ? q_out + ((size_t)m * n_q + h) * hd : k_out + ((size_t)m * n_kv + (h - n_q)) * hd;
  const float *w = is_q ? q_w : k_w;
  float ss = 0.0f;
  if (threadIdx.x == 0) {
    for (int j = 0; j < hd; j++) ss = FADD(ss, FMUL(x[j], x[j]));
  }
  ss = __shfl_sync(FULL_MASK, ss, 0);
  const float rms = FDIV(1.0f, FSQRT(FADD(FDIV(ss, (float)hd), eps)));
  for (int j = threadIdx.x; j < hd; j += 32) y[j] = FMUL(FMUL(x[j], rms), w[j]);
}

extern "C" __global__ void qknorm_fast(const float *__restrict__ q_in, float *__restrict__ q_out,
                                       const float *__restrict__ q_w, const float *__restrict__ k_in,
                                       float *__restrict__ k_out, const float *__restrict__ k_w,
                                       int n_q, int n_kv, int hd, float eps) {
  pdl_wait();
  const int h = blockIdx.x, m = blockIdx.y;
  const bool is_q = h < n_q;
  const float *x = is_q ? q_in + ((size_t)m * n_q + h) * hd : k_in + ((size_t)m * n_kv + (h - n_q)) * hd;
  float *y = is_q ? q_out + ((size_t)m * n_q + h) * hd : k_out + ((size_t)m * n_kv + (h - n_q)) * hd;
  const float *w = is_q ? q_w : k_w;
  float acc = 0.0f;
  for (int j = threadIdx.x; j < hd; j += 32) acc = fmaf(x[j], x[j], acc);
  acc = warp_sum_fast(acc);
  const float rms = rsqrtf(acc * (1.0f / (float)hd) + eps);
  for (int j = threadIdx.x; j < hd; j += 32) y[j] = x[j] * (rms * w[j]);
}
