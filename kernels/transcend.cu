// transcend.cu — the exp/cos/sin functions themselves, element-wise over arrays.
// Toggle: expf (and rope for cos/sin). The decode step calls the device
// functions inline (common.cuh); these kernels exist to test and benchmark them.
//
// Versions:
//   eval_expf_ucrt / eval_cosf_ucrt / eval_sinf_ucrt
//       the UCRT replicas (common.cuh; contract T1, T2), which must equal
//       numerics/transcend.py bit for bit (tests/test_cuda.py runs >= 10M inputs each).
//   eval_expf_fast / eval_sincosf_fast
//       the device library's expf and sincosf — what the fast kernels use.
#include "common.cuh"

extern "C" __global__ void eval_expf_ucrt(const float *__restrict__ x, float *__restrict__ y, int n) {
  pdl_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = expf_ucrt(x[i]);
}
extern "C" __global__ void eval_cosf_ucrt(const float *__restrict__ x, float *__restrict__ y, int n) {
  pdl_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = cosf_ucrt(x[i]);
}
extern "C" __global__ void eval_sinf_ucrt(const float *__restrict__ x, float *__restrict__ y, int n) {
  pdl_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = sinf_ucrt(x[i]);
}
extern "C" __global__ void eval_expf_fast(const float *__restrict__ x, float *__restrict__ y, int n) {
  pdl_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = expf(x[i]);
}
extern "C" __global__ void eval_sincosf_fast(const float *__restrict__ x, float *__restrict__ c,
                                             float *__restrict__ s, int n) {
  pdl_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) sincosf(x[i], &s[i], &c[i]);
}
