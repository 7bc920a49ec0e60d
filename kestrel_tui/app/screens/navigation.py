"""Cursor moves over the hash grid, for MainScreen (a mixin: it uses the screen's
board, cursor, follow flag, grid and detail refresh)."""
from __future__ import annotations

from ..state import Cursor
from ..widgets.tokens import TokenStrip


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
        self._refresh_detail()

    def _goto(self, key: str, keep_follow: bool = False) -> None:
        c = self.board.locate(key) if self.board else None
        if c is not None:
            self._set_cursor(Cursor(c.t, c.row, self.cursor.col if c.col < 0 else c.col), keep_follow)

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
        self._goto(first)
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
            self._goto(key)
