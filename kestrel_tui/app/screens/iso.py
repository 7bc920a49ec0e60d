"""The iso view (the seed's [ISODIFF]): batch-verify of M draft tokens vs M=1 decode, per column.

Speculative decoding is only correct when every verify column's full logits
equal the M=1 step's byte for byte; the table shows, per column, how many
logits differ, the first differing vocab id, the largest ULP distance and the
first differing probe key. It runs on the subject with the main screen's
current exact toggles, in a thread worker; +/- change M and rerun.
"""
from __future__ import annotations

from textual.binding import Binding

from ...backends.toggles import describe
from ...engines.build import make_backend
from ...session.iso import IsoColumn, iso
from ...session.session import Session
from ...trace.compare import NAN_ULP
from .table import TableScreen

HELP = """\
Speculative decoding verifies M draft tokens in one M-column step. That is only correct if every
column's logits equal, byte for byte, what the M=1 decode step gives for the same tokens: a 1-ULP
difference anywhere can flip a later boundary token. The subject decodes M tokens one at a time,
then a fresh instance verifies the same M tokens in one step.

ndiff          logits whose bits differ (of the whole vocabulary)
first logit    the first differing vocab id
max ULP        the largest distance in units in the last place
first DIFF key the first probe key, in dataflow order, that differs between the column and M=1

Ops toggled on the main screen apply here: escape, switch ops, press i again."""


class IsoScreen(TableScreen):
    PREFIX = "iso"
    COLUMNS = ("col", "pos", "token", "ndiff", "first logit", "max ULP", "first DIFF key", "top-1 M=1/batch")
    HELP = HELP
    BINDINGS = [
        Binding("escape,i", "app.pop_screen", "back", tooltip="back to the grid"),
        Binding("plus,equals_sign", "width(1)", "M+1", tooltip="one more verify column"),
        Binding("minus", "width(-1)", "M-1", tooltip="one verify column fewer"),
        Binding("r", "run", "rerun", tooltip="run the iso check again"),
    ]

    def __init__(self, session: Session, exact: frozenset[str], m: int = 5) -> None:
        super().__init__()
        self.session, self.exact = session, exact
        self.m = max(1, min(m, session.n_tokens))
        self.cols: list[IsoColumn] | None = None

    @property
    def busy(self) -> bool:
        return self.running

    def action_width(self, d: int) -> None:
        m = max(1, min(self.m + d, self.session.n_tokens))
        if m != self.m:
            self.m = m
            self.action_run()

    def action_run(self) -> None:
        s, exact, m = self.session, self.exact, self.m
        self.cols = None
        title = (f"iso: batch-verify M={m} vs M=1 decode · subject {s.subject} ({describe(exact)})"
                 f" · full logits byte by byte")
        self.start(title, f"running M=1 decode and one M={m} verify step…",
                   lambda cancel, _add_row: iso(lambda: make_backend(s.subject, s.model, kv=s.kv, exact=exact),
                                                s.prompt, m, cancel=cancel))

    def done(self, cols: list[IsoColumn] | None, error: BaseException | None) -> None:
        if error is not None:
            self.cols = []
            self.set_status(f"iso failed: {error}")
            self.notify(str(error), title="iso failed", severity="error", markup=False)
            return
        if cols is None:  # cancelled
            return
        self.cols = cols
        for c in cols:
            first = "—" if c.first_index is None else str(c.first_index)
            ulp = "NaN" if c.max_ulp == NAN_ULP else str(c.max_ulp)
            cells = (str(c.j), str(c.t), str(c.token), str(c.ndiff), first, ulp, c.first_diff_key or "—",
                     f"{c.top1_single}/{c.top1_batch}")
            self.add_row(cells, {3: "bold red" if c.ndiff else "green",
                                 7: "bold red" if c.top1_single != c.top1_batch else ""})
        bad = sum(1 for c in cols if c.ndiff)
        if bad:
            self.set_status(f"{bad}/{len(cols)} columns differ from M=1: batch-verify is not bit-exact here")
        else:
            self.set_status(f"all {len(cols)} columns byte-identical to M=1 decode")
