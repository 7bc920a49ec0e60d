// attention.cu — decode / prefill attention over the KV cache. Toggle: attention
// (and expf for its exponentials).
//
// dpos (last argument): null, or a device int that replaces pos0 (CUDA graph replay).
// Column m sits at position t = pos0+m and attends to cache positions 0..t;
// q head h reads kv head h / (n_q/n_kv). grid (n_q, M) for every version.
//
// Versions:
//   attn_exact_q8 / attn_exact_f32
//       contract L6: scores L6a (query q8, Q4) or L6b (f32 cache), L6d online
//       softmax. Only L6d's l and acc recurrences are serial: the scores, the
//       running max (a prefix-max scan) and both exponentials do not depend on
//       acc, so a tile of positions computes them in parallel (one thread per
//       position); then thread j runs the recurrence for output element j over
//       the tile (every thread also carries l). Positions stay in ascending
//       order, every product is rounded before its add, so this is bit-identical
//       to the serial loop, with a 1-flop-deep serial part (why not the seed's
//       one thread a head: results/gpu-history.md, attention.cu). The tile's int8
//       V rows are staged in shared memory first.
//   attn_fast_q8 / attn_fast_f32
//       two-pass softmax as engines do it: scores with FMA dots on the
//       dequantized cache (no query quantization), block max, e = exp(s - max),
//       block-tree sum, then P·V split over position groups with FMAs (weights
//       staged per tile in shared memory) and out = acc * (1/l). Scores go
//       through a global scratch row.
#include "common.cuh"

#define ATT_MAX_HD 256
#define ATT_MAX_THREADS 256
#define ATT_VT_BYTES 32768  // shared memory for a tile of int8 V rows

// Copy the int8 V rows of positions p0 .. p0+np-1 (kv head kvh) into shared memory with
// 16-byte loads from every thread, so the P.V loop reads shared memory instead of
// waiting on one global load per step.
__device__ __forceinline__ void stage_v_tile(signed char *__restrict__ vt, const signed char *__restrict__ vc,
                                             int p0, int np, int n_kv, int kvh, int hd) {
  const int per_row = hd / 16;
  for (int i = threadIdx.x; i < np * per_row; i += blockDim.x) {
    const int r = i / per_row, part = i % per_row;
    ((int4 *)(vt + (size_t)r * hd))[part] = ((const int4 *)(vc + ((size_t)(p0 + r) * n_kv + kvh) * hd))[part];
  }
}

__device__ __forceinline__ float block_max(float v, float *red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
  for (int i = 1; i < nw; i++) r = fmaxf(r, red[i]);
  return r;
}

__device__ __forceinline__ float block_sum_fast(float v, float *red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum_fast(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = 0.0f;
  if (lane < nw) r = red[lane];
  return warp_sum_fast(r);
}

// ------------------------------------------------------------ exact

// int8 query (packed 4 a word in shared memory) . one int8 K row: an exact int32
// dot, the whole row in flight at once (16-byte loads). hd: a multiple of 16.
__device__ __forceinline__ void q8_row_load(const int4 *__restrict__ krow, int hd, int4 (&kk)[ATT_MAX_HD / 16]) {
#pragma unroll
  for (int i = 0; i < ATT_MAX_HD / 16; i++)
    if (i < hd / 16) kk[i] = krow[i];
}

__device__ __forceinline__ int q8_row_dot(const int *__restrict__ qq4, const int4 (&kk)[ATT_MAX_HD / 16], int hd) {
  int isum = 0;
#pragma unroll
  for (int i = 0; i < ATT_MAX_HD / 16; i++) {
    if (i < hd / 16) {
      isum = __dp4a(qq4[4 * i + 0], kk[i].x, isum);
      isum = __dp4a(qq4[4 * i + 1], kk[i].y, isum);
      isum = __dp4a(qq4[4 * i + 2], kk[i].z, isum);
      isum = __dp4a(qq4[4 * i + 3], kk[i].w, isum);
    }
  }
  return isum;
}

__device__ __forceinline__ int q8_row_isum(const int *__restrict__ qq4, const int4 *__restrict__ krow, int hd) {
  int4 kk[ATT_MAX_HD / 16];
  q8_row_load(krow, hd, kk);
  return q8_row_dot(qq4, kk, hd);
}

// q: [M, n_q, hd]; kc/vc: the layer cache [cap, n_kv, hd] (int8 or f32);
// ksc/vsc: [cap, n_kv]; out: [M, n_q*hd]. block: a multiple of 32, >= hd, <= 256.
// hd: a multiple of 16 (16-byte K loads), at most 256.
template <bool Q8>
__device__ __forceinline__ void attn_exact(const float *__restrict__ q, const void *__restrict__ kc,
                                           const float *__restrict__ ksc, const void *__restrict__ vc,
                                           const float *__restrict__ vsc, float *__restrict__ out, int pos0,
                                           int n_q, int n_kv, int hd, float scale, int exact_exp, const int *__restrict__ dpos) {
  if (dpos) pos0 = *dpos;
  __shared__ float qf[ATT_MAX_HD];
  __shared__ int qq4[ATT_MAX_HD / 4];
  __shared__ float s_c[ATT_MAX_THREADS], s_w[ATT_MAX_THREADS], s_incl[ATT_MAX_THREADS];
  __shared__ float red[32];
  __shared__ __align__(16) signed char vt[ATT_VT_BYTES];
  __shared__ float vst[ATT_MAX_THREADS];
  const int h = blockIdx.x, m = blockIdx.y, tid = threadIdx.x;
  const int NT = min((int)blockDim.x, ATT_VT_BYTES / hd);  // positions per tile
  const int lane = tid & 31, warp = tid >> 5;
  const int kvh = h / (n_q / n_kv);
  const int T = pos0 + m + 1;  // positions 0..t
  const float *qh = q + ((size_t)m * n_q + h) * hd;

  float dq = 0.0f;
  if (Q8) {  // query q8 (contract Q4)
    const float v = tid < hd ? qh[tid] : 0.0f;
    const float amax = block_max(fabsf(v), red);
    dq = FDIV(amax, 127.0f);
    const float id = q8_inverse(dq);
    if (tid < hd) ((signed char *)qq4)[tid] = (signed char)fminf(127.0f, fmaxf(-127.0f, roundf(FMUL(v, id))));
  } else {
    if (tid < hd) qf[tid] = qh[tid];
  }
  __syncthreads();

  float m_run = -INFINITY, l = 0.0f, acc = 0.0f;
  for (int p0 = 0; p0 < T; p0 += NT) {
    const int np = min(NT, T - p0);
    const int p = p0 + tid;
    float s = -INFINITY;
    if (tid < np) {
      const size_t row = (size_t)p * n_kv + kvh;
      if (Q8) {
        const int isum = q8_row_isum(qq4, (const int4 *)((const signed char *)kc + row * hd), hd);
        s = FMUL(FMUL(__int2float_rn(isum), FMUL(dq, ksc[row])), scale);
      } else {
        const float *krow = (const float *)kc + row * hd;
        float v[32];
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = 0.0f;
        for (int j0 = 0; j0 < hd; j0 += 32) {
#pragma unroll
          for (int i = 0; i < 32; i++)
            if (j0 + i < hd) v[i] = FADD(v[i], FMUL(qf[j0 + i], krow[j0 + i]));
        }
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) {
#pragma unroll
          for (int i = 0; i < off; i++) v[i] = FADD(v[i], v[i + off]);
        }
        s = FMUL(v[0], scale);
      }
    }
    // running max: inclusive prefix max over the tile, seeded with m_run
    float incl = s;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const float o = __shfl_up_sync(FULL_MASK, incl, off);
      if (lane >= off) incl = fmaxf(incl, o);
    }
    if (lane == 31) red[warp] = incl;
    __syncthreads();
    for (int w2 = 0; w2 < warp; w2++) incl = fmaxf(incl, red[w2]);
    incl = fmaxf(incl, m_run);
    s_incl[tid] = incl;
    __syncthreads();
    if (tid < np) {
      const float mprev = tid == 0 ? m_run : s_incl[tid - 1];
      s_c[tid] = exact_exp ? expf_ucrt(FSUB(mprev, incl)) : expf(FSUB(mprev, incl));
      s_w[tid] = exact_exp ? expf_ucrt(FSUB(s, incl)) : expf(FSUB(s, incl));
    }
    if (Q8) {
      stage_v_tile(vt, (const signed char *)vc, p0, np, n_kv, kvh, hd);
      if (tid < np) vst[tid] = vsc[(size_t)(p0 + tid) * n_kv + kvh];
    }
    __syncthreads();
    if (tid < hd) {
#pragma unroll 8
      for (int i = 0; i < np; i++) {
        const float vv = Q8 ? FMUL((float)vt[i * hd + tid], vst[i])
                            : ((const float *)vc)[((size_t)(p0 + i) * n_kv + kvh) * hd + tid];
        const float ci = s_c[i], wi = s_w[i];
        acc = FADD(FMUL(acc, ci), FMUL(wi, vv));
        l = FADD(FMUL(l, ci), wi);
      }
    }
    m_run = s_incl[np - 1];
    __syncthreads();
  }
  if (tid < hd) out[((size_t)m * n_q + h) * hd + tid] = FDIV(acc, l);
}

extern "C" __global__ void attn_exact_q8(const float *q, const signed char *kc, const float *ksc,
                                         const signed char *vc, const float *vsc, float *out, int pos0, int n_q,
                                         int n_kv, int hd, float scale, int exact_exp, const int *dpos) {
  pdl_wait();
  attn_exact<true>(q, kc, ksc, vc, vsc, out, pos0, n_q, n_kv, hd, scale, exact_exp, dpos);
}
extern "C" __global__ void attn_exact_f32(const float *q, const float *kc, const float *ksc, const float *vc,
                                          const float *vsc, float *out, int pos0, int n_q, int n_kv, int hd,
                                          float scale, int exact_exp, const int *dpos) {
  pdl_wait();
  attn_exact<false>(q, kc, ksc, vc, vsc, out, pos0, n_q, n_kv, hd, scale, exact_exp, dpos);
}

// ------------------------------------------------------------ fast

// f32 query . one int8 K row dequantized on the fly: four FMA chains (fast only;
// the K scale is applied by the caller). hd: a multiple of 16.
__device__ __forceinline__ float q8_row_dot_fast(const float *__restrict__ qf, const int4 *__restrict__ krow, int hd) {
  float a4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
  for (int i = 0; i < hd / 16; i++) {
    const int4 kk = krow[i];
    const int w[4] = {kk.x, kk.y, kk.z, kk.w};
#pragma unroll
    for (int c = 0; c < 4; c++) {
      const float *qq = qf + 16 * i + 4 * c;
      a4[c] = fmaf(qq[0], (float)(signed char)(w[c]), a4[c]);
      a4[c] = fmaf(qq[1], (float)(signed char)(w[c] >> 8), a4[c]);
      a4[c] = fmaf(qq[2], (float)(signed char)(w[c] >> 16), a4[c]);
      a4[c] = fmaf(qq[3], (float)(signed char)(w[c] >> 24), a4[c]);
    }
  }
  return (a4[0] + a4[1]) + (a4[2] + a4[3]);
}

// scores: scratch [M, n_q, cap_s] with cap_s >= pos0+M. block 256, hd <= 256.
template <bool Q8>
__device__ __forceinline__ void attn_fast(const float *__restrict__ q, const void *__restrict__ kc,
                                          const float *__restrict__ ksc, const void *__restrict__ vc,
                                          const float *__restrict__ vsc, float *__restrict__ out,
                                          float *__restrict__ scores, int cap_s, int pos0, int n_q, int n_kv,
                                          int hd, float scale, int exact_exp, const int *__restrict__ dpos) {
  if (dpos) pos0 = *dpos;
  __shared__ float qf[ATT_MAX_HD];
  __shared__ float part[ATT_MAX_THREADS], wt[ATT_MAX_THREADS];
  __shared__ float red[32];
  __shared__ __align__(16) signed char vt[ATT_VT_BYTES];
  const int h = blockIdx.x, m = blockIdx.y, tid = threadIdx.x, NT = blockDim.x;
  const int kvh = h / (n_q / n_kv);
  const int T = pos0 + m + 1;
  const float *qh = q + ((size_t)m * n_q + h) * hd;
  float *S = scores + ((size_t)m * n_q + h) * cap_s;
  for (int j = tid; j < hd; j += NT) qf[j] = qh[j];
  __syncthreads();

  float lmax = -INFINITY;
  for (int p = tid; p < T; p += NT) {
    const size_t row = (size_t)p * n_kv + kvh;
    float a = 0.0f;
    if (Q8) {  // dequantize on the fly, four FMA chains
      a = q8_row_dot_fast(qf, (const int4 *)((const signed char *)kc + row * hd), hd) * (ksc[row] * scale);
    } else {
      const float4 *krow = (const float4 *)((const float *)kc + row * hd);
      float a4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
      for (int i = 0; i < hd / 4; i++) {
        const float4 kv = krow[i];
        a4[0] = fmaf(qf[4 * i + 0], kv.x, a4[0]);
        a4[1] = fmaf(qf[4 * i + 1], kv.y, a4[1]);
        a4[2] = fmaf(qf[4 * i + 2], kv.z, a4[2]);
        a4[3] = fmaf(qf[4 * i + 3], kv.w, a4[3]);
      }
      a = ((a4[0] + a4[1]) + (a4[2] + a4[3])) * scale;
    }
    S[p] = a;
    lmax = fmaxf(lmax, a);
  }
  const float mx = block_max(lmax, red);
  float lsum = 0.0f;
  for (int p = tid; p < T; p += NT) {
    const float e = exact_exp ? expf_ucrt(S[p] - mx) : expf(S[p] - mx);
    S[p] = e;
    lsum += e;
  }
  const float L = block_sum_fast(lsum, red);
  // P.V: a tile of weights (e_p * vs_p) staged in shared memory, the positions of a
  // tile split over G = NT/hd groups of hd threads, FMA accumulation
  const int G = NT / hd, grp = tid / hd, j = tid % hd;
  float a = 0.0f;
  const int TL = min(NT, ATT_VT_BYTES / hd);
  for (int p0 = 0; p0 < T; p0 += TL) {
    const int np = min(TL, T - p0);
    __syncthreads();  // S (global) written by other threads; the previous tile consumed
    if (tid < np) wt[tid] = Q8 ? S[p0 + tid] * vsc[(size_t)(p0 + tid) * n_kv + kvh] : S[p0 + tid];
    if (Q8) stage_v_tile(vt, (const signed char *)vc, p0, np, n_kv, kvh, hd);
    __syncthreads();
    if (grp < G) {
#pragma unroll 4
      for (int i = grp; i < np; i += G) {
        const float v = Q8 ? (float)vt[i * hd + j] : ((const float *)vc)[((size_t)(p0 + i) * n_kv + kvh) * hd + j];
        a = fmaf(wt[i], v, a);
      }
    }
  }
  if (grp < G) part[grp * hd + j] = a;
  __syncthreads();
  if (tid < hd) {
    float tot = 0.0f;
    for (int g = 0; g < G; g++) tot += part[g * hd + tid];
    out[((size_t)m * n_q + h) * hd + tid] = tot * (1.0f / L);
  }
}

extern "C" __global__ void attn_fast_q8(const float *q, const signed char *kc, const float *ksc,
                                        const signed char *vc, const float *vsc, float *out, float *scores,
                                        int cap_s, int pos0, int n_q, int n_kv, int hd, float scale,
                                        int exact_exp, const int *dpos) {
  pdl_wait();
  attn_fast<true>(q, kc, ksc, vc, vsc, out, scores, cap_s, pos0, n_q, n_kv, hd, scale, exact_exp, dpos);
}
extern "C" __global__ void attn_fast_f32(const float *q, const float *kc, const float *ksc, const float *vc,
                                         const float *vsc, float *out, float *scores, int cap_s, int pos0,
                                         int n_q, int n_kv, int hd, float scale, int exact_exp, const int *dpos) {
  pdl_wait();
  attn_fast<false>(q, kc, ksc, vc, vsc, out, scores, cap_s, pos0, n_q, n_kv, hd, scale, exact_exp, dpos);
}

// ------------------------------------------------------------ split versions (q8 cache; the default)
//
// The single-kernel versions above run one block per (head, column): at M = 1
// that is n_q blocks (32 for Qwen3-30B-A3B) working through the whole context
// with a sync-heavy loop per 256-position tile (slow at long contexts:
// results/gpu-history.md, attention.cu). The split versions spread the parallel
// parts over the context:
//
//   attn_exact_scores_q8  grid (n_q, M, tiles of ATT_SPLIT_TILE): the query's q8
//       quantization and the scores s_p, bit-identical to attn_exact_q8 (same
//       expressions), and each tile's inclusive prefix max I_p (max is exact, so
//       the global running max m_p = max(earlier tiles' maxima, I_p) equals the
//       serial kernel's, whatever the tiling).
//   attn_exact_pv_q8      grid (n_q, M, hd/ATT_SPLIT_COLS): in stages of
//       ATT_PV_STAGE positions (staged one ahead by producer threads), the running
//       max m_p = max(the max before the tile, I_p), L6d's c_p, w_p and its product
//       t_p = w_p*(v_p*vs_p) of the block's 32 columns in parallel, then two warps
//       run L6d's serial recurrences (acc, l) over the positions in order: the same
//       operations in the same order as attn_exact_q8, so the same bits — except
//       the multiplies by a c_p of exactly 1, which change no bit and are left out
//       (and c_p = expf(+0) = 1 is not computed where the running max did not move).
//   attn_fast_part_q8 +   flash-decoding as engines do it: each tile of positions
//   attn_fast_combine     gives, per query head, (its max, its sum of exp, its P.V
//       with FMAs; scores as int8 dots with the query in q8 blocks), and
//       a second kernel rescales and adds the tiles, out = acc * (1/L).
//
// Scratch: exact S and I rows [M, n_q, cap_s] (cap_s >= pos0 + M); fast
// partials [M, n_q, tiles_cap, hd + 2] (tiles of ATT_FAST_TILE positions). Tiles
// past a column's position exit at once, so a CUDA graph captures the grid for
// the whole cache.
#define ATT_SPLIT_COLS 32
#define ATT_PV_BATCH 32  // positions whose operands a serial warp of attn_exact_pv_q8 loads at a time
static_assert(ATT_SPLIT_COLS == QK, "a P.V block's 32 dims are one q8_0 block of its output");

extern "C" __global__ void attn_exact_scores_q8(const float *__restrict__ q, const signed char *__restrict__ kc,
                                                const float *__restrict__ ksc, float *__restrict__ S,
                                                float *__restrict__ I, int cap_s, int pos0, int n_q, int n_kv,
                                                int hd, float scale, const int *__restrict__ dpos) {
  if (dpos) pos0 = __ldcg(dpos);  // written by the host before the graph starts
  __shared__ int qq4[ATT_MAX_HD / 4];
  __shared__ float red[32];
  const int h = blockIdx.x, m = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int T = pos0 + m + 1;
  const int p0 = blockIdx.z * ATT_SPLIT_TILE;
  if (p0 >= T) return;  // block-uniform; touches nothing, so it need not wait
  const int kvh = h / (n_q / n_kv);
  const float *qh = q + ((size_t)m * n_q + h) * hd;
  const int np = min(ATT_SPLIT_TILE, T - p0);
  const int p = p0 + tid;
  const size_t row = (size_t)p * n_kv + kvh;
  int4 kk[ATT_MAX_HD / 16];  // the position's K row, in flight while the query is quantized
  float dk = 0.0f;
  // a row of an earlier step (below pos0) is final: loaded ahead of the wait, overlapping the
  // kernel in front (the early trigger); this step's rows after it
  auto load_k = [&] {
    q8_row_load((const int4 *)(kc + row * hd), hd, kk);
    dk = ksc[row];
  };
  const bool early = tid < np && p < pos0;
  if (early) load_k();
  pdl_wait();
  if (tid < np && !early) load_k();
  {  // query q8 (as attn_exact_q8)
    const float v = tid < hd ? qh[tid] : 0.0f;
    const float amax = block_max(fabsf(v), red);
    const float dq0 = FDIV(amax, 127.0f);
    const float id = q8_inverse(dq0);
    if (tid < hd) ((signed char *)qq4)[tid] = (signed char)fminf(127.0f, fmaxf(-127.0f, roundf(FMUL(v, id))));
    if (tid == 0) red[31] = dq0;  // red[0..nw) were read inside block_max; slot 31 is free (nw <= 8)
  }
  __syncthreads();
  const float dq = red[31];
  float s = -INFINITY;
  if (tid < np) s = FMUL(FMUL(__int2float_rn(q8_row_dot(qq4, kk, hd)), FMUL(dq, dk)), scale);
  float incl = s;  // tile-local inclusive prefix max
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float o = __shfl_up_sync(FULL_MASK, incl, off);
    if (lane >= off) incl = fmaxf(incl, o);
  }
  __syncthreads();  // everyone has read dq
  if (lane == 31) red[warp] = incl;
  __syncthreads();
  for (int w2 = 0; w2 < warp; w2++) incl = fmaxf(incl, red[w2]);
  if (tid < np) {
    const size_t o = ((size_t)m * n_q + h) * cap_s + p;
    S[o] = s;
    I[o] = incl;
  }
}

// Block = two serial warps + ATT_PV_STAGE producer threads, double-buffered in stages of
// ATT_PV_STAGE positions: while the serial warps run the recurrences over stage k, the producers
// (one position each) stage k+1 in shared memory — c_p, w_p, t_p = w_p*(v_p*vs_p) of the block's
// 32 dims stored [dim][position] so that a lane reads its dim's next four with one 16-byte load,
// and a bit a position where c_p != 1 — from operands they loaded one stage earlier, so that no
// global load sits between two of the block's barriers. Warp 0 runs acc (a lane a dim), warp 1
// runs l; each loads only its own chain's operands (t or w, and c only in a batch with a
// rescale), because a serial warp issues in order and its shared loads, not its dependent adds,
// were what bounded a single warp running both chains (results/gpu-h200-speed.md, 2026-12-06).
// A batch whose every c is 1 is adds alone (x*1 == x bit for bit, so the multiply leaves the
// chain), a multiply and an add otherwise. Positions past T are padded with c = 1, w = -0,
// t = -0: steps that change no bit. The producers turn the int8 V into floats without I2F
// (q8_float), a quarter-rate conversion on sm_90.
// Its launch takes half an SM's shared memory (unused; backends/cuda/launches.py
// pv_spread_bytes) so that each block has an SM to itself: blocks sharing one slow each other.
// Reshapings of this kernel that were measured and not kept: results/gpu-history.md
// (attention.cu) and docs/decisions.md.
#define ATT_PV_TROW (ATT_PV_STAGE + 4)  // floats a dim's row: +4 spreads the lanes' 16-byte loads over the banks
static_assert(ATT_SPLIT_TILE % ATT_PV_STAGE == 0, "a stage lies in one scores tile");
static_assert(ATT_PV_STAGE % (2 * ATT_PV_BATCH) == 0 && ATT_PV_BATCH % 4 == 0 && ATT_PV_BATCH <= 32 &&
                  32 % ATT_PV_BATCH == 0,
              "the serial loop runs whole pairs of batches, a batch's flags in one word");
// A q8 byte of a word as a float without I2F (a quarter-rate conversion on sm_90): the bits
// 0x4B000000 | (x + 128) are the float 2^23 + x + 128, exactly, and taking 2^23 + 128 away leaves
// x exactly, the value (float)x has.
__device__ __forceinline__ float q8_float(int word, int byte) {
  return FSUB(__uint_as_float(__byte_perm((unsigned)word ^ 0x80808080u, 0x4B000000u, 0x7540 | byte)), 8388736.0f);
}
// A producer's global operands of one position.
struct PvOperands {
  float s, incl, incl_prev, vs, tile_max;  // tile_max: the max of the scores tile before the stage (its first stage)
  int4 v[ATT_SPLIT_COLS / 16];
};
// A batch of a serial warp: its chain's addends (t of its lane's dim, or w), four positions a
// float4, and the batch's c != 1 bits.
struct PvBatch {
  float4 x[ATT_PV_BATCH / 4];
  unsigned rescale;
};
extern "C" __global__ void __launch_bounds__(ATT_PV_THREADS)
attn_exact_pv_q8(const signed char *__restrict__ vc, const float *__restrict__ vsc, const float *__restrict__ S,
                 const float *__restrict__ I, float *__restrict__ out, int cap_s, int pos0, int n_q, int n_kv,
                 int hd, int exact_exp, const int *__restrict__ dpos, signed char *__restrict__ xq,
                 float *__restrict__ xd, int quant) {
  if (dpos) pos0 = __ldcg(dpos);  // written by the host before the graph starts
  __shared__ __align__(16) float s_c[2][ATT_PV_STAGE], s_w[2][ATT_PV_STAGE];
  __shared__ float s_l;
  __shared__ __align__(16) float s_t[2][ATT_SPLIT_COLS][ATT_PV_TROW];       // t [dim][position]
  __shared__ unsigned s_rescale[2][ATT_PV_STAGE / 32];                      // bit: c != 1 at that position
  __shared__ unsigned long long expT[EXPF_TABLE_LEN];                       // c's and w's exponential table
  const int h = blockIdx.x, m = blockIdx.y, j0 = blockIdx.z * ATT_SPLIT_COLS, tid = threadIdx.x;
  const int kvh = h / (n_q / n_kv);
  const int T = pos0 + m + 1;
  const float *Sr = S + ((size_t)m * n_q + h) * cap_s, *Ir = I + ((size_t)m * n_q + h) * cap_s;
  const bool acc_warp = tid < 32, serial = tid < 64;  // warp 0: acc of its lanes' dims; warp 1: l
  const int i = tid - 64;  // a producer's position in the stage
  float m_run = -INFINITY;  // producers: the max over the scores tiles before the stage's tile
  auto load_v = [&](PvOperands &o, int c0) {  // the position's V (its 32 dims) and V scale
    const int p = c0 + i;
    o.vs = 0.0f;
#pragma unroll
    for (int part = 0; part < ATT_SPLIT_COLS / 16; part++) o.v[part] = make_int4(0, 0, 0, 0);
    if (p < T) {
      o.vs = vsc[(size_t)p * n_kv + kvh];
      const int4 *vrow = (const int4 *)(vc + ((size_t)p * n_kv + kvh) * hd + j0);
#pragma unroll
      for (int part = 0; part < ATT_SPLIT_COLS / 16; part++) o.v[part] = vrow[part];
    }
  };
  auto load_s = [&](PvOperands &o, int c0) {  // its score and prefix maxima (attn_exact_scores_q8's)
    const int p = c0 + i;
    // entering a new tile: the one before it ends at c0 - 1 (< T), where its prefix max is its max
    o.tile_max = c0 > 0 && c0 % ATT_SPLIT_TILE == 0 ? Ir[c0 - 1] : -INFINITY;
    o.s = o.incl = o.incl_prev = 0.0f;
    if (p < T) {
      o.s = Sr[p], o.incl = Ir[p];
      o.incl_prev = p % ATT_SPLIT_TILE == 0 ? -INFINITY : Ir[p - 1];  // the tile's prefix max before p
    }
  };
  auto load = [&](int c0) {
    PvOperands o;
    load_s(o, c0);
    load_v(o, c0);
    return o;
  };
  auto produce = [&](const PvOperands &o, int c0, int buf) {
    m_run = fmaxf(m_run, o.tile_max);
    const bool in = c0 + i < T;
    float c = 1.0f, w = -0.0f;
    if (in) {
      // the running max m_p = max(the max before the tile, I_p); m_{p-1} likewise
      const float incl = fmaxf(o.incl, m_run), mprev = fmaxf(o.incl_prev, m_run);
      if (mprev != incl) c = expf_sel(FSUB(mprev, incl), exact_exp, expT);  // else 1 = expf(+0)
      w = expf_sel(FSUB(o.s, incl), exact_exp, expT);
    }
    s_c[buf][i] = c;
    s_w[buf][i] = w;
    const unsigned rescale = __ballot_sync(FULL_MASK, c != 1.0f);  // a producer warp: 32 positions
    if ((i & 31) == 0) s_rescale[buf][i >> 5] = rescale;
#pragma unroll
    for (int part = 0; part < ATT_SPLIT_COLS / 16; part++) {
      const int wds[4] = {o.v[part].x, o.v[part].y, o.v[part].z, o.v[part].w};
#pragma unroll
      for (int b = 0; b < 16; b++) {
        const float vv = FMUL(q8_float(wds[b >> 2], b & 3), o.vs);
        s_t[buf][part * 16 + b][i] = in ? FMUL(w, vv) : -0.0f;
      }
    }
  };
  const int lane = tid & 31;
  float run = 0.0f;  // warp 0: acc; warp 1: l
  auto batch_load = [&](PvBatch &b, int buf, int k0) {
    const float4 *x4 = acc_warp ? (const float4 *)s_t[buf][lane] : (const float4 *)s_w[buf];
#pragma unroll
    for (int u = 0; u < ATT_PV_BATCH / 4; u++) b.x[u] = x4[k0 / 4 + u];
    b.rescale = (s_rescale[buf][k0 >> 5] >> (k0 & 31)) & (ATT_PV_BATCH == 32 ? ~0u : (1u << ATT_PV_BATCH) - 1u);
  };
  auto comp = [](const float4 &v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; };
  // c is loaded here, a batch after its rescale word, so that the branch on the word does not wait
  // on c's loads too (the serial side's share of a stage: results/gpu-h200-speed.md, 2026-12-07)
  auto batch_run = [&](const PvBatch &b, int buf, int k0) {
    if (b.rescale == 0) {  // every c is 1
#pragma unroll
      for (int u = 0; u < ATT_PV_BATCH; u++) run = FADD(run, comp(b.x[u / 4], u & 3));
    } else {
      const float4 *c4 = (const float4 *)s_c[buf];
      float4 c[ATT_PV_BATCH / 4];
#pragma unroll
      for (int u = 0; u < ATT_PV_BATCH / 4; u++) c[u] = c4[k0 / 4 + u];
#pragma unroll
      for (int u = 0; u < ATT_PV_BATCH; u++) run = FADD(FMUL(run, comp(c[u / 4], u & 3)), comp(b.x[u / 4], u & 3));
    }
  };
  // The first two stages' V rows of earlier steps (below pos0) are final: loaded ahead of the
  // wait, overlapping the scores kernel (the early trigger); this step's rows and every score after.
  PvOperands first, next;
  const bool early0 = !serial && i < pos0, early1 = !serial && ATT_PV_STAGE + i < pos0;
  if (early0) load_v(first, 0);
  if (early1) load_v(next, ATT_PV_STAGE);
  // The later stages' V rows of earlier steps to L2 as well: in the graph they come from DRAM
  // (a step streams the weights through L2 since), and a stage's loads are issued a stage ahead.
  if (!serial)
    for (int p = 2 * ATT_PV_STAGE + i; p < pos0; p += ATT_PV_STAGE) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(vc + ((size_t)p * n_kv + kvh) * hd + j0));
      if ((i & 7) == 0)  // a 128-byte line holds eight positions' scales at n_kv = 4
        asm volatile("prefetch.global.L2 [%0];" ::"l"(vsc + (size_t)p * n_kv + kvh));
    }
  if (serial && exact_exp) expf_table_to_shared(expT);  // threads 0..63, idle until the first stage
  pdl_wait();
  if (!serial) {
    if (!early0) load_v(first, 0);
    if (!early1) load_v(next, ATT_PV_STAGE);
    load_s(first, 0);
    load_s(next, ATT_PV_STAGE);
  }
  __syncthreads();  // the table; the producers' loads stay in flight across it
  if (!serial) produce(first, 0, 0);
  __syncthreads();
  for (int c0 = 0, buf = 0; c0 < T; c0 += ATT_PV_STAGE, buf ^= 1) {
    if (serial) {
      // whole pairs of batches: the stage's padding past T is steps that change no bit
      const int np = min(ATT_PV_STAGE, (T - c0 + 2 * ATT_PV_BATCH - 1) / (2 * ATT_PV_BATCH) * (2 * ATT_PV_BATCH));
      PvBatch a, b;
      batch_load(a, buf, 0);
      for (int k0 = 0; k0 < np; k0 += 2 * ATT_PV_BATCH) {
        batch_load(b, buf, k0 + ATT_PV_BATCH);
        batch_run(a, buf, k0);
        if (k0 + 2 * ATT_PV_BATCH < np) batch_load(a, buf, k0 + 2 * ATT_PV_BATCH);
        batch_run(b, buf, k0 + ATT_PV_BATCH);
      }
    } else if (c0 + ATT_PV_STAGE < T) {
      const PvOperands cur = next;
      if (c0 + 2 * ATT_PV_STAGE < T) next = load(c0 + 2 * ATT_PV_STAGE);  // in flight while cur is produced
      produce(cur, c0 + ATT_PV_STAGE, buf ^ 1);
    }
    __syncthreads();
  }
  if (tid == 32) s_l = run;
  __syncthreads();
  if (acc_warp) {  // the block's 32 dims, one q8_0 block of o_proj's input
    const size_t o = ((size_t)m * n_q + h) * hd + j0 + lane;
    const float y = FDIV(run, s_l);
    out[o] = y;
    q8_0_warp(y, o, xq, xd, quant);
  }
}

// part: [M, n_q, tiles_cap, hd + 2] = (P.V[hd], max, sum) per query head and tile.
// grid (n_kv, M, tiles of ATT_FAST_TILE), block 32 * min(n_q/n_kv, ATT_FAST_WARPS).
// A block stages its tile's K and V rows once for every query head that reads them (GQA:
// n_q/n_kv heads, 8 for Qwen3-30B-A3B), then a warp takes a head: lane = position for the
// scores (each lane a whole int8 dot over its row in shared memory, no shuffles), lane = 4 dims
// for P.V. (A block a head with a thread's dot straight from global memory was
// latency-bound: results/gpu-history.md, attention.cu.)
#define ATT_KROW_PAD 16  // bytes after a staged K row: rows 16 bytes apart in the banks, so the
                         // lanes' 16-byte loads (a lane a row) do not conflict
static_assert(ATT_FAST_TILE == 32, "the scores give a lane one position");
extern "C" __global__ void __launch_bounds__(32 * ATT_FAST_WARPS)
attn_fast_part_q8(const float *__restrict__ q, const signed char *__restrict__ kc, const float *__restrict__ ksc,
                  const signed char *__restrict__ vc, const float *__restrict__ vsc, float *__restrict__ part,
                  int tiles_cap, int pos0, int n_q, int n_kv, int hd, float scale, int exact_exp,
                  const int *__restrict__ dpos) {
  if (dpos) pos0 = __ldcg(dpos);  // written by the host before the graph starts
  __shared__ __align__(16) signed char kt[ATT_FAST_TILE * (ATT_MAX_HD + ATT_KROW_PAD)];
  __shared__ __align__(16) signed char vt[ATT_FAST_TILE * ATT_MAX_HD];
  __shared__ __align__(16) int qq[ATT_FAST_WARPS][ATT_MAX_HD / 4];  // a warp's query, q8 packed 4 a word
  __shared__ float qd[ATT_FAST_WARPS][ATT_MAX_HD / QK];            // and its block scales
  __shared__ float wt[ATT_FAST_WARPS][ATT_FAST_TILE];
  __shared__ float s_ks[ATT_FAST_TILE], s_vs[ATT_FAST_TILE];
  const int kvh = blockIdx.x, m = blockIdx.y, tile = blockIdx.z, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const int T = pos0 + m + 1, p0 = tile * ATT_FAST_TILE;
  if (p0 >= T) return;  // block-uniform; touches nothing, so it need not wait
  const int np = min(ATT_FAST_TILE, T - p0), G = n_q / n_kv, krow = hd + ATT_KROW_PAD, per_row = hd / 16;
  auto stage = [&](int r_begin, int r_end) {  // the tile's rows r_begin .. r_end-1
    for (int i = r_begin * per_row + tid; i < r_end * per_row; i += blockDim.x) {
      const int r = i / per_row, c = i % per_row;
      const size_t src = ((size_t)(p0 + r) * n_kv + kvh) * hd;
      ((int4 *)(kt + r * krow))[c] = ((const int4 *)(kc + src))[c];
      ((int4 *)(vt + r * hd))[c] = ((const int4 *)(vc + src))[c];
    }
    if (tid >= r_begin && tid < r_end) {
      s_ks[tid] = ksc[(size_t)(p0 + tid) * n_kv + kvh] * scale;
      s_vs[tid] = vsc[(size_t)(p0 + tid) * n_kv + kvh];
    }
  };
  // Rows of earlier steps (positions below pos0) are never written by this step, so they are
  // staged ahead of the wait and, with the early trigger, overlap the kernel in front; this
  // step's own rows (heads_fused writes them) after it. The same values either way.
  const int early = min(np, max(0, pos0 - p0));
  stage(0, early);
  pdl_wait();
  stage(early, np);
  int *qqw = qq[warp];
  float *qdw = qd[warp], *ww = wt[warp];
  for (int h = kvh * G + warp, first = 1; h < (kvh + 1) * G; h += nw, first = 0) {
    // the query in q8 blocks of 32, one scale a block, as llama.cpp's vector kernels quantize
    // it for a q8_0 cache: a lane 4 elements, a block 8 lanes
    const float *qh = q + ((size_t)m * n_q + h) * hd;
    for (int c = 0; c < ATT_MAX_HD / 128; c++) {
      const int j = 128 * c + 4 * lane;
      if (128 * c >= hd) break;  // warp-uniform
      const float4 v = j < hd ? *(const float4 *)(qh + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      float am = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
      for (int off = 4; off >= 1; off >>= 1) am = fmaxf(am, __shfl_xor_sync(FULL_MASK, am, off));
      const float id = am == 0.0f ? 0.0f : 127.0f / am;
      if (j < hd) {
        qqw[j / 4] = (__float2int_rn(v.x * id) & 0xff) | (__float2int_rn(v.y * id) & 0xff) << 8 |
                     (__float2int_rn(v.z * id) & 0xff) << 16 | (__float2int_rn(v.w * id) & 0xff) << 24;
        if ((lane & 7) == 0) qdw[j / QK] = am / 127.0f;
      }
    }
    if (first) __syncthreads();  // the tile's rows (staged by every thread); block-uniform: nw <= G
    __syncwarp();
    float a = -INFINITY;
    if (lane < np) {  // int8 dots a block of 32 (dp4a), scaled and summed with FMAs
      const int4 *kr = (const int4 *)(kt + lane * krow), *q4 = (const int4 *)qqw;
      float sacc = 0.0f;
      for (int b = 0; b < hd / QK; b++) {
        const int4 k0 = kr[2 * b], k1 = kr[2 * b + 1], x0 = q4[2 * b], x1 = q4[2 * b + 1];
        int is = __dp4a(k0.x, x0.x, 0);
        is = __dp4a(k0.y, x0.y, is);
        is = __dp4a(k0.z, x0.z, is);
        is = __dp4a(k0.w, x0.w, is);
        is = __dp4a(k1.x, x1.x, is);
        is = __dp4a(k1.y, x1.y, is);
        is = __dp4a(k1.z, x1.z, is);
        is = __dp4a(k1.w, x1.w, is);
        sacc = fmaf((float)is, qdw[b], sacc);
      }
      a = sacc * s_ks[lane];
    }
    const float mx = warp_max(a);
    const float e = lane < np ? (exact_exp ? expf_ucrt(a - mx) : __expf(a - mx)) : 0.0f;
    const float L = warp_sum_fast(e);
    ww[lane] = lane < np ? e * s_vs[lane] : 0.0f;  // the V scale folded into the weight
    __syncwarp();
    float acc[ATT_MAX_HD / 128][4] = {};
    for (int i = 0; i < np; i++) {
      const float w = ww[i];
#pragma unroll
      for (int c = 0; c < ATT_MAX_HD / 128; c++) {
        const int j = 128 * c + 4 * lane;
        if (j < hd) {
          const int v4 = *(const int *)(vt + i * hd + j);
#pragma unroll
          for (int b = 0; b < 4; b++) acc[c][b] = fmaf(w, (float)(signed char)(v4 >> (8 * b)), acc[c][b]);
        }
      }
    }
    float *dst = part + (((size_t)m * n_q + h) * tiles_cap + tile) * (hd + 2);
#pragma unroll
    for (int c = 0; c < ATT_MAX_HD / 128; c++) {
      const int j = 128 * c + 4 * lane;
      if (j < hd)
        for (int b = 0; b < 4; b++) dst[j + b] = acc[c][b];
    }
    if (lane == 0) {
      dst[hd] = mx;
      dst[hd + 1] = L;
    }
    __syncwarp();  // qqw / qdw / ww are the warp's next head's
  }
}

// grid (n_q, M), block >= hd (a multiple of 32). Tiles in batches of 32: lane u of every
// warp loads tile t0+u's (max, sum) and computes its factor f = exp(max - running max), and
// each thread loads its dim's P.V of all 32 tiles at once, two batches' loads together, so the
// kernel waits on memory once every two batches and needs no block barrier; the batch's factors
// reach the lanes by shuffles, and the running max moves from batch to batch with one rescale
// (online softmax).
// xq/xd (quant != 0): the q8_0 of out for o_proj (common.cuh q8_0_warp; a warp is 32
// consecutive dims of one head), saving the quantize launch.
extern "C" __global__ void attn_fast_combine(const float *__restrict__ part, float *__restrict__ out, int tiles_cap,
                                             int pos0, int n_q, int hd, int exact_exp, const int *__restrict__ dpos,
                                             signed char *__restrict__ xq, float *__restrict__ xd, int quant) {
  pdl_wait();
  if (dpos) pos0 = *dpos;
  const int h = blockIdx.x, m = blockIdx.y, tid = threadIdx.x, lane = tid & 31;
  const int T = pos0 + m + 1;
  const int nt = (T + ATT_FAST_TILE - 1) / ATT_FAST_TILE;
  const int stride = hd + 2, j = min(tid, hd - 1);
  const float *src = part + ((size_t)m * n_q + h) * tiles_cap * stride;
  float gm = -INFINITY, L = 0.0f, acc = 0.0f;
  struct Batch {
    float mt, lt, v[32];
  };
  auto load = [&](int t0, Batch &b) {
    const int nb = min(32, nt - t0);
    const float *pl = src + (size_t)(t0 + min(lane, nb - 1)) * stride;
    b.mt = lane < nb ? pl[hd] : -INFINITY;
    b.lt = lane < nb ? pl[hd + 1] : 0.0f;
#pragma unroll
    for (int u = 0; u < 32; u++) b.v[u] = u < nb ? src[(size_t)(t0 + u) * stride + j] : 0.0f;
  };
  auto fold = [&](int t0, const Batch &b) {
    const int nb = min(32, nt - t0);
    const float mt = b.mt, lt = b.lt;
    const float(&v)[32] = b.v;
    const float bm = fmaxf(gm, warp_max(mt));
    const float f = lane < nb ? (exact_exp ? expf_ucrt(mt - bm) : __expf(mt - bm)) : 0.0f;
    const float r = t0 == 0 ? 0.0f : (exact_exp ? expf_ucrt(gm - bm) : __expf(gm - bm));
    gm = bm;
    L = fmaf(L, r, warp_sum_fast(lt * f));
    acc *= r;
#pragma unroll
    for (int u = 0; u < 32; u++) acc = fmaf(v[u], __shfl_sync(FULL_MASK, f, u), acc);
  };
  // two batches' loads in flight together (one wait on memory for up to 64 tiles: context
  // 2048), then each folded in order as before
  for (int t0 = 0; t0 < nt; t0 += 64) {
    Batch a, b;
    load(t0, a);
    if (t0 + 32 < nt) load(t0 + 32, b);  // block-uniform
    fold(t0, a);
    if (t0 + 32 < nt) fold(t0 + 32, b);
  }
  if (tid < hd) {
    const size_t o = ((size_t)m * n_q + h) * hd + tid;
    const float y = acc * (1.0f / L);
    out[o] = y;
    q8_0_warp(y, o, xq, xd, quant);
  }
}
