"""GEMV in the contract's order: exact block dots, then the 32-lane sum of block terms.

q4_0 x q8_0: isum = sum(qw*qx) per 32-block (exact), term = float(isum) * (dw*dx),
y = lane_sum(terms over blocks). f32: y = lane_sum(w[i]*x[i] over elements).
Every column of a multi-column call is computed on its own, so batch-verify
columns equal M=1 decode by construction.

Memory and speed. q4_0 weights stay packed (ggml's 18-byte blocks, model/weights.py);
a call walks the output rows in chunks of about CHUNK_ELEMS f32 elements of
temporaries (about 1 MB, sized to stay in cache, whatever the matrix; one row's
block sums grow with the column count M, 3*nb*M values): each chunk's
nibbles are widened to f32 once and used for every column of the call, so an
M-column step (prefill, batch-verify) costs one widening, not M. Expert stacks
widen only the experts the step selected, each once for all the columns that
chose it (small experts are batched several to a chunk, their column lists padded
to one length; the padding columns are computed and dropped). Several matrices of
one input (q/k/v, gate/up) are walked as one stack of rows without being copied
together. Chunking never changes a bit: every output row is computed on its own.

The block dot on BLAS. A block's 16 nibble bytes b_j = lo_j + 16*hi_j hold elements
j (lo) and j+16 (hi), each q-8 with q in 0..15, so

    isum = sum_j (lo_j-8)*x_j + (hi_j-8)*x_{j+16}
         = sum_j b_j*x_j  +  sum_j hi_j*(x_{j+16} - 16*x_j)  -  8*sum_k x_k

needs only two widenings, each one contiguous cast of the chunk's bytes (the bytes
as they are, and their high nibbles; the scale bytes ride along with weight 0).
Every product and every partial sum is an integer of magnitude < 2^20 (|x| <= 127),
so an f32 matmul computes both sums exactly in any order, FMA or not; adding them
and subtracting 8*sum(x) (exact, < 2^15) leaves the exact isum.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..model.quant import BLOCK_BYTES, quantize_q8_0
from ..model.weights import Linear
from .reduce import lane_sum

F32 = np.float32

# f32 elements of temporaries per chunk (1 MB): measured fastest on a 2-core VM (the widened
# chunk and its block sums stay in cache); any value gives the same bits.
CHUNK_ELEMS = 1 << 18

# (isum [g, nb, rows, n], dw [g, nb, rows, 1], dx [g or 1, nb, 1, n]) -> y [g, rows, n]
Reduce = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., n] -> (qx f32 [..., nb, 32] holding int8 values, dx f32 [..., nb])."""
    qs, d = quantize_q8_0(x)
    return qs.astype(np.float32), d


def exact_terms(isum: np.ndarray, dw: np.ndarray, dx: np.ndarray) -> np.ndarray:
    """The contract: term = float(isum) * (dw*dx) (the scale product rounded first), lane-summed
    over the blocks (axis 1)."""
    return lane_sum(isum * (dw * dx), axis=1)


def _jobs(n_rows: int, per_row: Callable[[int], int], cols: list[np.ndarray]):
    """Chunks of work: (matrix indices [g], their column lists padded to one length [g, n], rows r0..r1).

    cols[u] lists the columns that use matrix u (an expert; or the one matrix). Matrices that fit
    a chunk whole are batched, padded to the longest column list of the batch (the longest lists
    come first, so a batch pads little); a matrix larger than a chunk is cut into row ranges."""
    def batch(group: list[int]):
        idx = np.empty((len(group), len(cols[group[0]])), np.intp)
        for i, u in enumerate(group):
            c = cols[u]
            idx[i, :len(c)] = c
            idx[i, len(c):] = c[-1]  # padding: a real column, computed and dropped
        return group, idx, 0, n_rows

    group: list[int] = []
    for u in sorted(range(len(cols)), key=lambda u: -len(cols[u])):
        n = len(cols[u])
        if n_rows * per_row(n) > CHUNK_ELEMS:
            step = max(1, CHUNK_ELEMS // per_row(n))
            for r0 in range(0, n_rows, step):
                yield [u], cols[u][None], r0, min(n_rows, r0 + step)
            continue
        n_max = len(cols[group[0]]) if group else n
        if group and (len(group) + 1) * n_rows * per_row(n_max) > CHUNK_ELEMS:
            yield batch(group)
            group = []
        group.append(u)
    if group:
        yield batch(group)


def _columns(expert: np.ndarray | None, n_src: int) -> tuple[list[np.ndarray], list[int] | None, np.ndarray]:
    """-> (per-matrix column lists, the expert id of each matrix (None: one matrix), the x row of
    every column).

    Without experts the columns are the rows of x. With expert [M, k] the columns are the M*k
    (token, slot) pairs in that order, grouped by expert; pair (m, j) reads x row m*k + j, or row m
    when x holds one row per token ([M, 1, in], shared by the k slots)."""
    if expert is None:
        return [np.arange(n_src)], None, np.arange(n_src)
    M, k = expert.shape
    pairs = np.arange(M * k)
    src = pairs if n_src == M * k else pairs // k
    flat = expert.reshape(-1)
    order = np.argsort(flat, kind="stable")
    ids = flat[order]
    starts = [0, *(np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist(), len(ids)]
    return [order[a:b] for a, b in zip(starts[:-1], starts[1:])], ids[starts[:-1]].tolist(), src


def _row_parts(parts: tuple[Linear, ...], r0: int, r1: int):
    """(part, its rows a..b, offset in the chunk) for the stacked rows r0..r1 of several matrices."""
    base = 0
    for p in parts:
        a, b = max(r0, base), min(r1, base + p.out)
        if a < b:
            yield p, a - base, b - base, a - r0
        base += p.out


def q4_gemv(parts: tuple[Linear, ...], xq: tuple[np.ndarray, np.ndarray], expert: np.ndarray | None = None,
            reduce: Reduce = exact_terms) -> np.ndarray:
    """y = [W_1; W_2; ...] x for q4_0 matrices of one input, rows stacked in part order.

    xq: the q8_0 activation (qx [..., nb, 32], dx [..., nb]). Without `expert`: y [..., sum(out)].
    With expert [M, k] (x [M, k or 1, in], stacked matrices [E, out, in]): y [M, k, sum(out)].
    `reduce` turns the exact block sums into outputs (the contract's exact_terms, or the sim's
    fast order)."""
    qx, dx = xq
    lead = dx.shape[:-1]
    nb = dx.shape[-1]
    qx, dx = qx.reshape(-1, nb, 32), dx.reshape(-1, nb)
    # the activation side of the two byte dots, laid out like a block's 18 bytes: the two scale
    # bytes get weight 0, byte j gets x_j (first dot) and x_{j+16} - 16*x_j (second dot)
    lo = qx[..., :16]
    x1 = np.zeros((*dx.shape, BLOCK_BYTES), F32)
    x2 = np.zeros((*dx.shape, BLOCK_BYTES), F32)
    x1[..., 2:] = lo
    x2[..., 2:] = qx[..., 16:] - F32(16) * lo
    c8 = F32(8) * qx.sum(axis=-1)  # [S, nb], exact integers
    cols, experts, src = _columns(expert, dx.shape[0])
    n_rows = sum(p.out for p in parts)
    y = np.empty((len(src), n_rows), F32)
    if experts is None:  # one column set for every chunk: lay it out once
        x1_all = np.ascontiguousarray(x1.transpose(1, 2, 0))[None]  # [1, nb, 18, S]
        x2_all = np.ascontiguousarray(x2.transpose(1, 2, 0))[None]
        c8_all, dx_all = c8.T[None, :, None, :], dx.T[None, :, None, :]  # [1, nb, 1, S]

    def per_row(n: int) -> int:  # f32 elements of one row of a chunk: two widened copies + ~3 [nb, n] temporaries
        return 2 * BLOCK_BYTES * nb + 3 * nb * n

    for units, cidx, r0, r1 in _jobs(n_rows, per_row, cols):
        ex = None if experts is None else [experts[u] for u in units]
        g, rows = len(units), r1 - r0
        # whole-chunk contiguous casts (scale bytes included: their weight is 0) — several times
        # faster in numpy than widening the nibbles into a strided layout
        w1 = np.empty((g, rows, nb, BLOCK_BYTES), F32)  # the bytes as they are, 0..255
        w2 = np.empty((g, rows, nb, BLOCK_BYTES), F32)  # their high nibbles, 0..15
        dw = np.empty((g, nb, rows, 1), F32)
        for p, a, b, off in _row_parts(parts, r0, r1):
            blk = p.blocks[a:b][None] if ex is None else p.blocks[ex, a:b]  # [g, b-a, nb, 18]
            np.copyto(w1[:, off:off + b - a], blk, casting="unsafe")
            np.copyto(w2[:, off:off + b - a], blk >> np.uint8(4), casting="unsafe")
            dw[:, :, off:off + b - a, 0] = blk[..., :2].view(np.float16)[..., 0].transpose(0, 2, 1)
        if ex is None:
            x1t, x2t, c8t, dxt = x1_all, x2_all, c8_all, dx_all
        else:
            s = src[cidx]  # [g, n] x rows
            x1t = np.ascontiguousarray(x1[s].transpose(0, 2, 3, 1))  # [g, nb, 18, n]
            x2t = np.ascontiguousarray(x2[s].transpose(0, 2, 3, 1))
            c8t, dxt = c8[s].transpose(0, 2, 1)[:, :, None, :], dx[s].transpose(0, 2, 1)[:, :, None, :]
        isum = np.matmul(w1.transpose(0, 2, 1, 3), x1t)  # [g, nb, rows, n]
        isum += np.matmul(w2.transpose(0, 2, 1, 3), x2t)
        isum -= c8t
        out = reduce(isum, dw, dxt)  # [g, rows, n]
        if ex is None:
            y[:, r0:r1] = out[0].T
        else:
            for i, u in enumerate(units):
                y[cols[u], r0:r1] = out[i, :, :len(cols[u])].T
    return y.reshape(*lead, n_rows) if expert is None else y.reshape(*expert.shape, n_rows)


def f32_gemv(parts: tuple[Linear, ...], x: np.ndarray, expert: np.ndarray | None = None) -> np.ndarray:
    """The f32 GEMV of the contract, y = lane_sum(w[i]*x[i]), in row chunks (shapes as q4_gemv)."""
    lead = x.shape[:-1]
    xs = x.reshape(-1, x.shape[-1])
    cols, experts, src = _columns(expert, xs.shape[0])
    n_rows = sum(p.out for p in parts)
    y = np.empty((len(src), n_rows), F32)
    inp = parts[0].inp

    def per_row(n: int) -> int:  # the [n, rows, in] products and lane_sum's copy of a 32nd of them
        return 2 * n * inp

    for units, cidx, r0, r1 in _jobs(n_rows, per_row, cols):
        ex = None if experts is None else [experts[u] for u in units]
        segs = list(_row_parts(parts, r0, r1))
        if ex is None and len(segs) == 1:  # one matrix's rows: a view, no copy
            p, a, b, _ = segs[0]
            w = p.w[a:b][None]
        else:
            w = np.empty((len(units), r1 - r0, inp), F32)
            for p, a, b, off in segs:
                w[:, off:off + b - a] = p.w[a:b][None] if ex is None else p.w[ex, a:b]
        xr = xs[src[cidx]]  # [g, n, in]
        out = lane_sum(w[:, None, :, :] * xr[:, :, None, :], axis=-1)  # [g, n, rows]
        if ex is None:
            y[:, r0:r1] = out[0]
        else:
            for i, u in enumerate(units):
                y[cols[u], r0:r1] = out[i, :len(cols[u])]
    return y.reshape(*lead, n_rows) if expert is None else y.reshape(*expert.shape, n_rows)


def gemv_parts(parts: tuple[Linear, ...], x: np.ndarray | None = None, xq: tuple | None = None,
               expert: np.ndarray | None = None) -> np.ndarray:
    """The GEMVs of several matrices of one input, outputs side by side along the last axis."""
    if parts[0].w is not None:
        return f32_gemv(parts, x, expert)
    return q4_gemv(parts, xq if xq is not None else quantize_act(x), expert)


def gemv(lin: Linear, x: np.ndarray | None = None, xq: tuple | None = None,
         expert: np.ndarray | None = None) -> np.ndarray:
    """y[..., out] = W x[..., in] in the contract order. Pass `xq` to reuse one q8_0
    quantization of the activation across several matrices."""
    return gemv_parts((lin,), x, xq, expert)
