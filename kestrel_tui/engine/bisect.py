"""Bisection over op toggles: follow the first DIFF to its owner until all keys agree.

From the starting toggle set, repeatedly look up the ops that own the first
DIFF's field (backends/toggles.OWNERS), switch on the first of them that moves
the first DIFF later, rerun, and record the move. When everything agrees, shrink
the set: drop each op whose removal keeps the run all ok (one pass of
delta debugging gives a 1-minimal set: removing any single op breaks it).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from ..backends.toggles import OWNERS, TOGGLES
from ..trace.keys import parse_key
from .session import HistoryEntry, RunResult, RunSettings, Session, first_diff_later


@dataclass
class BisectResult:
    moves: list[HistoryEntry] = field(default_factory=list)
    final: frozenset[str] = frozenset()
    minimal: frozenset[str] | None = None  # None: no toggle set reached all ok
    all_ok: bool = False


def _candidates(first_diff: str, exact: frozenset[str]) -> list[str]:
    owners = OWNERS.get(parse_key(first_diff).field, ())
    rest = [t for t in TOGGLES if t not in owners]  # unknown field: try everything, dataflow-agnostic
    return [t for t in (*owners, *rest) if t not in exact]


def bisect(session: Session, start: RunSettings = RunSettings(),
           on_move: Callable[[HistoryEntry], None] | None = None,
           cancel: threading.Event | None = None) -> BisectResult:
    result = BisectResult()

    def run(settings: RunSettings, full: bool = False) -> RunResult:
        return session.run(settings, cancel=cancel, record=False, stop_at_first_diff=not full)

    settings = start
    current = run(settings)
    while current.first_diff is not None:
        tried = None
        for op in _candidates(current.first_diff, settings.exact):
            trial_settings = replace(settings, exact=settings.exact | {op})
            trial = run(trial_settings)
            tried = tried or (op, trial_settings, trial)
            if first_diff_later(current.first_diff, trial.first_diff):
                tried = (op, trial_settings, trial)
                break
        if tried is None:  # every toggle is on and keys still differ: not an op we control
            break
        op, settings, trial = tried
        move = HistoryEntry((f"+{op}",), settings, current.first_diff, trial.first_diff)
        result.moves.append(move)
        session.history.append(move)
        if on_move:
            on_move(move)
        current = trial
    result.final = settings.exact
    if current.first_diff is None and run(settings, full=True).all_ok:
        result.all_ok = True
        minimal = set(settings.exact)
        for op in sorted(settings.exact, key=TOGGLES.index):
            if run(replace(settings, exact=frozenset(minimal - {op})), full=True).all_ok:
                minimal.discard(op)
        result.minimal = frozenset(minimal)
    session.last = run(replace(settings, exact=result.minimal or settings.exact), full=True)
    return result
