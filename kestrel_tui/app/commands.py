"""Command palette (ctrl+p): every action of the main screen by name, via a Textual Provider.

The list comes from the main screen's bindings (plus the palette-only ones), so
a new key is in the palette without further work.
"""
from __future__ import annotations

from functools import partial

from rich.markup import escape
from textual.command import DiscoveryHit, Hit, Hits, Provider


class KestrelCommands(Provider):
    def _commands(self) -> list[tuple[str, str, str]]:
        from .screens.main import MainScreen

        screen = self.screen
        if not isinstance(screen, MainScreen):
            return []
        # Textual's own provider already offers Quit, Keys, Theme and Screenshot
        return screen.palette_commands() + [("Help: every key and the legend", "key ?", "app.help")]

    def _run(self, action: str) -> None:
        # "app.help" runs on the app, anything else on the main screen
        self.screen.call_later(self.screen.run_action, action)

    async def discover(self) -> Hits:
        for title, help_text, action in self._commands():
            # the palette reads help as markup; key names such as "[" must stay literal
            yield DiscoveryHit(title, partial(self._run, action), help=escape(help_text))

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in self._commands():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self._run, action), help=escape(help_text))
