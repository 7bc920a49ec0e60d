"""GEMV in the contract's order: exact block dots, then the 32-lane sum of block terms.

q4_0 x q8_0: isum = sum(qw*qx) per 32-block (exact), term = float(isum) * (dw*dx),
y = lane_sum(terms over blocks). f32: y = lane_sum(w[i]*x[i] over elements).
Every column of a multi-column call is computed on its own, so batch-verify
columns equal M=1 decode by construction.
"""
from __future__ import annotations

import numpy as np

from ..model.quant import quantize_q8_0
from ..model.weights import Linear
from .reduce import lane_sum


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., n] -> (qx f32 [..., nb, 32] holding int8 values, dx f32 [..., nb])."""
    qs, d = quantize_q8_0(x)
    return qs.astype(np.float32), d


def block_terms(lin: Linear, xq: tuple[np.ndarray, np.ndarray], expert: np.ndarray | None = None) -> np.ndarray:
    """Per-block terms float(isum)*(dw*dx): [..., nb, out]. `expert` gathers stacked experts
    (an index array whose shape is the leading batch shape)."""
    qx, dx = xq  # [..., nb, 32], [..., nb]
    if expert is None:
        wq, wd = lin.qsf, lin.d  # [nb, out, 32], [nb, out]
    else:
        wq = lin.qsf[expert] if lin.qsf is not None else lin.qs[expert].astype(np.float32)
        wd = lin.d[expert]  # [..., nb, out]
    # integer-valued f32 matmul: every partial sum is an integer < 2^24, so BLAS is exact
    isum = np.matmul(wq, qx[..., None])[..., 0]  # [..., nb, out]
    return isum * (wd * dx[..., None])


def gemv(lin: Linear, x: np.ndarray | None = None, xq: tuple | None = None,
         expert: np.ndarray | None = None) -> np.ndarray:
    """y[..., out] = W x[..., in] in the contract order. Pass `xq` to reuse one q8_0
    quantization of the activation across several matrices."""
    if lin.w is not None:
        w = lin.w if expert is None else lin.w[expert]  # [..., out, in]
        prod = w * x[..., None, :]
        return lane_sum(prod, axis=-1)
    if xq is None:
        xq = quantize_act(x)
    return lane_sum(block_terms(lin, xq, expert), axis=-2)

