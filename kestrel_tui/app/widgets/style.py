"""The one way the panels look up their colours: a component class's style, as app.tcss sets it."""
from __future__ import annotations

from rich.style import Style


class ComponentStyles:
    """For a Widget that draws Rich text in its COMPONENT_CLASSES' styles."""

    def style_of(self, name: str) -> Style:
        return self.get_component_rich_style(name, partial=True)
