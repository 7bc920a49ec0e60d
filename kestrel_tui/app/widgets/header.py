"""One header line: model, reference and subject backends, device; plus a note line
when the subject is not what was asked for (no GPU -> sim)."""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from ...session.session import RunResult
from ...text import inert
from ...trace.ranks import world_size
from ..source import Loaded
from .style import ComponentStyles

PART_LIMIT = 200  # characters of one header part


class InfoHeader(ComponentStyles, Widget, can_focus=False):
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

    def show_session(self, info: Loaded, result: RunResult | None) -> None:
        """A loaded session, and the ranks each side of its last run had (a parallel run)."""
        s = info.session
        # most telling first: at 80 columns the tail is cut
        ref = f"{s.reference_engine.name} (cached)" if s.reference_cached else s.reference_engine.name
        parts = [("", f"{ref} vs {s.subject}"), ("model", info.model_label), ("device", info.device),
                 ("positions", f"{len(s.prompt)} prompt + {s.n_tokens}")]
        if result is not None:
            sizes = [(side, world_size(t)) for side, t in (("ref", result.ref), ("sub", result.sub))]
            ranks = " · ".join(f"{side} {n}" for side, n in sizes if n)
            if ranks:
                parts.insert(1, ("ranks", ranks))
        self.show(parts, info.note)

    def render(self) -> Text:
        dim = self.style_of("header--dim")
        out = Text("kestrel-tui", style=self.style_of("header--title"))
        for label, value in self.parts:
            out.append(" │ ", style=dim)
            if label:
                out.append(f"{label} ", style=dim)
            out.append(inert(value, PART_LIMIT))  # a model's or engine's own name: outside text
        if self.note:
            out.append("\n")
            out.append(f"note: {inert(self.note, 4 * PART_LIMIT)}", style=self.style_of("header--note"))
        out.no_wrap, out.overflow = True, "ellipsis"
        return out
