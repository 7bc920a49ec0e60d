"""The reference ops: each one the numerics contract (docs/numerics.md) in numpy.

Each function works on M independent columns at once. The decoder
(backends/decoder.py) composes them; the sim backend swaps single entries of
the op table for GPU-style fast versions (backends/ops_fast.py).
"""
from __future__ import annotations

import numpy as np

from ..model.quant import quantize_rows_q8
from ..model.weights import Linear
from ..numerics import transcend
from ..numerics.linalg import gemv_parts
from ..numerics.reduce import lane_sum, seq_sum, sumsq_block8

F32 = np.float32


def _normalize(x: np.ndarray, ss: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    n = F32(x.shape[-1])
    rms = F32(1) / np.sqrt(ss / n + F32(eps))  # IEEE sqrt and divide; rsqrtf differs in ~35% of cases
    return (x * rms[..., None]) * w


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Hidden-size RMSNorm, block-8 sum of squares. x [..., hidden]."""
    return _normalize(x, sumsq_block8(x), w, eps)


def qknorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm over head_dim, sequential sum of squares. x [..., n_heads, hd]."""
    return _normalize(x, seq_sum(x * x), w, eps)


def _split(y: np.ndarray, lins: tuple[Linear, ...]) -> tuple[np.ndarray, ...]:
    return tuple(np.split(y, np.cumsum([l.out for l in lins[:-1]]), axis=-1))


def project(lins: tuple[Linear, ...], x: np.ndarray) -> tuple[np.ndarray, ...]:
    """Several GEMVs of one input (the q8_0 activation quantized once), walked as one stack of rows."""
    return _split(gemv_parts(lins, x), lins)


def project_experts(lins: tuple[Linear, ...], x: np.ndarray, expert: np.ndarray) -> tuple[np.ndarray, ...]:
    """GEMVs of stacked experts: x [M, k or 1, in], expert [M, k] -> ([M, k, out], ...)."""
    return _split(gemv_parts(lins, x, expert=expert), lins)


def rope_cos_sin(pos: np.ndarray, inv_freq: np.ndarray):
    """Angles pos*inv_freq in f32 and their replica cos/sin: [M, hd/2] each, shared by all layers."""
    ang = pos.astype(F32)[:, None] * inv_freq[None, :]
    return transcend.sincosf(ang)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Half-split rotate: x [M, heads, hd], cos/sin [M, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def kvquant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KV rows [..., hd] -> int8 rows and f32 scales (kept in f32, not f16)."""
    return quantize_rows_q8(x)


def scores_q8(q: np.ndarray, k: np.ndarray, ks: np.ndarray, scale: np.float32) -> np.ndarray:
    """s = (float(isum) * (dq*dk)) * scale. q [M, n_kv, g, hd] f32, k [T, n_kv, hd] int8 -> [M, n_kv, g, T]."""
    qq, dq = quantize_rows_q8(q)
    # integer-valued f32 matmul: |isum| <= hd*127*127 < 2^24, so it is exact
    isum = np.matmul(qq.astype(F32), k.astype(F32).transpose(1, 2, 0)[None])
    return (isum * (dq[..., None] * ks.T[None, :, None, :])) * scale


def scores_f32(q: np.ndarray, k: np.ndarray, scale: np.float32) -> np.ndarray:
    """s = lane_sum(q[j]*k[j]) * scale for an f32 cache."""
    prod = q[:, :, :, None, :] * k.transpose(1, 0, 2)[None, :, None, :, :]  # [M, n_kv, g, T, hd]
    return lane_sum(prod, axis=-1) * scale


def attention(q: np.ndarray, cache: dict, pos: np.ndarray, scale: np.float32, expf=None) -> np.ndarray:
    """Online softmax, position by position (contract L6).

    q [M, n_heads, hd]; cache holds k/v [T, n_kv, hd] (int8 or f32) and ks/vs [T, n_kv];
    column m attends to positions 0..pos[m]. Returns [M, n_heads*hd].
    """
    expf = expf or transcend.expf
    k, ks, v, vs = cache["k"], cache["ks"], cache["v"], cache["vs"]
    M, nh, hd = q.shape
    T, nkv = k.shape[0], k.shape[1]
    q = q.reshape(M, nkv, nh // nkv, hd)  # q head h uses kv head h // g
    s = scores_q8(q, k, ks, scale) if k.dtype == np.int8 else scores_f32(q, k, scale)
    valid = np.arange(T)[None, :] <= pos[:, None]  # [M, T]
    s = np.where(valid[:, None, None, :], s, F32(-np.inf))
    # The running max and both exponentials do not depend on the accumulators, so
    # they are computed for every position at once; only the recurrence is serial.
    m_run = np.maximum.accumulate(s, axis=-1)
    m_prev = np.concatenate([np.full_like(m_run[..., :1], -np.inf), m_run[..., :-1]], axis=-1)
    ew = expf(np.stack([m_prev - m_run, s - m_run]))  # one call: [2, M, n_kv, g, T]
    c, w = ew[0], ew[1]
    vals = v.astype(F32) * vs[..., None] if v.dtype == np.int8 else v  # [T, n_kv, hd]
    # an extra all-ones column carries l through the same recurrence: l*c + w*1
    v1 = np.concatenate([vals, np.ones((T, nkv, 1), F32)], axis=-1).transpose(1, 0, 2)  # [n_kv, T, hd+1]
    wv = w[..., None] * v1[None, :, None, :, :]  # [M, n_kv, g, T, hd+1]
    acc = np.zeros((M, nkv, nh // nkv, hd + 1), F32)
    for p in range(int(pos.max()) + 1):
        step = acc * c[..., p, None] + wv[..., p, :]
        acc = step if p <= pos.min() else np.where(valid[:, p, None, None, None], step, acc)
    return (acc[..., :hd] / acc[..., hd:]).reshape(M, nh * hd)


def silu(x: np.ndarray, expf=None) -> np.ndarray:
    expf = expf or transcend.expf
    return x / (F32(1) + expf(-x))


def route(logits: np.ndarray, top_k: int, norm_topk_prob: bool, expf=None) -> tuple[np.ndarray, np.ndarray]:
    """Router softmax (expert order), top-k (descending, ties to the lower index), renormalise.
    logits [M, E] -> (expert ids [M, k] int64, weights [M, k] f32)."""
    expf = expf or transcend.expf
    e = expf(logits - logits.max(axis=-1, keepdims=True))
    p = e / seq_sum(e)[..., None]
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, idx, axis=-1)
    if norm_topk_prob:
        w = w / seq_sum(w)[..., None]
    return idx, w


def combine(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """moe = 0; moe = moe + w_j*y_j in rank order. y [M, k, hidden], w [M, k]."""
    out = np.zeros_like(y[:, 0])
    for j in range(y.shape[1]):
        out = out + w[:, j, None] * y[:, j]
    return out
