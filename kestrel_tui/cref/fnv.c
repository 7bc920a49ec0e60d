/* FNV-1a 64 of the probe buffers (trace/fnv.py: the dump format's hash, byte for byte). */
#include "cref.h"

void kc_fnv_keys(const uint8_t *const *base, const int64_t *bytes, const int64_t *stride, int64_t n_keys,
                 int64_t M, uint64_t *out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < n_keys; j++) {
            const uint8_t *p = base[j] + m * stride[j];
            uint64_t h = 0xcbf29ce484222325ull;
            for (int64_t i = 0; i < bytes[j]; i++) {
                h ^= p[i];
                h *= 0x100000001b3ull;
            }
            out[m * n_keys + j] = h;
        }
}
