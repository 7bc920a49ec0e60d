"""Key-by-key comparison of two runs, and element statistics for one key.

The "first DIFF" is the smallest ``order_key`` (position, then dataflow
index), never the file order: two engines may append keys in different
orders, and a prompt position must not hide behind a later decode step.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .keys import order_key


class Status(enum.Enum):
    OK = "ok"
    DIFF = "DIFF"
    MISSING_REF = "missing_ref"  # key only in the subject
    MISSING_SUB = "missing_sub"  # key only in the reference
    PENDING = "pending"          # a side that is still running has not produced it yet


_MISMATCH = (Status.DIFF, Status.MISSING_REF, Status.MISSING_SUB)


@dataclass(frozen=True)
class Comparison:
    status: dict[str, Status]       # union of keys, in order_key order
    first_diff: str | None          # smallest key with DIFF
    first_mismatch: str | None      # smallest key with DIFF or MISSING_*
    counts: dict[Status, int]       # every Status present, zeros included

    @property
    def identical(self) -> bool:
        """No DIFF and nothing missing (PENDING keys do not count: identical so far)."""
        return self.first_mismatch is None


def compare(ref: Mapping[str, int], sub: Mapping[str, int], *,
            ref_done: bool = True, sub_done: bool = True) -> Comparison:
    """Compare hash maps. A key absent from a side that is not done is PENDING."""
    status: dict[str, Status] = {}
    counts = {s: 0 for s in Status}
    first_diff = first_mismatch = None
    for k in sorted(ref.keys() | sub.keys(), key=order_key):
        if k in ref and k in sub:
            s = Status.OK if ref[k] == sub[k] else Status.DIFF
        elif k in ref:
            s = Status.MISSING_SUB if sub_done else Status.PENDING
        else:
            s = Status.MISSING_REF if ref_done else Status.PENDING
        status[k] = s
        counts[s] += 1
        if s is Status.DIFF and first_diff is None:
            first_diff = k
        if s in _MISMATCH and first_mismatch is None:
            first_mismatch = k
    return Comparison(status, first_diff, first_mismatch, counts)


# ---- element statistics -------------------------------------------------

NAN_ULP = (1 << 64) - 1  # distance given to a differing pair with a NaN on either side
ULP_BINS = (0, 1) + tuple(1 << i for i in range(1, 21))  # 0, 1, 2, 4, ..., 2^20


@dataclass(frozen=True)
class DiffStats:
    n: int                      # elements
    n_diff: int                 # elements whose bits differ (so -0 vs +0 counts)
    n_nan: int                  # differing elements with a NaN on either side
    max_ulp: int                # 0 if none; NAN_ULP if a NaN pair differs
    max_abs_err: float          # float64 |a-b| over differing non-NaN pairs
    first_index: int | None     # flat C-order index of the first differing element
    first_a: float | int | None
    first_b: float | int | None

    @property
    def identical(self) -> bool:
        return self.n_diff == 0


def _prepare(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"diff_stats: shape mismatch {a.shape} vs {b.shape}")
    da, db = a.dtype.newbyteorder("="), b.dtype.newbyteorder("=")
    if da != db:
        raise ValueError(f"diff_stats: dtype mismatch {a.dtype} vs {b.dtype}")
    if not (da.kind in "iu" or (da.kind == "f" and da.itemsize in (2, 4, 8))):
        raise ValueError(f"diff_stats: unsupported dtype {a.dtype} (want float or integer)")
    return a.astype(da, copy=False).ravel(), b.astype(db, copy=False).ravel()


def _ordered(x: np.ndarray) -> np.ndarray:
    """Map values to uint64 so that integer order is numeric order.

    Floats: IEEE sign-magnitude bits become two's complement (negative
    patterns m -> -m), so adjacent floats differ by 1, +0 and -0 both map to
    0, denormals sit contiguously between them and the normals, and ±inf are
    one step beyond ±max. Then an offset of 2^63 makes it unsigned, so a
    difference of two of these always fits in uint64 (float64 included).
    """
    bias = np.uint64(1 << 63)
    if x.dtype.kind == "u":
        return x.astype(np.uint64)
    if x.dtype.kind == "i":
        return x.astype(np.int64).view(np.uint64) ^ bias
    w = x.dtype.itemsize
    s = x.view(f"i{w}").astype(np.int64)
    int_min = np.int64(-(1 << (8 * w - 1)))
    with np.errstate(over="ignore"):  # the discarded where-branch may wrap for w=8
        o = np.where(s < 0, int_min - s, s)
    return o.view(np.uint64) ^ bias


def _bits_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    u = f"u{a.dtype.itemsize}"
    return a.view(u) != b.view(u)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-element distance (uint64, flat): ULPs for floats, |a-b| for integers.

    Bitwise-equal elements are 0 (NaN included); a differing pair with a NaN
    on either side is NAN_ULP, beyond every real distance.
    """
    a, b = _prepare(a, b)
    oa, ob = _ordered(a), _ordered(b)
    d = np.where(oa >= ob, oa - ob, ob - oa)
    if a.dtype.kind == "f":
        nan = (np.isnan(a) | np.isnan(b)) & _bits_differ(a, b)
        d[nan] = NAN_ULP
    return d


def diff_stats(a: np.ndarray, b: np.ndarray) -> DiffStats:
    a, b = _prepare(a, b)
    diff = _bits_differ(a, b)
    idx = np.flatnonzero(diff)
    if idx.size == 0:
        return DiffStats(a.size, 0, 0, 0, 0.0, None, None, None)
    da, db = a[idx], b[idx]
    dist = ulp_distance(da, db)
    nan = (np.isnan(da) | np.isnan(db)) if a.dtype.kind == "f" else np.zeros(idx.size, bool)
    with np.errstate(over="ignore", invalid="ignore"):
        err = np.abs(da[~nan].astype(np.float64) - db[~nan].astype(np.float64))
    i = int(idx[0])
    return DiffStats(
        n=a.size, n_diff=int(idx.size), n_nan=int(nan.sum()),
        max_ulp=int(dist.max()),
        max_abs_err=float(err.max()) if err.size else 0.0,
        first_index=i, first_a=a[i].item(), first_b=b[i].item(),
    )


def ulp_histogram(a: np.ndarray, b: np.ndarray, bins: Sequence[int] = ULP_BINS) -> list[int]:
    """Element counts per distance bucket; ``len(bins) + 1`` counts summing to n.

    Bucket i holds ``bins[i-1] < d <= bins[i]``; the last holds ``d > bins[-1]``
    (NaN pairs land there). With ULP_BINS: 0, 1, 2, 3-4, 5-8, ..., >2^20.
    """
    edges = np.asarray(bins, dtype=np.uint64)
    if edges.ndim != 1 or edges.size == 0 or np.any(edges[1:] <= edges[:-1]):
        raise ValueError("ulp_histogram: bins must be strictly increasing non-negative ints")
    where = np.searchsorted(edges, ulp_distance(a, b), side="left")
    return np.bincount(where, minlength=edges.size + 1).tolist()


def ulp_bin_labels(bins: Sequence[int] = ULP_BINS) -> list[str]:
    labels, lo = [], -1
    for hi in bins:
        labels.append(str(hi) if hi - lo == 1 else f"{lo + 1}-{hi}")
        lo = hi
    return labels + [f">{bins[-1]}"]
