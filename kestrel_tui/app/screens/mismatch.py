"""The logprob mismatch view (L): the last finished run's log-ratio histogram, its figures, the worst token.

The mismatch is what RL engineers measure between a rollout engine and a trainer (trace/logprobs.py):
the reference's chosen tokens scored by both sides. The view shows the histogram of the log-ratios
with the clip bands marked, the figures as a small table, and the worst token next to the run's first
far key; w and F go back to the grid with the cursor on either. It is computed in a thread worker (a
full vocabulary's log-softmax per position); x exports the histogram's SVG, mismatch.json and a
screenshot in a new folder, as the grid's export does.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Label, Static

from ...engines.schedule import GRAMMAR
from ...files import create_whole
from ...session.session import RunResult, ToleranceSummary
from ...text import inert
from ...trace.compare import Tolerance
from ...trace.keys import logits_key, parse_key
from ...trace.logprobs import CLIP_BANDS, RunMismatch
from ..export import json_safe
from ..messages import message
from ..parts.base import one_line
from ..parts.export import ExportDone, export_view, view_export_done
from ..widgets.histogram import Histogram, histogram_bins, histogram_svg
MISMATCH_JSON, MISMATCH_SVG = "mismatch.json", "mismatch.svg"
NO_LOGITS = "no logprob mismatch: a side reports no logits (hash-only or dump engines score no token)"
_BANDS = " or ".join(f"[{lo:g}, {hi:g}]" for lo, hi in sorted(CLIP_BANDS, key=lambda b: b[1] - b[0]))
HELP = f"""\
Each generated token the reference chose is scored by both sides from the same context; its log-ratio is
log p_subject - log p_reference and its ratio r = exp(log-ratio). Truncated importance sampling clips r
to a band: a token outside {_BANDS} is one the trainer would clip. k1 and k3 estimate
KL(reference || subject). A subject with a schedule other than decode scores the same tokens in other
forward passes ({GRAMMAR}): its schedule toggle switches it back to decode."""


@message
class MismatchReady(Message):
    mismatch: RunMismatch | None
    error: BaseException | None = None


def write_mismatch(folder: Path, mismatch: RunMismatch, title: str) -> None:
    """mismatch.json (the figures and the per-token log-ratios) and mismatch.svg (the histogram)."""
    with create_whole(folder / MISMATCH_JSON, what="mismatch report") as f:
        json.dump(json_safe(mismatch.as_dict()), f, indent=1)
        f.write("\n")
    with create_whole(folder / MISMATCH_SVG, what="mismatch histogram") as f:
        f.write(histogram_svg(title, histogram_bins(mismatch.tally.histogram)))


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def figures_table(m: RunMismatch) -> Table:
    """The tally's figures, one a row."""
    f = m.tally.figures()
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [("scored tokens", str(f["tokens"])), ("bitwise equal", str(f["bitwise_tokens"]))]
    rows += [(f"outside [{lo:g}, {hi:g}]", _fmt(f[f"outside_{lo:g}_{hi:g}"], ".2%")) for lo, hi in CLIP_BANDS]
    rows += [("KL k1", _fmt(f["k1"], ".3e")), ("KL k3", _fmt(f["k3"], ".3e")),
             ("max |dp|", _fmt(f["max_abs_dp"], ".3e")),
             ("geometric-mean ratio", _fmt(f["seq_geo_ratio_min"], ".6f"))]
    if m.unscored:
        rows.append(("unscored", f"{m.unscored} (the subject's context or logits differ there)"))
    for name, value in rows:
        table.add_row(Text(name), Text(value))
    return table


def worst_lines(m: RunMismatch | None) -> list[str]:
    if m is None or m.worst_position is None:
        return ["worst token: —"]
    lr = float(m.log_ratio[m.tally.worst[2]])
    ratio = math.exp(lr) if not math.isnan(lr) else math.nan
    return [f"worst token: position {m.worst_position} ({logits_key(m.worst_position)})",
            f"  log-ratio {lr:+.6g}, ratio {ratio:.6g}"]


def far_lines(result: RunResult, tol: Tolerance | None, summary: ToleranceSummary | None,
              worst: int | None) -> list[str]:
    """The run's first far key, or why there is none to show."""
    if result.all_ok:
        return ["first far key: — (every key agrees)"]
    diff = f"  first DIFF {inert(result.first_diff)}"
    if tol is None:
        return ["first far key: no tolerance on", "  (T on the grid judges the DIFF keys)", diff]
    if summary is None or summary.tolerance != tol:
        return [f"first far key: not judged yet at {tol.spec()}", diff]
    if summary.first_far is None:
        return [f"first far key: none at {tol.spec()}", "  (every judged DIFF key is close)"]
    t = parse_key(summary.first_far).t
    where = "" if worst is None else (", the worst token's" if t == worst else
                                      f", {abs(worst - t)} {'before' if t < worst else 'after'} the worst")
    return [f"first far key: {inert(summary.first_far)}", f"  position {t}{where}", f"  at {tol.spec()}"]


class MismatchScreen(Screen):
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]
    BINDINGS = [
        Binding("escape,L", "app.pop_screen", "back", tooltip="back to the grid"),
        Binding("w", "worst", "worst token", tooltip="back to the grid, the cursor on the worst token's position"
                " (the logits that scored it)"),
        Binding("F", "first_far", "first far", tooltip="back to the grid, the cursor on the first far key"
                " (a tolerance must be on: T)"),
        Binding("x", "export", "export", tooltip="export the histogram's SVG, mismatch.json and a screenshot in"
                " a new folder"),
    ]

    def __init__(self, result: RunResult, tol: Tolerance | None = None,
                 summary: ToleranceSummary | None = None) -> None:
        """``result``: the finished run (its traces name both sides and their settings); ``tol`` and
        ``summary``: the main screen's tolerance and its verdicts on this run, if any."""
        super().__init__()
        self.result, self.tol, self.summary = result, tol, summary
        self.mismatch: RunMismatch | None = None
        self.computing = True
        self.exporting = False
        self.last_export: Path | None = None

    @property
    def busy(self) -> bool:
        return self.computing or self.exporting

    def compose(self) -> ComposeResult:
        yield Label(inert(self.title_text()), id="mismatch-title", markup=False)
        with Horizontal(id="mismatch-body"):
            yield Histogram(id="mismatch-histogram")
            with Vertical(id="mismatch-side"):
                yield Static("", id="mismatch-figures")
                yield Static("", id="mismatch-worst", markup=False)
        yield Static(HELP, id="mismatch-help", markup=False)
        yield Label("computing the log-ratios…", id="mismatch-status", markup=False)
        yield Footer()

    def title_text(self) -> str:
        r = self.result
        return f"logprob mismatch · subject {r.sub.backend} vs reference {r.ref.backend}"

    def on_mount(self) -> None:
        self.query_one("#mismatch-histogram").border_title = "log-ratio histogram"
        self.query_one("#mismatch-side").border_title = "figures"
        result = self.result

        def compute() -> None:
            try:
                self.post_message(MismatchReady(result.mismatch))
            except Exception as e:  # noqa: BLE001 - shown on the screen; the app stays usable
                self.post_message(MismatchReady(None, e))

        self.run_worker(compute, thread=True, group="mismatch", name="mismatch", exit_on_error=False)

    def on_mismatch_ready(self, m: MismatchReady) -> None:
        self.computing = False
        status = self.query_one("#mismatch-status", Label)
        if m.error is not None:
            status.update(inert(f"mismatch failed: {one_line(m.error)}"))
            return
        self.mismatch = mm = m.mismatch
        worst = self.query_one("#mismatch-worst", Static)
        if mm is None:
            status.update(NO_LOGITS)
            worst.update("\n".join(far_lines(self.result, self.tol, self.summary, None)))
            return
        self.query_one(Histogram).show(histogram_bins(mm.tally.histogram))
        self.query_one("#mismatch-figures", Static).update(figures_table(mm))
        worst.update("\n".join([*worst_lines(mm), *far_lines(self.result, self.tol, self.summary, mm.worst_position),
                                "", "w: to the worst token on the grid", "F: to the first far key on the grid"]))
        status.update(mm.tally.lines()[0])

    # ---- to the grid

    def action_worst(self) -> None:
        m = self.mismatch
        if m is None or m.worst_position is None:
            self.notify("no scored token" if not self.computing else "still computing", markup=False)
            return
        main = self.app.main
        self.app.pop_screen()
        main.goto(logits_key(m.worst_position))
        main.follow = False  # f goes back to following the first DIFF

    def action_first_far(self) -> None:
        main = self.app.main
        self.app.pop_screen()
        main.tolerances.action_first_far()  # it says why, where there is no far key to go to

    # ---- export

    def set_status(self, text: str) -> None:
        self.query_one("#mismatch-status", Label).update(inert(text))

    def action_export(self) -> None:
        m = self.mismatch
        if m is None or self.exporting:
            self.notify(NO_LOGITS if not self.computing and not self.exporting else
                        "wait: the mismatch is being computed or exported", severity="warning", markup=False)
            return
        title = self.title_text()
        export_view(self, lambda folder: write_mismatch(folder, m, title), "mismatch export")

    def on_export_done(self, m: ExportDone) -> None:
        view_export_done(self, m)
