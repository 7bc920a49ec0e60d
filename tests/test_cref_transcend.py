"""The compiled reference's transcendentals (kestrel_tui/cref/transcend.c) against the numpy
replicas (kestrel_tui/numerics/transcend.py), bit for bit.

* **random** -- >= 10^6 fresh float32 inputs per primitive: uniform bit patterns (every
  exponent, subnormals, inf, NaN) and the ranges that matter (expf [-110, 90], cos/sin
  [-1e5, 1e5] and RoPE angles ``f32(pos) * inv_freq``, silu [-100, 100]);
* **edges** -- zeros, inf, NaN, subnormals, FLT_MAX, every branch threshold and its float
  neighbours (np.nextafter);
* **binary64** -- the double each routine rounds to float32 (transcend.c's test hooks
  kc_{expf,cosf,sinf}_double, not in cref.h) against numpy's (_expf_double,
  _trig(double=True)): a wrong intermediate fma almost never moves a float32 output
  (~2^-28 per input), so the float32 tests alone would not see it; the doubles always do;
* **API** -- kc_expf1 equals kc_expf elementwise, kc_sincosf equals kc_cosf/kc_sinf,
  outputs may alias the input.

NaN matches any NaN (payloads are not part of the contract). The one permitted difference is
the huge-argument range of cosf/sinf (|x| >= 3.37e9 / 16779436), which neither reference
replicates: numpy falls back to np.cos/np.sin in binary64, the C to libm's cos/sin, each
rounded once to float32. There the C must equal float32(libm) (Python's math.cos/math.sin
call the same libm) and lie within 1 ulp of numpy.

Random inputs are fresh every run (seed from os.urandom, printed in every failure message;
KESTREL_TEST_SEED replays one).
"""

from __future__ import annotations

import ctypes
import math
import os

import numpy as np
import pytest

from kestrel_tui.numerics import transcend as tr
from kestrel_tui.numerics.transcend import cosf, expf, silu, sincosf, sinf

pytestmark = pytest.mark.filterwarnings("error")  # no stray FP warnings

N = 1_000_000  # random inputs per primitive, at least

# float32 bit patterns of the thresholds (transcend.py)
EXP_X_MAX = 0x42B17218  # 88.7228394f: above it +inf
AU_PIO4 = 0x3F490FDB  # |x| <= pi/4: direct polynomial
AU_TINY = 0x39000000  # 2^-13
AU_SMALL = 0x3C000000  # 2^-7
AU_CW_EXACT = 0x4AC65D40  # 6.5e6: numpy's exact-product limit of the Cody-Waite step
AU_HUGE = {"cos": 0x4F490FDB, "sin": 0x4B800456}  # the fallback range (not replicated)
AU_INF = 0x7F800000


FIXED = "none: fixed inputs"  # the 'seed' of the edge-case tests' messages


def _seed() -> int:
    env = os.environ.get("KESTREL_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(8), "little")


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _abs_bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32) & np.uint32(0x7FFFFFFF)


def _neighbours(values, k: int = 3) -> np.ndarray:
    """Each value, its k float32 neighbours on either side (np.nextafter), and the negations."""
    v = np.asarray(values, dtype=np.float32)
    out = [v]
    for toward in (np.float32(np.inf), np.float32(-np.inf)):
        w = v
        for _ in range(k):
            with np.errstate(over="ignore", invalid="ignore"):  # FLT_MAX -> inf; NaN stays NaN
                w = np.nextafter(w, toward)
            out.append(w)
    out = np.concatenate(out)
    return np.concatenate([out, -out])


def _uniform_bits(rng, n: int) -> np.ndarray:
    return rng.integers(0, 1 << 32, n, dtype=np.uint32).view(np.float32)


def _log_uniform(rng, lo: float, hi: float, n: int) -> np.ndarray:
    """Magnitudes log-uniform in [lo, hi], random signs (float32)."""
    mag = np.exp(rng.uniform(math.log(lo), math.log(hi), n))
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)


# ---------------------------------------------------------------------------
# calling the library


_LIB = None  # the library under test (the every_build fixture)


@pytest.fixture(autouse=True)
def every_build(cref):
    """Each C call below runs in both builds of transcend.c: for any x86-64 (SIMD level 0) and, where the
    CPU has AVX2 and FMA, the KC_V3 one (level >= 1: fma and rint as instructions). They must agree with
    each other bit for bit (NaN payloads too), and then with numpy."""
    global _LIB
    _LIB = cref
    yield
    _LIB = None


def _each_build(run):
    top = _LIB.kc_gemv_simd(99)
    outs = []
    try:
        for level in sorted({0, top}):
            _LIB.kc_gemv_simd(level)
            outs.append(run())
    finally:
        _LIB.kc_gemv_simd(top)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert a.tobytes() == b.tobytes(), "the two builds of transcend.c differ"
    return outs[0]


def _call(fn, x: np.ndarray) -> np.ndarray:
    assert x.dtype == np.float32 and x.flags.c_contiguous

    def run():
        y = np.empty_like(x)
        fn(x.ctypes.data, y.ctypes.data, x.size)
        return (y,)
    return _each_build(run)[0]


def _call_sincos(lib, x: np.ndarray):
    assert x.dtype == np.float32 and x.flags.c_contiguous

    def run():
        c, s = np.empty_like(x), np.empty_like(x)
        lib.kc_sincosf(x.ctypes.data, c.ctypes.data, s.ctypes.data, x.size)
        return c, s
    return _each_build(run)


def _np(fn, x):
    """The numpy replica; signalling-NaN inputs raise 'invalid' in its float64 widening."""
    with np.errstate(invalid="ignore"):
        return fn(x)


# ---------------------------------------------------------------------------
# comparisons


def _ordered(bits: np.ndarray) -> np.ndarray:
    """float32 encodings -> integers whose differences count ulps."""
    b = bits.astype(np.int64)
    return np.where(b & 0x80000000, -(b & 0x7FFFFFFF), b)


def _assert_bits(name, x, got, want, seed, mask=None):
    """got == want bit for bit (NaN matches any NaN), on mask (all elements by default)."""
    g, w = got.view(np.uint32), want.view(np.uint32)
    bad = (g != w) & ~(np.isnan(got) & np.isnan(want))
    if mask is not None:
        bad &= mask
    if bad.any():
        rows = [
            f"  x={x[i]!r} (0x{x[i:i + 1].view(np.uint32)[0]:08x}): C {got[i]!r} (0x{g[i]:08x}), "
            f"numpy {want[i]!r} (0x{w[i]:08x})"
            for i in np.flatnonzero(bad)[:8]
        ]
        pytest.fail(f"{name}: {bad.sum()} of {x.size if mask is None else mask.sum()} differ "
                    f"(seed {seed}):\n" + "\n".join(rows))


def _assert_trig(f, name, x, got, want, seed):
    """f = "cos" or "sin": bit for bit outside the huge range; inside it (finite |x| >= the
    threshold) the C is float32(libm) exactly and within 1 ulp of numpy's float32(np.cos/np.sin)."""
    au = _abs_bits(x)
    huge = (au >= AU_HUGE[f]) & (au < AU_INF)
    _assert_bits(name, x, got, want, seed, mask=~huge)
    if not huge.any():
        return
    idx = np.flatnonzero(huge)
    libm = math.cos if f == "cos" else math.sin
    ref = np.array([libm(v) for v in x[idx[:20_000]].tolist()]).astype(np.float32)
    _assert_bits(name + " (huge range vs libm)", x[idx[:20_000]], got[idx[:20_000]], ref, seed)
    dist = np.abs(_ordered(got[idx].view(np.uint32)) - _ordered(want[idx].view(np.uint32)))
    if dist.max() > 1:
        i = idx[np.argmax(dist)]
        pytest.fail(f"{name}: huge range off by {dist.max()} ulp from numpy at x={x[i]!r}: C {got[i]!r}, "
                    f"numpy {want[i]!r} (seed {seed})")
    print(f"\n{name}: {idx.size} huge-range inputs, {int((dist != 0).sum())} differ by 1 ulp from numpy")


# ---------------------------------------------------------------------------
# inputs


def _expf_inputs(rng, n=N):
    q = n // 8
    return np.concatenate([
        _uniform_bits(rng, 2 * q),
        rng.uniform(-110, 90, 4 * q).astype(np.float32),
        _log_uniform(rng, 1e-45, 1.0, q),  # n = 0 and the first few n, down to subnormal x
        rng.uniform(-104.5, -102.5, q // 2).astype(np.float32),  # subnormal results, the +0 clamp
        rng.uniform(87.0, 88.8, n - 7 * q - q // 2).astype(np.float32),  # the +inf clamp
    ])


def _rope_angles(rng, n):
    """f32(pos) * inv_freq as decoder.py computes them (theta 1e4 .. 1e6, head_dim 64 .. 256)."""
    out = []
    for theta, hd in ((1e4, 64), (1e6, 128), (5e5, 256)):
        inv_freq = (1.0 / theta ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
        pos = rng.integers(0, 1 << 17, n // 3).astype(np.float32)
        out.append(pos * inv_freq[rng.integers(0, hd // 2, n // 3)])
    return np.concatenate(out)


def _near_multiples_of_pio2(rng, n):
    """Floats next to k*pi/2 (tiny reduced arguments) and to (k+1/2)*pi/2 (n at a rounding
    boundary of the reduction), both signs."""
    k = rng.integers(1, 1 << 22, n)
    v = ((k + rng.choice([0.0, 0.5], n)) * (np.pi / 2)).astype(np.float32)
    v = np.nextafter(v, (np.float32(np.inf) * rng.choice([-1, 1], n)).astype(np.float32))
    return v * rng.choice(np.array([-1, 1], np.float32), n)


def _trig_inputs(rng, n=N):
    q = n // 8
    parts = [
        _uniform_bits(rng, q),
        rng.uniform(-1e5, 1e5, 3 * q).astype(np.float32),
        _rope_angles(rng, 2 * q),
        rng.uniform(-1.6, 1.6, q // 2).astype(np.float32),  # direct branch and first quadrants
        _log_uniform(rng, 1e-45, 0.8, q // 2),  # the small-|x| branches
        _near_multiples_of_pio2(rng, q // 2),
    ]
    rest = n - sum(p.size for p in parts)
    parts.append(_log_uniform(rng, 1e5, 4e9, rest))  # past 6.5e6, up to the huge range
    return np.concatenate(parts)


def _silu_inputs(rng, n=N):
    q = n // 4
    return np.concatenate([
        rng.uniform(-100, 100, 2 * q).astype(np.float32),
        (rng.standard_normal(q) * 4).astype(np.float32),  # typical gate activations
        _uniform_bits(rng, n - 3 * q),
    ])


_COMMON_EDGES = np.concatenate([
    np.array([0.0, np.inf, np.nan, 1.0, 0.5, 2.0, np.finfo(np.float32).max, np.finfo(np.float32).tiny],
             np.float32),
    _f32([0x00000001, 0x00000002, 0x007FFFFF, 0x7FC00000, 0x7F800001, 0x7FFFFFFF]),  # subnormals, NaNs
])


def _expf_edges():
    ln2_64 = math.log(2) / 64
    # x*K next to a half-integer: the rounding of n (no float32 is an exact tie; exhaustive search)
    ties = np.array([(k + 0.5) * ln2_64 for k in range(-9610, 9610, 97)], np.float32)
    return np.concatenate([
        _neighbours(_COMMON_EDGES, 1),
        _neighbours(_f32([EXP_X_MAX]), 8),  # 88.7228394f
        _neighbours(np.array([-104.0, -103.97, -87.3365, -87.33654, -88.72284, 88.0, 89.0, 100.0, 1e30],
                             np.float32), 8),
        _neighbours(ties, 1),
        _neighbours(np.array([ln2_64 / 2, ln2_64, 1 / 64], np.float32), 4),  # first rounding steps of n
    ])


def _trig_edges():
    thresholds = _f32([AU_PIO4, AU_TINY, AU_SMALL, AU_CW_EXACT, AU_HUGE["cos"], AU_HUGE["sin"]])
    k = np.arange(1, 65)
    # (k+1/2)*pi/2 +- 16 ulps, k < 4096: fma(|x|, 2/pi, 0.5) within 2^-20 of an integer, where
    # numpy redoes n with an exact fma (an exhaustive search finds 508 such floats below 3.37e9,
    # about 40% of them here; for none does the fma change n)
    mids = ((np.arange(4096) + 0.5) * (np.pi / 2)).astype(np.float32).view(np.uint32).astype(np.int64)
    mids = _f32((mids[:, None] + np.arange(-16, 17)).ravel())
    return np.concatenate([
        _neighbours(_COMMON_EDGES, 2),
        _neighbours(thresholds, 8),  # each branch threshold, pi/4 = 0x3f490fdb among them
        _neighbours(_f32([AU_PIO4]), 48),  # just above pi/4: n = 1 with r ~ -pi/4
        _neighbours(np.array([math.pi, math.pi / 2, 6.6e6, 1.6777e7, 2.0**24, 3.37e9, 1e10, 4096.0, 1e-20],
                             np.float32), 2),
        _neighbours((k * np.pi / 2).astype(np.float32), 2),  # tiny reduced arguments
        mids, -mids,
    ])


def _silu_edges():
    # expf's edges with either sign (_neighbours negates), so expf(-x) meets them all
    return np.concatenate([_expf_edges(), _neighbours(np.array([100.0, 20.0, 1e-20], np.float32), 2)])


# ---------------------------------------------------------------------------
# random inputs, >= 10^6 per primitive


def test_expf_random_million(cref):
    seed = _seed()
    x = _expf_inputs(np.random.default_rng(seed))
    assert x.size >= N
    _assert_bits("expf", x, _call(cref.kc_expf, x), _np(expf, x), seed)


@pytest.mark.parametrize("name", ["cosf", "sinf"])
def test_trig_random_million(cref, name):
    seed = _seed()
    x = _trig_inputs(np.random.default_rng(seed))
    assert x.size >= N
    fn, ref = (cref.kc_cosf, cosf) if name == "cosf" else (cref.kc_sinf, sinf)
    _assert_trig(name[:3], name, x, _call(fn, x), _np(ref, x), seed)


@pytest.mark.parametrize("inputs", ["random million", "edges"])
def test_sincosf(cref, inputs):
    if inputs == "edges":
        x, seed = _trig_edges(), FIXED
    else:
        seed = _seed()
        x = _trig_inputs(np.random.default_rng(seed))
        assert x.size >= N
    c, s = _call_sincos(cref, x)
    wc, ws = _np(sincosf, x)
    _assert_trig("cos", f"cos of sincosf, {inputs}", x, c, wc, seed)
    _assert_trig("sin", f"sin of sincosf, {inputs}", x, s, ws, seed)


def test_silu_random_million(cref):
    seed = _seed()
    x = _silu_inputs(np.random.default_rng(seed))
    assert x.size >= N
    _assert_bits("silu", x, _call(cref.kc_silu, x), _np(silu, x), seed)


# ---------------------------------------------------------------------------
# edges


def test_expf_edges(cref):
    x = _expf_edges()
    _assert_bits("expf edges", x, _call(cref.kc_expf, x), _np(expf, x), FIXED)
    # the special values themselves, as transcend.py documents them
    x_max = _f32([EXP_X_MAX])[0]
    below_max = np.nextafter(x_max, np.float32(0))
    v = np.array([0.0, -0.0, -np.inf, -104.5, -1e30, x_max, below_max, np.inf, np.nan], np.float32)
    got = _call(cref.kc_expf, v)
    assert list(got[:2].view(np.uint32)) == [0x3F800000] * 2  # expf(+-0) = 1 exactly
    assert list(got[2:5].view(np.uint32)) == [0] * 3  # +0
    assert got[5] == np.inf and np.isfinite(got[6]) and got[7] == np.inf and np.isnan(got[8])


@pytest.mark.parametrize("name", ["cosf", "sinf"])
def test_trig_edges(cref, name):
    x = _trig_edges()
    fn, ref = (cref.kc_cosf, cosf) if name == "cosf" else (cref.kc_sinf, sinf)
    got = _call(fn, x)
    _assert_trig(name[:3], name + " edges", x, got, _np(ref, x), FIXED)
    assert np.isnan(got[_abs_bits(x) >= AU_INF]).all()  # inf and NaN -> NaN
    tiny = _abs_bits(x) < AU_TINY
    if name == "cosf":
        assert (got[tiny] == 1.0).all()
    else:
        assert np.array_equal(got[tiny].view(np.uint32), x[tiny].view(np.uint32))  # sin(-0) = -0, subnormals


def test_silu_edges(cref):
    x = _silu_edges()
    _assert_bits("silu edges", x, _call(cref.kc_silu, x), _np(silu, x), FIXED)
    got = _call(cref.kc_silu, np.array([100.0, -100.0, 0.0, -0.0, np.inf, -np.inf], np.float32))
    assert got[0] == np.float32(100.0)
    assert list(got[1:4].view(np.uint32)) == [0x80000000, 0, 0x80000000]  # -100/inf = -0; +-0/2
    assert got[4] == np.inf and np.isnan(got[5])  # silu(-inf) = -inf/inf


# ---------------------------------------------------------------------------
# binary64 before the final rounding


def _call_double(lib, name, x: np.ndarray) -> np.ndarray:
    """transcend.c's test hook void kc_*_double(const float *x, double *y, int64_t n)."""
    assert x.dtype == np.float32 and x.flags.c_contiguous
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def run():
        y = np.empty(x.shape, np.float64)
        fn(x.ctypes.data, y.ctypes.data, x.size)
        return (y,)
    return _each_build(run)[0]


def _assert_doubles(name, x, got, want, seed):
    bad = got.view(np.uint64) != want.view(np.uint64)
    if bad.any():
        rows = [f"  x={x[i]!r} (0x{x[i:i + 1].view(np.uint32)[0]:08x}): C {float(got[i]).hex()}, "
                f"numpy {float(want[i]).hex()}" for i in np.flatnonzero(bad)[:8]]
        pytest.fail(f"{name} (binary64 before rounding): {bad.sum()} of {x.size} differ (seed {seed}):\n"
                    + "\n".join(rows))


def test_expf_binary64_matches_numpy(cref):
    """Where the algorithm runs, [-104, 88.7228394f] (outside it the UCRT returns early and
    numpy clamps)."""
    seed = _seed()
    x = np.concatenate([_expf_inputs(np.random.default_rng(seed)), _expf_edges()])
    x = x[(x >= -104) & (x <= _f32(EXP_X_MAX))]
    assert x.size > 0.8 * N
    _assert_doubles("expf", x, _call_double(cref, "kc_expf_double", x), tr._expf_double(x), seed)


@pytest.mark.parametrize("name", ["cos", "sin"])
def test_trig_binary64_matches_numpy(cref, name):
    """Everywhere but the huge range, inf/nan, cos at |x| < 2^-13 (the UCRT returns the
    constant 1 there; numpy's double is 1 - x*x/2) and the float pi/4, 0x3f490fdb: the direct
    polynomial here, in numpy the reduction with n = 1 whenever the array holds a larger |x|
    (same float, different double; transcend.py's docstring). The small-|x| branches get a
    million of their own: their fmas matter for ~2^-17 of the inputs."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    small = _f32(rng.integers(AU_TINY, AU_SMALL, N, dtype=np.uint32))
    small *= rng.choice(np.array([-1, 1], np.float32), N)
    x = np.concatenate([_trig_inputs(rng), small, _trig_edges()])
    au = _abs_bits(x)
    keep = (au < AU_HUGE[name]) & (au != AU_PIO4)
    if name == "cos":
        keep &= au >= AU_TINY
    x = x[keep]
    assert x.size > N
    want = tr._trig(x, (name,), double=True)[0]
    _assert_doubles(name + "f", x, _call_double(cref, f"kc_{name}f_double", x), want, seed)


def test_binary64_hooks_round_to_the_outputs(cref):
    """The float32 API is exactly the hooks' doubles rounded once (one code path)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    for name, x in (("expf", np.concatenate([_expf_inputs(rng, 100_000), _expf_edges()])),
                    ("cosf", np.concatenate([_trig_inputs(rng, 100_000), _trig_edges()])),
                    ("sinf", np.concatenate([_trig_inputs(rng, 100_000), _trig_edges()]))):
        with np.errstate(over="ignore", invalid="ignore"):  # > FLT_MAX rounds to inf; NaNs
            rounded = _call_double(cref, f"kc_{name}_double", x).astype(np.float32)
        got = _call(getattr(cref, f"kc_{name}"), x)
        _assert_bits(f"kc_{name} vs (float)kc_{name}_double", x, got, rounded, seed)


# ---------------------------------------------------------------------------
# the API around the routines


def test_expf1_equals_expf(cref):
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = np.concatenate([_expf_inputs(rng, 40_000), _expf_edges()])
    want = _call(cref.kc_expf, x)
    got = np.array([cref.kc_expf1(v) for v in x.tolist()], dtype=np.float32)
    _assert_bits("kc_expf1 vs kc_expf", x, got, want, seed)


def test_sincosf_equals_separate_calls(cref):
    seed = _seed()
    x = np.concatenate([_trig_inputs(np.random.default_rng(seed), 100_000), _trig_edges()])
    c, s = _call_sincos(cref, x)
    _assert_bits("kc_sincosf cos vs kc_cosf", x, c, _call(cref.kc_cosf, x), seed)
    _assert_bits("kc_sincosf sin vs kc_sinf", x, s, _call(cref.kc_sinf, x), seed)


def test_in_place_and_empty(cref):
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = np.concatenate([_expf_inputs(rng, 10_000), _trig_inputs(rng, 10_000)])
    for name in ("kc_expf", "kc_cosf", "kc_sinf", "kc_silu"):
        fn = getattr(cref, name)
        y = x.copy()
        fn(y.ctypes.data, y.ctypes.data, y.size)
        _assert_bits(name + " in place", x, y, _call(fn, x), seed)
    y = x.copy()
    s = np.empty_like(x)
    cref.kc_sincosf(y.ctypes.data, y.ctypes.data, s.ctypes.data, y.size)  # cos over its input
    _assert_bits("kc_sincosf in place (cos)", x, y, _call(cref.kc_cosf, x), seed)
    _assert_bits("kc_sincosf in place (sin)", x, s, _call(cref.kc_sinf, x), seed)
    empty = np.zeros(0, np.float32)
    for name in ("kc_expf", "kc_cosf", "kc_sinf", "kc_silu"):
        getattr(cref, name)(empty.ctypes.data, empty.ctypes.data, 0)
    cref.kc_sincosf(empty.ctypes.data, empty.ctypes.data, empty.ctypes.data, 0)


def test_every_nan_bit_for_bit(cref):
    """All 2^24 - 2 NaN bit patterns, bit for bit (the other tests let any NaN match any NaN): T1
    returns its NaN quieted, sign and payload kept, in C and numpy alike; silu, cosf and sinf give
    the same NaN bits in both."""
    u = np.arange(1, 1 << 23, dtype=np.uint32)
    u = np.concatenate([u | 0x7F800000, u | 0xFF800000])
    x = u.view(np.float32)
    assert np.isnan(x).all() and x.size == (1 << 24) - 2
    quiet = (u | 0x00400000).view(np.float32)
    for name, fn, ref in (("expf", cref.kc_expf, expf), ("silu", cref.kc_silu, silu),
                          ("cosf", cref.kc_cosf, cosf), ("sinf", cref.kc_sinf, sinf)):
        got, want = _call(fn, x).view(np.uint32), _np(ref, x).view(np.uint32)
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, (f"{name}: {bad.size} NaNs differ, first x=0x{u[bad[0]]:08x}:"
                               f" C 0x{got[bad[0]]:08x}, numpy 0x{want[bad[0]]:08x}")
        if name == "expf":
            assert np.array_equal(got, quiet.view(np.uint32))
    d = _call_double(cref, "kc_expf_double", x)
    assert np.array_equal(d.view(np.uint64), _np(tr._expf_double, x).view(np.uint64))
