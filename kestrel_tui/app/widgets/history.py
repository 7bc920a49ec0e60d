"""History of runs: what changed -> where the first DIFF moved (`+expf  t24_l0_attn -> t57_l0_attn`).

It draws the newest entries that fit, newest last, so a bisection's moves scroll
in as they happen without a scrollbar to chase.
"""
from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widget import Widget

from ...session.session import HistoryEntry
from .style import ComponentStyles


CHANGE_W = 14


def entry_text(e: HistoryEntry) -> tuple[str, str, str | None]:
    """(change, before, after) as shown; the first run has nothing to move from."""
    if e.change == "start":
        return "start", "", e.after
    change = e.change
    if len(change) > CHANGE_W:  # "a" after "0": seven ops at once; the keys matter more than the list
        signs = {c[0] if c[0] in "+-" else "switch" for c in e.changes}
        n = len(e.changes)
        change = f"{signs.pop()}{n} ops" if len(signs) == 1 and signs <= {"+", "-"} else f"{n} changes"
    return change, e.before or "all ok", e.after


class HistoryPanel(ComponentStyles, Widget, can_focus=False):
    COMPONENT_CLASSES = {"history--change", "history--diff", "history--ok", "history--dim"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.entries: Sequence[HistoryEntry] = ()

    def show(self, entries: Sequence[HistoryEntry]) -> None:
        self.entries = list(entries)
        self.refresh()

    def render(self) -> Text:
        if not self.entries:
            return Text("no runs yet", style=self.style_of("history--dim"))
        shown = self.entries[-max(1, self.size.height):]
        w = min(CHANGE_W, max(len(entry_text(e)[0]) for e in shown))
        lines = []
        for e in shown:
            change, before, after = entry_text(e)
            line = Text(f"{change:<{w}} ", style=self.style_of("history--change"))
            if before:
                line.append(before, style=self.style_of("history--diff" if before != "all ok" else "history--ok"))
                line.append(" -> ", style=self.style_of("history--dim"))
            else:
                line.append("first DIFF ", style=self.style_of("history--dim"))
            line.append(after or "all ok", style=self.style_of("history--diff" if after else "history--ok"))
            lines.append(line)
        out = Text("\n").join(lines)
        out.no_wrap, out.overflow = True, "ellipsis"
        return out
