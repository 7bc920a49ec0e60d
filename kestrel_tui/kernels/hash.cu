// hash.cu — FNV-1a 64 of every probe key of a decode step, in ONE launch.
//
// Versions:
//   fnv1a64_keys   the only one: hashing has no fast/exact split (the hash is
//                  a definition, trace/fnv.py: h = 0xcbf29ce484222325; per byte
//                  h ^= b; h *= 0x100000001b3 mod 2^64). Hashes come back to the
//                  host once per step; raw buffers stay on the device.
//
// Why not one thread per key: FNV-1a is a serial chain, ~10 cycles a byte, so
// a 600 KB logits row (Qwen3-30B vocab) alone would take ~3 ms. Instead every
// key is cut into CHUNK-byte pieces hashed in parallel, using this identity:
// XOR with a byte b only touches the low 8 bits, and for s = h & 255
//     (h ^ b) * P = (h - s) * P + (s ^ b) * P      (mod 2^64)
// so after n bytes  h_n = (h_0 - s) * P^n + F(s)  where F(s) is FNV-1a over the
// chunk started from the value s (0..255). One 256-thread block computes F for
// all 256 starts of a chunk (thread s starts from h = s); a key's first chunk
// starts from the offset basis, so only one thread works there. The last block
// to finish a key (atomic ticket) folds its chunks in order:
//     h = (h - (h & 255)) * P^len(c) + F_c[h & 255]
// P^len(c) is precomputed on the host per chunk. The counters reset themselves.
#include "common.cuh"

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull
#define HASH_CHUNK 2048          // bytes per chunk (host and device must agree)
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
