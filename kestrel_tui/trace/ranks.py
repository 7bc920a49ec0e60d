"""Which rank's share of a key differs: the per-rank view of a tensor- or expert-parallel run.

A trace that ran on several ranks (the hf-dist engine) or was read from a serving engine's
per-rank dump answers `rank_values(key)`: each rank's share in rank order — its heads of a
column-parallel key, its partial sum before an all-reduce, or its copy of a replicated key the
ranks disagree on — and `partial`, the keys reached through such a sum. Another trace is
compared with it share by share: the same rank of a run with the same world size; else the
matching slice of a whole tensor, for shares that are slices of it. A partial sum is never
compared bit for bit with a whole tensor: the key it adds up to is judged instead
(docs/engines-distributed.md).

Each rank's share is kept in a position's raw values under one spelling, whichever engine made it:
``KEY@R`` for rank R's share (``rank_key``), ``KEY@sum`` for what an all-reduce returned (``sum_key``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .compare import KeyMetrics, Tolerance, key_metrics


def rank_key(key: str, rank: int) -> str:
    """The raw entry of rank ``rank``'s share of ``key``."""
    return f"{key}@{rank}"


def sum_key(key: str) -> str:
    """The raw entry of what the all-reduce returned for ``key``'s branch (the sum of the partials)."""
    return f"{key}@sum"


def rank_values(raw: Mapping[str, np.ndarray] | None, key: str) -> list[np.ndarray] | None:
    """The per-rank entries of ``key`` in one position's raw values, in rank order (None: there are none)."""
    if raw is None or rank_key(key, 0) not in raw:
        return None
    out, r = [], 0
    while rank_key(key, r) in raw:
        out.append(raw[rank_key(key, r)])
        r += 1
    return out


@dataclass(frozen=True)
class RankShare:
    rank: int
    status: str            # ok | DIFF | partial (a sum's share, judged through the key) | ? (nothing to hold it to)
    nmse: float | None = None
    metrics: KeyMetrics | None = None  # a differing float32 share's NMSE, max rel. err and max ULP


def shares(trace, key: str) -> tuple[np.ndarray, ...] | None:
    """Each rank's share of ``key`` in rank order; None for a trace of one rank, or a key not split."""
    get = getattr(trace, "rank_values", None)
    return get(key) if get is not None else None


def is_partial(trace, key: str) -> bool:
    return key in getattr(trace, "partial", ())


def world_size(trace) -> int | None:
    """The ranks a trace ran on, where it says (hf-dist: its Parallel)."""
    parallel = getattr(trace, "parallel", None)
    return getattr(parallel, "world_size", None)


def compare_shares(ref, sub, key: str) -> list[RankShare] | None:
    """The subject's shares of ``key`` held against the reference's (None: the subject has none)."""
    mine = shares(sub, key)
    if not mine:
        return None
    theirs = shares(ref, key)
    if is_partial(sub, key) and (theirs is None or len(theirs) != len(mine)):
        return [RankShare(r, "partial") for r in range(len(mine))]
    if theirs is None or len(theirs) != len(mine):
        whole = ref.raw(key)
        theirs = _slices(whole, mine) if whole is not None else None
    if theirs is None:
        return [RankShare(r, "?") for r in range(len(mine))]
    out = []
    for r, (a, b) in enumerate(zip(theirs, mine)):
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append(RankShare(r, "?"))
        elif np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            out.append(RankShare(r, "ok"))
        else:
            m = key_metrics(a, b) if a.dtype == np.float32 else None
            out.append(RankShare(r, "DIFF", m.nmse if m is not None else None, m))
    return out


def _slices(whole: np.ndarray, parts: tuple[np.ndarray, ...]) -> list[np.ndarray] | None:
    """``whole`` cut along its first axis as the shares are (a column-parallel key's heads), or a copy
    for each rank of a replicated key; None when neither fits."""
    whole = np.asarray(whole)
    if all(np.shape(p) == whole.shape for p in parts):
        return [whole] * len(parts)
    sizes = [np.shape(p)[0] if np.ndim(p) else 0 for p in parts]
    if whole.ndim == 0 or sum(sizes) != whole.shape[0] or any(np.shape(p)[1:] != whole.shape[1:] for p in parts):
        return None
    return np.split(whole, np.cumsum(sizes)[:-1], axis=0)


def line(report: list[RankShare]) -> str:
    """One line for the detail panel: each rank's verdict, the differing ones with their NMSE."""
    parts = []
    for s in report:
        parts.append(f"r{s.rank} {s.status}" + (f" ({s.nmse:.2g})" if s.nmse is not None else ""))
    return "ranks: " + " · ".join(parts)


# ---------------------------------------------------------------- a key's shares judged, for the reports

NO_SHARE = "no share"  # the key is not split: one value, judged as the key


def verdict(share: RankShare, key: str, tol: Tolerance | None) -> str:
    """A share's verdict: ok, close or far (DIFF without a tolerance, or without metrics to judge), or
    partial / ? where it has nothing of its own to be held to."""
    if share.status != "DIFF" or tol is None or share.metrics is None:
        return share.status
    return "close" if tol.for_key(key)[0].holds(share.metrics) else "far"


def split_run(ref, sub) -> bool:
    """Whether either side of a run can say what its ranks held (a parallel engine's or a dump's trace)."""
    return any(getattr(t, "rank_values", None) is not None for t in (ref, sub))


def judged(ref, sub, key: str, tol: Tolerance | None) -> dict:
    """``key``'s shares held against the reference and judged, as the headless reports give them:
    ``ranks`` each rank's verdict with its metrics (None: the key is not split), ``far`` the ranks whose
    share is far (DIFF without a tolerance)."""
    report = compare_shares(ref, sub, key)
    if not report:
        return {"key": key, "ranks": None, "far": [], "line": f"{key}: {NO_SHARE} (one value, not split over ranks)"}
    ranks = [{"rank": s.rank, "verdict": verdict(s, key, tol),
              **(s.metrics.as_dict() if s.metrics is not None else {})} for s in report]
    bad = "far" if tol is not None else "DIFF"
    far = [r["rank"] for r in ranks if r["verdict"] == bad]
    return {"key": key, "ranks": ranks, "far": far, "line": judged_line(key, ranks, far, bad)}


def judged_line(key: str, ranks: list[dict], far: list[int], bad: str) -> str:
    """One line: each rank's verdict (a differing one with its NMSE) and the ranks whose share is ``bad``."""
    parts = [f"r{r['rank']} {r['verdict']}" + (f" (nmse {r['nmse']:.3g})" if isinstance(r.get("nmse"), float) else "")
             for r in ranks]
    tail = ""
    if len(far) == 1:
        tail = f": rank {far[0]}'s share is {bad}"
    elif far:
        tail = f": the shares of ranks {', '.join(map(str, far))} are {bad}"
    elif all(r["verdict"] == "partial" for r in ranks):
        tail = (": partial sums, held only against the same rank of a run with the same world size"
                " (docs/engines-distributed.md)")
    return f"{key} by rank: {' · '.join(parts)}{tail}"
