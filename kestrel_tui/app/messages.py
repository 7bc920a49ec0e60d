"""What the app's thread workers post, as dataclasses; the messages every run on the session may post.

Each feature's own messages live with it (app/parts/): a part's worker posts them, the main screen hands
each to the part's handler. The ones here are shared: any worker that holds the session (a decode, a
bisection, a graft) may post them. Every run-related message carries the run id it belongs to: a
cancelled run may still deliver a position or two after the next one started, and the screen drops
anything whose id is not the current one.
"""
from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from ..trace.run import Trace

# A message is a dataclass (Textual calls its __post_init__): fields in order, compared by identity
# (the fields hold whole runs), and its repr is Textual's, which prints no field: a RunResult's repr
# would print every raw buffer.
message = dataclass(eq=False, repr=False)


@message
class WorkerMessage(Message):
    """Posted by a thread worker of the main screen, which hands it to the part with its handler."""


@message
class RunMessage(WorkerMessage):
    run_id: int


@message
class ReferenceReady(RunMessage):
    ref: Trace


@message
class RunCancelled(RunMessage):
    pass


@message
class RunFailed(RunMessage):
    error: BaseException
