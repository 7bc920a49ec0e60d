// gemv.cuh — the q4_0 x q8_0 matrix-vector arithmetic as device functions (gemv.cu's
// kernels and fused.cu's launches call them, so both give the same bits). The versions:
// gemv.cu.
#pragma once
#include "common.cuh"

#define GEMV_WARPS 4  // rows per block
#define GEMV_MC 4     // columns per warp (dense kernels)

// ------------------------------------------------------------ q4_0 x q8_0

// Contract G1's isum of one 32-block (exact in int32 whatever the order, N4): the packed
// nibbles (q in 0..15) against the q8 activation by dp4a, minus 8*sum(x).
__device__ __forceinline__ int q4_q8_block_isum(const uint4 wv, const int4 *__restrict__ xp) {
  const int wl0 = wv.x & 0x0F0F0F0F, wl1 = wv.y & 0x0F0F0F0F, wl2 = wv.z & 0x0F0F0F0F, wl3 = wv.w & 0x0F0F0F0F;
  const int wh0 = (wv.x >> 4) & 0x0F0F0F0F, wh1 = (wv.y >> 4) & 0x0F0F0F0F;
  const int wh2 = (wv.z >> 4) & 0x0F0F0F0F, wh3 = (wv.w >> 4) & 0x0F0F0F0F;
  const int4 xa = xp[0], xb = xp[1];
  int su = __dp4a(wl0, xa.x, 0);
  su = __dp4a(wl1, xa.y, su);
  su = __dp4a(wl2, xa.z, su);
  su = __dp4a(wl3, xa.w, su);
  su = __dp4a(wh0, xb.x, su);
  su = __dp4a(wh1, xb.y, su);
  su = __dp4a(wh2, xb.z, su);
  su = __dp4a(wh3, xb.w, su);
  int sx = __dp4a(0x01010101, xa.x, 0);
  sx = __dp4a(0x01010101, xa.y, sx);
  sx = __dp4a(0x01010101, xa.z, sx);
  sx = __dp4a(0x01010101, xa.w, sx);
  sx = __dp4a(0x01010101, xb.x, sx);
  sx = __dp4a(0x01010101, xb.y, sx);
  sx = __dp4a(0x01010101, xb.z, sx);
  sx = __dp4a(0x01010101, xb.w, sx);
  return su - 8 * sx;
}

#define GEMV_PF 4  // weight blocks a lane loads before its first dot (a decode GEMV row is a few a lane)

template <bool EXACT>
__device__ __forceinline__ float lane_reduce(float v) {
  return EXACT ? warp_butterfly_exact(v) : warp_sum_fast(v);
}

// The lanes' sums of the fast M = 1 GEMV, added in the other butterfly order (offsets 1, 2,
// .., 16): a different tree from every other width's, whatever the row length.
__device__ __forceinline__ float warp_sum_fast_rev(float v) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
  return v;
}

// The fast dense GEMV picks its reduction order by the batch width M like a
// real engine picks its tiling: at M = 1 one warp a row, lane l taking a
// contiguous run of the row's blocks (16-byte loads back to back) and the
// lanes' sums added in the reversed butterfly order (warp_sum_fast_rev); at M = 2..4
// two warps share a row (warp w takes the w-th half of the blocks, its lanes
// strided over it; the halves added in shared memory); from M = 5 one warp a
// row with lanes strided over the blocks. So batch-verify columns differ from
// M = 1 decode in fast mode. The exact GEMV never splits (contract G1, R1, G3).
// Host mirror: backends/cuda/launches.py gemv_split() (warps a row).
__device__ __forceinline__ int gemv_split(int M) { return M == 1 ? 1 : (M <= 4 ? 2 : 1); }

// W: [out, nb] uint4, D: [out, nb] f16; res, y: [M, out]; xq: [ncols, nb*32] and xd: [ncols, nb],
// the q8_0 of columns m0 = blockIdx.y*GEMV_MC .. m0+ncols-1. grid (ceil(out/rows a block),
// ceil(M/GEMV_MC)), block 32*warps (warps <= GEMV_MAX_WARPS); rows a block: warps*GEMV_ROWS1
// at M = 1 (gemv_q4_m1), else warps/ks with ks = 1 (exact) or gemv_split(M). A row's
// arithmetic does not depend on the block size.
//
// The kernel's pdl_wait() is in here, after the lane's first weight blocks are in flight:
// weights are never written by a step, so their loads may go ahead of the wait, and with the
// early trigger (kernels/common.cuh pdl_wait; off by default) they overlap the kernel in front.
// A lane's blocks at M > 1: split, its warp's share strided by 32 from lane; else lane,
// lane+32, ... Every lane adds its terms in that order, each term as the version says.
#define GEMV_MAX_WARPS 8
// One lane's terms of a row against up to GEMV_MC columns (ncols of them): its blocks
// b_first, b_first + b_step, ... below b_end, GEMV_PF weight blocks loaded ahead of their dots;
// the kernel's pdl_wait() once the first ones are in flight (gemv_q4).
template <bool EXACT>
__device__ __forceinline__ void q4_lane_terms(const uint4 *__restrict__ wr, const __half *__restrict__ dr, int b_first,
                                              int b_step, int b_end, const signed char *__restrict__ xq,
                                              const float *__restrict__ xd, int nb, int ncols,
                                              float (&acc)[GEMV_MC]) {
  uint4 wv[GEMV_PF];
  float dw[GEMV_PF];
  auto load = [&](int b0) {
#pragma unroll
    for (int u = 0; u < GEMV_PF; u++) {
      const int b = b0 + u * b_step;
      wv[u] = b < b_end ? wr[b] : make_uint4(0, 0, 0, 0);
      dw[u] = b < b_end ? __half2float(dr[b]) : 0.0f;
    }
  };
  load(b_first);
  pdl_wait();
#pragma unroll
  for (int c = 0; c < GEMV_MC; c++) acc[c] = 0.0f;
  for (int b0 = b_first; b0 < b_end; b0 += GEMV_PF * b_step) {
    if (b0 != b_first) load(b0);
#pragma unroll
    for (int u = 0; u < GEMV_PF; u++) {
      const int b = b0 + u * b_step;
      if (b >= b_end) break;
#pragma unroll
      for (int c = 0; c < GEMV_MC; c++) {
        if (c < ncols) {
          const float fsum = __int2float_rn(q4_q8_block_isum(wv[u], (const int4 *)(xq + ((size_t)c * nb + b) * QK)));
          const float dx = xd[(size_t)c * nb + b];
          if (EXACT)
            acc[c] = FADD(acc[c], FMUL(fsum, FMUL(dw[u], dx)));
          else
            acc[c] = fmaf(fsum, dw[u] * dx, acc[c]);
        }
      }
    }
  }
}

// M = 1 (decode): GEMV_ROWS1 rows a warp (rows (bx*warps + warp)*GEMV_ROWS1 ..), every row's
// first weight loads issued together, so a layer's GEMV is a fraction of a wave of blocks that
// each wait on memory once, not waves of one-row warps. A row's terms and their order are
// gemv_q4's: fast, lane l takes the contiguous run [l*per, (l+1)*per) and the reversed tree;
// exact, contract G1 (R1).
template <bool EXACT>
__device__ __forceinline__ void gemv_q4_m1(const uint4 *__restrict__ W, const __half *__restrict__ D,
                                           const signed char *__restrict__ xq, const float *__restrict__ xd,
                                           const float *__restrict__ res, float *__restrict__ y, int out, int nb,
                                           int bx) {
  constexpr int R = GEMV_ROWS1, PF = 2;
  const int lane = threadIdx.x & 31;
  const int row0 = (bx * (int)(blockDim.x >> 5) + (int)(threadIdx.x >> 5)) * R;
  const int per = (nb + 31) / 32;
  const int b_first = EXACT ? lane : lane * per, b_step = EXACT ? 32 : 1;
  const int b_end = row0 < out ? (EXACT ? nb : min(nb, (lane + 1) * per)) : b_first;
  uint4 wv[R][PF];
  float dw[R][PF];
  auto load = [&](int b0) {
#pragma unroll
    for (int r = 0; r < R; r++) {
      const size_t wrow = (size_t)min(row0 + r, out - 1) * nb;
#pragma unroll
      for (int u = 0; u < PF; u++) {
        const int b = b0 + u * b_step;
        wv[r][u] = b < b_end ? W[wrow + b] : make_uint4(0, 0, 0, 0);
        dw[r][u] = b < b_end ? __half2float(D[wrow + b]) : 0.0f;
      }
    }
  };
  load(b_first);
  pdl_wait();
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = 0.0f;
  for (int b0 = b_first; b0 < b_end; b0 += PF * b_step) {
    if (b0 != b_first) load(b0);
#pragma unroll
    for (int u = 0; u < PF; u++) {
      const int b = b0 + u * b_step;
      if (b >= b_end) break;
      const int4 *xp = (const int4 *)(xq + (size_t)b * QK);
      const float dx = xd[b];
#pragma unroll
      for (int r = 0; r < R; r++) {
        const float fsum = __int2float_rn(q4_q8_block_isum(wv[r][u], xp));
        if (EXACT)
          acc[r] = FADD(acc[r], FMUL(fsum, FMUL(dw[r][u], dx)));
        else
          acc[r] = fmaf(fsum, dw[r][u] * dx, acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) {
    const float v = EXACT ? lane_reduce<true>(acc[r]) : warp_sum_fast_rev(acc[r]);
    const int row = row0 + r;
    if (lane == 0 && row < out) y[row] = res ? (EXACT ? FADD(res[row], v) : res[row] + v) : v;
  }
}

template <bool EXACT>
__device__ __forceinline__ void gemv_q4(const uint4 *__restrict__ W, const __half *__restrict__ D,
                                        const signed char *__restrict__ xq, const float *__restrict__ xd,
                                        const float *__restrict__ res, float *__restrict__ y, int out, int nb,
                                        int M, int bx) {
  if (M == 1) {
    gemv_q4_m1<EXACT>(W, D, xq, xd, res, y, out, nb, bx);
    return;
  }
  __shared__ float part[GEMV_MAX_WARPS][GEMV_MC];
  const int ks = EXACT ? 1 : gemv_split(M);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = bx * ((int)(blockDim.x >> 5) / ks) + warp / ks, k = warp % ks;
  const bool live = row < out;  // warp-uniform; no early return (the block syncs when split)
  const int m0 = blockIdx.y * GEMV_MC;
  const int ncols = min(GEMV_MC, M - m0);
  int b_first, b_step, b_end;
  if (ks == 1) {
    b_first = lane, b_step = 32, b_end = nb;
  } else {  // fast only: this warp's contiguous share of the row's blocks, lanes strided in it
    const int per = (nb + ks - 1) / ks;
    b_first = k * per + lane, b_step = 32, b_end = min(nb, (k + 1) * per);
  }
  if (!live) b_end = b_first;
  const uint4 *wr = W + (size_t)min(row, out - 1) * nb;
  const __half *dr = D + (size_t)min(row, out - 1) * nb;
  float acc[GEMV_MC];
  q4_lane_terms<EXACT>(wr, dr, b_first, b_step, b_end, xq, xd, nb, ncols, acc);
#pragma unroll
  for (int c = 0; c < GEMV_MC; c++) acc[c] = lane_reduce<EXACT>(acc[c]);
  if (ks > 1) {  // fast only: add the warps' partial sums of each row
    if (lane == 0) {
#pragma unroll
      for (int c = 0; c < GEMV_MC; c++) part[warp][c] = acc[c];
    }
    __syncthreads();
    if (k == 0 && lane == 0) {
#pragma unroll
      for (int c = 0; c < GEMV_MC; c++) {
        float t = part[warp][c];
        for (int j = 1; j < ks; j++) t += part[warp + j][c];
        acc[c] = t;
      }
    }
  }
  if (live && k == 0 && lane == 0) {
    for (int c = 0; c < ncols; c++) {
      const size_t o = (size_t)(m0 + c) * out + row;
      y[o] = res ? (EXACT ? FADD(res[o], acc[c]) : res[o] + acc[c]) : acc[c];
    }
  }
}

// Three projections of one input in one launch (q, k and v): the row blocks of the three
// matrices one after the other along grid.x (no idle blocks for the short k and v); each row
// is computed exactly as by gemv_q4 (same lane order, same rounding). grid
// (sum over the matrices of ceil(out/(warps/ks)), ceil(M/GEMV_MC)); xq/xd as gemv_q4's.
template <bool EXACT>
__device__ __forceinline__ void gemv_q4_x3(const uint4 *W0, const __half *D0, float *y0, int out0, const uint4 *W1,
                                           const __half *D1, float *y1, int out1, const uint4 *W2,
                                           const __half *D2, float *y2, int out2, const signed char *xq,
                                           const float *xd, int nb, int M) {
  const int warps = blockDim.x >> 5, rpb = M == 1 ? warps * GEMV_ROWS1 : warps / (EXACT ? 1 : gemv_split(M));
  const int n0 = (out0 + rpb - 1) / rpb, n1 = (out1 + rpb - 1) / rpb;
  const int bx = blockIdx.x, z = bx < n0 ? 0 : (bx < n0 + n1 ? 1 : 2);
  gemv_q4<EXACT>(z == 0 ? W0 : (z == 1 ? W1 : W2), z == 0 ? D0 : (z == 1 ? D1 : D2), xq, xd, nullptr,
                 z == 0 ? y0 : (z == 1 ? y1 : y2), z == 0 ? out0 : (z == 1 ? out1 : out2), nb, M,
                 bx - (z == 0 ? 0 : (z == 1 ? n0 : n0 + n1)));
}

// Stacked experts W*: [E, out, nb]. EXPERT_ROWS rows of expert e from row0 (rows past out
// repeat the last one) against one activation column (xr, xdr); returns the rows'
// lane-reduced sums in acc. Every row's weight loads are issued before the first dot: one row
// a warp needed 2-3 waves of blocks for the top-8 experts of a 30B-A3B layer, each wave paying
// the full memory latency. Each row is reduced exactly as one row of gemv_q4 (lane order,
// then the lane tree). Its row loop repeats gemv_q4_m1's on purpose: one shared loop for both
// (same bits) compiled to slower code (results/gpu-history.md, gemv.cuh).
template <bool EXACT>
__device__ __forceinline__ void q4_expert_rows(const uint4 *W, const __half *D, int e, int row0, int out, int nb,
                                               const signed char *__restrict__ xr, const float *__restrict__ xdr,
                                               float (&acc)[EXPERT_ROWS]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < EXPERT_ROWS; r++) acc[r] = 0.0f;
  constexpr int PF = 2;  // blocks a lane loads ahead per row (a 2048-wide row is 2 a lane)
  for (int b0 = lane; b0 < nb; b0 += 32 * PF) {
    uint4 wv[EXPERT_ROWS][PF];
    float dw[EXPERT_ROWS][PF];
#pragma unroll
    for (int r = 0; r < EXPERT_ROWS; r++) {
      const size_t wrow = ((size_t)e * out + min(row0 + r, out - 1)) * nb;
#pragma unroll
      for (int u = 0; u < PF; u++) {
        const int b = b0 + 32 * u;
        wv[r][u] = b < nb ? W[wrow + b] : make_uint4(0, 0, 0, 0);
        dw[r][u] = b < nb ? __half2float(D[wrow + b]) : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < PF; u++) {
      const int b = b0 + 32 * u;
      if (b >= nb) break;
      const int4 *xp = (const int4 *)(xr + (size_t)b * QK);
      const float dx = xdr[b];
#pragma unroll
      for (int r = 0; r < EXPERT_ROWS; r++) {
        const float fsum = __int2float_rn(q4_q8_block_isum(wv[r][u], xp));
        if (EXACT)
          acc[r] = FADD(acc[r], FMUL(fsum, FMUL(dw[r][u], dx)));
        else
          acc[r] = fmaf(fsum, dw[r][u] * dx, acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < EXPERT_ROWS; r++) acc[r] = lane_reduce<EXACT>(acc[r]);
}

// eidx: [P] expert of each pair; pair p reads activation column p / x_div (x_div = top_k
// when the k slots share one input). grid (ceil(out/(warps*EXPERT_ROWS)), P, 1 or 2):
// z = 0 -> (W0, D0, y0), z = 1 -> (W1, D1, y1); y*: [P, out]. A warp takes EXPERT_ROWS rows.
template <bool EXACT>
__device__ __forceinline__ void gemv_q4_experts(const uint4 *W0, const __half *D0, float *y0, const uint4 *W1,
                                                const __half *D1, float *y1, const int *eidx,
                                                const signed char *xq, const float *xd, int x_div, int out,
                                                int nb) {
  const int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * EXPERT_ROWS;
  if (row0 >= out) return;
  const int pair = blockIdx.y, xc = pair / x_div;
  float *y = blockIdx.z ? y1 : y0;
  float acc[EXPERT_ROWS];
  q4_expert_rows<EXACT>(blockIdx.z ? W1 : W0, blockIdx.z ? D1 : D0, eidx[pair], row0, out, nb,
                        xq + (size_t)xc * nb * QK, xd + (size_t)xc * nb, acc);
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int r = 0; r < EXPERT_ROWS; r++)
      if (row0 + r < out) y[(size_t)pair * out + row0 + r] = acc[r];
}
