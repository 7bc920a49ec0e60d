/* FNV-1a 64 of the probe buffers (contract P3; trace/fnv.py, byte for byte).
 *
 * One buffer's hash is a chain: every byte waits for the previous byte's multiply, about four cycles
 * a byte. So buffers of the same length are hashed eight at a time, their chains advanced together
 * (each still byte by byte, in order): eight multiplies in flight instead of one. The probe keys come
 * in runs of equal length (one field across all layers and columns), which is where this pays. */
#include "cref.h"

#define FNV_OFFSET KC_FNV_OFFSET
#define FNV_PRIME 0x100000001b3ull
#define LANES 8

/* LANES buffers of len bytes each -> h. Fewer real buffers repeat the first one (the copies' hashes
 * are simply not kept). */
static void fnv_lanes(const uint8_t *const *p, int64_t len, uint64_t *h)
{
    uint64_t a[LANES];
    for (int s = 0; s < LANES; s++)
        a[s] = FNV_OFFSET;
    for (int64_t i = 0; i < len; i++)
        for (int s = 0; s < LANES; s++)
            a[s] = (a[s] ^ p[s][i]) * FNV_PRIME;
    for (int s = 0; s < LANES; s++)
        h[s] = a[s];
}

static uint64_t fnv_one(const uint8_t *p, int64_t len)
{
    uint64_t h = FNV_OFFSET;
    for (int64_t i = 0; i < len; i++)
        h = (h ^ p[i]) * FNV_PRIME;
    return h;
}

/* n chains continued over len more bytes each: h[s] over p[s][0..len), eight at a time */
void kc_fnv_update(uint64_t *h, const uint8_t *const *p, int64_t n, int64_t len)
{
    for (int64_t s0 = 0; s0 < n; s0 += LANES) {
        const int k = (int)(n - s0 < LANES ? n - s0 : LANES);
        uint64_t a[LANES];
        const uint8_t *q[LANES];
        for (int s = 0; s < LANES; s++) {
            a[s] = h[s0 + (s < k ? s : 0)];
            q[s] = p[s0 + (s < k ? s : 0)];
        }
        if (k == 1) {
            for (int64_t i = 0; i < len; i++)
                a[0] = (a[0] ^ q[0][i]) * FNV_PRIME;
        } else {
            for (int64_t i = 0; i < len; i++)
                for (int s = 0; s < LANES; s++)
                    a[s] = (a[s] ^ q[s][i]) * FNV_PRIME;
        }
        for (int s = 0; s < k; s++)
            h[s0 + s] = a[s];
    }
}

/* Streams s = 0..n of one run: key first + s / M, column s % M; key j of column m goes to
 * out[m * out_ld + j]. */
typedef struct {
    const uint8_t *const *base;
    const int64_t *stride;
    int64_t M, out_ld;
    uint64_t *out;
} fnv_job;

static void fnv_run_chunk(const fnv_job *jb, int64_t first, int64_t len, int64_t s0, int64_t n)
{
    const uint8_t *p[LANES];
    uint64_t h[LANES];
    for (int s = 0; s < LANES; s++) {
        int64_t t = s0 + (s < n ? s : 0), key = first + t / jb->M, m = t % jb->M;
        p[s] = jb->base[key] + m * jb->stride[key];
    }
    if (n == 1) {
        h[0] = fnv_one(p[0], len);
    } else {
        fnv_lanes(p, len, h);
    }
    for (int s = 0; s < n; s++) {
        int64_t t = s0 + s, key = first + t / jb->M, m = t % jb->M;
        jb->out[m * jb->out_ld + key] = h[s];
    }
}

/* Every key's hash, the work split into `parts` shares of which this caller does share `part`. */
void kc_fnv_share(const uint8_t *const *base, const int64_t *bytes, const int64_t *stride, int64_t n_keys,
                  int64_t M, uint64_t *out, int64_t out_ld, int part, int parts)
{
    fnv_job jb = {base, stride, M, out_ld, out};
    int64_t chunk = 0;
    for (int64_t first = 0, end; first < n_keys; first = end) {
        for (end = first + 1; end < n_keys && bytes[end] == bytes[first]; end++)
            ;
        int64_t streams = (end - first) * M;
        for (int64_t s0 = 0; s0 < streams; s0 += LANES, chunk++)
            if (chunk % parts == part)
                fnv_run_chunk(&jb, first, bytes[first], s0, streams - s0 < LANES ? streams - s0 : LANES);
    }
}

void kc_fnv_keys(const uint8_t *const *base, const int64_t *bytes, const int64_t *stride, int64_t n_keys,
                 int64_t M, uint64_t *out)
{
    kc_fnv_share(base, bytes, stride, n_keys, M, out, n_keys, 0, 1);
}
