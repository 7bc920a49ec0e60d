"""fma64 / fma32 against the C library's fma / fmaf, bit for bit.

Inputs are fresh random numbers every run (the seed comes from os.urandom and
is printed in every failure message; set KESTREL_TEST_SEED to replay one).
The generators aim at the hard cases of an emulated FMA: near-cancellation,
exact ties of the final rounding, products and sums that overflow or land in
the subnormal range, signed zeros, inf/nan and raw random bit patterns.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_tui.numerics.fma import _fma64_fast, fma32, fma64, fma_tail, two_prod, veltkamp_split

pytestmark = pytest.mark.filterwarnings("error")  # no stray FP warnings

_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_c_fma = _libm.fma
_c_fma.argtypes = [ctypes.c_double] * 3
_c_fma.restype = ctypes.c_double
_c_fmaf = _libm.fmaf
_c_fmaf.argtypes = [ctypes.c_float] * 3
_c_fmaf.restype = ctypes.c_float
_ufunc_fma = np.frompyfunc(_c_fma, 3, 1)
_ufunc_fmaf = np.frompyfunc(_c_fmaf, 3, 1)


def libm_fma(a, b, c):
    with np.errstate(all="ignore"):  # libm raises FE_OVERFLOW etc. legitimately
        return _ufunc_fma(a, b, c).astype(np.float64)


def libm_fmaf(a, b, c):
    with np.errstate(all="ignore"):
        return _ufunc_fmaf(a, b, c).astype(np.float32)


def _seed() -> int:
    env = os.environ.get("KESTREL_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(8), "little")


def _mismatches(got, want, uint):
    same = got.view(uint) == want.view(uint)
    return ~(same | (np.isnan(got) & np.isnan(want)))  # any NaN matches any NaN


def _report(kind, seed, bad, a, b, c, got, want):
    idx = np.flatnonzero(bad)[:8]
    rows = [
        f"  fma({float(a[i]).hex()}, {float(b[i]).hex()}, {float(c[i]).hex()}) "
        f"= {float(got[i]).hex()}, libm {float(want[i]).hex()}"
        for i in idx
    ]
    return f"{kind}: {bad.sum()} mismatches (seed {seed}):\n" + "\n".join(rows)


# ---------------------------------------------------------------------------
# float64 generators


def _f64_from_parts(rng, n, exp_lo, exp_hi):
    """Random sign and 52-bit mantissa, biased exponent field in [lo, hi]
    (0 = subnormal/zero, 2046 = largest finite binade)."""
    sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(63)
    expo = rng.integers(exp_lo, exp_hi + 1, n, dtype=np.uint64) << np.uint64(52)
    mant = rng.integers(0, 1 << 52, n, dtype=np.uint64)
    return (sign | expo | mant).view(np.float64)


_SPECIALS64 = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 2.0**-1074, -(2.0**-1074), 2.0**-1022,
     -(2.0**-1022), np.finfo(np.float64).max, -np.finfo(np.float64).max, 2.0**-1023, 0.5,
     2.0**996, 2.0**-968, 2.0**1022, 3.0],
    dtype=np.float64,
)


def _sprinkle(rng, arrays, rate, specials):
    for x in arrays:
        m = rng.random(x.size) < rate
        x[m] = rng.choice(specials, m.sum())


def _cases64(rng, n):
    """Yield (name, a, b, c) batches; about n triples in total."""
    k = n // 11
    # raw bit patterns: every exponent, subnormals, inf, nan
    bits = lambda: rng.integers(0, 2**64, k, dtype=np.uint64).view(np.float64)  # noqa: E731
    yield "random bits", bits(), bits(), bits()
    # whole exponent range, finite
    wide = lambda: _f64_from_parts(rng, k, 0, 2046)  # noqa: E731
    yield "wide exponents", wide(), wide(), wide()
    # moderate magnitudes: the bulk of real use
    mod = lambda lo=1000, hi=1046: _f64_from_parts(rng, k, lo, hi)  # noqa: E731
    yield "moderate", mod(), mod(), mod(950, 1100)
    # near-cancellation c ~ -a*b (a few ulps off, or exactly)
    a, b = _f64_from_parts(rng, k, 700, 1340), _f64_from_parts(rng, k, 700, 1340)
    with np.errstate(all="ignore"):
        p = a * b
        c = -p * (1.0 + rng.integers(-3, 4, k) * 2.0**-52)
        c[::3] = -p[::3]
        c[1::3] = np.nextafter(-p[1::3], rng.choice([-np.inf, np.inf], c[1::3].size))
    yield "cancellation", a, b, c
    # exact ties in the final rounding: 27-bit integer significands give an
    # exact (up to 54-bit) product; a small integer addend on a nearby scale
    A = rng.integers(1, 1 << 27, k).astype(np.float64) * rng.choice([-1.0, 1.0], k)
    B = rng.integers(1, 1 << 27, k).astype(np.float64)
    ea, eb = rng.integers(-60, 60, k), rng.integers(-60, 60, k)
    a, b = np.ldexp(A, ea), np.ldexp(B, eb)
    C = rng.integers(-(1 << 30), 1 << 30, k).astype(np.float64)
    c = np.ldexp(C, ea + eb + rng.integers(-8, 30, k))
    yield "ties", a, b, c
    # double-rounding hazards (what round-to-odd is for): a*b = h + d with h
    # exactly half an ulp of c and |d| tiny, so c + RN(a*b) is a tie that the
    # tiny remainder must break: a = (1+u)*2^s, b = h*(1-u)*2^-s, u = k*2^-52
    c = _f64_from_parts(rng, k, 900, 1150)
    ulp_c = np.spacing(np.abs(c))
    h = ulp_c / 2 * rng.choice([-1.0, 1.0], k)
    edge = rng.random(k) < 0.2  # binade edge: c = 2^e, the midpoint below is ulp/4
    c[edge] = np.ldexp(np.sign(c[edge]), np.frexp(c[edge])[1])
    h[edge] = -np.sign(c[edge]) * np.spacing(np.abs(c[edge])) / 4
    u = rng.integers(1, 1 << 20, k) * 2.0**-52 * rng.choice([-1.0, 1.0], k)
    sh = rng.integers(-40, 40, k)
    a, b = np.ldexp(1.0 + u, sh), np.ldexp(h * (1.0 - u), -sh)
    yield "rounding hazards", a, b, c
    # products near the overflow threshold, addend of any size or sign
    ea = rng.integers(3, 1024, k)
    a = np.ldexp(_f64_from_parts(rng, k, 1023, 1023), ea)
    b = np.ldexp(_f64_from_parts(rng, k, 1023, 1023), 1022 - ea + rng.integers(-3, 3, k))
    c = _f64_from_parts(rng, k, 1800, 2046)
    yield "overflow", a, b, c
    # products and results in / near the subnormal range (error terms underflow)
    ea = rng.integers(-1000, -20, k)
    a = np.ldexp(_f64_from_parts(rng, k, 1023, 1023), ea)
    b = np.ldexp(_f64_from_parts(rng, k, 1023, 1023), -1050 - ea + rng.integers(-30, 110, k))
    c = _f64_from_parts(rng, k, 0, 60)
    with np.errstate(all="ignore"):
        c[::2] = -(a[::2] * b[::2]) * (1.0 + rng.integers(-2, 3, c[::2].size) * 2.0**-52)
    yield "underflow", a, b, c
    # subnormal operands times large ones (the fast path's lower edge)
    a = _f64_from_parts(rng, k, 0, 0)
    b = _f64_from_parts(rng, k, 2046 - 60, 2046)
    c = _f64_from_parts(rng, k, 0, 200)
    yield "subnormal operand", a, b, c
    # signed zeros: zero products, zero addends, exact zero results
    a = rng.choice(np.array([0.0, -0.0, 1.5, -2.0, 2.0**-1074, -3.0]), k)
    b = rng.choice(np.array([0.0, -0.0, 7.0, -0.25, 2.0**-600]), k)
    c = rng.choice(np.array([0.0, -0.0, 1e-300, -1e-300]), k)
    yield "signed zeros", a, b, c
    # everything above with specials sprinkled in
    a, b, c = mod(), mod(), mod(950, 1100)
    _sprinkle(rng, (a, b, c), 0.1, _SPECIALS64)
    yield "specials", a, b, c


def test_fma64_matches_libm_on_a_million_random_triples():
    seed = _seed()
    rng = np.random.default_rng(seed)
    total = 0
    for name, a, b, c in _cases64(rng, 1_100_000):
        got, want = fma64(a, b, c), libm_fma(a, b, c)
        bad = _mismatches(got, want, np.uint64)
        assert not bad.any(), _report(f"fma64 [{name}]", seed, bad, a, b, c, got, want)
        total += a.size
    assert total >= 1_000_000


def test_fma64_fast_is_exact_inside_its_documented_domain():
    """_fma64_fast (no mask) equals libm fma whenever its preconditions hold,
    except for the one documented signed-zero case."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    for name, a, b, c in _cases64(rng, 400_000):
        with np.errstate(all="ignore"):
            p = a * b
            inside = (
                np.isfinite(a) & np.isfinite(b) & np.isfinite(c)
                & (np.abs(a) < 2.0**996) & (np.abs(b) < 2.0**996) & (np.abs(c) <= 2.0**1022)
                & (((a == 0) | (b == 0)) | ((np.abs(p) >= 2.0**-968) & (np.abs(p) <= 2.0**1022)))
            )
        a, b, c = a[inside], b[inside], c[inside]
        with np.errstate(all="ignore"):
            got = _fma64_fast(a, b, c)[0]
        want = libm_fma(a, b, c)
        bad = _mismatches(got, want, np.uint64)
        documented = (a * b == 0) & np.signbit(a * b) & (c == 0) & np.signbit(c)
        assert np.all(got[documented] == 0) and not np.signbit(got[documented]).any()
        bad &= ~documented
        assert not bad.any(), _report(f"_fma64_fast [{name}]", seed, bad, a, b, c, got, want)


def test_fma_tail_with_dominant_addend():
    """The building block of the transcendental replicas: split operands,
    Dekker product, Fast2Sum + round-to-odd tail, valid when |c| >= 2|a*b|.
    The rounding-hazard inputs fail without the round-to-odd step."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    n = 0
    for name, a, b, c in _cases64(rng, 550_000):
        with np.errstate(all="ignore"):
            p = a * b
            inside = (
                np.isfinite(a) & np.isfinite(b) & np.isfinite(c) & (np.abs(a) < 2.0**996)
                & (np.abs(b) < 2.0**996) & (np.abs(c) <= 2.0**1022) & (np.abs(c) >= 2 * np.abs(p))
                & (((a == 0) | (b == 0)) | (np.abs(p) >= 2.0**-968))
                & ~((p == 0) & (c == 0))  # the documented -0 caveat
            )
        a, b, c = a[inside], b[inside], c[inside]
        n += a.size
        with np.errstate(all="ignore"):
            P = a * b
            got = fma_tail(P, two_prod(P, *veltkamp_split(a), *veltkamp_split(b)), c)
        want = libm_fma(a, b, c)
        bad = _mismatches(got, want, np.uint64)
        assert not bad.any(), _report(f"fma_tail [{name}]", seed, bad, a, b, c, got, want)
    assert n > 100_000


def test_fma64_special_values_exhaustively():
    vals = _SPECIALS64
    a, b, c = (g.ravel() for g in np.meshgrid(vals, vals, vals, indexing="ij"))
    got, want = fma64(a, b, c), libm_fma(a, b, c)
    bad = _mismatches(got, want, np.uint64)
    assert not bad.any(), _report("fma64 specials", 0, bad, a, b, c, got, want)


def test_fma64_signed_zero_rules():
    assert np.signbit(fma64(-0.0, 1.0, -0.0))  # (-0) + (-0) = -0
    assert not np.signbit(fma64(-0.0, 1.0, 0.0))  # (-0) + (+0) = +0
    assert not np.signbit(fma64(2.0, 3.0, -6.0))  # exact cancellation: +0
    assert np.signbit(fma64(-(2.0**-600), 2.0**-600, 0.0))  # underflows to -0
    assert fma64(2.0**-600, 2.0**-600, 2.0**-1074) == 2.0**-1074


def test_fma64_broadcasting_shapes_and_scalars():
    rng = np.random.default_rng(_seed())
    a = rng.standard_normal((3, 1, 5))
    b = rng.standard_normal((4, 1))
    c = 0.25
    got = fma64(a, b, c)
    assert got.shape == (3, 4, 5) and got.dtype == np.float64
    want = libm_fma(*np.broadcast_arrays(a, b, np.float64(c)))
    assert np.array_equal(got.view(np.uint64), want.view(np.uint64))
    s = fma64(0.1, 10.0, -1.0)
    assert isinstance(s, np.float64) and s == _c_fma(0.1, 10.0, -1.0)
    assert fma64(a[:, :, ::2], 1.0, 0.0).shape == (3, 1, 3)  # non-contiguous input


@settings(max_examples=3000, deadline=None)
@given(st.floats(width=64), st.floats(width=64), st.floats(width=64))
def test_fma64_property(a, b, c):
    got = fma64(a, b, c)
    want = _c_fma(a, b, c)
    if np.isnan(want):
        assert np.isnan(got)
    else:
        assert np.float64(got).view(np.uint64) == np.float64(want).view(np.uint64), (a, b, c, got, want)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(*[st.floats(width=64)] * 3), min_size=1, max_size=64))
def test_fma64_property_arrays(triples):
    a, b, c = (np.array(v, dtype=np.float64) for v in zip(*triples))
    got, want = fma64(a, b, c), libm_fma(a, b, c)
    assert not _mismatches(got, want, np.uint64).any()


# ---------------------------------------------------------------------------
# float32


def _f32_from_parts(rng, n, exp_lo, exp_hi):
    sign = rng.integers(0, 2, n, dtype=np.uint32) << np.uint32(31)
    expo = rng.integers(exp_lo, exp_hi + 1, n, dtype=np.uint32) << np.uint32(23)
    mant = rng.integers(0, 1 << 23, n, dtype=np.uint32)
    return (sign | expo | mant).view(np.float32)


def _cases32(rng, n):
    k = n // 7
    bits = lambda: rng.integers(0, 2**32, k, dtype=np.uint32).view(np.float32)  # noqa: E731
    yield "random bits", bits(), bits(), bits()
    wide = lambda: _f32_from_parts(rng, k, 0, 254)  # noqa: E731
    yield "wide exponents", wide(), wide(), wide()
    a, b = _f32_from_parts(rng, k, 100, 154), _f32_from_parts(rng, k, 100, 154)
    with np.errstate(all="ignore"):
        c = -(a * b)  # float32 product: c ~ -a*b, the remainder is the low part
        c[::2] = np.nextafter(c[::2], np.float32(0))
    yield "cancellation", a, b, c
    # ties: 12-bit significands multiply exactly in 24 bits
    A = rng.integers(1, 1 << 12, k).astype(np.float32) * rng.choice(np.array([-1, 1], np.float32), k)
    B = rng.integers(1, 1 << 12, k).astype(np.float32)
    ea, eb = rng.integers(-20, 20, k), rng.integers(-20, 20, k)
    a, b = np.ldexp(A, ea).astype(np.float32), np.ldexp(B, eb).astype(np.float32)
    C = rng.integers(-(1 << 20), 1 << 20, k).astype(np.float32)
    c = np.ldexp(C, ea + eb + rng.integers(-4, 24, k)).astype(np.float32)
    yield "ties", a, b, c
    # double-rounding hazards: a*b = h*(1 - 2^-46), h half a float32 ulp of c
    c = _f32_from_parts(rng, k, 60, 190)
    h = (np.spacing(np.abs(c)) / 2) * rng.choice(np.array([-1, 1], np.float32), k)
    u = (rng.integers(1, 1 << 10, k) * 2.0**-23).astype(np.float32)
    a, b = (1 + u).astype(np.float32), (h * (1 - u)).astype(np.float32)
    yield "rounding hazards", a, b, c
    # subnormal results and overflow
    a = _f32_from_parts(rng, k, 1, 60)
    b = _f32_from_parts(rng, k, 1, 80)
    c = _f32_from_parts(rng, k, 0, 10)
    a[::2] = _f32_from_parts(rng, a[::2].size, 190, 254)
    b[::2] = _f32_from_parts(rng, b[::2].size, 190, 254)
    yield "under/overflow", a, b, c
    a, b = _f32_from_parts(rng, k, 110, 140), _f32_from_parts(rng, k, 110, 140)
    c = _f32_from_parts(rng, k, 100, 150)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-45, -1e-45, 3.4028235e38], np.float32)
    _sprinkle(rng, (a, b, c), 0.1, specials)
    yield "specials", a, b, c


def test_fma32_matches_libm_fmaf_on_a_million_random_triples():
    seed = _seed()
    rng = np.random.default_rng(seed)
    total = 0
    for name, a, b, c in _cases32(rng, 1_050_000):
        got, want = fma32(a, b, c), libm_fmaf(a, b, c)
        assert got.dtype == np.float32
        bad = _mismatches(got, want, np.uint32)
        assert not bad.any(), _report(f"fma32 [{name}]", seed, bad, a, b, c, got, want)
        total += a.size
    assert total >= 1_000_000


@settings(max_examples=2000, deadline=None)
@given(st.floats(width=32), st.floats(width=32), st.floats(width=32))
def test_fma32_property(a, b, c):
    got = fma32(np.float32(a), np.float32(b), np.float32(c))
    want = np.float32(_c_fmaf(a, b, c))
    if np.isnan(want):
        assert np.isnan(got)
    else:
        assert np.float32(got).view(np.uint32) == want.view(np.uint32), (a, b, c, got, want)
