"""The toggles panel: the subject's toggles with their keys, and the run switches.

It shows the settings the user asked for, which take effect at once: a toggle
reruns by itself. A binary toggle reads its current value (fast/exact for the
built-in ops, sdpa/eager for hf...); a list toggle its value and how many it
has. Toggles at their default value that can originate the current first DIFF
(the ownership bisection follows) are marked, so the next key to try is on
screen. With two lines or fewer (an 80x24 terminal) it draws a compact form.
"""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from ...session.session import RunSettings
from ...engines.base import Toggle
from ...engines.builtin import OP_TOGGLES
from .style import ComponentStyles

TOGGLE_KEYS = tuple(str(i + 1) for i in range(9))  # 1..9: the subject's toggles in its order
SWITCHES = (("m", "mode", ("chain", "isolate")),
            ("p", "prefill", ("reference", "subject")),
            ("t", "forcing", ("teacher", "free")))
SHORT = {"attention": "attn", "kvquant": "kvq", "attn_implementation": "attn", "deterministic": "determ"}


class TogglePanel(ComponentStyles, Widget, can_focus=False):
    COMPONENT_CLASSES = {"toggles--key", "toggles--exact", "toggles--fast", "toggles--owner", "toggles--dim"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.settings = RunSettings()
        self.owners: tuple[str, ...] = ()
        self.toggles: tuple[Toggle, ...] = OP_TOGGLES
        self.enabled = True

    def show(self, settings: RunSettings, owners: tuple[str, ...] = (), enabled: bool = True,
             toggles: tuple[Toggle, ...] | None = None) -> None:
        self.settings, self.owners, self.enabled = settings, owners, enabled
        if toggles is not None:
            self.toggles = toggles[:len(TOGGLE_KEYS)]
        self.refresh()

    def render(self) -> Text:
        if not self.enabled:
            out = Text("no model: toggles are off (diff mode or load error)", style=self.style_of("toggles--dim"))
        elif self.size.height <= 2:
            out = self._compact()
        else:
            out = self._full()
        out.no_wrap, out.overflow = True, "ellipsis"
        return out

    def _state(self, t: Toggle) -> tuple[str, bool]:
        """(value shown, whether it reads as switched: exact, or a list toggle off its default)."""
        value = self.settings.value(t)
        return value, (value == t.exact if t.binary else value != t.default)

    def _full(self) -> Text:
        lines = []
        width = max([10, *(len(t.name) + 1 for t in self.toggles)])
        value_width = max([0, *(len(v) for t in self.toggles if t.binary for v in t.values)])
        for key, t in zip(TOGGLE_KEYS, self.toggles):
            value, on = self._state(t)
            line = Text.assemble((f" {key} ", self.style_of("toggles--key")), f" {t.name:<{width}}")
            shown = f"{value:<{value_width}}" if t.binary else value
            line.append(shown, style=self.style_of("toggles--exact" if on else "toggles--fast"))
            if not t.binary:
                line.append(f" ({t.values.index(value) + 1}/{len(t.values)})", style=self.style_of("toggles--dim"))
            if t.name in self.owners and not on:
                line.append("  ◂ may own first DIFF", style=self.style_of("toggles--owner"))
            lines.append(line)
        if not self.toggles:
            lines.append(Text(" (the subject has no toggles)", style=self.style_of("toggles--dim")))
        lines.append(Text.assemble((" a ", self.style_of("toggles--key")), " all exact  ",
                                   (" 0 ", self.style_of("toggles--key")), " all fast"))
        for key, name, _ in SWITCHES:
            lines.append(Text.assemble((f" {key} ", self.style_of("toggles--key")),
                                       f" {name:<{width}}{getattr(self.settings, name)}"))
        return Text("\n").join(lines)

    def _compact(self) -> Text:
        ops = Text()
        for key, t in zip(TOGGLE_KEYS, self.toggles):
            value, on = self._state(t)
            style = self.style_of("toggles--exact" if on else "toggles--fast")
            if t.name in self.owners and not on:
                style += self.style_of("toggles--owner")
            ops.append(key, style=self.style_of("toggles--key"))
            mark = ("=" if on else "~") if t.binary else f":{value}"
            ops.append(f"{SHORT.get(t.name, t.name)}{mark} ", style=style)
        sw = Text(" ")
        for key, name, _ in SWITCHES:
            sw.append(key, style=self.style_of("toggles--key"))
            sw.append(f" {name} {getattr(self.settings, name)}  ")
        if self.size.height <= 1:
            return ops + sw
        legend = Text("  (= exact, ~ fast)", style=self.style_of("toggles--dim"))
        return Text("\n").join([ops + legend, sw])
