/* The GEMVs of numerics/linalg.py (docs/numerics.md, "GEMV" and "Ordered reductions"), bit for bit.
 *
 * Threads take tiles of output rows (of all jobs flattened); each output's lane sum is computed
 * whole by one thread, so the thread count moves no bit. Within a tile the columns are looped
 * inside the rows, so a weight row is read from memory once for all columns of a call.
 *
 * SIMD (kc_gemv_simd, cpu.c: scalar, AVX2, VNNI, AVX-512; x86 only, picked at run time so one build
 * serves every CPU): every level gives the same bits. The integer block dots are exact in any
 * order; the float part is vectorised over 8 consecutive blocks, which sit in 8 different lanes of
 * the lane sum (block b in lane b % 32), so each lane still adds its blocks in ascending order.
 *
 * The q4_0 dot is sum_k q_k*x_k - 8*sum_k x_k with the raw nibbles q in 0..15 (unsigned, as
 * maddubs / dpbusd want them); the 8*sum x part is per column, computed once, not per row.
 * So the nibbles need no recentring and every int16 partial below stays under 2^15:
 * a maddubs pair is <= 2*15*128 = 3840, and 8 of them <= 30720.
 *
 * The block dot wants block k's products in int32 lane k, so 8 blocks are transposed as
 * 4-byte words: weight word v of 8 blocks forms one vector (lane k = block k), and the activation
 * is laid out the same way once per call (prep_x). Which weight nibble meets which activation
 * byte within a block is free (an exact sum), so the words pair with a transposed copy of x.
 */
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KC_X86 1
#endif

#include "cref.h"

#define QK 32
#define BLOCK 18       /* q4_0 bytes per block: f16 scale, 16 nibble bytes */
#define TILE_ROWS 16   /* output rows per work item: small enough to balance 2..16 threads */
#define TILE_COLS 16   /* columns sharing one decode of a weight group in the SIMD tiles */

/* ---------------------------------------------------------------- shared helpers */

static inline int64_t col_x(const kc_job *j, int64_t c) { return j->xrow ? j->xrow[c] : c; }
static inline int64_t col_y(const kc_job *j, int64_t c) { return j->yrow ? j->yrow[c] : c; }

static inline float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return kc_f16_to_f32(h);
}

/* The contract's butterfly over the 32 lanes v[0..32); only lane 0's operands are computed. */
static inline float butterfly(float *v)
{
    for (int off = 16; off >= 1; off >>= 1)
        for (int i = 0; i < off; i++)
            v[i] = v[i] + v[i + off];
    return v[0];
}

/* ---------------------------------------------------------------- scalar reference paths */

static void q4_tile_scalar(const kc_job *jb, int64_t r0, int64_t r1, int64_t nb, const int8_t *qx,
                           const float *dx, float *y, int64_t y_ld)
{
    const uint8_t *w = jb->w;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = w + r * nb * BLOCK;
        for (int64_t c = 0; c < jb->n; c++) {
            const int8_t *xr = qx + col_x(jb, c) * nb * QK;
            const float *dr = dx + col_x(jb, c) * nb;
            float lane[32] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *q = wr + b * BLOCK + 2;
                const int8_t *xb = xr + b * QK;
                int32_t isum = 0;
                for (int j = 0; j < 16; j++)
                    isum += ((q[j] & 15) - 8) * xb[j] + ((q[j] >> 4) - 8) * xb[j + 16];
                float s = f16_at(wr + b * BLOCK) * dr[b];
                lane[b & 31] = lane[b & 31] + (float)isum * s;
            }
            y[col_y(jb, c) * y_ld + jb->y_off + r] = butterfly(lane);
        }
    }
}

static void f32_tile_scalar(const kc_job *jb, int64_t r0, int64_t r1, int64_t inp, const float *x,
                            float *y, int64_t y_ld)
{
    const float *w = jb->w;
    for (int64_t r = r0; r < r1; r++) {
        const float *wr = w + r * inp;
        for (int64_t c = 0; c < jb->n; c++) {
            const float *xr = x + col_x(jb, c) * inp;
            float lane[32] = {0};
            for (int64_t i = 0; i < inp; i++)
                lane[i & 31] = lane[i & 31] + wr[i] * xr[i];
            y[col_y(jb, c) * y_ld + jb->y_off + r] = butterfly(lane);
        }
    }
}

/* ---------------------------------------------------------------- x86 SIMD paths */

#ifdef KC_X86

/* One x row's group of 8 blocks, prepared once per call: xt word v of block k at xt[v*32 + k*4]
 * (the transposed layout of the file comment), -8 * sum(x) per block, and the scales; blocks
 * past nb are zero, so they add +0 terms, which leave a lane unchanged (a lane starts at +0 and
 * so is never -0). */
typedef struct {
    int8_t xt[256];
    int32_t negc8[8];
    float dx[8];
} xgroup;  /* 320 bytes: a multiple of 64, so an aligned array keeps every group aligned */

static void prep_x(const int8_t *qx, const float *dx, int64_t nb, int64_t row, xgroup *out)
{
    int64_t ng = (nb + 7) / 8;
    const int8_t *xr = qx + row * nb * QK;
    for (int64_t g = 0; g < ng; g++) {
        xgroup *xg = out + g;
        memset(xg, 0, sizeof *xg);
        for (int k = 0; k < 8 && g * 8 + k < nb; k++) {
            int64_t b = g * 8 + k;
            const int8_t *xb = xr + b * QK;
            int32_t s = 0;
            for (int v = 0; v < 8; v++)
                memcpy(xg->xt + v * 32 + k * 4, xb + v * 4, 4);
            for (int i = 0; i < QK; i++)
                s += xb[i];
            xg->negc8[k] = -8 * s;
            xg->dx[k] = dx[row * nb + b];
        }
    }
}

/* For nb = 1, 2 or 4 blocks a row, 8 consecutive blocks are 8/nb whole rows: group lane k is block
 * k % nb of row k / nb, so the x group repeats the row's nb blocks 8/nb times (q4_tile_packed). */
static void prep_x_tiled(const int8_t *qx, const float *dx, int64_t nb, int64_t row, xgroup *out)
{
    xgroup one[1];
    prep_x(qx, dx, nb, row, one);
    memcpy(out, one, sizeof *out);
    for (int k = (int)nb; k < 8; k++) {
        for (int v = 0; v < 8; v++)
            memcpy(out->xt + v * 32 + k * 4, one->xt + v * 32 + (k % nb) * 4, 4);
        out->negc8[k] = one->negc8[k % nb];
        out->dx[k] = one->dx[k % nb];
    }
}

typedef struct {
    __m256i n[8];  /* nibbles of weight word v (low: n[v], high: n[v+4]), lane k = block k */
    __m256 dw;
} dec8;

#define AVX2_TARGET "avx2,f16c"

/* 8 blocks of one weight row; blk points at 8 whole blocks (callers pad the last group).
 * Weight word v of block k holds elements 4v..4v+3 (low nibbles) and 16+4v.. (high), which is
 * what x word v and x word v+4 hold in prep_x's layout. */
static inline __attribute__((always_inline, target(AVX2_TARGET)))
void decode8(const uint8_t *blk, dec8 *d)
{
    __m256i y[4];
    for (int k = 0; k < 4; k++)
        y[k] = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(blk + k * BLOCK + 2))),
            _mm_loadu_si128((const __m128i *)(blk + (k + 4) * BLOCK + 2)), 1);
    /* 4x4 transpose of words within each 128-bit half: half 0 holds blocks 0..3, half 1 4..7 */
    __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
    __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
    __m256i v[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                    _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int i = 0; i < 4; i++) {
        d->n[i] = _mm256_and_si256(v[i], m4);
        d->n[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v[i], 4), m4);
    }
    /* scale k sits at bytes 18k = 16k + 2k: word k of the k-th 16 bytes, so 7 word blends gather them */
    __m128i h = _mm_loadu_si128((const __m128i *)blk);
#define KC_BLEND_SCALE(k) h = _mm_blend_epi16(h, _mm_loadu_si128((const __m128i *)(blk + 16 * (k))), 1 << (k))
    KC_BLEND_SCALE(1); KC_BLEND_SCALE(2); KC_BLEND_SCALE(3); KC_BLEND_SCALE(4);
    KC_BLEND_SCALE(5); KC_BLEND_SCALE(6); KC_BLEND_SCALE(7);
#undef KC_BLEND_SCALE
    d->dw = _mm256_cvtph_ps(h);
}

static inline __attribute__((always_inline, target(AVX2_TARGET)))
__m256i dot8_avx2(const dec8 *d, const xgroup *xg)
{
    const __m256i *xt = (const __m256i *)xg->xt;
    __m256i p = _mm256_maddubs_epi16(d->n[0], _mm256_load_si256(xt));
    for (int v = 1; v < 8; v++)
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(d->n[v], _mm256_load_si256(xt + v)));
    return _mm256_add_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)),
                            _mm256_load_si256((const __m256i *)xg->negc8));
}

#define VNNI512_TARGET "avx2,f16c,avx512f,avx512vl,avx512vnni"
#define VNNIAVX_TARGET "avx2,f16c,avxvnni"

static inline __attribute__((always_inline, target(VNNI512_TARGET)))
__m256i dot8_vnni512(const dec8 *d, const xgroup *xg)
{
    const __m256i *xt = (const __m256i *)xg->xt;
    __m256i s = _mm256_load_si256((const __m256i *)xg->negc8), u = _mm256_setzero_si256();
    for (int v = 0; v < 8; v += 2) {  /* two chains: dpbusd's latency, not its throughput, would bound one */
        s = _mm256_dpbusd_epi32(s, d->n[v], _mm256_load_si256(xt + v));
        u = _mm256_dpbusd_epi32(u, d->n[v + 1], _mm256_load_si256(xt + v + 1));
    }
    return _mm256_add_epi32(s, u);
}

static inline __attribute__((always_inline, target(VNNIAVX_TARGET)))
__m256i dot8_vnniavx(const dec8 *d, const xgroup *xg)
{
    const __m256i *xt = (const __m256i *)xg->xt;
    __m256i s = _mm256_load_si256((const __m256i *)xg->negc8), u = _mm256_setzero_si256();
    for (int v = 0; v < 8; v += 2) {
        s = _mm256_dpbusd_avx_epi32(s, d->n[v], _mm256_load_si256(xt + v));
        u = _mm256_dpbusd_avx_epi32(u, d->n[v + 1], _mm256_load_si256(xt + v + 1));
    }
    return _mm256_add_epi32(s, u);
}

/* Lanes 0..31 in four vectors -> the contract's butterfly result (lane 0). */
static inline __attribute__((always_inline, target(AVX2_TARGET)))
float butterfly8(const __m256 *a)
{
    __m256 v = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));  /* off 16, 8 */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));    /* off 4 */
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                           /* off 2 */
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));                                       /* off 1 */
    return _mm_cvtss_f32(h);
}

/* The rest of the butterfly for one row once its four lane vectors are summed into v (offsets 16 and 8:
 * (a0 + a2) + (a1 + a3)): offsets 4, 2, 1. */
static inline __attribute__((always_inline, target(AVX2_TARGET)))
float finish1(__m256 v)
{
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));    /* off 4 */
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                           /* off 2 */
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));                                       /* off 1 */
    return _mm_cvtss_f32(h);
}

/* finish1 of eight rows at once, the same additions with the same operands: offset 4 as the low plus
 * the high half of each row, two rows a vector; offset 2 and 1 as pairs of lanes picked from two rows'
 * vectors. -> the eight results, row order. */
static inline __attribute__((always_inline, target(AVX2_TARGET)))
__m256 reduce8(const __m256 *v)
{
    __m256 s[4];
    for (int k = 0; k < 4; k++)  /* [row 2k | row 2k+1], lanes i: lo_i + hi_i */
        s[k] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x31));
    /* lanes 0, 1 of each half: u0 + u2, u1 + u3: rows [0, 2 | 1, 3] and [4, 6 | 5, 7] */
    __m256 t0 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], 0x44), _mm256_shuffle_ps(s[0], s[1], 0xEE));
    __m256 t1 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], 0x44), _mm256_shuffle_ps(s[2], s[3], 0xEE));
    /* w0 + w1: rows [0, 2, 4, 6 | 1, 3, 5, 7] */
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x88), _mm256_shuffle_ps(t0, t1, 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Level 3 (AVX-512 VBMI + VNNI): the same 8-block groups, but the transpose is two byte permutes
 * over the group's 144 bytes (3 loads, none past the group), which also pick out the 8 scales.
 * Bytes 0..127 are reachable by one two-source permute; only block 7's nibbles (128..143) are not,
 * and a masked permute of the last 64 bytes fills them in. */
#define AVX512_TARGET "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni"

typedef struct {
    __m512i lo[2], hi[2];  /* [n0|n1], [n2|n3] and [n4|n5], [n6|n7] of dec8 */
    __m256 dw;
} dec8z;

static int8_t g_perm[3][64];  /* words 0-1 and 2-3 (index into group bytes 0..127, or 80..143 for
                               * block 7), and the scales' bytes in the first 16 */

/* At load time, so no GEMV ever races the table. */
__attribute__((constructor)) static void init_perm(void)
{
    for (int z = 0; z < 2; z++)
        for (int p = 0; p < 64; p++) {
            int v = 2 * z + p / 32, k = (p % 32) / 4, t = p % 4, src = 18 * k + 2 + 4 * v + t;
            g_perm[z][p] = (int8_t)(k == 7 ? src - 80 : src);
        }
    for (int p = 0; p < 64; p++)
        g_perm[2][p] = (int8_t)(p < 16 ? 18 * (p / 2) + p % 2 : 0);
}

static inline __attribute__((always_inline, target(AVX512_TARGET)))
void decode8z(const uint8_t *blk, dec8z *d)
{
    const __mmask64 k7 = 0xF0000000F0000000ull;  /* the bytes of lane 7 (block 7) in both halves */
    __m512i a = _mm512_loadu_si512(blk), b = _mm512_loadu_si512(blk + 64), c = _mm512_loadu_si512(blk + 80);
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int z = 0; z < 2; z++) {
        __m512i idx = _mm512_loadu_si512(g_perm[z]);
        __m512i w = _mm512_mask_permutexvar_epi8(_mm512_permutex2var_epi8(a, idx, b), k7, idx, c);
        d->lo[z] = _mm512_and_si512(w, m4);
        d->hi[z] = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
    }
    __m512i h = _mm512_permutex2var_epi8(a, _mm512_loadu_si512(g_perm[2]), b);
    d->dw = _mm256_cvtph_ps(_mm512_castsi512_si128(h));
}

static inline __attribute__((always_inline, target(AVX512_TARGET)))
__m256i dot8z(const dec8z *d, const xgroup *xg)
{
    const __m512i *xt = (const __m512i *)xg->xt;
    __m512i s = _mm512_zextsi256_si512(_mm256_load_si256((const __m256i *)xg->negc8));
    __m512i u = _mm512_dpbusd_epi32(_mm512_setzero_si512(), d->hi[0], _mm512_load_si512(xt + 2));
    s = _mm512_dpbusd_epi32(s, d->lo[0], _mm512_load_si512(xt));
    u = _mm512_dpbusd_epi32(u, d->hi[1], _mm512_load_si512(xt + 3));
    s = _mm512_dpbusd_epi32(s, d->lo[1], _mm512_load_si512(xt + 1));
    s = _mm512_add_epi32(s, u);  /* lanes 0..7 and 8..15 both hold partial sums of blocks 0..7 */
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

/* The hardware prefetcher alone leaves a streamed matrix (one too large for the caches, as every
 * matrix of a real decode is) at about 2/3 of the memory bandwidth; prefetching 4 KB ahead of the
 * group being decoded measured 1.5x on a 2-core VM, and costs nothing measurable on a hot matrix.
 * A prefetch past the end of the weights is harmless: prefetches never fault. */
#define PREFETCH_DIST 4096
#define PREFETCH_AHEAD(p)                                                            \
    do {                                                                             \
        _mm_prefetch((const char *)(p) + PREFETCH_DIST, _MM_HINT_T0);                \
        _mm_prefetch((const char *)(p) + PREFETCH_DIST + 64, _MM_HINT_T0);           \
        _mm_prefetch((const char *)(p) + PREFETCH_DIST + 128, _MM_HINT_T0);          \
    } while (0)

/* dw & LIVE_MASK(live): the scales of the first `live` lanes, +0 in the others */
static const int32_t g_live[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
#define LIVE_MASK(live) _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(g_live + 8 - (live))))

/* One tile of one q4_0 job: rows r0..r1, every column; xp: prep_x of every x row (ng groups each).
 * A row's last group, when nb is not a multiple of 8, is read where it lies: the blocks after the row's
 * end are the next row's, their scales masked to +0 (and x is zero there too), so their terms are +0.
 * Only where those 8 blocks would run past the matrix are they copied to a zero-padded buffer.
 * Group g of a row goes to lane vector g % 4 (blocks 8g..8g+7 are lanes (8g..8g+7) % 32). One column
 * (a decode step) keeps its four vectors in registers; more share each decoded group, TILE_COLS at a
 * time. */
#define DEFINE_Q4_TILE(NAME, TARGET, DEC, DECODE, DOT8)                                                        \
    static inline __attribute__((always_inline, target(TARGET)))                                  \
    void NAME##_group(const uint8_t *wr, int64_t g, int64_t full, const uint8_t *end, __m256 live, DEC *d) \
    {                                                                                              \
        const uint8_t *blk = wr + g * 8 * BLOCK;                                                   \
        PREFETCH_AHEAD(blk);                                                                       \
        if (g < full) {                                                                            \
            DECODE(blk, d);                                                                        \
            return;                                                                                \
        }                                                                                          \
        if (blk + 8 * BLOCK <= end) {                                                              \
            DECODE(blk, d);                                                                        \
        } else {                                                                                   \
            uint8_t pad[8 * BLOCK] = {0};                                                          \
            memcpy(pad, blk, (size_t)(end - blk));                                                 \
            DECODE(pad, d);                                                                        \
        }                                                                                          \
        d->dw = _mm256_and_ps(d->dw, live);                                                        \
    }                                                                                              \
    static inline __attribute__((always_inline, target(TARGET)))                                  \
    __m256 NAME##_term(const DEC *d, const xgroup *xg)                                             \
    {                                                                                              \
        __m256 s = _mm256_mul_ps(d->dw, _mm256_load_ps(xg->dx));                                   \
        return _mm256_mul_ps(_mm256_cvtepi32_ps(DOT8(d, xg)), s);                                  \
    }                                                                                              \
    static inline __attribute__((always_inline, target(TARGET)))                                  \
    __m256 NAME##_gterm(const uint8_t *wr, int64_t g, int64_t full, const uint8_t *end, __m256 live, \
                        const xgroup *xr)                                                          \
    {                                                                                              \
        DEC d;                                                                                     \
        NAME##_group(wr, g, full, end, live, &d);                                                  \
        return NAME##_term(&d, xr + g);                                                            \
    }                                                                                              \
    static inline __attribute__((always_inline, target(TARGET)))                                  \
    __m256 NAME##_fterm(const uint8_t *wr, int64_t g, const xgroup *xr)                            \
    {                                                                                              \
        DEC d;                                                                                     \
        PREFETCH_AHEAD(wr + g * 8 * BLOCK);                                                        \
        DECODE(wr + g * 8 * BLOCK, &d);                                                            \
        return NAME##_term(&d, xr + g);                                                            \
    }                                                                                              \
    static __attribute__((target(TARGET))) void NAME(const kc_job *jb, int64_t r0, int64_t r1,      \
                                                     int64_t nb, const xgroup *xp, float *y,        \
                                                     int64_t y_ld)                                  \
    {                                                                                              \
        const int64_t ng = (nb + 7) / 8, full = nb / 8;                                            \
        const uint8_t *w = jb->w, *end = w + jb->out * nb * BLOCK;                                 \
        const __m256 live = LIVE_MASK((int)(nb - full * 8));                                       \
        if (jb->n == 1) {                                                                          \
            const xgroup *xr = xp + col_x(jb, 0) * ng;                                             \
            float *yr = y + col_y(jb, 0) * y_ld + jb->y_off;                                       \
            __m256 v[8];                                                                           \
            if (nb == 8) { /* one group a row: its lane vector a0 = +0 + term, a1..a3 = +0 */        \
                for (int64_t r = r0; r < r1; r++) {                                                \
                    v[(r - r0) & 7] = _mm256_add_ps(_mm256_setzero_ps(),                           \
                                                    NAME##_fterm(w + r * 8 * BLOCK, 0, xr));      \
                    if (((r - r0) & 7) == 7)                                                       \
                        _mm256_storeu_ps(yr + r - 7, reduce8(v));                                  \
                }                                                                                  \
            } else if (nb % 8 == 0) { /* whole groups only: no partial-group test in the loop */     \
                for (int64_t r = r0; r < r1; r++) {                                                \
                    const uint8_t *wr = w + r * nb * BLOCK;                                        \
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                    \
                    int64_t g = 0;                                                                 \
                    for (; g + 4 <= ng; g += 4) {                                                  \
                        a0 = _mm256_add_ps(a0, NAME##_fterm(wr, g, xr));                           \
                        a1 = _mm256_add_ps(a1, NAME##_fterm(wr, g + 1, xr));                       \
                        a2 = _mm256_add_ps(a2, NAME##_fterm(wr, g + 2, xr));                       \
                        a3 = _mm256_add_ps(a3, NAME##_fterm(wr, g + 3, xr));                       \
                    }                                                                              \
                    if (g < ng)                                                                    \
                        a0 = _mm256_add_ps(a0, NAME##_fterm(wr, g, xr));                           \
                    if (g + 1 < ng)                                                                \
                        a1 = _mm256_add_ps(a1, NAME##_fterm(wr, g + 1, xr));                       \
                    if (g + 2 < ng)                                                                \
                        a2 = _mm256_add_ps(a2, NAME##_fterm(wr, g + 2, xr));                       \
                    v[(r - r0) & 7] = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3)); \
                    if (((r - r0) & 7) == 7)                                                       \
                        _mm256_storeu_ps(yr + r - 7, reduce8(v));                                  \
                }                                                                                  \
            }                                                                                      \
            for (int64_t r = nb % 8 == 0 ? r1 : r0; r < r1; r++) {                                     \
                const uint8_t *wr = w + r * nb * BLOCK;                                            \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                        \
                int64_t g = 0;                                                                     \
                for (; g + 4 <= ng; g += 4) {                                                      \
                    a0 = _mm256_add_ps(a0, NAME##_gterm(wr, g, full, end, live, xr));              \
                    a1 = _mm256_add_ps(a1, NAME##_gterm(wr, g + 1, full, end, live, xr));          \
                    a2 = _mm256_add_ps(a2, NAME##_gterm(wr, g + 2, full, end, live, xr));          \
                    a3 = _mm256_add_ps(a3, NAME##_gterm(wr, g + 3, full, end, live, xr));          \
                }                                                                                  \
                if (g < ng)                                                                        \
                    a0 = _mm256_add_ps(a0, NAME##_gterm(wr, g, full, end, live, xr));              \
                if (g + 1 < ng)                                                                    \
                    a1 = _mm256_add_ps(a1, NAME##_gterm(wr, g + 1, full, end, live, xr));          \
                if (g + 2 < ng)                                                                    \
                    a2 = _mm256_add_ps(a2, NAME##_gterm(wr, g + 2, full, end, live, xr));          \
                v[(r - r0) & 7] = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));     \
                if (((r - r0) & 7) == 7)                                                           \
                    _mm256_storeu_ps(yr + r - 7, reduce8(v));                                      \
            }                                                                                      \
            for (int64_t r = r0 + (r1 - r0) / 8 * 8; r < r1; r++)                                  \
                yr[r] = finish1(v[(r - r0) & 7]);                                                  \
            return;                                                                                \
        }                                                                                          \
        /* several columns: each decoded group serves all of them; a column's row sums wait in vs    \
         * until 8 rows can be reduced together */                                                 \
        __m256 acc[TILE_COLS][4], vs[TILE_COLS][8];                                                \
        const xgroup *xc[TILE_COLS];                                                               \
        float *yc[TILE_COLS];                                                                      \
        for (int64_t c0 = 0; c0 < jb->n; c0 += TILE_COLS) {                                        \
            const int nc = (int)(jb->n - c0 < TILE_COLS ? jb->n - c0 : TILE_COLS);                 \
            for (int c = 0; c < nc; c++) {                                                         \
                xc[c] = xp + col_x(jb, c0 + c) * ng;                                               \
                yc[c] = y + col_y(jb, c0 + c) * y_ld + jb->y_off;                                  \
            }                                                                                      \
            for (int64_t r = r0; r < r1; r++) {                                                    \
                const uint8_t *wr = w + r * nb * BLOCK;                                            \
                const int k = (int)((r - r0) & 7);                                                 \
                if (nb == 8) { /* one group: a0 = +0 + term, a1..a3 = +0, as for one column */       \
                    DEC d;                                                                         \
                    NAME##_group(wr, 0, full, end, live, &d);                                      \
                    for (int c = 0; c < nc; c++)                                                   \
                        vs[c][k] = _mm256_add_ps(_mm256_setzero_ps(), NAME##_term(&d, xc[c]));     \
                } else {                                                                           \
                    for (int c = 0; c < nc; c++)                                                   \
                        for (int l = 0; l < 4; l++)                                                \
                            acc[c][l] = _mm256_setzero_ps();                                       \
                    for (int64_t g = 0; g < ng; g++) {                                             \
                        DEC d;                                                                     \
                        NAME##_group(wr, g, full, end, live, &d);                                  \
                        for (int c = 0; c < nc; c++)                                               \
                            acc[c][g & 3] = _mm256_add_ps(acc[c][g & 3], NAME##_term(&d, xc[c] + g)); \
                    }                                                                              \
                    for (int c = 0; c < nc; c++)                                                   \
                        vs[c][k] = _mm256_add_ps(_mm256_add_ps(acc[c][0], acc[c][2]),              \
                                                 _mm256_add_ps(acc[c][1], acc[c][3]));             \
                }                                                                                  \
                if (k == 7)                                                                        \
                    for (int c = 0; c < nc; c++)                                                   \
                        _mm256_storeu_ps(yc[c] + r - 7, reduce8(vs[c]));                           \
            }                                                                                      \
            for (int64_t r = r0 + (r1 - r0) / 8 * 8; r < r1; r++)                                  \
                for (int c = 0; c < nc; c++)                                                       \
                    yc[c][r] = finish1(vs[c][(r - r0) & 7]);                                       \
        }                                                                                          \
    }

/* The lane sums of rows of nb = 1, 2 or 4 blocks, 8/nb rows in the 8 lanes of t (lane k: block k % nb
 * of row k / nb), each lane already +0 + its one term: the butterfly of the contract (R1) over the
 * row's nb lanes, all the others +0 (adding +0 to a lane that is never -0 changes nothing), written to
 * the 8/nb consecutive outputs at y. */
static inline __attribute__((always_inline, target(AVX2_TARGET)))
void store_packed(__m256 t, int64_t nb, float *y)
{
    if (nb == 1) {
        _mm256_storeu_ps(y, t);
    } else if (nb == 2) {
        t = _mm256_add_ps(t, _mm256_permute_ps(t, 0xB1));  /* off 1: lane i + lane i^1 */
        _mm_storeu_ps(y, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6))));
    } else {
        t = _mm256_add_ps(t, _mm256_permute_ps(t, 0x4E));  /* off 2 */
        t = _mm256_add_ps(t, _mm256_permute_ps(t, 0xB1));  /* off 1 */
        y[0] = _mm256_cvtss_f32(t);
        y[1] = _mm_cvtss_f32(_mm256_extractf128_ps(t, 1));
    }
}

/* Rows r0..r1 ((r1 - r0) a multiple of 8/nb) of a job with nb = 1, 2 or 4: one decode of 8 blocks
 * serves 8/nb rows; xt: prep_x_tiled of every x row. */
#define DEFINE_Q4_PACKED(NAME, TARGET, DEC, DECODE, DOT8)                                                      \
    static __attribute__((target(TARGET))) void NAME(const kc_job *jb, int64_t r0, int64_t r1,      \
                                                     int64_t nb, const xgroup *xt, float *y,        \
                                                     int64_t y_ld)                                  \
    {                                                                                              \
        const int64_t per = 8 / nb;                                                                \
        const uint8_t *w = jb->w;                                                                  \
        for (int64_t r = r0; r < r1; r += per) {                                                   \
            DEC d;                                                                                 \
            const uint8_t *blk = w + r * nb * BLOCK;                                               \
            PREFETCH_AHEAD(blk);                                                                   \
            DECODE(blk, &d);                                                                       \
            for (int64_t c = 0; c < jb->n; c++) {                                                  \
                const xgroup *xg = xt + col_x(jb, c);                                              \
                __m256 s = _mm256_mul_ps(d.dw, _mm256_load_ps(xg->dx));                            \
                __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(DOT8(&d, xg)), s);                     \
                store_packed(_mm256_add_ps(_mm256_setzero_ps(), t), nb,                            \
                             y + col_y(jb, c) * y_ld + jb->y_off + r);                             \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_Q4_TILE(q4_tile_avx2, AVX2_TARGET, dec8, decode8, dot8_avx2)
DEFINE_Q4_TILE(q4_tile_vnni512, VNNI512_TARGET, dec8, decode8, dot8_vnni512)
DEFINE_Q4_TILE(q4_tile_vnniavx, VNNIAVX_TARGET, dec8, decode8, dot8_vnniavx)
DEFINE_Q4_TILE(q4_tile_avx512, AVX512_TARGET, dec8z, decode8z, dot8z)
DEFINE_Q4_PACKED(q4_packed_avx2, AVX2_TARGET, dec8, decode8, dot8_avx2)
DEFINE_Q4_PACKED(q4_packed_vnni512, VNNI512_TARGET, dec8, decode8, dot8_vnni512)
DEFINE_Q4_PACKED(q4_packed_vnniavx, VNNIAVX_TARGET, dec8, decode8, dot8_vnniavx)
DEFINE_Q4_PACKED(q4_packed_avx512, AVX512_TARGET, dec8z, decode8z, dot8z)

/* f32: element i in lane i % 32, so 32 elements are four vectors of lanes; the tail is masked
 * (0 * 0 = +0 terms). */
static __attribute__((target(AVX2_TARGET))) void f32_tile_avx2(const kc_job *jb, int64_t r0, int64_t r1,
                                                               int64_t inp, const float *x, float *y,
                                                               int64_t y_ld)
{
    const float *w = jb->w;
    const int64_t full = inp & ~(int64_t)31;
    __m256i mask[4];
    for (int j = 0; j < 4; j++) {
        int64_t left = inp - full - 8 * j;
        int32_t m[8];
        for (int i = 0; i < 8; i++)
            m[i] = i < left ? -1 : 0;
        mask[j] = _mm256_loadu_si256((const __m256i *)m);
    }
    for (int64_t r = r0; r < r1; r++) {
        const float *wr = w + r * inp;
        for (int64_t c = 0; c < jb->n; c++) {
            const float *xr = x + col_x(jb, c) * inp;
            __m256 a[4];
            for (int j = 0; j < 4; j++)
                a[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < full; i += 32) {
                _mm_prefetch((const char *)(wr + i) + PREFETCH_DIST, _MM_HINT_T0);
                _mm_prefetch((const char *)(wr + i) + PREFETCH_DIST + 64, _MM_HINT_T0);
                for (int j = 0; j < 4; j++)
                    a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(_mm256_loadu_ps(wr + i + 8 * j),
                                                             _mm256_loadu_ps(xr + i + 8 * j)));
            }
            if (full < inp)
                for (int j = 0; j < 4; j++)
                    a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(_mm256_maskload_ps(wr + full + 8 * j, mask[j]),
                                                             _mm256_maskload_ps(xr + full + 8 * j, mask[j])));
            y[col_y(jb, c) * y_ld + jb->y_off + r] = butterfly8(a);
        }
    }
}

#endif /* KC_X86 */

/* ---------------------------------------------------------------- entry points */

/* A share of the calls' row tiles: TILE_ROWS rows of one job, every job in turn. A thread takes one
 * contiguous stretch (tiles t0..t1 of all), so it streams its own part of the matrices. */
typedef struct { int job; int64_t r0; } tile_pos;

static int64_t count_tiles(const kc_job *jobs, int n_jobs)
{
    int64_t t = 0;
    for (int j = 0; j < n_jobs; j++)
        if (jobs[j].n > 0)
            t += (jobs[j].out + TILE_ROWS - 1) / TILE_ROWS;
    return t;
}

static tile_pos tile_at(const kc_job *jobs, int n_jobs, int64_t t)
{
    for (int j = 0; j < n_jobs; j++) {
        if (jobs[j].n <= 0)
            continue;
        int64_t n = (jobs[j].out + TILE_ROWS - 1) / TILE_ROWS;
        if (t < n)
            return (tile_pos){j, t * TILE_ROWS};
        t -= n;
    }
    return (tile_pos){n_jobs, 0};
}

static void next_tile(const kc_job *jobs, int n_jobs, tile_pos *p)
{
    p->r0 += TILE_ROWS;
    if (p->r0 < jobs[p->job].out)
        return;
    p->r0 = 0;
    for (p->job++; p->job < n_jobs && jobs[p->job].n <= 0; p->job++)
        ;
}

static inline int64_t tile_end(const kc_job *jb, int64_t r0)
{
    return r0 + TILE_ROWS < jb->out ? r0 + TILE_ROWS : jb->out;
}

/* The x rows the jobs read: 0..x_rows(). */
static int64_t x_rows(const kc_job *jobs, int n_jobs)
{
    int64_t s = 0;
    for (int j = 0; j < n_jobs; j++)
        for (int64_t c = 0; c < jobs[j].n; c++) {
            int64_t r = col_x(&jobs[j], c) + 1;
            s = r > s ? r : s;
        }
    return s;
}

typedef void (*q4_tile_fn)(const kc_job *, int64_t, int64_t, int64_t, const xgroup *, float *, int64_t);

/* nb 1, 2, 4: 8/nb rows share an 8-block group (q4_tile_packed) */
static inline int packs_rows(int64_t nb) { return nb == 1 || nb == 2 || nb == 4; }

/* The xgroups of rows 0..S of qx/dx (and their tiled copies after them, where packs_rows). */
static void prep_rows(const int8_t *qx, const float *dx, int64_t nb, int64_t s0, int64_t s1, int64_t S,
                      xgroup *xp)
{
    int64_t ng = (nb + 7) / 8;
    for (int64_t s = s0; s < s1; s++) {
        prep_x(qx, dx, nb, s, xp + s * ng);
        if (packs_rows(nb))
            prep_x_tiled(qx, dx, nb, s, xp + S * ng + s);
    }
}

static size_t xgroups_bytes(int64_t S, int64_t nb)
{
    return (size_t)(S * ((nb + 7) / 8 + 1) > 0 ? S * ((nb + 7) / 8 + 1) : 1) * sizeof(xgroup);
}

/* Tiles t0..t1 of the jobs; xp as prep_rows left it (SIMD levels) or qx/dx themselves (scalar). */
static void q4_tiles(const kc_job *jobs, int n_jobs, int64_t nb, const int8_t *qx, const float *dx,
                     const xgroup *xp, int64_t S, int64_t t0, int64_t t1, float *y, int64_t y_ld, int level)
{
    tile_pos p = tile_at(jobs, n_jobs, t0);
#ifdef KC_X86
    if (level > 0) {
        q4_tile_fn fn = q4_tile_avx2, packed_fn = q4_packed_avx2;
        if (level == 2) {
            fn = kc_avxvnni() ? q4_tile_vnniavx : q4_tile_vnni512;
            packed_fn = kc_avxvnni() ? q4_packed_vnniavx : q4_packed_vnni512;
        } else if (level >= 3) {
            fn = q4_tile_avx512;
            packed_fn = q4_packed_avx512;
        }
        const int64_t per = packs_rows(nb) ? 8 / nb : 1;
        const xgroup *xt = xp + S * ((nb + 7) / 8);
        for (int64_t t = t0; t < t1; t++, next_tile(jobs, n_jobs, &p)) {
            const kc_job *jb = jobs + p.job;
            int64_t r1 = tile_end(jb, p.r0), whole = p.r0;
            if (per > 1) {  /* packed rows end at whole; the rest row by row */
                whole += (r1 - p.r0) / per * per;
                if (whole > p.r0)
                    packed_fn(jb, p.r0, whole, nb, xt, y, y_ld);
            }
            if (whole < r1)
                fn(jb, whole, r1, nb, xp, y, y_ld);
        }
        return;
    }
#endif
    (void)xp, (void)S, (void)level;
    for (int64_t t = t0; t < t1; t++, next_tile(jobs, n_jobs, &p))
        q4_tile_scalar(jobs + p.job, p.r0, tile_end(jobs + p.job, p.r0), nb, qx, dx, y, y_ld);
}

/* One GEMV as a team op: chunk c is tiles [c*n/chunks, (c+1)*n/chunks) (contiguous: each chunk streams
 * its own stretch of the matrices); a worker's join quantizes x (or takes qx/dx as given) and lays out
 * its x groups in its workspace. */
typedef struct {
    const kc_job *jobs;
    int n_jobs, level;
    int64_t nb, S, n_tiles, chunks, y_ld, inp;
    const float *x;          /* f32 input to quantize, or NULL: */
    const int8_t *qx;        /* ... the q8_0 input as given */
    const float *dx;
    float *y;
    kc_ws *ws;
    const kc_after *after;
} gemv_op;

/* the chunk's rows of job 0, for op->after */
static void after_chunk(const gemv_op *op, int64_t c)
{
    if (!op->after)
        return;
    int64_t t0 = op->n_tiles * c / op->chunks, t1 = op->n_tiles * (c + 1) / op->chunks, out = op->jobs[0].out;
    op->after->fn(op->after->ctx, c, op->chunks, t0 * TILE_ROWS, t1 * TILE_ROWS < out ? t1 * TILE_ROWS : out);
}

static void q4_join(void *ctx, int64_t chunk, int worker)
{
    gemv_op *op = ctx;
    kc_ws *ws = &op->ws[worker];
    (void)chunk;
    const int8_t *qx = op->qx;
    const float *dx = op->dx;
    if (op->x) {
        kc_quant_q8_0(op->x, op->S, op->nb * QK, ws->qx, ws->dx);
        qx = ws->qx;
        dx = ws->dx;
    }
    if (op->level > 0)
        prep_rows(qx, dx, op->nb, 0, op->S, op->S, ws->xp);
}

static void q4_chunk(void *ctx, int64_t c, int worker)
{
    gemv_op *op = ctx;
    kc_ws *ws = &op->ws[worker];
    q4_tiles(op->jobs, op->n_jobs, op->nb, op->x ? ws->qx : op->qx, op->x ? ws->dx : op->dx, ws->xp, op->S,
             op->n_tiles * c / op->chunks, op->n_tiles * (c + 1) / op->chunks, op->y, op->y_ld, op->level);
    after_chunk(op, c);
}

/* A block dot, and 32 f32 products, take about a nanosecond (AVX2) */
static double gemv_ns(const kc_job *jobs, int n_jobs, int64_t blocks_per_row)
{
    double n = 0;
    for (int j = 0; j < n_jobs; j++)
        n += (double)jobs[j].out * (double)jobs[j].n * (double)blocks_per_row;
    return n;
}

static void run_q4(int team, const kc_job *jobs, int n_jobs, int64_t nb, const float *x, const int8_t *qx,
                   const float *dx, float *y, int64_t y_ld, kc_ws *ws, const kc_after *after)
{
    int64_t n_tiles = count_tiles(jobs, n_jobs);
    gemv_op op = {jobs, n_jobs, kc_gemv_simd(-1), nb, x_rows(jobs, n_jobs), n_tiles,
                  kc_team_chunks(team, gemv_ns(jobs, n_jobs, nb), n_tiles), y_ld, nb * QK, x, qx, dx, y, ws, after};
    kc_team_run(team, q4_chunk, q4_join, &op, op.chunks);
}

void kc_team_gemv_q4(int team, const kc_job *jobs, int n_jobs, int64_t nb, const float *x, float *y, int64_t y_ld,
                     kc_ws *ws, const kc_after *after)
{
    run_q4(team, jobs, n_jobs, nb, x, NULL, NULL, y, y_ld, ws, after);
}

void kc_gemv_q4(const kc_job *jobs, int n_jobs, int64_t nb, const int8_t *qx, const float *dx,
                float *y, int64_t y_ld, int threads)
{
    int team = kc_team_begin(threads), ok = 0;
    int64_t S = x_rows(jobs, n_jobs);
    kc_ws ws[team];
    while (ok < team && kc_ws_init(&ws[ok], S, nb * QK) == 0)
        ok++;
    if (ok == team)
        run_q4(team, jobs, n_jobs, nb, NULL, qx, dx, y, y_ld, ws, NULL);
    for (int i = 0; i < team && i <= ok; i++)  /* ws[ok], when it failed, holds what it got */
        kc_ws_free(&ws[i]);
    kc_team_end(team);
    if (ok < team)
        abort();  /* the workspace of a GEMV call: a few KB per x row */
}

int kc_ws_init(kc_ws *ws, int64_t rows, int64_t inp)
{
    int64_t nb = (inp + QK - 1) / QK;
    ws->qx = malloc((size_t)(rows * nb * QK > 0 ? rows * nb * QK : 1));
    ws->dx = malloc((size_t)(rows * nb > 0 ? rows * nb : 1) * sizeof(float));
    /* the widest row's groups, packed or not: nb + 8 covers (nb + 7) / 8 + 1 for every nb */
    ws->xp = aligned_alloc(64, xgroups_bytes(rows, nb + 8));
    return ws->qx && ws->dx && ws->xp ? 0 : -1;
}

void kc_ws_free(kc_ws *ws)
{
    free(ws->qx);
    free(ws->dx);
    free(ws->xp);
}

static void f32_tiles(const kc_job *jobs, int n_jobs, int64_t inp, const float *x, int64_t t0, int64_t t1,
                      float *y, int64_t y_ld, int level)
{
    tile_pos p = tile_at(jobs, n_jobs, t0);
    for (int64_t t = t0; t < t1; t++, next_tile(jobs, n_jobs, &p)) {
        const kc_job *jb = jobs + p.job;
#ifdef KC_X86
        if (level > 0) {
            f32_tile_avx2(jb, p.r0, tile_end(jb, p.r0), inp, x, y, y_ld);
            continue;
        }
#endif
        f32_tile_scalar(jb, p.r0, tile_end(jb, p.r0), inp, x, y, y_ld);
    }
    (void)level;
}

static void f32_chunk(void *ctx, int64_t c, int worker)
{
    gemv_op *op = ctx;
    (void)worker;
    f32_tiles(op->jobs, op->n_jobs, op->inp, op->x, op->n_tiles * c / op->chunks, op->n_tiles * (c + 1) / op->chunks,
              op->y, op->y_ld, op->level);
    after_chunk(op, c);
}

void kc_team_gemv_f32(int team, const kc_job *jobs, int n_jobs, int64_t inp, const float *x, float *y, int64_t y_ld,
                      const kc_after *after)
{
    int64_t n_tiles = count_tiles(jobs, n_jobs);
    gemv_op op = {jobs, n_jobs, kc_gemv_simd(-1), 0, 0, n_tiles,
                  kc_team_chunks(team, gemv_ns(jobs, n_jobs, (inp + QK - 1) / QK), n_tiles), y_ld, inp, x, NULL, NULL,
                  y, NULL, after};
    kc_team_run(team, f32_chunk, NULL, &op, op.chunks);
}

void kc_gemv_f32(const kc_job *jobs, int n_jobs, int64_t inp, const float *x, float *y, int64_t y_ld,
                 int threads)
{
    int team = kc_team_begin(threads);
    kc_team_gemv_f32(team, jobs, n_jobs, inp, x, y, y_ld, NULL);
    kc_team_end(team);
}
