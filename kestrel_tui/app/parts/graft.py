"""Graft (g), the cause test: graft the reference's values at the first far key (the first DIFF without a
tolerance), rerun, and name every source in order; the grid then shows the run with them grafted."""
from __future__ import annotations

import threading

from textual.binding import Binding

from ...session.graft import GraftResult, Source, graft
from ...session.session import RunSettings, Session
from ...trace.compare import Tolerance
from ...trace.run import Cancelled
from ..messages import RunCancelled, RunFailed, RunMessage, message
from .base import Host, Part, Phase
from .runs import Runs


@message
class GraftSource(RunMessage):
    source: Source


@message
class GraftDone(RunMessage):
    outcome: GraftResult


def grafting(session: Session, settings: RunSettings, tol: Tolerance | None, run_id: int, cancel: threading.Event,
             lock: threading.Lock, post) -> None:
    """The cause test from the first far key (the first DIFF without a tolerance); each source is posted."""
    with lock:
        try:
            if cancel.is_set():
                raise Cancelled()
            outcome = graft(session, settings, tol=tol, on_source=lambda src: post(GraftSource(run_id, src)),
                            cancel=cancel)
            post(GraftDone(run_id, outcome))
        except Cancelled:
            post(RunCancelled(run_id))
        except Exception as e:  # noqa: BLE001 - a subject that cannot graft, a failed trial: shown in the app
            post(RunFailed(run_id, e))


class Graft(Part):
    BINDINGS = (Binding("g", "graft", "graft", show=False, tooltip="the cause test: graft the reference's values"
                        " at the first far key (first DIFF without a tolerance), rerun, and name every source in"
                        " order"),)
    PHASES = (Phase.GRAFTING,)

    def __init__(self, screen: Host, runs: Runs) -> None:
        super().__init__(screen)
        self.runs = runs  # shows the grafted run

    def action_graft(self) -> None:
        s = self.screen
        session = s.session
        if session is None:
            self.screen.no_model()
            return
        if not session.subject_engine.caps.graft:
            s.notify(f"{session.subject_engine.name} cannot take the reference's values at a key: graft on sim"
                     f" or hf", title="graft", severity="warning", markup=False)
            return
        run_id, cancel = s.begin(Phase.GRAFTING)
        settings, tol = s.settings, s.tolerance
        what = f"far keys at {tol.spec()}" if tol is not None else "DIFF keys"
        s.title_grid("the run before grafting (grafting…)")
        s.status.set_text(f"grafting: following the {what}…", "busy")
        self.work(lambda: grafting(session, settings, tol, run_id, cancel, s.run_lock, s.post_message),
                  group="run", name="graft", description="graft the sources")

    def on_graft_source(self, m: GraftSource) -> None:
        if not self.screen.current(m):
            return
        src = m.source
        after = f"another source at {src.next_key}" if src.next_key else "every key after it agrees"
        self.screen.status.set_text(f"grafting: {src.label} (first at {src.key}) · {after}", "busy")

    def on_graft_done(self, m: GraftDone) -> None:
        """The grid shows the run with every source grafted; the status and a note name the sources."""
        s = self.screen
        if not s.current(m):
            return
        out = m.outcome
        if out.last is not None:
            self.runs.show(out.last)
            self.runs.finish(out.last)
        done = out.remaining is None
        s.status.set_text(f"graft: {out.line()}" + (" · the grid shows the run with them grafted"
                                                    if out.sources else ""), "ok" if done else "diff")
        s.notify(out.line(), title="graft", severity="information" if done else "warning", markup=False)

    def cancelled(self) -> str:
        return "graft cancelled · the grid shows the run before it · g restarts"
