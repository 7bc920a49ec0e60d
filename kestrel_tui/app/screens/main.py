"""The main screen: token strip, hash grid, toggles, detail, history, progress.

This is the app's controller (cursor moves: navigation.py). Numerics run only
in thread workers (app/workers.py: load, run, bisect, export); they post
messages tagged with a run id, and the handlers here apply them to the Board
on the UI thread. Starting a run cancels the one in flight (its threading.Event is set, the engine stops at
the next position) and a lock makes the new worker wait for the old one to
leave, so two decodes never compete for the CPU and stale messages are
dropped by id.
"""
from __future__ import annotations

import gc
import threading
from dataclasses import replace
from functools import partial
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label

from ...trace.run import Position, Trace
from ...session.session import RunResult, RunSettings, Session, ToleranceSummary
from ...trace.compare import Status, Tolerance, compare
from ...trace.keys import layer_fields, parse_key
from ...trace.ranks import compare_shares, world_size
from .. import messages as msg
from .. import workers
from ..export import final_name, new_export_dir
from ..source import DiffSource, LiveSource, Loaded, Loader, PromptError, default_loader
from ..state import Board, Cursor, axes_of
from ..widgets.detail import DetailPanel, key_info
from ..widgets.grid import HashGrid
from ..widgets.header import InfoHeader
from ..widgets.history import HistoryPanel
from ..widgets.status import StatusBar
from ..widgets.tokens import TokenStrip
from ..widgets.toggles import SWITCHES, TOGGLE_KEYS, TogglePanel
from .navigation import GridNavigation

MIN_SIZE = (80, 24)  # the smallest terminal the layout supports (app.tcss's narrow form)
DIFFS = Binding.Group("DIFF")
TOKEN = Binding.Group("token")

# The tolerance key's cycle: off (plain ok/DIFF) first, so a fresh app looks as it always did.
TOLERANCES: tuple[Tolerance | None, ...] = (None, Tolerance(), Tolerance(nmse=1e-4), Tolerance(nmse=None, ulp=4))
HASH_ONLY = "no raw values: hash-only dumps, so DIFF keys stay DIFF"

# Actions that need a model; diff mode hides them (check_action).
RUN_ACTIONS = {"toggle", "all_exact", "all_fast", "switch", "rerun", "bisect", "iso", "cancel", "first_far"}


def _toggle_binding(i: int) -> Binding:
    # the footer shows one "1-9 toggle" entry for all nine keys; keys past the subject's toggles are off
    return Binding(TOGGLE_KEYS[i], f"toggle({i})", "toggle", show=i == 0,
                   key_display=f"1-{len(TOGGLE_KEYS)}" if i == 0 else TOGGLE_KEYS[i],
                   tooltip=f"switch the subject's toggle {i + 1} (fast/exact, or its next value); reruns at once")


class MainScreen(GridNavigation, Screen):
    # Below 110 columns the side panels move under the grid (app.tcss): 80x24 stays usable.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]

    BINDINGS = [
        Binding("up,k", "move(-1, 0)", "up", show=False, tooltip="previous row (layer)"),
        Binding("down,j", "move(1, 0)", "down", show=False, tooltip="next row (layer)"),
        Binding("left,h", "move(0, -1)", "left", show=False, tooltip="previous field"),
        Binding("right,l", "move(0, 1)", "right", show=False, tooltip="next field"),
        Binding("pageup", "move(-10, 0)", "10 rows up", show=False),
        Binding("pagedown", "move(10, 0)", "10 rows down", show=False),
        *[_toggle_binding(i) for i in range(len(TOGGLE_KEYS))],
        Binding("f", "first_diff", "first", tooltip="jump to the first DIFF and follow it across runs"),
        Binding("F", "first_far", "first far", show=False,
                tooltip="jump to the first far key (a tolerance must be on: T)"),
        Binding("n", "next_diff(True)", "next", group=DIFFS, tooltip="jump to the next DIFF (dataflow order)"),
        Binding("N", "next_diff(False)", "prev", group=DIFFS, tooltip="jump to the previous DIFF (dataflow order)"),
        Binding("left_square_bracket", "token(-1)", "prev", group=TOKEN, key_display="[", show=False,
                tooltip="previous token position"),
        Binding("right_square_bracket", "token(1)", "next", group=TOKEN, key_display="]", show=False,
                tooltip="next token position"),
        Binding("r", "rerun", "rerun", tooltip="rerun the subject with the current settings"),
        Binding("b", "bisect", "bisect", tooltip="bisect: switch owners of the first DIFF to exact until all ok"),
        Binding("i", "iso", "iso", tooltip="iso view: batch-verify (M columns) vs M=1 decode, logits byte by byte"),
        Binding("T", "tolerance", "tolerance", show=False,
                tooltip="cycle the tolerance: off, nmse<=1e-7, nmse<=1e-4, max ULP<=4; DIFF keys read close/far"),
        Binding("x", "export", "export", tooltip="export a snapshot: both dumps, report.json, SVG, in a new folder"),
        Binding("a", "all_exact", "all exact", show=False, tooltip="switch every op to exact"),
        Binding("R", "rank", "rank", show=False, tooltip="rank filter: a sharded key's cell shows one rank's"
                " share (all ranks → rank 0 → rank 1 …); the detail panel lists every rank's"),
        Binding("s", "sweep", "sweep", show=False, tooltip="sweep one setting over its values (a toggle, M, the"
                " prompt length, hf batch composition): where the answer changes, with a chart"),
        Binding("w", "repro", "repro", show=False, tooltip="write a repro bundle of the key under the cursor"
                " (a DIFF; else the first far key): inputs, outputs, case.json, a numpy-only replay.py"),
        Binding("g", "graft", "graft", show=False, tooltip="the cause test: graft the reference's values at the"
                " first far key (first DIFF without a tolerance), rerun, and name every source in order"),
        Binding("0", "all_fast", "all fast", show=False, tooltip="switch every op to fast"),
        *[Binding(key, f"switch('{name}')", f"{name}", show=False, tooltip=f"switch {name}: {' / '.join(vals)}")
          for key, name, vals in SWITCHES],
        Binding("escape", "cancel", "cancel run", show=False, tooltip="cancel the run or bisection in flight"),
    ]

    def __init__(self, source: LiveSource | DiffSource, export_dir: Path) -> None:
        super().__init__()
        self.source = source
        self.export_dir = export_dir
        self.diff_mode = isinstance(source, DiffSource)
        self.session: Session | None = None
        self.info: Loaded | None = None
        self.board: Board | None = None
        self.settings = RunSettings()
        self.cursor = Cursor(0, 1, 0)
        self.follow = True  # the cursor tracks the first DIFF until the user moves it
        self.phase = "loading"  # loading | reference | running | bisecting | idle | cancelled | error
        self.result: RunResult | None = None  # the last finished run
        self.last_export: Path | None = None
        self._run_id = 0
        self._cancel: threading.Event | None = None
        self._run_lock = threading.Lock()
        self._ref: Trace | None = None
        self._sub: dict[int, Position] = {}
        self._diff_cmp = None
        self._detail_key: tuple | None = None
        self._bisect_start: RunSettings | None = None
        self._exporting = False
        self.tolerances = TOLERANCES  # the T key's cycle; a profile's tolerance joins it and starts on
        self.tol_index = 0  # into self.tolerances
        self._judging = 0  # the run id a tolerance worker is judging for; 0: none
        self._said_hash_only = False

    # ---- layout ----------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield InfoHeader(id="header")
        yield TokenStrip(id="tokens")
        with Horizontal(id="body"):
            with Vertical(id="grid-box"):
                yield HashGrid(id="grid")
            with Vertical(id="side"):
                yield TogglePanel(id="toggles")
                yield DetailPanel(id="detail")
                yield HistoryPanel(id="history")
        yield StatusBar(id="status")
        yield Footer()
        yield Label(f"enlarge the terminal to at least {MIN_SIZE[0]}×{MIN_SIZE[1]}", id="too-small", markup=False)

    def on_unmount(self) -> None:
        self.cancel_all()
        quiet_gc(False)

    def on_resize(self) -> None:
        # Below 80x24 the panels cannot fit and the footer runs its words together: app.tcss then
        # shows one line asking for more room instead (keys keep working).
        w, h = MIN_SIZE
        self.set_class(self.size.width < w or self.size.height < h, "-too-small")
        # at 80 columns every footer key must still fit: drop the padding, and the palette hint
        # (ctrl+p still works and the help screen lists it)
        footer = self.query_one(Footer)
        footer.compact = self.size.width < 110
        footer.show_command_palette = self.size.width >= 110

    def on_mount(self) -> None:
        for wid, title in (("grid-box", "hash grid"), ("toggles", "toggles"), ("detail", "detail"),
                           ("history", "history")):
            self.query_one(f"#{wid}").border_title = title
        self.status.set_progress(None, None)
        if self.diff_mode:
            self._open_diff(self.source)
        else:
            self._load(self.source.loader)

    @property
    def grid(self) -> HashGrid:
        return self.query_one(HashGrid)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def busy(self) -> bool:
        """A worker is loading, running or bisecting (tests and the benchmark wait on this)."""
        return self.phase in ("loading", "reference", "running", "bisecting", "grafting") or self._exporting \
            or bool(self._judging)

    # ---- diff mode -------------------------------------------------------

    def _open_diff(self, src: DiffSource) -> None:
        cmp = compare(src.a, src.b)
        self._diff_cmp = cmp
        positions, layers, fields = axes_of(cmp.status)
        board = Board(positions, layers, fields or layer_fields(), sides=("A", "B"), live=False)
        board.load(cmp, src.a, src.b)
        self.board = board
        self.add_class("-diff")  # app.tcss hides the toggles and history: nothing runs here
        self.query_one(InfoHeader).show([("", "diff mode (no model)"), ("A", src.path_a), ("B", src.path_b)])
        self.query_one(TogglePanel).show(self.settings, enabled=False)
        self.grid.set_board(board)
        self.phase = "idle"
        if cmp.identical:
            self.status.set_text(f"identical: {len(cmp.status)} keys", "ok")
        else:
            names = {Status.DIFF: "DIFF", Status.MISSING_SUB: "only in A", Status.MISSING_REF: "only in B"}
            parts = [f"{n} {names[s]}" for s, n in cmp.counts.items() if n and s in names]
            self.status.set_text(f"first DIFF {cmp.first_diff or '—'} · " + " · ".join(parts)
                                 + (f" · {len(board.outside)} keys outside the grid" if board.outside else ""),
                                 "diff")
        self._set_cursor(Cursor(0, 1, 0))  # also when the first mismatch is a foreign tag, with no cell to go to
        first = board.first_diff or board.first_mismatch
        if first:
            self._goto(first)
        self.query_one(HistoryPanel).show([])
        quiet_gc(True)

    # ---- loading ---------------------------------------------------------

    def _load(self, loader: Loader) -> None:
        self._run_id += 1  # whatever the previous session still posts is stale from here on
        self.session = None  # keys that need a model wait for the new one
        self.phase = "loading"
        self.status.set_text("loading the model…", "busy")
        self.status.set_progress(0, None)

        self.run_worker(partial(workers.load, loader, self.post_message), thread=True, group="load", name="load",
                        description="load the model",
                        exclusive=True, exit_on_error=False)

    def on_load_progress(self, m: msg.LoadProgress) -> None:
        if self.phase == "loading":
            self.status.set_text(f"loading the model… {m.step.line()}", "busy")
            self.status.set_progress(m.step.bytes_read, m.step.bytes_total)

    def on_session_loaded(self, m: msg.SessionLoaded) -> None:
        info = m.info
        s = info.session
        self.session, self.info = s, info
        self.result, self._ref, self._sub = None, None, {}
        P = len(s.prompt)
        self.settings = s.initial_settings()  # a new session has its own toggles
        self._use_tolerance(info.tolerance)
        self.board = Board(range(P + s.n_tokens), range(s.model.cfg.n_layers), layer_fields(s.deep), prompt_len=P)
        toggles = s.toggles
        self.query_one(DetailPanel).owner_label = lambda f: " ".join(
            f"{o}[{next(i for i, t in enumerate(toggles) if t.name == o) + 1}]"
            for o in s.subject_engine.owners(f))
        self.board.raw_sub = self._raw_sub
        self.board.q8_inputs = s.model.fmt == "q4_0"
        self.board.expected_missing = s.missing_by_design
        self.grid.set_board(self.board)
        self.cursor = Cursor(min(P, self.board.n_positions - 1), 1, 0)
        self._header()
        if info.note:
            self.notify(info.note, title="subject", severity="warning", timeout=8, markup=False)
        self.start_run()

    def on_load_failed(self, m: msg.LoadFailed) -> None:
        self.phase = "error"
        self.status.set_progress(None, None)
        text = _one_line(m.error)
        if isinstance(m.error, PromptError):
            what, header = "bad prompt or token count", "prompt rejected: nothing to run"
            hint = "The model loaded, but the prompt or --tokens does not fit it (see the status line)."
        else:
            what, header, hint = "cannot load the model", "no model loaded", "No model loaded."
        self.query_one(InfoHeader).show([("", header)])
        self.status.set_text(f"{what}: {text}", "error")
        self.query_one(DetailPanel).show(None, f"{hint} Quit (q), or open the embedded default model "
                                               "from the command palette (ctrl+p).")
        self.query_one(TogglePanel).show(self.settings, enabled=False)
        self.notify(text, title=what, severity="error", timeout=10, markup=False)

    def _header(self) -> None:
        info, s = self.info, self.session
        # most telling first: at 80 columns the tail is cut
        ref = f"{s.reference_engine.name} (cached)" if s.reference_cached else s.reference_engine.name
        parts = [("", f"{ref} vs {s.subject}"), ("model", info.model_label), ("device", info.device),
                 ("positions", f"{len(s.prompt)} prompt + {s.n_tokens}")]
        if self.result is not None:  # a parallel run: how many ranks each side had
            sizes = [(side, world_size(t)) for side, t in (("ref", self.result.ref), ("sub", self.result.sub))]
            ranks = " · ".join(f"{side} {n}" for side, n in sizes if n)
            if ranks:
                parts.insert(1, ("ranks", ranks))
        self.query_one(InfoHeader).show(parts, info.note)

    def _raw_sub(self, key: str):
        pos = self._sub.get(parse_key(key).t)
        return None if pos is None or pos.raw is None else pos.raw.get(key)

    # ---- runs ------------------------------------------------------------

    def _begin(self, phase: str) -> tuple[int, threading.Event]:
        """Cancel whatever is in flight and open a new run id."""
        quiet_gc(False)
        self.cancel_all()
        self._bisect_start = None  # a bisection in flight is superseded; its messages turn stale
        self._judging = 0  # so is a tolerance judgement (the board's reset drops its summary)
        self._run_id += 1
        self._cancel = threading.Event()
        self.phase = phase
        return self._run_id, self._cancel

    def cancel_all(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def start_run(self) -> None:
        session = self.session
        if session is None:
            self._no_model()
            return
        run_id, cancel = self._begin("reference" if self._ref is None else "running")
        settings = self.settings
        self.board.reset()
        self.board.raw_sub = self._raw_sub
        self._sub = {}
        self._refresh_all()
        self.status.set_progress(0, self.board.n_positions)
        what = "computing the reference, then running" if self._ref is None else "running"
        self.status.set_text(f"{what} {session.subject} ({session.label(settings)})", "busy")
        self.run_worker(partial(workers.decode, session, settings, run_id, cancel, self._run_lock, self.post_message),
                        thread=True, group="run", name="run", description="decode reference and subject",
                        exit_on_error=False)

    def _current(self, m: msg.RunMessage) -> bool:
        return m.run_id == self._run_id

    def on_reference_progress(self, m: msg.ReferenceProgress) -> None:
        if self._current(m):
            self.status.set_progress(m.done, self.board.n_positions)
            self.status.set_text(f"computing the reference: {m.done}/{self.board.n_positions} positions", "busy")

    def on_reference_ready(self, m: msg.ReferenceReady) -> None:
        if not self._current(m) or self._ref is m.ref:
            return
        self._ref = m.ref
        self.board.ref_hashes = m.ref.hashes()
        self.board.raw_ref = m.ref.raw
        if self.session.reference_cached:
            self._header()  # "cpu (cached) vs ...": no reference was computed
        for note in self.session.notes:
            self.notify(note, title="reference", severity="warning", markup=False)
        for note in self.session.cache.notes if self.session.cache else ():
            self.notify(note, title="reference cache", severity="warning", markup=False)
        if self.session.cache:
            self.session.cache.notes.clear()
        if self.phase == "reference":
            self.phase = "running"
            self.status.set_progress(0, self.board.n_positions)
            self.status.set_text(f"running {self.session.subject} ({self.session.label(self.settings)})", "busy")
        self._refresh_detail()

    def on_position_done(self, m: msg.PositionDone) -> None:
        if not self._current(m):
            return
        pos, board = m.pos, self.board
        self._sub[pos.t] = pos
        ref_top = self._ref.positions[pos.t].top1 if self._ref is not None else None
        had_first = board.first_diff
        board.add_position(pos.t, m.statuses, pos.hashes, (ref_top, pos.top1) if ref_top is not None else None)
        if self.phase == "running":
            self.status.set_progress(pos.t + 1, board.n_positions)
        if self.follow and board.first_diff and board.first_diff != had_first:
            self._goto(board.first_diff, keep_follow=True)
        else:
            self.query_one(TokenStrip).refresh()
            if board.slot(pos.t) == self.cursor.t:
                self.grid.refresh()
                self._refresh_detail()

    def on_run_done(self, m: msg.RunDone) -> None:
        if not self._current(m):
            return
        self._finish(m.result)

    def _finish(self, result: RunResult) -> None:
        self.query_one("#grid-box").border_title = "hash grid"
        if result.notes and (self.result is None or self.result.notes != result.notes):
            self.notify(" · ".join(result.notes), title=self.session.subject, severity="warning", timeout=10,
                        markup=False)
        self.result = result
        self.board.events = result.events
        self.board.traces = (result.ref, result.sub)
        if world_size(result.sub) or world_size(result.ref):
            self._header()  # the world size the run had (a toggle may change it)
        self.phase = "idle"
        status = result.comparison.status
        for p_ref in result.ref.positions:  # positions a failed subject never reached read missing, not pending
            if p_ref.t not in self._sub:
                self.board.add_position(p_ref.t, {k: status[k] for k in p_ref.hashes if k in status}, {}, None)
        quiet_gc(True)
        self.status.set_progress(None, None)
        self._result_status()
        if self.follow and self.board.first_diff:
            self._goto(self.board.first_diff, keep_follow=True)
        self._refresh_all()
        if self.tolerance is not None:
            self._judge()

    def _result_status(self) -> None:
        """The status line of the finished run, with the tolerance's verdicts once they are in."""
        result = self.result
        cmp = result.comparison
        flips = sum(1 for s in result.tokens if s.flip)
        if result.all_ok:
            shared = len(cmp.status) - len(result.expected_missing)
            self.status.set_text(f"all ok · {shared} keys identical · {self.session.label(result.settings)}"
                                 + (f" · {len(result.expected_missing)} made by one side only"
                                    if result.expected_missing else ""), "ok")
            return
        # most telling first: at 80 columns the tail is cut
        n = cmp.counts.get(Status.DIFF, 0)
        counts = f"{n} DIFF keys"
        summary: ToleranceSummary | None = self.board.tolerance if self.board is not None else None
        tol = self.tolerance
        if summary is not None and summary.n_close + summary.n_far == 0:
            counts = (f"no verdict at {tol.spec()}: the {summary.n_unjudged} DIFF keys are hash-only"
                      f" (no raw values to judge)")
        elif summary is not None:
            far = summary.first_far or "— (every judged DIFF key close)"
            cause = result.cause_of(summary.first_far) if summary.first_far else None
            if cause is not None:
                far += f" (after {cause.short})"
            counts = f"first far {far} at {tol.spec()} · {summary.n_close} close · {summary.n_far} far"
            if summary.n_unjudged:
                counts += f" · {summary.n_unjudged} hash-only"
        elif tol is not None:
            counts = f"judging at {tol.spec()}… · {counts}"
        missing = f" · {result.n_missing} missing" if result.n_missing else ""
        self.status.set_text(f"first DIFF {cmp.first_diff or '—'} · {counts}{missing} · {flips} top-1 flips"
                             f" · {self.session.label(result.settings)}", "diff")

    # ---- tolerance -------------------------------------------------------

    @property
    def tolerance(self) -> Tolerance | None:
        return self.tolerances[self.tol_index]

    def _use_tolerance(self, tol: Tolerance | None) -> None:
        """A profile's tolerance: first in the cycle after off, and the one a new session starts with."""
        if tol is None:
            self.tolerances, self.tol_index = TOLERANCES, 0
            return
        self.tolerances = (None, tol, *(t for t in TOLERANCES[1:] if t != tol))
        self.tol_index = 1

    def action_tolerance(self) -> None:
        if self.diff_mode:
            if not self._said_hash_only:  # said once: every further press would say the same
                self._said_hash_only = True
                self.notify(HASH_ONLY, title="tolerance", severity="warning", markup=False)
            return
        self.tol_index = (self.tol_index + 1) % len(self.tolerances)
        self._judging = 0  # a judgement in flight is for the previous tolerance: its message is dropped
        if self.board is not None:
            self.board.set_tolerance(None)
        if self.result is not None and self.phase == "idle":
            self._result_status()
            if self.tolerance is not None:
                self._judge()
        elif self.tolerance is not None and self.phase != "error":
            self.status.set_text(f"tolerance {self.tolerance.spec()}: DIFF keys are judged when the run finishes",
                                 "busy" if self.busy else "")
        self._refresh_all()

    def action_first_far(self) -> None:
        summary = self.board.tolerance if self.board is not None else None
        if self.tolerance is None:
            self.notify("no tolerance chosen: T cycles through them, then F jumps to the first far key",
                        markup=False)
        elif summary is None:
            self.notify("the DIFF keys are not judged yet (the run must finish)", markup=False)
        elif summary.first_far is None:
            self.notify(f"no far key at {self.tolerance.spec()}", markup=False)
        else:
            self._goto(summary.first_far)
            self.follow = False  # f goes back to following the first DIFF

    def _judge(self) -> None:
        """Judge the finished run's DIFF keys off the UI thread (~0.4 s on the default model)."""
        result, tol = self.result, self.tolerance
        if result is None or tol is None or result.all_ok:
            return
        self._judging = self._run_id
        self._result_status()
        # described: Textual describes a worker by repr(work) otherwise, and a RunResult's repr
        # prints every raw buffer (27 s on the default model)
        self.run_worker(partial(workers.judge, result, tol, self._run_id, self.post_message), thread=True,
                        group="judge", name="judge", description="judge DIFF keys against the tolerance",
                        exit_on_error=False)

    def on_tolerance_ready(self, m: msg.ToleranceReady) -> None:
        if not self._current(m) or m.tol != self.tolerance or self.result is None:
            return  # a newer run or another tolerance: a newer judgement (if any) is on its way
        self._judging = 0
        if m.error is not None:
            text = _one_line(m.error)
            self.status.set_text(f"tolerance failed: {text}", "error")
            self.notify(text, title="tolerance", severity="error", markup=False)
            return
        self.board.set_tolerance(m.summary)
        self._result_status()
        self._refresh_all()

    def on_run_cancelled(self, m: msg.RunCancelled) -> None:
        if not self._current(m):
            return
        self.query_one("#grid-box").border_title = "hash grid"
        if self.phase == "bisecting":
            self._end_bisect()
            self.status.set_text("bisection cancelled · the grid shows the run before it · b restarts", "")
        elif self.phase == "grafting":
            self.status.set_text("graft cancelled · the grid shows the run before it · g restarts", "")
        else:
            done = sum(self.board.arrived) if self.board else 0
            self.status.set_text(f"cancelled after {done} positions · r reruns", "")
        self.phase = "cancelled"
        self.status.set_progress(None, None)
        self._refresh_all()

    def on_run_failed(self, m: msg.RunFailed) -> None:
        if not self._current(m):
            return
        self.query_one("#grid-box").border_title = "hash grid"
        if self.phase == "bisecting":
            self._end_bisect()
        self.phase = "error"
        self.status.set_progress(None, None)
        text = _one_line(m.error)
        self.status.set_text(f"run failed: {text}", "error")
        self.notify(text, title="run failed", severity="error", timeout=10, markup=False)
        self._refresh_all()

    # ---- bisection -------------------------------------------------------

    def action_bisect(self) -> None:
        session = self.session
        if session is None:
            self._no_model()
            return
        run_id, cancel = self._begin("bisecting")
        start = self._bisect_start = self.settings
        # bisection's trial runs do not stream positions: say that the grid shows the run before it
        self.query_one("#grid-box").border_title = "hash grid · the run before bisection (bisecting…)"
        self.status.set_progress(0, None)
        self.status.set_text(f"bisecting from {session.label(start)}…", "busy")
        self.run_worker(partial(workers.bisection, session, start, run_id, cancel, self._run_lock,
                                self.post_message), thread=True, group="run", name="bisect",
                        description="bisect the toggles", exit_on_error=False)

    def on_bisect_move(self, m: msg.BisectMove) -> None:
        if not self._current(m):
            return
        self.query_one(HistoryPanel).show(self.session.history)
        mv = m.move
        self.settings = mv.settings  # the toggles panel shows the ops switched so far
        self.query_one(TogglePanel).show(self.settings, self._owners(mv.after), toggles=self._toggles())
        self.status.set_text(f"bisecting: {mv.change} moved the first DIFF {mv.before} -> {mv.after or 'all ok'}",
                             "busy")

    def on_bisect_done(self, m: msg.BisectDone) -> None:
        if not self._current(m):
            return
        out, result = m.outcome, m.result
        self._bisect_start = None
        self.settings = result.settings
        self._load_result(result)
        self._finish(result)
        if out.all_ok:
            mins = ",".join(t for t in self.session.binary_toggles if t in (out.minimal or ())) or "(none)"
            text = f"all ok; minimal exact set {mins}"
            self.status.set_text(f"all ok · minimal exact set {mins} · {len(out.moves)} moves", "ok")
        else:
            text = "DIFFs remain with every op exact: not an op the toggles control"
        self.notify(text, title="bisect", severity="information" if out.all_ok else "warning", markup=False)

    def action_rank(self) -> None:
        board, result = self.board, self.result
        n = max(world_size(result.sub) or 0, world_size(result.ref) or 0) if result is not None else 0
        if board is None or not n:
            self.notify("no ranks: this run is not tensor- or expert-parallel (hf-dist, a serving engine's dump)",
                        markup=False)
            return
        board.rank = None if board.rank is not None and board.rank + 1 >= n else (
            0 if board.rank is None else board.rank + 1)
        board.rank_status = {} if board.rank is None else rank_statuses(result, board.rank)
        board.version += 1
        shown = "all ranks" if board.rank is None else f"rank {board.rank} of {n}"
        self.query_one("#grid-box").border_title = f"hash grid · {shown}"
        self.status.set_text(f"rank filter: {shown} ({len(board.rank_status)} sharded keys)", "")
        self._refresh_all()

    def action_sweep(self) -> None:
        from .sweep import SweepScreen

        if self.session is None:
            self._no_model()
            return
        if self.busy:
            self.notify("a sweep waits for the run in flight: escape cancels it", severity="warning", markup=False)
            return
        self.app.push_screen(SweepScreen(self.session, self.settings, tol=self.tolerance or Tolerance(),
                                         lock=self._run_lock))

    def action_repro(self) -> None:
        if self.session is None or self.result is None or self.phase != "idle":
            self.notify("a repro bundle needs a finished run", severity="warning", markup=False)
            return
        key = self.board.key(self.cursor.t, self.cursor.row, self.cursor.col)
        key = key if key is not None and self.result.comparison.status.get(key) is Status.DIFF else None
        self.status.set_text(f"writing the repro bundle of {key or 'the first far key'}…", "busy")
        self.run_worker(partial(workers.repro, self.session, self.result, self.export_dir, key, self.tolerance,
                                self.post_message), thread=True, group="repro", name="repro",
                        description="write a repro bundle", exit_on_error=False)

    def on_bundle_written(self, m: msg.BundleWritten) -> None:
        if m.error is not None:
            text = _one_line(m.error)
            self.status.set_text(f"no repro bundle: {text}", "error")
            self.notify(text, title="repro", severity="error", markup=False)
            return
        self.status.set_text(f"repro bundle {m.line}", "ok")
        self.notify(m.line, title="repro", markup=False)

    def action_graft(self) -> None:
        session = self.session
        if session is None:
            self._no_model()
            return
        if not session.subject_engine.caps.graft:
            self.notify(f"{session.subject_engine.name} cannot take the reference's values at a key: graft on sim"
                        f" or hf", title="graft", severity="warning", markup=False)
            return
        run_id, cancel = self._begin("grafting")
        what = f"far keys at {self.tolerance.spec()}" if self.tolerance is not None else "DIFF keys"
        self.query_one("#grid-box").border_title = "hash grid · the run before grafting (grafting…)"
        self.status.set_text(f"grafting: following the {what}…", "busy")
        self.run_worker(partial(workers.grafting, session, self.settings, self.tolerance, run_id, cancel,
                                self._run_lock, self.post_message), thread=True, group="run", name="graft",
                        description="graft the sources", exit_on_error=False)

    def on_graft_source(self, m: msg.GraftSource) -> None:
        if not self._current(m):
            return
        s = m.source
        after = f"another source at {s.next_key}" if s.next_key else "every key after it agrees"
        self.status.set_text(f"grafting: {s.label} (first at {s.key}) · {after}", "busy")

    def on_graft_done(self, m: msg.GraftDone) -> None:
        """The grid shows the run with every source grafted; the status and a note name the sources."""
        if not self._current(m):
            return
        out = m.outcome
        if out.last is not None:
            self._load_result(out.last)
            self._finish(out.last)
        done = out.remaining is None
        self.status.set_text(f"graft: {out.line()}" + (" · the grid shows the run with them grafted"
                                                       if out.sources else ""), "ok" if done else "diff")
        self.notify(out.line(), title="graft", severity="information" if done else "warning", markup=False)

    def _end_bisect(self) -> None:
        """A bisection stopped short: the toggles go back to what the grid shows."""
        if self._bisect_start is not None:
            self.settings = self._bisect_start
            self._bisect_start = None
            self.query_one(TogglePanel).show(self.settings, self._owners(self.board.first_diff),
                                             toggles=self._toggles())

    def _load_result(self, result: RunResult) -> None:
        """Show a finished run that did not stream positions (bisection's final run)."""
        board = self.board
        board.reset()
        board.raw_sub = self._raw_sub
        self._sub = {p.t: p for p in result.sub.positions}
        status = result.comparison.status
        for p_ref, p_sub in zip(result.ref.positions, result.sub.positions):
            board.add_position(p_sub.t, {k: status[k] for k in p_ref.hashes if k in status}, p_sub.hashes,
                               (p_ref.top1, p_sub.top1))

    # ---- settings --------------------------------------------------------

    def action_toggle(self, index: int) -> None:
        if self.session is None:
            self._no_model()
            return
        toggles = self.session.toggles
        if index >= len(toggles):
            return
        t = toggles[index]
        cur = self.settings.value(t)
        if t.binary and len(t.values) == 2:  # exact <-> its plain value
            self._change(self.settings.pick(t, t.fast if cur == t.exact else t.exact))
        else:
            self._change(self.settings.pick(t, t.values[(t.values.index(cur) + 1) % len(t.values)]))

    def action_all_exact(self) -> None:
        if self.session is None:
            self._no_model()
            return
        self._change(replace(self.settings, exact=frozenset(self.session.binary_toggles)))

    def action_all_fast(self) -> None:
        self._change(replace(self.settings, exact=frozenset()))

    def action_switch(self, name: str) -> None:
        values = next(vals for _, n, vals in SWITCHES if n == name)
        cur = getattr(self.settings, name)
        self._change(replace(self.settings, **{name: values[(values.index(cur) + 1) % len(values)]}))

    def _change(self, settings: RunSettings) -> None:
        if self.session is None:
            self._no_model()
            return
        self.settings = settings
        self.start_run()  # a change reruns by itself, cancelling the run in flight

    def action_rerun(self) -> None:
        self.start_run()

    def action_cancel(self) -> None:
        if self.phase in ("reference", "running", "bisecting", "grafting") and self._cancel is not None:
            self._cancel.set()
            self.status.set_text("cancelling…", "busy")

    def _no_model(self) -> None:
        self.notify("no model is loaded", severity="warning", markup=False)

    @on(HashGrid.CellClicked)
    def _clicked(self, m: HashGrid.CellClicked) -> None:
        c = self.cursor
        self._set_cursor(Cursor(c.t, m.row, c.col if m.col is None else m.col))

    # ---- iso, export -----------------------------------------------------

    def action_iso(self) -> None:
        if self.session is None:
            self._no_model()
            return
        from ...engines.builtin import BuiltinEngine
        from .iso import IsoScreen

        if not isinstance(self.session.subject_engine, BuiltinEngine):
            self.notify(f"iso needs a built-in subject (sim or cuda); {self.session.subject} runs whole decodes only",
                        severity="warning", markup=False)
            return

        self.app.push_screen(IsoScreen(self.session, self.settings.exact))

    def action_export(self) -> None:
        if self._exporting:
            self.notify("an export is being written", severity="warning", markup=False)
            return
        if not self.diff_mode and (self.result is None or self.phase != "idle"):
            self.notify("nothing finished to export yet: wait for the run (escape cancels it)",
                        severity="warning", markup=False)
            return
        try:
            folder = new_export_dir(self.export_dir).resolve()  # shown in full: it is where to look
        except OSError as e:
            self._export_failed(f"{self.export_dir}: {e.strerror or e}")
            return
        self._exporting = True
        write = (workers.export_diff(folder, self.source, self._diff_cmp) if self.diff_mode
                 else workers.export_live(folder, self.session, self.result, self.info.device, self.info.note))
        # A toast is not part of the evidence: hide the toast rack for the frame the screenshot is
        # taken from (the screenshot must come from the UI thread, and before the status says "exporting").
        toasts = self.query("#textual-toastrack")
        toasts.set(display=False)
        self.call_after_refresh(self._shoot, folder, write, toasts)

    def _shoot(self, folder: Path, write, toasts) -> None:
        try:
            svg = self.app.export_screenshot()
        except Exception as e:  # noqa: BLE001 - a failed export is a message, not a crash
            self._exporting = False
            self._export_failed(f"screenshot: {_one_line(e)}; the unfinished export is {folder}")
            return
        finally:
            toasts.set(display=True)
        self.status.set_text(f"exporting to {final_name(folder)}…", "busy")
        self.run_worker(partial(workers.export, folder, svg, write, self.post_message), thread=True,
                        group="export", name="export", description="write an export folder",
                        exit_on_error=False)

    def on_export_done(self, m: msg.ExportDone) -> None:
        self._exporting = False
        if m.error is not None:
            self._export_failed(f"{_one_line(m.error)} (the unfinished export is {m.path})")
            return
        self.last_export = Path(m.path)
        self.status.set_text(f"exported to {m.path}", "ok")
        self.notify(m.path, title="exported", timeout=8, markup=False)

    def _export_failed(self, text: str) -> None:
        # the status bar must not keep saying "exported to" an earlier folder
        self.status.set_text(f"export failed: {text}", "error")
        self.notify(text, title="export failed", severity="error", markup=False)

    def action_load_default(self) -> None:
        self.cancel_all()
        self._load(default_loader())

    # ---- actions availability ---------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if self.diff_mode and action in RUN_ACTIONS:
            return False  # two dump files: nothing to run, so the keys leave the footer
        if action == "toggle" and parameters and self.session is not None:
            return int(parameters[0]) < len(self.session.toggles)  # keys past the subject's toggles are off
        return True

    def palette_commands(self) -> list[tuple[str, str, str]]:
        """(title, help, action) for the command palette: every action of this screen."""
        cmds = []
        toggles = self._toggles()
        for b in self.BINDINGS:
            name = b.action.split("(")[0]
            if not self.check_action(name, ()):
                continue
            keys = ", ".join(self.app.get_key_display(Binding(k, "")) for k in b.key.split(","))
            title = _title(b)
            if name == "toggle":  # one command per toggle the subject has, named after it
                i = int(b.action[len("toggle("):-1])
                if i >= len(toggles):
                    continue
                title = f"Switch {toggles[i].name}: {' / '.join(toggles[i].values)}"
            cmds.append((title, f"key {keys}", b.action))
        cmds.append(("Load the embedded default model", "sim subject, 48 layers", "load_default"))
        return cmds

    # ---- redraw ----------------------------------------------------------

    def _owners(self, first: str | None) -> tuple[str, ...]:
        if not first or self.session is None:
            return ()
        try:
            return self.session.subject_engine.owners(parse_key(first).field)
        except ValueError:
            return ()

    def _toggles(self):
        return self.session.toggles if self.session is not None else ()

    def _refresh_all(self) -> None:
        board = self.board
        if board is None:
            return
        self.grid.refresh()
        self.query_one(TokenStrip).show(board, self.cursor.t)
        if not self.diff_mode:
            self.query_one(TogglePanel).show(self.settings, self._owners(board.first_diff), toggles=self._toggles())
            if self.session is not None:
                self.query_one(HistoryPanel).show(self.session.history)
        self._refresh_detail()

    def _refresh_detail(self) -> None:
        board, c = self.board, self.cursor
        if board is None:
            return
        key = board.key(c.t, c.row, c.col)
        # recompute only when the key or what is known about it changed (stats are the costly part)
        stamp = (self._run_id, key, board.cell(key, c.t), board.first_diff, self._ref is not None,
                 id(board.tolerance), id(board.traces))
        if stamp == self._detail_key:
            return
        self._detail_key = stamp
        self.query_one(DetailPanel).show(key_info(board, key, c.t))


def rank_statuses(result: RunResult, rank: int) -> dict[str, Status]:
    """Each sharded DIFF or ok key's status for one rank's share (a partial sum's share: its key's)."""
    out = {}
    for key, st in result.comparison.status.items():
        if st not in (Status.DIFF, Status.OK):
            continue
        report = compare_shares(result.ref, result.sub, key)
        if report and rank < len(report) and report[rank].status in ("ok", "DIFF"):
            out[key] = Status.OK if report[rank].status == "ok" else Status.DIFF
    return out


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


def _title(b: Binding) -> str:
    text = b.tooltip or b.description
    return text[:1].upper() + text[1:]


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
