// gemv.cu — matrix x vector products over M columns, the q8_0 activation
// quantization in front of them, and the embedding lookup. Toggle: gemm.
//
// Weights on the device (backends/cuda/weights.py):
//   q4_0: nibbles [..., out, nb, 16] bytes (ggml packing: byte j holds q[j] in
//         the low and q[j+16] in the high nibble, both +8), scales f16
//         [..., out, nb]; the leading axis indexes experts.
//   f32:  [..., out, in].
// Activations: q8_0 values int8 [R, nb*32] and scales f32 [R, nb] (the f16
// rounded values), R = columns (dense) or (column, expert) pairs.
//
// Versions:
//   quantize_q8_0_exact  contract Q2 (ggml quantize_row_q8_0_ref).
//   quantize_q8_0_fast   ggml-cuda quantize_q8_1: q = roundf(x / d) (a divide
//                        instead of the reciprocal multiply).
//   gemv_q4_exact        contract G1 (R1 over the blocks, isum by __dp4a).
//                        One warp per output row, up to GEMV_MC columns per
//                        warp so a weight block is read once for several
//                        columns; every column is still reduced on its own
//                        (G3). At M = 1 a warp takes GEMV_ROWS1 rows instead
//                        (gemv.cuh gemv_q4_m1: the layer's rows in one wave of
//                        blocks).
//   gemv_q4_fast         same loop with the term fused: acc = fma(float(isum),
//                        dw*dx, acc) — what FMA contraction makes of it — and
//                        the block order chosen by M (gemv_split below:
//                        contiguous lane runs and a reversed lane tree at
//                        M = 1, 2 warps a row at M = 2..4, strided lanes from
//                        5), so its reduction order, and its bits, change with
//                        the batch width. (The fast kernels' launch bounds keep
//                        their registers to 6 blocks an SM.)
//   gemv_q4_x3_*         gemv_q4 of three matrices of one input in one launch
//                        (q, k, v), their row blocks one after the other.
//   gemv_q4_experts_*    the same for stacked experts: grid.y = (column,
//                        slot) pairs, each with its own expert id; grid.z picks
//                        one of two matrices (gate and up in one launch).
//   gemv_f32_exact       --weights f32: contract G2.
//   gemv_f32_fast        FMA accumulation.
//   gemv_f32_experts_*   stacked-expert versions.
//   embed_q4 / embed_f32 the embedding row (contract L9's emb); no toggle.
//
// Every dense kernel can add a residual: y = res + W x (the add is rounded on
// its own, as contract L7's ores = x + o).
#include "gemv.cuh"


// ------------------------------------------------------------ activation quantization

// x: [n_total] f32 (n_total a multiple of 32, rows laid end to end); the rule: common.cuh
// q8_0_warp.
template <bool EXACT>
__device__ __forceinline__ void quantize_q8_0(const float *__restrict__ x, signed char *__restrict__ q,
                                              float *__restrict__ d_out, int n_total) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i - (threadIdx.x & 31) >= n_total) return;  // whole warps only
  q8_0_warp(x[i], i, q, d_out, EXACT ? 2 : 1);
}

extern "C" __global__ void quantize_q8_0_exact(const float *__restrict__ x, signed char *__restrict__ q,
                                               float *__restrict__ d, int n_total) {
  pdl_wait();
  quantize_q8_0<true>(x, q, d, n_total);
}
extern "C" __global__ void quantize_q8_0_fast(const float *__restrict__ x, signed char *__restrict__ q,
                                              float *__restrict__ d, int n_total) {
  pdl_wait();
  quantize_q8_0<false>(x, q, d, n_total);
}


extern "C" __global__ void gemv_q4_exact(const uint4 *W, const __half *D, const signed char *xq, const float *xd,
                                         const float *res, float *y, int out, int nb, int M) {
  // pdl_wait(): inside gemv_q4, behind the first weight loads
  const size_t m0 = (size_t)blockIdx.y * GEMV_MC;
  gemv_q4<true>(W, D, xq + m0 * nb * QK, xd + m0 * nb, res, y, out, nb, M, blockIdx.x);
}
// (fast: launch bounds keep the multi-column loop in the registers of 6 blocks an SM, so a
// decode layer's GEMV blocks fit in one wave)
extern "C" __global__ void __launch_bounds__(128, 6)
    gemv_q4_fast(const uint4 *W, const __half *D, const signed char *xq, const float *xd, const float *res, float *y,
                 int out, int nb, int M) {
  // pdl_wait(): inside gemv_q4, behind the first weight loads
  const size_t m0 = (size_t)blockIdx.y * GEMV_MC;
  gemv_q4<false>(W, D, xq + m0 * nb * QK, xd + m0 * nb, res, y, out, nb, M, blockIdx.x);
}

extern "C" __global__ void gemv_q4_x3_exact(const uint4 *W0, const __half *D0, float *y0, int out0, const uint4 *W1,
                                            const __half *D1, float *y1, int out1, const uint4 *W2,
                                            const __half *D2, float *y2, int out2, const signed char *xq,
                                            const float *xd, int nb, int M) {
  // pdl_wait(): inside gemv_q4, behind the first weight loads
  const size_t m0 = (size_t)blockIdx.y * GEMV_MC;
  gemv_q4_x3<true>(W0, D0, y0, out0, W1, D1, y1, out1, W2, D2, y2, out2, xq + m0 * nb * QK, xd + m0 * nb, nb, M);
}
extern "C" __global__ void __launch_bounds__(128, 6)
    gemv_q4_x3_fast(const uint4 *W0, const __half *D0, float *y0, int out0, const uint4 *W1, const __half *D1,
                    float *y1, int out1, const uint4 *W2, const __half *D2, float *y2, int out2,
                    const signed char *xq, const float *xd, int nb, int M) {
  // pdl_wait(): inside gemv_q4, behind the first weight loads
  const size_t m0 = (size_t)blockIdx.y * GEMV_MC;
  gemv_q4_x3<false>(W0, D0, y0, out0, W1, D1, y1, out1, W2, D2, y2, out2, xq + m0 * nb * QK, xd + m0 * nb, nb, M);
}

extern "C" __global__ void gemv_q4_experts_exact(const uint4 *W0, const __half *D0, float *y0, const uint4 *W1,
                                                 const __half *D1, float *y1, const int *eidx,
                                                 const signed char *xq, const float *xd, int x_div, int out,
                                                 int nb) {
  pdl_wait();
  gemv_q4_experts<true>(W0, D0, y0, W1, D1, y1, eidx, xq, xd, x_div, out, nb);
}
extern "C" __global__ void gemv_q4_experts_fast(const uint4 *W0, const __half *D0, float *y0, const uint4 *W1,
                                                const __half *D1, float *y1, const int *eidx,
                                                const signed char *xq, const float *xd, int x_div, int out,
                                                int nb) {
  pdl_wait();
  gemv_q4_experts<false>(W0, D0, y0, W1, D1, y1, eidx, xq, xd, x_div, out, nb);
}

// ------------------------------------------------------------ f32 weights

template <bool EXACT, int MC>
__device__ __forceinline__ void f32_lane_dot(const float *__restrict__ wrow, const float *__restrict__ x, int n,
                                             int ncols, float (&acc)[MC]) {
  const int lane = threadIdx.x & 31;
  for (int j = lane; j < n; j += 32) {
    const float w = wrow[j];
#pragma unroll
    for (int c = 0; c < MC; c++) {
      if (c < ncols) {
        const float xv = x[(size_t)c * n + j];
        acc[c] = EXACT ? FADD(acc[c], FMUL(w, xv)) : fmaf(w, xv, acc[c]);
      }
    }
  }
}

// W: [out, n]; x: [M, n]; res, y: [M, out]. Same grid as gemv_q4.
template <bool EXACT>
__device__ __forceinline__ void gemv_f32(const float *__restrict__ W, const float *__restrict__ x,
                                         const float *__restrict__ res, float *__restrict__ y, int out, int n,
                                         int M) {
  const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (row >= out) return;
  const int m0 = blockIdx.y * GEMV_MC;
  const int ncols = min(GEMV_MC, M - m0);
  float acc[GEMV_MC];
#pragma unroll
  for (int c = 0; c < GEMV_MC; c++) acc[c] = 0.0f;
  f32_lane_dot<EXACT, GEMV_MC>(W + (size_t)row * n, x + (size_t)m0 * n, n, ncols, acc);
#pragma unroll
  for (int c = 0; c < GEMV_MC; c++) acc[c] = lane_reduce<EXACT>(acc[c]);
  if ((threadIdx.x & 31) == 0) {
    for (int c = 0; c < ncols; c++) {
      const size_t o = (size_t)(m0 + c) * out + row;
      y[o] = res ? (EXACT ? FADD(res[o], acc[c]) : res[o] + acc[c]) : acc[c];
    }
  }
}

extern "C" __global__ void gemv_f32_exact(const float *W, const float *x, const float *res, float *y, int out,
                                          int n, int M) {
  pdl_wait();
  gemv_f32<true>(W, x, res, y, out, n, M);
}
extern "C" __global__ void gemv_f32_fast(const float *W, const float *x, const float *res, float *y, int out,
                                         int n, int M) {
  pdl_wait();
  gemv_f32<false>(W, x, res, y, out, n, M);
}

template <bool EXACT>
__device__ __forceinline__ void gemv_f32_experts(const float *W0, float *y0, const float *W1, float *y1,
                                                 const int *eidx, const float *x, int x_div, int out, int n) {
  const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (row >= out) return;
  const int pair = blockIdx.y, e = eidx[pair], xc = pair / x_div;
  const float *W = blockIdx.z ? W1 : W0;
  float *y = blockIdx.z ? y1 : y0;
  float acc[1] = {0.0f};
  f32_lane_dot<EXACT, 1>(W + ((size_t)e * out + row) * n, x + (size_t)xc * n, n, 1, acc);
  acc[0] = lane_reduce<EXACT>(acc[0]);
  if ((threadIdx.x & 31) == 0) y[(size_t)pair * out + row] = acc[0];
}

extern "C" __global__ void gemv_f32_experts_exact(const float *W0, float *y0, const float *W1, float *y1,
                                                  const int *eidx, const float *x, int x_div, int out, int n) {
  pdl_wait();
  gemv_f32_experts<true>(W0, y0, W1, y1, eidx, x, x_div, out, n);
}
extern "C" __global__ void gemv_f32_experts_fast(const float *W0, float *y0, const float *W1, float *y1,
                                                 const int *eidx, const float *x, int x_div, int out, int n) {
  pdl_wait();
  gemv_f32_experts<false>(W0, y0, W1, y1, eidx, x, x_div, out, n);
}

// ------------------------------------------------------------ embedding

// out: [M, nb*32]; grid (ceil(nb*32/256), M), block 256.
extern "C" __global__ void embed_q4(const unsigned char *__restrict__ Wq, const __half *__restrict__ D,
                                    const int *__restrict__ tokens, float *__restrict__ out, int nb) {
  pdl_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (i >= nb * QK) return;
  const size_t tok = (size_t)tokens[m];
  const int b = i / QK, j = i % QK;
  const unsigned char byte = Wq[(tok * nb + b) * 16 + (j & 15)];
  const int q = (j < 16 ? (byte & 15) : (byte >> 4)) - 8;
  out[(size_t)m * nb * QK + i] = FMUL(__half2float(D[tok * nb + b]), (float)q);
}

extern "C" __global__ void embed_f32(const float *__restrict__ W, const int *__restrict__ tokens,
                                     float *__restrict__ out, int n) {
  pdl_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (i >= n) return;
  out[(size_t)m * n + i] = W[(size_t)tokens[m] * n + i];
}

// ------------------------------------------------------------ synthetic weights on the device

// Counter-based RNG: splitmix64 of (seed, block index). Fills q4_0 blocks with
// uniform nibbles and f16 scales d = dscale * (0.5 + u), u uniform in [0, 1),
// so a full-size model is generated in place without a host copy. (Not the
// embedded model's values, which model/weights.py draws from PCG64; the host
// twin of this generator, the same bytes, is model/device_synthetic.py.)
// W: [n] uint4, D: [n] f16 (the layout of weights.py); grid-stride.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

extern "C" __global__ void gen_q4(uint4 *__restrict__ W, __half *__restrict__ D, int n, int seed,
                                  float dscale) {
  pdl_wait();
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const unsigned long long base = splitmix64(((unsigned long long)(unsigned)seed << 32) ^
                                               ((unsigned long long)i * 0xd1342543de82ef95ull));
    const unsigned long long a = splitmix64(base), b = splitmix64(base + 1), c = splitmix64(base + 2);
    W[i] = make_uint4((unsigned)a, (unsigned)(a >> 32), (unsigned)b, (unsigned)(b >> 32));
    const float u = (float)(c >> 40) * (1.0f / 16777216.0f);
    D[i] = __float2half_rn(dscale * (0.5f + u));
  }
}
