"""Cursor moves over the hash grid, for MainScreen (a mixin: it uses the screen's
board, cursor, follow flag, grid and detail refresh)."""
from __future__ import annotations

from textual.binding import Binding

from ..state import Cursor
from ..widgets.tokens import TokenStrip

DIFFS = Binding.Group("DIFF")
TOKEN = Binding.Group("token")

NAVIGATION = (
    Binding("up,k", "move(-1, 0)", "up", show=False, tooltip="previous row (layer)"),
    Binding("down,j", "move(1, 0)", "down", show=False, tooltip="next row (layer)"),
    Binding("left,h", "move(0, -1)", "left", show=False, tooltip="previous field"),
    Binding("right,l", "move(0, 1)", "right", show=False, tooltip="next field"),
    Binding("pageup", "move(-10, 0)", "10 rows up", show=False),
    Binding("pagedown", "move(10, 0)", "10 rows down", show=False),
    Binding("f", "first_diff", "first", tooltip="jump to the first DIFF and follow it across runs"),
    Binding("n", "next_diff(True)", "next", group=DIFFS, tooltip="jump to the next DIFF (dataflow order)"),
    Binding("N", "next_diff(False)", "prev", group=DIFFS, tooltip="jump to the previous DIFF (dataflow order)"),
    Binding("left_square_bracket", "token(-1)", "prev", group=TOKEN, key_display="[", show=False,
            tooltip="previous token position"),
    Binding("right_square_bracket", "token(1)", "next", group=TOKEN, key_display="]", show=False,
            tooltip="next token position"),
)


class GridNavigation:
    def _set_cursor(self, c: Cursor, keep_follow: bool = False) -> None:
        board = self.board
        if board is None:
            return
        t = min(max(0, c.t), board.n_positions - 1)
        row = min(max(0, c.row), len(board.rows) - 1)
        col = min(max(0, c.col), max(0, len(board.fields) - 1))
        self.cursor = Cursor(t, row, col)
        if not keep_follow:
            self.follow = False
        self.grid.set_cursor(self.cursor)
        self.query_one(TokenStrip).show(board, t)
        self.refresh_detail()

    def goto(self, key: str, keep_follow: bool = False) -> None:
        c = self.board.locate(key) if self.board else None
        if c is not None:
            self._set_cursor(Cursor(c.t, c.row, self.cursor.col if c.col < 0 else c.col), keep_follow)

    def home(self) -> None:
        """The cursor on the first row below emb of the first position."""
        self._set_cursor(Cursor(0, 1, 0))

    def action_move(self, drow: int, dcol: int) -> None:
        c = self.cursor
        if dcol and self.board and self.grid._single(c.row):
            dcol = 0  # emb/logits rows hold one key: left/right has nowhere to go
        self._set_cursor(Cursor(c.t, c.row + drow, c.col + dcol))

    def action_token(self, dt: int) -> None:
        c = self.cursor
        self._set_cursor(Cursor(c.t + dt, c.row, c.col))

    def action_first_diff(self) -> None:
        board = self.board
        first = board and (board.first_diff or board.first_mismatch)
        if not first:
            self.notify("no DIFF" + (" so far" if self.busy else ": all keys agree"), markup=False)
            return
        self.goto(first)
        self.follow = True

    def action_next_diff(self, forward: bool) -> None:
        board = self.board
        if board is None:
            return
        key = board.step_mismatch(board.key(self.cursor.t, self.cursor.row, self.cursor.col), forward)
        # keys outside the grid (foreign tags) have no cell to go to: step over them
        for _ in board.mismatches:
            if key is None or board.locate(key) is not None:
                break
            key = board.step_mismatch(key, forward)
        if key is None:
            self.notify("no DIFF" + (" so far" if self.busy else ""), markup=False)
        elif board.locate(key) is None:
            self.notify("no DIFF in the grid (only keys outside it)", markup=False)
        else:
            self.goto(key)
