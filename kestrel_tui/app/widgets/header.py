"""One header line: model, reference and subject backends, device; plus a note line
when the subject is not what was asked for (no GPU -> sim)."""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from ...text import inert

PART_LIMIT = 200  # characters of one header part


class InfoHeader(Widget, can_focus=False):
    COMPONENT_CLASSES = {"header--title", "header--dim", "header--note"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.parts: list[tuple[str, str]] = [("", "loading…")]
        self.note: str | None = None

    def show(self, parts: list[tuple[str, str]], note: str | None = None) -> None:
        """parts: (label, value) pairs, e.g. ("model", "synthetic ..."), drawn left to right."""
        self.parts, self.note = parts, note
        self.set_class(bool(note), "-with-note")  # TCSS gives the header a second line for the note
        self.refresh(layout=True)

    def render(self) -> Text:
        dim = self.get_component_rich_style("header--dim", partial=True)
        out = Text("kestrel-tui", style=self.get_component_rich_style("header--title", partial=True))
        for label, value in self.parts:
            out.append(" │ ", style=dim)
            if label:
                out.append(f"{label} ", style=dim)
            out.append(inert(value, PART_LIMIT))  # a model's or engine's own name: outside text
        if self.note:
            out.append("\n")
            out.append(f"note: {inert(self.note, 4 * PART_LIMIT)}", style=self.get_component_rich_style("header--note", partial=True))
        out.no_wrap, out.overflow = True, "ellipsis"
        return out
