"""The rank filter (R): in a tensor- or expert-parallel run, a sharded key's cell shows one rank's share
(all ranks → rank 0 → rank 1 …); the detail panel lists every rank's."""
from __future__ import annotations

from textual.binding import Binding

from ...session.session import RunResult
from ...trace.compare import Status
from ...trace.ranks import compare_shares, world_size
from .base import Part


def rank_statuses(result: RunResult, rank: int) -> dict[str, Status]:
    """Each sharded DIFF or ok key's status for one rank's share (a partial sum's share: its key's)."""
    out = {}
    for key, st in result.comparison.status.items():
        if st not in (Status.DIFF, Status.OK):
            continue
        report = compare_shares(result.ref, result.sub, key)
        if report and rank < len(report) and report[rank].status in ("ok", "DIFF"):
            out[key] = Status.OK if report[rank].status == "ok" else Status.DIFF
    return out


class Ranks(Part):
    BINDINGS = (Binding("R", "rank", "rank", show=False, tooltip="rank filter: a sharded key's cell shows one"
                        " rank's share (all ranks → rank 0 → rank 1 …); the detail panel lists every rank's"),)
    DIFF_MODE = frozenset({"rank"})  # says that two dump files have no ranks

    def action_rank(self) -> None:
        s = self.screen
        board, result = s.board, s.result
        n = max(world_size(result.sub) or 0, world_size(result.ref) or 0) if result is not None else 0
        if board is None or not n:
            s.notify("no ranks: this run is not tensor- or expert-parallel (hf-dist, a serving engine's dump)",
                     markup=False)
            return
        board.rank = None if board.rank is not None and board.rank + 1 >= n else (
            0 if board.rank is None else board.rank + 1)
        board.rank_status = {} if board.rank is None else rank_statuses(result, board.rank)
        board.version += 1
        shown = "all ranks" if board.rank is None else f"rank {board.rank} of {n}"
        s.title_grid(shown)
        s.status.set_text(f"rank filter: {shown} ({len(board.rank_status)} sharded keys)", "")
        s.refresh_all()
