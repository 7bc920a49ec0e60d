"""A debugging session: one reference trace, many subject runs compared against it.

The reference depends only on the model, prompt, token count and formats, so it
is computed once and reused across toggle changes. Each subject run is
compared key by key as its positions arrive (the app's grid fills from the
`on_position` callback); the history records where each change moved the
first DIFF.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from ..backends.toggles import TOGGLES
from ..engines.base import Engine, EngineFailed, Graft, RunRequest, Toggle
from ..engines.build import make_engine
from ..engines.schedule import DECODE
from ..model.weights import Model
from ..trace.compare import (CLOSE, FAR, Comparison, DiffStats, KeyMetrics, Status, Tolerance, compare,
                             diff_stats, key_metrics)
from ..trace.events import Event, event_before, find_events, logit_margin
from ..trace.keys import order_key, parse_key
from ..trace.run import Position, Trace

MODES = ("chain", "isolate")
PREFILLS = ("reference", "subject")
FORCINGS = ("teacher", "free")


@dataclass(frozen=True)
class RunSettings:
    exact: frozenset[str] = frozenset()  # binary toggles at their exact value
    mode: str = "chain"  # isolate: every subject op is fed the reference's inputs
    prefill: str = "reference"  # where the prompt runs (the seed's trap: subject prefill shifts KV rows)
    forcing: str = "teacher"  # teacher: the subject consumes the reference's tokens
    picks: tuple[tuple[str, str], ...] = ()  # list toggles away from their default, sorted by name

    def label(self, order: tuple[str, ...] = TOGGLES) -> str:
        """``order``: the subject's binary toggle names (for "all exact" and a stable order)."""
        extra = [s for s, default in ((self.mode, "chain"), (f"prefill={self.prefill}", "prefill=reference"),
                                      (f"forcing={self.forcing}", "forcing=teacher")) if s != default]
        return ", ".join([_describe_exact(self.exact, order), *(f"{n}={v}" for n, v in self.picks), *extra])

    def value(self, toggle: Toggle) -> str:
        if toggle.binary and toggle.name in self.exact:
            return toggle.exact
        return dict(self.picks).get(toggle.name, toggle.fast if toggle.binary else toggle.default)

    def values(self, toggles: tuple[Toggle, ...]) -> dict[str, str]:
        return {t.name: self.value(t) for t in toggles}

    def pick(self, toggle: Toggle, value: str) -> "RunSettings":
        """These settings with ``toggle`` set to ``value``: a binary toggle's exact value goes in ``exact``,
        any other value not its plain one (a 3-valued binary toggle's third, a list toggle's) in ``picks``."""
        rest = {n: v for n, v in self.picks if n != toggle.name}
        exact = self.exact - {toggle.name}
        if toggle.binary and value == toggle.exact:
            exact = exact | {toggle.name}
        elif value != (toggle.fast if toggle.binary else toggle.default):
            rest[toggle.name] = value
        return replace(self, exact=exact, picks=tuple(sorted(rest.items())))


def starting_exact(toggles: tuple[Toggle, ...]) -> frozenset[str]:
    """The binary toggles whose default is their exact value (a profile may start one there)."""
    return frozenset(t.name for t in toggles if t.binary and t.default == t.exact)


def _describe_exact(exact: frozenset[str], order: tuple[str, ...]) -> str:
    if not order and not exact:
        return "no toggles"
    if not exact:
        return "all fast"
    if order and exact >= set(order):
        return "all exact"
    return "exact: " + ",".join([t for t in order if t in exact] + sorted(exact - set(order)))


@dataclass(frozen=True)
class Failure:
    """An engine that stopped (EngineFailed): which side, which engine, and its one-line reason."""
    side: str  # "reference" | "subject"
    engine: str
    reason: str

    def as_dict(self) -> dict:
        return {"side": self.side, "engine": self.engine, "reason": self.reason}

    def __str__(self) -> str:
        return self.reason


class SideFailed(EngineFailed):
    """EngineFailed naming the side that failed, for a failure no result can be made of (the
    reference, or a subject that finished nothing): the CLI's exit 3 and --json's `failed`."""

    def __init__(self, failure: Failure, partial=None):
        super().__init__(failure.reason, partial)
        self.failure = failure


@dataclass(frozen=True)
class TokenSummary:
    t: int
    prompt: bool
    ref_top1: int
    sub_top1: int
    n_diff: int
    ref_margin: float | None = None  # the reference's top-1 minus top-2 logit (None: no logits)

    @property
    def flip(self) -> bool:
        """Both top-1s known (-1: an engine without logits) and different."""
        return self.ref_top1 >= 0 and self.sub_top1 >= 0 and self.ref_top1 != self.sub_top1


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
    no_raw: tuple[str, ...] = ()        # the sides ("reference", "subject") lacking an unjudged key's buffer
    rule: dict[str, str] = field(default_factory=dict)  # judged key -> the tolerance's rule that judged it

    def criteria(self, key: str) -> Tolerance:
        """The criteria ``key`` is judged by (a per-key rule's, else the default)."""
        return self.tolerance.for_key(key)[0]

    @property
    def all_close(self) -> bool:
        """Every key ok or close: no far key, no hash-only DIFF, nothing missing."""
        return self.n_far == 0 and self.n_unjudged == 0 and self.n_missing == 0

    @property
    def n_judged(self) -> int:
        return self.n_close + self.n_far

    def not_close(self) -> str | None:
        """Why a run without a far key is still not all close (one line); None when it is, or a key is far."""
        if self.n_far or self.all_close:
            return None
        parts = []
        if self.n_unjudged:
            sides = " and ".join(f"the {s}" for s in self.no_raw) or "a side"
            parts.append(f"{self.n_unjudged} DIFF key{'s' * (self.n_unjudged != 1)} could not be judged"
                         f" ({sides} gave no raw values for {'them' if self.n_unjudged != 1 else 'it'})")
        if self.n_missing:
            parts.append(f"{self.n_missing} key{'s' * (self.n_missing != 1)} missing")
        return "; ".join(parts)


@dataclass
class RunResult:
    settings: RunSettings
    ref: Trace
    sub: Trace
    comparison: Comparison
    tokens: list[TokenSummary]
    notes: tuple[str, ...] = ()  # settings the subject could not honour; how it failed, if it did
    expected_missing: frozenset[str] = frozenset()  # keys one engine never makes (not failures)
    failed: Failure | None = None  # the subject stopped midway (EngineFailed); str() is its one-line message
    _stats: dict[str, DiffStats] = field(default_factory=dict, repr=False)
    _metrics: dict[str, KeyMetrics | None] = field(default_factory=dict, repr=False)
    _summaries: dict[Tolerance, ToleranceSummary] = field(default_factory=dict, repr=False)
    _events: list[Event] | None = field(default=None, repr=False)
    _mismatch: list = field(default_factory=list, repr=False)  # [RunMismatch | None] once computed

    @property
    def mismatch(self):
        """The logprob mismatch of the reference's chosen tokens (trace/logprobs.py); None without logits."""
        if not self._mismatch:
            from ..trace.logprobs import run_mismatch

            self._mismatch.append(run_mismatch(self.ref, self.sub))
        return self._mismatch[0]

    @property
    def first_diff(self) -> str | None:
        return self.comparison.first_diff

    @property
    def first_problem(self) -> str | None:
        """The first DIFF, else (a subject that stopped) the first key it should have made; None: all ok."""
        if self.first_diff is not None or self.n_missing == 0:
            return self.first_diff
        return next(k for k, st in self.comparison.status.items()
                    if st in (Status.MISSING_REF, Status.MISSING_SUB) and k not in self.expected_missing)

    @property
    def all_ok(self) -> bool:
        """No DIFF, and nothing missing but the keys one side never makes."""
        cmp = self.comparison
        if cmp.first_diff is not None:
            return False
        if cmp.first_mismatch is None:
            return True
        return all(k in self.expected_missing for k, st in cmp.status.items()
                   if st in (Status.MISSING_REF, Status.MISSING_SUB))

    @property
    def n_missing(self) -> int:
        """Keys missing where both engines make them (the subject failed or stopped)."""
        cmp = self.comparison
        return cmp.counts[Status.MISSING_REF] + cmp.counts[Status.MISSING_SUB] - len(self.expected_missing)

    @property
    def events(self) -> list[Event]:
        """The discrete events among the DIFF keys (trace/events.py: a flipped expert set, a top-1 flip
        and its margin, a q8 scale a ULP off), in dataflow order; found once, then kept."""
        if self._events is None:
            diff = [k for k, st in self.comparison.status.items() if st is Status.DIFF]
            self._events = find_events(diff, _raw_of(self.ref), _raw_of(self.sub))
        return self._events

    def cause_of(self, key: str) -> Event | None:
        """The event a DIFF key follows (event_before): what the keys after an expert flip inherit."""
        return event_before(self.events, key)

    def stats(self, key: str) -> DiffStats | None:
        """Element statistics for a key from both raw buffers (None when either is absent)."""
        if key not in self._stats:
            a, b = self.ref.raw(key), self.sub.raw(key)
            if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
                return None  # two shapes or dtypes: nothing element by element (metrics: uncomparable)
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
        rule: dict[str, str] = {}
        first_far, unjudged, no_raw = None, 0, set()
        for key, st in self.comparison.status.items():  # already in order_key order
            if st is not Status.DIFF:
                continue
            m = self.metrics(key)
            if m is None:
                unjudged += 1
                no_raw.update(side for side, trace in (("reference", self.ref), ("subject", self.sub))
                              if trace.raw(key) is None)
                continue
            metrics[key] = m
            criteria, rule[key] = tol.for_key(key)
            verdict[key] = CLOSE if criteria.holds(m) else FAR
            if verdict[key] == FAR and first_far is None:  # statuses come in dataflow order
                first_far = key
        n_far = sum(1 for v in verdict.values() if v == FAR)
        n_missing = self.n_missing
        return ToleranceSummary(tol, first_far, len(verdict) - n_far, n_far, unjudged, n_missing, verdict, metrics,
                                tuple(s for s in ("reference", "subject") if s in no_raw), rule)


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
    old_picks, new_picks = dict(old.picks), dict(new.picks)
    for name in sorted(old_picks.keys() | new_picks.keys()):
        if old_picks.get(name) != new_picks.get(name):
            parts.append(f"{name}={new_picks.get(name, 'default')}")
    for name in ("mode", "prefill", "forcing"):
        if getattr(old, name) != getattr(new, name):
            parts.append(f"{name} {getattr(new, name)}")
    return tuple(parts) or ("rerun",)


def _raw_of(trace: Trace):
    """key -> raw array; a position's logits count as its logits key's raw values."""
    def get(key: str):
        a = trace.raw(key)
        if a is None and parse_key(key).field == "logits":
            t = parse_key(key).t
            if t < len(trace.positions):
                a = trace.positions[t].logits
        return a
    return get


def summarize(ref: Trace, sub: Trace, cmp: Comparison, failing=None) -> list[TokenSummary]:
    """Per position: both top-1s and the keys that fail there (DIFF, or missing where expected)."""
    failing = failing or (lambda k, st: st is not Status.OK)
    out = []
    for p_ref, p_sub in zip(ref.positions, sub.positions):
        n = sum(1 for k in p_ref.hashes.keys() | p_sub.hashes.keys() if failing(k, cmp.status.get(k, Status.OK)))
        margin = logit_margin(p_ref.logits) if p_ref.logits is not None else None
        out.append(TokenSummary(p_ref.t, p_ref.prompt, p_ref.top1, p_sub.top1, n, margin))
    return out


def _engine(engine: str | Engine, model: Model, kv: str, deep: bool) -> Engine:
    return engine if isinstance(engine, Engine) else make_engine(engine, model, kv=kv, deep=deep)


class Session:
    """``reference`` and ``subject`` are engines (or built-in names: cpu, sim, cuda). The subject's
    toggles are what RunSettings switch; the reference runs once, with its own option values."""

    def __init__(self, model: Model, prompt: list[int], n_tokens: int, *, subject: str | Engine = "sim",
                 reference: str | Engine = "cpu", kv: str = "q8", deep: bool = False, cache=None,
                 forced: list[int] | None = None):
        self.model, self.prompt, self.n_tokens = model, list(prompt), n_tokens
        # the tokens after the prompt, given (a sequence another engine scored): the reference consumes them
        # instead of its own greedy ones, and teacher forcing hands the subject the same
        self.forced = None if forced is None else list(forced)
        self.kv, self.deep = kv, deep
        self.cache = cache  # a session.refcache.RefCache, or None: the reference is always computed
        self.reference_cached = False  # the reference came from the cache
        self.reference_engine = _engine(reference, model, kv, deep)
        self.subject_engine = _engine(subject, model, kv, deep)
        # what the user should know about the engines as built (the numpy reference standing in)
        self.notes = tuple(dict.fromkeys(n for e in (self.reference_engine, self.subject_engine)
                                         for n in getattr(e, "notes", ())))
        self._ref: Trace | None = None
        self._lock = threading.Lock()
        self.history: list[HistoryEntry] = []
        self.last: RunResult | None = None

    @property
    def subject(self) -> str:
        return self.subject_engine.name

    @property
    def toggles(self) -> tuple[Toggle, ...]:
        return self.subject_engine.toggles

    @property
    def binary_toggles(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.toggles if t.binary)

    def initial_settings(self) -> RunSettings:
        """Every toggle at its default (a profile may start a binary toggle on its exact value)."""
        return RunSettings(exact=starting_exact(self.toggles))

    def label(self, settings: RunSettings) -> str:
        return settings.label(self.binary_toggles)

    def reference(self, on_position: Callable[[Position], None] | None = None,
                  cancel: threading.Event | None = None) -> Trace:
        with self._lock:
            if self._ref is None:
                key = self._cache_key()
                cached = self.cache.load(key, self.prompt, len(self.prompt) + self.n_tokens) if key else None
                if cached is not None:
                    self.reference_cached = True
                    self._ref = cached
                    return cached
                eng = self.reference_engine
                req = RunRequest(self.prompt, self.n_tokens, {t.name: t.default for t in eng.toggles},
                                 forced=self.forced, on_position=on_position, cancel=cancel)
                try:
                    self._ref = eng.run(req)
                except EngineFailed as e:  # nothing compares against half a reference
                    raise SideFailed(Failure("reference", eng.name, str(e)), e.partial) from None
                if key:
                    self.cache.store(key, self._ref)
            return self._ref

    def _cache_key(self) -> str | None:
        """The reference's cache key; None when there is no cache or the reference is not the built-in cpu."""
        from ..engines.builtin import BuiltinEngine
        from .refcache import model_fingerprint, trace_key

        eng = self.reference_engine
        if self.cache is None or not (isinstance(eng, BuiltinEngine) and eng.name == "cpu"):
            return None
        if self.forced is not None:  # the key names no forced tokens: a replay is computed every time
            return None
        schedule = eng.schedule({})
        name = eng.name if schedule == DECODE else f"{eng.name} schedule {schedule}"  # the same bits, its own label
        return trace_key(model_fingerprint(self.model), self.prompt, self.n_tokens, self.kv, self.deep, name)

    def unsupported(self, settings: RunSettings) -> list[str]:
        """What the subject cannot honour in ``settings`` (each noted on the run, which goes on without it)."""
        eng, notes = self.subject_engine, []
        if settings.mode == "isolate" and not eng.caps.isolate:
            notes.append(f"{eng.name} cannot run isolated: chained instead")
        elif settings.mode == "isolate" and not self.can_feed():
            notes.append(f"isolation needs the reference's buffers in the subject's layout (a built-in"
                         f" reference); {self.reference_engine.name} gives none: chained instead")
        if settings.prefill == "reference":
            problem = eng.prefill_problem(self.reference_engine)
            if problem:
                notes.append(f"prefill ran in the subject ({problem})")
        if (settings.forcing == "teacher" or settings.mode == "isolate") and not eng.caps.forcing:
            notes.append(f"{eng.name} decodes its own tokens: no teacher forcing")
        return notes

    def run(self, settings: RunSettings, on_position: Callable[[Position, dict[str, Status]], None] | None = None,
            cancel: threading.Event | None = None, record: bool = True, stop_at_first_diff: bool = False,
            graft: frozenset[tuple[str, int | None]] | None = None) -> RunResult:
        """Run the subject with these settings against the cached reference.

        on_position(pos, statuses) is called as each subject position completes,
        with that position's per-key status. stop_at_first_diff ends the run at
        the first position holding a DIFF (bisection only needs where it is). graft: sites whose
        values the subject takes from the reference (the cause test, session/graft.py).
        A subject that fails midway (EngineFailed) still gives a result: the
        positions it finished, the rest missing, the failure in ``failed`` (and
        ``notes``). One that finished nothing, or a failing reference, raises
        SideFailed, which names the side.
        """
        ref = self.reference(cancel=cancel)
        eng = self.subject_engine
        P = len(self.prompt)
        notes = self.unsupported(settings)
        isolate = settings.mode == "isolate" and eng.caps.isolate and self.can_feed()
        forced = None
        if (settings.forcing == "teacher" or isolate) and eng.caps.forcing:  # isolation needs identical inputs
            forced = [p.token for p in ref.positions[P:]]
            if any(tok < 0 for tok in forced):  # a reference that reports no tokens (a hash-only process)
                forced = None
                notes.append(f"the reference ({self.reference_engine.name}) reports no tokens: the subject"
                             f" decodes its own (no teacher forcing)")
        prefill_from = ref if settings.prefill == "reference" and eng.prefill_problem(self.reference_engine) is None \
            else None
        schedule = eng.schedule(settings.values(eng.toggles))
        if prefill_from is not None and schedule.groups(P, self.n_tokens)[:1] != [(0, P)]:
            prefill_from = None  # the schedule is about how the prompt is run: the subject runs its own
            notes.append(f"schedule {schedule} runs the prompt in its own passes: the subject prefills itself")
        stop = threading.Event()

        def watch(pos: Position):
            ref_pos = ref.positions[pos.t] if pos.t < len(ref.positions) else None
            statuses = compare(ref_pos.hashes if ref_pos else {}, pos.hashes).status
            if on_position:
                on_position(pos, statuses)
            if stop_at_first_diff and any(s is Status.DIFF for s in statuses.values()):
                stop.set()

        req = RunRequest(self.prompt, self.n_tokens, settings.values(eng.toggles), forced=forced,
                         prefill_from=prefill_from, feed_from=ref if isolate else None, on_position=watch,
                         cancel=cancel, stop=stop.is_set, graft=Graft(ref, graft) if graft else None)
        failed = None
        try:
            sub = eng.run(req)
        except EngineFailed as e:
            failed = Failure("subject", eng.name, str(e))
            if e.partial is None:
                raise SideFailed(failed) from None
            sub = e.partial
            notes.append(failed.reason)
        # an early stop compares only the positions that ran
        n_ran = len(sub.positions) if stop.is_set() else None
        cmp = compare(ref.hashes(n_ran), sub.hashes())
        expected = self._expected_missing(cmp)
        result = RunResult(settings, ref, sub, cmp,
                           summarize(ref, sub, cmp, lambda k, st: st is Status.DIFF or (
                               st in (Status.MISSING_REF, Status.MISSING_SUB) and k not in expected)),
                           notes=tuple(notes), expected_missing=expected, failed=failed)
        if record:
            prev = self.last
            self.history.append(HistoryEntry(setting_changes(prev.settings if prev else None, settings), settings,
                                             prev.first_problem if prev else None, result.first_problem))
        self.last = result
        return result

    def can_feed(self) -> bool:
        """Whether the reference's buffers are in the subject's layout (a built-in reference of its KV
        format): what isolation feeds the subject."""
        from ..engines.builtin import BuiltinEngine

        ref = self.reference_engine
        return isinstance(ref, BuiltinEngine) and ref.kv == self.kv


    def missing_by_design(self, key: str, status: Status) -> bool:
        """A key missing on a side whose engine never makes it: not a failure (shown missing, not counted).
        The app's board asks this live, position by position; a finished run keeps the set."""
        return ((status is Status.MISSING_SUB and not self.subject_engine.produces(key))
                or (status is Status.MISSING_REF and not self.reference_engine.produces(key)))

    def _expected_missing(self, cmp: Comparison) -> frozenset[str]:
        return frozenset(k for k, st in cmp.status.items() if self.missing_by_design(k, st))


def first_diff_later(a: str | None, b: str | None) -> bool:
    """True when first DIFF b lies strictly later in dataflow order than a (None = all ok)."""
    if b is None:
        return a is not None
    return a is not None and order_key(b) > order_key(a)


