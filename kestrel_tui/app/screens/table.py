"""A screen of one table that a thread worker fills: a title line, the table, what it means, a status line.

The iso and the sweep views are two (iso.py, sweep.py). A view names the prefix of its ids (app.tcss
styles #<prefix>-title, -table, -help and -status), its columns and its help text, and `start`s its work
in a thread worker, which hands rows over as it makes them and its result at the end, both tagged with
a run id: starting again cancels the work in flight, and what that work still posts is dropped.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Static

from ...text import inert
from ...trace.run import Cancelled
from ..messages import message

# work(cancel, add_row) -> its result; raises Cancelled once cancel is set
Work = Callable[[threading.Event, Callable[[Any], None]], Any]


@message
class RowMade(Message):
    run_id: int
    row: Any


@message
class WorkDone(Message):
    run_id: int
    result: Any  # None: cancelled, or failed
    error: BaseException | None = None


class TableScreen(Screen):
    PREFIX: ClassVar[str]
    COLUMNS: ClassVar[Sequence[str]]
    HELP: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.running = False
        self._run_id = 0
        self._cancel: threading.Event | None = None

    def compose(self) -> ComposeResult:
        p = self.PREFIX
        yield Label("", id=f"{p}-title", markup=False)
        yield DataTable(id=f"{p}-table", cursor_type="row", zebra_stripes=True)
        yield from self.compose_under_table()
        yield Static(self.HELP, id=f"{p}-help", markup=False)
        yield Label("", id=f"{p}-status", markup=False)
        yield Footer()

    def compose_under_table(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*self.COLUMNS)
        self.action_run()

    def on_unmount(self) -> None:
        self.stop()

    def action_run(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def start(self, title: str, status: str, work: Work, lock: threading.Lock | None = None) -> None:
        """Cancel the work in flight, empty the table and run `work` in a thread worker (holding `lock`)."""
        self.stop()
        self._run_id += 1
        run_id, cancel = self._run_id, threading.Event()
        self._cancel, self.running = cancel, True
        self.set_title(title)
        self.set_status(status)
        self.query_one(DataTable).clear()

        def body() -> None:
            result, error = None, None
            with lock or contextlib.nullcontext():
                try:
                    result = work(cancel, lambda row: self.post_message(RowMade(run_id, row)))
                except Cancelled:
                    pass
                except Exception as e:  # noqa: BLE001 - shown on the screen; the app stays usable
                    error = e
            self.post_message(WorkDone(run_id, result, error))

        self.run_worker(body, thread=True, group=self.PREFIX, name=self.PREFIX, exit_on_error=False)

    @on(RowMade)
    def _row_made(self, m: RowMade) -> None:
        if m.run_id == self._run_id:
            self.row_made(m.row)

    @on(WorkDone)
    def _work_done(self, m: WorkDone) -> None:
        if m.run_id == self._run_id:
            self.running = False
            self.done(m.result, m.error)

    def row_made(self, row: Any) -> None:
        """A row the work handed over while it runs."""

    def done(self, result: Any, error: BaseException | None) -> None:
        raise NotImplementedError

    def set_title(self, text: str) -> None:
        self.query_one(f"#{self.PREFIX}-title", Label).update(inert(text))

    def set_status(self, text: str) -> None:
        self.query_one(f"#{self.PREFIX}-status", Label).update(inert(text))

    def add_row(self, cells: Sequence[str], styles: Mapping[int, str]) -> None:
        """One row; styles: column -> its cell's style. Cells are data (keys, values): never markup."""
        self.query_one(DataTable).add_row(*(Text(inert(c), style=styles.get(i, "")) for i, c in enumerate(cells)))
