"""Bit-exact replicas of the Windows UCRT ``expf``, ``cosf`` and ``sinf``.

Why these and not ``np.exp``: the CPU reference engine of the seed ran on the
Windows UCRT, whose float routines are *not* correctly rounded (``expf``
differs from ``(float)exp((double)x)`` in ~7e-5 of inputs), so "bit-exact
with the reference" means "the same algorithm". The seed reverse-engineered
them from ucrtbase.dll (expf RVA 0xA84F0, cosf 0xA7D20, sinf 0xAC110; the
FMA3 code path) and verified its host replicas against the real DLL (400002
expf and 600002 cosf/sinf samples, 0 differences). The coefficients match
AMD's win-libm ``Lsincosf_array`` (``__Lcosfarray``/``__Lsinfarray``), from
which the UCRT code descends.

Every routine works in binary64 with explicit FMAs and rounds to float32
once at the end. Here the FMAs are the exact emulation from ``fma.py``; a GPU
port uses ``__fma_rn``, ``__double2int_rn`` and ``__longlong_as_double`` and
gets the same bits. Constants are written as IEEE bit patterns.

expf (x float32, all math in double)::

    x > 88.7228394f -> (float)exp(x) (= +inf);  x < -104 -> +0
    n = rint(x*K)  (ties to even);  j = n & 63;  m = n >> 6  (arithmetic)
    r = fma(-n, C2, x);  z = r*r;  p = fma(fma(r, C0, C1), z, r)
    return (float)(2^m * fma(T[j], p, T[j]))
    K = 64/ln2, C2 = ln2/64, C0 = 1/6, C1 = 1/2, T[j] = RN(2^(j/64))

cosf / sinf (au = float32 bits of |x|, ax = |x| in double)::

    au >= 0x7f800000 (inf/nan)            -> nan
    au <= 0x3f490fdb (|x| <= pi/4):
        au <  0x39000000 (|x| < 2^-13)    cos -> 1,  sin -> x
        au <  0x3c000000 (|x| < 2^-7)     cos -> fma(-(x*0.5), x, 1)
                                          sin -> fma(-(x*x*x), 1/6, x)
        else                              cos -> C(x),  sin -> S(x)
    au >= 0x4f490fdb (cos) / 0x4b800456 (sin): Payne-Hanek in UCRT (see below)
    else Cody-Waite:
        n = (int)trunc(fma(ax, 2/pi, 0.5))
        r = fma(-n, PIO2_HI, ax) - n*PIO2_LO
        cos: n odd -> S(r) else C(r);  negate if ((n&3)+1)>>1 is odd
        sin: n odd -> C(r) else S(r);  negate if (n&3 >= 2) xor (x < 0)
    z = x*x
    C(x) = fma(P, z*z, 1 - 0.5*z),  P = fma(z, fma(z, fma(z, A9, A7), A5), A3)
    S(x) = fma(Q, x*z, x),          Q = fma(z, fma(z, fma(z, B9, B7), B5), B3)

Note the operand order (the seed's trap): ``fma(z, p, A)`` is ``z*p + A``
(``vfmadd213sd``). The reference computes the cos-type polynomial's base as
``1 - 0.5*z`` in ``cosf`` and as ``fma(z, -0.5, 1)`` in ``sinf``; both equal
``RN(1 - z/2)`` because ``0.5*z`` is exact. The UCRT compares |x| with pi/4
in double (``ax <= 0x3fe921fb54442d18``), which excludes the float
0x3f490fdb that the seed's ``au <= 0x3f490fdb`` includes; both branches give
the same float there (tested), so the two descriptions agree.

**Huge arguments** (|x| >= 3.37e9 for cosf, >= 16779436 for sinf): the UCRT
switches to a Payne-Hanek reduction that is not replicated; those elements
(and inf/nan) fall back to ``np.cos``/``np.sin`` in double rounded to float32.
RoPE angles are ``t * inv_freq <= max_seq`` and never get there.

How the numpy version is organised (per-call overhead matters: these run a
few times per layer on small arrays, and numpy costs ~0.6-1 us per operation
whatever the size): no Python loop over elements, no per-branch passes.
Every element of cosf/sinf takes the Cody-Waite path -- for |x| <= pi/4 it
gives n = 0 and r = |x| exactly, i.e. the direct branch (the float 0x3f490fdb
gets n = 1 and the same result, see above); the cos- or sin-type polynomial
is chosen per element through coefficient tables indexed by quadrant and
sign (one polynomial pass for any mix, and for ``sincosf`` both results in
one pass); the small-|x| formulas are overrides of the final FMA's operands.

The FMAs use the exact building blocks of ``fma.py`` directly, under these
preconditions (proved here, exercised by the tests) instead of the general
masked ``fma64``:

* every addend dominates its product, |c| >= 2|a*b| (r <= ln2/128 in expf,
  |r| <= pi/4 in cosf/sinf), as ``fma_tail`` requires;
* nonzero products exceed 2**-610 in magnitude (x = +-2**-149 is the worst
  case), far above the 2**-968 limit of Dekker's product; nothing overflows
  (expf clamps x first; cosf/sinf zero the huge/inf/nan lanes first);
* ``fma(-n, C2, x)`` in expf: C2 = C2_HI + C2_LO with 39 + 14 significant
  bits, so for |n| < 2**14 both products are exact, and ``x - n*C2_HI`` is
  exact (n = 0, or both within a factor 2 on a 2**-45 grid): one rounding;
* ``fma(-n, PIO2_HI, ax)``: PIO2_HI has 31 significant bits, so ``n*PIO2_HI``
  is exact for n < 2**22 (|x| < 6.5e6) and the fma is a plain subtraction;
  larger |x| use ``fma64`` on those elements;
* ``trunc(fma(ax, 2/pi, 0.5))`` equals ``trunc(RN(RN(ax*2/pi) + 0.5))``
  unless that sum is within 2**-20 of an integer (its error is <= 2**-22);
  such elements are redone with ``fma64``.

Tests compare the binary64 results before the final rounding
(``_expf_double``, ``_trig(..., double=True)``) with a literal scalar
transcription using libm's ``fma``: a wrong intermediate FMA would almost
never change a float32 output, but always changes those doubles.
"""

from __future__ import annotations

import numpy as np

from .fma import fma64, fma_tail, two_prod, veltkamp_split

__all__ = ["expf", "cosf", "sinf", "sincosf", "silu"]


def _d(bits: int) -> np.ndarray:
    """The binary64 with the given IEEE bit pattern, as a 0-d array (numpy
    combines 0-d arrays with arrays faster than Python floats)."""
    return np.array(bits, dtype=np.uint64).view(np.float64)


def _f(bits: int) -> np.ndarray:
    """The binary32 with the given IEEE bit pattern, widened to a 0-d float64."""
    return np.array(bits, dtype=np.uint32).view(np.float32).astype(np.float64)


def _as_f32(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"{name} expects float32 input, got {x.dtype}")
    return x


# ---------------------------------------------------------------------------
# expf

_EXP_K = _d(0x40571547652B82FE)  # 64/ln2
_EXP_C2 = _d(0x3F862E42FEFA39EF)  # ln2/64
_EXP_C0 = _d(0x3FC5555555555555)  # 1/6
_EXP_C1 = _d(0x3FE0000000000000)  # 1/2
# C2 = C2_HI + C2_LO exactly, C2_HI with 39 significant bits and C2_LO with
# 14: for |n| < 2**14 both n*C2_HI and n*C2_LO are exact.
_EXP_C2_HI = _d(0x3F862E42FEFA0000)
_EXP_C2_LO = np.array(_EXP_C2 - _EXP_C2_HI)
_EXP_C0_HI, _EXP_C0_LO = (np.array(v) for v in veltkamp_split(_EXP_C0))
_EXP_X_MAX = _f(0x42B17218)  # 88.7228394f: above it the UCRT returns +inf
_EXP_X_MIN = np.array(-104.0)  # below it the UCRT returns +0
_RINT_SHIFT = _d(0x4338000000000000)  # 1.5 * 2**52: (t + S) - S == rint(t)

# T[j] = 2^(j/64) correctly rounded to binary64 (tests re-derive them).
_EXP_T_BITS = np.array(
    [
        0x3FF0000000000000, 0x3FF02C9A3E778061, 0x3FF059B0D3158574, 0x3FF0874518759BC8,
        0x3FF0B5586CF9890F, 0x3FF0E3EC32D3D1A2, 0x3FF11301D0125B51, 0x3FF1429AAEA92DE0,
        0x3FF172B83C7D517B, 0x3FF1A35BEB6FCB75, 0x3FF1D4873168B9AA, 0x3FF2063B88628CD6,
        0x3FF2387A6E756238, 0x3FF26B4565E27CDD, 0x3FF29E9DF51FDEE1, 0x3FF2D285A6E4030B,
        0x3FF306FE0A31B715, 0x3FF33C08B26416FF, 0x3FF371A7373AA9CB, 0x3FF3A7DB34E59FF7,
        0x3FF3DEA64C123422, 0x3FF4160A21F72E2A, 0x3FF44E086061892D, 0x3FF486A2B5C13CD0,
        0x3FF4BFDAD5362A27, 0x3FF4F9B2769D2CA7, 0x3FF5342B569D4F82, 0x3FF56F4736B527DA,
        0x3FF5AB07DD485429, 0x3FF5E76F15AD2148, 0x3FF6247EB03A5585, 0x3FF6623882552225,
        0x3FF6A09E667F3BCD, 0x3FF6DFB23C651A2F, 0x3FF71F75E8EC5F74, 0x3FF75FEB564267C9,
        0x3FF7A11473EB0187, 0x3FF7E2F336CF4E62, 0x3FF82589994CCE13, 0x3FF868D99B4492ED,
        0x3FF8ACE5422AA0DB, 0x3FF8F1AE99157736, 0x3FF93737B0CDC5E5, 0x3FF97D829FDE4E50,
        0x3FF9C49182A3F090, 0x3FFA0C667B5DE565, 0x3FFA5503B23E255D, 0x3FFA9E6B5579FDBF,
        0x3FFAE89F995AD3AD, 0x3FFB33A2B84F15FB, 0x3FFB7F76F2FB5E47, 0x3FFBCC1E904BC1D2,
        0x3FFC199BDD85529C, 0x3FFC67F12E57D14B, 0x3FFCB720DCEF9069, 0x3FFD072D4A07897C,
        0x3FFD5818DCFBA487, 0x3FFDA9E603DB3285, 0x3FFDFC97337B9B5F, 0x3FFE502EE78B3FF6,
        0x3FFEA4AFA2A490DA, 0x3FFEFA1BEE615A27, 0x3FFF50765B6E4540, 0x3FFFA7C1819E90D8,
    ],
    dtype=np.uint64,
)
# With kd = rint(x*K) + 1.5*2**52 the low bits of kd's encoding are n (two's
# complement), and (bits(kd) << 46) == (m << 52) + (j << 46) mod 2**64. Adding
# bits(T[j]) - (j << 46) therefore yields the encoding of T[j] * 2**m.
_EXP_T_ADJ = _EXP_T_BITS - (np.arange(64, dtype=np.uint64) << np.uint64(46))
_U46 = np.array(46, dtype=np.uint64)
_I63 = np.array(63, dtype=np.int64)


def expf(x):
    """UCRT ``expf`` on a float32 array (any shape); returns float32.

    ``x > 88.7228394f`` gives +inf, ``x < -104`` gives +0, a NaN gives itself quieted (sign and
    payload kept),
    ``expf(0) == 1`` and ``expf(-inf) == +0`` exactly. Raises TypeError for a
    dtype other than float32 (convert explicitly; a silent float64 -> float32
    rounding would hide bugs in an exact pipeline).
    """
    x = _as_f32(x, "expf")
    # errstate: the final cast overflows to +inf on purpose, and a NaN input
    # may become a signalling NaN inside the round-to-odd bit step.
    with np.errstate(over="ignore", invalid="ignore"):
        out = _expf_double(x).astype(np.float32)  # (float) of a double > FLT_MAX -> +inf
    return out[()] if out.ndim == 0 else out


def _expf_double(x):
    """The binary64 value ``2^m * fma(T[j], p, T[j])`` that expf rounds to
    float32 (x clamped to [-104, 88.7228394f]). Tests compare it bit for bit
    with a literal transcription: a wrong intermediate FMA almost never shows
    in the float32 result (~2**-28 per input) but always shows here. NaN
    inputs need ``np.errstate(invalid="ignore")`` (see expf)."""
    # Clamping is exact: at 88.7228394f the algorithm itself already rounds to
    # +inf and at -104 to +0, like the UCRT's two early returns. NaN passes.
    xd = np.minimum(np.maximum(x.astype(np.float64), _EXP_X_MIN), _EXP_X_MAX)
    kd = xd * _EXP_K + _RINT_SHIFT  # rint(RN(x*K)) + shift, ties to even
    n = kd - _RINT_SHIFT
    # r = fma(-n, C2, x): x - n*C2_HI is exact (n = 0, or x and n*C2_HI
    # within a factor 2 on a 2**-45 grid), so one rounding remains.
    r = (xd - n * _EXP_C2_HI) - n * _EXP_C2_LO
    z = r * r
    # q = fma(r, C0, C1)
    rh, rl = veltkamp_split(r)
    P = r * _EXP_C0
    q = fma_tail(P, two_prod(P, rh, rl, _EXP_C0_HI, _EXP_C0_LO), _EXP_C1)
    # p = fma(q, z, r)
    qh, ql = veltkamp_split(q)
    zh, zl = veltkamp_split(z)
    P = q * z
    p = fma_tail(P, two_prod(P, qh, ql, zh, zl), r)
    # 2^m * fma(T[j], p, T[j]) == fma(S, p, S) with S = T[j] * 2^m (exact
    # scaling: m in [-152, 128] keeps everything normal in binary64).
    S = (_EXP_T_ADJ.take(kd.view(np.int64) & _I63) + (kd.view(np.uint64) << _U46)).view(np.float64)
    sh, sl = veltkamp_split(S)
    ph, pl = veltkamp_split(p)
    P = S * p
    out = fma_tail(P, two_prod(P, sh, sl, ph, pl), S)
    nan = np.isnan(x)
    if nan.any():  # T1: a NaN comes out as it went in, quieted (the arithmetic above would pick its own)
        out = np.where(nan, x.astype(np.float64), out)
    return out


def silu(x):
    """``x / (1 + expf(-x))`` in float32 (negate, replica expf, add, divide);
    ``silu(-inf)`` is NaN (``-inf/inf``), as the formula says."""
    x = _as_f32(x, "silu")
    e = expf(-x)
    with np.errstate(invalid="ignore"):
        return x / (np.float32(1.0) + e)


# ---------------------------------------------------------------------------
# cosf / sinf

_INV_PIO2 = _d(0x3FE45F306DC9C883)  # 2/pi
_PIO2_HI = _d(0x3FF921FB54400000)  # pi/2, leading 31 bits
_PIO2_LO = _d(0x3DD0B4611A626331)  # pi/2 - PIO2_HI
# __Lcosfarray c1..c4 (A) and __Lsinfarray s1..s4 (B)
_A3 = _d(0x3FA5555555555555)  # 1/24
_A5 = _d(0xBF56C16C16C16C16)  # -1/720 (UCRT's rounding, not RN)
_A7 = _d(0x3EFA01A01A01A019)  # 1/40320 (UCRT's rounding, not RN)
_A9 = _d(0xBE927E4FB7789F5C)  # -1/3628800
_B3 = _d(0xBFC5555555555555)  # -1/6
_B5 = _d(0x3F81111111111111)  # 1/120
_B7 = _d(0xBF2A01A01A01A01A)  # -1/5040
_B9 = _d(0x3EC71DE3A556C734)  # 1/362880

_AU_PIO4 = 0x3F490FDB  # |x| <= pi/4 (float bits)
_AU_TINY = 0x39000000  # 2**-13
_AU_SMALL = 0x3C000000  # 2**-7
_AU_CW_EXACT = 0x4AC65D40  # 6.5e6: below it n < 2**22 and n*PIO2_HI is exact
_AU_HUGE = {"cos": 0x4F490FDB, "sin": 0x4B800456}  # Payne-Hanek in the UCRT
_ABS_MASK = np.array(0x7FFFFFFF, dtype=np.uint32)
_HALF = np.array(0.5)
_ONE = np.array(1.0)
_NEAR_INT = 0.5 - 2.0**-20  # |frac(q) - 1/2| above this: n may be off by one
_TWO52 = np.array(2.0**52)  # nf + 2**52: the low bits of the encoding are n
_I3 = np.array(3, dtype=np.int64)

# Per-element polynomial selection, one table row per quantity, one column
# per index: index = n&3 for cosf; 4 + (n&3) + 4*signbit(x) for sinf.
# KIND 0 = cos-type C(r), 1 = sin-type S(r); SIGN is the final +-1.
_KIND = np.array([0, 1, 0, 1, 1, 0, 1, 0, 1, 0, 1, 0], dtype=bool)
_SIGN = np.array([1, -1, -1, 1, 1, 1, -1, -1, -1, -1, 1, 1], dtype=np.float64)
_K9 = np.where(_KIND, _B9, _A9)
_K9H, _K9L = veltkamp_split(_K9)
_TABLE = np.stack([_K9, _K9H, _K9L, np.where(_KIND, _B7, _A7), np.where(_KIND, _B5, _A5),
                   np.where(_KIND, _B3, _A3), _SIGN, _KIND.astype(np.float64)])


def _cw_reduce(ax, au, amax):
    """Cody-Waite for |x| = ax: returns (n as float64, r). Huge/inf/nan
    elements must already be replaced by 0."""
    q = ax * _INV_PIO2 + _HALF
    nf = np.trunc(q)
    # trunc(q) == trunc(fma(ax, 2/pi, 0.5)) unless q is within 2**-20 of an
    # integer (|q - exact| <= ulp(q) <= 2**-22 here): redo those exactly.
    dist = np.abs(q - nf - _HALF)
    if dist.max() > _NEAR_INT:
        bad = dist > _NEAR_INT
        nf[bad] = np.trunc(fma64(ax[bad], _INV_PIO2, 0.5))
    rhead = ax - nf * _PIO2_HI  # == fma(-n, PIO2_HI, ax) while n < 2**22
    if amax >= _AU_CW_EXACT:
        big = au >= _AU_CW_EXACT
        rhead[big] = fma64(-nf[big], _PIO2_HI, ax[big])
    return nf, rhead - nf * _PIO2_LO


def _trig(x, funcs, double=False):
    """Shared cosf/sinf evaluation; ``funcs`` is a tuple of "cos"/"sin".
    Returns one float32 array per requested function (shape of x); with
    ``double=True`` the signed binary64 values before the final rounding
    instead (for tests; meaningless for cos at |x| < 2**-13, where the UCRT
    returns the constant 1, and for huge/inf/nan x)."""
    shape = x.shape
    xb = x.reshape(-1).view(np.uint32)
    n = xb.size
    if n == 0:
        return tuple(np.empty(shape, np.float32) for _ in funcs)
    au = xb & _ABS_MASK
    ax = au.view(np.float32).astype(np.float64)
    amax = int(au.max())
    amin = int(au.min())
    sanitise = max(_AU_HUGE[f] for f in funcs)
    if amax >= sanitise:  # keep huge/inf/nan out of the arithmetic
        ax[au >= sanitise] = 0.0
    if amax > _AU_PIO4:
        nf, r = _cw_reduce(ax, au, amax)
        quad = (nf + _TWO52).view(np.int64) & _I3
    else:  # every |x| <= pi/4: n = 0 and r = |x|, the direct branch
        r = ax
        quad = np.zeros(n, np.int64)
    z = r * r

    # Stack the requested functions: one polynomial pass serves all of them.
    # Small |x| (n = 0, r = |x|) are overrides of the final fma(p, W, V):
    #   cosf |x| < 2^-7:  (float)fma(-(x*.5), x, 1) == V = 1 - 0.5*z (exact
    #                     product); below 2^-13 that float is 1.0f as well
    #   sinf |x| < 2^-7:  fma(-(x*x*x), 1/6, x) == fma(B3, x*z, x): p := B3
    #   sinf |x| < 2^-13: x itself == V = |x| (sign applied with the rest)
    small = amin < _AU_SMALL  # any element on a small-|x| branch?
    idx, use_v, use_b3 = [], [], []
    for f in funcs:
        if f == "cos":
            idx.append(quad)
            use_v.append(au < _AU_SMALL if small else None)
            use_b3.append(np.zeros(n, bool) if small and "sin" in funcs else None)
        else:
            idx.append(quad + ((xb >> np.uint32(29)) & np.uint32(4)) + 4)  # sign of x
            use_v.append(au < _AU_TINY if small else None)
            use_b3.append(au < _AU_SMALL if small else None)
    if len(funcs) > 1:
        k = len(funcs)
        idx = np.concatenate(idx)
        r, z = np.concatenate([r] * k), np.concatenate([z] * k)
        use_v, use_b3 = (np.concatenate(u) if u[0] is not None else None for u in (use_v, use_b3))
    else:
        idx, use_v, use_b3 = idx[0], use_v[0], use_b3[0]
    k9, k9h, k9l, k7, k5, k3, sign, kind = _TABLE.take(idx, axis=1)

    # p = fma(z, fma(z, fma(z, K9, K7), K5), K3)   (K = A or B per element)
    zh, zl = veltkamp_split(z)
    P = z * k9
    p = fma_tail(P, two_prod(P, zh, zl, k9h, k9l), k7)
    for k in (k5, k3):
        ph, pl = veltkamp_split(p)
        P = z * p
        p = fma_tail(P, two_prod(P, zh, zl, ph, pl), k)
    # result fma(p, W, V): C(r) -> (z*z, 1 - 0.5*z), S(r) -> (r*z, r)
    W = z * np.where(kind, r, z)
    V = np.where(kind, r, _ONE - _HALF * z)
    if use_b3 is not None:
        p = np.where(use_b3, _B3, p)
    ph, pl = veltkamp_split(p)
    wh, wl = veltkamp_split(W)
    P = p * W
    res = fma_tail(P, two_prod(P, ph, pl, wh, wl), V)
    if use_v is not None:
        res = np.where(use_v, V, res)
    res = res * sign
    if double:
        return tuple(res[i * n : (i + 1) * n].reshape(shape) for i in range(len(funcs)))
    out = res.astype(np.float32)

    outs = []
    for i, f in enumerate(funcs):
        o = out[i * n : (i + 1) * n]
        if amax >= _AU_HUGE[f]:  # not replicated: double libm, rounded once
            h = au >= _AU_HUGE[f]
            ref = np.cos if f == "cos" else np.sin
            with np.errstate(invalid="ignore"):
                o[h] = ref(x.reshape(-1)[h].astype(np.float64)).astype(np.float32)
        outs.append(o.reshape(shape))
    return tuple(outs)


def _unwrap(a):
    return a[()] if a.ndim == 0 else a


def cosf(x):
    """UCRT ``cosf`` on a float32 array (any shape); returns float32.

    inf/nan -> nan; |x| >= 3.37e9 falls back to ``np.cos`` in double (see
    module docstring). Raises TypeError for a dtype other than float32."""
    return _unwrap(_trig(_as_f32(x, "cosf"), ("cos",))[0])


def sinf(x):
    """UCRT ``sinf`` on a float32 array (any shape); returns float32.

    ``sinf(-0.0)`` is -0.0; inf/nan -> nan; |x| >= 16779436 falls back to
    ``np.sin`` in double. Raises TypeError for a dtype other than float32."""
    return _unwrap(_trig(_as_f32(x, "sinf"), ("sin",))[0])


def sincosf(x):
    """``(cosf(x), sinf(x))`` bit for bit, sharing the argument reduction and
    one polynomial pass (cheaper than two calls; what RoPE needs)."""
    c, s = _trig(_as_f32(x, "sincosf"), ("cos", "sin"))
    return _unwrap(c), _unwrap(s)
