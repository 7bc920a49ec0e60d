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
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding

from ...files import create_whole
from ...session.session import RunSettings, Session
from ...session.sweep import COLUMNS, SweepResult, SweepRow, format_nmse, kinds, sweep
from ...text import inert
from ...trace.compare import Tolerance
from ..parts.export import ExportDone, export_view, view_export_done
from ..widgets.chart import Chart, Point, chart_svg
from .table import TableScreen

CHART_TITLE = "max NMSE of the logits (log scale)"
HELP = """\
Each value runs once and is compared with the sweep's baseline (named below when it is done): the
reference for a toggle or a prompt length, the M=1 decode for the batch-verify width M, the prompt alone
for hf batch composition. The answer is the first DIFF and the first far key; "changed" marks a value
whose answer is not the previous value's: a boundary of the setting. In the chart · is 0 (every logit's
bits equal), × a run that failed, ▲ a change."""
SWEEP_JSON, SWEEP_SVG = "sweep.json", "sweep.svg"


def points(rows: Sequence[SweepRow]) -> list[Point]:
    return [Point(str(r.value), r.logits_nmse, r.changed) for r in rows]


def write_sweep(folder: Path, result: SweepResult) -> None:
    """sweep.json (the rows, as `kestrel-tui sweep --json` prints them) and sweep.svg (the chart)."""
    with create_whole(folder / SWEEP_JSON, what="sweep report") as f:
        json.dump(result.as_dict(), f, indent=1)
        f.write("\n")
    with create_whole(folder / SWEEP_SVG, what="sweep chart") as f:
        f.write(chart_svg(f"{result.what}: {CHART_TITLE}", points(result.rows)))


class SweepScreen(TableScreen):
    PREFIX = "sweep"
    COLUMNS = COLUMNS
    HELP = HELP
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
        self.exporting = False
        self.last_export: Path | None = None

    @property
    def busy(self) -> bool:
        return self.running or self.exporting

    def compose_under_table(self) -> ComposeResult:
        yield Chart(CHART_TITLE, id="sweep-chart")

    def action_back(self) -> None:
        self.stop()
        self.app.pop_screen()

    def action_next_what(self) -> None:
        if len(self.kinds) < 2:
            return
        self.what = self.kinds[(self.kinds.index(self.what) + 1) % len(self.kinds)] if self.what in self.kinds \
            else self.kinds[0]
        self.values = None  # another setting's values
        self.action_run()

    def action_run(self) -> None:
        self.rows, self.result = [], None
        self.query_one(Chart).show([], f"{self.what}: {CHART_TITLE}")
        s, settings, what, values, tol = self.session, self.settings, self.what, self.values, self.tol
        title = (f"sweep {what} · subject {s.subject} ({s.label(settings)})"
                 f" · tolerance {tol.spec() if tol is not None else 'bits only'}")
        self.start(title, f"sweeping {what}…",
                   lambda cancel, add_row: sweep(s, what, values, tol, settings, cancel=cancel, on_row=add_row),
                   lock=self.lock)

    def row_made(self, row: SweepRow) -> None:
        self.rows.append(row)
        self.add_row(row.cells(), {1: "bold red" if row.first_diff else "green", 2: "bold red" if row.first_far else "",
                                   6: "bold yellow" if row.changed else ""})
        self.query_one(Chart).show(points(self.rows))
        self.set_status(f"{len(self.rows)} values done; last: {row.value} (max logits NMSE"
                        f" {format_nmse(row.logits_nmse)})")

    def done(self, result: SweepResult | None, error: BaseException | None) -> None:
        if error is not None:
            self.set_status(f"sweep failed: {error}")
            self.notify(inert(str(error)), title="sweep failed", severity="error", markup=False)
            return
        if result is None:
            self.set_status("sweep cancelled")
            return
        self.result = result
        notes = f" · {'; '.join(result.notes)}" if result.notes else ""
        self.set_status(f"{result.line()} · against {result.baseline}{notes}")

    # ---- export

    def action_export(self) -> None:
        result = self.result
        if result is None or self.exporting:
            self.notify("nothing finished to export yet: wait for the sweep", severity="warning", markup=False)
            return
        export_view(self, lambda folder: write_sweep(folder, result), "sweep export")

    def on_export_done(self, m: ExportDone) -> None:
        view_export_done(self, m)
