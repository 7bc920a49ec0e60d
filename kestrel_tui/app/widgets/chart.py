"""A terminal bar chart of one metric over a sweep's values, on a log scale, the changing values marked.

Drift spans many decades (1e-15 from a reordered sum, 1e-2 once a token flips), so the y axis is
log10, one bar per value, eighth-block tops for the fraction of a row. A value whose metric is 0
(every bit equal) gets a dot on the axis instead of a bar: a bar of any height would claim a
difference. A value with no metric (the run failed) gets a cross. Under the labels a ▲ marks each
value where the answer changes. The same chart as an SVG (`chart_svg`) goes into the export.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from ...text import inert
from .style import ComponentStyles

EIGHTHS = " ▁▂▃▄▅▆▇█"
ZERO, MISSING, MARK = "·", "×", "▲"
AXIS_W = 7  # "1e-13 ┤"


@dataclass(frozen=True)
class Point:
    label: str
    y: float | None   # None: no value (the run failed); 0.0: bit-identical
    marked: bool      # the answer changes here


def decades(points: Sequence[Point]) -> tuple[int, int] | None:
    """The log10 range (lo, hi), whole decades, that holds every positive finite y; None: there is none."""
    logs = [math.log10(p.y) for p in points if p.y is not None and 0 < p.y < math.inf]
    if not logs:
        return None
    lo, hi = math.floor(min(logs)), math.ceil(max(logs))
    return (lo, hi) if hi > lo else (lo, lo + 1)


def bar_eighths(y: float, lo: int, hi: int, rows: int) -> int:
    """A positive y's bar height in eighths of a row: at least one eighth, all rows at 10^hi."""
    if y == math.inf:
        return rows * 8
    frac = (math.log10(y) - lo) / (hi - lo)
    return max(1, min(rows * 8, round(frac * rows * 8)))


LABEL_W = 12  # a value's label is clipped to this many characters (a profile's toggle value may be long)


def _axis_label(exp: int) -> str:
    return f"1e{exp}"


def _label(text: str) -> str:
    s = inert(text, 4 * LABEL_W)
    return s if len(s) <= LABEL_W else s[:LABEL_W - 1] + "…"


class Chart(ComponentStyles, Widget, can_focus=False):
    COMPONENT_CLASSES = {"chart--title", "chart--axis", "chart--bar", "chart--zero", "chart--missing",
                         "chart--mark"}

    def __init__(self, title: str = "", *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title
        self.points: tuple[Point, ...] = ()

    def show(self, points: Sequence[Point], title: str | None = None) -> None:
        self.points = tuple(points)
        if title is not None:
            self.title = title
        self.refresh()

    def render(self) -> Text:
        out = Text(no_wrap=True, overflow="crop")
        out.append(inert(self.title), style=self.style_of("chart--title"))
        if any(p.marked for p in self.points):
            out.append(f"  {MARK} the answer changes", style=self.style_of("chart--mark"))
        rows = max(1, self.size.height - 4)  # title, axis, labels, marks
        for line in chart_lines(self.points, rows):
            out.append("\n")
            for piece, kind in line:
                out.append(piece, style=self.style_of(f"chart--{kind}") if kind else Style())
        return out


def axis_labels(span: tuple[int, int], rows: int) -> dict[int, int]:
    """row -> the decade labelled there: the top and the bottom, and between them every decade that
    keeps two rows clear of the labels already placed."""
    lo, hi = span
    placed: dict[int, int] = {}
    for exp in (hi, lo, *range(hi - 1, lo, -1)):
        row = max(1, math.ceil((exp - lo) / (hi - lo) * rows))
        if all(abs(row - r) > 2 for r in placed):
            placed[row] = exp
    return placed


def chart_lines(points: Sequence[Point], rows: int) -> list[list[tuple[str, str]]]:
    """The chart under its title as lines of (text, kind) pieces, kind naming a component class ("" plain):
    ``rows`` rows of bars, the axis, the values' labels, the change marks."""
    labels = [_label(p.label) for p in points]
    width = max([3, *(len(s) for s in labels)]) + 1
    span = decades(points)
    marks = axis_labels(span, rows) if span is not None else {}
    lines: list[list[tuple[str, str]]] = []
    for r in range(rows, 0, -1):  # r: the row's height above the axis, top first
        label = _axis_label(marks[r]) if r in marks else ""
        line = [(f"{label:>{AXIS_W - 2}} ┤", "axis")]
        for p in points:
            cell = " "
            if span is not None and p.y is not None and p.y > 0:
                left = bar_eighths(p.y, *span, rows) - (r - 1) * 8
                cell = EIGHTHS[max(0, min(8, left))]
            line.append((cell.center(width - 1) + " ", "bar"))
        lines.append(line)
    axis = [(f"{'0':>{AXIS_W - 2}} ┼", "axis")]
    for p in points:
        sym, kind = (MISSING, "missing") if p.y is None else (ZERO, "zero") if p.y == 0 else ("─", "axis")
        before = (width - 2) // 2
        axis += [("─" * before, "axis"), (sym, kind), ("─" * (width - 1 - before), "axis")]
    lines.append(axis)
    lines.append([(" " * AXIS_W, "")] + [(s.center(width - 1) + " ", "mark" if p.marked else "")
                                         for s, p in zip(labels, points)])
    lines.append([(" " * AXIS_W, "")] + [((MARK if p.marked else " ").center(width - 1) + " ", "mark")
                                         for p in points])
    return lines


def chart_svg(title: str, points: Sequence[Point], *, width: int = 640, height: int = 320) -> str:
    """The chart as a standalone SVG: log-scale bars, a dot for 0, a cross for none, ▲ at the changes."""
    left, right, top, bottom = 70, 20, 40, 60
    plot_w, plot_h = width - left - right, height - top - bottom
    n = max(1, len(points))
    step = plot_w / n
    span = decades(points)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
             f'<text x="{left}" y="20" font-size="14">{escape(inert(title))}</text>',
             f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#444"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#444"/>']
    if span is not None:
        lo, hi = span
        for exp in range(lo, hi + 1):
            y = top + plot_h - (exp - lo) / (hi - lo) * plot_h
            parts.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
            parts.append(f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">{_axis_label(exp)}</text>')
    for i, p in enumerate(points):
        cx = left + step * (i + 0.5)
        base = top + plot_h
        if p.y is None:
            parts.append(f'<text x="{cx:.1f}" y="{base - 4}" text-anchor="middle" fill="#b00">{MISSING}</text>')
        elif p.y == 0 or span is None:
            parts.append(f'<circle cx="{cx:.1f}" cy="{base}" r="3" fill="#2a2"/>')
        else:
            h = bar_eighths(p.y, *span, 64) / (64 * 8) * plot_h
            colour = "#c33" if p.marked else "#d88"
            parts.append(f'<rect x="{cx - step * 0.35:.1f}" y="{base - h:.1f}" width="{step * 0.7:.1f}" '
                         f'height="{h:.1f}" fill="{colour}"/>')
        weight = ' font-weight="bold"' if p.marked else ""
        parts.append(f'<text x="{cx:.1f}" y="{base + 18}" text-anchor="middle"{weight}>'
                     f'{escape(_label(p.label))}</text>')
        if p.marked:
            parts.append(f'<text x="{cx:.1f}" y="{base + 36}" text-anchor="middle" fill="#c33">{MARK}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
