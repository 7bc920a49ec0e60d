"""The toggles panel: each op (fast/exact) with its key, and the run switches.

It shows the settings the user asked for, which take effect at once: a toggle
reruns by itself. Fast ops that can originate the current first DIFF (the
ownership table bisection follows) are marked, so the next key to try is on screen.
With two lines or fewer (an 80x24 terminal) it draws a compact form.
"""
from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from ...backends.toggles import TOGGLES
from ...engine.session import RunSettings

TOGGLE_KEYS = tuple(str(i + 1) for i in range(len(TOGGLES)))  # 1..7 in TOGGLES order
SWITCHES = (("m", "mode", ("chain", "isolate")),
            ("p", "prefill", ("reference", "subject")),
            ("t", "forcing", ("teacher", "free")))
SHORT = {"attention": "attn", "kvquant": "kvq"}


class TogglePanel(Widget, can_focus=False):
    COMPONENT_CLASSES = {"toggles--key", "toggles--exact", "toggles--fast", "toggles--owner", "toggles--dim"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.settings = RunSettings()
        self.owners: tuple[str, ...] = ()
        self.enabled = True

    def show(self, settings: RunSettings, owners: tuple[str, ...] = (), enabled: bool = True) -> None:
        self.settings, self.owners, self.enabled = settings, owners, enabled
        self.refresh()

    def _s(self, name: str) -> Style:
        return self.get_component_rich_style(name, partial=True)

    def render(self) -> Text:
        if not self.enabled:
            out = Text("no model: toggles are off (diff mode or load error)", style=self._s("toggles--dim"))
        elif self.size.height <= 2:
            out = self._compact()
        else:
            out = self._full()
        out.no_wrap, out.overflow = True, "ellipsis"
        return out

    def _full(self) -> Text:
        lines = []
        for key, op in zip(TOGGLE_KEYS, TOGGLES):
            on = op in self.settings.exact
            line = Text.assemble((f" {key} ", self._s("toggles--key")), f" {op:<10}")
            line.append("exact" if on else "fast ", style=self._s("toggles--exact" if on else "toggles--fast"))
            if op in self.owners and not on:
                line.append("  ◂ may own first DIFF", style=self._s("toggles--owner"))
            lines.append(line)
        lines.append(Text.assemble((" a ", self._s("toggles--key")), " all exact  ",
                                   (" 0 ", self._s("toggles--key")), " all fast"))
        for key, name, _ in SWITCHES:
            lines.append(Text.assemble((f" {key} ", self._s("toggles--key")),
                                       f" {name:<10}{getattr(self.settings, name)}"))
        return Text("\n").join(lines)

    def _compact(self) -> Text:
        ops = Text()
        for key, op in zip(TOGGLE_KEYS, TOGGLES):
            on = op in self.settings.exact
            style = self._s("toggles--exact" if on else "toggles--fast")
            if op in self.owners and not on:
                style += self._s("toggles--owner")
            ops.append(key, style=self._s("toggles--key"))
            ops.append(f"{SHORT.get(op, op)}{'=' if on else '~'} ", style=style)
        sw = Text(" ")
        for key, name, _ in SWITCHES:
            sw.append(key, style=self._s("toggles--key"))
            sw.append(f" {name} {getattr(self.settings, name)}  ")
        if self.size.height <= 1:
            return ops + sw
        legend = Text("  (= exact, ~ fast)", style=self._s("toggles--dim"))
        return Text("\n").join([ops + legend, sw])
