"""The UCRT replicas: bit-exact against a literal transcription, accurate
against libm, exact on special values.

Three kinds of checks:

* **literal reference** -- the seed's pseudo-code transcribed line by line as
  scalar Python, with libm's ``fma`` through ctypes (independent of our
  emulation and of the vectorised branch logic): bit-for-bit equality;
* **accuracy** -- >= 1M samples per function in the ranges a decoder uses:
  within 1 float32 ULP of the correctly rounded float32 of the double libm
  result; the number of not-correctly-rounded results is printed (``-s``);
* **special values** -- exact bits.

Random inputs are fresh every run (seed from os.urandom, printed in failure
messages; KESTREL_TEST_SEED replays one).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import struct
from decimal import Decimal, getcontext
from fractions import Fraction

import numpy as np
import pytest

from kestrel_tui.numerics import transcend as tr
from kestrel_tui.numerics.transcend import cosf, expf, silu, sincosf, sinf

pytestmark = pytest.mark.filterwarnings("error")  # no stray FP warnings

_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_fma = _libm.fma
_fma.argtypes = [ctypes.c_double] * 3
_fma.restype = ctypes.c_double


def _seed() -> int:
    env = os.environ.get("KESTREL_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(8), "little")


def _d(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _f32(v: float) -> float:
    """Round a Python float to binary32 (RN), returned as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def _bits32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def _fbits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _from_bits32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


# ---------------------------------------------------------------------------
# literal transcriptions of the seed (sections 3.3 and 3.6.1), scalar

_K, _C2, _C0, _C1 = _d(0x40571547652B82FE), _d(0x3F862E42FEFA39EF), _d(0x3FC5555555555555), 0.5
_INV_PIO2 = _d(0x3FE45F306DC9C883)
_PIO2_HI, _PIO2_LO = _d(0x3FF921FB54400000), _d(0x3DD0B4611A626331)
_A3, _A5, _A7, _A9 = (
    _d(b) for b in (0x3FA5555555555555, 0xBF56C16C16C16C16, 0x3EFA01A01A01A019, 0xBE927E4FB7789F5C)
)
_B3, _B5, _B7, _B9 = (
    _d(b) for b in (0xBFC5555555555555, 0x3F81111111111111, 0xBF2A01A01A01A01A, 0x3EC71DE3A556C734)
)
_T = [_d(int(b)) for b in tr._EXP_T_BITS]  # verified separately below


def ref_expf(xf: float, double: bool = False) -> float:
    """``double=True``: the binary64 before the final (float) cast, or None
    on the early-return branches."""
    if math.isnan(xf):
        return None if double else math.nan
    if xf > _f32(88.7228394):
        return None if double else math.inf  # (float)exp((double)x) overflows
    if xf < -104.0:
        return None if double else 0.0
    x = xf
    n = round(x * _K)  # rint: Python's round() is ties-to-even
    dn = float(n)
    r = _fma(-dn, _C2, x)
    j, m = n & 63, n >> 6
    z = r * r
    t1 = _fma(r, _C0, _C1)
    p = _fma(t1, z, r)
    q = _fma(_T[j], p, _T[j])
    res = math.ldexp(1.0, m) * q
    return res if double else _f32(res)


def _poly_c(x: float) -> float:
    z = x * x
    p = _fma(z, _A9, _A7)
    p = _fma(z, p, _A5)
    p = _fma(z, p, _A3)
    return _fma(p, z * z, 1.0 - 0.5 * z)


def _poly_s(x: float) -> float:
    z = x * x
    p = _fma(z, _B9, _B7)
    p = _fma(z, p, _B5)
    p = _fma(z, p, _B3)
    return _fma(p, x * z, x)


def _reduce(ax: float):
    n = math.trunc(_fma(ax, _INV_PIO2, 0.5))
    return n, _fma(-float(n), _PIO2_HI, ax) - n * _PIO2_LO


def ref_cosf(xf: float, double: bool = False):
    """``double=True``: the signed binary64 before the final (float) cast,
    or None where the UCRT returns a constant or calls another routine."""
    au = _fbits(xf) & 0x7FFFFFFF
    r32 = (lambda v: v) if double else _f32
    if au >= 0x7F800000:
        return None if double else math.nan
    if au <= 0x3F490FDB:
        if au < 0x39000000:
            return None if double else 1.0
        if au < 0x3C000000:
            return r32(_fma(-(xf * 0.5), xf, 1.0))
        return r32(_poly_c(xf))
    if au >= 0x4F490FDB:
        return None if double else _f32(math.cos(xf))  # Payne-Hanek in the UCRT
    n, r = _reduce(abs(xf))
    y = _poly_s(r) if n & 1 else _poly_c(r)
    if (((n & 3) + 1) >> 1) & 1:
        y = -y
    return r32(y)


def ref_sinf(xf: float, double: bool = False):
    au = _fbits(xf) & 0x7FFFFFFF
    r32 = (lambda v: v) if double else _f32
    if au >= 0x7F800000:
        return None if double else math.nan
    if au <= 0x3F490FDB:
        if au < 0x39000000:
            return xf
        if au < 0x3C000000:
            return r32(_fma(-(xf * xf * xf), 1.0 / 6.0, xf))
        return r32(_poly_s(xf))
    if au >= 0x4B800456:
        return None if double else _f32(math.sin(xf))
    n, r = _reduce(abs(xf))
    y = _poly_c(r) if n & 1 else _poly_s(r)
    if ((n & 3) >= 2) != (xf < 0):
        y = -y
    return r32(y)


def _vs_literal_double(name, fn64, ref, x, seed):
    """Bit-compare the binary64 results before the final rounding."""
    with np.errstate(invalid="ignore"):
        got = fn64(x)
    want = [ref(v, double=True) for v in x.tolist()]
    keep = np.array([w is not None for w in want])
    want = np.array([w for w in want if w is not None], dtype=np.float64)
    g, xs = got[keep], x[keep]
    bad = g.view(np.uint64) != want.view(np.uint64)
    if bad.any():
        rows = [f"  x={xs[i]!r}: got {float(g[i]).hex()}, want {float(want[i]).hex()}"
                for i in np.flatnonzero(bad)[:8]]
        pytest.fail(f"{name} (binary64 before rounding): {bad.sum()} of {keep.sum()} differ "
                    f"(seed {seed}):\n" + "\n".join(rows))
    assert keep.sum() > 0.9 * x.size


def _assert_bits_equal(name, x, got, want, seed):
    g, w = _bits32(got), _bits32(want)
    bad = (g != w) & ~(np.isnan(got) & np.isnan(want))
    if bad.any():
        rows = [
            f"  x={x[i]!r} (0x{_bits32(x[i:i + 1])[0]:08x}): got {got[i]!r} (0x{g[i]:08x}), "
            f"want {want[i]!r} (0x{w[i]:08x})"
            for i in np.flatnonzero(bad)[:8]
        ]
        pytest.fail(f"{name}: {bad.sum()} of {x.size} differ (seed {seed}):\n" + "\n".join(rows))


def _vs_literal(name, fn, ref, x, seed):
    got = fn(x)
    want = np.array([ref(v) for v in x.tolist()], dtype=np.float32)
    assert got.dtype == np.float32 and got.shape == x.shape
    _assert_bits_equal(name, x, got, want, seed)


def _ordered(bits: np.ndarray) -> np.ndarray:
    """Map float32 encodings to integers whose difference counts ULPs."""
    b = bits.astype(np.int64)
    return np.where(b & 0x80000000, -(b & 0x7FFFFFFF), b)


def _accuracy(name, fn, ref64, x, seed):
    """Within 1 ULP of float32(ref64(double x)); prints the not-CR count."""
    got = fn(x)
    with np.errstate(over="ignore", invalid="ignore"):
        want = ref64(x.astype(np.float64)).astype(np.float32)
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), f"{name}: NaN placement differs (seed {seed})"
    keep = ~nan_w
    dist = np.abs(_ordered(_bits32(got[keep])) - _ordered(_bits32(want[keep])))
    not_cr = int((dist != 0).sum())
    msg = (
        f"{name}: {x.size} samples, {not_cr} not correctly rounded "
        f"({not_cr / x.size:.2e}), max {dist.max()} ulp (seed {seed})"
    )
    print("\n" + msg)
    if dist.max() > 1:
        i = np.flatnonzero(keep)[np.argmax(dist)]
        pytest.fail(msg + f"; worst x={x[i]!r}: got {got[i]!r}, want {want[i]!r}")
    return not_cr


# ---------------------------------------------------------------------------
# constants


def test_exp_table_is_correctly_rounded_2_pow_j_over_64():
    """T[j] is the double nearest 2^(j/64): exact rational check
    (t - ulp/2)^64 < 2^j < (t + ulp/2)^64, with no rounding anywhere."""
    for j, bits in enumerate(tr._EXP_T_BITS.tolist()):
        t = Fraction(_d(bits))
        assert 1 <= t < 2
        half = Fraction(1, 2**53)  # half an ulp in [1, 2)
        if j == 0:
            assert t == 1
        else:
            assert (t - half) ** 64 < 2**j < (t + half) ** 64, j


def test_constants_match_their_definitions():
    getcontext().prec = 60
    ln2 = Decimal(2).ln()
    assert float(tr._EXP_K) == float(Fraction(64 / ln2))
    assert float(tr._EXP_C2) == float(Fraction(ln2 / 64))
    assert float(tr._EXP_C0) == float(Fraction(1, 6))
    # the split of C2 is exact and short enough for exact n*C2_HI, n*C2_LO
    hi, lo = Fraction(float(tr._EXP_C2_HI)), Fraction(float(tr._EXP_C2_LO))
    assert hi + lo == Fraction(float(tr._EXP_C2))
    for v, nbits in ((hi, 39), (lo, 14)):
        num = v.numerator
        assert num.bit_length() - (num & -num).bit_length() + 1 <= nbits
    # PIO2_HI has 31 significant bits: n*PIO2_HI is exact for n < 2^22
    num = Fraction(float(tr._PIO2_HI)).numerator
    assert num.bit_length() - (num & -num).bit_length() + 1 == 31
    assert np.float32(6.5e6).view(np.uint32) == tr._AU_CW_EXACT
    assert math.trunc(6.5e6 * 2 / math.pi + 0.5) < 2**22
    # the sin/cos coefficients are the Taylor ones (cos: UCRT's own rounding)
    for got, frac in ((_B3, Fraction(-1, 6)), (_B5, Fraction(1, 120)), (_B7, Fraction(-1, 5040)),
                      (_B9, Fraction(1, 362880)), (_A3, Fraction(1, 24)), (_A9, Fraction(-1, 3628800))):
        assert got == float(frac)
    assert abs(Fraction(_A5) - Fraction(-1, 720)) < Fraction(1, 720) * 2**-52
    assert abs(Fraction(_A7) - Fraction(1, 40320)) < Fraction(1, 40320) * 2**-51
    # the module's constants are the ones transcribed here
    for mine, ref in ((tr._A3, _A3), (tr._A5, _A5), (tr._A7, _A7), (tr._A9, _A9), (tr._B3, _B3),
                      (tr._B5, _B5), (tr._B7, _B7), (tr._B9, _B9), (tr._INV_PIO2, _INV_PIO2),
                      (tr._PIO2_HI, _PIO2_HI), (tr._PIO2_LO, _PIO2_LO)):
        assert float(mine) == ref


# ---------------------------------------------------------------------------
# expf


def _expf_inputs(rng, n):
    parts = [
        rng.uniform(-104, 89, n // 3),
        rng.uniform(-30, 0, n // 3),
        rng.standard_normal(n // 6) * 1e-3,
        np.exp(rng.uniform(-103, 0, n // 6)) * rng.choice([-1, 1], n // 6),  # down to subnormal
    ]
    return np.concatenate(parts).astype(np.float32)


_EXP_SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, -104.0, -103.97, -87.3365, 88.7228394,
     88.72283, 88.7229, 89.0, 100.0, -105.0, -1e30, 1e30, 1e-45, -1e-45, 1.1754944e-38, 3.4028235e38,
     -3.4028235e38, 0.5, 0.0108304246, 0.0054152123, -0.0054152123],
    dtype=np.float32,
)


def test_expf_matches_literal_ucrt_transcription():
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = np.concatenate([_expf_inputs(rng, 60_000), _EXP_SPECIALS])
    _vs_literal("expf", expf, ref_expf, x, seed)


def test_expf_binary64_result_matches_literal_transcription():
    """The double before the (float) cast, bit for bit: sensitive to any
    inexact intermediate FMA, unlike the float32 output."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = _expf_inputs(rng, 60_000)
    _vs_literal_double("expf", tr._expf_double, ref_expf, x, seed)


def test_expf_exhaustive_at_the_range_ends():
    """Every float32 in [-104.5, -103.8] (the +0 threshold) and in
    [88.70, 88.76] (overflow to +inf): bit-identical to the transcription."""
    lo = _from_bits32(np.arange(_fbits(-103.8), _fbits(-104.5) + 1, dtype=np.uint32))
    hi = _from_bits32(np.arange(_fbits(88.70), _fbits(88.76) + 1, dtype=np.uint32))
    x = np.concatenate([lo, hi])
    _vs_literal("expf range ends", expf, ref_expf, x, 0)


def test_expf_accuracy_million_samples():
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = np.concatenate([_expf_inputs(rng, 1_200_000), _EXP_SPECIALS])
    assert x.size >= 1_000_000
    not_cr = _accuracy("expf", expf, np.exp, x, seed)
    # the seed: UCRT expf is "almost correctly rounded" (28 of 400002 differ)
    assert not_cr < 1e-3 * x.size


def test_expf_special_values():
    one = np.float32(1.0).view(np.uint32)
    assert expf(np.float32(0.0)).view(np.uint32) == one
    assert expf(np.float32(-0.0)).view(np.uint32) == one
    assert expf(np.float32(-np.inf)).view(np.uint32) == 0  # +0.0
    assert expf(np.float32(-104.5)).view(np.uint32) == 0
    assert expf(np.float32(np.inf)) == np.inf
    assert expf(np.float32(88.7228394)) == np.inf  # (float)exp(x) overflows
    assert np.isfinite(expf(np.float32(88.72283)))
    assert np.isnan(expf(np.float32(np.nan)))
    assert isinstance(expf(np.float32(1.0)), np.float32)
    assert expf(np.float32(1.0)) == np.float32(math.e)


def test_expf_shapes_and_dtype():
    rng = np.random.default_rng(_seed())
    x = rng.uniform(-20, 20, (4, 6, 8)).astype(np.float32)
    y = expf(x)
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.array_equal(_bits32(expf(x[:, ::2, 1:])), _bits32(y[:, ::2, 1:]))  # non-contiguous
    assert expf(np.zeros(0, np.float32)).shape == (0,)
    with pytest.raises(TypeError):
        expf(np.zeros(3, np.float64))


def test_silu_definition():
    rng = np.random.default_rng(_seed())
    x = np.concatenate([rng.standard_normal(10_000) * 8, _EXP_SPECIALS]).astype(np.float32)
    with np.errstate(invalid="ignore"):
        want = x / (np.float32(1) + expf(-x))
    got = silu(x)
    assert got.dtype == np.float32
    _assert_bits_equal("silu", x, got, want, 0)
    assert silu(np.float32(0.0)) == 0.0
    assert silu(np.float32(100.0)) == np.float32(100.0)
    assert silu(np.float32(-100.0)).view(np.uint32) == 0x80000000  # x / inf = -0


# ---------------------------------------------------------------------------
# cosf / sinf


def _trig_inputs(rng, n):
    tiny = np.exp(rng.uniform(math.log(1e-45), math.log(2.0**-7), n // 8)) * rng.choice([-1, 1], n // 8)
    parts = [
        rng.uniform(-4096, 4096, n // 2),
        rng.uniform(-35, 35, n // 4),
        rng.uniform(-(2.0**-7), 2.0**-7, n // 8),
        tiny,
    ]
    return np.concatenate(parts).astype(np.float32)


def _near_multiples_of_pio2(rng, n):
    """Floats next to k*pi/2 (tiny reduced arguments) and next to (k+1/2)*pi/2
    (n near a rounding boundary of the reduction)."""
    k = rng.integers(1, 1 << 20, n)
    v = (k + rng.choice([0.0, 0.5], n)) * (np.pi / 2)
    x = v.astype(np.float32)
    x = np.nextafter(x, np.float32(np.inf) * rng.choice([-1, 1], n).astype(np.float32))
    return x * rng.choice(np.array([-1, 1], np.float32), n)


_TRIG_SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 0.7853981, 0.7853982, -0.7853982, 0.78539824,
     1.5707964, 3.1415927, -3.1415927, 2.0**-13, -(2.0**-13), 2.0**-7, 2.0**-7 * 0.9999999, 1e-45,
     -1e-45, 6.5e6, 6.6e6, 1.6777e7, 16779436.0, 16779438.0, -16779438.0, 3.37e9, 3.3702e9, 1e10,
     -1e30, 3.4028235e38, 4096.0, -4096.0, 1e-20],
    dtype=np.float32,
)


@pytest.mark.parametrize("name", ["cosf", "sinf"])
def test_trig_matches_literal_ucrt_transcription(name):
    seed = _seed()
    rng = np.random.default_rng(seed)
    fn, ref = (cosf, ref_cosf) if name == "cosf" else (sinf, ref_sinf)
    x = np.concatenate([
        _trig_inputs(rng, 40_000),
        _near_multiples_of_pio2(rng, 8_000),
        (np.exp(rng.uniform(math.log(4096), math.log(4e9), 4_000))
         * rng.choice([-1, 1], 4_000)).astype(np.float32),  # up to the fallback range
        _TRIG_SPECIALS,
    ])
    _vs_literal(name, fn, ref, x, seed)


@pytest.mark.parametrize("name", ["cos", "sin"])
def test_trig_binary64_result_matches_literal_transcription(name):
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = np.concatenate([_trig_inputs(rng, 40_000), _near_multiples_of_pio2(rng, 8_000)])
    x = x[np.abs(x) >= 2.0**-13] if name == "cos" else x  # UCRT cosf returns 1.0f there
    ref = ref_cosf if name == "cos" else ref_sinf
    _vs_literal_double(name + "f", lambda v: tr._trig(v, (name,), double=True)[0], ref, x, seed)


def test_trig_pi_over_4_boundary_is_branch_independent():
    """The UCRT compares |x| with pi/4 in double, which sends the float
    0x3f490fdb to the reduction; the seed's ``au <= 0x3f490fdb`` sends it to
    the direct polynomial. Both give the same bits, so both descriptions hold."""
    for xf in (_from_bits32([0x3F490FDB])[0].item(), _from_bits32([0xBF490FDB])[0].item()):
        direct_c, direct_s = _f32(_poly_c(xf)), _f32(_poly_s(xf))
        n, r = _reduce(abs(xf))
        assert n == 1
        red_c, red_s = _f32(-_poly_s(r)), _f32(_poly_c(r) * (-1.0 if xf < 0 else 1.0))
        assert _fbits(direct_c) == _fbits(red_c) and _fbits(direct_s) == _fbits(red_s)
        x = np.float32(xf)
        assert _fbits(float(cosf(x))) == _fbits(direct_c)
        assert _fbits(float(sinf(x))) == _fbits(direct_s)
        # also inside an array that takes the Cody-Waite path
        arr = np.array([xf, 2.0, 0.1], np.float32)
        assert _bits32(cosf(arr))[0] == _fbits(direct_c) and _bits32(sinf(arr))[0] == _fbits(direct_s)


@pytest.mark.parametrize("name", ["cosf", "sinf"])
def test_trig_accuracy_million_samples(name):
    seed = _seed()
    rng = np.random.default_rng(seed)
    fn, ref = (cosf, np.cos) if name == "cosf" else (sinf, np.sin)
    x = np.concatenate([_trig_inputs(rng, 1_000_000), _near_multiples_of_pio2(rng, 20_000), _TRIG_SPECIALS])
    assert x.size >= 1_000_000
    _accuracy(name, fn, ref, x, seed)


def test_trig_special_values():
    z, nz = np.float32(0.0), np.float32(-0.0)
    assert cosf(z) == 1.0 and cosf(nz) == 1.0
    assert sinf(z).view(np.uint32) == 0
    assert sinf(nz).view(np.uint32) == 0x80000000  # -0.0
    for v in (np.inf, -np.inf, np.nan):
        assert np.isnan(cosf(np.float32(v))) and np.isnan(sinf(np.float32(v)))
    rng = np.random.default_rng(_seed())
    tiny = _from_bits32(rng.integers(0, 0x39000000, 100_000, dtype=np.uint32))
    tiny = np.concatenate([tiny, -tiny])
    assert np.all(cosf(tiny) == 1.0)
    assert np.array_equal(_bits32(sinf(tiny)), _bits32(tiny))  # sin(x) = x, signs and subnormals kept


def test_sincosf_equals_separate_calls():
    seed = _seed()
    rng = np.random.default_rng(seed)
    for x in (
        np.concatenate([_trig_inputs(rng, 20_000), _TRIG_SPECIALS]),
        rng.uniform(-0.7, 0.7, 1000).astype(np.float32),  # direct branch only
        rng.uniform(1, 1000, 1000).astype(np.float32),  # no small elements
        np.array([1e9, 2e7, -3e9], np.float32),  # sin fallback, cos Cody-Waite
    ):
        c, s = sincosf(x)
        _assert_bits_equal("sincosf cos", x, c, cosf(x), seed)
        _assert_bits_equal("sincosf sin", x, s, sinf(x), seed)


def test_trig_shapes_and_dtype():
    rng = np.random.default_rng(_seed())
    x = rng.uniform(-50, 50, (3, 5, 7)).astype(np.float32)
    for fn in (cosf, sinf):
        y = fn(x)
        assert y.shape == x.shape and y.dtype == np.float32
        assert np.array_equal(_bits32(fn(x[::2, :, ::3])), _bits32(y[::2, :, ::3]))
        assert fn(np.zeros((0, 3), np.float32)).shape == (0, 3)
        assert isinstance(fn(np.float32(0.5)), np.float32)
        with pytest.raises(TypeError):
            fn(np.zeros(3, np.float64))
    c, s = sincosf(x)
    assert c.shape == s.shape == x.shape
