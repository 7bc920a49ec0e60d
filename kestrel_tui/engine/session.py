"""A debugging session: one reference trace, many subject runs compared against it.

The reference depends only on the model, prompt, token count and formats, so it
is computed once and reused across toggle changes. Each subject run is
compared key by key as its positions arrive (the app's grid fills from the
`on_position` callback); the history records where each change moved the
first DIFF.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from ..backends.toggles import describe
from ..model.weights import Model
from ..trace.compare import (CLOSE, FAR, Comparison, DiffStats, KeyMetrics, Status, Tolerance, compare,
                             diff_stats, key_metrics)
from ..trace.keys import order_key
from .build import make_backend
from .run import Position, Trace, run_decode

MODES = ("chain", "isolate")
PREFILLS = ("reference", "subject")
FORCINGS = ("teacher", "free")


@dataclass(frozen=True)
class RunSettings:
    exact: frozenset[str] = frozenset()
    mode: str = "chain"  # isolate: every subject op is fed the reference's inputs
    prefill: str = "reference"  # where the prompt runs (the seed's trap: subject prefill shifts KV rows)
    forcing: str = "teacher"  # teacher: the subject consumes the reference's tokens

    def label(self) -> str:
        extra = [s for s, default in ((self.mode, "chain"), (f"prefill={self.prefill}", "prefill=reference"),
                                      (f"forcing={self.forcing}", "forcing=teacher")) if s != default]
        return ", ".join([describe(self.exact), *extra])


@dataclass(frozen=True)
class TokenSummary:
    t: int
    prompt: bool
    ref_top1: int
    sub_top1: int
    n_diff: int

    @property
    def flip(self) -> bool:
        return self.ref_top1 != self.sub_top1


@dataclass(frozen=True)
class ToleranceSummary:
    """DIFF keys judged against a tolerance (ok keys stay ok; hash-only DIFF keys are not judged)."""
    tolerance: Tolerance
    first_far: str | None               # smallest far key in dataflow order
    n_close: int
    n_far: int
    n_unjudged: int                     # DIFF keys without both raw buffers (they stay DIFF)
    n_missing: int                      # keys on one side only
    verdict: dict[str, str]             # DIFF key -> "close" | "far", in dataflow order
    metrics: dict[str, KeyMetrics]      # same keys

    @property
    def all_close(self) -> bool:
        """Every key ok or close: no far key, no hash-only DIFF, nothing missing."""
        return self.n_far == 0 and self.n_unjudged == 0 and self.n_missing == 0


@dataclass
class RunResult:
    settings: RunSettings
    ref: Trace
    sub: Trace
    comparison: Comparison
    tokens: list[TokenSummary]
    _stats: dict[str, DiffStats] = field(default_factory=dict, repr=False)
    _metrics: dict[str, KeyMetrics | None] = field(default_factory=dict, repr=False)
    _summaries: dict[Tolerance, ToleranceSummary] = field(default_factory=dict, repr=False)

    @property
    def first_diff(self) -> str | None:
        return self.comparison.first_diff

    @property
    def all_ok(self) -> bool:
        return self.comparison.identical

    def stats(self, key: str) -> DiffStats | None:
        """Element statistics for a key from both raw buffers (None when either is absent)."""
        if key not in self._stats:
            a, b = self.ref.raw(key), self.sub.raw(key)
            if a is None or b is None:
                return None
            self._stats[key] = diff_stats(a, b)
        return self._stats[key]

    def metrics(self, key: str) -> KeyMetrics | None:
        """Tolerance metrics (NMSE, max rel. err, max ULP) for a key; None when either raw buffer is absent."""
        if key not in self._metrics:
            a, b = self.ref.raw(key), self.sub.raw(key)
            self._metrics[key] = None if a is None or b is None else key_metrics(a, b)
        return self._metrics[key]

    def tolerance(self, tol: Tolerance = Tolerance()) -> ToleranceSummary:
        """Judge every DIFF key against ``tol`` (metrics computed on first use, per key, then cached;
        the summary cached per tolerance: bisection asks for it several times a trial)."""
        if tol not in self._summaries:
            self._summaries[tol] = self._judge(tol)
        return self._summaries[tol]

    def _judge(self, tol: Tolerance) -> ToleranceSummary:
        verdict: dict[str, str] = {}
        metrics: dict[str, KeyMetrics] = {}
        first_far, unjudged = None, 0
        for key, st in self.comparison.status.items():  # already in order_key order
            if st is not Status.DIFF:
                continue
            m = self.metrics(key)
            if m is None:
                unjudged += 1
                continue
            metrics[key] = m
            verdict[key] = CLOSE if tol.holds(m) else FAR
            if verdict[key] == FAR and first_far is None:  # statuses come in dataflow order
                first_far = key
        n_far = sum(1 for v in verdict.values() if v == FAR)
        n_missing = self.comparison.counts[Status.MISSING_REF] + self.comparison.counts[Status.MISSING_SUB]
        return ToleranceSummary(tol, first_far, len(verdict) - n_far, n_far, unjudged, n_missing, verdict, metrics)


@dataclass(frozen=True)
class HistoryEntry:
    changes: tuple[str, ...]  # ("+expf",), ("-norm", "mode isolate"); () for the first run
    settings: RunSettings
    before: str | None
    after: str | None  # None: all ok

    @property
    def change(self) -> str:
        return " ".join(self.changes) if self.changes else "start"

    def line(self, none: str = "all ok") -> str:
        """`none` names the target reached when there is no key to show (bisect --target far: "no far key")."""
        def show(k):
            return k or none
        return f"{self.change:<14} {show(self.before)} -> {show(self.after)}"


def setting_changes(old: RunSettings | None, new: RunSettings) -> tuple[str, ...]:
    """One item per setting that changed: "+op", "-op", "mode isolate"; ("rerun",) when none did."""
    if old is None:
        return ()
    parts = [f"+{t}" for t in sorted(new.exact - old.exact)] + [f"-{t}" for t in sorted(old.exact - new.exact)]
    for name in ("mode", "prefill", "forcing"):
        if getattr(old, name) != getattr(new, name):
            parts.append(f"{name} {getattr(new, name)}")
    return tuple(parts) or ("rerun",)


def summarize(ref: Trace, sub: Trace, cmp: Comparison) -> list[TokenSummary]:
    out = []
    for p_ref, p_sub in zip(ref.positions, sub.positions):
        n = sum(1 for k in p_ref.hashes if cmp.status.get(k) is not Status.OK)
        out.append(TokenSummary(p_ref.t, p_ref.prompt, p_ref.top1, p_sub.top1, n))
    return out


class Session:
    def __init__(self, model: Model, prompt: list[int], n_tokens: int, *, subject: str = "sim",
                 kv: str = "q8", deep: bool = False):
        self.model, self.prompt, self.n_tokens = model, list(prompt), n_tokens
        self.subject, self.kv, self.deep = subject, kv, deep
        self._ref: Trace | None = None
        self._lock = threading.Lock()
        self.history: list[HistoryEntry] = []
        self.last: RunResult | None = None

    def reference(self, on_position: Callable[[Position], None] | None = None,
                  cancel: threading.Event | None = None) -> Trace:
        with self._lock:
            if self._ref is None:
                backend = make_backend("cpu", self.model, kv=self.kv, deep=self.deep)
                self._ref = run_decode(backend, self.prompt, self.n_tokens, on_position=on_position, cancel=cancel)
            return self._ref

    def run(self, settings: RunSettings, on_position: Callable[[Position, dict[str, Status]], None] | None = None,
            cancel: threading.Event | None = None, record: bool = True, stop_at_first_diff: bool = False) -> RunResult:
        """Run the subject with these settings against the cached reference.

        on_position(pos, statuses) is called as each subject position completes,
        with that position's per-key status. stop_at_first_diff ends the run at
        the first position holding a DIFF (bisection only needs where it is).
        """
        ref = self.reference(cancel=cancel)
        P = len(self.prompt)
        isolate = settings.mode == "isolate"
        forced = None
        if settings.forcing == "teacher" or isolate:  # isolation needs identical inputs, so it forces
            forced = [p.token for p in ref.positions[P:]]
        backend = make_backend(self.subject, self.model, kv=self.kv, exact=settings.exact, deep=self.deep)
        stop = threading.Event()

        def watch(pos: Position):
            ref_pos = ref.positions[pos.t]
            statuses = compare(ref_pos.hashes, pos.hashes).status
            if on_position:
                on_position(pos, statuses)
            if stop_at_first_diff and any(s is Status.DIFF for s in statuses.values()):
                stop.set()

        sub = run_decode(backend, self.prompt, self.n_tokens, forced=forced,
                         prefill_from=ref if settings.prefill == "reference" else None,
                         feed_from=ref if isolate else None, on_position=watch, cancel=cancel, stop=stop.is_set)
        # an early stop compares only the positions that ran
        cmp = compare(ref.hashes(len(sub.positions)), sub.hashes())
        result = RunResult(settings, ref, sub, cmp, summarize(ref, sub, cmp))
        if record:
            prev = self.last
            self.history.append(HistoryEntry(setting_changes(prev.settings if prev else None, settings), settings,
                                             prev.first_diff if prev else None, result.first_diff))
        self.last = result
        return result


def first_diff_later(a: str | None, b: str | None) -> bool:
    """True when first DIFF b lies strictly later in dataflow order than a (None = all ok)."""
    if b is None:
        return a is not None
    return a is not None and order_key(b) > order_key(a)


