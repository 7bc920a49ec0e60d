"""The keys that change the run's settings: the subject's toggles (1-9), all exact (a), all fast (0) and
the switches (m, p, t). A change takes effect at once: it reruns, cancelling the run in flight."""
from __future__ import annotations

from dataclasses import replace

from textual.binding import Binding

from ...session.session import RunSettings
from ..widgets.toggles import SWITCHES, TOGGLE_KEYS
from .base import Part


def _toggle_binding(i: int) -> Binding:
    # the footer shows one "1-9 toggle" entry for all nine keys; keys past the subject's toggles are off
    return Binding(TOGGLE_KEYS[i], f"toggle({i})", "toggle", show=i == 0,
                   key_display=f"1-{len(TOGGLE_KEYS)}" if i == 0 else TOGGLE_KEYS[i],
                   tooltip=f"switch the subject's toggle {i + 1} (fast/exact, or its next value); reruns at once")


class Settings(Part):
    BINDINGS = (
        *(_toggle_binding(i) for i in range(len(TOGGLE_KEYS))),
        Binding("a", "all_exact", "all exact", show=False, tooltip="switch every op to exact"),
        Binding("0", "all_fast", "all fast", show=False, tooltip="switch every op to fast"),
        *(Binding(key, f"switch('{name}')", f"{name}", show=False, tooltip=f"switch {name}: {' / '.join(vals)}")
          for key, name, vals in SWITCHES),
    )

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool:
        session = self.screen.session
        if action == "toggle" and parameters and session is not None:
            return int(parameters[0]) < len(session.toggles)  # keys past the subject's toggles are off
        return True

    def action_toggle(self, index: int) -> None:
        session = self.screen.session
        if session is None:
            self.screen.no_model()
            return
        if index >= len(session.toggles):
            return
        t = session.toggles[index]
        settings = self.screen.settings
        cur = settings.value(t)
        if t.binary and len(t.values) == 2:  # exact <-> its plain value
            self._change(settings.pick(t, t.fast if cur == t.exact else t.exact))
        else:
            self._change(settings.pick(t, t.values[(t.values.index(cur) + 1) % len(t.values)]))

    def action_all_exact(self) -> None:
        session = self.screen.session
        if session is None:
            self.screen.no_model()
            return
        self._change(replace(self.screen.settings, exact=frozenset(session.binary_toggles)))

    def action_all_fast(self) -> None:
        self._change(replace(self.screen.settings, exact=frozenset()))

    def action_switch(self, name: str) -> None:
        values = next(vals for _, n, vals in SWITCHES if n == name)
        cur = getattr(self.screen.settings, name)
        self._change(replace(self.screen.settings, **{name: values[(values.index(cur) + 1) % len(values)]}))

    def _change(self, settings: RunSettings) -> None:
        if self.screen.session is None:
            self.screen.no_model()
            return
        self.screen.settings = settings
        self.screen.start_run()  # a change reruns by itself, cancelling the run in flight
