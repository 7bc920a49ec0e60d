// kvquant.cuh — the q8 KV row rule (kvquant.cu's kernels and fused.cu's per-head launch
// call it, so both give the same bits). The versions: kvquant.cu.
#pragma once
#include "common.cuh"

#define KV_MAX_PER_LANE 8  // head_dim <= 256

// One row held by one warp, v[i] = x[lane + 32 i] (0 past hd): its q8 values and scale (exact:
// contract Q3) to the probe buffers and, when not null, to the cache row.
template <bool EXACT>
__device__ __forceinline__ void kv_row_q8_regs(const float (&v)[KV_MAX_PER_LANE], signed char *__restrict__ q_out,
                                               float *__restrict__ s_out, signed char *__restrict__ q_cache,
                                               float *__restrict__ s_cache, int hd) {
  const int lane = threadIdx.x & 31;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < KV_MAX_PER_LANE; i++) amax = fmaxf(amax, fabsf(v[i]));
  amax = warp_max(amax);
  float d, id;
  if (EXACT) {
    d = FDIV(amax, 127.0f);
    id = q8_inverse(d);
  } else {
    d = amax / 127.0f;
    id = amax == 0.0f ? 0.0f : 127.0f / amax;
  }
#pragma unroll
  for (int i = 0; i < KV_MAX_PER_LANE; i++) {
    const int j = lane + 32 * i;
    if (j < hd) {
      const float r = EXACT ? roundf(FMUL(v[i], id)) : rintf(v[i] * id);
      const signed char q = (signed char)fminf(127.0f, fmaxf(-127.0f, r));
      q_out[j] = q;
      if (q_cache) q_cache[j] = q;
    }
  }
  if (lane == 0) {
    *s_out = d;
    if (s_cache) *s_cache = d;
  }
}

template <bool EXACT>
__device__ __forceinline__ void kv_row_q8(const float *__restrict__ x, signed char *__restrict__ q_out,
                                          float *__restrict__ s_out, signed char *__restrict__ q_cache,
                                          float *__restrict__ s_cache, int hd) {
  const int lane = threadIdx.x & 31;
  float v[KV_MAX_PER_LANE];
#pragma unroll
  for (int i = 0; i < KV_MAX_PER_LANE; i++) v[i] = lane + 32 * i < hd ? x[lane + 32 * i] : 0.0f;
  kv_row_q8_regs<EXACT>(v, q_out, s_out, q_cache, s_cache, hd);
}
