"""Key-by-key comparison of two runs, and element statistics for one key.

The "first DIFF" is the smallest ``order_key`` (position, then dataflow
index), never the file order: two engines may append keys in different
orders, and a prompt position must not hide behind a later decode step.
"""
from __future__ import annotations

import difflib
import enum
import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..bounds import Number
from .keys import order_key, parse_key


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


# ---- tolerance: ok / close / far ------------------------------------------
#
# A DIFF key whose raw buffers both exist is *close* when every criterion of
# the tolerance holds and *far* otherwise; ok keys (bits equal) stay ok, and a
# DIFF key without raw values on both sides (hash-only dumps) stays DIFF.
#
# NMSE is llama.cpp test-backend-ops' metric, sum((a-b)^2) / sum(a^2), with
# ``a`` the *reference* (the denominator's side), computed in float64. Pairs
# whose bits are equal contribute nothing, so matching NaN/inf elements are
# skipped on both sides; a pair where either side is NaN or inf and the bits
# differ (NaN vs a number, inf vs -inf, inf vs finite) is a non-finite
# mismatch, which makes the key far whatever the tolerance (nmse and
# max_rel_err inf). A zero denominator gives nmse 0 when the numerator is 0
# too (e.g. -0 vs +0) and inf otherwise. The sums are scaled by a power of two
# near the largest magnitude so that float64 denormals do not underflow to 0/0
# and large float64 values do not overflow.

CLOSE = "close"
FAR = "far"
_TOL_NAMES = ("nmse", "ulp", "rel")
_CRITERIA_HELP = "nmse=X, ulp=N or rel=X, comma-combined, e.g. nmse=1e-7,ulp=4"
_TOL_HELP = f"want {_CRITERIA_HELP}"
_RULE_HELP = ("a rule is PATTERN:CRITERIA with one ':', PATTERN a field or a glob over key names, CRITERIA"
              " comma-combined, e.g. t*_l3_*:nmse=1e-7,ulp=4")
# A key is printable ASCII without ':' (a dump's tags are); ',' and '=' belong to the criteria.
_PATTERN = re.compile(r"[!-~]+")
_PATTERN_NOT = ":,="
# The criteria's numbers (bounds.py: ASCII digits, finite): nmse and rel any size >= 0, ulp whole.
_NUMBERS = {"nmse": Number(lo=0), "rel": Number(lo=0), "ulp": Number(whole=True, lo=0, unit="ULPs")}


@dataclass(frozen=True)
class Tolerance:
    """Criteria that must all hold for a DIFF key to be close; None = not checked.

    The default is NMSE <= 1e-7 alone; a spec string names exactly the
    criteria it wants (``ulp=4`` checks ULPs only). ``rules`` judge some keys
    by their own criteria, as Polygraphy's per-output tolerances do: the first
    rule whose pattern matches a key judges it (a field name, ``logits``, or a
    glob over key names, ``t*_l3_*``), the criteria above judge the rest.
    """
    nmse: float | None = 1e-7
    ulp: int | None = None
    rel: float | None = None
    rules: tuple[tuple[str, "Tolerance"], ...] = ()

    def spec(self) -> str:
        parts = [f"nmse={self.nmse:g}" if self.nmse is not None else None,
                 f"ulp={self.ulp}" if self.ulp is not None else None,
                 f"rel={self.rel:g}" if self.rel is not None else None]
        own = ",".join(p for p in parts if p) or "none"
        return " ".join([own, *(f"{pattern}:{t.spec()}" for pattern, t in self.rules)])

    def for_key(self, key: str) -> tuple["Tolerance", str]:
        """The criteria that judge ``key`` and the rule's name (its pattern, or "default")."""
        for pattern, t in self.rules:
            if _matches(pattern, key):
                return t, pattern
        return (Tolerance(self.nmse, self.ulp, self.rel) if self.rules else self), "default"

    def holds(self, m: "KeyMetrics") -> bool:
        if m.nonfinite:
            return False
        return ((self.nmse is None or m.nmse <= self.nmse)
                and (self.ulp is None or m.max_ulp <= self.ulp)
                and (self.rel is None or m.max_rel_err <= self.rel))


def _matches(pattern: str, key: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(key, pattern)
    return parse_key(key).field == pattern


def parse_tolerance(spec: str) -> Tolerance:
    """``nmse=1e-7``, ``ulp=4``, ``rel=1e-3`` or ``default``, comma-combined (all must hold); then,
    space-separated, per-key rules ``PATTERN:CRITERIA`` (``logits:nmse=1e-5 emb:ulp=0``), the first
    match judging a key. Without a group of its own the default is ``default`` (nmse=1e-7)."""
    from ..errors import UsageError
    from .fields import NAMES

    groups = re.sub(r"\s*([=,:])\s*", r"\1", spec.strip()).split()  # "nmse = 1e-7 , ulp=4" is one group
    if not groups:
        raise UsageError(f"--tol {spec!r}: empty tolerance ({_TOL_HELP})")
    base, rules = None, []
    for group in groups:
        pattern, colon, criteria = group.partition(":")
        if ":" in criteria:
            raise UsageError(f"--tol {spec!r}: {group!r} has {group.count(':')} ':'; {_RULE_HELP}")
        if not colon:
            if base is not None:
                raise UsageError(f"--tol {spec!r}: two default criteria ({base.spec()} and {group});"
                                 f" give one, and PATTERN:CRITERIA for the keys judged otherwise")
            base = _criteria(spec, group)
            continue
        if not pattern:
            raise UsageError(f"--tol {spec!r}: {group!r} names no keys; write FIELD:CRITERIA or GLOB:CRITERIA,"
                             f" e.g. logits:nmse=1e-5")
        if not _PATTERN.fullmatch(pattern) or any(c in pattern for c in _PATTERN_NOT):
            raise UsageError(f"--tol {spec!r}: the pattern {pattern!r} holds characters no key has (keys are"
                             f" printable ASCII without ':', ',' or '='); {_RULE_HELP}")
        if not any(c in pattern for c in "*?[") and pattern not in NAMES:
            close = difflib.get_close_matches(pattern, NAMES, n=1)
            raise UsageError(f"--tol {spec!r}: {pattern!r} is no field" + (f" (did you mean {close[0]}?)" if close
                             else "") + "; name a field (trace/fields.py) or a glob over key names such as t*_l3_*")
        if any(p == pattern for p, _ in rules):
            raise UsageError(f"--tol {spec!r}: {pattern} given twice")
        rules.append((pattern, _criteria(spec, criteria)))
    base = base if base is not None else Tolerance()
    return Tolerance(base.nmse, base.ulp, base.rel, tuple(rules))


def _criteria(spec: str, text: str) -> Tolerance:
    """One group of comma-combined criteria: ``nmse=1e-7,ulp=4`` or ``default``."""
    from ..errors import UsageError

    if text == "default":
        return Tolerance()
    if not text:
        raise UsageError(f"--tol {spec!r}: empty tolerance ({_TOL_HELP})")
    seen: dict[str, float | int] = {}
    for part in text.split(","):
        p = part.strip()
        name, eq, value = p.partition("=")
        name, value = name.strip().lower(), value.strip()
        if not eq or not name or not value:
            raise UsageError(f"--tol {spec!r}: {p!r} is not name=value ({_TOL_HELP})")
        if name not in _TOL_NAMES:
            raise UsageError(f"--tol {spec!r}: unknown criterion {name!r} ({_TOL_HELP})")
        if name in seen:
            raise UsageError(f"--tol {spec!r}: {name} given twice")
        number = _NUMBERS[name]
        problem = number.problem(value)
        if problem is not None:
            raise UsageError(f"--tol {spec!r}: {name}={value!r} {problem}; {name} takes {number.allowed()}"
                             f" (criteria: {_CRITERIA_HELP})")
        seen[name] = number.parse(value, name)
    return Tolerance(nmse=seen.get("nmse"), ulp=seen.get("ulp"), rel=seen.get("rel"))


@dataclass(frozen=True)
class KeyMetrics:
    nmse: float          # sum((ref-sub)^2) / sum(ref^2) over finite pairs; inf on a non-finite mismatch
    max_rel_err: float   # max |ref-sub| / |ref| (a zero ref with a nonzero sub: inf)
    max_ulp: int         # ulp_distance's max (NAN_ULP for a NaN mismatch)
    nonfinite: int = 0   # differing pairs with NaN or inf on either side

    def as_dict(self) -> dict:
        def num(x: float):
            return x if x != float("inf") else "inf"  # JSON has no inf
        return {"nmse": num(self.nmse), "max_rel_err": num(self.max_rel_err), "max_ulp": self.max_ulp}


UNCOMPARABLE = KeyMetrics(float("inf"), float("inf"), NAN_ULP, 1)  # shapes or dtypes differ


def key_metrics(ref: np.ndarray, sub: np.ndarray) -> KeyMetrics:
    """Tolerance metrics of one key; ``ref`` is the reference (NMSE's and rel. err's denominator)."""
    try:
        a, b = _prepare(ref, sub)
    except ValueError:
        return UNCOMPARABLE
    if a.size == 0:
        return KeyMetrics(0.0, 0.0, 0)
    max_ulp = int(ulp_distance(a, b).max())
    diff = _bits_differ(a, b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(a64) & np.isfinite(b64)
    nonfinite = int((diff & ~finite).sum())
    if nonfinite:
        return KeyMetrics(float("inf"), float("inf"), max_ulp, nonfinite)
    a64, b64 = a64[finite], b64[finite]  # bit-equal NaN/inf pairs drop out of both sums
    d = np.abs(a64 - b64)
    biggest = float(np.max(np.maximum(np.abs(a64), np.abs(b64)), initial=0.0))
    if biggest == 0.0:
        return KeyMetrics(0.0, 0.0, max_ulp)
    scale = float(np.ldexp(1.0, np.frexp(biggest)[1]))  # a power of two: scaling itself rounds nothing
    num = float(np.sum(np.square(d / scale)))
    den = float(np.sum(np.square(a64 / scale)))
    nmse = (0.0 if num == 0.0 else float("inf")) if den == 0.0 else num / den
    absa = np.abs(a64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(d == 0.0, 0.0, np.where(absa == 0.0, np.inf, d / np.where(absa == 0.0, 1.0, absa)))
    return KeyMetrics(nmse, float(rel.max(initial=0.0)), max_ulp)


def classify(status: Status, ref: np.ndarray | None, sub: np.ndarray | None,
             tol: Tolerance = Tolerance()) -> tuple[str, KeyMetrics | None]:
    """("ok" | "close" | "far" | status.value, metrics): only a DIFF with both raw buffers is judged."""
    if status is not Status.DIFF or ref is None or sub is None:
        return status.value, None
    m = key_metrics(ref, sub)
    return (CLOSE if tol.holds(m) else FAR), m
