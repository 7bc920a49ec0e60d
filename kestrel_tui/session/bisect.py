"""Bisection over op toggles: follow the first DIFF to its owner until all keys agree.

From the starting toggle set, repeatedly look up the subject's binary toggles
that own the first DIFF's field (Toggle.owns), switch on the first of them that moves
the first DIFF later, rerun, and record the move. When everything agrees, shrink
the set: drop each op whose removal keeps the run all ok (one pass of
delta debugging gives a 1-minimal set: removing any single op breaks it).

With a tolerance (``tol``) the target is "no far key" instead of "all ok": the
walk follows the first far key, and a run is done when every key is ok or
close. Far keys need whole runs (a run cannot stop at its first far position
yet), so this mode is slower.

A run whose subject fails (a crash, a timeout, nothing written) ends the bisection: its
missing keys say nothing about the toggle tried, and a walk that skipped it would report
sets that never ran. The result names the trial that failed.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from ..engines.base import Engine
from ..trace.compare import Tolerance
from ..trace.keys import parse_key
from .session import Failure, HistoryEntry, RunResult, RunSettings, Session, SideFailed, first_diff_later


@dataclass
class BisectResult:
    moves: list[HistoryEntry] = field(default_factory=list)
    final: frozenset[str] | None = frozenset()  # the last set that ran; None: the start itself failed
    minimal: frozenset[str] | None = None  # None: no toggle set reached the target
    all_ok: bool = False  # the target reached: all ok, or with a tolerance no far key
    failed: Failure | None = None  # the subject failed on a trial: bisection stopped there
    failed_on: RunSettings | None = None  # that trial's settings
    failed_trial: str = ""  # what that trial was: "start", "+norm", "-rope (shrinking)", "final"

    def failure_line(self, order: tuple[str, ...] = ()) -> str:
        """The failed trial and the engine's reason, one line (empty when nothing failed)."""
        if self.failed is None:
            return ""
        label = self.failed_on.label(order) if self.failed_on is not None else "?"
        return f"the {self.failed.side} failed on the trial {self.failed_trial} ({label}): {self.failed.reason}"


class _TrialFailed(Exception):
    def __init__(self, failure: Failure, settings: RunSettings, trial: str):
        self.failure, self.settings, self.trial = failure, settings, trial


def _candidates(first_diff: str, exact: frozenset[str], engine: Engine) -> list[str]:
    try:
        owners = engine.owners(parse_key(first_diff).field)
    except ValueError:  # a foreign tag: no field to look up
        owners = ()
    rest = [t.name for t in engine.toggles if t.binary and t.name not in owners]  # try everything else too
    return [t for t in (*owners, *rest) if t not in exact]


def bisect(session: Session, start: RunSettings | None = None,
           on_move: Callable[[HistoryEntry], None] | None = None,
           cancel: threading.Event | None = None, tol: Tolerance | None = None) -> BisectResult:
    """tol None: walk to "all ok" (first DIFF); a Tolerance: walk to "no far key" (first far).
    A subject that fails on a trial stops the walk: ``failed``, ``failed_on`` and ``failed_trial`` say
    where; the reference failing raises SideFailed (nothing can be bisected without it)."""
    result = BisectResult()
    start = session.initial_settings() if start is None else start

    def run(settings: RunSettings, trial: str, full: bool = False) -> RunResult:
        try:
            res = session.run(settings, cancel=cancel, record=False, stop_at_first_diff=not full and tol is None)
        except SideFailed as e:
            if e.failure.side != "subject":
                raise
            raise _TrialFailed(e.failure, settings, trial) from None
        if res.failed:
            raise _TrialFailed(res.failed, settings, trial)
        return res

    def first(res: RunResult) -> str | None:
        return res.first_diff if tol is None else res.tolerance(tol).first_far

    def done(res: RunResult) -> bool:
        return res.all_ok if tol is None else res.tolerance(tol).all_close

    settings = start
    try:
        current = run(settings, "start")
        while first(current) is not None:
            tried = None
            for op in _candidates(first(current), settings.exact, session.subject_engine):
                trial_settings = replace(settings, exact=settings.exact | {op})
                trial = run(trial_settings, f"+{op}")
                tried = tried or (op, trial_settings, trial)
                if first_diff_later(first(current), first(trial)):
                    tried = (op, trial_settings, trial)
                    break
            if tried is None:  # every toggle is on and keys still differ: not an op we control
                break
            op, settings, trial = tried
            move = HistoryEntry((f"+{op}",), settings, first(current), first(trial))
            result.moves.append(move)
            session.history.append(move)
            if on_move:
                on_move(move)
            current = trial
        result.final = settings.exact
        if first(current) is None and done(run(settings, "final", full=True)):
            result.all_ok = True
            minimal = set(settings.exact)
            for op in sorted(settings.exact, key=session.binary_toggles.index):
                if done(run(replace(settings, exact=frozenset(minimal - {op})), f"-{op} (shrinking)", full=True)):
                    minimal.discard(op)
            result.minimal = frozenset(minimal)
        session.last = run(replace(settings, exact=result.minimal if result.minimal is not None else settings.exact),
                           "final", full=True)
    except _TrialFailed as e:
        result.final = None if e.trial == "start" else settings.exact
        result.all_ok, result.minimal = False, None
        result.failed, result.failed_on, result.failed_trial = e.failure, e.settings, e.trial
    return result
