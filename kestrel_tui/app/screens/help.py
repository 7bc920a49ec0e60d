"""The help screen: every key, generated from the screens' own bindings so it cannot drift,
and what the colours and glyphs mean."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ...engines.schedule import GRAMMAR

LEGEND = [
    ("ok", "grid: hashes equal", "green"),
    ("DIFF", "grid: hashes differ (▶ and bright red: the first DIFF in dataflow order)", "bold white on red"),
    ("close", "grid, tolerance on (T): a DIFF key whose raw values are within the tolerance", "black on yellow"),
    ("far", "grid, tolerance on (T): a DIFF key outside it (the status line names the first far key)",
     "bold white on red"),
    ("·", "pending: the subject has not reached this position yet", "bright_black"),
    ("-sub", "missing: the named side has no such key (diff mode: -A / -B)", "black on yellow"),
    ("✓ ✗ ! · ?", "token strip: ok, DIFF, top-1 flip, pending, missing; shaded = prompt", ""),
]

ABOUT = ("kestrel-tui runs the decode on the CPU reference and on the subject, hashes every buffer "
         "(rows emb, L0..Ln, logits x the field columns) and shows where they first differ. Switch "
         "ops between fast and exact and watch the first DIFF move; b bisects automatically. "
         "Runs happen in the background: keys work while the grid fills, and a new run cancels the old.")
SCHEDULES = (f"A side's schedule says which positions go into one forward pass: {GRAMMAR}; the same tokens, "
             "so the same keys (--schedule, --reference-schedule, or a profile's option schedule). A subject "
             "with a schedule other than decode gets a schedule toggle (its number key, listed with the "
             "toggles) that switches it back to decode. Every run reports the logprob mismatch of the "
             "reference's chosen tokens: {key} opens its view (the log-ratio histogram with the clip bands, the "
             "figures, the worst token next to the first far key).")


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark,f1", "app.pop_screen", "close help")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(self._text(), id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "help · escape closes"

    def _rows(self) -> list[tuple[str, str, str]]:
        from .iso import IsoScreen
        from .main import MainScreen
        from .mismatch import MismatchScreen
        from .sweep import SweepScreen

        rows = []
        for section, bindings in (("main", MainScreen.BINDINGS), ("app", self.app.BINDINGS),
                                  ("iso view", IsoScreen.BINDINGS), ("sweep view", SweepScreen.BINDINGS),
                                  ("mismatch view", MismatchScreen.BINDINGS)):
            for b in bindings:
                if not isinstance(b, Binding) or b.system:
                    continue
                # each key by its own name (the footer's "1-7" display would mislabel the single keys)
                keys = " ".join(self.app.get_key_display(Binding(k, "")) for k in b.key.split(",") if k)
                rows.append((section, keys, b.tooltip or b.description))
        rows.append(("app", self.app.get_key_display(Binding("ctrl+p", "")),
                     "command palette: every action by name"))
        return rows

    def _key_of(self, action: str) -> str:
        from .main import MainScreen

        return next(self.app.get_key_display(Binding(b.key.split(",")[0], "")) for b in MainScreen.BINDINGS
                    if isinstance(b, Binding) and b.action == action)

    def _text(self) -> Table:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        table.add_row(Text("kestrel-tui", style="bold"), Text(ABOUT))
        section = None
        for sec, keys, what in self._rows():
            if sec != section:
                table.add_row("", "")
                table.add_row(Text(sec, style="bold underline"), "")
                section = sec
            table.add_row(Text(keys), Text(what))  # a str cell would be read as markup: "[" is a key
        table.add_row("", "")
        table.add_row(Text("legend", style="bold underline"), "")
        for sym, what, style in LEGEND:
            table.add_row(Text(sym, style=style), Text(what))
        table.add_row("", "")  # after the keys, which are what the screen is opened for
        table.add_row(Text("schedules", style="bold underline"), Text(SCHEDULES.format(key=self._key_of("mismatch"))))
        return table
