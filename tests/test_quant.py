"""model/quant.py against the gguf package's numpy port of ggml's reference quantizers, bit for bit,
and the q8 KV/query row quantizer against an independent per-element implementation."""
from decimal import ROUND_HALF_UP, Decimal

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # subnormal/huge cases, on purpose
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize as gg_dequantize  # noqa: E402
from gguf.quants import quantize as gg_quantize  # noqa: E402

from kestrel_tui.model.quant import (  # noqa: E402
    dequantize_q4_0, q4_0_from_ggml, q4_0_to_ggml, q8_0_to_ggml, quantize_q4_0, quantize_q8_0,
    quantize_rows_q8,
)
from kestrel_tui.model.weights import make_linear  # noqa: E402

SHAPES = [(1, 32), (4, 64), (7, 256), (3, 5, 96)]


def _blocks_with_ties(rng, shape):
    """Every 32-block holds +m and -m (max magnitude tie), in a random order: the first one wins."""
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    b = x.reshape(-1, 32)
    for row in b:
        i, j = rng.choice(32, 2, replace=False)
        m = np.float32(rng.choice([1.0, 3.0, 0.37, 2.0**-10]))
        row[i], row[j] = m, -m
    return x


def _zero_blocks(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    b = x.reshape(-1, 32)
    b[::2] = 0  # every other block all zeros, plus a block of -0.0
    b[-1] = np.float32(-0.0)
    return x


def _mixed(rng, shape):
    """Each block scaled by 10^U(-8, 4): per-block scales spanning many binades."""
    x = rng.standard_normal(shape).astype(np.float32)
    b = x.reshape(-1, 32)
    b *= (10.0 ** rng.uniform(-8, 4, (b.shape[0], 1))).astype(np.float32)
    return x


DISTS = {
    "normal": lambda r, s: r.standard_normal(s).astype(np.float32),
    "normal_small": lambda r, s: (r.standard_normal(s) * 0.02).astype(np.float32),
    "uniform": lambda r, s: r.uniform(-1, 1, s).astype(np.float32),
    "uniform_pos": lambda r, s: r.uniform(0, 5, s).astype(np.float32),
    "heavy_tail": lambda r, s: r.standard_t(1.5, s).astype(np.float32),
    "cauchy": lambda r, s: r.standard_cauchy(s).astype(np.float32),
    "zero_blocks": _zero_blocks,
    "ties": _blocks_with_ties,
    "tiny": lambda r, s: (r.standard_normal(s) * 1e-6).astype(np.float32),
    "subnormal": lambda r, s: (r.standard_normal(s) * 1e-39).astype(np.float32),  # f32 subnormals
    "f16_subnormal": lambda r, s: (r.standard_normal(s) * 1e-5).astype(np.float32),  # d is an f16 subnormal
    "large": lambda r, s: (r.standard_normal(s) * 3e4).astype(np.float32),  # d near the f16 maximum
    "mixed_scales": _mixed,
    "small_ints": lambda r, s: r.integers(-9, 10, s).astype(np.float32),  # exact x/d = k + 0.5 cases
}
CASES = [(d, s, seed) for seed, (d, s) in enumerate((d, s) for d in DISTS for s in SHAPES)]


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a.view(np.uint8)


def _same(a, b):
    """Bitwise equality (NaN payloads included)."""
    a, b = _bits(a), _bits(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    bad = np.flatnonzero(a.ravel() != b.ravel())
    assert bad.size == 0, f"{bad.size} of {a.size} differ; first at flat index {bad[0]}"


@pytest.mark.parametrize("dist,shape,seed", CASES, ids=[f"{d}-{'x'.join(map(str, s))}" for d, s, _ in CASES])
def test_q4_0_matches_gguf(dist, shape, seed):
    x = DISTS[dist](np.random.default_rng(1000 + seed), shape)
    out, inp = shape[-2:]
    qs, d = quantize_q4_0(x)
    nb = inp // 32
    assert qs.shape == (*shape[:-2], nb, out, 32) and qs.dtype == np.int8
    assert d.shape == (*shape[:-2], nb, out) and d.dtype == np.float32
    assert qs.min() >= -8 and qs.max() <= 7
    ref = gg_quantize(x.reshape(-1, inp), QT.Q4_0)  # [rows, nb*18]
    rows = x.reshape(-1, out, inp).shape[0]
    mine = np.concatenate([q4_0_to_ggml(qs.reshape(rows, nb, out, 32)[i], d.reshape(rows, nb, out)[i])
                           for i in range(rows)]).reshape(ref.shape)
    _same(mine, ref)
    # ggml bytes -> our layout, both from gguf's bytes and as a round trip
    for i in range(rows):
        qs2, d2 = q4_0_from_ggml(ref.reshape(rows, out, -1)[i], out, inp)
        _same(qs2, qs.reshape(rows, nb, out, 32)[i])
        _same(d2, d.reshape(rows, nb, out)[i])
    # dequantization: value = d * (q - 8), bit for bit with gguf's (NaN from inf*0 included)
    with np.errstate(invalid="ignore", over="ignore"):
        deq = dequantize_q4_0(qs, d)
        ref_deq = gg_dequantize(ref, QT.Q4_0).reshape(shape)
    _same(deq, ref_deq)
    # the Linear a checkpoint becomes holds exactly these blocks, as gguf's bytes
    lin = make_linear(x, "q4_0")
    _same(lin.ggml.reshape(ref.shape), ref)
    _same(lin.qs, qs)
    _same(lin.d, d)
    with np.errstate(invalid="ignore", over="ignore"):
        _same(lin.dense(), deq)


@pytest.mark.parametrize("dist,shape,seed", CASES, ids=[f"{d}-{'x'.join(map(str, s))}" for d, s, _ in CASES])
def test_q8_0_matches_gguf(dist, shape, seed):
    x = DISTS[dist](np.random.default_rng(2000 + seed), shape)
    n = shape[-1]
    qs, d = quantize_q8_0(x)
    assert qs.shape == (*shape[:-1], n // 32, 32) and qs.dtype == np.int8 and d.shape == (*shape[:-1], n // 32)
    _same(d, d.astype(np.float16).astype(np.float32))  # the scales are f16 values
    ref = gg_quantize(x.reshape(-1, n), QT.Q8_0)
    mine = q8_0_to_ggml(qs.reshape(-1, n // 32, 32), d.reshape(-1, n // 32)).reshape(ref.shape)
    _same(mine, ref)
    with np.errstate(invalid="ignore", over="ignore"):
        deq = (qs.astype(np.float32) * d[..., None]).reshape(shape)
        ref_deq = gg_dequantize(ref, QT.Q8_0).reshape(shape)
    _same(deq, ref_deq)


def test_q4_0_known_block():
    """A hand-checked block: max-magnitude element first on ties, d = max/-8, q = min(15, trunc(x/d + 8.5))."""
    x = np.zeros((1, 32), np.float32)
    x[0, :6] = [-4.0, 4.0, 1.0, -1.0, 0.25, 3.75]  # -4 comes first: d = -4/-8 = 0.5
    qs, d = quantize_q4_0(x)
    assert d[0, 0] == np.float32(0.5)
    # x/d + 8.5 = -8+8.5, 8+8.5 (clamped to 15), 2+8.5, -2+8.5, 0.5+8.5, 7.5+8.5 (clamped)
    assert (qs[0, 0, :6] + 8).tolist() == [0, 15, 10, 6, 9, 15]
    assert (qs[0, 0, 6:] + 8 == 8).all()
    raw = q4_0_to_ggml(qs, d)
    assert raw.shape == (1, 1, 18)
    assert raw[0, 0, :2].view(np.float16)[0] == np.float16(0.5)
    assert raw[0, 0, 2] == 0 | (8 << 4)  # element 0 in the low nibble, element 16 in the high one
    _same(raw.reshape(1, 18), gg_quantize(x, QT.Q4_0))


# ---------------------------------------------------------------- q8 rows (KV cache / query)

def _f32(v: float) -> float:
    """Round a double to the nearest f32 (exact for the single ops here: 53 >= 2*24+2, so the
    double-rounded quotient/product equals the correctly rounded f32 one)."""
    return float(np.float32(v))


def _roundf_ref(v: float) -> int:
    return int(Decimal(v).quantize(Decimal(1), rounding=ROUND_HALF_UP))  # ties away from zero


def _rows_q8_ref(row: np.ndarray) -> tuple[list[int], float]:
    vals = [float(v) for v in row]
    amax = max(abs(v) for v in vals)
    d = _f32(amax / 127.0)
    inv = 0.0 if d == 0.0 else _f32(1.0 / d)
    q = [max(-127, min(127, _roundf_ref(_f32(v * inv)))) for v in vals]
    return q, d


DISTS["very_small"] = lambda r, s: (r.standard_normal(s) * 1e-30).astype(np.float32)
# f32-subnormal rows are not here: see test_rows_q8_overflowing_reciprocal
ROW_DISTS = ["normal", "uniform", "heavy_tail", "zero_blocks", "ties", "tiny", "very_small", "large",
             "small_ints", "mixed_scales"]


@pytest.mark.parametrize("dist", ROW_DISTS)
def test_rows_q8_rule(dist):
    rng = np.random.default_rng(hash(dist) % 2**32)
    x = DISTS[dist](rng, (3, 4, 64))
    x[0, 0] = 0  # an all-zero row: scale 0, values 0
    q, d = quantize_rows_q8(x)
    assert q.dtype == np.int8 and q.shape == x.shape and d.dtype == np.float32 and d.shape == x.shape[:-1]
    assert d[0, 0] == 0 and (q[0, 0] == 0).all()
    assert q.min() >= -127  # -128 never appears
    for idx in np.ndindex(*x.shape[:-1]):
        q_ref, d_ref = _rows_q8_ref(x[idx])
        assert float(d[idx]) == d_ref, (idx, d[idx], d_ref)
        assert q[idx].tolist() == q_ref, idx


def test_rows_q8_ties_and_clamp():
    """Exact halves round away from zero; x*id rounding above 127 is clamped."""
    # amax 127 -> d = 1, id = 1: q = roundf(x) exactly
    row = np.array([127, -0.5, 0.5, 1.5, -1.5, 2.5, -2.5, 126.5] + [0] * 24, np.float32)
    q, d = quantize_rows_q8(row)
    assert d == np.float32(1)
    assert q[:8].tolist() == [127, -1, 1, 2, -2, 3, -3, 127]
    # a row whose max maps to slightly above 127 after the f32 reciprocal still gives 127
    for amax in np.float32([0.1, 0.3, 1.1, 3.3, 7e-3, 1e30, 1e-30]):
        r = np.array([amax, -amax] + [0] * 30, np.float32)
        q, d = quantize_rows_q8(r)
        assert q[0] == 127 and q[1] == -127, amax
        assert float(d) == _f32(float(amax) / 127.0)


def test_rows_q8_overflowing_reciprocal():
    """Rows so tiny that 1/d overflows quantize to zeros (docs/numerics.md): the
    literal rule would compute inf*x and NaN, whose int8 cast is undefined."""
    x = np.zeros(32, np.float32)
    x[0], x[1] = np.float32(1e-37), np.float32(-5e-38)
    q, d = quantize_rows_q8(x)
    assert d == np.float32(1e-37) / np.float32(127)
    assert (q == 0).all()
    qs, d8 = quantize_q8_0(x)
    assert (qs == 0).all()
