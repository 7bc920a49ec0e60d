/* f16 conversions and the q8 activation / row quantizers of model/quant.py (docs/numerics.md,
 * "Quantization"), bit for bit.
 *
 * The quantizers' inputs are finite: NaN and inf are outside the contract (casting x*id = inf/NaN
 * to int8 is undefined in both languages), so they do not try to agree there. The f16 conversions agree with numpy on
 * every input, NaN payloads included.
 *
 * The f16 conversions are integer-only, so they do not depend on the MXCSR (a library built with
 * -ffast-math elsewhere in the process may have set FTZ/DAZ, which would flush a float-trick
 * conversion of subnormals).
 */
#include <math.h>
#include <string.h>

#include "cref.h"

static inline __attribute__((always_inline)) uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline __attribute__((always_inline)) float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float kc_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f)  /* inf / NaN: the payload moves up as numpy's (and F16C's) does */
        return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return bits_f32(sign);
        /* subnormal half: normalise (every f16 subnormal is a normal f32) */
        exp = 113;  /* 127 - 14 */
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        return bits_f32(sign | (exp << 23) | ((man & 0x3ffu) << 13));
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t kc_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) {  /* NaN: the top payload bits, kept a NaN, as numpy does */
        uint16_t r = 0x7c00u | (uint16_t)((x >> 13) & 0x3ffu);
        return sign | (r == 0x7c00u ? 0x7c01u : r);
    }
    if (x >= 0x477ff000u)  /* >= 65520 (halfway between 65504 and 2^16, ties to even): inf */
        return sign | 0x7c00u;
    if (x < 0x38800000u) {  /* below 2^-14: an f16 subnormal (or zero) */
        if (x <= 0x33000000u)  /* <= 2^-25, half the smallest subnormal: ties to even give 0 */
            return sign;
        uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e;  /* m * 2^(e-150) in units of 2^-24; 14..24 here */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        r += rem > half || (rem == half && (r & 1));  /* may carry into the smallest normal: right */
        return sign | (uint16_t)r;
    }
    /* normal: rebias, round the 13 dropped bits to nearest even; a carry out of the mantissa
     * bumps the exponent, which is the right result (up to 0x7bff + 1 = inf, excluded above) */
    uint32_t r = x - 0x38000000u;  /* exponent 127-bias -> 15-bias */
    r += 0xfffu + ((r >> 13) & 1);
    return sign | (uint16_t)(r >> 13);
}

/* d = amax/127, id = 1/d or 0 where that is not finite (quant.py _inverse) */
static inline __attribute__((always_inline)) float inverse(float d)
{
    float id = 1.0f / d;
    return isfinite(id) ? id : 0.0f;
}

/* max |x|: for finite floats the order of |x| is the order of their bit patterns with the sign
 * cleared, so the maximum is an integer maximum, which vectorizes (a float max with NaN semantics
 * does not) */
static inline __attribute__((always_inline)) float amax(const float *x, int64_t n)
{
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = f32_bits(x[i]) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return bits_f32(m);
}

/* roundf(v): half away from zero, quant.py's _roundf, for the |v| <= ~127 that the quantizers make
 * (|x| <= amax, so |x*id| rounds to at most 127 and a little). Written out rather than calling libm's
 * roundf so the loops below vectorize: the truncation is exact below 2^31, v - trunc(v) is exact below
 * 2^23, and the fraction decides the step away from zero exactly as roundf does. */
static inline __attribute__((always_inline)) int32_t round_away(float v)
{
    int32_t i = (int32_t)v;
    float f = v - (float)i;
    return i + (f >= 0.5f) - (f <= -0.5f);
}

static inline __attribute__((always_inline)) void quant_q8_0(const float *x, int64_t rows, int64_t n, int8_t *q,
                                                             float *d)
{
    int64_t nb = n / 32;
    for (int64_t b = 0; b < rows * nb; b++) {
        const float *xb = x + b * 32;
        float db = amax(xb, 32) / 127.0f, id = inverse(db);
        for (int k = 0; k < 32; k++)
            q[b * 32 + k] = (int8_t)round_away(xb[k] * id);
        d[b] = kc_f16_to_f32(kc_f32_to_f16(db));
    }
}

static inline __attribute__((always_inline)) void quant_rows_q8(const float *x, int64_t rows, int64_t n, int8_t *q,
                                                                float *d)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float dr = amax(xr, n) / 127.0f, id = inverse(dr);
        for (int64_t k = 0; k < n; k++) {
            int32_t v = round_away(xr[k] * id);
            q[r * n + k] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        }
        d[r] = dr;
    }
}

/* Each built twice, the second for AVX2 (KC_V3): the same operations, eight lanes at a time. */
static void quant_q8_0_base(const float *x, int64_t rows, int64_t n, int8_t *q, float *d)
{
    quant_q8_0(x, rows, n, q, d);
}

static KC_V3 void quant_q8_0_v3(const float *x, int64_t rows, int64_t n, int8_t *q, float *d)
{
    quant_q8_0(x, rows, n, q, d);
}

static void quant_rows_q8_base(const float *x, int64_t rows, int64_t n, int8_t *q, float *d)
{
    quant_rows_q8(x, rows, n, q, d);
}

static KC_V3 void quant_rows_q8_v3(const float *x, int64_t rows, int64_t n, int8_t *q, float *d)
{
    quant_rows_q8(x, rows, n, q, d);
}

void kc_quant_q8_0(const float *x, int64_t rows, int64_t n, int8_t *q, float *d)
{
    (kc_v3() ? quant_q8_0_v3 : quant_q8_0_base)(x, rows, n, q, d);
}

void kc_quant_rows_q8(const float *x, int64_t rows, int64_t n, int8_t *q, float *d)
{
    (kc_v3() ? quant_rows_q8_v3 : quant_rows_q8_base)(x, rows, n, q, d);
}
