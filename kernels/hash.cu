// hash.cu — FNV-1a 64 of every probe key of a decode step, on the device.
//
// The hash is a definition (contract P3; trace/fnv.py: h = 0xcbf29ce484222325; per byte
// h ^= b; h *= P = 0x100000001b3 mod 2^64), so there is no fast/exact split;
// the versions differ in how they parallelise a serial chain. Hashes come back
// to the host once per step; raw buffers stay on the device.
//
// Why not one thread per key: FNV-1a costs ~10 cycles a byte in one thread, so
// a 600 KB logits row (Qwen3-30B vocab) alone would take ~3 ms. Both versions
// cut every key into HASH_CHUNK-byte chunks and rest on one identity: XOR with a
// byte only touches the low 8 bits, so for s = h & 255
//     (h ^ b) * P = (h - s) * P + (s ^ b) * P      (mod 2^64)
// and after a chunk of n bytes   h_n = (h_0 - s) * P^n + F(s),
// F(s) = FNV-1a over the chunk started from the value s (0..255). The low 8
// bits alone follow a 256-state machine, s' = ((s ^ b) * 0xb3) & 255.
//
// Versions:
//   fnv1a64_keys         one launch: a 256-thread block per chunk computes F for
//                        all 256 starts (256x the work of the serial hash); the
//                        last block of a key (atomic ticket) folds its chunks
//                        h = (h - (h & 255)) * P^len + F_c[h & 255].
//   fnv_states +         two launches, ~1/200 of the 64-bit work (what the backend
//   fnv_chunks           uses): (1) eight warps per chunk run only the 8-bit
//                        state machine for all 256 starts over their eighth —
//                        two states per 32-bit register, two instructions per
//                        byte per register — snapshotting it every PIECE bytes,
//                        then compose the eighths; the last block of a key
//                        walks the chunks' permutations to find every chunk's
//                        true start state. (2) one thread per PIECE
//                        bytes runs FNV-1a once, from its true state, and adds
//                        its term of the closed-form fold (below) to the key's
//                        hash with a 64-bit atomicAdd.
//   fnv_scan             one launch, a block a SCAN_MAX-byte segment of a key (what
//                        the backend uses), ~1/5 of fnv_states' work: the low 8 bits
//                        of the state are a T-function of the bytes (bit j of s'
//                        depends only on bits 0..j of s ^ b), so bit j of the state
//                        before every byte is a prefix XOR over the key once bits
//                        0..j-1 are known,
//                            s'_j = s_j ^ b_j ^ bit_j(((s ^ b) & (2^j - 1)) * 0xb3);
//                        eight XOR scans (block-wide, and across a key's segments by
//                        a look-back) give every byte's true state with no 256
//                        starts; then each thread runs FNV-1a over its SCAN_SEG
//                        bytes from its true start and adds its term of fnv_chunks'
//                        closed-form sum.
// The powers of P are precomputed on the host. The ticket counters reset
// themselves, so the scratch needs zeroing once, at allocation.
#include "common.cuh"

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull
#define HASH_CHUNK 4096          // bytes per chunk (host and device must agree)
#define HASH_THREADS 256
#define FOLD_BATCH 16            // chunk rows staged in shared memory per fold step

__device__ __forceinline__ unsigned long long fnv_word(unsigned long long h, unsigned w, int nbytes) {
#pragma unroll
  for (int i = 0; i < 4; i++) {
    if (i < nbytes) h = (h ^ ((w >> (8 * i)) & 0xffu)) * FNV_PRIME;
  }
  return h;
}

__device__ __forceinline__ unsigned long long fnv_run(unsigned long long h, const unsigned *words, int len) {
  const int full = len >> 2;
  for (int i = 0; i < full; i++) {
    const unsigned w = words[i];
    h = (h ^ (w & 0xffu)) * FNV_PRIME;
    h = (h ^ ((w >> 8) & 0xffu)) * FNV_PRIME;
    h = (h ^ ((w >> 16) & 0xffu)) * FNV_PRIME;
    h = (h ^ (w >> 24)) * FNV_PRIME;
  }
  if (len & 3) h = fnv_word(h, words[full], len & 3);
  return h;
}

// grid = n_chunks blocks of HASH_THREADS threads.
// chunk_key[c]: the key chunk c belongs to; chunk_off[c]: byte offset from base;
// chunk_len[c]: bytes (<= HASH_CHUNK); chunk_pow[c] = P^chunk_len[c] mod 2^64.
// key_first[k], key_n[k]: the key's chunks are key_first[k] .. +key_n[k]-1.
// F: scratch [n_chunks, 256]; tickets: [n_keys] zeroed once at allocation.
extern "C" __global__ void fnv1a64_keys(const unsigned char *__restrict__ base,
                                        const int *__restrict__ chunk_key,
                                        const unsigned long long *__restrict__ chunk_off,
                                        const int *__restrict__ chunk_len,
                                        const unsigned long long *__restrict__ chunk_pow,
                                        const int *__restrict__ key_first,
                                        const int *__restrict__ key_n,
                                        unsigned long long *__restrict__ F,
                                        unsigned *__restrict__ tickets,
                                        unsigned long long *__restrict__ out) {
  pdl_wait();
  __shared__ unsigned words[HASH_CHUNK / 4];
  __shared__ unsigned long long stage[FOLD_BATCH][256];
  __shared__ int is_last;
  const int c = blockIdx.x, tid = threadIdx.x;
  const int k = chunk_key[c];
  const int first = key_first[k];
  const int len = chunk_len[c];
  // Offsets are multiples of 4 (the arena aligns every buffer to 256 bytes and
  // chunks are multiples of 4 bytes long), so whole words can be loaded; the
  // padding read past a buffer's end is never hashed.
  const unsigned *src = (const unsigned *)(base + chunk_off[c]);
  for (int i = tid; i < (len + 3) / 4; i += HASH_THREADS) words[i] = src[i];
  __syncthreads();

  if (c == first) {
    if (tid == 0) F[(size_t)c * 256] = fnv_run(FNV_OFFSET, words, len);
  } else {
    F[(size_t)c * 256 + tid] = fnv_run((unsigned long long)tid, words, len);
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = (atomicAdd(&tickets[k], 1u) == (unsigned)(key_n[k] - 1));
  __syncthreads();
  if (!is_last) return;
  __threadfence();  // see every other block's F rows

  const int n = key_n[k];
  unsigned long long h = 0;
  if (tid == 0) h = ((volatile unsigned long long *)F)[(size_t)first * 256];
  for (int b0 = 1; b0 < n; b0 += FOLD_BATCH) {
    const int nb = min(FOLD_BATCH, n - b0);
    __syncthreads();
    for (int i = 0; i < nb; i++)
      stage[i][tid] = ((volatile unsigned long long *)F)[(size_t)(first + b0 + i) * 256 + tid];
    __syncthreads();
    if (tid == 0) {
      for (int i = 0; i < nb; i++) {
        const unsigned s = (unsigned)(h & 255u);
        h = (h - s) * chunk_pow[first + b0 + i] + stage[i][s];
      }
    }
  }
  if (tid == 0) {
    out[k] = h;
    tickets[k] = 0;  // ready for the next step
  }
}

// ------------------------------------------------------------ two launches

#define WALK_BATCH 64   // permutations staged in shared memory per step of the walk
#define PIECE 256       // bytes per FNV run in fnv_chunks (HASH_CHUNK / PIECE pieces a chunk)
#define PIECES (HASH_CHUNK / PIECE)

// (1) grid = n_chunks blocks of STATE_THREADS: warp w runs the state machine over pieces
// 2w, 2w+1 of the chunk from all 256 starts, then the block composes the warps' results.
// snap: [n_chunks, PIECES, 256] scratch — the state machine after each full piece, for all
// 256 starts at the chunk's start (the last one is the chunk's permutation); start:
// [n_chunks], each chunk's true low-8-bit start state; out: [n_keys], zeroed here for
// fnv_chunks' sums; tickets: [n_keys], zero.
#define STATE_THREADS 256
#define PIECES_PER_WARP (PIECES / (STATE_THREADS / 32))
#define STATES_PER_THREAD (256 / STATE_THREADS)
extern "C" __global__ void fnv_states(const unsigned char *__restrict__ base, const int *__restrict__ chunk_key,
                                      const unsigned long long *__restrict__ chunk_off,
                                      const int *__restrict__ chunk_len, const int *__restrict__ key_first,
                                      const int *__restrict__ key_n, unsigned char *__restrict__ snap,
                                      unsigned char *__restrict__ start, unsigned *__restrict__ tickets,
                                      unsigned long long *__restrict__ out) {
  pdl_wait();
  __shared__ unsigned words[HASH_CHUNK / 4];
  __shared__ __align__(16) unsigned char lsnap[PIECES][256];  // per warp: from its own segment's start
  __shared__ __align__(16) unsigned char stage[WALK_BATCH][256];
  __shared__ int is_last;
  const int c = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int k = chunk_key[c], first = key_first[k], n = key_n[k];
  const int len = chunk_len[c];  // a multiple of 4
  const int full = len / PIECE;  // pieces that end inside the chunk: the snapshots
  if (full > 0) {
    const unsigned *src = (const unsigned *)(base + chunk_off[c]);
    for (int i = tid; i < len / 4; i += STATE_THREADS) words[i] = src[i];
    __syncthreads();
    const int p0 = warp * PIECES_PER_WARP;
    if (p0 < full) {
      // lane holds starts 8*lane .. 8*lane+7, two per register (bits 0-7 and 16-23)
      unsigned x[4];
#pragma unroll
      for (int r = 0; r < 4; r++) x[r] = (8u * lane + 2 * r) | ((8u * lane + 2 * r + 1) << 16);
      const int w_end = min(p0 + PIECES_PER_WARP, full) * (PIECE / 4);
      for (int i = p0 * (PIECE / 4); i < w_end; i++) {
        const unsigned w = words[i];
#pragma unroll
        for (int kb = 0; kb < 4; kb++) {
          const unsigned bb = __byte_perm(w, 0u, 0x4040u | (kb << 8) | kb);  // byte kb in both halves
#pragma unroll
          for (int r = 0; r < 4; r++) x[r] = ((x[r] ^ bb) & 0x00FF00FFu) * 0xB3u;  // (s ^ b) * P mod 256
        }
        if ((i + 1) % (PIECE / 4) == 0) {  // a piece ends: snapshot
          unsigned char *ps = lsnap[(i + 1) / (PIECE / 4) - 1] + 8 * lane;
#pragma unroll
          for (int r = 0; r < 4; r++) {
            ps[2 * r] = (unsigned char)(x[r] & 255u);
            ps[2 * r + 1] = (unsigned char)((x[r] >> 16) & 255u);
          }
        }
      }
    }
    __syncthreads();
    // compose: a later warp's snapshots start from the state the earlier warps reached
    for (int w2 = 1; w2 * PIECES_PER_WARP < full; w2++) {
      const int prev = w2 * PIECES_PER_WARP - 1;
      unsigned char nxt[STATES_PER_THREAD][PIECES_PER_WARP];
#pragma unroll
      for (int h = 0; h < STATES_PER_THREAD; h++) {
        const int st = tid + h * STATE_THREADS;
        const unsigned sp = lsnap[prev][st];
#pragma unroll
        for (int j = 0; j < PIECES_PER_WARP; j++)
          if (w2 * PIECES_PER_WARP + j < full) nxt[h][j] = lsnap[w2 * PIECES_PER_WARP + j][sp];
      }
      __syncthreads();
#pragma unroll
      for (int h = 0; h < STATES_PER_THREAD; h++)
#pragma unroll
        for (int j = 0; j < PIECES_PER_WARP; j++)
          if (w2 * PIECES_PER_WARP + j < full) lsnap[w2 * PIECES_PER_WARP + j][tid + h * STATE_THREADS] = nxt[h][j];
      __syncthreads();
    }
    uint4 *dst = (uint4 *)(snap + (size_t)c * PIECES * 256);
    for (int i = tid; i < full * 16; i += STATE_THREADS) dst[i] = ((const uint4 *)lsnap)[i];
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = (atomicAdd(&tickets[k], 1u) == (unsigned)(n - 1));
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // walk: start[first] = low 8 bits of the offset basis, start[c+1] = perm_c[start[c]]
  // (every chunk but a key's last is a full HASH_CHUNK, so its permutation is snapshot PIECES-1)
  unsigned s = (unsigned)(FNV_OFFSET & 255u);
  for (int b0 = 0; b0 < n - 1; b0 += WALK_BATCH) {
    const int nb = min(WALK_BATCH, n - 1 - b0);
    for (int i = tid; i < nb * 16; i += STATE_THREADS) {
      const int row = i / 16, part = i % 16;
      ((uint4 *)stage[row])[part] =
          __ldcg((const uint4 *)(snap + ((size_t)(first + b0 + row) * PIECES + PIECES - 1) * 256) + part);
    }
    __syncthreads();
    if (tid == 0) {
      for (int i = 0; i < nb; i++) {
        start[first + b0 + i] = (unsigned char)s;
        s = stage[i][s];
      }
    }
    __syncthreads();
  }
  if (tid == 0) {
    start[first + n - 1] = (unsigned char)s;
    out[k] = 0;
    tickets[k] = 0;
  }
}

// (2) grid = ceil(n_chunks*PIECES/128) blocks of 128 threads, one thread per PIECE bytes.
// Writing h_c = P_c*h_{c-1} + b_c for the fold (P_c = P^len(c), b_c = F_c(s_c) - s_c*P_c,
// b_first = FNV from the offset basis), a key's hash is the plain sum
//     h = sum over pieces of b_piece * P^(bytes after the piece)   (mod 2^64),
// so every piece adds its term with one 64-bit atomicAdd: no serial fold, and the sum is
// the same in any order. piece_pow[q] = P^len(piece), piece_spow[q] = P^(bytes after it).
extern "C" __global__ void fnv_chunks(const unsigned char *__restrict__ base, const int *__restrict__ chunk_key,
                                      const unsigned long long *__restrict__ chunk_off,
                                      const int *__restrict__ chunk_len, const int *__restrict__ key_first,
                                      const unsigned long long *__restrict__ piece_pow,
                                      const unsigned long long *__restrict__ piece_spow,
                                      const unsigned char *__restrict__ snap, const unsigned char *__restrict__ start,
                                      unsigned long long *__restrict__ out, int n_chunks) {
  pdl_wait();
  const int q = blockIdx.x * blockDim.x + threadIdx.x;
  const int c = q / PIECES, j = q % PIECES;
  int k = -1;  // no term
  unsigned long long term = 0;
  if (c < n_chunks) {
    const int len = chunk_len[c] - j * PIECE;
    const int kc = chunk_key[c];
    const bool basis = j == 0 && c == key_first[kc];
    if (len > 0) {
      const unsigned s0 = start[c];
      const unsigned s = j == 0 ? s0 : snap[((size_t)c * PIECES + j - 1) * 256 + s0];
      unsigned long long h = basis ? FNV_OFFSET : (unsigned long long)s;
      const unsigned *src = (const unsigned *)(base + chunk_off[c] + (size_t)j * PIECE);
      const int nw = min(len, PIECE) / 4;
#pragma unroll 8
      for (int i = 0; i < nw; i++) h = fnv_word(h, src[i], 4);
      term = (basis ? h : h - (unsigned long long)s * piece_pow[q]) * piece_spow[q];
      k = kc;
    } else if (basis) {  // an empty buffer hashes to the offset basis
      term = FNV_OFFSET;
      k = kc;
    }
  }
  // a warp whose pieces all belong to one key adds one sum (mod 2^64, so order-free)
  const int k0 = __shfl_sync(FULL_MASK, k, 0);
  if (__all_sync(FULL_MASK, k == k0)) {
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) term += __shfl_xor_sync(FULL_MASK, term, off);
    if ((threadIdx.x & 31) == 0 && k0 >= 0) atomicAdd(&out[k0], term);
  } else if (k >= 0) {
    atomicAdd(&out[k], term);
  }
}

// ------------------------------------------------------------ a block a segment

static_assert(SCAN_SEG == 32, "a thread's bytes are the bits of one word in the scans");
#define SCAN_MAX (SCAN_THREADS * SCAN_SEG)
#define SCAN_WARPS (SCAN_THREADS / 32)

// grid = the list's segments: each key cut into SCAN_MAX-byte segments (its last one shorter; an
// empty key one empty segment), block SCAN_THREADS. Segment g: seg_len[g] bytes (a multiple of
// 4) at base + seg_off[g] (a multiple of 4), of key seg_key[g] (its hash goes to out[seg_key[g]]),
// whose segments are seg_first[g] .. + seg_n[g] - 1; seg_pow[g] = P^(bytes after it in its key).
// pow_seg[n] = P^(SCAN_SEG*n) (n < SCAN_THREADS), pow_word[n] = P^(4n) (n <= SCAN_SEG/4).
// A thread takes SCAN_SEG bytes of its segment; each 4-byte word is held as two registers of
// 16-bit lanes (even bytes, odd bytes), so one 32-bit multiply by 0xb3 steps two bytes' states
// (255 * 0xb3 < 2^16: no carry crosses a lane).
// A key of several segments: in each round a segment's block publishes its parity to agg and
// adds those of the key's earlier segments (a decoupled look-back), then the last block of the
// key (ticket) adds the segments' partial sums. Blocks take their segment in the order they
// start (a ticket from `counter`), so a block only ever waits on blocks already running; the
// flags carry the launch's epoch, so the scratch is zeroed once, at allocation, and never reset.
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    fnv_scan(const unsigned char *__restrict__ base, const int *__restrict__ seg_key,
             const unsigned long long *__restrict__ seg_off, const int *__restrict__ seg_len,
             const int *__restrict__ seg_first, const int *__restrict__ seg_n,
             const unsigned long long *__restrict__ seg_pow, const unsigned long long *__restrict__ pow_seg,
             const unsigned long long *__restrict__ pow_word, unsigned *__restrict__ agg,
             unsigned long long *__restrict__ partial, unsigned *__restrict__ tickets,
             unsigned long long *__restrict__ counter, unsigned long long *__restrict__ out) {
  pdl_wait();
  __shared__ unsigned wpar[2][SCAN_WARPS], carry[2];
  __shared__ unsigned long long wsum[SCAN_WARPS], s_ticket;
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) s_ticket = atomicAdd(counter, 1ull);
  __syncthreads();
  const int g = (int)(s_ticket % gridDim.x);
  const unsigned epoch = (unsigned)((s_ticket / gridDim.x + 1) & 0x7FFFFFFFu);
  const int first = seg_first[g], n = seg_n[g], q = g - first, k = seg_key[g];
  const int len = seg_len[g];
  const int my = min(SCAN_SEG, max(0, len - tid * SCAN_SEG));  // this thread's bytes
  const unsigned *src = (const unsigned *)(base + seg_off[g] + (size_t)tid * SCAN_SEG);
  constexpr int NW = SCAN_SEG / 4;
  unsigned be[NW], bo[NW], se[NW], so[NW];
#pragma unroll
  for (int r = 0; r < NW; r++) {
    const unsigned w = 4 * r < my ? src[r] : 0u;
    be[r] = w & 0x00FF00FFu;
    bo[r] = (w >> 8) & 0x00FF00FFu;
    se[r] = so[r] = 0u;
  }
  const unsigned live = my == 32 ? 0xFFFFFFFFu : (1u << my) - 1u;  // bytes past the key add no term
  // a warp wholly past the segment's end (a short key's block) only keeps the barriers
  const bool idle = warp * 32 * SCAN_SEG >= len;
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const unsigned mj = ((1u << j) - 1u) * 0x00010001u;
    unsigned t = 0u;  // bit i: t_i = b_j ^ bit_j(((s ^ b) & (2^j - 1)) * 0xb3) of byte i
    if (!idle) {
#pragma unroll
      for (int r = 0; r < NW; r++) {
        const unsigned pe = ((se[r] ^ be[r]) & mj) * 0xB3u, po = ((so[r] ^ bo[r]) & mj) * 0xB3u;
        unsigned t4 = (((pe ^ be[r]) >> j) & 0x00010001u) | ((((po ^ bo[r]) >> j) & 0x00010001u) << 1);
        t4 = (t4 | (t4 >> 14)) & 0xFu;  // bytes 0..3 of the word in bits 0..3
        t |= t4 << (4 * r);
      }
      t &= live;
#pragma unroll
      for (int sh = 1; sh < 32; sh <<= 1) t ^= t << sh;  // inclusive prefix XOR within the thread
    }
    const unsigned bal = __ballot_sync(FULL_MASK, t >> 31);
    if (lane == 0) wpar[j & 1][warp] = __popc(bal) & 1u;
    __syncthreads();  // (double-buffered: round j+2 writes this row after round j+1's barrier)
    const unsigned wbal = __ballot_sync(FULL_MASK, lane < SCAN_WARPS && wpar[j & 1][lane]);
    unsigned cin = (unsigned)(FNV_OFFSET >> j) & 1u;  // the state's bit j before the key
    if (n > 1) {  // block-uniform: publish this segment's parity, add the earlier segments'
      if (warp == 0) {
        if (lane == 0) atomicExch(agg + (size_t)g * 8 + j, epoch << 1 | (__popc(wbal) & 1u));
        unsigned x = 0u;
        for (int p = lane; p < q; p += 32) {
          const volatile unsigned *a = agg + (size_t)(first + p) * 8 + j;
          unsigned w;
          while (((w = *a) >> 1) != epoch) {
          }
          x ^= w & 1u;
        }
        x = __popc(__ballot_sync(FULL_MASK, x)) & 1u;
        if (lane == 0) carry[j & 1] = x;
      }
      __syncthreads();
      cin ^= carry[j & 1];
    }
    const unsigned c = (__popc(bal & ((1u << lane) - 1u)) + __popc(wbal & ((1u << warp) - 1u)) + cin) & 1u;
    const unsigned e = (t << 1) ^ (0u - c);  // bit i: bit j of the state before byte i
    if (!idle) {
#pragma unroll
      for (int r = 0; r < NW; r++) {
        const unsigned e4 = e >> (4 * r);
        se[r] |= ((e4 & 1u) | ((e4 & 4u) << 14)) << j;
        so[r] |= (((e4 >> 1) & 1u) | ((e4 & 8u) << 13)) << j;
      }
    }
  }
  // FNV-1a from the true start (the offset basis for the key's first bytes), closed-form term
  const int nsg = (len + SCAN_SEG - 1) / SCAN_SEG, last = len - (nsg - 1) * SCAN_SEG;
  const bool basis = q == 0 && tid == 0;
  const unsigned s0 = se[0] & 255u;
  unsigned long long h = basis ? FNV_OFFSET : (unsigned long long)s0;
#pragma unroll
  for (int r = 0; r < NW; r++)
    if (4 * r < my) h = fnv_word(h, be[r] | (bo[r] << 8), 4);
  unsigned long long term = 0;
  if (basis || my > 0) {
    term = basis ? h : h - (unsigned long long)s0 * pow_word[my / 4];
    if (tid < nsg - 1) term *= pow_seg[nsg - 2 - tid] * pow_word[last / 4];
    term *= seg_pow[g];
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) term += __shfl_xor_sync(FULL_MASK, term, off);
  if (lane == 0) wsum[warp] = term;
  __syncthreads();
  if (warp != 0) return;
  unsigned long long v = lane < SCAN_WARPS ? wsum[lane] : 0ull;
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
  if (n == 1) {
    if (lane == 0) out[k] = v;
    return;
  }
  if (lane == 0) {
    partial[g] = v;
    __threadfence();
    is_last = atomicAdd(tickets + k, 1u) == (unsigned)(n - 1);
  }
  __syncwarp();
  if (!is_last) return;
  __threadfence();  // see every other segment's partial sum
  unsigned long long sum = 0;
  for (int p = lane; p < n; p += 32) sum += ((volatile unsigned long long *)partial)[first + p];
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off);
  if (lane == 0) {
    out[k] = sum;
    tickets[k] = 0;  // ready for the next launch
  }
}
