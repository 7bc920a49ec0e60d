"""The hash grid for one position: rows emb, L0..Ln, logits x the field columns.

A Line API widget (ScrollView + render_line): only the visible rows are drawn,
each from a handful of segments, so a 48-layer grid redraws in well under a
millisecond whatever the number of positions. The header row and the row
labels stay put while the cells scroll (deep mode has 17 columns).
Colours come from component classes in app.tcss.
"""
from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ...trace.compare import CLOSE, FAR, Status
from ..messages import message
from ..state import Board, Cursor
from .style import ComponentStyles

LABEL_W = 7  # "logits" + the first-DIFF marker
CELL_W = 5  # "knorm", "qrope" and "DIFF" fit; one blank column between cells
STEP = CELL_W + 1

_CLASS = {
    Status.OK: "grid--ok",
    Status.DIFF: "grid--diff",
    Status.PENDING: "grid--pending",
    Status.MISSING_SUB: "grid--missing",
    Status.MISSING_REF: "grid--missing",
}

_VERDICT_CLASS = {CLOSE: "grid--close", FAR: "grid--far"}


def cell_text(status: Status | None, sides: tuple[str, str], verdict: str | None = None) -> str:
    """verdict: "close" | "far" for a DIFF key judged under a tolerance (Board.verdict)."""
    if status is None:
        return ""
    if status is Status.OK:
        return "ok"
    if status is Status.DIFF:
        return verdict or "DIFF"
    if status is Status.PENDING:
        return "·"
    # a key one side lacks: name the side that lacks it, so it never reads as a DIFF
    return "-" + (sides[1] if status is Status.MISSING_SUB else sides[0])[:3]


def position_label(t: int) -> str:
    """t<n> in the label column; a long one keeps its last digits, which tell neighbours apart."""
    text = f"t{t}"
    return (text if len(text) <= LABEL_W else "…" + text[-(LABEL_W - 1):]).ljust(LABEL_W)


class HashGrid(ComponentStyles, ScrollView, can_focus=False):
    """Navigation keys live on the screen; the grid only draws and reports clicks."""

    COMPONENT_CLASSES = {
        "grid--header", "grid--label", "grid--label-cursor", "grid--ok", "grid--diff", "grid--first",
        "grid--pending", "grid--missing", "grid--cursor", "grid--marker", "grid--close", "grid--far",
    }

    @message
    class CellClicked(Message):
        row: int
        col: int | None  # None: no field column (the label): the cursor keeps its column

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.board: Board | None = None
        self.cursor = Cursor(0, 0, 0)
        self._lines: dict[tuple, Strip] = {}

    # ---- state -----------------------------------------------------------

    def set_board(self, board: Board | None) -> None:
        self.board = board
        if board is None:
            self.virtual_size = Size(0, 0)
        else:
            self.virtual_size = Size(LABEL_W + len(board.fields) * STEP, len(board.rows) + 1)
        self.refresh()

    def set_cursor(self, cursor: Cursor) -> None:
        self.cursor = cursor
        self._scroll_to_cursor()
        self.refresh()

    def _scroll_to_cursor(self) -> None:
        # the header row is sticky, so only height-1 rows scroll
        if self.board is None:
            return
        rows = max(1, self.scrollable_content_region.height - 1)
        y = self.scroll_offset.y
        r = self.cursor.row
        if r < y:
            y = r
        elif r >= y + rows:
            y = r - rows + 1
        cols_w = max(1, self.scrollable_content_region.width - LABEL_W)
        x = self.scroll_offset.x
        cx = (0 if self._single(r) else self.cursor.col) * STEP
        if cx < x:
            x = cx
        elif cx + CELL_W > x + cols_w:
            x = cx + CELL_W - cols_w
        self.scroll_to(x=x, y=y, animate=False, immediate=True)

    def on_resize(self) -> None:
        self._scroll_to_cursor()

    def _single(self, row: int) -> bool:
        """emb and logits rows hold one key each, drawn in the first column."""
        return self.board is not None and (row == 0 or row == self.board.n_layers + 1)

    # ---- drawing ---------------------------------------------------------
    #
    # A frame asks for every visible line; building a Strip is the costly part
    # (each one carries its own caches), so a line is one segment list and one
    # Strip, styles are looked up once per theme, and finished lines are kept
    # in a small cache keyed by everything they show: moving the cursor within
    # a position redraws two lines, the rest come from the cache.

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._kstyles = None
        self._lines.clear()

    _kstyles: dict[str, Style] | None = None

    @property
    def _st(self) -> dict[str, Style]:
        if self._kstyles is None:
            st = {name: self.style_of(name) for name in self.COMPONENT_CLASSES}
            st["base"] = self.rich_style
            st["none"] = Style()
            self._kstyles = st
        return self._kstyles

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        board = self.board
        if board is None:
            return Strip.blank(width, self.rich_style)
        row = -1 if y == 0 else self.scroll_offset.y + y - 1
        if row >= len(board.rows):
            return Strip.blank(width, self._st["base"])
        cur = self.cursor
        on_row = row == cur.row or row == -1
        ck = (row, cur.t, cur.col if on_row else None, cur.row if row == -1 else None, board.version,
              board.first_diff, self.scroll_offset.x, width)
        strip = self._lines.get(ck)
        if strip is None:
            if len(self._lines) > 512:
                self._lines.clear()
            strip = self._header(width) if row == -1 else self._row(row, width)
            self._lines[ck] = strip
        return strip

    def _finish(self, label: list[Segment], cells: list[Segment], width: int) -> Strip:
        x = self.scroll_offset.x
        if x:
            cells = list(Strip(cells).crop(x, x + max(0, width - LABEL_W)))
        base = self._st["base"]
        segs = [Segment(t, base + s if s else base) for t, s, _ in label + cells]
        used = sum(len(t) for t, _, _ in segs)
        if used < width:
            segs.append(Segment(" " * (width - used), base))
        return Strip(segs).crop(0, width) if used > width else Strip(segs, width)

    def _header(self, width: int) -> Strip:
        board, cur, st = self.board, self.cursor, self._st
        head = st["grid--header"]
        hot = head + st["grid--label-cursor"]
        label = [Segment(position_label(board.positions[cur.t]), hot)]
        cells: list[Segment] = []
        single = self._single(cur.row)
        for c, f in enumerate(board.fields):
            cells.append(Segment(f[:CELL_W].center(CELL_W), hot if c == cur.col and not single else head))
            cells.append(Segment(" "))
        return self._finish(label, cells, width)

    def _row(self, row: int, width: int) -> Strip:
        board, cur, st = self.board, self.cursor, self._st
        t = cur.t
        first = board.first_diff
        is_cursor_row = row == cur.row
        marker = " "
        cells: list[Segment] = []
        n = 1 if self._single(row) else len(board.fields)
        sides = board.sides
        for c in range(n):
            key = board.key(t, row, c)
            status = board.cell(key, t)
            verdict = board.verdict(key) if status is Status.DIFF else None
            style = st[_VERDICT_CLASS[verdict] if verdict else _CLASS[status]] if status is not None else st["none"]
            if key == first and key is not None:
                style = style + st["grid--first"]
                marker = "▶"
            if is_cursor_row and (c == cur.col or n == 1):
                style = style + st["grid--cursor"]
            cells.append(Segment(cell_text(status, sides, verdict).center(CELL_W), style))
            cells.append(Segment(" "))
        lab = st["grid--label"] + st["grid--label-cursor"] if is_cursor_row else st["grid--label"]
        label = [Segment(board.rows[row].ljust(LABEL_W - 1), lab),
                 Segment(marker, st["grid--marker"] if marker != " " else lab)]
        return self._finish(label, cells, width)

    # ---- mouse -----------------------------------------------------------

    def on_click(self, event: Click) -> None:
        if self.board is None:
            return
        offset = event.get_content_offset(self)
        if offset is None or offset.y == 0:
            return
        row = self.scroll_offset.y + offset.y - 1
        if row >= len(self.board.rows):
            return
        col = None
        if offset.x >= LABEL_W:
            col = (offset.x - LABEL_W + self.scroll_offset.x) // STEP
            col = col if col < len(self.board.fields) else None
        self.post_message(self.CellClicked(row, col))
