"""Bisect (b): switch the owners of the first DIFF to exact until all ok; each move shows as it happens.

Bisection's trial runs do not stream positions: the grid keeps the run before it until the last one,
while the toggles and history panels follow the moves. Stopped short (cancelled, failed), the toggles
go back to what the grid shows.
"""
from __future__ import annotations

import threading

from textual.binding import Binding

from ...engines.base import EngineFailed
from ...session.bisect import BisectResult, bisect
from ...session.session import HistoryEntry, RunResult, RunSettings, Session
from ...trace.run import Cancelled
from ..messages import ReferenceReady, RunCancelled, RunFailed, RunMessage, message
from ..widgets.history import HistoryPanel
from .base import Host, Part, Phase
from .runs import Runs


@message
class BisectMove(RunMessage):
    move: HistoryEntry


@message
class BisectDone(RunMessage):
    outcome: BisectResult
    result: RunResult


def bisection(session: Session, start: RunSettings, run_id: int, cancel: threading.Event,
              lock: threading.Lock, post) -> None:
    """Switch owners of the first DIFF to exact until all ok; each move is posted."""
    with lock:
        try:
            if cancel.is_set():
                raise Cancelled()
            ref = session.reference(cancel=cancel)
            post(ReferenceReady(run_id, ref))
            outcome = bisect(session, start, on_move=lambda mv: post(BisectMove(run_id, mv)), cancel=cancel)
            if outcome.failed is not None:  # a crashed trial is no verdict: shown as the run failing, by name
                why = outcome.failure_line(session.binary_toggles)
                post(RunFailed(run_id, EngineFailed(f"bisect stopped: {why}")))
                return
            post(BisectDone(run_id, outcome, session.last))
        except Cancelled:
            post(RunCancelled(run_id))
        except Exception as e:  # noqa: BLE001
            post(RunFailed(run_id, e))


class Bisect(Part):
    BINDINGS = (Binding("b", "bisect", "bisect", tooltip="bisect: switch owners of the first DIFF to exact until"
                        " all ok"),)
    PHASES = (Phase.BISECTING,)

    def __init__(self, screen: Host, runs: Runs) -> None:
        super().__init__(screen)
        self.runs = runs  # shows the final run
        self.before: RunSettings | None = None  # the settings the grid shows while bisection runs

    def superseded(self) -> None:
        self.before = None  # a bisection in flight is superseded; its messages turn stale

    def action_bisect(self) -> None:
        s = self.screen
        session = s.session
        if session is None:
            self.screen.no_model()
            return
        run_id, cancel = s.begin(Phase.BISECTING)
        start = self.before = s.settings
        s.title_grid("the run before bisection (bisecting…)")
        s.status.set_progress(0, None)
        s.status.set_text(f"bisecting from {session.label(start)}…", "busy")
        self.work(lambda: bisection(session, start, run_id, cancel, s.run_lock, s.post_message), group="run",
                  name="bisect", description="bisect the toggles")

    def on_bisect_move(self, m: BisectMove) -> None:
        s = self.screen
        if not s.current(m):
            return
        s.query_one(HistoryPanel).show(s.session.history)
        mv = m.move
        s.settings = mv.settings  # the toggles panel shows the ops switched so far
        s.show_toggles(mv.after)
        s.status.set_text(f"bisecting: {mv.change} moved the first DIFF {mv.before} -> {mv.after or 'all ok'}",
                          "busy")

    def on_bisect_done(self, m: BisectDone) -> None:
        s = self.screen
        if not s.current(m):
            return
        out, result = m.outcome, m.result
        self.before = None
        s.settings = result.settings
        self.runs.show(result)
        self.runs.finish(result)
        if out.all_ok:
            mins = ",".join(t for t in s.session.binary_toggles if t in (out.minimal or ())) or "(none)"
            text = f"all ok; minimal exact set {mins}"
            s.status.set_text(f"all ok · minimal exact set {mins} · {len(out.moves)} moves", "ok")
        else:
            text = "DIFFs remain with every op exact: not an op the toggles control"
        s.notify(text, title="bisect", severity="information" if out.all_ok else "warning", markup=False)

    def cancelled(self) -> str:
        self.failed()
        return "bisection cancelled · the grid shows the run before it · b restarts"

    def failed(self) -> None:
        """Stopped short: the toggles go back to what the grid shows."""
        if self.before is not None:
            self.screen.settings, self.before = self.before, None
            self.screen.show_toggles(self.screen.board.first_diff)
