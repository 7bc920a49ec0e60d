// common.cuh — shared by every kernel file of the cuda backend.
//
// THE EXACT-PATH CONTRACT is docs/numerics.md; rules are cited by number ("contract L6",
// "R1"). Every *_exact kernel reproduces it bit for bit (as the CPU reference does). How the
// kernels keep it:
//
//   * N1/N2: f32 arithmetic in exact code is written with the IEEE round-to-nearest
//     intrinsics only (FADD/FSUB/FMUL/FDIV/FSQRT below), so no FMA contraction, no
//     approximate division and no rsqrtf can creep in. As a second guard the backend
//     compiles every module with -fmad=false (so plain operators in fast kernels are not
//     contracted either: the fast kernels ask for FMAs explicitly with fmaf).
//   * N3: __fma_rn only in binary64, inside the replicas below (-fmad=false does not touch
//     explicit FMAs).
//   * R1 is a warp's native __shfl_xor_sync order (warp_butterfly_exact); N4 lets __dp4a
//     sum integer dots in any order.
//   * T1/T2: expf_ucrt/cosf_ucrt/sinf_ucrt below, line-by-line ports of
//     numerics/transcend.py. Never the device expf/__expf in exact code.
//
// The *_fast kernels do what a GPU engine does (tree reductions with warp
// shuffles, device expf/sincosf/rsqrtf, FMAs, reciprocal multiplies); they
// only have to be plausible, deterministic and different. (They are not the sim
// subject's fast orders, backends/ops_fast.py: each .cu header lists its own.)
//
// The replicas are __host__ __device__ so that the CPU-only test suite can
// compile them for the host with nvcc and check them against the numpy
// replicas without a GPU (tests/test_kernels_compile.py); on the device they
// use the intrinsics named in the contract.
#pragma once

#include <cuda_fp16.h>

#include "launch.cuh"
#include <stdint.h>
#ifndef __CUDA_ARCH__
#include <cmath>
#include <cstring>
#endif

#define FADD(a, b) __fadd_rn((a), (b))
#define FSUB(a, b) __fsub_rn((a), (b))
#define FMUL(a, b) __fmul_rn((a), (b))
#define FDIV(a, b) __fdiv_rn((a), (b))
#define FSQRT(a) __fsqrt_rn(a)

// Programmatic dependent launch (sm_90+; backends/cuda/pdl.py launches the decode graph's
// kernels with it): every kernel calls pdl_wait() before it reads or writes anything a kernel
// before it may write — first thing, except where the loads ahead of it read what is final
// once the kernel starts: the dense GEMVs' first weight loads (gemv.cuh gemv_q4; weights are
// never written by a step), down_combine's L2 prefetch of its experts' rows (fused.cu; the
// router that chose them has finished by then), the attention's cache rows of earlier steps
// (attention.cu: attn_fast_part_q8, attn_exact_scores_q8, attn_exact_pv_q8) and the copies of
// the exponential's table (expf_table_to_shared).
// It waits until every kernel before it has finished and its writes are visible — the
// dependency a plain launch has — so a kernel scheduled early computes exactly what it
// computes without PDL. Without the launch attribute it is a no-op. Built with
// KESTREL_PDL_TRIGGER (runtime.py nvcc_options: the default; env KESTREL_PDL_TRIGGER=0 builds
// wait-only), each kernel triggers its successor once past its wait
// (griddepcontrol.launch_dependents), so the next grid's blocks are resident and waiting when it
// ends. Either way a kernel reads nothing that a kernel in front of it may still write: the
// bits do not change (docs/decisions.md; figures in results/gpu-h200-speed.md).
#ifdef KESTREL_STAMPS
// A diagnostic build (scripts/gpu/gpu_step_timeline.py): thread 0 of block (0,0,0) writes the
// global timer and its launch shape once past the wait, so that the time from one kernel's
// stamp to the next one's is the first kernel's share of a step. Null: off.
__device__ unsigned long long *kestrel_stamps;  // [0] the count, then (time ns, shape) pairs
#define KESTREL_STAMP_CAP 8192
__device__ __forceinline__ void kestrel_stamp() {
  unsigned long long *st = kestrel_stamps;
  if (st == nullptr || threadIdx.x != 0 || (blockIdx.x | blockIdx.y | blockIdx.z) != 0) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  const unsigned long long i = atomicAdd(st, 1ull);
  if (i < KESTREL_STAMP_CAP) {
    st[1 + 2 * i] = t;
    st[2 + 2 * i] = gridDim.x | (unsigned long long)gridDim.y << 16 | (unsigned long long)gridDim.z << 32 |
                    (unsigned long long)blockDim.x << 48;
  }
}
#endif

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef KESTREL_PDL_TRIGGER
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
#endif
#ifdef KESTREL_STAMPS
  kestrel_stamp();
#endif
}

#define FULL_MASK 0xffffffffu
#define QK 32  // q4_0 / q8_0 block size

// ------------------------------------------------------------ binary64 helpers
// Host builds (the CPU replica test) map the device intrinsics to their C99
// equivalents, which are IEEE-exact too: fma is correctly rounded, nearbyint
// rounds ties to even in the default rounding mode.

__host__ __device__ __forceinline__ double d_bits(unsigned long long b) {
#ifdef __CUDA_ARCH__
  return __longlong_as_double((long long)b);
#else
  double d;
  memcpy(&d, &b, sizeof d);
  return d;
#endif
}
__host__ __device__ __forceinline__ double d_fma(double a, double b, double c) {
#ifdef __CUDA_ARCH__
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
__host__ __device__ __forceinline__ double d_mul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
__host__ __device__ __forceinline__ double d_sub(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
__host__ __device__ __forceinline__ int d_rint_to_int(double a) {  // ties to even
#ifdef __CUDA_ARCH__
  return __double2int_rn(a);
#else
  return (int)std::nearbyint(a);
#endif
}
__host__ __device__ __forceinline__ float d_to_f(double a) {  // one rounding, RN
#ifdef __CUDA_ARCH__
  return __double2float_rn(a);
#else
  return (float)a;
#endif
}
__host__ __device__ __forceinline__ unsigned f_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  unsigned u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}
__host__ __device__ __forceinline__ float f_from_bits(unsigned u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// ------------------------------------------------------------ expf_ucrt
#include "ucrt_tables.h"
// Contract T1's table: T[j] = 2^(j/64) correctly rounded (numerics/transcend.py _EXP_T_BITS).
// Global, not __constant__, memory on the device: the lanes of a warp index it divergently,
// which the constant cache serves one address at a time.
#define EXPF_TABLE_LEN 64
#ifdef __CUDA_ARCH__
__device__
#endif
static const unsigned long long EXPF_T[EXPF_TABLE_LEN] = UCRT_EXPF_T_BITS;

// Contract T1, UCRT expf (ucrtbase.dll RVA 0xA84F0): 64-entry table + degree-3 polynomial
// in binary64 with explicit FMAs; x > 88.7228394f -> +inf, x < -104 -> +0. T: the table, EXPF_T
// or a block's copy of it in shared memory (expf_table_to_shared).
__host__ __device__ __forceinline__ float expf_ucrt(float xf, const unsigned long long *T = EXPF_T) {
  if (xf > f_from_bits(0x42B17218u)) return f_from_bits(0x7f800000u);  // +inf
  if (xf < -104.0f) return 0.0f;
  const double K = d_bits(0x40571547652B82FEull);   // 64/ln2
  const double C2 = d_bits(0x3F862E42FEFA39EFull);  // ln2/64
  const double C0 = d_bits(0x3FC5555555555555ull);  // 1/6
  const double C1 = d_bits(0x3FE0000000000000ull);  // 1/2
  const double x = (double)xf;
  const int n = d_rint_to_int(d_mul(x, K));
  const double dn = (double)n;
  const double r = d_fma(-dn, C2, x);
  const int j = n & 63;
  const int m = n >> 6;  // arithmetic shift
  const double z = d_mul(r, r);
  const double p = d_fma(d_fma(r, C0, C1), z, r);
  const double Tj = d_bits(T[j]);
  const double q = d_fma(Tj, p, Tj);
  const double two_m = d_bits((unsigned long long)(long long)(m + 1023) << 52);
  return d_to_f(d_mul(two_m, q));
}

// ------------------------------------------------------------ cosf_ucrt / sinf_ucrt
// Contract T2, UCRT cosf (RVA 0xA7D20) / sinf (RVA 0xAC110): direct polynomial for
// |x| <= pi/4 (with the two small-|x| shortcuts), Cody-Waite reduction above.
// Beyond the Payne-Hanek thresholds (never reached by RoPE) they fall back to
// the binary64 library function, like the numpy replica.

__host__ __device__ __forceinline__ double ucrt_poly_cos(double z) {  // C(x), z = x*x
  const double A3 = d_bits(0x3FA5555555555555ull);
  const double A5 = d_bits(0xBF56C16C16C16C16ull);
  const double A7 = d_bits(0x3EFA01A01A01A019ull);
  const double A9 = d_bits(0xBE927E4FB7789F5Cull);
  double p = d_fma(z, A9, A7);
  p = d_fma(z, p, A5);
  p = d_fma(z, p, A3);
  return d_fma(p, d_mul(z, z), d_sub(1.0, d_mul(0.5, z)));
}
__host__ __device__ __forceinline__ double ucrt_poly_sin(double x, double z) {  // S(x), z = x*x
  const double B3 = d_bits(0xBFC5555555555555ull);
  const double B5 = d_bits(0x3F81111111111111ull);
  const double B7 = d_bits(0xBF2A01A01A01A01Aull);
  const double B9 = d_bits(0x3EC71DE3A556C734ull);
  double p = d_fma(z, B9, B7);
  p = d_fma(z, p, B5);
  p = d_fma(z, p, B3);
  return d_fma(p, d_mul(x, z), x);
}

// Cody-Waite: n = trunc(fma(|x|, 2/pi, 0.5)), r = fma(-n, PIO2_HI, |x|) - n*PIO2_LO
__host__ __device__ __forceinline__ double ucrt_reduce(double ax, int *n_out) {
  const double INV_PIO2 = d_bits(0x3FE45F306DC9C883ull);
  const double PIO2_HI = d_bits(0x3FF921FB54400000ull);
  const double PIO2_LO = d_bits(0x3DD0B4611A626331ull);
  const int n = (int)d_fma(ax, INV_PIO2, 0.5);  // conversion truncates
  const double dn = (double)n;
  *n_out = n;
  return d_sub(d_fma(-dn, PIO2_HI, ax), d_mul(dn, PIO2_LO));
}

__host__ __device__ __forceinline__ float cosf_ucrt(float xf) {
  const unsigned au = f_bits(xf) & 0x7fffffffu;
  const double x = (double)xf;
  if (au >= 0x4F490FDBu) {  // inf/nan and the Payne-Hanek range
#ifdef __CUDA_ARCH__
    return d_to_f(cos(x));
#else
    return d_to_f(std::cos(x));
#endif
  }
  if (au <= 0x3F490FDBu) {      // |x| <= pi/4
    if (au < 0x39000000u) return 1.0f;  // |x| < 2^-13
    if (au < 0x3C000000u) return d_to_f(d_fma(-d_mul(x, 0.5), x, 1.0));  // |x| < 2^-7
    return d_to_f(ucrt_poly_cos(d_mul(x, x)));
  }
  int n;
  const double r = ucrt_reduce(x < 0 ? -x : x, &n);
  const double z = d_mul(r, r);
  double res = (n & 1) ? ucrt_poly_sin(r, z) : ucrt_poly_cos(z);
  if (((((n & 3) + 1) >> 1) & 1) != 0) res = -res;
  return d_to_f(res);
}

__host__ __device__ __forceinline__ float sinf_ucrt(float xf) {
  const unsigned au = f_bits(xf) & 0x7fffffffu;
  const double x = (double)xf;
  if (au >= 0x4B800456u) {
#ifdef __CUDA_ARCH__
    return d_to_f(sin(x));
#else
    return d_to_f(std::sin(x));
#endif
  }
  if (au <= 0x3F490FDBu) {
    if (au < 0x39000000u) return xf;  // |x| < 2^-13 (keeps -0.0)
    if (au < 0x3C000000u) {  // |x| < 2^-7
      const double B3 = d_bits(0xBFC5555555555555ull);  // fma(-(x*x*x), 1/6, x) == fma(B3, x^3, x)
      return d_to_f(d_fma(B3, d_mul(d_mul(x, x), x), x));
    }
    return d_to_f(ucrt_poly_sin(x, d_mul(x, x)));
  }
  int n;
  const double r = ucrt_reduce(x < 0 ? -x : x, &n);
  const double z = d_mul(r, r);
  double res = (n & 1) ? ucrt_poly_cos(z) : ucrt_poly_sin(r, z);
  const bool neg = ((n & 3) >= 2) != (xf < 0.0f);
  if (neg) res = -res;
  return d_to_f(res);
}

#ifdef __CUDACC__
// ------------------------------------------------------------ device-only helpers

// The expf toggle: exact -> the UCRT replica (T: its table), fast -> the device library expf.
__device__ __forceinline__ float expf_sel(float x, int exact, const unsigned long long *T = EXPF_T) {
  return exact ? expf_ucrt(x, T) : expf(x);
}

// A block's copy of contract T1's table in shared memory, for the kernels whose exponentials sit
// on the step's critical path (the router, SwiGLU, the exact P.V): read from global memory, the
// table is one more dependent L2 round trip after the exponent's operand arrives. A step never
// writes the table, so the copy is made ahead of pdl_wait(); it is visible after the next
// __syncthreads(). The same values, so the same bits.
__device__ __forceinline__ void expf_table_to_shared(unsigned long long *s) {
  for (int i = threadIdx.x; i < EXPF_TABLE_LEN; i += blockDim.x) s[i] = EXPF_T[i];
}

// Contract R1, second half (the butterfly); every lane ends with the result.
__device__ __forceinline__ float warp_butterfly_exact(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = FADD(v, __shfl_xor_sync(FULL_MASK, v, off));
  return v;
}
__device__ __forceinline__ float warp_sum_fast(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_down_sync(FULL_MASK, v, off);
  return __shfl_sync(FULL_MASK, v, 0);
}
__device__ __forceinline__ float warp_max(float v) {  // max is exact in any order
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
  return v;
}

// The inverse scale id of contract Q2-Q4 (model/quant.py _inverse).
__device__ __forceinline__ float q8_inverse(float d) {
  const float inv = FDIV(1.0f, d);
  return isfinite(inv) ? inv : 0.0f;
}

// C roundf (half away from zero) — ggml's q8_0 rounding (contract Q2, Q3).
__device__ __forceinline__ float round_half_away(float x) { return roundf(x); }

// f16 round trip of a q8_0 block scale (__float2half_rn = numpy's astype(float16)).
__device__ __forceinline__ float f16_round(float x) { return __half2float(__float2half_rn(x)); }

// Contract R3 over a 16-byte-aligned shared-memory array, by one thread, in order. The next
// eight float4s are loaded while the adds of the current eight run, so the chain waits on its
// adds alone: with the loads of a group issued just ahead of its own adds, each group of 32 adds
// also waited one shared-load latency (~1340 cycles for RMSNorm's 256 terms on an H100 against
// ~1040 for the adds; results/gpu-h200-speed.md, 2026-12-06, second set).
#define SERIAL_GROUP 8  // float4s a group
__device__ __forceinline__ float add4_in_order(float s, float4 t) {
  return FADD(FADD(FADD(FADD(s, t.x), t.y), t.z), t.w);
}
__device__ __forceinline__ float serial_sum_shared(const float *a, int n) {
  float s = 0.0f;
  const float4 *a4 = (const float4 *)a;
  const int n4 = n / 4;
  int j = 0;
  if (n4 >= SERIAL_GROUP) {
    float4 cur[SERIAL_GROUP], nxt[SERIAL_GROUP];
#pragma unroll
    for (int u = 0; u < SERIAL_GROUP; u++) cur[u] = a4[u];
    for (j = SERIAL_GROUP; j + SERIAL_GROUP <= n4; j += SERIAL_GROUP) {  // cur holds [j - GROUP, j)
#pragma unroll
      for (int u = 0; u < SERIAL_GROUP; u++) nxt[u] = a4[j + u];
#pragma unroll
      for (int u = 0; u < SERIAL_GROUP; u++) s = add4_in_order(s, cur[u]);
#pragma unroll
      for (int u = 0; u < SERIAL_GROUP; u++) cur[u] = nxt[u];
    }
#pragma unroll
    for (int u = 0; u < SERIAL_GROUP; u++) s = add4_in_order(s, cur[u]);
  }
  for (; j < n4; j++) s = add4_in_order(s, a4[j]);
  for (j = 4 * n4; j < n; j++) s = FADD(s, a[j]);
  return s;
}

// x / n rounded, as FDIV(x, n) gives it. For n a power of two the quotient is x * 2^-k rounded,
// and 2^-k is exact, so one multiply gives the same bits; otherwise the divide.
__device__ __forceinline__ float div_by_count(float x, int n) {
  if (n > 0 && (n & (n - 1)) == 0 && n <= (1 << 30)) return FMUL(x, __int_as_float((127 - (__ffs(n) - 1)) << 23));
  return FDIV(x, (float)n);
}

// The q8_0 quantization of a q4_0 GEMV's input, one 32-element block held one element a lane
// by a whole warp (element i, block i/32; the kernels that produce a GEMV's input call it on
// their output). quant 2: the exact rule, contract Q2 (ggml quantize_row_q8_0_ref); quant 1:
// the fast rule, ggml-cuda's quantize_q8_1 (q = roundf(x / d)); quant 0: nothing. The scale
// is stored f16-rounded.
// q8_0_finish: the rest, given the block's amax (every lane holds it).
__device__ __forceinline__ void q8_0_finish(float v, float amax, size_t i, signed char *__restrict__ xq,
                                            float *__restrict__ xd, int quant) {
  float d, r;
  if (quant == 2) {
    d = FDIV(amax, 127.0f);
    const float id = q8_inverse(d);
    r = roundf(FMUL(v, id));
  } else {
    d = amax / 127.0f;
    r = amax == 0.0f ? 0.0f : roundf(v / d);
  }
  xq[i] = (signed char)r;
  if ((threadIdx.x & 31) == 0) xd[i / QK] = f16_round(d);
}

__device__ __forceinline__ void q8_0_warp(float v, size_t i, signed char *__restrict__ xq, float *__restrict__ xd,
                                          int quant) {
  if (quant) q8_0_finish(v, warp_max(fabsf(v)), i, xq, xd, quant);
}

// q8_0_warp of the N elements a lane holds, v[k] = element i0 + k*stride (whole warps, as
// there; k < n_valid only), their N warp maxima computed side by side so that the shuffle
// chains overlap instead of running one after another. The same bits as N q8_0_warp calls.
template <int N>
__device__ __forceinline__ void q8_0_warp_n(const float (&v)[N], size_t i0, int stride, int n_valid,
                                            signed char *__restrict__ xq, float *__restrict__ xd, int quant) {
  if (!quant) return;
  float amax[N];
#pragma unroll
  for (int k = 0; k < N; k++) amax[k] = fabsf(v[k]);
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1)
#pragma unroll
    for (int k = 0; k < N; k++) amax[k] = fmaxf(amax[k], __shfl_xor_sync(FULL_MASK, amax[k], off));
#pragma unroll
  for (int k = 0; k < N; k++)
    if (k < n_valid) q8_0_finish(v[k], amax[k], i0 + (size_t)k * stride, xq, xd, quant);
}
#endif
