"""The headless subcommands behind cli.py; each returns the process exit status: 0 same, 1 DIFF
(with --tol: a far key, or what else kept the run from all close, said), 2 bad input (cli.py),
3 an engine failed (a crash, a timeout, nothing written), with --json's `failed` naming the side."""
from __future__ import annotations

import argparse
import json

from rich.table import Table
from rich.text import Text

from .terminal import console, err_console, load_model, whole_columns_table
from .errors import UsageError
from .files import check_new_path
from .backends.toggles import parse_exact
from .session.inputs import RunConfig, cache_from_options, engines_from_options, resolve_prompt
from .engines.registry import names
from .model.weights import Model
from .trace.compare import NAN_ULP, Status, Tolerance

ENGINE_FAILED = 3  # the exit status of a run an engine did not finish: not a DIFF, not bad input
# What a command judges by when neither --tol nor the profile gives a tolerance (docs/decisions.md): the
# commands that ask whether the bits agree judge bits (None); the ones that look for far keys, nmse=1e-7.
TOLERANCE_DEFAULT: dict[str, Tolerance | None] = {"diff": None, "run": None, "repro": None, "bisect": Tolerance(),
                                                  "graft": Tolerance(), "sweep": Tolerance(), "logprobs": Tolerance()}


def _tolerance(args: argparse.Namespace, config: RunConfig | None) -> Tolerance | None:
    """--tol, else the profile's, else the command's default."""
    if config is None:  # diff: no profile
        from .trace.compare import parse_tolerance

        return parse_tolerance(args.tol) if args.tol is not None else TOLERANCE_DEFAULT[args.cmd]
    return config.tolerance if config.tolerance is not None else TOLERANCE_DEFAULT[args.cmd]


def _engine_failed(args: argparse.Namespace, failure, line: str | None = None, report: dict | None = None) -> int:
    """An engine failed: one line on stderr, and with --json the report (or just `failed`) on stdout."""
    if getattr(args, "json", False):
        print(json.dumps({**(report or {}), "failed": failure.as_dict()}, indent=2))
    err_console.print(f"kestrel-tui {args.cmd}: {line or f'the {failure.side} failed: {failure.reason}'}",
                      markup=False, highlight=False)
    return ENGINE_FAILED


def _dump_engine(args: argparse.Namespace, config: RunConfig, model: Model):
    """The engine `dump` runs and its toggle values: --backend (with --profile: a side) and --exact."""
    from .session.session import RunSettings, starting_exact

    profile = config.profile
    if profile is not None:
        side = args.backend or "subject"
        if side not in ("reference", "subject"):
            raise UsageError(f"--backend {side!r}: with --profile, name a side: reference or subject")
        ref, sub = engines_from_options(config, model, sides=(side,))
        engine = ref if side == "reference" else sub
    else:
        engine = engines_from_options(config, model, subject=args.backend or "cpu")[1]
    names = tuple(t.name for t in engine.toggles if t.binary)
    if args.exact is not None:
        return engine, RunSettings(exact=parse_exact(args.exact, names)).values(engine.toggles)
    if profile is None:  # a built-in, as before profiles: every op exact
        return engine, RunSettings(exact=frozenset(names)).values(engine.toggles)
    # a profile's side as the session runs it: the reference on its defaults, the subject at its start
    return engine, RunSettings(exact=starting_exact(engine.toggles)).values(engine.toggles)


def _dump_side(args: argparse.Namespace, config: RunConfig) -> str:
    if config.profile is not None:
        return args.backend or "subject"
    return "reference" if (args.backend or "cpu") == "cpu" else "subject"


def cmd_dump(args: argparse.Namespace, config: RunConfig) -> int:
    from .session.session import Failure
    from .engines.base import EngineFailed, RunRequest
    from .trace.dump import DumpWriter

    out = check_new_path(args.out, "dump")  # before the slow part; DumpWriter checks again
    model = load_model(config)
    prompt = resolve_prompt(config, model)
    engine, values = _dump_engine(args, config, model)
    _engine_notes(engine)
    what = engine.describe(values)
    failure = None
    try:
        with DumpWriter(out) as writer, console.status(f"{what}: {len(prompt)}+{config.tokens} positions"):
            def write(pos):
                for key, h in pos.hashes.items():
                    writer.write(key, h)
            try:
                trace = engine.run(RunRequest(prompt, config.tokens, values, raw=False, on_position=write))
            except EngineFailed as e:
                failure = Failure(_dump_side(args, config), engine.name, str(e))
                raise
    except UsageError as e:
        if failure is None:
            raise
        # the writer's message names the output and where the unfinished file went
        return _engine_failed(args, failure, f"the {failure.side} failed: {e}")
    n_keys = sum(len(p.hashes) for p in trace.positions)
    console.print(f"wrote {out}: {len(trace.positions)} positions, {n_keys} keys ({what})")
    return 0


def cmd_generate(args: argparse.Namespace, config: RunConfig) -> int:
    from .session.session import Failure
    from .engines.base import EngineFailed, RunRequest

    model = load_model(config)
    prompt = resolve_prompt(config, model)
    ref = engines_from_options(config, model, subject="cpu", sides=("reference",))[0]
    _engine_notes(ref)
    if not ref.caps.logits:
        raise UsageError(f"generate: the reference ({ref.name}) reports no logits, so no tokens to print;"
                         f" give it a raw-values sidecar with t<T>_logits (docs/engines-process.md)")
    try:
        trace = ref.run(RunRequest(prompt, config.tokens, {t.name: t.default for t in ref.toggles}, raw=False))
    except EngineFailed as e:
        return _engine_failed(args, Failure("reference", ref.name, str(e)))
    ids = trace.generated[: config.tokens]
    console.print(" ".join(map(str, ids)))
    if model.tokenizer is not None:
        console.print(model.tokenizer.decode(ids))
    return 0


def _diff_side(path: str, other=None):
    """(key -> hash, the Trace or None): a dump file, or a serving engine's dump folder (engines/dumps/),
    whose request is the one that consumed the other side's tokens when the other side has them."""
    from pathlib import Path

    from .trace.dump import read_dump

    if Path(path).is_dir():
        from .engines.dumps import read_folder

        tokens = [p.token for p in other.positions] if other is not None else None
        trace = read_folder(path, tokens=tokens)
        return trace.hashes(), trace
    return read_dump(path), None


def _diff_notes(*sides: tuple[str, object]) -> None:
    """The folders' notes, once both sides are read and checked: a refusal stays the one line."""
    for path, trace in sides:
        for note in getattr(trace, "notes", ()):
            err_console.print(f"note: {path}: {note}", markup=False, highlight=False)


def cmd_diff(args: argparse.Namespace, config: None = None) -> int:
    from .trace.compare import Status, compare

    tol = _tolerance(args, config)
    a, trace_a = _diff_side(args.a)
    b, trace_b = _diff_side(args.b, trace_a)
    if args.tui:
        from .app.main import run_diff_app

        _diff_notes((args.a, trace_a), (args.b, trace_b))
        return run_diff_app(args.a, args.b, a, b)
    cmp = compare(a, b)
    if cmp.identical:
        _diff_notes((args.a, trace_a), (args.b, trace_b))
        console.print(Text.assemble(("identical", "green"), f": {len(a)} keys"))
        return 0
    if trace_a is not None and trace_b is not None:
        _check_shapes(args.a, args.b, cmp, trace_a, trace_b)
    if tol is not None and (trace_a is None or trace_b is None):
        raise UsageError(f"--tol {args.tol!r}: a dump file holds hashes only; a tolerance judges raw values, which"
                         f" only a serving engine's dump folder has on both sides")
    _diff_notes((args.a, trace_a), (args.b, trace_b))
    console.print(f"{args.a} vs {args.b}")
    console.print(counts_table(cmp.counts))
    first = cmp.first_diff or cmp.first_mismatch
    if cmp.first_diff:
        console.print(Text.assemble("first DIFF: ", (cmp.first_diff, "bold red"),
                                    f"  {a[cmp.first_diff]:016x} != {b[cmp.first_diff]:016x}"))
    if first != cmp.first_diff:
        console.print(Text.assemble("first missing: ", (first, "yellow"), f" ({cmp.status[first].value})"))
    diff = [k for k, st in cmp.status.items() if st is Status.DIFF]
    partial = sorted(set(diff) & (getattr(trace_a, "partial", set()) | getattr(trace_b, "partial", set())))
    if partial:  # a sum over ranks is never its engine's own reduction bit for bit
        console.print(f"{len(partial)} DIFF keys are partial sums added over ranks (first {partial[0]}): their"
                      f" bits say nothing; --tol judges them")
    if tol is None:
        return 1
    return _diff_tolerance(diff, trace_a, trace_b, tol)


def _check_shapes(name_a: str, name_b: str, cmp, trace_a, trace_b) -> None:
    """Two dump folders' shards put together give every key the model's full shape, at any TP size; a
    key of two shapes means ranks are missing on one side (or the dumps are of two models): one line."""
    from .text import inert

    first = next((k for k, st in cmp.status.items() if st is Status.DIFF), None)
    if first is None:
        return
    pos = first[:first.index("_") + 1]
    for key, st in cmp.status.items():
        if st is not Status.DIFF or not key.startswith(pos):
            continue
        ra, rb = trace_a.raw(key), trace_b.raw(key)
        if ra is None or rb is None or ra.shape == rb.shape:
            continue
        ranks = [len(t.rank_values(key) or ()) or 1 for t in (trace_a, trace_b)]
        small = inert(name_a if ra.size < rb.size else name_b)
        raise UsageError(f"{key} is {list(ra.shape)} in {inert(name_a)} (from {ranks[0]} rank{'s' * (ranks[0] != 1)})"
                         f" and {list(rb.shape)} in {inert(name_b)} (from {ranks[1]} rank{'s' * (ranks[1] != 1)}):"
                         f" a rank's folder is missing from {small}, or the two are dumps of different models;"
                         f" copy every rank's folder")


def _diff_tolerance(diff: list[str], trace_a, trace_b, tol) -> int:
    """Judge the DIFF keys of two dump folders: the first far key, and how many are close / far."""
    from .trace.compare import key_metrics

    far, close, unjudged = [], 0, 0
    for key in diff:
        ra, rb = trace_a.raw(key), trace_b.raw(key)
        if ra is None or rb is None or ra.shape != rb.shape:
            unjudged += 1
            continue
        if tol.for_key(key)[0].holds(key_metrics(ra, rb)):
            close += 1
        else:
            far.append(key)
    console.print(Text.assemble("first far: ", (far[0] if far else "none", "bold magenta" if far else "bold green"),
                                f"  (tolerance {tol.spec()}: {close} close, {len(far)} far"
                                + (f", {unjudged} not judged" if unjudged else "") + ")"))
    return 1 if far or unjudged else 0


def counts_table(counts) -> Table:
    table = Table()
    table.add_column("status")
    table.add_column("keys", justify="right", no_wrap=True)
    for st, n in counts.items():
        if n:
            table.add_row(st.value, str(n))
    return table


def _session(config: RunConfig):
    from .session.session import Session

    model = load_model(config)
    prompt = resolve_prompt(config, model)
    ref, sub = engines_from_options(config, model)
    return Session(model, prompt, config.tokens, reference=ref, subject=sub, kv=config.kv, deep=config.deep,
                   cache=cache_from_options(config))


def _engine_notes(engine) -> None:
    for note in getattr(engine, "notes", ()):
        err_console.print(f"note: {note}")


def _cache_notes(session) -> None:
    """What the engines and the reference cache did, on stderr (stdout stays the report)."""
    for note in session.notes:
        err_console.print(f"note: {note}")
    for note in session.cache.notes if session.cache else ():
        err_console.print(f"note: {note}")
    if session.reference_cached:
        err_console.print(f"note: the reference came from the cache ({session.cache.folder}); --no-cache"
                          f" computes it")


def _check_subject(args: argparse.Namespace, config: RunConfig,
                   allowed: tuple[str, ...] = names(flag_subject=True)) -> None:
    name = args.subject
    if name is not None and config.profile is not None:
        raise UsageError(f"--subject {name} and --profile {args.profile}: the profile names the subject; drop one")
    if name is not None and name not in allowed:
        raise UsageError(f"--subject {name!r}: choose {', '.join(allowed)} (cpu is the reference;"
                         f" any engine through --profile)")


def _settings(args: argparse.Namespace, session):
    """RunSettings from --exact (the subject's binary toggles) and the run switches."""
    from .session.session import RunSettings

    exact = (session.initial_settings().exact if args.exact is None
             else parse_exact(args.exact, session.binary_toggles))
    # graft has no --prefill/--forcing: its subject takes the reference's prefill and tokens
    settings = RunSettings(exact, getattr(args, "mode", "chain"), getattr(args, "prefill", "reference"),
                           getattr(args, "forcing", "teacher"))
    for item in getattr(args, "toggle", None) or []:
        settings = _set_toggle(settings, session, item)
    return settings


def _set_toggle(settings, session, item: str):
    """--toggle NAME=VALUE on these settings."""
    name, sep, value = item.partition("=")
    names = [t.name for t in session.toggles]
    if not sep or name not in names:
        raise UsageError(f"--toggle {item!r}: expected NAME=VALUE with NAME one of {', '.join(names) or '(none)'}")
    t = session.toggles[names.index(name)]
    if value not in t.values:
        raise UsageError(f"--toggle {item!r}: {name} takes {', '.join(t.values)}")
    return settings.pick(t, value)


def cmd_run(args: argparse.Namespace, config: RunConfig) -> int:
    from .session.session import SideFailed

    _check_subject(args, config)
    tol = _tolerance(args, config)
    session = _session(config)
    settings = _settings(args, session)
    try:
        with console.status(f"reference + {session.subject} ({session.label(settings)})"):
            res = session.run(settings)
    except SideFailed as e:  # the reference, or a subject that finished nothing: no report to make
        _cache_notes(session)
        return _engine_failed(args, e.failure)
    _cache_notes(session)
    for note in res.notes:
        if res.failed is None or note != res.failed.reason:  # the failure is the last line, said once
            err_console.print(f"note: {note}")
    summary = res.tolerance(tol) if tol is not None else None
    report = run_report(res, summary)
    if res.failed is not None:  # the keys that ran are reported; the exit says the run is not whole
        if not args.json:
            print_run(res, summary)
        return _engine_failed(args, res.failed, report=report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_run(res, summary)
    if summary is not None:
        return 0 if summary.all_close else 1
    return 0 if res.all_ok else 1


def _parallel(trace) -> dict | None:
    """The world size and ranks a side ran on (a tensor- or expert-parallel engine's); None: one process."""
    parallel = getattr(trace, "parallel", None)
    return parallel.as_dict() if parallel is not None and hasattr(parallel, "as_dict") else None


def run_report(res, summary=None) -> dict:
    """The `run --json` object; a ToleranceSummary adds tolerance, first_far, counts_close_far, key_metrics."""
    report = _base_report(res)
    if summary is not None:
        report["tolerance"] = summary.tolerance.spec()
        report["first_far"] = summary.first_far
        report["counts_close_far"] = {"close": summary.n_close, "far": summary.n_far,
                                      "unjudged": summary.n_unjudged}
        report["not_close"] = summary.not_close()  # why exit 1 without a far key; None otherwise
        cause = res.cause_of(summary.first_far) if summary.first_far else None
        report["first_far_after"] = cause.as_dict() if cause else None
        report["key_metrics"] = {
            k: ({**summary.metrics[k].as_dict(), "verdict": summary.verdict[k], "rule": summary.rule[k]}
                if k in summary.metrics else None)
            for k, st in res.comparison.status.items() if st is Status.DIFF}
    report["ranks"] = rank_view(res, summary)
    return report


def rank_view(res, summary=None) -> dict | None:
    """Each rank's share of the first DIFF key and of the first far key, judged (trace/ranks.judged); None
    when neither side ran over ranks."""
    from .trace.ranks import judged, split_run

    if not split_run(res.ref, res.sub):
        return None
    tol = summary.tolerance if summary is not None else None
    first_far = summary.first_far if summary is not None else None
    return {"first_diff": judged(res.ref, res.sub, res.comparison.first_diff, tol) if res.comparison.first_diff
            else None,
            "first_far": judged(res.ref, res.sub, first_far, tol) if first_far else None}


def print_rank_view(view: dict | None, which: str, label: str = "  ranks: ") -> None:
    """The line naming the ranks whose share of the first DIFF / far key is off."""
    judged = (view or {}).get(which)
    if judged is not None:
        console.print(Text.assemble(label, judged["line"]))


def _base_report(res) -> dict:
    cmp = res.comparison
    return {
        "settings": {"exact": sorted(res.settings.exact), "mode": res.settings.mode,
                     "prefill": res.settings.prefill, "forcing": res.settings.forcing,
                     "picks": dict(res.settings.picks)},
        "reference": res.ref.backend,
        "subject": res.sub.backend,
        "parallel": {side: _parallel(trace) for side, trace in (("reference", res.ref), ("subject", res.sub))},
        "notes": list(res.notes),
        "missing": res.n_missing,
        "one_side_only": len(res.expected_missing),
        "positions": len(res.sub.positions),
        "first_diff": cmp.first_diff,
        "all_ok": res.all_ok,
        "failed": res.failed.as_dict() if res.failed else None,
        "counts": {st.value: n for st, n in cmp.counts.items()},
        "top1_flips": [{"t": s.t, "ref": s.ref_top1, "sub": s.sub_top1, "ref_margin": s.ref_margin,
                        "near_tie": _near_tie(res, s.t)} for s in res.tokens if s.flip],
        "logprob_mismatch": res.mismatch.as_dict() if res.mismatch is not None else None,
        "events": [e.as_dict() for e in res.events[:MAX_EVENTS]],
        "n_events": {kind: sum(1 for e in res.events if e.kind == kind) for kind in EVENT_KINDS},
        "tokens": [{"t": s.t, "prompt": s.prompt, "ref_top1": s.ref_top1, "sub_top1": s.sub_top1,
                    "n_diff": s.n_diff} for s in res.tokens],
    }


MAX_EVENTS = 200  # of --json's events list (n_events counts them all)
EVENT_KINDS = ("experts", "token", "q8-scale")


def _near_tie(res, t: int) -> bool | None:
    """Whether the top-1 flip at t is a near-tie (trace/events.py); None without both sides' logits."""
    return next((e.near_tie for e in res.events if e.kind == "token" and e.key == f"t{t}_logits"), None)


def print_events(res, summary=None) -> None:
    """What the far keys follow, and the discrete events in the run (a few of each kind)."""
    cause = res.cause_of(summary.first_far) if summary is not None and summary.first_far else None
    if cause is not None:
        console.print(Text.assemble("  after: ", (cause.line, "bold")))
    counts = [(kind, [e for e in res.events if e.kind == kind]) for kind in EVENT_KINDS]
    if not res.events:
        return
    console.print("discrete events: " + ", ".join(f"{len(es)} {kind}" for kind, es in counts if es))
    for kind, es in counts:
        if kind != "token":  # the flips line below lists the tokens
            for e in es[:3]:
                console.print(f"  {e.line}")


def print_run(res, summary=None) -> None:
    cmp = res.comparison
    console.print(f"reference {res.ref.backend} vs subject {res.sub.backend}, {len(res.sub.positions)} positions")
    console.print(counts_table(cmp.counts))
    if res.all_ok:
        shared = len(cmp.status) - len(res.expected_missing)
        console.print(Text.assemble(("all ok", "bold green"), f": {shared} keys over {len(res.sub.positions)} positions"
                                    + (f" ({len(res.expected_missing)} more made by one side only)"
                                       if res.expected_missing else "")))
        if summary is not None:
            print_tolerance(summary)
        return
    if cmp.first_diff is None:  # no DIFF, but keys missing: the subject stopped (its note says why)
        console.print(Text.assemble("no DIFF in what ran; first missing: ", (str(res.first_problem), "yellow"),
                                    f" ({res.n_missing} keys missing)"))
    else:
        console.print(Text.assemble("first DIFF: ", (str(cmp.first_diff), "bold red")))
    st = res.stats(cmp.first_diff) if cmp.first_diff else None
    if st is not None:
        console.print(f"  {st.n_diff}/{st.n} elements differ, max {st.max_ulp} ULP, max abs {st.max_abs_err:.3g},"
                      f" first at [{st.first_index}]: {st.first_a!r} vs {st.first_b!r}")
    view = rank_view(res, summary)
    print_rank_view(view, "first_diff")
    if summary is not None:
        print_tolerance(summary)
        print_rank_view(view, "first_far")
    print_events(res, summary)
    if res.mismatch is not None:
        for line in res.mismatch.tally.lines():
            console.print(line, markup=False, highlight=False)
    flips = [s for s in res.tokens if s.flip]
    console.print(f"top-1 flips: {len(flips)}" + "".join(f"  t{s.t}: {s.ref_top1}->{s.sub_top1}{_margin(res, s)}"
                                                         for s in flips[:8]))


def _margin(res, s) -> str:
    if s.ref_margin is None:
        return ""
    near = _near_tie(res, s.t)
    return f" (margin {s.ref_margin:.3g}{', a near-tie' if near else ''})"


def _fmt_metric(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.3g}"


def print_tolerance(summary) -> None:
    """The first far key (with its metrics), the close/far counts of a ToleranceSummary, and what else
    keeps the run from all close. "first far: none" only when some DIFF key was judged."""
    if summary.first_far is not None:
        m = summary.metrics[summary.first_far]
        ulp = "NaN" if m.max_ulp == NAN_ULP else str(m.max_ulp)
        console.print(Text.assemble("first far: ", (summary.first_far, "bold magenta"),
                                    f" (nmse {_fmt_metric(m.nmse)}, max rel {_fmt_metric(m.max_rel_err)},"
                                    f" max ULP {ulp})"))
    elif summary.n_judged:
        console.print(Text.assemble("first far: ", ("none", "bold green"), f" (tolerance {summary.tolerance.spec()})"
                                    + (f" among the {summary.n_judged} judged DIFF keys" if summary.n_unjudged
                                       else "")))
    elif summary.n_unjudged:
        sides = " and ".join(f"the {s}" for s in summary.no_raw) or "a side"
        console.print(Text.assemble(("no verdict", "bold yellow"), f": none of the {summary.n_unjudged} DIFF keys"
                                    f" has raw values on both sides ({sides} reports hashes only), and a"
                                    f" tolerance judges raw values; give {sides} raw buffers (a process engine's"
                                    f" sidecar) to judge them"))
    parts = [("close", summary.n_close, "yellow"), ("far", summary.n_far, "magenta")]
    line = Text(f"tolerance {summary.tolerance.spec()}: ")
    for i, (name, n, style) in enumerate(parts):
        line.append((", " if i else "") + f"{n} ")
        line.append(name, style)
    if summary.n_unjudged:
        line.append(f", {summary.n_unjudged} DIFF without raw values (not judged)")
    console.print(line)
    why = summary.not_close()
    if why and (summary.n_judged or summary.n_missing):  # else the "no verdict" line said it
        console.print(Text.assemble(("not all close", "bold red"), f": no far key, but {why}"))


def cmd_bisect(args: argparse.Namespace, config: RunConfig) -> int:
    from .session.bisect import bisect
    from .session.session import SideFailed

    _check_subject(args, config)
    far = args.target == "far"
    if args.tol is not None and not far:  # the profile's tolerance is only for --target far
        raise UsageError(f"--tol {args.tol!r}: a tolerance needs --target far (bisect --target ok wants all keys ok)")
    tol = _tolerance(args, config) if far else None
    session = _session(config)
    if tol is not None:
        hash_only = [f"the {side} ({e.name})" for side, e in (("reference", session.reference_engine),
                                                                ("subject", session.subject_engine)) if not e.caps.raw]
        if hash_only:  # no key could ever be judged far or close
            raise UsageError(f"--target far: {' and '.join(hash_only)} reports hashes only, and a tolerance judges"
                             f" raw values; give it raw buffers (a process engine's sidecar) or bisect --target ok")

    def line(move) -> str:
        return move.line() if tol is None else move.line(none="no far key")

    try:
        with console.status("bisecting") as status:
            session.reference()
            _cache_notes(session)

            def on_move(move):
                status.update(f"bisecting: {line(move)}")
                if not args.json:
                    console.print(line(move))
            result = bisect(session, _settings(args, session), on_move=on_move, tol=tol)
    except SideFailed as e:  # the reference: nothing to bisect against
        return _engine_failed(args, e.failure)
    last = session.last
    for note in last.notes if last else ():
        if result.failed is None or note != result.failed.reason:
            err_console.print(f"note: {note}")
    report = {"moves": [{"change": m.change, "before": m.before, "after": m.after} for m in result.moves],
              "all_ok": result.all_ok, "final": sorted(result.final) if result.final is not None else None,
              "minimal": sorted(result.minimal) if result.minimal is not None else None}
    if tol is not None:  # all_ok then means "no far key"
        report.update(target="far", tolerance=tol.spec())
    if result.failed is not None:
        report["failed_trial"] = {"trial": result.failed_trial, "exact": sorted(result.failed_on.exact)}
        if not args.json:
            console.print(Text(f"stopped: the {result.failed.side} failed on the trial {result.failed_trial}"
                               f" ({session.label(result.failed_on)}); no verdict on that set", "bold red"))
        return _engine_failed(args, result.failed, result.failure_line(session.binary_toggles), report=report)
    if args.json:
        print(json.dumps(report, indent=2))
    elif result.all_ok:
        console.print(Text.assemble(("all ok" if tol is None else f"no far key ({tol.spec()})", "bold green"),
                                    f" with {len(result.final)} exact ops; minimal set: ",
                                    (",".join(sorted(result.minimal)) or "(none)", "bold")))
    else:
        console.print(Text(_bisect_not_reached(session, last, tol), "bold red"))
    return 0 if result.all_ok else 1


def cmd_graft(args: argparse.Namespace, config: RunConfig) -> int:
    from .session.graft import graft
    from .session.session import SideFailed

    _check_subject(args, config)
    far = args.target == "far"
    if args.tol is not None and not far:
        raise UsageError(f"--tol {args.tol!r}: --target ok follows DIFF keys, which need no tolerance; drop one")
    tol = _tolerance(args, config) if far else None
    session = _session(config)
    if not session.subject_engine.caps.graft:
        raise UsageError(f"graft: the subject {session.subject_engine.name} cannot take the reference's values at a"
                         f" key; graft on sim, hf or hf-dist (docs/engines-hf.md)")
    settings = _settings(args, session)

    def on_source(src) -> None:
        if not args.json:
            after = f"another source at {src.next_key}" if src.next_key else "every key after it ok" + (
                " or close" if far else "")
            console.print(Text.assemble("grafted ", (src.label, "bold"), f" (first at {src.key}): {after}"))
    try:
        with console.status("grafting"):
            result = graft(session, settings, tol=tol, limit=args.limit, start=args.key, on_source=on_source)
    except SideFailed as e:
        return _engine_failed(args, e.failure)
    report = {"target": result.target, "tolerance": tol.spec() if tol else None, "start": result.start,
              "sources": [{"field": s.site[0], "layer": s.site[1], "key": s.key, "next": s.next_key}
                          for s in result.sources],
              "remaining": result.remaining, "line": result.line()}
    # the run before any graft: each rank's share of its first DIFF and first far key
    view = rank_view(result.first, result.first.tolerance(tol) if tol is not None else None)
    report["ranks"] = view
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        console.print(Text(result.line(), "bold green" if result.remaining is None else "bold red"))
        print_rank_view(view, "first_diff", "before grafting, first DIFF ")
        print_rank_view(view, "first_far", "before grafting, first far ")
    return 0 if result.remaining is None else 1


def cmd_repro(args: argparse.Namespace, config: RunConfig) -> int:
    from .session.repro import write_bundle
    from .session.session import SideFailed

    _check_subject(args, config)
    check_new_path(args.out, "bundle folder")  # before the slow part; write_bundle checks again
    session = _session(config)
    settings = _settings(args, session)
    try:
        with console.status(f"reference + {session.subject} ({session.label(settings)})"):
            result = session.run(settings, record=False)
    except SideFailed as e:
        return _engine_failed(args, e.failure)
    if result.failed is not None:
        return _engine_failed(args, result.failed)
    with console.status("writing the bundle"):
        bundle = write_bundle(session, result, args.out, key=args.key, tol=_tolerance(args, config),
                              max_mb=args.max_mb)
    if args.json:
        print(json.dumps({"path": str(bundle.path), "key": bundle.key, "op": bundle.op, "bytes": bundle.nbytes,
                          "verdict": bundle.verdict, "inputs_note": bundle.inputs_note or None}, indent=2))
    else:
        console.print(bundle.line())
        if bundle.inputs_note:
            console.print(f"note: {bundle.inputs_note}")
    return 0


def cmd_sweep(args: argparse.Namespace, config: RunConfig) -> int:
    from .engines.base import EngineFailed
    from .session.session import Failure, SideFailed
    from .session.sweep import COLUMNS, parse_values, sweep, value_limit

    _check_subject(args, config)
    session = _session(config)
    settings = _settings(args, session)
    values = (parse_values(args.what, args.values, value_limit(session, args.what)) if args.values is not None
              else None)
    try:
        with console.status(f"sweep {args.what}") as status:
            result = sweep(session, args.what, values, _tolerance(args, config), settings,
                           on_row=lambda row: status.update(f"sweep {args.what}: {row.value} done"))
    except SideFailed as e:
        return _engine_failed(args, e.failure)
    except EngineFailed as e:  # the M=1 decode a batch-verify sweep compares with
        return _engine_failed(args, Failure("subject", session.subject_engine.name, str(e)))
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        rows = [[Text(c, "bold red") if i == len(COLUMNS) - 1 and c else c for i, c in enumerate(r.cells())]
                for r in result.rows]
        console.print(whole_columns_table(f"sweep {result.what} against {result.baseline} ({result.settings})",
                                          [(c, True) for c in COLUMNS], rows))
        console.print(Text(result.line(), "bold red" if result.changes else "bold green"))
        for note in result.notes:
            err_console.print(f"note: {note}", markup=False, highlight=False)
    return 1 if result.changes else 0


def _bisect_not_reached(session, last, tol) -> str:
    """Why bisection ended short of its target, from its last run (a DIFF left with every op exact,
    or no DIFF but keys missing: then the set is named, every op need not be exact)."""
    if tol is None:
        if last is not None and last.first_diff is None:
            return f"no DIFF with {session.label(last.settings)}, but {last.n_missing} keys missing"
        return "still DIFF with every op exact"
    summary = last.tolerance(tol) if last is not None else None
    if summary is not None and summary.first_far is None and summary.not_close():
        return f"no far key ({tol.spec()}) with {session.label(last.settings)}, but {summary.not_close()}"
    return f"still far ({tol.spec()}) with every op exact"


def cmd_iso(args: argparse.Namespace, config: RunConfig) -> int:
    from .backends.cuda.options import CudaOptions
    from .session.inputs import DEFAULT_SUBJECT, side_specs
    from .session.iso import iso
    from .session.session import Failure
    from .engines.base import EngineFailed
    from .engines.build import make_backend

    if config.profile is not None:
        _check_subject(args, config)
    name = config.profile.subject.engine if config.profile is not None else config.subject or DEFAULT_SUBJECT
    iso_subjects = names(builtin=True, flag_subject=True)
    if name not in iso_subjects:
        raise UsageError(f"--subject {name!r}: iso runs batch-verify inside a built-in backend;"
                         f" choose {' or '.join(iso_subjects)}")
    spec = side_specs(config)["subject"]
    model = load_model(config)
    prompt = resolve_prompt(config, model, n_new=args.m, flag="--m")  # iso decodes M tokens, not --tokens
    if spec.engine != "cuda" and config.cuda_options:
        raise UsageError(f"--cuda-options {config.cuda_options}: the iso subject is {spec.engine}, not cuda;"
                         f" drop it, or run --subject cuda")
    exact = parse_exact(args.exact)
    cuda_options = CudaOptions.of(spec.options, config.cuda_options) if spec.engine == "cuda" else None
    try:
        with console.status(f"iso M={args.m}"):
            cols = iso(lambda: make_backend(spec.engine, model, kv=config.kv, exact=exact, cuda_options=cuda_options),
                       prompt, args.m)
    except EngineFailed as e:
        return _engine_failed(args, Failure("subject", spec.engine, str(e)))
    if args.json:
        print(json.dumps([c.__dict__ for c in cols], indent=2))
    else:
        rows = [[str(c.j), str(c.t), str(c.token), Text(str(c.ndiff), "red" if c.ndiff else "green"),
                 "-" if c.first_index is None else str(c.first_index), str(c.max_ulp),
                 c.first_diff_key or "-", f"{c.top1_single}/{c.top1_batch}"] for c in cols]
        columns = [("col", True), ("pos", True), ("token", True), ("ndiff", True), ("first logit", True),
                   ("max ULP", True), ("first DIFF key", True), ("top1 M=1/batch", False)]
        console.print(whole_columns_table(f"batch-verify M={args.m} vs M=1 ({spec.engine}, exact: {args.exact})",
                                          columns, rows))
    return 0 if all(c.ndiff == 0 for c in cols) else 1


def cmd_logprobs(args: argparse.Namespace, config: RunConfig | None = None) -> int:
    """Two JSONL files of chosen-token log-probabilities: the mismatch figures; exit 0 when every scored
    token's two log-probabilities are the same float, 1 when one differs (docs/decisions.md)."""
    from .terminal import bytes_bar
    from .text import inert
    from .trace.logprob_files import compare_files, total_bytes
    from .trace.logprobs import bin_labels

    replay = config is not None and (args.model is not None or args.profile is not None)
    if args.tol is not None and not replay:
        raise UsageError(f"--tol {args.tol!r}: it judges the replay of the worst sequence, which needs --profile"
                         f" (or --model); give one or drop --tol")
    with bytes_bar("reading logprobs", total_bytes(args.a, args.b)) as progress:
        result = compare_files(args.a, args.b, progress)
    tally, worst = result.tally, result.worst
    report = {"a": args.a, "b": args.b, **tally.figures(), "worst_token": worst.as_dict() if worst else None}
    if not args.json:
        console.print(f"{inert(args.a)} (reference) vs {inert(args.b)} (subject)")
        for line in tally.lines():
            console.print(line)
        if worst is not None:
            console.print(f"  largest |log-ratio| {tally.worst[0]:.3e}: line {worst.line}, token {worst.token_id}"
                          f" (A[{worst.index_a}] {worst.logprob_a:.6g}, B[{worst.index_b}] {worst.logprob_b:.6g})")
        rows = [[label, str(n), f"{n / tally.tokens:.2%}"] for label, n in zip(bin_labels(), tally.histogram) if n]
        console.print(whole_columns_table("log-ratio (B - A) histogram", [("log-ratio", True), ("tokens", True),
                                                                           ("share", True)], rows))
    verdict = 0 if tally.bitwise == tally.tokens else 1
    if not replay:
        if args.json:
            print(json.dumps(report, indent=2))
        return verdict
    return _replay_worst(args, config, worst, report, verdict)


def _replay_worst(args: argparse.Namespace, config: RunConfig, worst, report: dict, verdict: int) -> int:
    """The worst sequence through the session (session/logprob_replay.py): its first far key and the graft
    from there, after the figures (with --json, under "replay")."""
    from .session.logprob_replay import replay_worst
    from .session.session import SideFailed

    model = load_model(config)
    ref, sub = engines_from_options(config, model)
    tol = _tolerance(args, config)
    try:
        with console.status(f"replaying line {worst.line} ({worst.index} tokens) and grafting"):
            session, result = replay_worst(model, worst.token_ids, worst.index, ref, sub, kv=config.kv,
                                           deep=config.deep, tol=tol)
    except SideFailed as e:
        return _engine_failed(args, e.failure, report=report)
    replay = {"line": worst.line, "positions": session.n_tokens + 1, "tolerance": tol.spec(),
              "first_far": result.start, "sources": [{"field": s.site[0], "layer": s.site[1], "key": s.key,
                                                      "next": s.next_key} for s in result.sources],
              "remaining": result.remaining, "graft": result.line()}
    if args.json:
        print(json.dumps({**report, "replay": replay}, indent=2))
    else:
        console.print(f"replay of line {worst.line} ({replay['positions']} positions, {session.reference_engine.name}"
                      f" vs {session.subject}, tolerance {tol.spec()}): first far key {result.start or 'none'}")
        console.print(Text(result.line(), "bold green" if result.remaining is None else "bold red"))
    return verdict


def cmd_export(args: argparse.Namespace, config: RunConfig) -> int:
    from .model.gguf import write_gguf

    if not str(args.out).lower().endswith(".gguf"):
        raise UsageError(f"--out {args.out}: a GGUF file name ends in .gguf (so that --model takes it back)")
    out = check_new_path(args.out, "GGUF file")  # before the slow part; write_gguf checks again
    model = load_model(config)
    cfg = model.cfg
    with console.status(f"writing {out} ({model.fmt})"):
        notes = write_gguf(model, out)
    for note in notes:
        console.print(f"note: {note}")
    console.print(f"wrote {out}: {cfg.arch.replace('_', '')}, {cfg.n_layers} layers, {model.fmt} weights,"
                  f" {out.stat().st_size / 2**20:.1f} MiB")
    return 0


def cmd_bench(args: argparse.Namespace, config: RunConfig) -> int:
    from .bench import run_bench

    return run_bench(args, config)


def cmd_tui(args: argparse.Namespace, config: RunConfig) -> int:
    from .app.main import run_app

    _check_subject(args, config, ("auto", *names(flag_subject=True)))
    return run_app(config)
