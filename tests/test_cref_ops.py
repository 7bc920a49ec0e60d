"""kestrel_tui/cref/ops.c against the numpy reference ops (backends/ops_exact.py), bit for bit.

Fresh random inputs on every run; a failure names the seed (np.random.default_rng(seed)
reproduces it). The numpy side is batched: one reference call covers many rows/columns.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kestrel_tui.backends import ops_exact as ox
from kestrel_tui.model.quant import quantize_rows_q8
from kestrel_tui.numerics import transcend

F32 = np.float32


def _builds(cref):
    """The SIMD levels that pick each build of the elementwise code (0: any x86-64; the CPU's best: the
    KC_V3 build where it has AVX2 and FMA); the best is put back afterwards by `at_level`."""
    top = cref.kc_gemv_simd(99)
    return sorted({0, top})


def at_level(cref, level, fn):
    top = cref.kc_gemv_simd(99)
    try:
        cref.kc_gemv_simd(level)
        return fn()
    finally:
        cref.kc_gemv_simd(top)


def _rng():
    seed = np.random.SeedSequence().entropy
    return seed, np.random.default_rng(seed)


def _p(a: np.ndarray) -> int:
    assert a.flags.c_contiguous
    return a.ctypes.data


def _same(got: np.ndarray, want: np.ndarray, what: str):
    """Bit-for-bit equality (float32 via their encodings, integers as they are)."""
    want = np.ascontiguousarray(want)
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (what, got.shape, want.shape, got.dtype, want.dtype)
    g, w = (got.view(np.uint32), want.view(np.uint32)) if got.dtype == F32 else (got, want)
    bad = np.flatnonzero((g != w).reshape(-1))
    if bad.size:
        i = np.unravel_index(bad[0], got.shape)
        raise AssertionError(f"{what}: {bad.size} of {got.size} differ; first at {i}: C {got[i]!r}"
                             f" ({g[i]:#x}) numpy {want[i]!r} ({w[i]:#x})")


# ---------------------------------------------------------------------------------- RMSNorm orders


def _norm_rows(rng, rows: int, n: int) -> np.ndarray:
    """Rows of mixed kinds: plain, huge (x*x overflows), tiny (x*x underflows, subnormals),
    a wide spread within the row, all zeros (either sign), sprinkled zeros."""
    x = rng.standard_normal((rows, n))
    kind = rng.integers(0, 6, rows)
    scale = np.ones(rows)
    scale[kind == 1] = 10.0 ** rng.uniform(17, 37, (kind == 1).sum())
    scale[kind == 2] = 10.0 ** rng.uniform(-45, -17, (kind == 2).sum())
    x = x * scale[:, None]
    wide = kind == 3
    x[wide] *= 10.0 ** rng.uniform(-30, 30, (wide.sum(), n))
    x = x.astype(F32)
    x[kind == 4] = np.where(rng.random(((kind == 4).sum(), 1)) < 0.5, F32(0), F32(-0.0))
    sprinkle = (kind == 5)[:, None] & (rng.random((rows, n)) < 0.2)
    x[sprinkle] = F32(0)
    return x


def _norm_case(seed, rng, fn, ref, n: int, elements: int) -> int:
    rows = -(-elements // n)
    x = _norm_rows(rng, rows, n)
    w = (rng.standard_normal(n) * rng.choice([1.0, 1e-3, 30.0])).astype(F32)
    eps = float(F32(rng.choice([1e-6, 1e-5, 1e-12])))
    out = np.empty_like(x)
    fn(_p(x), _p(w), rows, n, eps, _p(out))
    with np.errstate(over="ignore"):  # the huge rows' squares overflow on purpose
        want = ref(x, w, eps)
    _same(out, want, f"{ref.__name__} n={n} eps={eps} seed={seed}")
    return rows * n


def test_rmsnorm_orders(cref):
    seed, rng = _rng()
    total = 0
    for n in (8, 13, 256, 1024, 2048, 2049):
        total += _norm_case(seed, rng, cref.kc_rmsnorm, ox.rmsnorm, n, 180_000)
    assert total >= 10**6, total
    # qknorm: rows are heads of head_dim elements
    total = 0
    for n in (64, 96, 128):
        total += _norm_case(seed, rng, cref.kc_qknorm, ox.qknorm, n, 350_000)
    assert total >= 10**6, total


# ---------------------------------------------------------------------------------- RoPE


def _inv_freq(hd: int, theta: float) -> np.ndarray:
    i = np.arange(hd // 2, dtype=np.float64)
    return (1.0 / theta ** (2 * i / hd)).astype(F32)


@pytest.mark.parametrize("hd", [64, 96, 128, 640])  # 640: half > 256, the angles take two chunks in ops.c
def test_rope(cref, hd):
    seed, rng = _rng()
    M, heads, half = 1024, int(rng.integers(1, 9)), hd // 2
    pos = np.concatenate([[0, 1, 40960, 40959], rng.integers(0, 40961, M - 4)]).astype(np.int64)
    inv = _inv_freq(hd, float(rng.choice([1e4, 1e6, 5e5])))
    rc, rs = ox.rope_cos_sin(pos, inv)
    for level in _builds(cref):
        cos, sin = np.empty((M, half), F32), np.empty((M, half), F32)
        at_level(cref, level, lambda: cref.kc_rope_cos_sin(_p(pos), M, _p(inv), half, _p(cos), _p(sin)))
        _same(cos, rc, f"cos hd={hd} level={level} seed={seed}")
        _same(sin, rs, f"sin hd={hd} level={level} seed={seed}")

    x = (rng.standard_normal((M, heads, hd)) * 10.0 ** rng.uniform(-3, 3, (M, heads, 1))).astype(F32)
    want = ox.rope(x, rc, rs)
    out = np.empty_like(x)
    cref.kc_rope(_p(x), M, heads, hd, _p(rc), _p(rs), _p(out))
    _same(out, want, f"rope hd={hd} seed={seed}")
    cref.kc_rope(_p(x), M, heads, hd, _p(rc), _p(rs), _p(x))  # in place
    _same(x, want, f"rope in place hd={hd} seed={seed}")


# ---------------------------------------------------------------------------------- attention


def _qkv(rng, style: str, M: int, nh: int, nkv: int, T: int, hd: int):
    q = rng.standard_normal((M, nh, hd))
    k = rng.standard_normal((T, nkv, hd))
    v = rng.standard_normal((T, nkv, hd)) * rng.choice([1.0, 1e-3, 1e3])
    if style == "ties":  # a few distinct keys repeated (tied scores, a max reached again), or one key everywhere
        pool = rng.integers(1, 4)
        k = k[rng.integers(0, pool, T)]
        v = np.where(rng.random((T, 1, 1)) < 0.5, v, v[:1])
    elif style == "spread":  # scores hundreds apart: most weights underflow, maxima move
        q *= rng.uniform(8, 40)
        k += np.linspace(-3, 3, T)[:, None, None] * rng.choice([-1, 1]) * rng.standard_normal(hd)
    elif style == "rising":  # a new maximum at every position: c < 1 at each step
        q = np.abs(q) * rng.uniform(1, 20)
        k = np.linspace(0, 1, T)[:, None, None] + 0.01 * k
    elif style == "zero_q":  # all-zero query heads (every score 0, query q8 scale 0) and constant ones
        q[:] = 0
        q[rng.random((M, nh)) < 0.5] = 1.0
    return q.astype(F32), k.astype(F32), v.astype(F32)


def _attention_case(cref, rng, seed, hd: int, ratio: int, kv_q8: bool, style: str) -> int:
    nkv = int(rng.choice([1, 2, 4, 8]))
    nh = nkv * ratio
    M = int(rng.integers(1, 9))
    T = int(rng.integers(max(M, 2), 512))
    base = int(rng.integers(0, T - M + 1)) if rng.random() < 0.3 else T - M
    pos = (base + np.arange(M)).astype(np.int64)  # batch verify: consecutive, ascending
    q, k, v = _qkv(rng, style, M, nh, nkv, T, hd)
    if kv_q8:  # the cache as the numpy decoder writes it
        (kc, ks), (vc, vs) = quantize_rows_q8(k), quantize_rows_q8(v)
    else:
        kc, vc = k, v
        ks = vs = np.ones((T, nkv), F32)
    scale = F32(1 / np.sqrt(hd))
    want = ox.attention(q, {"k": kc, "ks": ks, "v": vc, "vs": vs}, pos, scale)
    what = f"hd={hd} nh={nh} nkv={nkv} q8={kv_q8} {style} M={M} T={T} pos={pos} seed={seed}"
    for level, threads in itertools.product(_builds(cref), (1, 2)):
        out = np.empty((M, nh * hd), F32)
        at_level(cref, level, lambda: cref.kc_attention(_p(q), M, nh, nkv, hd, _p(kc), _p(ks), _p(vc), _p(vs),
                                                         int(kv_q8), _p(pos), scale, _p(out), threads))
        _same(out, want, f"{what} level={level} threads={threads}")
    return nh * int((pos + 1).sum())  # scores (one per head and attended position)


@pytest.fixture
def shared(cref):
    """Every op of two or more pieces shared by the team (small ones run on the caller alone by default)."""
    cref.kc_team_share_min(0)
    yield
    cref.kc_team_share_min(-1)


def test_attention_softmax_orders(cref, shared):
    seed, rng = _rng()
    total = 0
    while total < 10**6:  # every combination each round; one round is ~1.3e6 scores on average
        for hd, ratio, kv_q8, style in itertools.product(
                (64, 96, 128), (1, 2, 4, 8), (True, False), ("plain", "ties", "spread", "rising", "zero_q")):
            total += _attention_case(cref, rng, seed, hd, ratio, kv_q8, style)


# ---------------------------------------------------------------------------------- routing


def _logits(rng, rows: int, E: int) -> np.ndarray:
    """Router rows of mixed kinds, most with exact ties somewhere."""
    kind = rng.integers(0, 6, rows)
    x = rng.standard_normal((rows, E)) * 10.0 ** rng.uniform(-1, 1, (rows, 1))
    ints = rng.integers(-3, 4, (rows, E)).astype(np.float64)  # heavy ties; -0 and +0 both occur
    x = np.where((kind == 1)[:, None], ints * rng.choice([-1.0, 1.0], (rows, 1)), x)
    x = np.where((kind == 2)[:, None], rng.standard_normal((rows, 1)), x)  # all equal
    pool = rng.standard_normal((rows, 3))
    pick = np.take_along_axis(pool, rng.integers(0, 3, (rows, E)), axis=1)
    x = np.where((kind == 3)[:, None], pick, x)  # three values repeated
    x = np.where((kind == 4)[:, None], x * 60, x)  # wide: most p underflow to exactly 0 (tied at 0)
    x = np.where((kind == 5)[:, None], 1.0 + 1e-7 * rng.standard_normal((rows, E)), x)  # p ties by rounding
    return x.astype(F32)


class _ExpfOnce:
    """The reference expf, computed once per logits batch: route() with norm_topk on or off and
    any k exponentiates the same shifted logits (the replica is the slow part of this test)."""

    def __init__(self):
        self.key = self.val = None

    def __call__(self, x):
        if self.key is None or self.key.shape != x.shape or not np.array_equal(self.key.view(np.uint32),
                                                                                  x.view(np.uint32)):
            self.key, self.val = x.copy(), transcend.expf(x)
        return self.val


def test_routing_ties(cref):
    seed, rng = _rng()
    total = 0
    for E, rows in ((8, 100_000), (16, 50_000), (128, 20_000)):
        logits = _logits(rng, rows, E)
        expf = _ExpfOnce()
        for top_k in (2, 4, 8):
            for norm in (False, True):
                ridx, rw = ox.route(logits, top_k, norm, expf=expf)
                for level in _builds(cref):
                    idx, w = np.empty((rows, top_k), np.int64), np.empty((rows, top_k), F32)
                    at_level(cref, level, lambda: cref.kc_route(_p(logits), rows, E, top_k, int(norm), _p(idx),
                                                                _p(w)))
                    what = f"E={E} k={top_k} norm={norm} level={level} seed={seed}"
                    _same(idx, ridx.astype(np.int64), f"idx {what}")
                    _same(w, rw, f"w {what}")
                total += rows
    assert total >= 10**6, total


def test_routing_all_equal(cref):
    """Every expert tied: the first k in index order, equal weights."""
    logits = np.full((3, 16), F32(0.25))
    logits[1] = F32(-0.0)
    logits[2] = F32(7)
    idx, w = np.empty((3, 4), np.int64), np.empty((3, 4), F32)
    cref.kc_route(_p(logits), 3, 16, 4, 1, _p(idx), _p(w))
    assert (idx == np.arange(4)).all()
    _same(w, np.full((3, 4), F32(0.25)), "all equal")


# ---------------------------------------------------------------------------------- combine


def test_combine(cref):
    seed, rng = _rng()
    for top_k in (1, 2, 4, 8):
        M, n = 64, 2048
        y = (rng.standard_normal((M, top_k, n)) * 10.0 ** rng.uniform(-20, 20, (M, top_k, 1))).astype(F32)
        y[rng.random(y.shape) < 0.05] = F32(-0.0)
        w = rng.random((M, top_k)).astype(F32)
        w[rng.random(w.shape) < 0.1] = F32(0)
        out = np.empty((M, n), F32)
        cref.kc_combine(_p(y), _p(w), M, top_k, n, _p(out))
        _same(out, ox.combine(y, w), f"k={top_k} seed={seed}")
