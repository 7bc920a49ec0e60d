"""Invariance sweeps: one setting over its values, and where the answer changes.

A sweep runs the subject once per value of one setting and compares each run with that setting's
baseline, giving per value the first DIFF, the first far key (with a tolerance), how many keys are far,
the largest NMSE of the logits over the positions and the top-1 flips. The *answer* of a value is its
first DIFF and first far key (or that it failed); a value whose answer is not the previous value's is a
change, which is what the sweep is for: where a setting's boundary is (docs/sweep.md).

What can be swept, and against what:

* ``toggle:NAME`` — each value of one of the subject's toggles (an op's kernel, n_ubatch, threads,
  the attention implementation, the world size), against the session's reference;
* ``m`` — the batch-verify width of a built-in subject (session/iso.py's check), against the M=1
  decode of the same subject;
* ``prompt`` — the prompt's length (its first N ids), against the reference on that prompt;
* ``batch`` — the hf subject's prompt alone vs in a batch with N other prompts (vLLM's needle test;
  engines/hf_batch.py), against the prompt alone.

Keys name absolute positions; answers are compared with positions counted from the prompt's end, so
that a prompt-length sweep does not mark every value because every key moved with the prompt.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..bounds import Number, shown
from ..engines.base import EngineFailed, Toggle
from ..errors import UsageError
from ..trace.compare import Status, Tolerance, compare, key_metrics
from ..trace.keys import parse_key
from ..trace.run import Cancelled, Position, Trace
from .session import RunResult, RunSettings, Session, SideFailed, summarize

KINDS = ("toggle:NAME", "m", "prompt", "batch")
DEFAULT_M = tuple(range(1, 9))
DEFAULT_BATCH = (0, 1, 2, 3)
# A sweep is one run per value: 4096 of them take hours on the embedded model (8 widths: about 20 s,
# docs/sweep.md), so more is a typo rather than a plan; the kinds' own limits (value_limit) are often lower.
MAX_VALUES = 4096
_MAX_VALUES_WHY = f"one run per value; a sweep runs at most {MAX_VALUES}"
# The other prompts a batch sweep puts beside the subject's: a batch of 256 rows is vLLM's default
# max_num_seqs, the most requests it schedules in one batch.
MAX_OTHERS = 255
VALUE = Number(whole=True)  # a value of m, prompt or batch as typed; the kind checks its range
COLUMNS = ("value", "first DIFF", "first far", "far", "max NMSE logits", "flips", "answer")


@dataclass(frozen=True)
class SweepRow:
    value: int | str
    first_diff: str | None
    first_far: str | None
    n_diff: int
    n_far: int | None                   # None: no tolerance (bits only)
    logits_nmse: float | None           # the largest over the positions; 0.0: every logit's bits equal
    flips: int                          # positions whose top-1 differs from the baseline's
    changed: bool                       # the answer is not the previous value's
    failed: str | None = None           # the subject stopped at this value (one line)
    answer: tuple = field(default=(), repr=False, compare=False)

    def cells(self) -> tuple[str, ...]:
        """The row as the CLI's table and the app's show it (COLUMNS)."""
        if self.failed is not None and not self.n_diff:
            return (str(self.value), "failed", "—", "—", "—", "—", "changed" if self.changed else "")
        return (str(self.value), self.first_diff or "all ok", self.first_far or "—",
                "—" if self.n_far is None else str(self.n_far), format_nmse(self.logits_nmse), str(self.flips),
                "changed" if self.changed else "")

    def as_dict(self) -> dict:
        nmse = self.logits_nmse
        return {"value": self.value, "first_diff": self.first_diff, "first_far": self.first_far,
                "n_diff": self.n_diff, "n_far": self.n_far,
                "logits_nmse": nmse if nmse is None or math.isfinite(nmse) else str(nmse),
                "flips": self.flips, "changed": self.changed, "failed": self.failed}


@dataclass(frozen=True)
class SweepResult:
    what: str                           # "toggle:NAME", "m", "prompt" or "batch"
    baseline: str                       # what every row is compared with
    tolerance: Tolerance | None
    settings: str                       # the subject's other settings, as the session labels them
    rows: tuple[SweepRow, ...]
    notes: tuple[str, ...] = ()

    @property
    def values(self) -> tuple:
        return tuple(r.value for r in self.rows)

    @property
    def changes(self) -> tuple:
        """The values whose answer differs from the previous value's."""
        return tuple(r.value for r in self.rows if r.changed)

    def line(self) -> str:
        if not self.changes:
            return f"{self.what}: the same answer for every value ({_answer_text(self.rows[0]) if self.rows else '-'})"
        return f"{self.what}: the answer changes at {', '.join(str(v) for v in self.changes)}"

    def as_dict(self) -> dict:
        return {"what": self.what, "baseline": self.baseline,
                "tolerance": self.tolerance.spec() if self.tolerance is not None else None,
                "settings": self.settings, "values": list(self.values),
                "rows": [r.as_dict() for r in self.rows], "changes": list(self.changes),
                "notes": list(self.notes), "line": self.line()}


def format_nmse(x: float | None) -> str:
    if x is None:
        return "—"
    return "0" if x == 0.0 else f"{x:.2e}"


def _answer_text(row: SweepRow) -> str:
    return "failed" if row.failed and not row.n_diff else (row.first_diff or "all ok")


# ---- what and values

def parse_what(session: Session, what: str) -> tuple[str, Toggle | None]:
    """("toggle", the toggle) or (kind, None), with the subject able to take it; else one line."""
    from ..engines.builtin import BuiltinEngine
    from ..engines.hf import HFEngine

    kind, colon, name = what.partition(":")
    eng = session.subject_engine
    if kind == "toggle" and colon:
        names = [t.name for t in session.toggles]
        if name not in names:
            raise UsageError(f"--what {what}: {eng.name} has no toggle {name!r}; choose from"
                             f" {', '.join(names) or '(none: this subject has no toggles)'}")
        return "toggle", session.toggles[names.index(name)]
    if kind == "m" and not colon:
        if not isinstance(eng, BuiltinEngine):
            raise UsageError(f"--what m: batch-verify runs inside a built-in subject (sim or cuda); {eng.name}"
                             f" runs whole decodes only")
        return "m", None
    if kind == "prompt" and not colon:
        return "prompt", None
    if kind == "batch" and not colon:
        if not isinstance(eng, HFEngine):
            raise UsageError(f"--what batch: batch composition runs on the hf subject (transformers); {eng.name}"
                             f" decodes one sequence")
        return "batch", None
    raise UsageError(f"--what {what!r}: choose from toggle:NAME (NAME one of the subject's toggles), m, prompt,"
                     f" batch")


def kinds(session: Session) -> tuple[str, ...]:
    """Every `what` this session's subject can sweep."""
    out = [f"toggle:{t.name}" for t in session.toggles]
    for what in ("m", "prompt", "batch"):
        try:
            parse_what(session, what)
        except UsageError:
            continue
        out.append(what)
    return tuple(out)


def parse_values(what: str, text: str, limit: tuple[int, str] | None = None) -> list:
    """``--values``: comma-separated; for m, prompt and batch whole numbers or ranges A..B (``1..8``,
    ``1,2,4..6``); for a toggle its values' names. The values are counted before any list is made:
    more than ``limit`` (value_limit's: how many this run can take, and why) or MAX_VALUES is one line."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise UsageError(f"--values {shown(text)}: no values; give them comma-separated, e.g. 1..8 or fast,exact")
    spans = items if what.startswith("toggle:") else [_span(text, item) for item in items]
    count = len(items) if what.startswith("toggle:") else sum(b - a + 1 for a, b in spans)
    most, why = limit if limit is not None and limit[0] < MAX_VALUES else (MAX_VALUES, _MAX_VALUES_WHY)
    if count > most:
        raise UsageError(f"--values {shown(text)}: {count} values, but a sweep of {what} takes at most {most}"
                         f" ({why}); give fewer")
    if what.startswith("toggle:"):
        return items
    return [v for a, b in spans for v in range(a, b + 1)]


def _span(text: str, item: str) -> tuple[int, int]:
    """One item of --values: ``N`` or ``A..B``, as (first, last)."""
    lo, dots, hi = item.partition("..")
    ends = (lo, hi) if dots else (item, item)
    if any(VALUE.problem(e) is not None for e in ends):
        raise UsageError(f"--values {shown(text)}: {shown(item)} is not a whole number or a range A..B"
                         f" (digits 0-9)")
    a, b = (VALUE.parse(e, "--values") for e in ends)
    if b < a:
        raise UsageError(f"--values {shown(text)}: the range {item} runs backwards; write {b}..{a}")
    return a, b


def value_limit(session: Session, what: str, prompt: Sequence[int] | None = None,
                others: Sequence[Sequence[int]] | None = None) -> tuple[int, str]:
    """How many values a sweep of ``what`` can take in this session, and what sets that (for messages):
    the toggle's values, the widest M, the prompt's length, the other prompts there are."""
    kind, toggle = parse_what(session, what)
    ctx, n_prompt = session.model.cfg.max_positions, len(session.prompt)
    if toggle is not None:
        return len(toggle.values), f"{toggle.name} has {len(toggle.values)} values"
    if kind == "m":
        return max(ctx - n_prompt, 0), f"the widest M: the model's context of {ctx} less the prompt's {n_prompt} tokens"
    if kind == "prompt":
        full = len(prompt if prompt is not None else session.prompt)
        room = ctx - session.n_tokens
        if full <= room:
            return full, f"the prompt's {full} tokens"
        return max(room, 0), f"the model's context of {ctx} less {session.n_tokens} positions"
    if others is not None:
        return len(others) + 1, f"0 to the {len(others)} other prompts given"
    return MAX_OTHERS + 1, f"0 to {MAX_OTHERS} other prompts: a batch of {MAX_OTHERS + 1} rows"


def default_values(session: Session, what: str, toggle: Toggle | None = None,
                   prompt: Sequence[int] | None = None) -> list:
    if toggle is not None:
        return list(toggle.values)
    if what == "m":
        return list(DEFAULT_M)
    if what == "batch":
        return list(DEFAULT_BATCH)
    n = len(prompt if prompt is not None else session.prompt)
    out = [1 << i for i in range(n.bit_length()) if 1 << i < n]
    return out + [n]


# ---- the sweep

OnRow = Callable[[SweepRow], None]


def sweep(session: Session, what: str, values: Sequence | None = None, tol: Tolerance | None = Tolerance(),
          settings: RunSettings | None = None, *, prompt: Sequence[int] | None = None,
          others: Sequence[Sequence[int]] | None = None, on_row: OnRow | None = None,
          cancel: threading.Event | None = None) -> SweepResult:
    """Run ``what`` over ``values`` (default: default_values) with the subject's other settings from
    ``settings`` (default: the session's initial ones). ``tol`` None judges bits only (no far keys).
    ``prompt``: the longer prompt a prompt sweep cuts (default the session's); ``others``: the prompts
    a batch sweep puts beside the session's (default hf_batch.other_prompts). ``on_row`` gets each row
    as it is made (the app's table fills from it)."""
    kind, toggle = parse_what(session, what)
    settings = settings or session.initial_settings()
    values = list(values) if values is not None else default_values(session, kind, toggle, prompt)
    if not values:
        raise UsageError(f"--what {what}: no values to sweep")
    if len(set(values)) != len(values):
        raise UsageError(f"--values: {', '.join(str(v) for v in values)} names a value twice; give each once")
    plan = {"toggle": _toggle_runs, "m": _m_runs, "prompt": _prompt_runs, "batch": _batch_runs}[kind](
        session, settings, values, toggle=toggle, prompt=prompt, others=others, cancel=cancel)
    notes, rows = list(plan.notes), []
    try:
        for value in values:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            result, failed, n_prompt = plan.run(value)
            row = _row(value, result, failed, n_prompt, tol, rows[-1] if rows else None)
            if result is not None:
                notes.extend(result.notes)
            rows.append(row)
            if on_row:
                on_row(row)
    finally:
        plan.close()
    return SweepResult(what, plan.baseline, tol, session.label(settings), tuple(rows), tuple(dict.fromkeys(notes)))


@dataclass(frozen=True)
class _Plan:
    """A kind's runs: its baseline (named), one run per value -> (result, failure line, prompt length)."""
    baseline: str
    run: Callable[[object], tuple]
    notes: tuple[str, ...] = ()
    close: Callable[[], None] = lambda: None


def _row(value, result: RunResult | None, failed: str | None, n_prompt: int, tol: Tolerance | None,
         prev: SweepRow | None) -> SweepRow:
    if result is None:
        answer = (None, None, True)
        return SweepRow(value, None, None, 0, None, None, 0, prev is not None and prev.answer != answer, failed,
                        answer)
    summary = result.tolerance(tol) if tol is not None else None
    first_far = summary.first_far if summary is not None else None
    failed = failed or (str(result.failed) if result.failed is not None else None)
    answer = (_relative(result.first_diff, n_prompt), _relative(first_far, n_prompt), failed is not None)
    return SweepRow(value, result.first_diff, first_far, result.comparison.counts[Status.DIFF],
                    summary.n_far if summary is not None else None, _logits_nmse(result.ref, result.sub),
                    sum(1 for t in result.tokens if t.flip), prev is not None and prev.answer != answer, failed,
                    answer)


def _relative(key: str | None, n_prompt: int):
    """A key with its position counted from the prompt's end (a foreign tag as it is)."""
    if key is None:
        return None
    try:
        k = parse_key(key)
    except ValueError:
        return key
    return k.t - n_prompt, k.layer, k.field


def _logits_nmse(ref: Trace, sub: Trace) -> float | None:
    """The largest NMSE of the logits over the positions both sides have them at (None: neither has any)."""
    out = None
    for a, b in zip(ref.positions, sub.positions):
        if a.logits is None or b.logits is None:
            continue
        nmse = key_metrics(np.asarray(a.logits), np.asarray(b.logits)).nmse
        out = nmse if out is None else max(out, nmse)
    return out


def _result(settings: RunSettings, ref: Trace, sub: Trace) -> RunResult:
    """Two traces as one run's result: the baseline standing in for the reference."""
    cmp = compare(ref.hashes(), sub.hashes())
    return RunResult(settings, ref, sub, cmp, summarize(ref, sub, cmp))


def _subject_run(session: Session, settings: RunSettings, cancel):
    """(result, failure line, prompt length) of one session run; a reference that fails ends the sweep."""
    try:
        return session.run(settings, cancel=cancel, record=False), None, len(session.prompt)
    except SideFailed as e:
        if e.failure.side == "reference":
            raise
        return None, str(e.failure), len(session.prompt)


def _toggle_runs(session: Session, settings: RunSettings, values, *, toggle: Toggle, cancel, **_):
    bad = [v for v in values if v not in toggle.values]
    if bad:
        raise UsageError(f"--values: {toggle.name} takes {', '.join(toggle.values)}, not {bad[0]!r}")
    session.reference(cancel=cancel)  # a failing reference is one line before any subject runs

    def runs(value):
        return _subject_run(session, settings.pick(toggle, value), cancel)
    return _Plan(f"the reference ({session.reference_engine.name})", runs)


def _prompt_runs(session: Session, settings: RunSettings, values, *, prompt, cancel, **_):
    full = list(prompt if prompt is not None else session.prompt)
    bad = [v for v in values if not isinstance(v, int) or not 1 <= v <= len(full)]
    if bad:
        raise UsageError(f"--values: prompt length {bad[0]} is outside 1..{len(full)} (the prompt's"
                         f" {len(full)} tokens); give a longer prompt or shorter lengths")
    room = session.model.cfg.max_positions - session.n_tokens
    if max(values) > room:
        raise UsageError(f"--values: a prompt of {max(values)} and {session.n_tokens} positions exceed the model's"
                         f" context of {session.model.cfg.max_positions}; sweep lengths up to {room}")

    def runs(n):
        cut = Session(session.model, full[:n], session.n_tokens, subject=session.subject_engine,
                      reference=session.reference_engine, kv=session.kv, deep=session.deep, cache=session.cache)
        return _subject_run(cut, settings, cancel)
    return _Plan(f"the reference ({session.reference_engine.name}) on the same prompt", runs)


def _m_runs(session: Session, settings: RunSettings, values, *, cancel, **_):
    """The M=1 decode runs once, for the largest M: each M's verify step is compared with its first M
    positions (what iso(m) compares with where a decode step does not depend on the cache's capacity,
    which tests/test_sweep.py checks against iso() on the sim)."""
    from ..engines.builtin import run_decode
    from .iso import failing

    bad = [v for v in values if not isinstance(v, int) or v < 1]
    if bad:
        raise UsageError(f"--values: M={bad[0]}: the batch-verify width must be at least 1")
    prompt, P = list(session.prompt), len(session.prompt)
    room = session.model.cfg.max_positions - P
    if max(values) > room:
        raise UsageError(f"--values: M={max(values)} after the prompt's {P} tokens exceeds the model's context of"
                         f" {session.model.cfg.max_positions}; sweep M up to {room}")
    eng = session.subject_engine
    toggles = settings.values(eng.toggles)

    def backend():
        return eng.backend(toggles)

    single = failing("the M=1 decode", lambda: run_decode(backend(), prompt, max(values), cancel=cancel))
    drafts = [p.token for p in single.positions[P:]]

    def runs(m):
        batch = backend()

        def verify():
            batch.reset(P + m)
            batch.step(np.array(prompt), 0, raw=False)
            return batch.step(np.array(drafts[:m]), P, raw=True)
        try:
            out = failing(f"the M={m} verify step", verify)
        except EngineFailed as e:
            return None, str(e), P
        ref = Trace(single.backend, prompt, single.positions[:P + m])
        # the verify step's own prefill is not compared (iso compares the verify columns only)
        cols = [Position(P + j, drafts[j], False, out.hashes[j], out.raw[j] if out.raw else None, out.logits[j])
                for j in range(m)]
        sub = Trace(f"{single.backend}, verify M={m}", prompt, single.positions[:P] + cols)
        return _result(settings, ref, sub), None, P
    return _Plan(f"the M=1 decode ({single.backend})", runs)


def _batch_runs(session: Session, settings: RunSettings, values, *, others, cancel, **_):
    from ..engines.hf_batch import BatchRunner, other_prompts

    bad = [v for v in values if not isinstance(v, int) or v < 0]
    if bad:
        raise UsageError(f"--values: {bad[0]} other prompts: give a count of 0 (alone) or more")
    if others is None and max(values) > MAX_OTHERS:  # before other_prompts makes that many
        raise UsageError(f"--values: {max(values)} other prompts, but a batch sweep takes at most {MAX_OTHERS}"
                         f" (a batch of {MAX_OTHERS + 1} rows, vLLM's default max_num_seqs)")
    P = len(session.prompt)
    pool = [list(o) for o in others] if others is not None else other_prompts(session.model.cfg.vocab, P,
                                                                             max(values))
    if max(values) > len(pool):
        raise UsageError(f"--values: a batch of {max(values)} other prompts, but {len(pool)} were given;"
                         f" give more prompts or smaller counts")
    longest = max([P, *(len(o) for o in pool[:max(values)])])
    if longest + session.n_tokens > session.model.cfg.max_positions:
        raise UsageError(f"--values: the batch's longest prompt ({longest}) and {session.n_tokens} positions exceed"
                         f" the model's context of {session.model.cfg.max_positions}; use fewer tokens")
    forced, notes = None, []
    if settings.forcing == "teacher":
        ref = session.reference(cancel=cancel)
        forced = [p.token for p in ref.positions[P:]]
        if any(t < 0 for t in forced):
            forced = None
            notes.append(f"the reference ({session.reference_engine.name}) reports no tokens: the prompt decodes"
                         f" its own")
    eng = session.subject_engine
    toggles = settings.values(eng.toggles)
    if eng.settings(toggles).get("prefill") == "token":
        notes.append("hf batch: the prompts run in one forward (prefill=token cannot wait for one row)")
    if settings.mode == "isolate":
        notes.append("hf batch: the rows run chained (isolation feeds one sequence)")
    runner = BatchRunner(eng, toggles)
    try:
        alone = runner.run(session.prompt, session.n_tokens, forced=forced, cancel=cancel)
    except BaseException:
        runner.close()
        raise

    def runs(n):
        try:
            sub = runner.run(session.prompt, session.n_tokens, pool[:n], forced=forced, cancel=cancel)
        except EngineFailed as e:
            return None, str(e), P
        return _result(settings, alone, sub), None, P
    return _Plan(f"the prompt alone ({eng.name}; 0: alone again)", runs, tuple(notes), runner.close)
