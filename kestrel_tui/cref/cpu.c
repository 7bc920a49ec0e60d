/* The SIMD level every other unit asks for: what the CPU has, read once at load time, and the
 * switch that tests and benchmarks turn down (kc_gemv_simd). Every level gives the same bits;
 * a level only picks which build of a loop runs (cref.h, KC_V3; gemv.c's tiles).
 *
 * Levels (x86 only; elsewhere always 0): 0 scalar, 1 AVX2 + F16C, 2 VNNI (AVX-VNNI, or
 * AVX512-VNNI on 256-bit vectors), 3 AVX-512 with VBMI and VNNI.
 */
#include "cref.h"

#if defined(__x86_64__) || defined(__i386__)
#define KC_X86 1
#endif

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

static int g_max, g_level, g_fma, g_avxvnni;

/* At load time, so no caller ever races the detection. */
__attribute__((constructor)) static void init_level(void)
{
    g_max = g_level = cpu_level();
#ifdef KC_X86
    g_avxvnni = __builtin_cpu_supports("avxvnni");
    g_fma = __builtin_cpu_supports("fma");
#endif
}

int kc_v3(void)
{
    return g_level >= 1 && g_fma;
}

int kc_avxvnni(void)
{
    return g_avxvnni;
}

/* A switch for tests and benchmarks: not to be flipped while a GEMV runs. */
int kc_gemv_simd(int level)
{
    if (level >= 0)
        g_level = level < g_max ? level : g_max;
    return g_level;
}
