"""The Textual app: a small shell around the main screen.

The app only owns what is global — quit, help, the command palette and where
exports go. Runs live in the main screen (screens/main.py) and its parts (parts/); drawing lives in
widgets/; colours and layout in app.tcss.

SIGTERM and SIGHUP quit the app as `q` does (runs cancelled, the terminal
restored), when it runs with ``signals=True`` (app/main.py; tests driving it
leave their own loop's signals alone); then, and on a terminal that hangs up,
the process is gone within moments (app/hangup.py).
"""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.screen import Screen

from .commands import KestrelCommands
from .hangup import driver_class, quit_on_stop_signals
from .screens.help import HelpScreen
from .screens.main import MainScreen
from .source import DiffSource, LiveSource


class KestrelApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "kestrel-tui"
    COMMANDS = App.COMMANDS | {KestrelCommands}
    BINDINGS = [
        Binding("question_mark", "help", "help", tooltip="this help: every key and the legend"),
        Binding("q", "quit", "quit", tooltip="quit (cancels a run in flight)"),
    ]

    SIGNAL_EXIT = 130  # as the headless commands, stopped by a signal or Ctrl-C

    def __init__(self, source: LiveSource | DiffSource, *, export_dir: str | Path = "exports",
                 signals: bool = False) -> None:
        super().__init__()
        self.source = source
        self.export_dir = Path(export_dir)
        self._signals = signals

    def get_driver_class(self):
        return driver_class(super().get_driver_class())

    def on_mount(self) -> None:
        if self._signals:
            quit_on_stop_signals(asyncio.get_running_loop(), self._on_stop_signal, self.SIGNAL_EXIT)

    def _on_stop_signal(self) -> None:
        # the engines' processes run in sessions of their own: the signal reached us alone
        with contextlib.suppress(Exception):
            self.main.cancel_all()
        self.exit(return_code=self.SIGNAL_EXIT)

    def get_default_screen(self) -> Screen:
        return MainScreen(self.source, self.export_dir)

    @property
    def main(self) -> MainScreen:
        return self.screen_stack[0]

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        # stop numerics first: a worker thread would otherwise keep the process alive until its run ends
        self.main.cancel_all()
        self.exit(0)
