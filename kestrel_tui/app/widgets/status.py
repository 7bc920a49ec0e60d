"""The line above the footer: a progress bar while a run goes, and what the app is doing.

Status texts carry no times or dates, so screenshots of a finished run are
byte-for-byte repeatable (the snapshot tests rely on it).
"""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from ...text import inert

STATUS_LIMIT = 1000  # characters: far past any terminal width, short of a runaway message


class StatusBar(Horizontal):
    text = ""  # what the label shows (tests and scripts read it)

    def compose(self) -> ComposeResult:
        yield ProgressBar(id="progress", show_eta=False)
        yield Label("", id="status-text", markup=False)

    def set_text(self, text: str, kind: str = "") -> None:
        # the status line carries engines' messages: one line, no control codes, bounded
        text = inert(text, STATUS_LIMIT)
        self.text = text
        label = self.query_one("#status-text", Label)
        label.update(text)
        for k in ("error", "busy", "ok", "diff"):
            label.set_class(k == kind, f"-{k}")

    def set_progress(self, done: int | None, total: int | None) -> None:
        """done None: hide the bar; total None: an indeterminate (pulsing) bar."""
        bar = self.query_one("#progress", ProgressBar)
        bar.display = done is not None
        if done is not None:
            bar.update(total=total, progress=done)
