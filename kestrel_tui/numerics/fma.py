"""Exactly rounded fused multiply-add on numpy arrays, without a hardware FMA.

Why this exists: the transcendental replicas in ``numerics/transcend.py`` copy
the Windows UCRT ``expf``/``cosf``/``sinf`` (the CPU reference engine of the
seed ran on UCRT), and those routines use explicit double-precision FMAs
(``vfmadd213sd``; ``__fma_rn`` on the GPU). numpy has no FMA ufunc, so we
emulate ``fma(a, b, c) = RN(a*b + c)`` with plain IEEE double operations:

1. **TwoProduct** (Dekker, operands split by Veltkamp into 26-bit halves):
   ``a*b = ph + pl`` exactly.
2. **TwoSum** (Knuth/Møller): ``c + ph = th + tl`` exactly.
3. **Round-to-odd addition** ``v = RO(tl + pl)``: a TwoSum gives ``s`` and its
   error ``e``; if ``e != 0`` and ``s`` is even, ``s`` moves one unit toward
   ``e`` (an integer bit operation on the float's encoding).
4. One final ``RN(th + v)``.

Boldo & Melquiond ("Emulation of FMA and correctly rounded sums: proved
algorithms using rounding to odd", IEEE TC 57(4), 2008) prove that step 4
returns the correctly rounded ``a*b + c`` provided the error terms are exact
(no underflow of the product's low part, no overflow anywhere).

``fma64`` handles every input: it runs the vectorised algorithm above, then a
cheap mask finds the rare elements it does not cover (zero, tiny or huge
products, any overflow, inf/nan) and recomputes only those exactly (IEEE
special-value rules vectorised; finite cases with Python integers, whose true
division is correctly rounded). The result is bit-identical to C99 ``fma``
(tested against libm on millions of inputs, NaN payloads aside).

``fma32`` is the float32 FMA: the product of two float32 is exact in double,
one round-to-odd double addition and a final rounding to float32 give the
correctly rounded single-precision result (53 >= 24 + 2 bits).

The building blocks (``veltkamp_split``, ``two_prod``, ``fma_tail``) are
shared with ``transcend.py``, which calls them under preconditions it can
prove (documented there), skipping the mask; ``_fma64_fast`` is the unmasked
general algorithm with its exact domain stated.
"""

from __future__ import annotations

import numpy as np

__all__ = ["fma64", "fma32"]

# Constants are 0-d arrays: numpy combines them with arrays ~0.25 us faster
# per operation than Python floats (this module is overhead-bound).
_SPLIT = np.array(134217729.0)  # 2**27 + 1: Veltkamp splitting constant
# The fast path is exact when TINY <= |RN(a*b)| <= HUGE (see _fma64_fast).
_TINY = np.array(2.0**-968)
_HUGE = np.array(2.0**1022)


# ---------------------------------------------------------------------------
# building blocks (all exact under the stated conditions; no masks, no copies)


def veltkamp_split(a):
    """Veltkamp split: ``a == hi + lo`` exactly, each with <= 26 significant
    bits. Needs ``|a| < 2**996`` (else ``a*SPLIT`` overflows and hi is NaN)."""
    t = a * _SPLIT
    hi = t - (t - a)
    return hi, a - hi


def two_prod(p, ah, al, bh, bl):
    """Dekker: the exact error ``a*b - p`` of ``p = RN(a*b)`` from split
    operands. Exact when ``a*b`` is exactly 0 or ``2**-968 <= |p| <= 2**1022``."""
    return ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _ro_add(x, y):
    """Round-to-odd ``RO(x + y)`` for finite doubles (TwoSum + bit fix-up).

    With ``s = RN(x+y)`` and exact error ``e``: if ``e == 0`` the sum is
    exact; otherwise the exact value lies strictly between ``s`` and its
    neighbour on the side of ``e``, and RO picks the one with an odd
    significand: ``s | 1`` when ``e`` has the sign of ``s``, else
    ``(s - 1) | 1`` (on the sign-magnitude integer encoding).
    """
    s = x + y
    bb = s - x
    e = (x - (s - bb)) + (y - bb)
    opp = np.copysign(e, s) != e  # e nonzero and of the other sign than s
    nz = e != 0
    return ((s.view(np.int64) - opp) | nz).view(np.float64)


def fma_tail(p, pl, c):
    """``RN(c + p + pl)`` where ``p = RN(a*b)`` and ``pl`` its exact error,
    **given |c| >= 2*|p|** (or ``p == 0``) -- the shape of every polynomial
    step ``fma(z, p, A)`` / ``fma(T, p, T)`` in the transcendental replicas,
    where the addend dominates the product.

    Then Fast2Sum gives ``c + p = th + tl`` exactly, and ``tl`` is 0 or a
    multiple of ``ulp(p)`` (c and th are, as |c| >= |p| and |th| >= |p|),
    while ``|pl| <= ulp(p)/2``; so ``|tl| > |pl|`` unless ``tl == 0`` and the
    round-to-odd sum may use Fast2Sum too. 11 array operations. (A zero
    product ``-0`` with ``c = -0`` yields +0 instead of -0; no caller has it.)
    """
    th = c + p
    tl = p - (th - c)
    s = tl + pl
    e = pl - (s - tl)
    v = (s.view(np.int64) - (np.copysign(e, s) != e)) | (e != 0)  # RO(tl + pl)
    return th + v.view(np.float64)


def _fma64_fast(a, b, c):
    """Boldo-Melquiond FMA without the safety mask (float64 arrays).

    Bit-identical to C ``fma(a, b, c)`` **provided**:

    * ``a``, ``b``, ``c`` are finite and ``|a|, |b| < 2**996``;
    * ``a == 0`` or ``b == 0``, or ``2**-968 <= |RN(a*b)| <= 2**1022``;
    * ``|c| <= 2**1022``;

    with one exception: when ``a*b`` is exactly ``-0`` and ``c`` is ``-0``
    it returns ``+0`` (C returns ``-0``). Outside these conditions the result
    may be wrong (never silently for overflow: that yields inf/nan).
    Returns ``(z, p)`` with ``p = RN(a*b)`` so that callers can mask.
    """
    p = a * b
    ah, al = veltkamp_split(a)
    bh, bl = veltkamp_split(b)
    pl = two_prod(p, ah, al, bh, bl)
    th = c + p  # TwoSum(c, p): no ordering assumption
    bb = th - c
    tl = (c - (th - bb)) + (p - bb)
    return th + _ro_add(tl, pl), p


# ---------------------------------------------------------------------------
# exact slow path for the elements the fast path does not cover


def _fma_exact_finite(a: float, b: float, c: float) -> float:
    """Correctly rounded ``a*b + c`` for finite ``a``, ``b``, ``c`` with a
    nonzero product, in exact integer arithmetic. ``int / int`` true division
    in CPython is correctly rounded (ties to even, subnormals included) and
    raises OverflowError when the rounded result does not fit."""
    na, da = a.as_integer_ratio()
    nb, db = b.as_integer_ratio()
    nc, dc = c.as_integer_ratio()
    num = na * nb * dc + nc * da * db
    if num == 0:
        return 0.0  # exact cancellation of a nonzero product: +0 under RN
    try:
        return num / (da * db * dc)
    except OverflowError:
        return float("inf") if num > 0 else float("-inf")


def _fma_slow(a, b, c):
    """Exact fma on 1-D float64 arrays (any values). Vectorised IEEE rules for
    specials and zero products; a Python loop only over finite elements with
    nonzero product (tiny/huge products, results near overflow)."""
    with np.errstate(all="ignore"):
        out = a * b + c  # exact rules when a*b is exactly 0, inf or nan
        fa, fb = np.isfinite(a), np.isfinite(b)
        out = np.where(np.isinf(c) & fa & fb, c, out)  # finite*finite + inf
    need = np.flatnonzero(fa & fb & np.isfinite(c) & (a != 0) & (b != 0))
    if need.size:
        al, bl, cl = a[need].tolist(), b[need].tolist(), c[need].tolist()
        out[need] = [_fma_exact_finite(x, y, z) for x, y, z in zip(al, bl, cl)]
    return out


# ---------------------------------------------------------------------------
# public API


def fma64(a, b, c):
    """Exactly rounded ``a*b + c`` in binary64, elementwise with broadcasting.

    Inputs are converted with ``np.asarray(x, np.float64)`` (float32 and small
    integers convert exactly). Bit-identical to C ``fma`` for every input,
    including signed zeros, subnormals, overflow to inf and inf/nan (NaN
    payloads are not specified). Returns a float64 array of the broadcast
    shape (an ``np.float64`` scalar when all inputs are scalars).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    with np.errstate(all="ignore"):
        z, p = _fma64_fast(a, b, c)
        pa = np.abs(p)
        ok = (pa >= _TINY) & (pa <= _HUGE) & np.isfinite(z)
    if not ok.all():
        bad = ~ok
        A, B, C = np.broadcast_arrays(a, b, c)
        z = np.asarray(z)  # 0-d inputs give numpy scalars; make it writeable
        z[bad] = _fma_slow(A[bad], B[bad], C[bad])
    return z[()] if z.ndim == 0 else z


def fma32(a, b, c):
    """Exactly rounded single-precision ``a*b + c`` (C ``fmaf``), elementwise
    with broadcasting; inputs are converted with ``np.asarray(x, np.float32)``.

    The float32 product is exact in binary64; ``RO64(a*b + c)`` followed by one
    rounding to float32 equals ``RN32(a*b + c)`` (rounding to odd with >= 2
    extra bits is innocuous for the second rounding, subnormals included).
    Infinities/NaN follow IEEE: the round-to-odd step only ever turns a double
    inf into +-DBL_MAX, which still rounds to the same float32 inf.
    """
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    c = np.asarray(c, dtype=np.float32)
    with np.errstate(all="ignore"):  # (signalling NaN inputs, overflow to inf)
        c = c.astype(np.float64)
        p = a.astype(np.float64) * b.astype(np.float64)  # exact: 48-bit product
        v = _ro_add(p, c)
        z = v.astype(np.float32)
    return z[()] if z.ndim == 0 else z
