"""The main screen: token strip, hash grid, toggles, detail, history, progress.

The screen is made of parts (app/parts/): loading, the decode, the settings keys, tolerance, bisect,
graft, repro, export and ranks, each with its keys, its thread worker and its messages. The screen
lays out the widgets, lists the parts' keys (and its own: cursor moves in navigation.py, the iso,
sweep and logprob mismatch views), hands each action and each worker message to its part, and holds
what they share: the session, the board, the settings, the last finished run, the phase (which part's
worker holds the session) and the run id. Numerics run only in the workers; a new run cancels the one in flight,
and messages of any run but the current one are dropped by id.
"""
from __future__ import annotations

import threading
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label

from ...session.session import RunResult, RunSettings, Session
from ...trace.compare import Tolerance
from ...trace.keys import parse_key
from ..messages import RunMessage, WorkerMessage
from ..parts.base import Part, Phase
from ..parts.bisect import Bisect
from ..parts.export import Export
from ..parts.graft import Graft
from ..parts.load import Load
from ..parts.ranks import Ranks
from ..parts.repro import Repro
from ..parts.runs import Runs, quiet_gc
from ..parts.settings import Settings
from ..parts.tolerance import Tolerances
from ..source import DiffSource, Loaded, LiveSource
from ..state import Board, Cursor
from ..widgets.detail import DetailPanel, key_info
from ..widgets.grid import HashGrid
from ..widgets.header import InfoHeader
from ..widgets.history import HistoryPanel
from ..widgets.status import StatusBar
from ..widgets.tokens import TokenStrip
from ..widgets.toggles import TogglePanel
from .navigation import NAVIGATION, GridNavigation

MIN_SIZE = (80, 24)  # the smallest terminal the layout supports (app.tcss's narrow form)

PARTS: tuple[type[Part], ...] = (Load, Runs, Settings, Tolerances, Bisect, Graft, Repro, Export, Ranks)

# The screen's own keys: the views it opens over the grid (all need a model).
VIEWS = (
    Binding("i", "iso", "iso", tooltip="iso view: batch-verify (M columns) vs M=1 decode, logits byte by byte"),
    Binding("s", "sweep", "sweep", show=False, tooltip="sweep one setting over its values (a toggle, M, the"
            " prompt length, hf batch composition): where the answer changes, with a chart"),
    Binding("L", "mismatch", "mismatch", show=False, tooltip="logprob mismatch view: the last finished run's"
            " log-ratio histogram with the clip bands, its figures, the worst token next to the first far key"),
)

# The order the footer, the help screen and the command palette list the keys in, by action.
KEY_ORDER = ("move", "toggle", "first_diff", "first_far", "next_diff", "token", "rerun", "bisect", "iso", "mismatch",
             "tolerance", "export", "all_exact", "rank", "sweep", "repro", "graft", "all_fast", "switch", "cancel")


def action_name(b: Binding) -> str:
    return b.action.split("(")[0]


# Actions that need a model; diff mode (two dump files) hides them (check_action).
RUN_ACTIONS = frozenset().union(*(p.live_actions() for p in PARTS), (action_name(b) for b in VIEWS))


class MainScreen(GridNavigation, Screen):
    # Below 110 columns the side panels move under the grid (app.tcss): 80x24 stays usable.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]

    BINDINGS = sorted([*NAVIGATION, *VIEWS, *(b for p in PARTS for b in p.BINDINGS)],
                      key=lambda b: KEY_ORDER.index(action_name(b)))

    def __init__(self, source: LiveSource | DiffSource, export_dir: Path) -> None:
        super().__init__()
        self.source = source
        self.export_dir = export_dir
        self.diff_mode = isinstance(source, DiffSource)
        self.last_export: Path | None = None
        self.session: Session | None = None
        self.info: Loaded | None = None
        self.board: Board | None = None
        self.settings = RunSettings()
        self.result: RunResult | None = None  # the last finished run
        self.cursor = Cursor(0, 1, 0)
        self.follow = True  # the cursor tracks the first DIFF until the user moves it
        self.phase = Phase.LOADING
        self.run_lock = threading.Lock()  # held by whichever worker runs the session
        self._run_id = 0
        self._cancel: threading.Event | None = None
        self._detail_key: tuple | None = None

        self.tolerances = Tolerances(self)
        self.runs = Runs(self, self.tolerances)
        self.load = Load(self, self.runs, self.tolerances)
        self.parts: tuple[Part, ...] = (self.load, self.runs, Settings(self), self.tolerances,
                                        Bisect(self, self.runs), Graft(self, self.runs), Repro(self),
                                        Export(self), Ranks(self))
        # Textual finds a key's action as the screen's action_<name>, a message's handler as on_<name>:
        # each is its part's
        self._owner = {name: p for p in self.parts for name in p.actions()}
        for name, p in self._owner.items():
            setattr(self, f"action_{name}", getattr(p, f"action_{name}"))
        self._handlers = {name: getattr(p, name) for p in self.parts for name in dir(p) if name.startswith("on_")}

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

    def on_mount(self) -> None:
        for wid, title in (("grid-box", "hash grid"), ("toggles", "toggles"), ("detail", "detail"),
                           ("history", "history")):
            self.query_one(f"#{wid}").border_title = title
        self.status.set_progress(None, None)
        if self.diff_mode:
            self.add_class("-diff")  # app.tcss hides the toggles and history: nothing runs here
            self.load.open_diff(self.source)
        else:
            self.load.start(self.source.loader)

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

    @property
    def grid(self) -> HashGrid:
        return self.query_one(HashGrid)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    # ---- what the parts share ----------------------------------------------

    @property
    def busy(self) -> bool:
        """A worker is loading, running, bisecting, grafting, exporting or judging (tests and the benchmark
        wait on this)."""
        return self.phase.busy or any(p.busy for p in self.parts)

    @property
    def tolerance(self) -> Tolerance | None:
        return self.tolerances.current

    @property
    def holder(self) -> Part | None:
        """The part whose worker holds the session in this phase."""
        return next((p for p in self.parts if self.phase in p.PHASES), None)

    @property
    def run_id(self) -> int:
        return self._run_id

    def begin(self, phase: Phase) -> tuple[int, threading.Event]:
        """Cancel whatever is in flight and open a new run id."""
        quiet_gc(False)
        self.cancel_all()
        for p in self.parts:
            p.superseded()
        self._run_id += 1
        self._cancel = threading.Event()
        self.phase = phase
        return self._run_id, self._cancel

    def current(self, m: RunMessage) -> bool:
        return m.run_id == self._run_id

    def cancel_all(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def start_run(self) -> None:
        self.runs.start()

    def no_model(self) -> None:
        self.notify("no model is loaded", severity="warning", markup=False)

    @on(WorkerMessage)
    def _to_its_part(self, m: WorkerMessage) -> None:
        handler = self._handlers.get(m.handler_name)
        if handler is not None:
            handler(m)

    @on(HashGrid.CellClicked)
    def _clicked(self, m: HashGrid.CellClicked) -> None:
        c = self.cursor
        self._set_cursor(Cursor(c.t, m.row, c.col if m.col is None else m.col))

    # ---- the views over the grid -----------------------------------------------

    def action_iso(self) -> None:
        if self.session is None:
            self.no_model()
            return
        from ...engines.builtin import BuiltinEngine
        from .iso import IsoScreen

        if not isinstance(self.session.subject_engine, BuiltinEngine):
            self.notify(f"iso needs a built-in subject (sim or cuda); {self.session.subject} runs whole decodes only",
                        severity="warning", markup=False)
            return
        self.app.push_screen(IsoScreen(self.session, self.settings.exact))

    def action_sweep(self) -> None:
        from .sweep import SweepScreen

        if self.session is None:
            self.no_model()
            return
        if self.busy:
            self.notify("a sweep waits for the run in flight: escape cancels it", severity="warning", markup=False)
            return
        self.app.push_screen(SweepScreen(self.session, self.settings, tol=self.tolerance or Tolerance(),
                                         lock=self.run_lock))

    def action_mismatch(self) -> None:
        from .mismatch import MismatchScreen

        if self.session is None:
            self.no_model()
            return
        if self.result is None:
            self.notify("no finished run yet: the mismatch view shows the last finished run", severity="warning",
                        markup=False)
            return
        summary = self.board.tolerance if self.board is not None else None
        self.app.push_screen(MismatchScreen(self.result, self.tolerance, summary))

    # ---- actions availability ---------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if self.diff_mode and action in RUN_ACTIONS:
            return False  # two dump files: nothing to run, so the keys leave the footer
        part = self._owner.get(action)
        return part.check_action(action, parameters) if part is not None else True

    def palette_commands(self) -> list[tuple[str, str, str]]:
        """(title, help, action) for the command palette: every action of this screen."""
        cmds = []
        toggles = self._toggles()
        for b in self.BINDINGS:
            name = action_name(b)
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
        return cmds + [c for p in self.parts for c in p.COMMANDS]

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

    def title_grid(self, note: str | None = None) -> None:
        self.query_one("#grid-box").border_title = "hash grid" + (f" · {note}" if note else "")

    def show_header(self) -> None:
        self.query_one(InfoHeader).show_session(self.info, self.result)

    def show_toggles(self, first: str | None) -> None:
        """The settings asked for, marking the toggles that may own `first` (a DIFF key)."""
        self.query_one(TogglePanel).show(self.settings, self._owners(first), toggles=self._toggles())

    def refresh_all(self) -> None:
        board = self.board
        if board is None:
            return
        self.grid.refresh()
        self.query_one(TokenStrip).show(board, self.cursor.t)
        if not self.diff_mode:
            self.show_toggles(board.first_diff)
            if self.session is not None:
                self.query_one(HistoryPanel).show(self.session.history)
        self.refresh_detail()

    def refresh_detail(self) -> None:
        board, c = self.board, self.cursor
        if board is None:
            return
        key = board.key(c.t, c.row, c.col)
        # recompute only when the key or what is known about it changed (stats are the costly part)
        stamp = (self._run_id, key, board.cell(key, c.t), board.first_diff, self.runs.ref is not None,
                 id(board.tolerance), id(board.traces))
        if stamp == self._detail_key:
            return
        self._detail_key = stamp
        self.query_one(DetailPanel).show(key_info(board, key, c.t))


def _title(b: Binding) -> str:
    text = b.tooltip or b.description
    return text[:1].upper() + text[1:]
