"""The histogram of a run's log-ratios (trace/logprobs.py's bins), one row a bin, the clip bands marked.

A bin lies wholly inside or wholly outside each clip band (the bands' edges are histogram edges), so
each bin has one kind: the bin of 0 (the two log-probabilities bitwise equal), inside every band,
outside the narrowest band only, outside every band, and NaN. A kind has a glyph as well as a colour
(nothing relies on colour alone). The same histogram as an SVG (`histogram_svg`) goes into the export:
the bands as shaded rows, their edges as labelled lines.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from rich.text import Text
from textual.widget import Widget

from ...text import inert
from ...trace.logprobs import CLIP_BANDS, EDGES, bin_labels
from .style import ComponentStyles

BLOCKS = " ▏▎▍▌▋▊▉█"  # eighths of a cell, for the tip of a bar
# kind -> (glyph, what it means); the kinds in the order the legend lists them
KINDS = {"bitwise": ("=", "bitwise equal"), "inside": (" ", "inside every clip band"),
         "narrow": ("›", "outside [{narrow}]"), "wide": ("»", "outside [{wide}] too"), "nan": ("?", "NaN")}
LABEL_W, COUNT_W = 18, 7


def _band_text(band: tuple[float, float]) -> str:
    return f"{band[0]:g}, {band[1]:g}"


def _bands_by_width() -> list[tuple[float, float]]:
    return sorted(CLIP_BANDS, key=lambda b: b[1] - b[0])


def meaning(kind: str) -> str:
    narrow, wide = _bands_by_width()[0], _bands_by_width()[-1]
    return KINDS[kind][1].format(narrow=_band_text(narrow), wide=_band_text(wide))


def bin_spans() -> list[tuple[float, float]]:
    """Each bin's log-ratio interval (lo, hi) in bin_labels() order: (0, 0) for the bin of 0 alone,
    (nan, nan) for NaN; the ends run to -inf and inf."""
    z = EDGES.index(0.0)
    below = [(-math.inf, EDGES[0]), *zip(EDGES[:z], EDGES[1:z + 1])]
    above = [(0.0, EDGES[z + 1]), *zip(EDGES[z + 1:], EDGES[z + 2:]), (EDGES[-1], math.inf)]
    return [*below, (0.0, 0.0), *above, (math.nan, math.nan)]


def representative(span: tuple[float, float]) -> float:
    """A log-ratio that falls in the bin: its middle, or one past its finite edge where it is unbounded."""
    lo, hi = span
    if math.isnan(lo) or lo == hi:
        return lo
    if lo == -math.inf:
        return hi - 1.0
    if hi == math.inf:
        return lo + 1.0
    return (lo + hi) / 2


def bands_outside(log_ratio: float) -> int:
    """How many clip bands the ratio exp(log_ratio) lies outside (NaN: all of them)."""
    r = math.exp(log_ratio) if not math.isnan(log_ratio) else math.nan
    return sum(1 for lo, hi in CLIP_BANDS if not (lo <= r <= hi))


def kind_of(span: tuple[float, float]) -> str:
    x = representative(span)
    if math.isnan(x):
        return "nan"
    if span == (0.0, 0.0):
        return "bitwise"
    n = bands_outside(x)
    return "inside" if n == 0 else "wide" if n == len(CLIP_BANDS) else "narrow"


@dataclass(frozen=True)
class Bin:
    label: str
    count: int
    kind: str


def histogram_bins(counts: Sequence[int]) -> list[Bin]:
    """A tally's histogram (MismatchTally.histogram) as labelled, classified bins."""
    return [Bin(label, int(n), kind_of(span)) for label, n, span in zip(bin_labels(), counts, bin_spans())]


def edge_rows() -> list[tuple[float, int]]:
    """(band edge value r, the bin row whose top is log r), for every clip band's edge, low to high."""
    spans = bin_spans()
    edges = sorted(v for band in CLIP_BANDS for v in band)
    return [(v, next(i for i, (lo, _) in enumerate(spans) if lo == math.log(v))) for v in edges]


def bar_eighths(count: int, most: int, width: int) -> int:
    """A count's bar length in eighths of a cell: at least one eighth when it is not 0."""
    if count <= 0 or most <= 0:
        return 0
    return max(1, round(count / most * width * 8))


def bar_text(eighths: int) -> str:
    return "█" * (eighths // 8) + (BLOCKS[eighths % 8] if eighths % 8 else "")


class Histogram(ComponentStyles, Widget, can_focus=False):
    COMPONENT_CLASSES = {f"histogram--{k}" for k in KINDS} | {"histogram--axis"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.bins: tuple[Bin, ...] = ()

    def show(self, bins: Sequence[Bin]) -> None:
        self.bins = tuple(bins)
        self.refresh()

    def render(self) -> Text:
        out = Text(no_wrap=True, overflow="crop")
        total = sum(b.count for b in self.bins)
        most = max((b.count for b in self.bins), default=0)
        width = max(1, self.size.width - LABEL_W - COUNT_W - 12)
        for i, b in enumerate(self.bins):
            if i:
                out.append("\n")
            style = self.style_of(f"histogram--{b.kind}")
            share = f"{b.count / total:6.1%}" if total else "     —"
            out.append(f"{KINDS[b.kind][0]} {b.label:>{LABEL_W}} ", style=style)
            out.append(f"{b.count:>{COUNT_W}} {share} ", style=self.style_of("histogram--axis"))
            out.append(bar_text(bar_eighths(b.count, most, width)), style=style)
        for i, kind in enumerate(k for k in KINDS if k != "inside"):  # the legend, two a line
            out.append("\n" if i % 2 == 0 else "   ")
            out.append(f"{KINDS[kind][0]} {meaning(kind)}", style=self.style_of(f"histogram--{kind}"))
        return out


# ---- the export's SVG

FILL = {"bitwise": "#2a9d2a", "inside": "#6b8fbf", "narrow": "#e0a030", "wide": "#c83232", "nan": "#777777"}
BAND_SHADE = ("#f3f3f3", "#e4ecf6")  # widest band first: the narrower one is drawn over it


def histogram_svg(title: str, bins: Sequence[Bin], *, width: int = 760) -> str:
    """The histogram as a standalone SVG: a bar per bin (class "bar", its label and count as data-*
    attributes), the clip bands as shaded rows, each band edge a line of class "band-edge"."""
    left, label_w, count_w, right, top, row_h = 20, 170, 60, 30, 64, 20
    bar_x = left + label_w + count_w
    bar_w = width - bar_x - right
    height = top + row_h * len(bins) + 40
    most = max((b.count for b in bins), default=0)
    spans = bin_spans()
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
             f'<text x="{left}" y="22" font-size="14">{escape(inert(title))}</text>']
    x = left
    for kind in KINDS:  # the legend: a swatch and its meaning
        text = meaning(kind)
        parts.append(f'<rect class="legend" x="{x}" y="34" width="10" height="10" fill="{FILL[kind]}"/>')
        parts.append(f'<text x="{x + 14}" y="43">{escape(text)}</text>')
        x += 14 + 7.3 * len(text) + 16
    for shade, band in zip(BAND_SHADE, sorted(CLIP_BANDS, key=lambda b: b[0] - b[1])):
        inside = [i for i, s in enumerate(spans) if not math.isnan(s[0]) and
                  band[0] <= math.exp(representative(s)) <= band[1]]
        y0, y1 = top + row_h * min(inside), top + row_h * (max(inside) + 1)
        parts.append(f'<rect class="band" data-band={quoteattr(_band_text(band))} x="{left}" y="{y0}" '
                     f'width="{width - left - right + 20}" height="{y1 - y0}" fill="{shade}"/>')
        parts.append(f'<text x="{width - 8}" y="{y1 - 4}" text-anchor="end" fill="#555">'
                     f'ratio in [{_band_text(band)}]</text>')
    for v, row in edge_rows():
        y = top + row_h * row
        parts.append(f'<line class="band-edge" data-ratio="{v:g}" data-log-ratio="{math.log(v)!r}" x1="{left}" '
                     f'y1="{y}" x2="{width - right + 20}" y2="{y}" stroke="#555" stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{bar_x + bar_w - 4}" y="{y - 3}" text-anchor="end" fill="#555">'
                     f'log {v:g} = {math.log(v):.4f}</text>')
    for i, b in enumerate(bins):
        y = top + row_h * i
        w = bar_eighths(b.count, most, 512) / (512 * 8) * bar_w
        parts.append(f'<text x="{left}" y="{y + 14}">{escape(KINDS[b.kind][0])}</text>')
        parts.append(f'<text x="{left + label_w - 6}" y="{y + 14}" text-anchor="end">{escape(b.label)}</text>')
        parts.append(f'<text x="{bar_x - 6}" y="{y + 14}" text-anchor="end">{b.count}</text>')
        parts.append(f'<rect class="bar bar-{b.kind}" data-bin={quoteattr(b.label)} data-count="{b.count}" '
                     f'x="{bar_x}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" fill="{FILL[b.kind]}"/>')
    parts.append(f'<text x="{left}" y="{height - 14}" fill="#555">log-ratio = log p_subject - log p_reference'
                 f' of the reference\'s tokens; ratio r = exp(log-ratio)</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
