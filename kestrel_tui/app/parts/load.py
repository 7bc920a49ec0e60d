"""What the screen looks at: a model loaded in a worker (a bad model directory or prompt is a message, and
the app stays up), or two dump files compared at once (diff mode: nothing runs)."""
from __future__ import annotations

from ...trace.compare import Status, compare
from ...trace.keys import layer_fields
from ..messages import WorkerMessage, message
from ..source import DiffSource, Loaded, Loader, PromptError, default_loader
from ..state import Board, Cursor, axes_of
from ..widgets.detail import DetailPanel
from ..widgets.header import InfoHeader
from ..widgets.history import HistoryPanel
from ..widgets.toggles import TogglePanel
from .base import Host, Part, Phase, one_line
from .runs import Runs, quiet_gc
from .tolerance import Tolerances


@message
class LoadProgress(WorkerMessage):
    step: object  # model.progress.LoadStep


@message
class SessionLoaded(WorkerMessage):
    info: Loaded


@message
class LoadFailed(WorkerMessage):
    error: BaseException


def load(loader: Loader, post) -> None:
    try:
        info = loader(lambda step: post(LoadProgress(step)))
    except Exception as e:  # noqa: BLE001 - any load failure is shown, the app stays up
        post(LoadFailed(e))
        return
    post(SessionLoaded(info))


class Load(Part):
    COMMANDS = (("Load the embedded default model", "sim subject, 48 layers", "load_default"),)
    DIFF_MODE = frozenset({"load_default"})

    def __init__(self, screen: Host, runs: Runs, tolerances: Tolerances) -> None:
        super().__init__(screen)
        self.runs, self.tolerances = runs, tolerances  # a new session: no reference yet, its own tolerance

    def action_load_default(self) -> None:
        self.start(default_loader())

    def start(self, loader: Loader) -> None:
        s = self.screen
        s.begin(Phase.LOADING)  # cancels a run in flight: whatever it still posts is stale from here on
        s.session = None  # keys that need a model wait for the new one
        s.status.set_text("loading the model…", "busy")
        s.status.set_progress(0, None)
        self.work(lambda: load(loader, s.post_message), name="load", description="load the model", exclusive=True)

    def on_load_progress(self, m: LoadProgress) -> None:
        s = self.screen
        if s.phase is Phase.LOADING:
            s.status.set_text(f"loading the model… {m.step.line()}", "busy")
            s.status.set_progress(m.step.bytes_read, m.step.bytes_total)

    def on_session_loaded(self, m: SessionLoaded) -> None:
        s = self.screen
        info = m.info
        session = info.session
        s.session, s.info, s.result = session, info, None
        self.runs.forget()
        P = len(session.prompt)
        s.settings = session.initial_settings()  # a new session has its own toggles
        self.tolerances.use(info.tolerance)
        board = s.board = Board(range(P + session.n_tokens), range(session.model.cfg.n_layers),
                                layer_fields(session.deep), prompt_len=P)
        toggles = session.toggles
        s.query_one(DetailPanel).owner_label = lambda f: " ".join(
            f"{o}[{next(i for i, t in enumerate(toggles) if t.name == o) + 1}]"
            for o in session.subject_engine.owners(f))
        board.raw_sub = self.runs.raw_sub
        board.q8_inputs = session.model.fmt == "q4_0"
        board.expected_missing = session.missing_by_design
        s.grid.set_board(board)
        s.cursor = Cursor(min(P, board.n_positions - 1), 1, 0)
        s.show_header()
        if info.note:
            s.notify(info.note, title="subject", severity="warning", timeout=8, markup=False)
        s.start_run()

    def on_load_failed(self, m: LoadFailed) -> None:
        s = self.screen
        s.phase = Phase.ERROR
        s.status.set_progress(None, None)
        text = one_line(m.error)
        if isinstance(m.error, PromptError):
            what, header = "bad prompt or token count", "prompt rejected: nothing to run"
            hint = "The model loaded, but the prompt or --tokens does not fit it (see the status line)."
        else:
            what, header, hint = "cannot load the model", "no model loaded", "No model loaded."
        s.query_one(InfoHeader).show([("", header)])
        s.status.set_text(f"{what}: {text}", "error")
        s.query_one(DetailPanel).show(None, f"{hint} Quit (q), or open the embedded default model "
                                            "from the command palette (ctrl+p).")
        s.query_one(TogglePanel).show(s.settings, enabled=False)
        s.notify(text, title=what, severity="error", timeout=10, markup=False)

    def open_diff(self, src: DiffSource) -> None:
        s = self.screen
        cmp = compare(src.a, src.b)
        positions, layers, fields = axes_of(cmp.status)
        board = s.board = Board(positions, layers, fields or layer_fields(), sides=("A", "B"), live=False)
        board.load(cmp, src.a, src.b)
        s.query_one(InfoHeader).show([("", "diff mode (no model)"), ("A", src.path_a), ("B", src.path_b)])
        s.query_one(TogglePanel).show(s.settings, enabled=False)
        s.grid.set_board(board)
        s.phase = Phase.IDLE
        if cmp.identical:
            s.status.set_text(f"identical: {len(cmp.status)} keys", "ok")
        else:
            names = {Status.DIFF: "DIFF", Status.MISSING_SUB: "only in A", Status.MISSING_REF: "only in B"}
            parts = [f"{n} {names[st]}" for st, n in cmp.counts.items() if n and st in names]
            s.status.set_text(f"first DIFF {cmp.first_diff or '—'} · " + " · ".join(parts)
                              + (f" · {len(board.outside)} keys outside the grid" if board.outside else ""),
                              "diff")
        s.home()  # also when the first mismatch is a foreign tag, with no cell to go to
        first = board.first_diff or board.first_mismatch
        if first:
            s.goto(first)
        s.query_one(HistoryPanel).show([])
        quiet_gc(True)
