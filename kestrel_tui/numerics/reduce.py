"""The contract's ordered float32 reductions (docs/numerics.md, "Ordered reductions").

numpy's `sum` is pairwise with an unspecified blocking, so every reduction the
reference needs is spelled out here. Each is vectorised across the independent
outputs; only the order *within* one reduction is fixed.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32
ZERO = F32(0)


def seq_sum(t: np.ndarray, axis: int = -1) -> np.ndarray:
    """s = 0; s = s + t[i] ascending. `ufunc.accumulate` is a strict left-to-right
    recurrence; starting it at t[0] instead of +0 only differs when every term is
    -0, which the final `+ 0` maps back to +0."""
    return np.add.accumulate(t, axis=axis).take(-1, axis=axis) + ZERO


def lane_sum(t: np.ndarray, axis: int = -1) -> np.ndarray:
    """32 lanes: lane i = ((0 + t[i]) + t[i+32]) + ...; then butterfly v[i] += v[i^off],
    off = 16, 8, 4, 2, 1 — a CUDA warp's native order (`__shfl_xor_sync`).

    Lanes past the end hold +0 on the GPU; adding +0 is the identity for every
    value but -0, and `0 + t` has already turned any -0 into +0, so numpy skips
    those additions.
    """
    t = np.moveaxis(t, axis, 0)
    n = t.shape[0]
    lanes = min(n, 32)
    v = t[:lanes] + ZERO
    for start in range(32, n, 32):
        chunk = t[start:start + 32]
        v[: len(chunk)] += chunk
    for off in (16, 8, 4, 2, 1):
        if lanes > off:
            v[: lanes - off] += v[off:lanes]
            v = v[:off]
            lanes = off
    return v[0]


def sumsq_block8(x: np.ndarray) -> np.ndarray:
    """RMSNorm's sum of squares over the last axis: 8-element blocks
    (lo[k] = x[b+k]^2, hi[k] = x[b+4+k]^2, lo += hi, (lo0+lo1) + (lo2+lo3)) added
    to ss in ascending block order, then the tail element by element."""
    n = x.shape[-1]
    n8 = n & ~7
    blocks = x[..., :n8].reshape(*x.shape[:-1], n8 // 8, 8)
    sq = blocks * blocks
    lo = sq[..., :4] + sq[..., 4:]
    terms = (lo[..., 0] + lo[..., 1]) + (lo[..., 2] + lo[..., 3])  # [..., n8/8]
    if n8 < n:
        tail = x[..., n8:]
        terms = np.concatenate([terms, tail * tail], axis=-1)
    return seq_sum(terms)
