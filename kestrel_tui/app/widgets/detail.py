"""Detail of the key under the cursor: both hashes, shape and dtype, DIFF statistics
and a ULP-distance histogram drawn with block characters.

Statistics need both raw buffers (the live session keeps them; dump files have
hashes only). They are computed when the cursor lands on a key — a few
microseconds for the default model, a few milliseconds for a 152k-entry
logits row — and cached per (run, key), so redraws are free. The histogram
lists the buckets that hold elements (0, 1, 2, 3-4, 5-8, ... ULP); bars scale
to the panel's width at draw time. With a tolerance on (key T), a DIFF key also
shows its NMSE, max rel. err and max ULP and its close/far verdict, read from
the engine's ToleranceSummary on the board (computed in a worker, not here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from rich.text import Text
from textual.widget import Widget

from ...backends.toggles import OWNERS, TOGGLES
from ...trace.compare import NAN_ULP, DiffStats, KeyMetrics, Status, diff_stats, ulp_bin_labels, ulp_histogram
from ...model.quant import CodeFlips, q8_0_code_flips
from ...trace.events import event_before
from ...trace.ranks import compare_shares, line as rank_line
from ...trace.keys import GEMV_INPUT, key_name, parse_key
from .style import ComponentStyles

BIN_LABELS = ulp_bin_labels()
EIGHTHS = " ▏▎▍▌▋▊▉"


@dataclass
class KeyInfo:
    key: str
    status: Status | None
    first: bool
    hash_a: int | None
    hash_b: int | None
    sides: tuple[str, str]
    shape: tuple | None = None
    dtype: str | None = None
    stats: DiffStats | None = None
    hist: list[int] | None = None
    raw_note: str | None = None
    metrics: KeyMetrics | None = None   # NMSE, max rel. err, max ULP: a DIFF key under a tolerance
    verdict: str | None = None          # "close" | "far" under `tol`
    tol: str | None = None              # the tolerance's spec, e.g. "nmse=1e-07"
    rule: str | None = None             # the per-key rule that judged it, "logits: nmse=1e-05" (None: no rules)
    event: str | None = None            # the discrete event at this key (an expert flip, a top-1 flip's margin)
    after: str | None = None            # the event a DIFF key follows (trace/events.event_before)
    ranks: str | None = None            # each rank's share held against the reference (trace/ranks.py)
    first_far: bool = False
    q8_input: str | None = None         # a q4_0 GEMV's input key, when this key is such a GEMV's output
    q8: CodeFlips | None = None         # where that input's q8_0 codes differ (None: all equal)


def key_info(board, key: str | None, t: int) -> KeyInfo | None:
    """Everything the panel shows for one key (the numerics part runs here, once per key)."""
    if board is None or key is None:
        return None
    status = board.cell(key, t)
    a_hash, b_hash = board.hashes(key)
    info = KeyInfo(key, status, key == board.first_diff, a_hash, b_hash, board.sides)
    events = getattr(board, "events", ())  # a board the tests make by hand may have neither
    if status is Status.DIFF and events:
        own = next((e for e in events if e.key == key), None)
        cause = event_before(events, key)
        info.event = own.line if own else None
        info.after = cause.line if cause is not None and cause is not own else None
    traces = getattr(board, "traces", None)
    if traces is not None and status in (Status.DIFF, Status.OK):
        report = compare_shares(*traces, key)
        info.ranks = rank_line(report) if report else None
    summary = board.tolerance
    if summary is not None and status is Status.DIFF:  # computed by the engine in a worker (workers.judge)
        info.metrics, info.verdict = summary.metrics.get(key), summary.verdict.get(key)
        info.tol, info.first_far = summary.tolerance.spec(), key == summary.first_far
        if summary.tolerance.rules and key in summary.rule:  # the rule that judged this key, by name
            info.rule = f"{summary.rule[key]}: {summary.criteria(key).spec()}"
    a, b = board.raw_ref(key), board.raw_sub(key)
    if a is None and b is None:
        info.raw_note = "hashes only (no raw buffers)" if not board.live else None
        return info
    shown = a if a is not None else b
    info.shape, info.dtype = tuple(shown.shape), str(shown.dtype)
    if status is Status.DIFF and a is not None and b is not None:
        try:
            info.stats = diff_stats(a, b)
            info.hist = ulp_histogram(a, b)
        except ValueError as e:  # shape or dtype differs between the sides
            info.raw_note = str(e)
        _q8_input(board, key, info)
    return info


def _q8_input(board, key: str, info: KeyInfo) -> None:
    """For the output of a q4_0 GEMV: do both sides' q8_0 activation codes agree? (A 1-ULP input
    difference that crosses a rounding boundary is the usual start of a far key.)"""
    if not getattr(board, "q8_inputs", False):
        return
    try:
        k = parse_key(key)
    except ValueError:
        return
    src = GEMV_INPUT.get(k.field)
    if src is None or k.layer is None:
        return
    name = key_name(k.t, k.layer, src)
    a, b = board.raw_ref(name), board.raw_sub(name)
    if a is None or b is None:
        return
    info.q8_input, info.q8 = name, q8_0_code_flips(a, b)


def _differ(n: int, what: str) -> str:
    return f"1 {what} differs" if n == 1 else f"{n} {what}s differ"


def _bar(frac: float, width: int) -> str:
    cells = frac * width
    full = int(cells)
    part = int((cells - full) * 8)
    return ("█" * full + (EIGHTHS[part] if part and full < width else "")).ljust(width)


def _num(x, dtype: str | None) -> str:
    """The shortest text that round-trips in the buffer's own dtype: 1-ULP neighbours never print alike."""
    if isinstance(x, float) and dtype in ("float32", "float16"):
        return str(getattr(np, dtype)(x))
    return str(x)


def _builtin_owners(field_name: str) -> str:
    return " ".join(f"{o}[{TOGGLES.index(o) + 1}]" for o in OWNERS.get(field_name, ()))


class DetailPanel(ComponentStyles, Widget, can_focus=False):
    COMPONENT_CLASSES = {"detail--key", "detail--ok", "detail--diff", "detail--missing", "detail--pending",
                         "detail--dim", "detail--bar", "detail--first", "detail--close", "detail--far"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.info: KeyInfo | None = None
        self.message: str = ""
        # field -> the toggles that may own a DIFF there, with their keys ("norm[1]"); the screen sets the
        # subject's (diff mode keeps the built-in table: the dumps may well come from the built-ins)
        self.owner_label: Callable[[str], str] = _builtin_owners

    def show(self, info: KeyInfo | None, message: str = "") -> None:
        self.info, self.message = info, message
        self.refresh()

    def render(self) -> Text:
        info = self.info
        if info is None:
            return Text(self.message, style=self.style_of("detail--dim"))
        compact = self.size.height <= 5  # 80x24: four lines, no histogram
        width = self.size.width
        lines = [self._head(info, compact)]
        hashes = [Text.assemble((f"{side} ", self.style_of("detail--dim")), f"{h:016x}" if h is not None else "—")
                  for side, h in zip(info.sides, (info.hash_a, info.hash_b))]
        if compact or width >= 41:  # both hashes on one line leaves more rows for the histogram
            lines.append(Text(" ").join(hashes))
        else:
            lines.extend(hashes)
        if not compact:
            meta = self._meta(info)
            if meta:
                lines.append(meta)
        if info.raw_note:
            lines.append(Text(info.raw_note, style=self.style_of("detail--dim")))
        if info.metrics is not None:
            lines.append(self._metrics(info))
        s = info.stats
        if s is not None:
            ulp = "NaN" if s.max_ulp == NAN_ULP else str(s.max_ulp)
            lines.append(Text(f"differ {s.n_diff}/{s.n} · max {ulp} ULP · |Δ| {s.max_abs_err:.3g}"))
            if s.n_nan and not compact:
                lines.append(Text(f"{s.n_nan} differing pairs involve NaN"))
            lines.append(Text(f"first [{s.first_index}] {_num(s.first_a, info.dtype)} vs "
                              f"{_num(s.first_b, info.dtype)}"))
        if info.q8_input is not None:
            lines.append(self._q8_line(info))
        if info.ranks:
            lines.append(Text(info.ranks))
        if info.event:
            lines.append(Text(info.event, style=self.style_of("detail--far")))
        if info.after:
            lines.append(Text.assemble(("after ", self.style_of("detail--dim")), info.after))
        if info.hist is not None:
            if compact:
                # the histogram as one line of bucket:count pairs
                lines[-1].append("  ULP " + " ".join(f"{BIN_LABELS[i]}:{n}" for i, n in enumerate(info.hist) if n),
                                 style=self.style_of("detail--dim"))
            else:
                lines.append(Text("ULP distance  elements", style=self.style_of("detail--dim")))
                lines.extend(self._histogram(info.hist, max(20, width)))
        out = Text("\n").join(lines)
        out.no_wrap, out.overflow = True, "ellipsis"
        return out

    def _q8_line(self, info: KeyInfo) -> Text:
        f, src = info.q8, parse_key(info.q8_input).field
        if f is None:
            return Text(f"q8_0 of {src}: codes and scales equal (the sums differ)", style=self.style_of("detail--dim"))
        line = Text(f"q8_0 of {src}: ", style=self.style_of("detail--far"))
        if f.index is not None:
            line.append(_differ(f.n, "code"), style=self.style_of("detail--far"))
            line.append(f" [{f.index}] {f.scaled[0]:.6g}→{f.codes[0]} vs {f.scaled[1]:.6g}→{f.codes[1]}")
        else:
            line.append("codes equal", style=self.style_of("detail--dim"))
        if f.scale_block is not None:
            line.append(" · ")
            line.append(_differ(f.n_scales, "block scale"), style=self.style_of("detail--far"))
            steps = f" ({f.scale_steps} f16 step{'s' * (f.scale_steps != 1)})" if f.scale_steps else ""
            line.append(f", block {f.scale_block}: {f.scales[0]:.6g} vs {f.scales[1]:.6g}{steps}")
        return line

    def _head(self, info: KeyInfo, compact: bool) -> Text:
        st_style = {Status.OK: "detail--ok", Status.DIFF: "detail--diff", Status.PENDING: "detail--pending",
                    Status.MISSING_REF: "detail--missing", Status.MISSING_SUB: "detail--missing"}
        head = Text(info.key, style=self.style_of("detail--key"))
        label = {None: "not probed", Status.MISSING_SUB: f"only in {info.sides[0]}",
                 Status.MISSING_REF: f"only in {info.sides[1]}"}.get(info.status)
        label = label or (info.status.value if info.status is not None else "")
        head.append("  ")
        head.append(label, style=self.style_of(st_style.get(info.status, "detail--dim")))
        if info.verdict:
            head.append(f" {info.verdict}", style=self.style_of(f"detail--{info.verdict}"))
        if info.first:
            head.append("  first DIFF", style=self.style_of("detail--first"))
        if info.first_far:
            head.append("  first far", style=self.style_of("detail--first"))
        if compact:
            meta = self._meta(info)
            if meta:
                head.append("  ")
                head.append_text(meta)
        return head

    def _metrics(self, info: KeyInfo) -> Text:
        m = info.metrics
        ulp = "NaN" if m.max_ulp == NAN_ULP else str(m.max_ulp)
        # the verdict first (the tolerance itself is on the status line): a 40-column panel fits it all
        line = Text()
        if info.verdict:
            line.append(f"{info.verdict} ", style=self.style_of(f"detail--{info.verdict}"))
        line.append(f"nmse {m.nmse:.3g} rel {m.max_rel_err:.3g} ulp {ulp}")
        if info.rule:
            line.append(f"  by {info.rule}", style=self.style_of("detail--dim"))
        return line

    def _meta(self, info: KeyInfo) -> Text:
        meta = Text()
        if info.shape is not None:
            meta.append(f"{info.dtype} {list(info.shape)}")
        try:
            owners = self.owner_label(parse_key(info.key).field)
        except ValueError:
            owners = ""
        if owners and info.status is Status.DIFF:
            meta.append("  ops " if meta else "ops ", style=self.style_of("detail--dim"))
            meta.append(owners)
        return meta

    def _histogram(self, hist: list[int], width: int) -> list[Text]:
        rows = [(BIN_LABELS[i], n) for i, n in enumerate(hist) if n]
        if not rows:
            return []
        top = max(n for _, n in rows)
        lab_w = max(len(lab) for lab, _ in rows)
        num_w = len(str(top))
        bar_w = max(4, width - lab_w - num_w - 3)
        out = []
        for lab, n in rows:
            line = Text(f"{lab:>{lab_w}} ", style=self.style_of("detail--dim"))
            line.append(_bar(n / top, bar_w), style=self.style_of("detail--bar"))
            line.append(f" {n:>{num_w}}")
            out.append(line)
        return out
