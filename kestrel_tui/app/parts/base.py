"""What a part of the main screen is, and the one interface of the screen that parts use.

A part is one feature of the main screen (the decode, the settings keys, tolerance, bisect, graft,
repro, export, ranks, loading): it owns its keys (BINDINGS, and the action_* methods they name), starts
its thread worker and handles the messages that worker posts (methods named as Textual names handlers,
on_<message>). The screen (screens/main.py) composes the parts: its bindings are theirs, it routes each
action and each worker message to the part that has it, and it holds the state they share (Host).

A worker runs the engines off the UI thread: it checks its cancel event (the engine stops at the next
position), holds the screen's run lock so that a cancelled run has left before the next one decodes,
and reports only by posting messages tagged with its run id; a failure becomes a message too, and the
app stays usable.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Protocol

from textual.binding import Binding

from ...session.session import RunResult, RunSettings, Session
from ...trace.compare import Tolerance
from ..messages import RunMessage
from ..source import DiffSource, Loaded, LiveSource
from ..state import Board, Cursor
from ..widgets.grid import HashGrid
from ..widgets.status import StatusBar


class Phase(StrEnum):
    """What the main screen is doing. In a running phase one part's worker holds the session: the decode
    (reference, running), bisect (bisecting) or graft (grafting); escape cancels it."""
    LOADING = "loading"
    REFERENCE = "reference"  # the first run: the reference is computed, then the subject
    RUNNING = "running"
    BISECTING = "bisecting"
    GRAFTING = "grafting"
    IDLE = "idle"
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def running(self) -> bool:
        return self in (Phase.REFERENCE, Phase.RUNNING, Phase.BISECTING, Phase.GRAFTING)

    @property
    def busy(self) -> bool:
        return self.running or self is Phase.LOADING


class Host(Protocol):
    """The main screen as its parts see it: the state they share and what they do with it."""
    source: LiveSource | DiffSource
    diff_mode: bool
    export_dir: Path
    last_export: Path | None
    session: Session | None
    info: Loaded | None
    board: Board | None
    settings: RunSettings
    result: RunResult | None  # the last finished run
    cursor: Cursor
    follow: bool  # the cursor tracks the first DIFF until the user moves it
    phase: Phase
    run_lock: threading.Lock  # held by whichever worker runs the session

    @property
    def status(self) -> StatusBar: ...
    @property
    def grid(self) -> HashGrid: ...
    @property
    def tolerance(self) -> Tolerance | None: ...
    @property
    def busy(self) -> bool: ...
    @property
    def run_id(self) -> int: ...  # the current run's: messages of any other are stale
    @property
    def holder(self) -> Part | None: ...  # the part whose worker holds the session in this phase
    def begin(self, phase: Phase) -> tuple[int, threading.Event]: ...
    def current(self, m: RunMessage) -> bool: ...
    def cancel_all(self) -> None: ...
    def start_run(self) -> None: ...
    def no_model(self) -> None: ...  # says that a key needs a model
    def goto(self, key: str, keep_follow: bool = False) -> None: ...
    def home(self) -> None: ...
    def refresh_all(self) -> None: ...
    def refresh_detail(self) -> None: ...
    def show_header(self) -> None: ...
    def show_toggles(self, first: str | None) -> None: ...
    def title_grid(self, note: str | None = None) -> None: ...
    # Textual's own, used as they are
    def notify(self, message: str, **kw: Any) -> None: ...
    def post_message(self, message: Any) -> bool: ...
    def run_worker(self, work: Callable[[], None], **kw: Any) -> Any: ...
    def query_one(self, selector: Any, expect_type: Any = None) -> Any: ...
    def query(self, selector: Any) -> Any: ...
    def call_after_refresh(self, callback: Callable[..., Any], *args: Any) -> bool: ...
    @property
    def app(self) -> Any: ...


class Part:
    """One feature of the main screen; `screen` is the screen as every part sees it."""
    BINDINGS: ClassVar[tuple[Binding, ...]] = ()
    DIFF_MODE: ClassVar[frozenset[str]] = frozenset()  # its actions that still work over two dump files
    PHASES: ClassVar[tuple[Phase, ...]] = ()  # the phases in which its worker holds the session
    COMMANDS: ClassVar[tuple[tuple[str, str, str], ...]] = ()  # (title, help, action): palette-only actions

    def __init__(self, screen: Host) -> None:
        self.screen = screen

    @classmethod
    def actions(cls) -> frozenset[str]:
        return frozenset(name[len("action_"):] for name in dir(cls) if name.startswith("action_"))

    @classmethod
    def live_actions(cls) -> frozenset[str]:
        """Its actions that need a model: diff mode hides them."""
        return cls.actions() - cls.DIFF_MODE

    @property
    def busy(self) -> bool:
        """A worker of its own is still at work (outside the phase: an export, a judgement)."""
        return False

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool:
        return True

    def superseded(self) -> None:
        """A new run took the session: whatever this part had in flight is stale."""

    def cancelled(self) -> str:
        """Its run was cancelled (it held the session): undo what it changed; the status line."""
        return "cancelled"

    def failed(self) -> None:
        """Its run failed (it held the session): undo what it changed."""

    def work(self, body: Callable[[], None], *, name: str, description: str, group: str | None = None,
             exclusive: bool = False) -> None:
        """Run `body` in a thread worker of the screen (described: Textual describes a worker by
        repr(work) otherwise, and a RunResult's repr prints every raw buffer)."""
        self.screen.run_worker(body, thread=True, group=group or name, name=name, description=description,
                               exclusive=exclusive, exit_on_error=False)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
