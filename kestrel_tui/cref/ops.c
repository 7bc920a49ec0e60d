/* Norms, RoPE, attention, routing and the MoE combine: backends/ops_exact.py, bit for bit.
 * Step numbers refer to "The layer" in docs/numerics.md; the sums are its "Ordered reductions". */
#include <math.h>
#include <stddef.h>

#include "cref.h"

/* Contract step 1. sqrtf then a divide, never an rsqrt: a reciprocal square root
 * instruction rounds differently in about a third of the cases. */
static void normalize_row(const float *x, float ss, const float *w, int64_t n, float eps, float *out) {
    const float rms = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++)
        out[i] = (x[i] * rms) * w[i];
}

/* Step 1 with the block-8 sum of squares. */
void kc_rmsnorm(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out) {
    const int64_t n8 = n & ~(int64_t)7;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float ss = 0.0f;
        for (int64_t b = 0; b < n8; b += 8) {
            float lo[4];
            for (int k = 0; k < 4; k++)
                lo[k] = xr[b + k] * xr[b + k] + xr[b + 4 + k] * xr[b + 4 + k];
            ss = ss + ((lo[0] + lo[1]) + (lo[2] + lo[3]));
        }
        for (int64_t j = n8; j < n; j++)
            ss = ss + xr[j] * xr[j];
        normalize_row(xr, ss, w, n, eps, out + r * n);
    }
}

/* Step 3: one row per head, the sequential sum. */
void kc_qknorm(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float ss = 0.0f;
        for (int64_t j = 0; j < n; j++)
            ss = ss + xr[j] * xr[j];
        normalize_row(xr, ss, w, n, eps, out + r * n);
    }
}

/* Step 4's table. The angles go through a small local buffer so that kc_sincosf never
 * sees its input aliased with an output. */
void kc_rope_cos_sin(const int64_t *pos, int64_t M, const float *inv_freq, int64_t half, float *cos,
                     float *sin) {
    enum { CHUNK = 256 };
    float ang[CHUNK];
    for (int64_t m = 0; m < M; m++) {
        const float t = (float)pos[m];
        for (int64_t i0 = 0; i0 < half; i0 += CHUNK) {
            const int64_t cnt = half - i0 < CHUNK ? half - i0 : CHUNK;
            for (int64_t i = 0; i < cnt; i++)
                ang[i] = t * inv_freq[i0 + i];
            kc_sincosf(ang, cos + m * half + i0, sin + m * half + i0, cnt);
        }
    }
}

/* Step 4's rotation. Both inputs of a pair are read before either output is written,
 * which is what lets out alias x. */
void kc_rope(const float *x, int64_t M, int64_t heads, int64_t hd, const float *cos, const float *sin,
             float *out) {
    const int64_t half = hd / 2;
    for (int64_t m = 0; m < M; m++) {
        const float *c = cos + m * half, *s = sin + m * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + (m * heads + h) * hd;
            float *o = out + (m * heads + h) * hd;
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i], b = xr[i + half];
                o[i] = a * c[i] - b * s[i];
                o[i + half] = b * c[i] + a * s[i];
            }
        }
    }
}

/* The f32 QK dot: the lane sum over head_dim. Lanes past the end stay +0, as on a warp. */
static inline __attribute__((always_inline)) float lane_dot(const float *a, const float *b, int64_t n) {
    float v[32];
    for (int i = 0; i < 32; i++)
        v[i] = 0.0f;
    int64_t j0 = 0;
    for (; j0 + 32 <= n; j0 += 32)
        for (int i = 0; i < 32; i++)
            v[i] = v[i] + a[j0 + i] * b[j0 + i];
    for (int i = 0; j0 + i < n; i++)
        v[i] = v[i] + a[j0 + i] * b[j0 + i];
    for (int off = 16; off > 0; off >>= 1)
        for (int i = 0; i < off; i++)
            v[i] = v[i] + v[i + off];
    return v[0];
}

enum { SPAN = 64 };  /* positions scored, then exponentiated, then accumulated at a time */

/* The q8 score's integer dot and the q8 value row's accumulation (step 6), for any x86-64 ... */
static inline __attribute__((always_inline)) int32_t dot_i8(const int8_t *a, const int8_t *b, int64_t n) {
    int32_t isum = 0; /* exact in int32: any order */
    for (int64_t j = 0; j < n; j++)
        isum += (int32_t)a[j] * (int32_t)b[j];
    return isum;
}

static inline __attribute__((always_inline)) void acc_q8(float *acc, const int8_t *vr, float d, float c, float w,
                                                         int64_t n) {
    for (int64_t j = 0; j < n; j++)
        acc[j] = acc[j] * c + w * ((float)vr[j] * d);
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
/* ... and for AVX2: the dot 32 products at a time as |a| * (b with a's sign), summed in int16 pairs
 * (each at most 2 * 127 * 127: the KV rows and the query are clamped to +-127, Q3/Q4) and in int32,
 * exact; the accumulation eight lanes at a time, the same four roundings per element. */
static inline __attribute__((always_inline, target("avx2"))) int32_t dot_i8_avx2(const int8_t *a, const int8_t *b,
                                                                               int64_t n) {
    __m256i s = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(a + j)), y = _mm256_loadu_si256((const __m256i *)(b + j));
        __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h) + dot_i8(a + j, b + j, n - j);
}

static inline __attribute__((always_inline, target("avx2"))) void acc_q8_avx2(float *acc, const int8_t *vr, float d,
                                                                            float c, float w, int64_t n) {
    const __m256 vd = _mm256_set1_ps(d), vc = _mm256_set1_ps(c), vw = _mm256_set1_ps(w);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(vr + j))));
        __m256 t = _mm256_mul_ps(vw, _mm256_mul_ps(v, vd));
        _mm256_storeu_ps(acc + j, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(acc + j), vc), t));
    }
    acc_q8(acc + j, vr + j, d, c, w, n - j);
}
#else
#define dot_i8_avx2 dot_i8
#define acc_q8_avx2 acc_q8
#endif

/* Step 6 for one (column, query head), evaluated exactly as written there, position by position; only
 * the work is batched: a span of positions' scores first (each one step 6's formula), then their
 * running maxima and the two expf arguments of each position, one kc_expf call for all of them, then
 * the recurrence. l is the value column of an all-ones row in the numpy reference, so l*c + w*1, and
 * w*1 == w. qq [hd] and acc [hd]: the caller's scratch. Defined once per pair of DOT/ACC kernels (a
 * function with a target attribute cannot be inlined into one without). */
#define DEFINE_ATTEND_BODY(NAME, DOT, ACC, ...)                                                              \
static inline __attribute__((always_inline, ##__VA_ARGS__)) void NAME(                                       \
        const float *qh, int64_t hd, const void *k, const float *ks, const void *v, const float *vs, int kv_q8, \
        int64_t kv, int64_t nkv, int64_t last, float scale, float *o, int8_t *qq, float *acc) {               \
    float dq = 0.0f, s[SPAN], arg[2 * SPAN], e[2 * SPAN];                                                      \
    if (kv_q8)                                                                                                 \
        kc_quant_rows_q8(qh, 1, hd, qq, &dq); /* query q8: per head, as the KV rows */                         \
    for (int64_t j = 0; j < hd; j++)                                                                           \
        acc[j] = 0.0f;                                                                                         \
    float mx = -INFINITY, l = 0.0f;                                                                            \
    for (int64_t p0 = 0; p0 <= last; p0 += SPAN) {                                                             \
        const int n = (int)(last + 1 - p0 < SPAN ? last + 1 - p0 : SPAN);                                      \
        for (int i = 0; i < n; i++) {                                                                          \
            const int64_t p = p0 + i, row = (p * nkv + kv) * hd;                                               \
            if (kv_q8) {                                                                                       \
                const int32_t isum = DOT(qq, (const int8_t *)k + row, hd);                                     \
                s[i] = ((float)isum * (dq * ks[p * nkv + kv])) * scale;                                        \
            } else {                                                                                           \
                s[i] = lane_dot(qh, (const float *)k + row, hd) * scale;                                       \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < n; i++) {                                                                          \
            /* np.maximum's choice: NaN propagates, and on equality the second operand wins                    \
             * (only the sign of a zero could tell, and expf(+-0) == 1 either way). */                         \
            const float mn = (mx > s[i] || mx != mx) ? mx : s[i];                                              \
            arg[2 * i] = mx - mn;       /* c = expf(m - m') */                                                 \
            arg[2 * i + 1] = s[i] - mn; /* w = expf(s_p - m') */                                               \
            mx = mn;                                                                                           \
        }                                                                                                      \
        kc_expf(arg, e, 2 * n);                                                                                \
        for (int i = 0; i < n; i++) {                                                                          \
            const int64_t p = p0 + i, row = (p * nkv + kv) * hd;                                               \
            const float c = e[2 * i], w = e[2 * i + 1];                                                        \
            l = l * c + w;                                                                                     \
            if (kv_q8) {                                                                                       \
                ACC(acc, (const int8_t *)v + row, vs[p * nkv + kv], c, w, hd);                                 \
            } else {                                                                                           \
                const float *vr = (const float *)v + row;                                                      \
                for (int64_t j = 0; j < hd; j++)                                                               \
                    acc[j] = acc[j] * c + w * vr[j];                                                           \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    for (int64_t j = 0; j < hd; j++)                                                                           \
        o[j] = acc[j] / l;                                                                                     \
}

DEFINE_ATTEND_BODY(attend_head_body, dot_i8, acc_q8)
DEFINE_ATTEND_BODY(attend_head_body_avx2, dot_i8_avx2, acc_q8_avx2, target("avx2"))

static void attend_head_base(const float *qh, int64_t hd, const void *k, const float *ks, const void *v,
                             const float *vs, int kv_q8, int64_t kv, int64_t nkv, int64_t last, float scale,
                             float *o) {
    int8_t qq[hd];
    float acc[hd];
    attend_head_body(qh, hd, k, ks, v, vs, kv_q8, kv, nkv, last, scale, o, qq, acc);
}

static KC_V3 void attend_head_v3(const float *qh, int64_t hd, const void *k, const float *ks, const void *v,
                                 const float *vs, int kv_q8, int64_t kv, int64_t nkv, int64_t last, float scale,
                                 float *o) {
    int8_t qq[hd];
    float acc[hd];
    attend_head_body_avx2(qh, hd, k, ks, v, vs, kv_q8, kv, nkv, last, scale, o, qq, acc);
}

/* Step 6 as a team op: chunks of (column, head) pairs. Each pair's recurrence is serial and independent
 * of the others, so any thread count gives the same bits. */
typedef struct {
    const float *q, *ks, *vs;
    const void *k, *v;
    int64_t M, nh, nkv, hd, chunks;
    int kv_q8;
    const int64_t *pos;
    float scale;
    float *out;
} attention_op;

static void attention_chunk(void *ctx, int64_t c, int worker) {
    const attention_op *a = ctx;
    (void)worker;
    const int64_t g = a->nh / a->nkv, n = a->M * a->nh;
    void (*head)(const float *, int64_t, const void *, const float *, const void *, const float *, int, int64_t,
                 int64_t, int64_t, float, float *) = kc_v3() ? attend_head_v3 : attend_head_base;
    for (int64_t mh = n * c / a->chunks; mh < n * (c + 1) / a->chunks; mh++) {
        const int64_t m = mh / a->nh, h = mh % a->nh;
        head(a->q + mh * a->hd, a->hd, a->k, a->ks, a->v, a->vs, a->kv_q8, h / g, a->nkv, a->pos[m], a->scale,
             a->out + mh * a->hd);
    }
}

void kc_team_attention(int team, const float *q, int64_t M, int64_t nh, int64_t nkv, int64_t hd, const void *k,
                       const float *ks, const void *v, const float *vs, int kv_q8, const int64_t *pos, float scale,
                       float *out) {
    double ns = 0;  /* a position of a head: its dot, two expf and the hd accumulations, ~(hd + 64) / 8 ns */
    for (int64_t m = 0; m < M; m++)
        ns += (double)(pos[m] + 1) * (double)nh * (double)(hd + 64) / 8;
    attention_op a = {q, ks, vs, k, v, M, nh, nkv, hd, kc_team_chunks(team, ns, M * nh), kv_q8, pos, scale, out};
    kc_team_run(team, attention_chunk, NULL, &a, a.chunks);
}

void kc_attention(const float *q, int64_t M, int64_t nh, int64_t nkv, int64_t hd, const void *k, const float *ks,
                  const void *v, const float *vs, int kv_q8, const int64_t *pos, float scale, float *out,
                  int threads) {
    int team = kc_team_begin(threads);
    kc_team_attention(team, q, M, nh, nkv, hd, k, ks, v, vs, kv_q8, pos, scale, out);
    kc_team_end(team);
}

/* Rank order of step 8's top-k: higher p first; a NaN ranks below every number, as in
 * numpy's argsort(-p). Equal values are never "before" each other, so the insertion below
 * keeps the lower expert index first (a stable sort). */
static int before(float a, float b) {
    return a > b || (b != b && a == a);
}

/* Step 8's router: softmax in expert order, top-k, optional renormalisation. */
void kc_route(const float *logits, int64_t M, int64_t E, int64_t k, int norm_topk, int64_t *idx, float *w) {
    float p[E];
    for (int64_t m = 0; m < M; m++) {
        const float *lr = logits + m * E;
        float mx = lr[0];
        for (int64_t i = 1; i < E; i++)
            if (mx == mx && !(lr[i] <= mx)) /* a NaN sticks, as in np.max */
                mx = lr[i];
        for (int64_t i = 0; i < E; i++)
            p[i] = lr[i] - mx;
        kc_expf(p, p, E);  /* in place: element by element */
        float S = 0.0f;
        for (int64_t i = 0; i < E; i++)
            S = S + p[i];
        for (int64_t i = 0; i < E; i++)
            p[i] = p[i] / S;

        int64_t *id = idx + m * k;
        int64_t cnt = 0;
        for (int64_t i = 0; i < E; i++) {
            if (cnt == k && !before(p[i], p[id[k - 1]]))
                continue;
            int64_t r = cnt < k ? cnt++ : k - 1;
            for (; r > 0 && before(p[i], p[id[r - 1]]); r--)
                id[r] = id[r - 1];
            id[r] = i;
        }

        float *wr = w + m * k;
        for (int64_t r = 0; r < k; r++)
            wr[r] = p[id[r]];
        if (norm_topk) {
            float s = 0.0f;
            for (int64_t r = 0; r < k; r++)
                s = s + wr[r];
            for (int64_t r = 0; r < k; r++)
                wr[r] = wr[r] / s;
        }
    }
}

/* Step 8's combine, in rank order from +0. */
void kc_combine(const float *y, const float *w, int64_t M, int64_t k, int64_t n, float *out) {
    for (int64_t m = 0; m < M; m++) {
        float *o = out + m * n;
        for (int64_t i = 0; i < n; i++)
            o[i] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const float wj = w[m * k + j];
            const float *yj = y + (m * k + j) * n;
            for (int64_t i = 0; i < n; i++)
                o[i] = o[i] + wj * yj[i];
        }
    }
}
