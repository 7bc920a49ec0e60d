"""The tolerance key (T): a finished run's DIFF keys judged close or far, in a worker; F jumps to the first far.

The finished run's status line lives here too: with a tolerance on, it names the first far key and the
counts once the verdicts are in.
"""
from __future__ import annotations

from textual.binding import Binding

from ...session.session import RunResult, ToleranceSummary
from ...trace.compare import Status, Tolerance
from ..messages import RunMessage, message
from .base import Host, Part, Phase, one_line

# The tolerance key's cycle: off (plain ok/DIFF) first, so a fresh app looks as it always did.
TOLERANCES: tuple[Tolerance | None, ...] = (None, Tolerance(), Tolerance(nmse=1e-4), Tolerance(nmse=None, ulp=4))
HASH_ONLY = "no raw values: hash-only dumps, so DIFF keys stay DIFF"


@message
class ToleranceReady(RunMessage):
    """A finished run's DIFF keys judged against one tolerance (dropped if either changed meanwhile)."""
    tol: Tolerance
    summary: ToleranceSummary | None
    error: BaseException | None = None


def judge(result: RunResult, tol: Tolerance, run_id: int, post) -> None:
    """Judge a finished run's DIFF keys against a tolerance (NMSE/ULP/rel. err over every DIFF key's
    raw buffers: ~0.4 s on the default model's 32 positions the first time, cached per key after)."""
    try:
        summary = result.tolerance(tol)
    except Exception as e:  # noqa: BLE001 - shown in the app; the plain DIFF view stays
        post(ToleranceReady(run_id, tol, None, e))
        return
    post(ToleranceReady(run_id, tol, summary))


def result_line(result: RunResult, label: str, tol: Tolerance | None,
                summary: ToleranceSummary | None) -> tuple[str, str]:
    """(text, kind) of a finished run's status line; the verdicts once `summary` holds them."""
    cmp = result.comparison
    if result.all_ok:
        shared = len(cmp.status) - len(result.expected_missing)
        return (f"all ok · {shared} keys identical · {label}"
                + (f" · {len(result.expected_missing)} made by one side only" if result.expected_missing else ""),
                "ok")
    # most telling first: at 80 columns the tail is cut
    counts = f"{cmp.counts.get(Status.DIFF, 0)} DIFF keys"
    if summary is not None and summary.n_close + summary.n_far == 0:
        counts = (f"no verdict at {tol.spec()}: the {summary.n_unjudged} DIFF keys are hash-only"
                  f" (no raw values to judge)")
    elif summary is not None:
        far = summary.first_far or "— (every judged DIFF key close)"
        cause = result.cause_of(summary.first_far) if summary.first_far else None
        if cause is not None:
            far += f" (after {cause.short})"
        counts = f"first far {far} at {tol.spec()} · {summary.n_close} close · {summary.n_far} far"
        if summary.n_unjudged:
            counts += f" · {summary.n_unjudged} hash-only"
    elif tol is not None:
        counts = f"judging at {tol.spec()}… · {counts}"
    missing = f" · {result.n_missing} missing" if result.n_missing else ""
    flips = sum(1 for s in result.tokens if s.flip)
    return f"first DIFF {cmp.first_diff or '—'} · {counts}{missing} · {flips} top-1 flips · {label}", "diff"


class Tolerances(Part):
    BINDINGS = (
        Binding("F", "first_far", "first far", show=False,
                tooltip="jump to the first far key (a tolerance must be on: T)"),
        Binding("T", "tolerance", "tolerance", show=False,
                tooltip="cycle the tolerance: off, nmse<=1e-7, nmse<=1e-4, max ULP<=4; DIFF keys read close/far"),
    )
    DIFF_MODE = frozenset({"tolerance"})  # says once why dump files get no verdicts

    def __init__(self, screen: Host) -> None:
        super().__init__(screen)
        self.cycle = TOLERANCES  # a profile's tolerance joins it and starts on
        self.index = 0  # into self.cycle
        self.judging = 0  # the run id a worker is judging for; 0: none
        self.said_hash_only = False

    @property
    def current(self) -> Tolerance | None:
        return self.cycle[self.index]

    @property
    def busy(self) -> bool:
        return bool(self.judging)

    def superseded(self) -> None:
        self.judging = 0  # the board's reset drops its summary; a judgement in flight turns stale

    def use(self, tol: Tolerance | None) -> None:
        """A profile's tolerance: first in the cycle after off, and the one a new session starts with."""
        if tol is None:
            self.cycle, self.index = TOLERANCES, 0
            return
        self.cycle = (None, tol, *(t for t in TOLERANCES[1:] if t != tol))
        self.index = 1

    def action_tolerance(self) -> None:
        s = self.screen
        if s.diff_mode:
            if not self.said_hash_only:  # said once: every further press would say the same
                self.said_hash_only = True
                s.notify(HASH_ONLY, title="tolerance", severity="warning", markup=False)
            return
        self.index = (self.index + 1) % len(self.cycle)
        self.judging = 0  # a judgement in flight is for the previous tolerance: its message is dropped
        if s.board is not None:
            s.board.set_tolerance(None)
        if s.result is not None and s.phase is Phase.IDLE:
            self.show_status()
            if self.current is not None:
                self.judge()
        elif self.current is not None and s.phase is not Phase.ERROR:
            s.status.set_text(f"tolerance {self.current.spec()}: DIFF keys are judged when the run finishes",
                              "busy" if s.busy else "")
        s.refresh_all()

    def action_first_far(self) -> None:
        s = self.screen
        summary = s.board.tolerance if s.board is not None else None
        if self.current is None:
            s.notify("no tolerance chosen: T cycles through them, then F jumps to the first far key", markup=False)
        elif summary is None:
            s.notify("the DIFF keys are not judged yet (the run must finish)", markup=False)
        elif summary.first_far is None:
            s.notify(f"no far key at {self.current.spec()}", markup=False)
        else:
            s.goto(summary.first_far)
            s.follow = False  # f goes back to following the first DIFF

    def show_status(self) -> None:
        """The finished run's status line, with the verdicts once they are in."""
        s = self.screen
        summary = s.board.tolerance if s.board is not None else None
        s.status.set_text(*result_line(s.result, s.session.label(s.result.settings), self.current, summary))

    def judge(self) -> None:
        """Judge the finished run's DIFF keys off the UI thread (~0.4 s on the default model)."""
        s = self.screen
        result, tol = s.result, self.current
        if result is None or tol is None or result.all_ok:
            return
        run_id = self.judging = s.run_id
        self.show_status()
        self.work(lambda: judge(result, tol, run_id, s.post_message), name="judge",
                  description="judge DIFF keys against the tolerance")

    def on_tolerance_ready(self, m: ToleranceReady) -> None:
        s = self.screen
        if not s.current(m) or m.tol != self.current or s.result is None:
            return  # a newer run or another tolerance: a newer judgement (if any) is on its way
        self.judging = 0
        if m.error is not None:
            text = one_line(m.error)
            s.status.set_text(f"tolerance failed: {text}", "error")
            s.notify(text, title="tolerance", severity="error", markup=False)
            return
        s.board.set_tolerance(m.summary)
        self.show_status()
        s.refresh_all()
