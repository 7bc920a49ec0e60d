"""Repro (w): a bundle of the key under the cursor (a DIFF; else the first far key) written in a worker:
inputs, outputs, case.json and a numpy-only replay.py, in a new folder under the exports (docs/repro.md)."""
from __future__ import annotations

from pathlib import Path

from textual.binding import Binding

from ...session.session import RunResult, Session
from ...trace.compare import Status, Tolerance
from ..messages import WorkerMessage, message
from .base import Part, Phase, one_line


@message
class BundleWritten(WorkerMessage):
    """A repro bundle was written (line: what and where), or could not be (error)."""
    line: str | None
    error: Exception | None = None


def repro(session: Session, result: RunResult, folder: Path, key: str | None, tol: Tolerance | None,
          post) -> None:
    """A repro bundle of ``key`` (None: the first far key, else the first DIFF) under ``folder``."""
    from ...session.repro import free_folder, write_bundle

    try:
        folder.mkdir(parents=True, exist_ok=True)  # the export folder, as an export makes it
        bundle = write_bundle(session, result, free_folder(folder, key or "first"), key=key, tol=tol)
        post(BundleWritten(bundle.line()))
    except Exception as e:  # noqa: BLE001 - a bundle too large, a key without raw values: a message
        post(BundleWritten(None, e))


class Repro(Part):
    BINDINGS = (Binding("w", "repro", "repro", show=False, tooltip="write a repro bundle of the key under the"
                        " cursor (a DIFF; else the first far key): inputs, outputs, case.json, a numpy-only"
                        " replay.py"),)

    def action_repro(self) -> None:
        s = self.screen
        session, result = s.session, s.result
        if session is None or result is None or s.phase is not Phase.IDLE:
            s.notify("a repro bundle needs a finished run", severity="warning", markup=False)
            return
        key = s.board.key(s.cursor.t, s.cursor.row, s.cursor.col)
        key = key if key is not None and result.comparison.status.get(key) is Status.DIFF else None
        folder, tol = s.export_dir, s.tolerance
        s.status.set_text(f"writing the repro bundle of {key or 'the first far key'}…", "busy")
        self.work(lambda: repro(session, result, folder, key, tol, s.post_message), name="repro",
                  description="write a repro bundle")

    def on_bundle_written(self, m: BundleWritten) -> None:
        s = self.screen
        if m.error is not None:
            text = one_line(m.error)
            s.status.set_text(f"no repro bundle: {text}", "error")
            s.notify(text, title="repro", severity="error", markup=False)
            return
        s.status.set_text(f"repro bundle {m.line}", "ok")
        s.notify(m.line, title="repro", markup=False)
