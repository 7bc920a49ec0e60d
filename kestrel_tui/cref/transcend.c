/* The UCRT replicas of numerics/transcend.py in C: expf, cosf, sinf, sincosf, silu.
 *
 * docs/numerics.md "Transcendentals" is the contract, and the docstring of
 * kestrel_tui/numerics/transcend.py is the algorithm, line by line (constants, operand
 * order, branch thresholds); this file is a literal transcription of that pseudo-code.
 * Everything is binary64 with explicit `fma` (libm's, correctly rounded) where the spec
 * says fma and plain IEEE double operations elsewhere -- the build's -ffp-contract=off
 * guarantees that no a*b+c is fused behind our back -- and one final rounding to float.
 *
 * The numpy version evaluates the same algorithm differently (no branches: every cosf/sinf
 * element goes through the Cody-Waite reduction, small-|x| cases are operand overrides,
 * the FMAs are emulated); its docstring proves the two agree, and
 * tests/test_cref_transcend.py checks that this file gives the same bits.
 *
 * Constants are IEEE bit patterns, as in the Python.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cref.h"
#include "ucrt_tables.h"  /* kernels/: shared with the CUDA replica */

/* float and double operations must round to their own precision (no x87 excess precision).
 * 16 is what AVX512-FP16 targets report: only _Float16 differs from 0 there. */
#if !defined(FLT_EVAL_METHOD) || (FLT_EVAL_METHOD != 0 && FLT_EVAL_METHOD != 16)
#error "transcend.c needs FLT_EVAL_METHOD 0: float and double evaluated in their own precision"
#endif

/* A binary64 constant written as its bit pattern: `static const b64 K = {.u = 0x...}`, used as K.d. */
typedef union {
    uint64_t u;
    double d;
} b64;

static inline double d_of(uint64_t u) {
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ------------------------------------------------------------------------------------ expf */

static const b64 EXP_K = {.u = 0x40571547652B82FEull};   /* 64/ln2 */
static const b64 EXP_C2 = {.u = 0x3F862E42FEFA39EFull};  /* ln2/64 */
static const b64 EXP_C0 = {.u = 0x3FC5555555555555ull};  /* 1/6 */
static const b64 EXP_C1 = {.u = 0x3FE0000000000000ull};  /* 1/2 */
#define EXP_X_MAX_BITS 0x42B17218u                       /* 88.7228394f: above it +inf */
#define EXP_X_MIN (-104.0f)                              /* below it +0 */

/* T[j] = 2^(j/64) correctly rounded to binary64: the table the CUDA replica uses too. */
static const uint64_t EXP_T[64] = UCRT_EXPF_T_BITS;

/* The binary64 that expf rounds to float (the whole routine but the last conversion). */
static inline __attribute__((always_inline)) double expf_ucrt_d(float xf) {
    /* The UCRT's two early returns. (The numpy version clamps to [-104, 88.7228394f]
     * instead; the algorithm itself already gives +inf / +0 at the clamp values.)
     * T1: a NaN comes out as it went in, quieted (sign and payload kept): through the
     * arithmetic it would come out with the sign of whichever operand x86 picks. */
    if (xf != xf) /* quieted by its bits: a compiler may drop a float -> double -> float round trip */
        return (double)f_of(bits_of(xf) | 0x00400000u);
    if (xf > f_of(EXP_X_MAX_BITS)) return INFINITY; /* (float)exp(x) overflows */
    if (xf < EXP_X_MIN) return 0.0;
    const double x = (double)xf;
    const double dn = nearbyint(x * EXP_K.d); /* rint, ties to even (default rounding mode) */
    const int64_t n = (int64_t)dn;           /* |n| <= 9603 */
    const int64_t j = n & 63;
    const int64_t m = n >> 6;                /* arithmetic shift: floor(n / 64), in [-151, 127] */
    const double r = fma(-dn, EXP_C2.d, x);
    const double z = r * r;
    const double p = fma(fma(r, EXP_C0.d, EXP_C1.d), z, r);
    const double T = d_of(EXP_T[j]);
    const double q = fma(T, p, T);
    /* 2^m is a normal binary64 for every m here, so the scaling is exact and the
     * conversion to float is the only rounding after the last fma. */
    const double two_m = d_of((uint64_t)(m + 1023) << 52);
    return two_m * q;
}

static inline __attribute__((always_inline)) float expf_ucrt(float x) { return (float)expf_ucrt_d(x); }

/* ----------------------------------------------------------------------------- cosf / sinf */

static const b64 INV_PIO2 = {.u = 0x3FE45F306DC9C883ull}; /* 2/pi */
static const b64 PIO2_HI = {.u = 0x3FF921FB54400000ull};  /* pi/2, leading 31 bits */
static const b64 PIO2_LO = {.u = 0x3DD0B4611A626331ull};  /* pi/2 - PIO2_HI */
/* __Lcosfarray c1..c4 (A) and __Lsinfarray s1..s4 (B) */
static const b64 A3 = {.u = 0x3FA5555555555555ull}; /* 1/24 */
static const b64 A5 = {.u = 0xBF56C16C16C16C16ull}; /* -1/720 (UCRT's rounding, not RN) */
static const b64 A7 = {.u = 0x3EFA01A01A01A019ull}; /* 1/40320 (UCRT's rounding, not RN) */
static const b64 A9 = {.u = 0xBE927E4FB7789F5Cull}; /* -1/3628800 */
static const b64 B3 = {.u = 0xBFC5555555555555ull}; /* -1/6 */
static const b64 B5 = {.u = 0x3F81111111111111ull}; /* 1/120 */
static const b64 B7 = {.u = 0xBF2A01A01A01A01Aull}; /* -1/5040 */
static const b64 B9 = {.u = 0x3EC71DE3A556C734ull}; /* 1/362880 */
static const b64 ONE_SIXTH = {.u = 0x3FC5555555555555ull}; /* 1/6 = -B3 */

#define AU_INF 0x7F800000u      /* inf/nan */
#define AU_PIO4 0x3F490FDBu     /* |x| <= pi/4: direct polynomial */
#define AU_TINY 0x39000000u     /* 2^-13 */
#define AU_SMALL 0x3C000000u    /* 2^-7 */
#define AU_HUGE_COS 0x4F490FDBu /* ~3.37e9: Payne-Hanek in the UCRT, not replicated */
#define AU_HUGE_SIN 0x4B800456u /* 16779436: likewise */

/* C(x) with z = x*x. Operand order as the UCRT: fma(z, p, A) is z*p + A. */
static inline __attribute__((always_inline)) double poly_c(double z) {
    double p = fma(z, A9.d, A7.d);
    p = fma(z, p, A5.d);
    p = fma(z, p, A3.d);
    return fma(p, z * z, 1.0 - 0.5 * z);
}

/* S(x) with z = x*x. */
static inline __attribute__((always_inline)) double poly_s(double x, double z) {
    double p = fma(z, B9.d, B7.d);
    p = fma(z, p, B5.d);
    p = fma(z, p, B3.d);
    return fma(p, x * z, x);
}

/* Cody-Waite for ax = |x| < the huge thresholds: returns r, sets *n (0 <= n < 2^31). */
static inline __attribute__((always_inline)) double cw_reduce(double ax, int64_t *n) {
    const int64_t k = (int64_t)fma(ax, INV_PIO2.d, 0.5); /* conversion truncates; the fma is > 0 */
    const double dk = (double)k;
    *n = k;
    return fma(-dk, PIO2_HI.d, ax) - dk * PIO2_LO.d;
}

/* The huge-argument range (|x| >= AU_HUGE_COS for cos, AU_HUGE_SIN for sin) is outside the
 * replica: the UCRT switches to a Payne-Hanek reduction that neither reference replicates,
 * and both fall back to the binary64 library function rounded once to float -- numpy's
 * np.cos/np.sin there, libm's cos/sin here, which may differ in the last bit (RoPE angles
 * never get there). */

/* The signed binary64 that cosf rounds to float; the constant 1 for |x| < 2^-13. */
static inline __attribute__((always_inline)) double cosf_ucrt_d(float xf) {
    const uint32_t au = bits_of(xf) & 0x7FFFFFFFu;
    const double x = (double)xf;
    if (au >= AU_INF) return x - x; /* inf - inf, nan - nan: nan */
    if (au <= AU_PIO4) {
        if (au < AU_TINY) return 1.0;
        if (au < AU_SMALL) return fma(-(x * 0.5), x, 1.0);
        return poly_c(x * x);
    }
    if (au >= AU_HUGE_COS) return cos(x); /* outside the replica, see above */
    int64_t n;
    const double r = cw_reduce(fabs(x), &n);
    const double z = r * r;
    double y = (n & 1) ? poly_s(r, z) : poly_c(z);
    if ((((n & 3) + 1) >> 1) & 1) y = -y;
    return y;
}

/* The signed binary64 that sinf rounds to float; x itself for |x| < 2^-13. */
static inline __attribute__((always_inline)) double sinf_ucrt_d(float xf) {
    const uint32_t au = bits_of(xf) & 0x7FFFFFFFu;
    const double x = (double)xf;
    if (au >= AU_INF) return x - x;
    if (au <= AU_PIO4) {
        if (au < AU_TINY) return x; /* exact: keeps -0 and subnormals */
        if (au < AU_SMALL) return fma(-(x * x * x), ONE_SIXTH.d, x);
        return poly_s(x, x * x);
    }
    if (au >= AU_HUGE_SIN) return sin(x); /* outside the replica, see above */
    int64_t n;
    const double r = cw_reduce(fabs(x), &n);
    const double z = r * r;
    double y = (n & 1) ? poly_c(z) : poly_s(r, z);
    if (((n & 3) >= 2) != (xf < 0.0f)) y = -y;
    return y;
}

/* One rounding to float, at the very end. */
static inline __attribute__((always_inline)) float cosf_ucrt(float x) { return (float)cosf_ucrt_d(x); }
static inline __attribute__((always_inline)) float sinf_ucrt(float x) { return (float)sinf_ucrt_d(x); }

/* -------------------------------------------------------------------------------- the API */

float kc_expf1(float x) { return expf_ucrt(x); }

/* y[i] = fn(x[i]) for the array entry points (and the test hooks below), built twice: for any x86-64
 * and for AVX2 + FMA (KC_V3), where libm's fma and nearbyint become single instructions. Both are
 * the same IEEE operations (a fused multiply-add rounds once either way; rint in the default
 * rounding mode), so they give the same bits; kc_v3() picks one. */
#define KC_MAP(name, fn, T)                                                       \
    static void name##_base(const float *x, T *y, int64_t n) {                   \
        for (int64_t i = 0; i < n; i++) y[i] = fn(x[i]);                          \
    }                                                                             \
    static KC_V3 void name##_v3(const float *x, T *y, int64_t n) {               \
        for (int64_t i = 0; i < n; i++) y[i] = fn(x[i]);                          \
    }                                                                             \
    void name(const float *x, T *y, int64_t n) { (kc_v3() ? name##_v3 : name##_base)(x, y, n); }

KC_MAP(kc_expf, expf_ucrt, float)
KC_MAP(kc_cosf, cosf_ucrt, float)
KC_MAP(kc_sinf, sinf_ucrt, float)

/* (cosf(x), sinf(x)) by definition: the same two routines. */
static inline __attribute__((always_inline)) void sincos_body(const float *x, float *c, float *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i];
        c[i] = cosf_ucrt(v);
        s[i] = sinf_ucrt(v);
    }
}
static void sincos_base(const float *x, float *c, float *s, int64_t n) { sincos_body(x, c, s, n); }
static KC_V3 void sincos_v3(const float *x, float *c, float *s, int64_t n) { sincos_body(x, c, s, n); }
void kc_sincosf(const float *x, float *c, float *s, int64_t n) { (kc_v3() ? sincos_v3 : sincos_base)(x, c, s, n); }

/* silu(x) = x / (1 + expf(-x)): negate, replica expf, float add, IEEE float divide.
 * silu(-inf) = -inf / inf = nan, as the formula says. */
static inline __attribute__((always_inline)) float silu1(float v) { return v / (1.0f + expf_ucrt(-v)); }
KC_MAP(kc_silu, silu1, float)

/* ------------------------------------------------------------------------------ test hooks */

/* Test hooks, not in cref.h: the binary64 results before the final rounding, which
 * tests/test_cref_transcend.py compares with numpy's (_expf_double, _trig(double=True)).
 * A wrong intermediate fma almost never shows in a float32 output but always shows here. */
void kc_expf_double(const float *x, double *y, int64_t n);
void kc_cosf_double(const float *x, double *y, int64_t n);
void kc_sinf_double(const float *x, double *y, int64_t n);

KC_MAP(kc_expf_double, expf_ucrt_d, double)
KC_MAP(kc_cosf_double, cosf_ucrt_d, double)
KC_MAP(kc_sinf_double, sinf_ucrt_d, double)
