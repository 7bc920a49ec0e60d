// rope.cuh — one rotation pair of RoPE (rope.cu's kernels and fused.cu's per-head launch
// call it, so both give the same bits). The versions: rope.cu.
#pragma once
#include "common.cuh"

// (x1, x2) = (x[i], x[i + hd/2]) -> (y[i], y[i + hd/2]); exact: contract L4a's rotation.
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, float &y1, float &y2, bool exact) {
  if (exact) {
    y1 = FSUB(FMUL(x1, c), FMUL(x2, s));
    y2 = FADD(FMUL(x2, c), FMUL(x1, s));
  } else {
    y1 = fmaf(x1, c, -(x2 * s));
    y2 = fmaf(x2, c, x1 * s);
  }
}
