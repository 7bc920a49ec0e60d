// rope.cu — rotary position embedding, half-split (HF rotate_half). Toggle: rope.
//
// Versions:
//   rope_table_exact  contract L4a's cos/sin table (T2: the UCRT replicas); inv_freq
//                     is the model constant computed once on the host.
//   rope_table_fast   the device library's sincosf (not the UCRT's bits).
//   rope_exact        contract L4a's rotation (every product rounded, no FMA).
//   rope_fast         the same formula with FMA contraction (fmaf).
//   (Yarn, L4b/L4c, is not implemented here: the cuda subject refuses it.)
//
// The cos/sin table [M, hd/2] is built once per step and shared by every layer,
// like the reference. The rope kernels rotate the q heads and the k heads of M
// columns in one launch: grid (n_q + n_kv, M), block hd/2 rounded up to whole warps.
#include "rope.cuh"

// cos_t, sin_t: [M, half]; grid (ceil(half/64), M), block 64. dpos: null, or a device int
// that replaces pos0 (a captured CUDA graph replays one launch at every position).
extern "C" __global__ void rope_table_exact(const float *__restrict__ inv_freq, float *__restrict__ cos_t,
                                            float *__restrict__ sin_t, int pos0, int half,
                                            const int *__restrict__ dpos) {
  pdl_wait();
  if (dpos) pos0 = *dpos;
  const int i = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (i >= half) return;
  const float a = FMUL((float)(pos0 + m), inv_freq[i]);
  cos_t[(size_t)m * half + i] = cosf_ucrt(a);
  sin_t[(size_t)m * half + i] = sinf_ucrt(a);
}

extern "C" __global__ void rope_table_fast(const float *__restrict__ inv_freq, float *__restrict__ cos_t,
                                           float *__restrict__ sin_t, int pos0, int half,
                                            const int *__restrict__ dpos) {
  pdl_wait();
  if (dpos) pos0 = *dpos;
  const int i = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (i >= half) return;
  float s, c;
  sincosf((float)(pos0 + m) * inv_freq[i], &s, &c);
  cos_t[(size_t)m * half + i] = c;
  sin_t[(size_t)m * half + i] = s;
}

// q_in/q_out: [M, n_q, hd]; k_in/k_out: [M, n_kv, hd].
#define ROPE_KERNEL(NAME, EXACT)                                                                       \
  extern "C" __global__ void NAME(const float *__restrict__ q_in, float *__restrict__ q_out,           \
                                  const float *__restrict__ k_in, float *__restrict__ k_out,          \
                                  const float *__restrict__ cos_t, const float *__restrict__ sin_t,   \
                                  int n_q, int n_kv, int hd) {                                       \
    pdl_wait();                                                                                      \
    const int h = blockIdx.x, m = blockIdx.y, i = threadIdx.x, half = hd / 2;                        \
    if (i >= half) return; /* the block is whole warps: head_dims such as 80 leave lanes over */     \
    const bool is_q = h < n_q;                                                                       \
    const size_t row = is_q ? ((size_t)m * n_q + h) * hd : ((size_t)m * n_kv + (h - n_q)) * hd;      \
    const float *x = (is_q ? q_in : k_in) + row;                                                     \
    float *y = (is_q ? q_out : k_out) + row;                                                         \
    rope_rotate(x[i], x[i + half], cos_t[(size_t)m * half + i], sin_t[(size_t)m * half + i], y[i],   \
                y[i + half], EXACT);                                                                 \
  }

ROPE_KERNEL(rope_exact, true)
ROPE_KERNEL(rope_fast, false)
