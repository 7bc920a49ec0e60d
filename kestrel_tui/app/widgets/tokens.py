"""The token strip: one cell per position, and a line about the current one.

A cell is a glyph as well as a colour (ok ✓, DIFF ✗, top-1 flip !, pending ·,
missing ?), so the strip still reads without colour. Prompt positions sit on
a shaded background left of a bar, generated ones plain right of it. With more
positions than fit, the strip shows a window around the current position.
Cells are the board's slots (the positions present, which a dump may number
t0, t1000000000, ...); the line above names the real position.
"""
from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from ..state import Board
from .style import ComponentStyles

GLYPH = {"ok": "✓", "diff": "✗", "flip": "!", "pending": "·", "missing": "?"}
CELL = 2  # glyph + a space


class TokenStrip(ComponentStyles, Widget, can_focus=False):
    COMPONENT_CLASSES = {
        "tokens--ok", "tokens--diff", "tokens--flip", "tokens--pending", "tokens--missing",
        "tokens--prompt", "tokens--cursor", "tokens--first", "tokens--info", "tokens--dim",
    }

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.board: Board | None = None
        self.t = 0  # the cursor's slot

    def show(self, board: Board | None, t: int) -> None:
        self.board, self.t = board, t
        self.refresh()

    def render(self) -> Text:
        board = self.board
        if board is None:
            return Text("")
        # one line each, clipped rather than wrapped: the strip has a fixed height
        out = Text("\n").join([self._info(board), self._cells(board)])
        out.no_wrap, out.overflow = True, "ellipsis"
        return out

    def _info(self, board: Board) -> Text:
        t = self.t
        kind = {True: "prompt", False: "generated", None: "position"}[board.is_prompt(t)]
        out = Text(f"t{board.positions[t]} ", style=self.style_of("tokens--info"))
        out.append(f"{kind} {t + 1}/{board.n_positions}", style=self.style_of("tokens--dim"))
        state = board.position_state(t)
        top = board.top1[t]
        if top is not None:
            a, b = board.sides
            out.append(f"  top-1 {a} {top[0]} / {b} {top[1]}")
            if top[0] != top[1]:
                out.append("  FLIP", style=self.style_of("tokens--flip"))
        if state == "pending":
            out.append("  pending", style=self.style_of("tokens--pending"))
        else:
            n, m = board.n_diff[t], board.n_missing[t]
            out.append(f"  {n} DIFF", style=self.style_of("tokens--diff") if n else self.style_of("tokens--dim"))
            if m:
                out.append(f"  {m} missing", style=self.style_of("tokens--missing"))
        if board.prompt_len is not None:
            out.append(f"   prompt 0-{board.prompt_len - 1} | generated {board.prompt_len}-"
                       f"{board.n_positions - 1}", style=self.style_of("tokens--dim"))
        return out

    def _cells(self, board: Board) -> Text:
        width = max(CELL, self.size.width)
        n = board.n_positions
        fits = max(1, (width - 4) // CELL)  # room for the '‹' '›' clip marks and the prompt bar
        start = 0 if n <= fits else min(max(0, self.t - fits // 2), n - fits)
        stop = min(n, start + fits)
        # a foreign first DIFF (a tag that is no probe key) has no cell to mark
        first = board.locate(board.first_diff) if board.first_diff else None
        first_t = first.t if first else None
        out = Text("‹" if start > 0 else " ", style=self.style_of("tokens--dim"))
        for t in range(start, stop):
            if board.prompt_len is not None and board.positions[t] == board.prompt_len and t > start:
                out.append("│", style=self.style_of("tokens--dim"))
            state = board.position_state(t)
            style = self.style_of(f"tokens--{state}")
            if board.is_prompt(t):
                style += self.style_of("tokens--prompt")
            if t == first_t:
                style += self.style_of("tokens--first")
            if t == self.t:
                style += self.style_of("tokens--cursor")
            out.append(GLYPH[state], style=style)
            out.append(" ", style=self.style_of("tokens--prompt")
                       if board.is_prompt(t) and board.positions[t] + 1 != board.prompt_len else Style())
        if stop < n:
            out.append("›", style=self.style_of("tokens--dim"))
        return out
