// kvquant.cu — the KV cache row at the new positions (contract L5). Toggle: kvquant.
//
// Versions:
//   kvquant_exact  contract Q3: a q8 row per kv head.
//   kvquant_fast   the common GPU shortcut: inv = 127/amax computed directly,
//                  q = rint(x*inv) (ties to even), scale amax/127.
//   kv_rows_f32    --kv f32: the rows are stored as they are, scales 1.0
//                  (no quantization, so there is nothing to toggle).
//
// One launch writes the K rows (from RoPE'd K) and the V rows (from the V
// projection) of M columns: grid (2*n_kv, M), block 32 (one warp per row).
// Each row goes to its probe buffer and, when the cache pointers are not null,
// straight into the cache at position pos0+m (isolate mode passes null and
// copies the reference's rows into the cache instead).
// The attention kernels' query quantization (contract Q4, the same rule as
// kvquant_exact) lives in attention.cu, next to its only user.
#include "kvquant.cuh"

// k_in/v_in: [M, n_kv, hd] f32; k_out/v_out: [M, n_kv, hd] int8; ks_out/vs_out: [M, n_kv];
// k_cache..vs_cache: the layer's cache [cap, n_kv, hd] / [cap, n_kv], or null.
#define KVQUANT_KERNEL(NAME, EXACT)                                                                    \
  extern "C" __global__ void NAME(const float *__restrict__ k_in, const float *__restrict__ v_in,      \
                                  signed char *__restrict__ k_out, float *__restrict__ ks_out,        \
                                  signed char *__restrict__ v_out, float *__restrict__ vs_out,        \
                                  signed char *__restrict__ k_cache, float *__restrict__ ks_cache,    \
                                  signed char *__restrict__ v_cache, float *__restrict__ vs_cache,    \
                                  int pos0, int n_kv, int hd, const int *__restrict__ dpos) {         \
    pdl_wait();                                                                                      \
    if (dpos) pos0 = *dpos;                                                                          \
    const int m = blockIdx.y, is_v = blockIdx.x >= n_kv, h = blockIdx.x - (is_v ? n_kv : 0);          \
    const size_t row = (size_t)m * n_kv + h, crow = (size_t)(pos0 + m) * n_kv + h;                    \
    const float *x = (is_v ? v_in : k_in) + row * hd;                                                 \
    signed char *qo = (is_v ? v_out : k_out) + row * hd;                                              \
    float *so = (is_v ? vs_out : ks_out) + row;                                                       \
    signed char *qc = is_v ? v_cache : k_cache;                                                       \
    float *sc = is_v ? vs_cache : ks_cache;                                                           \
    kv_row_q8<EXACT>(x, qo, so, qc ? qc + crow * hd : nullptr, sc ? sc + crow : nullptr, hd);         \
  }

KVQUANT_KERNEL(kvquant_exact, true)
KVQUANT_KERNEL(kvquant_fast, false)

extern "C" __global__ void kv_rows_f32(const float *__restrict__ k_in, const float *__restrict__ v_in,
                                       float *__restrict__ k_out, float *__restrict__ ks_out,
                                       float *__restrict__ v_out, float *__restrict__ vs_out,
                                       float *__restrict__ k_cache, float *__restrict__ ks_cache,
                                       float *__restrict__ v_cache, float *__restrict__ vs_cache,
                                       int pos0, int n_kv, int hd, const int *__restrict__ dpos) {
  pdl_wait();
  if (dpos) pos0 = *dpos;
  const int m = blockIdx.y, is_v = blockIdx.x >= n_kv, h = blockIdx.x - (is_v ? n_kv : 0);
  const size_t row = (size_t)m * n_kv + h, crow = (size_t)(pos0 + m) * n_kv + h;
  const float *x = (is_v ? v_in : k_in) + row * hd;
  float *xo = (is_v ? v_out : k_out) + row * hd;
  float *xc = is_v ? v_cache : k_cache;
  for (int j = threadIdx.x; j < hd; j += 32) {
    xo[j] = x[j];
    if (xc) xc[crow * hd + j] = x[j];
  }
  if (threadIdx.x == 0) {
    (is_v ? vs_out : ks_out)[row] = 1.0f;
    float *sc = is_v ? vs_cache : ks_cache;
    if (sc) sc[crow] = 1.0f;
  }
}
