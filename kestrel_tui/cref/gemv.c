/* The GEMVs of numerics/linalg.py (docs/numerics.md, "GEMV" and "Ordered reductions"), bit for bit.
 *
 * Threads take tiles of output rows (of all jobs flattened); each output's lane sum is computed
 * whole by one thread, so the thread count moves no bit. Within a tile the columns are looped
 * inside the rows, so a weight row is read from memory once for all columns of a call.
 *
 * SIMD (kc_gemv_simd: scalar, AVX2, VNNI, AVX-512; x86 only, picked at run time so one build
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
/* Block dots (or 32 f32 products) a thread must get before a call is split: waking a thread costs
 * microseconds, a block dot under a nanosecond, and the embedded model's GEMVs are small. */
#define MIN_WORK_PER_THREAD 32768

/* The threads worth waking for `work` block dots: at most `threads`, at least 1. */
static int useful_threads(const kc_job *jobs, int n_jobs, int64_t blocks_per_row, int threads)
{
    int64_t work = 0;
    for (int j = 0; j < n_jobs; j++)
        work += jobs[j].out * jobs[j].n * blocks_per_row;
    int64_t useful = work / MIN_WORK_PER_THREAD;
    return threads < 1 || useful < 1 ? 1 : useful < threads ? (int)useful : threads;
}

/* ---------------------------------------------------------------- level selection */

static int cpu_level(void)
{
#ifdef KC_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
            && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi"))
            return 3;
        if ((__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
            || __builtin_cpu_supports("avxvnni"))
            return 2;
        return 1;
    }
#endif
    return 0;
}

static int g_max, g_level;
/* level 2's dot: AVX-VNNI where the CPU has it (so this level is what an AVX-VNNI-only CPU runs, and
 * tests on a CPU with both reach it), else AVX512-VNNI on 256-bit vectors (e.g. Cascade Lake) */
static int g_vnni_avx;

#ifdef KC_X86
static void init_perm(void);
#endif

/* At load time, so no GEMV ever races the detection. */
__attribute__((constructor)) static void init_level(void)
{
#ifdef KC_X86
    init_perm();
#endif
    g_max = g_level = cpu_level();
#ifdef KC_X86
    g_vnni_avx = __builtin_cpu_supports("avxvnni");
#endif
}

/* A switch for tests and benchmarks: not to be flipped while a GEMV runs. */
int kc_gemv_simd(int level)
{
    if (level >= 0)
        g_level = level < g_max ? level : g_max;
    return g_level;
}

/* ---------------------------------------------------------------- shared helpers */

static inline int64_t col_x(const kc_job *j, int64_t c) { return j->xrow ? j->xrow[c] : c; }
static inline int64_t col_y(const kc_job *j, int64_t c) { return j->yrow ? j->yrow[c] : c; }

static inline float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return kc_f16_to_f32(h);
}

/* Work items: (job, first row) for every TILE_ROWS rows of every job. */
typedef struct { int job; int64_t r0; } tile;

static tile *make_tiles(const kc_job *jobs, int n_jobs, int64_t *n_tiles)
{
    int64_t t = 0;
    for (int j = 0; j < n_jobs; j++)
        if (jobs[j].n > 0)
            t += (jobs[j].out + TILE_ROWS - 1) / TILE_ROWS;
    tile *tl = malloc((size_t)(t ? t : 1) * sizeof *tl);
    if (!tl)
        abort();
    t = 0;
    for (int j = 0; j < n_jobs; j++)
        if (jobs[j].n > 0)
            for (int64_t r = 0; r < jobs[j].out; r += TILE_ROWS)
                tl[t++] = (tile){j, r};
    *n_tiles = t;
    return tl;
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

static void init_perm(void)
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

/* One tile of one q4_0 job: rows r0..r1, every column; xp: prep_x of every x row (ng groups each). */
#define DEFINE_Q4_TILE(NAME, TARGET, DEC, DECODE, DOT8)                                                        \
    static __attribute__((target(TARGET))) void NAME(const kc_job *jb, int64_t r0, int64_t r1,      \
                                                     int64_t nb, const xgroup *xp, float *y,        \
                                                     int64_t y_ld)                                  \
    {                                                                                              \
        const int64_t ng = (nb + 7) / 8, full = nb / 8;                                            \
        const uint8_t *w = jb->w;                                                                  \
        __m256 acc[TILE_COLS][4];                                                                  \
        const xgroup *xc[TILE_COLS];                                                               \
        uint8_t pad[8 * BLOCK];                                                                    \
        for (int64_t c0 = 0; c0 < jb->n; c0 += TILE_COLS) {                                        \
            const int nc = (int)(jb->n - c0 < TILE_COLS ? jb->n - c0 : TILE_COLS);                 \
            for (int c = 0; c < nc; c++)                                                           \
                xc[c] = xp + col_x(jb, c0 + c) * ng;                                               \
            for (int64_t r = r0; r < r1; r++) {                                                    \
                const uint8_t *wr = w + r * nb * BLOCK;                                            \
                for (int c = 0; c < nc; c++)                                                       \
                    for (int l = 0; l < 4; l++)                                                    \
                        acc[c][l] = _mm256_setzero_ps();                                           \
                for (int64_t g = 0; g < ng; g++) {                                                 \
                    DEC d;                                                                         \
                    PREFETCH_AHEAD(wr + g * 8 * BLOCK);                                            \
                    if (g < full) {                                                                \
                        DECODE(wr + g * 8 * BLOCK, &d);                                            \
                    } else { /* the last, partial group: zero blocks (scale 0) after the row's */ \
                        memset(pad, 0, sizeof pad);                                                \
                        memcpy(pad, wr + g * 8 * BLOCK, (size_t)(nb - g * 8) * BLOCK);             \
                        DECODE(pad, &d);                                                           \
                    }                                                                              \
                    for (int c = 0; c < nc; c++) {                                                 \
                        const xgroup *xg = xc[c] + g;                                              \
                        __m256 s = _mm256_mul_ps(d.dw, _mm256_load_ps(xg->dx));                    \
                        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(DOT8(&d, xg)), s);             \
                        acc[c][g & 3] = _mm256_add_ps(acc[c][g & 3], t);                           \
                    }                                                                              \
                }                                                                                  \
                for (int c = 0; c < nc; c++)                                                       \
                    y[col_y(jb, c0 + c) * y_ld + jb->y_off + r] = butterfly8(acc[c]);              \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_Q4_TILE(q4_tile_avx2, AVX2_TARGET, dec8, decode8, dot8_avx2)
DEFINE_Q4_TILE(q4_tile_vnni512, VNNI512_TARGET, dec8, decode8, dot8_vnni512)
DEFINE_Q4_TILE(q4_tile_vnniavx, VNNIAVX_TARGET, dec8, decode8, dot8_vnniavx)
DEFINE_Q4_TILE(q4_tile_avx512, AVX512_TARGET, dec8z, decode8z, dot8z)

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

void kc_gemv_q4(const kc_job *jobs, int n_jobs, int64_t nb, const int8_t *qx, const float *dx,
                float *y, int64_t y_ld, int threads)
{
    int level = kc_gemv_simd(-1);
    int64_t n_tiles;
    tile *tl = make_tiles(jobs, n_jobs, &n_tiles);
    threads = useful_threads(jobs, n_jobs, nb, threads);
#ifdef KC_X86
    if (level > 0 && nb > 0) {
        void (*fn)(const kc_job *, int64_t, int64_t, int64_t, const xgroup *, float *, int64_t) = q4_tile_avx2;
        if (level == 2)
            fn = g_vnni_avx ? q4_tile_vnniavx : q4_tile_vnni512;
        else if (level >= 3)
            fn = q4_tile_avx512;
        int64_t S = x_rows(jobs, n_jobs), ng = (nb + 7) / 8;
        xgroup *xp = aligned_alloc(64, (size_t)(S * ng > 0 ? S * ng : 1) * sizeof(xgroup));
        if (!xp)
            abort();
        #pragma omp parallel num_threads(threads) if(threads > 1)
        {
            #pragma omp for schedule(static)
            for (int64_t s = 0; s < S; s++)
                prep_x(qx, dx, nb, s, xp + s * ng);
            #pragma omp for schedule(dynamic)
            for (int64_t t = 0; t < n_tiles; t++) {
                const kc_job *jb = jobs + tl[t].job;
                int64_t r1 = tl[t].r0 + TILE_ROWS < jb->out ? tl[t].r0 + TILE_ROWS : jb->out;
                fn(jb, tl[t].r0, r1, nb, xp, y, y_ld);
            }
        }
        free(xp);
        free(tl);
        return;
    }
#endif
    (void)level;
    #pragma omp parallel for schedule(dynamic) num_threads(threads) if(threads > 1)
    for (int64_t t = 0; t < n_tiles; t++) {
        const kc_job *jb = jobs + tl[t].job;
        int64_t r1 = tl[t].r0 + TILE_ROWS < jb->out ? tl[t].r0 + TILE_ROWS : jb->out;
        q4_tile_scalar(jb, tl[t].r0, r1, nb, qx, dx, y, y_ld);
    }
    free(tl);
}

void kc_gemv_f32(const kc_job *jobs, int n_jobs, int64_t inp, const float *x, float *y, int64_t y_ld,
                 int threads)
{
    int level = kc_gemv_simd(-1);
    int64_t n_tiles;
    tile *tl = make_tiles(jobs, n_jobs, &n_tiles);
    threads = useful_threads(jobs, n_jobs, (inp + QK - 1) / QK, threads);
    #pragma omp parallel for schedule(dynamic) num_threads(threads) if(threads > 1)
    for (int64_t t = 0; t < n_tiles; t++) {
        const kc_job *jb = jobs + tl[t].job;
        int64_t r1 = tl[t].r0 + TILE_ROWS < jb->out ? tl[t].r0 + TILE_ROWS : jb->out;
#ifdef KC_X86
        if (level > 0) {
            f32_tile_avx2(jb, tl[t].r0, r1, inp, x, y, y_ld);
            continue;
        }
#endif
        f32_tile_scalar(jb, tl[t].r0, r1, inp, x, y, y_ld);
    }
    (void)level;
    free(tl);
}
