"""Messages the worker threads post to the main screen.

Every run-related message carries the run id it belongs to: a cancelled run may
still deliver a position or two after the next one started, and the screen
drops anything whose id is not the current one.
"""
from __future__ import annotations

from textual.message import Message

from ..session.bisect import BisectResult
from ..session.graft import GraftResult, Source
from ..trace.run import Position, Trace
from ..session.session import HistoryEntry, RunResult, ToleranceSummary
from ..trace.compare import Status, Tolerance
from .source import Loaded


class SessionLoaded(Message):
    def __init__(self, info: Loaded) -> None:
        super().__init__()
        self.info = info


class LoadProgress(Message):
    def __init__(self, step) -> None:  # model.progress.LoadStep
        super().__init__()
        self.step = step


class LoadFailed(Message):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


class RunMessage(Message):
    def __init__(self, run_id: int) -> None:
        super().__init__()
        self.run_id = run_id


class ReferenceProgress(RunMessage):
    def __init__(self, run_id: int, done: int) -> None:
        super().__init__(run_id)
        self.done = done


class ReferenceReady(RunMessage):
    def __init__(self, run_id: int, ref: Trace) -> None:
        super().__init__(run_id)
        self.ref = ref


class PositionDone(RunMessage):
    def __init__(self, run_id: int, pos: Position, statuses: dict[str, Status]) -> None:
        super().__init__(run_id)
        self.pos = pos
        self.statuses = statuses


class RunDone(RunMessage):
    def __init__(self, run_id: int, result: RunResult) -> None:
        super().__init__(run_id)
        self.result = result


class RunCancelled(RunMessage):
    pass


class RunFailed(RunMessage):
    def __init__(self, run_id: int, error: BaseException) -> None:
        super().__init__(run_id)
        self.error = error


class BisectMove(RunMessage):
    def __init__(self, run_id: int, move: HistoryEntry) -> None:
        super().__init__(run_id)
        self.move = move


class BisectDone(RunMessage):
    def __init__(self, run_id: int, outcome: BisectResult, result: RunResult) -> None:
        super().__init__(run_id)
        self.outcome = outcome
        self.result = result


class GraftSource(RunMessage):
    def __init__(self, run_id: int, source: Source) -> None:
        super().__init__(run_id)
        self.source = source


class GraftDone(RunMessage):
    def __init__(self, run_id: int, outcome: GraftResult) -> None:
        super().__init__(run_id)
        self.outcome = outcome


class BundleWritten(Message):
    """A repro bundle was written (line: what and where), or could not be (error)."""
    def __init__(self, line: str | None, error: Exception | None = None) -> None:
        super().__init__()
        self.line, self.error = line, error


class ToleranceReady(RunMessage):
    """A finished run's DIFF keys judged against one tolerance (the screen drops it if either changed)."""
    def __init__(self, run_id: int, tol: Tolerance, summary: ToleranceSummary | None,
                 error: BaseException | None = None) -> None:
        super().__init__(run_id)
        self.tol = tol
        self.summary = summary
        self.error = error


class ExportDone(Message):
    def __init__(self, path: str | None, error: BaseException | None = None) -> None:
        super().__init__()
        self.path = path
        self.error = error
