"""The Textual app: a small shell around the main screen.

The app only owns what is global — quit, help, the command palette and where
exports go. Everything about runs lives in screens/main.py; drawing lives in
widgets/; colours and layout in app.tcss.
"""
from __future__ import annotations

from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.screen import Screen

from .commands import KestrelCommands
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

    def __init__(self, source: LiveSource | DiffSource, *, export_dir: str | Path = "exports") -> None:
        super().__init__()
        self.source = source
        self.export_dir = Path(export_dir)

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
