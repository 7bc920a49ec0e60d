"""The sim backend's *fast* ops: GPU-style evaluations, in real arithmetic, on the CPU.

Each is a genuinely different evaluation, not noise added to the reference, so
its DIFFs behave like a GPU's: they appear in the op's output, propagate, and
vanish when the op's toggle is switched to exact. They are not the CUDA fast
kernels' orders (kernels/*.cu have their own; the two move a first DIFF along
different paths). Their orders:

* tree sum (`tree_sum`): pad to a power of two with +0, then v = v[:n/2] + v[n/2:]
  until one value is left — a shared-memory block reduction.
* norm: ss = tree_sum(x*x); rms = 1/sqrt(ss*(1/d) + eps) (reciprocal-multiply
  instead of ss/d); out = x * (rms*w).
* gemm: term = (float(isum)*dw)*dx; the block terms are combined by a split-K
  whose split count depends on M (1 split for M=1, 2 for M>1): each split
  sums its blocks sequentially, then the splits are added — so batch-verify
  columns differ from M=1 decode, as with real tiled GEMMs. f32 weights:
  numpy matmul (BLAS order).
* rope: numpy's own float32 cos/sin.
* expf: numpy's own float32 exp.
* attention: two-pass softmax without query quantization — s = (q . (k*ks)) by
  matmul * scale, m = max, e = exp(s-m), l = tree_sum(e), out = (e @ V) * (1/l);
  a column over its own positions, so that its bits do not depend on the pass it
  is in (BLAS picks its kernel by the shapes).
* kvquant: q = rint(x * (127/amax)) (round half to even, reciprocal computed
  directly), scale amax * f32(1/127) (multiply by a rounded constant).
* moe: softmax with tree_sum and reciprocal-multiply, renormalise by
  reciprocal-multiply, silu = x * (1/(1+exp(-x))), experts combined by a
  pairwise tree over the k slots.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..model.weights import Linear
from ..numerics import transcend
from ..numerics.linalg import q4_gemv, quantize_act
from .decoder import EXACT, Ops

F32 = np.float32


def tree_sum(t: np.ndarray, axis: int = -1) -> np.ndarray:
    t = np.moveaxis(t, axis, 0)
    n = 1 << max(0, (t.shape[0] - 1).bit_length())
    if n != t.shape[0]:
        t = np.concatenate([t, np.zeros((n - t.shape[0], *t.shape[1:]), t.dtype)])
    while t.shape[0] > 1:
        half = t.shape[0] // 2
        t = t[:half] + t[half:]
    return t[0]


def _normalize(x, ss, w, eps):
    rms = F32(1) / np.sqrt(ss * (F32(1) / F32(x.shape[-1])) + F32(eps))
    return x * (rms[..., None] * w)


def rmsnorm(x, w, eps):
    return _normalize(x, tree_sum(x * x), w, eps)


def qknorm(x, w, eps):
    return _normalize(x, tree_sum(x * x), w, eps)


def _split_k(terms: np.ndarray, n_split: int, axis: int = -2) -> np.ndarray:
    """terms [..., nb, ...] -> the block axis summed: sequential within each split, then splits added."""
    parts = np.array_split(np.moveaxis(terms, axis, 0), n_split)
    sums = [np.add.accumulate(p, axis=0)[-1] for p in parts if len(p)]
    out = sums[0]
    for s in sums[1:]:
        out = out + s
    return out


def _fast_terms(M: int):
    """term = (float(isum)*dw)*dx, split-K over the blocks: 1 split for M=1, 2 for M>1."""
    n_split = 1 if M == 1 else 2

    def reduce(isum, dw, dx):
        return _split_k((isum * dw) * dx, n_split, axis=1)
    return reduce


def _gemv_f32_fast(lin: Linear, x: np.ndarray, expert=None) -> np.ndarray:
    """numpy matmul (BLAS order), one GEMV per column — kept call for call as it always was:
    OpenBLAS's summation order is its own, so a different call shape could change bits."""
    w = lin.w if expert is None else lin.w[expert]
    return np.matmul(w, x[..., None])[..., 0]


def _project_fast(lins, x, expert=None):
    if lins[0].w is not None:
        return tuple(_gemv_f32_fast(lin, x, expert) for lin in lins)
    # q4_0: the exact integer block dots of numerics/linalg.py (packed weights widened in chunks),
    # then this module's term order; rows are independent, so the matrices run as one stack
    y = q4_gemv(tuple(lins), quantize_act(x), expert, _fast_terms(x.shape[0]))
    return tuple(np.split(y, np.cumsum([l.out for l in lins[:-1]]), axis=-1))


def project(lins, x):
    return _project_fast(lins, x)


def project_experts(lins, x, expert):
    return _project_fast(lins, x, expert)


def rope_cos_sin(pos, inv_freq):
    ang = pos.astype(F32)[:, None] * inv_freq[None, :]
    return np.cos(ang), np.sin(ang)


def expf(x):
    return np.exp(np.asarray(x, F32))


def kvquant(x):
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore", over="ignore"):
        inv = F32(127) / amax
    inv = np.where(np.isfinite(inv), inv, F32(0)).astype(F32)
    q = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
    return q, amax * F32(1 / 127)


def attention(q, cache, pos, scale, expf_fn=None):
    expf_fn = expf_fn or transcend.expf
    k, ks, v, vs = cache["k"], cache["ks"], cache["v"], cache["vs"]
    M, nh, hd = q.shape
    nkv = k.shape[1]
    kf = k.astype(F32) * ks[..., None] if k.dtype == np.int8 else k  # [T, n_kv, hd]
    vf = v.astype(F32) * vs[..., None] if v.dtype == np.int8 else v
    qg = q.reshape(M, nkv, nh // nkv, hd)
    out = np.empty((M, nh * hd), F32)
    # a column at a time over its own positions 0..pos: BLAS picks its kernel (and so its order
    # of adds) by the matrices' shapes and the CPU, so a wider cache or pass must not reach them
    for m in range(M):
        t = int(pos[m]) + 1
        s = np.matmul(qg[m], kf[:t].transpose(1, 2, 0)) * scale  # [n_kv, g, t]
        e = expf_fn(s - s.max(axis=-1, keepdims=True))
        inv_l = F32(1) / tree_sum(e)
        out[m] = (np.matmul(e, vf[:t].transpose(1, 0, 2)) * inv_l[..., None]).reshape(-1)  # [n_kv, g, hd]
    return out


def route(logits, top_k, norm_topk_prob, expf_fn=None):
    expf_fn = expf_fn or transcend.expf
    e = expf_fn(logits - logits.max(axis=-1, keepdims=True))
    p = e * (F32(1) / tree_sum(e))[..., None]
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, idx, axis=-1)
    if norm_topk_prob:
        w = w * (F32(1) / tree_sum(w))[..., None]
    return idx, w


def silu(x, expf_fn=None):
    expf_fn = expf_fn or transcend.expf
    return x * (F32(1) / (F32(1) + expf_fn(-x)))


def combine(y, w):
    return tree_sum(w[..., None] * y, axis=1)


def sim_ops(exact: frozenset[str]) -> Ops:
    """The op table with every toggle not in `exact` swapped for its fast version: the registry's
    (backends/toggles.py) op-table entries of that toggle, each this module's function of that name."""
    from .toggles import REGISTRY

    fast = globals()
    return replace(EXACT, **{name: fast[name] for op in REGISTRY if op.name not in exact for name in op.ops})

