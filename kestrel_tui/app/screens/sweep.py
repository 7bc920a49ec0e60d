"""The sweep view: one setting over its values, a row per value and a chart of the logits' drift.

The table shows, per value, the first DIFF, the first far key, how many keys are far, the largest NMSE
of the logits and the top-1 flips against the sweep's baseline, and marks the values where the answer
(first DIFF, first far) changes; the chart draws the NMSE on a log scale with the same marks. The sweep
runs in a thread worker (rows arrive as they are made; escape cancels), on the subject with the main
screen's settings; w picks the next setting to sweep, x exports the table, the chart and the screen.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Static

from ...files import create_whole
from ...session.session import RunSettings, Session
from ...session.sweep import COLUMNS, SweepResult, SweepRow, format_nmse, kinds, sweep
from ...text import inert
from ...trace.compare import Tolerance
from ...trace.run import Cancelled
from .. import messages as msg
from .. import workers
from ..export import final_name, new_export_dir
from ..widgets.chart import Chart, Point, chart_svg

CHART_TITLE = "max NMSE of the logits (log scale)"
HELP = """\
Each value runs once and is compared with the sweep's baseline (named below when it is done): the
reference for a toggle or a prompt length, the M=1 decode for the batch-verify width M, the prompt alone
for hf batch composition. The answer is the first DIFF and the first far key; "changed" marks a value
whose answer is not the previous value's: a boundary of the setting. In the chart · is 0 (every logit's
bits equal), × a run that failed, ▲ a change."""
SWEEP_JSON, SWEEP_SVG = "sweep.json", "sweep.svg"


class SweepRowDone(Message):
    def __init__(self, run_id: int, row: SweepRow) -> None:
        super().__init__()
        self.run_id, self.row = run_id, row


class SweepDone(Message):
    def __init__(self, run_id: int, result: SweepResult | None, error: BaseException | None = None) -> None:
        super().__init__()
        self.run_id, self.result, self.error = run_id, result, error


def points(rows: Sequence[SweepRow]) -> list[Point]:
    return [Point(str(r.value), r.logits_nmse, r.changed) for r in rows]


def write_sweep(folder: Path, result: SweepResult) -> None:
    """sweep.json (the rows, as `kestrel-tui sweep --json` prints them) and sweep.svg (the chart)."""
    with create_whole(folder / SWEEP_JSON, what="sweep report") as f:
        json.dump(result.as_dict(), f, indent=1)
        f.write("\n")
    with create_whole(folder / SWEEP_SVG, what="sweep chart") as f:
        f.write(chart_svg(f"{result.what}: {CHART_TITLE}", points(result.rows)))


class SweepScreen(Screen):
    BINDINGS = [
        Binding("escape", "back", "back", tooltip="back to the grid (cancels a sweep in flight)"),
        Binding("r", "run", "rerun", tooltip="run the sweep again"),
        Binding("w", "next_what", "next setting", tooltip="sweep the next setting (toggles, M, prompt, batch)"),
        Binding("x", "export", "export", tooltip="export sweep.json, the chart's SVG and a screenshot"),
    ]

    def __init__(self, session: Session, settings: RunSettings, what: str | None = None,
                 values: Sequence | None = None, tol: Tolerance | None = Tolerance(),
                 lock: threading.Lock | None = None) -> None:
        """``what``: a sweep.kinds() entry (default: M where the subject has it, else its first);
        ``values``: that setting's values (default: sweep.default_values); ``lock``: the main screen's run
        lock, so that a sweep waits for a run in flight to leave the session."""
        super().__init__()
        self.session, self.settings, self.values, self.tol = session, settings, values, tol
        self.kinds = kinds(session)
        self.what = what or ("m" if "m" in self.kinds else self.kinds[0] if self.kinds else "prompt")
        self.lock = lock or threading.Lock()
        self.rows: list[SweepRow] = []
        self.result: SweepResult | None = None
        self.running = False
        self._exporting = False
        self.last_export: Path | None = None
        self._run_id = 0
        self._cancel: threading.Event | None = None

    @property
    def busy(self) -> bool:
        return self.running or self._exporting

    def compose(self) -> ComposeResult:
        yield Label("", id="sweep-title", markup=False)
        yield DataTable(id="sweep-table", cursor_type="row", zebra_stripes=True)
        yield Chart(CHART_TITLE, id="sweep-chart")
        yield Static(HELP, id="sweep-help", markup=False)
        yield Label("", id="sweep-status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)
        self.action_run()

    def on_unmount(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def _title(self) -> str:
        tol = self.tol.spec() if self.tol is not None else "bits only"
        return (f"sweep {self.what} · subject {self.session.subject} ({self.session.label(self.settings)})"
                f" · tolerance {tol}")

    def _status(self, text: str) -> None:
        self.query_one("#sweep-status", Label).update(inert(text))

    def action_back(self) -> None:
        if self._cancel is not None:
            self._cancel.set()
        self.app.pop_screen()

    def action_next_what(self) -> None:
        if len(self.kinds) < 2:
            return
        self.what = self.kinds[(self.kinds.index(self.what) + 1) % len(self.kinds)] if self.what in self.kinds \
            else self.kinds[0]
        self.values = None  # another setting's values
        self.action_run()

    def action_run(self) -> None:
        if self._cancel is not None:
            self._cancel.set()
        self._run_id += 1
        run_id, cancel = self._run_id, threading.Event()
        self._cancel, self.rows, self.result, self.running = cancel, [], None, True
        self.query_one("#sweep-title", Label).update(inert(self._title()))
        self.query_one(DataTable).clear()
        self.query_one(Chart).show([], f"{self.what}: {CHART_TITLE}")
        self._status(f"sweeping {self.what}…")
        s, settings, what, values, tol = self.session, self.settings, self.what, self.values, self.tol

        def work() -> None:
            with self.lock:
                try:
                    result = sweep(s, what, values, tol, settings, cancel=cancel,
                                   on_row=lambda row: self.post_message(SweepRowDone(run_id, row)))
                except Cancelled:
                    self.post_message(SweepDone(run_id, None))
                    return
                except Exception as e:  # noqa: BLE001 - shown on the screen; the app stays usable
                    self.post_message(SweepDone(run_id, None, e))
                    return
            self.post_message(SweepDone(run_id, result))

        self.run_worker(work, thread=True, group="sweep", name="sweep", exit_on_error=False)

    @on(SweepRowDone)
    def _row(self, m: SweepRowDone) -> None:
        if m.run_id != self._run_id:
            return
        self.rows.append(m.row)
        cells = m.row.cells()
        style = {1: "bold red" if m.row.first_diff else "green", 2: "bold red" if m.row.first_far else "",
                 6: "bold yellow" if m.row.changed else ""}
        # DataTable reads str cells as markup; keys and toggle values are data, never markup
        self.query_one(DataTable).add_row(*(Text(inert(c), style=style.get(i, "")) for i, c in enumerate(cells)))
        self.query_one(Chart).show(points(self.rows))
        self._status(f"{len(self.rows)} values done; last: {m.row.value} (max logits NMSE"
                     f" {format_nmse(m.row.logits_nmse)})")

    @on(SweepDone)
    def _done(self, m: SweepDone) -> None:
        if m.run_id != self._run_id:
            return
        self.running = False
        if m.error is not None:
            self._status(f"sweep failed: {m.error}")
            self.notify(inert(str(m.error)), title="sweep failed", severity="error", markup=False)
            return
        if m.result is None:
            self._status("sweep cancelled")
            return
        self.result = m.result
        notes = f" · {'; '.join(m.result.notes)}" if m.result.notes else ""
        self._status(f"{m.result.line()} · against {m.result.baseline}{notes}")

    # ---- export

    def action_export(self) -> None:
        if self.result is None or self._exporting:
            self.notify("nothing finished to export yet: wait for the sweep", severity="warning", markup=False)
            return
        try:
            folder = new_export_dir(self.app.export_dir).resolve()
        except OSError as e:
            self.notify(f"{self.app.export_dir}: {e.strerror or e}", title="export failed", severity="error",
                        markup=False)
            return
        self._exporting = True
        svg = self.app.export_screenshot()
        self._status(f"exporting to {final_name(folder)}…")
        result = self.result
        self.run_worker(partial(workers.export, folder, svg, lambda: write_sweep(folder, result), self.post_message),
                        thread=True, group="export", name="sweep export", exit_on_error=False)

    def on_export_done(self, m: msg.ExportDone) -> None:
        self._exporting = False
        if m.error is not None:
            self._status(f"export failed: {m.error} (the unfinished export is {m.path})")
            self.notify(str(m.error), title="export failed", severity="error", markup=False)
            return
        self.last_export = Path(m.path)
        self._status(f"exported to {m.path}")
        self.notify(m.path, title="exported", timeout=8, markup=False)
