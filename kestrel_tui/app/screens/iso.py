"""The iso view (the seed's [ISODIFF]): batch-verify of M draft tokens vs M=1 decode, per column.

Speculative decoding is only correct when every verify column's full logits
equal the M=1 step's byte for byte; the table shows, per column, how many
logits differ, the first differing vocab id, the largest ULP distance and the
first differing probe key. It runs on the subject with the main screen's
current exact toggles, in a thread worker; +/- change M and rerun.
"""
from __future__ import annotations

import threading

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Static

from ...backends.toggles import describe
from ...engines.build import make_backend
from ...session.iso import IsoColumn, iso
from ...trace.run import Cancelled
from ...session.session import Session
from ...trace.compare import NAN_ULP

HELP = """\
Speculative decoding verifies M draft tokens in one M-column step. That is only correct if every
column's logits equal, byte for byte, what the M=1 decode step gives for the same tokens: a 1-ULP
difference anywhere can flip a later boundary token. The subject decodes M tokens one at a time,
then a fresh instance verifies the same M tokens in one step.

ndiff          logits whose bits differ (of the whole vocabulary)
first logit    the first differing vocab id
max ULP        the largest distance in units in the last place
first DIFF key the first probe key, in dataflow order, that differs between the column and M=1

Ops toggled on the main screen apply here: escape, switch ops, press i again."""

COLUMNS = ("col", "pos", "token", "ndiff", "first logit", "max ULP", "first DIFF key", "top-1 M=1/batch")


class IsoDone(Message):
    def __init__(self, run_id: int, cols: list[IsoColumn] | None, error: BaseException | None = None) -> None:
        super().__init__()
        self.run_id, self.cols, self.error = run_id, cols, error


class IsoScreen(Screen):
    BINDINGS = [
        Binding("escape,i", "app.pop_screen", "back", tooltip="back to the grid"),
        Binding("plus,equals_sign", "width(1)", "M+1", tooltip="one more verify column"),
        Binding("minus", "width(-1)", "M-1", tooltip="one verify column fewer"),
        Binding("r", "run", "rerun", tooltip="run the iso check again"),
    ]

    def __init__(self, session: Session, exact: frozenset[str], m: int = 5) -> None:
        super().__init__()
        self.session, self.exact = session, exact
        self.m = max(1, min(m, session.n_tokens))
        self.cols: list[IsoColumn] | None = None
        self._run_id = 0
        self._cancel: threading.Event | None = None

    def compose(self) -> ComposeResult:
        yield Label("", id="iso-title", markup=False)
        yield DataTable(id="iso-table", cursor_type="row", zebra_stripes=True)
        yield Static(HELP, id="iso-help", markup=False)
        yield Label("", id="iso-status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)
        self.action_run()

    def on_unmount(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def _title(self) -> str:
        return (f"iso: batch-verify M={self.m} vs M=1 decode · subject {self.session.subject}"
                f" ({describe(self.exact)}) · full logits byte by byte")

    def action_width(self, d: int) -> None:
        m = max(1, min(self.m + d, self.session.n_tokens))
        if m != self.m:
            self.m = m
            self.action_run()

    def action_run(self) -> None:
        if self._cancel is not None:
            self._cancel.set()
        self._run_id += 1
        run_id, cancel, m = self._run_id, threading.Event(), self.m
        self._cancel = cancel
        self.cols = None
        s, exact = self.session, self.exact
        self.query_one("#iso-title", Label).update(self._title())
        self.query_one("#iso-status", Label).update(f"running M=1 decode and one M={m} verify step…")
        self.query_one(DataTable).clear()

        def work() -> None:
            try:
                cols = iso(lambda: make_backend(s.subject, s.model, kv=s.kv, exact=exact), s.prompt, m,
                           cancel=cancel)
            except Cancelled:
                return
            except Exception as e:  # noqa: BLE001 - shown on the screen
                self.post_message(IsoDone(run_id, None, e))
                return
            self.post_message(IsoDone(run_id, cols))

        self.run_worker(work, thread=True, group="iso", name="iso", exit_on_error=False)

    @property
    def busy(self) -> bool:
        return self.cols is None

    @on(IsoDone)
    def _done(self, m: IsoDone) -> None:
        if m.run_id != self._run_id:
            return
        status = self.query_one("#iso-status", Label)
        if m.error is not None:
            self.cols = []
            status.update(f"iso failed: {m.error}")
            self.notify(str(m.error), title="iso failed", severity="error", markup=False)
            return
        self.cols = m.cols
        table = self.query_one(DataTable)
        for c in m.cols:
            ndiff = Text(str(c.ndiff), style="bold red" if c.ndiff else "green")
            ulp = "NaN" if c.max_ulp == NAN_ULP else str(c.max_ulp)
            top = Text(f"{c.top1_single}/{c.top1_batch}", style="bold red" if c.top1_single != c.top1_batch else "")
            cells = (str(c.j), str(c.t), str(c.token), ndiff, "—" if c.first_index is None else str(c.first_index),
                     ulp, c.first_diff_key or "—", top)
            # DataTable reads str cells as markup; a probe key is data, never markup
            table.add_row(*(Text(x) if isinstance(x, str) else x for x in cells))
        bad = sum(1 for c in m.cols if c.ndiff)
        if bad:
            status.update(f"{bad}/{len(m.cols)} columns differ from M=1: batch-verify is not bit-exact here")
        else:
            status.update(f"all {len(m.cols)} columns byte-identical to M=1 decode")
