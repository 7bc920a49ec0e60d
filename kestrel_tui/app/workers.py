"""The app's thread workers: engine work off the UI thread.

Each body runs in a Textual thread worker, checks its cancel event (the engine
stops at the next position), holds the run lock so a cancelled run has left
before the next one decodes, and reports only by posting messages tagged with
its run id — the screen drops whatever a superseded run still posts. A failure
becomes a message too: the app shows it and stays usable.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from ..session.bisect import bisect
from ..session.graft import graft
from ..trace.run import Cancelled
from ..session.session import RunResult, RunSettings, Session
from ..engines.base import EngineFailed
from ..trace.compare import Tolerance
from . import messages as msg
from .export import publish, write_diff, write_live, write_screenshot
from .source import Loader

Post = Callable[[object], object]


def load(loader: Loader, post: Post) -> None:
    try:
        info = loader(lambda step: post(msg.LoadProgress(step)))
    except Exception as e:  # noqa: BLE001 - any load failure is shown, the app stays up
        post(msg.LoadFailed(e))
        return
    post(msg.SessionLoaded(info))


def decode(session: Session, settings: RunSettings, run_id: int, cancel: threading.Event,
           lock: threading.Lock, post: Post) -> None:
    """The reference (computed once per session), then the subject, position by position."""
    with lock:  # the previous (cancelled) run leaves within one position
        try:
            if cancel.is_set():
                raise Cancelled()
            ref = session.reference(on_position=lambda p: post(msg.ReferenceProgress(run_id, p.t + 1)),
                                    cancel=cancel)
            post(msg.ReferenceReady(run_id, ref))
            result = session.run(settings, cancel=cancel,
                                 on_position=lambda p, st: post(msg.PositionDone(run_id, p, st)))
            result.events  # found here, off the UI thread: the status line and the panel name them
            post(msg.RunDone(run_id, result))
        except Cancelled:
            post(msg.RunCancelled(run_id))
        except Exception as e:  # noqa: BLE001 - shown in the app; the app stays usable
            post(msg.RunFailed(run_id, e))


def bisection(session: Session, start: RunSettings, run_id: int, cancel: threading.Event,
              lock: threading.Lock, post: Post) -> None:
    """Switch owners of the first DIFF to exact until all ok; each move is posted."""
    with lock:
        try:
            if cancel.is_set():
                raise Cancelled()
            ref = session.reference(cancel=cancel)
            post(msg.ReferenceReady(run_id, ref))
            outcome = bisect(session, start, on_move=lambda mv: post(msg.BisectMove(run_id, mv)), cancel=cancel)
            if outcome.failed is not None:  # a crashed trial is no verdict: shown as the run failing, by name
                why = outcome.failure_line(session.binary_toggles)
                post(msg.RunFailed(run_id, EngineFailed(f"bisect stopped: {why}")))
                return
            post(msg.BisectDone(run_id, outcome, session.last))
        except Cancelled:
            post(msg.RunCancelled(run_id))
        except Exception as e:  # noqa: BLE001
            post(msg.RunFailed(run_id, e))


def grafting(session: Session, settings: RunSettings, tol: Tolerance | None, run_id: int, cancel: threading.Event,
             lock: threading.Lock, post: Post) -> None:
    """The cause test from the first far key (the first DIFF without a tolerance); each source is posted."""
    with lock:
        try:
            if cancel.is_set():
                raise Cancelled()
            outcome = graft(session, settings, tol=tol, on_source=lambda s: post(msg.GraftSource(run_id, s)),
                            cancel=cancel)
            post(msg.GraftDone(run_id, outcome))
        except Cancelled:
            post(msg.RunCancelled(run_id))
        except Exception as e:  # noqa: BLE001 - a subject that cannot graft, a failed trial: shown in the app
            post(msg.RunFailed(run_id, e))


def repro(session: Session, result: RunResult, folder: Path, key: str | None, tol: Tolerance | None,
          post: Post) -> None:
    """A repro bundle of ``key`` (None: the first far key, else the first DIFF) under ``folder``."""
    from ..session.repro import free_folder, write_bundle

    try:
        folder.mkdir(parents=True, exist_ok=True)  # the export folder, as an export makes it
        bundle = write_bundle(session, result, free_folder(folder, key or "first"), key=key, tol=tol)
        post(msg.BundleWritten(bundle.line()))
    except Exception as e:  # noqa: BLE001 - a bundle too large, a key without raw values: a message
        post(msg.BundleWritten(None, e))


def judge(result: RunResult, tol: Tolerance, run_id: int, post: Post) -> None:
    """Judge a finished run's DIFF keys against a tolerance (NMSE/ULP/rel. err over every DIFF key's
    raw buffers: ~0.4 s on the default model's 32 positions the first time, cached per key after)."""
    try:
        summary = result.tolerance(tol)
    except Exception as e:  # noqa: BLE001 - shown in the app; the plain DIFF view stays
        post(msg.ToleranceReady(run_id, tol, None, e))
        return
    post(msg.ToleranceReady(run_id, tol, summary))


def export(folder: Path, svg: str, write: Callable[[], None], post: Post) -> None:
    """Fill an export folder (the screenshot, then `write`) and publish it; ExportDone carries the error, if any.

    On failure the folder keeps its .partial name: whatever was written stays, marked unfinished.
    """
    try:
        write_screenshot(folder, svg)
        write()
        final = publish(folder)
    except Exception as e:  # noqa: BLE001
        post(msg.ExportDone(str(folder), e))
        return
    post(msg.ExportDone(str(final)))


def export_live(folder: Path, session: Session, result, device: str, note: str | None) -> Callable[[], None]:
    return lambda: write_live(folder, session, result, device=device, note=note)


def export_diff(folder: Path, src, cmp) -> Callable[[], None]:
    return lambda: write_diff(folder, src.path_a, src.path_b, src.a, src.b, cmp)
