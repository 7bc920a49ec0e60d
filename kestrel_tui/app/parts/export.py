"""Export (x): a snapshot of what the screen shows in a new folder (app/export.py): both dumps,
report.json and the SVG screenshot. The screenshot is taken on the UI thread; the files are written
in a worker. The sweep and mismatch views export through export_view and view_export_done."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from textual.binding import Binding

from ..export import final_name, new_export_dir, publish, write_diff, write_live, write_screenshot
from ..messages import WorkerMessage, message
from .base import Host, Part, Phase, one_line


@message
class ExportDone(WorkerMessage):
    path: str | None
    error: BaseException | None = None


def export(folder: Path, svg: str, write: Callable[[], None], post) -> None:
    """Fill an export folder (the screenshot, then `write`) and publish it; ExportDone carries the error, if any.

    On failure the folder keeps its .partial name: whatever was written stays, marked unfinished.
    """
    try:
        write_screenshot(folder, svg)
        write()
        final = publish(folder)
    except Exception as e:  # noqa: BLE001
        post(ExportDone(str(folder), e))
        return
    post(ExportDone(str(final)))


class View(Protocol):
    """A screen with an export of its own (the sweep and mismatch views), as export_view sees it."""
    app: Any  # the KestrelApp: its export_dir and export_screenshot
    exporting: bool
    last_export: Path | None

    def set_status(self, text: str) -> None: ...  # shows outside text inert

    def notify(self, message: str, **kw: Any) -> None: ...

    def run_worker(self, work: Callable[[], None], **kw: Any) -> Any: ...

    def post_message(self, message: Any) -> bool: ...


def export_view(view: View, write: Callable[[Path], None], name: str) -> None:
    """A view's export: a new folder under the app's exports, the screenshot taken now, then `write(folder)`
    and publishing in a thread worker whose ExportDone goes back to the view (view_export_done)."""
    app = view.app
    try:
        folder = new_export_dir(app.export_dir).resolve()  # shown in full: it is where to look
    except OSError as e:
        view.notify(f"{app.export_dir}: {e.strerror or e}", title="export failed", severity="error", markup=False)
        return
    view.exporting = True
    svg = app.export_screenshot()
    view.set_status(f"exporting to {final_name(folder)}…")
    view.run_worker(partial(export, folder, svg, partial(write, folder), view.post_message),
                    thread=True, group="export", name=name, exit_on_error=False)


def view_export_done(view: View, m: ExportDone) -> None:
    view.exporting = False
    if m.error is not None:
        view.set_status(f"export failed: {one_line(m.error)} (the unfinished export is {m.path})")
        view.notify(one_line(m.error), title="export failed", severity="error", markup=False)
        return
    view.last_export = Path(m.path)
    view.set_status(f"exported to {m.path}")
    view.notify(m.path, title="exported", timeout=8, markup=False)


class Export(Part):
    BINDINGS = (Binding("x", "export", "export", tooltip="export a snapshot: both dumps, report.json, SVG,"
                        " in a new folder"),)
    DIFF_MODE = frozenset({"export"})

    def __init__(self, screen: Host) -> None:
        super().__init__(screen)
        self.writing = False

    @property
    def busy(self) -> bool:
        return self.writing

    def action_export(self) -> None:
        s = self.screen
        if self.writing:
            s.notify("an export is being written", severity="warning", markup=False)
            return
        if not s.diff_mode and (s.result is None or s.phase is not Phase.IDLE):
            s.notify("nothing finished to export yet: wait for the run (escape cancels it)",
                     severity="warning", markup=False)
            return
        try:
            folder = new_export_dir(s.export_dir).resolve()  # shown in full: it is where to look
        except OSError as e:
            self.failed_with(f"{s.export_dir}: {e.strerror or e}")
            return
        self.writing = True
        src = s.source
        write = (partial(write_diff, folder, src.path_a, src.path_b, src.a, src.b, s.board.comparison) if s.diff_mode
                 else partial(write_live, folder, s.session, s.result, device=s.info.device, note=s.info.note))
        # A toast is not part of the evidence: hide the toast rack for the frame the screenshot is
        # taken from (the screenshot must come from the UI thread, and before the status says "exporting").
        toasts = s.query("#textual-toastrack")
        toasts.set(display=False)
        s.call_after_refresh(self._shoot, folder, write, toasts)

    def _shoot(self, folder: Path, write: Callable[[], None], toasts) -> None:
        s = self.screen
        try:
            svg = s.app.export_screenshot()
        except Exception as e:  # noqa: BLE001 - a failed export is a message, not a crash
            self.writing = False
            self.failed_with(f"screenshot: {one_line(e)}; the unfinished export is {folder}")
            return
        finally:
            toasts.set(display=True)
        s.status.set_text(f"exporting to {final_name(folder)}…", "busy")
        self.work(lambda: export(folder, svg, write, s.post_message), name="export",
                  description="write an export folder")

    def on_export_done(self, m: ExportDone) -> None:
        s = self.screen
        self.writing = False
        if m.error is not None:
            self.failed_with(f"{one_line(m.error)} (the unfinished export is {m.path})")
            return
        s.last_export = Path(m.path)
        s.status.set_text(f"exported to {m.path}", "ok")
        s.notify(m.path, title="exported", timeout=8, markup=False)

    def failed_with(self, text: str) -> None:
        # the status bar must not keep saying "exported to" an earlier folder
        self.screen.status.set_text(f"export failed: {text}", "error")
        self.screen.notify(text, title="export failed", severity="error", markup=False)
