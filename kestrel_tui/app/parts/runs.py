"""The decode: the reference (once per session), then the subject position by position, shown as it arrives.

Starting a run cancels the one in flight (its threading.Event is set, the engine stops at the next
position) and the run lock makes the new worker wait for the old one to leave, so two decodes never
compete for the CPU. A cancelled or failed run is reported by the part whose worker held the session
(Phase: the decode, bisect or graft). A finished run is shown here for bisect and graft too.
"""
from __future__ import annotations

import gc
import threading

from textual.binding import Binding

from ...session.session import RunResult, RunSettings, Session
from ...trace.keys import parse_key
from ...trace.ranks import world_size
from ...trace.run import Cancelled, Position, Trace
from ..messages import ReferenceReady, RunCancelled, RunFailed, RunMessage, message
from ..widgets.tokens import TokenStrip
from .base import Host, Part, Phase, one_line
from .tolerance import Tolerances


@message
class ReferenceProgress(RunMessage):
    done: int


@message
class PositionDone(RunMessage):
    pos: Position
    statuses: dict


@message
class RunDone(RunMessage):
    result: RunResult


def decode(session: Session, settings: RunSettings, run_id: int, cancel: threading.Event,
           lock: threading.Lock, post) -> None:
    """The reference (computed once per session), then the subject, position by position."""
    with lock:  # the previous (cancelled) run leaves within one position
        try:
            if cancel.is_set():
                raise Cancelled()
            ref = session.reference(on_position=lambda p: post(ReferenceProgress(run_id, p.t + 1)), cancel=cancel)
            post(ReferenceReady(run_id, ref))
            result = session.run(settings, cancel=cancel,
                                 on_position=lambda p, st: post(PositionDone(run_id, p, st)))
            result.events  # found here, off the UI thread: the status line and the panel name them
            post(RunDone(run_id, result))
        except Cancelled:
            post(RunCancelled(run_id))
        except Exception as e:  # noqa: BLE001 - shown in the app; the app stays usable
            post(RunFailed(run_id, e))


class Runs(Part):
    BINDINGS = (
        Binding("r", "rerun", "rerun", tooltip="rerun the subject with the current settings"),
        Binding("escape", "cancel", "cancel run", show=False, tooltip="cancel the run or bisection in flight"),
    )
    PHASES = (Phase.REFERENCE, Phase.RUNNING)

    def __init__(self, screen: Host, tolerances: Tolerances) -> None:
        super().__init__(screen)
        self.tolerances = tolerances  # a finished run is judged, and its status line carries the verdicts
        self.ref: Trace | None = None  # the session's reference, once computed
        self.sub: dict[int, Position] = {}  # the subject's positions of the run shown

    def forget(self) -> None:
        """A new session: its reference is still to come."""
        self.ref, self.sub = None, {}

    def action_rerun(self) -> None:
        self.start()

    def action_cancel(self) -> None:
        if self.screen.phase.running:
            self.screen.cancel_all()
            self.screen.status.set_text("cancelling…", "busy")

    def start(self) -> None:
        s = self.screen
        session = s.session
        if session is None:
            self.screen.no_model()
            return
        run_id, cancel = s.begin(Phase.REFERENCE if self.ref is None else Phase.RUNNING)
        settings = s.settings
        s.board.reset()
        s.board.raw_sub = self.raw_sub
        self.sub = {}
        s.refresh_all()
        s.status.set_progress(0, s.board.n_positions)
        what = "computing the reference, then running" if self.ref is None else "running"
        s.status.set_text(f"{what} {session.subject} ({session.label(settings)})", "busy")
        self.work(lambda: decode(session, settings, run_id, cancel, s.run_lock, s.post_message), group="run",
                  name="run", description="decode reference and subject")

    def raw_sub(self, key: str):
        pos = self.sub.get(parse_key(key).t)
        return None if pos is None or pos.raw is None else pos.raw.get(key)

    # ---- the worker's messages (bisect's and graft's workers post the shared ones too)

    def on_reference_progress(self, m: ReferenceProgress) -> None:
        s = self.screen
        if s.current(m):
            s.status.set_progress(m.done, s.board.n_positions)
            s.status.set_text(f"computing the reference: {m.done}/{s.board.n_positions} positions", "busy")

    def on_reference_ready(self, m: ReferenceReady) -> None:
        s = self.screen
        if not s.current(m) or self.ref is m.ref:
            return
        self.ref = m.ref
        s.board.ref_hashes = m.ref.hashes()
        s.board.raw_ref = m.ref.raw
        session = s.session
        if session.reference_cached:
            s.show_header()  # "cpu (cached) vs ...": no reference was computed
        for note in session.notes:
            s.notify(note, title="reference", severity="warning", markup=False)
        for note in session.cache.notes if session.cache else ():
            s.notify(note, title="reference cache", severity="warning", markup=False)
        if session.cache:
            session.cache.notes.clear()
        if s.phase is Phase.REFERENCE:
            s.phase = Phase.RUNNING
            s.status.set_progress(0, s.board.n_positions)
            s.status.set_text(f"running {session.subject} ({session.label(s.settings)})", "busy")
        s.refresh_detail()

    def on_position_done(self, m: PositionDone) -> None:
        s = self.screen
        if not s.current(m):
            return
        pos, board = m.pos, s.board
        self.sub[pos.t] = pos
        ref_top = self.ref.positions[pos.t].top1 if self.ref is not None else None
        had_first = board.first_diff
        board.add_position(pos.t, m.statuses, pos.hashes, (ref_top, pos.top1) if ref_top is not None else None)
        if s.phase is Phase.RUNNING:
            s.status.set_progress(pos.t + 1, board.n_positions)
        if s.follow and board.first_diff and board.first_diff != had_first:
            s.goto(board.first_diff, keep_follow=True)
        else:
            s.query_one(TokenStrip).refresh()
            if board.slot(pos.t) == s.cursor.t:
                s.grid.refresh()
                s.refresh_detail()

    def on_run_done(self, m: RunDone) -> None:
        if self.screen.current(m):
            self.finish(m.result)

    def on_run_cancelled(self, m: RunCancelled) -> None:
        s = self.screen
        if not s.current(m):
            return
        s.title_grid()
        s.status.set_text((s.holder or self).cancelled(), "")
        s.phase = Phase.CANCELLED
        s.status.set_progress(None, None)
        s.refresh_all()

    def on_run_failed(self, m: RunFailed) -> None:
        s = self.screen
        if not s.current(m):
            return
        s.title_grid()
        (s.holder or self).failed()
        s.phase = Phase.ERROR
        s.status.set_progress(None, None)
        text = one_line(m.error)
        s.status.set_text(f"run failed: {text}", "error")
        s.notify(text, title="run failed", severity="error", timeout=10, markup=False)
        s.refresh_all()

    def cancelled(self) -> str:
        done = sum(self.screen.board.arrived) if self.screen.board else 0
        return f"cancelled after {done} positions · r reruns"

    # ---- a finished run, also bisect's and graft's

    def show(self, result: RunResult) -> None:
        """Show a finished run that did not stream positions (bisection's final run, a graft's)."""
        board = self.screen.board
        board.reset()
        board.raw_sub = self.raw_sub
        self.sub = {p.t: p for p in result.sub.positions}
        status = result.comparison.status
        for p_ref, p_sub in zip(result.ref.positions, result.sub.positions):
            board.add_position(p_sub.t, {k: status[k] for k in p_ref.hashes if k in status}, p_sub.hashes,
                               (p_ref.top1, p_sub.top1))

    def finish(self, result: RunResult) -> None:
        s = self.screen
        s.title_grid()
        if result.notes and (s.result is None or s.result.notes != result.notes):
            s.notify(" · ".join(result.notes), title=s.session.subject, severity="warning", timeout=10, markup=False)
        s.result = result
        board = s.board
        board.events = result.events
        board.traces = (result.ref, result.sub)
        if world_size(result.sub) or world_size(result.ref):
            s.show_header()  # the world size the run had (a toggle may change it)
        s.phase = Phase.IDLE
        status = result.comparison.status
        for p_ref in result.ref.positions:  # positions a failed subject never reached read missing, not pending
            if p_ref.t not in self.sub:
                board.add_position(p_ref.t, {k: status[k] for k in p_ref.hashes if k in status}, {}, None)
        quiet_gc(True)
        s.status.set_progress(None, None)
        self.tolerances.show_status()
        if s.follow and board.first_diff:
            s.goto(board.first_diff, keep_follow=True)
        s.refresh_all()
        if s.tolerance is not None:
            self.tolerances.judge()


def quiet_gc(on: bool) -> None:
    """Keep the cyclic GC off the finished run's data while the user navigates.

    A finished run holds ~1M references (hash dicts, raw buffers); a full
    collection walks all of them and stalls a frame by ~80 ms. Freezing moves
    what exists into the permanent generation once a run is done; the next
    run unfreezes first, so cycles that became garbage are collected while
    the grid is filling anyway.
    """
    if on:
        gc.freeze()
    else:
        gc.unfreeze()
