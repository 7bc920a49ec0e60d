"""The headless subcommands behind cli.py; each returns the process exit status."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from .cli import console
from .errors import UsageError
from .model.weights import Model

DEFAULT_PROMPT_LEN = 16


def default_prompt(vocab: int, n: int = DEFAULT_PROMPT_LEN) -> list[int]:
    """The embedded model has no tokenizer: a fixed, spread-out id sequence."""
    return [(1 + 7919 * i) % vocab for i in range(n)]


def load_model_args(args: argparse.Namespace) -> Model:
    from .model.hf import load_model

    return load_model(args.model, args.weights)


def resolve_prompt(args: argparse.Namespace, model: Model) -> list[int]:
    cfg = model.cfg
    if getattr(args, "prompt_ids", None):
        try:
            ids = [int(tok) for tok in args.prompt_ids.split(",") if tok.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers like 1,2,3") from None
        bad = [i for i in ids if not 0 <= i < cfg.vocab]
        if bad:
            raise UsageError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary 0..{cfg.vocab - 1}")
    elif getattr(args, "prompt", None) is not None:
        if model.tokenizer is None:
            raise UsageError("--prompt needs a model with tokenizer.json; use --prompt-ids for this model")
        ids = model.tokenizer.encode(args.prompt).ids
    else:
        ids = default_prompt(cfg.vocab)
    if not ids:
        raise UsageError("the prompt is empty; give at least one token")
    tokens = getattr(args, "tokens", 0)
    if tokens < 1:
        raise UsageError(f"--tokens {tokens}: must be at least 1")
    if len(ids) + tokens > cfg.max_positions:
        raise UsageError(f"prompt ({len(ids)}) + tokens ({tokens}) exceeds the model's context of"
                         f" {cfg.max_positions} positions; shorten the prompt or use fewer --tokens")
    return ids


def check_output_path(path: str) -> Path:
    out = Path(path)
    if out.exists():
        raise UsageError(f"{out}: already exists; kestrel-tui never overwrites — choose another --out")
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent}: no such directory for --out")
    return out


def cmd_dump(args: argparse.Namespace) -> int:
    from .engine.build import make_backend
    from .engine.run import run_decode
    from .trace.dump import DumpWriter

    out = check_output_path(args.out)
    model = load_model_args(args)
    prompt = resolve_prompt(args, model)
    backend = make_backend(args.backend, model, kv=args.kv, exact=args.exact, deep=args.deep)
    try:
        writer = DumpWriter(out)
    except OSError as e:
        raise UsageError(f"{out}: cannot create ({e.strerror}); choose a writable --out") from None
    with writer, console.status(f"{backend.describe()}: {len(prompt)}+{args.tokens} positions"):
        def write(pos):
            for key, h in pos.hashes.items():
                writer.write(key, h)
        trace = run_decode(backend, prompt, args.tokens, raw=False, on_position=write)
    n_keys = sum(len(p.hashes) for p in trace.positions)
    console.print(f"wrote {out}: {len(trace.positions)} positions, {n_keys} keys ({backend.describe()})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .backends.base import NumpyBackend
    from .engine.run import run_decode

    model = load_model_args(args)
    prompt = resolve_prompt(args, model)
    trace = run_decode(NumpyBackend(model, kv=args.kv), prompt, args.tokens, raw=False)
    ids = trace.generated[: args.tokens]
    console.print(" ".join(map(str, ids)))
    if model.tokenizer is not None:
        console.print(model.tokenizer.decode(ids), markup=False)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from .trace.compare import Status, compare
    from .trace.dump import read_dump

    a, b = read_dump(args.a), read_dump(args.b)
    if args.tui:
        from .app.main import run_diff_app

        return run_diff_app(args.a, args.b, a, b)
    cmp = compare(a, b)
    if cmp.identical:
        console.print(f"[green]identical[/]: {len(a)} keys")
        return 0
    table = Table(title=f"{args.a} vs {args.b}")
    table.add_column("status")
    table.add_column("keys", justify="right")
    for st in Status:
        n = cmp.counts.get(st, 0)
        if n:
            table.add_row(st.value, str(n))
    console.print(table)
    first = cmp.first_diff or cmp.first_mismatch
    if cmp.first_diff:
        console.print(f"first DIFF: [bold red]{cmp.first_diff}[/]  {a[cmp.first_diff]:016x} != {b[cmp.first_diff]:016x}")
    if first != cmp.first_diff:
        console.print(f"first missing: [yellow]{first}[/] ({cmp.status[first].value})")
    return 1


def _session(args: argparse.Namespace):
    from .engine.session import Session

    model = load_model_args(args)
    prompt = resolve_prompt(args, model)
    return Session(model, prompt, args.tokens, subject=args.subject, kv=args.kv, deep=args.deep)


def _check_subject(name: str) -> None:
    if name not in ("sim", "cuda"):
        raise UsageError(f"--subject {name!r}: choose sim or cuda (cpu is the reference)")


def cmd_run(args: argparse.Namespace) -> int:
    from .backends.toggles import parse_exact
    from .engine.session import RunSettings

    _check_subject(args.subject)
    settings = RunSettings(parse_exact(args.exact), args.mode, args.prefill, args.forcing)
    session = _session(args)
    with console.status(f"reference + {args.subject} ({settings.label()})"):
        res = session.run(settings)
    report = run_report(res)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_run(res)
    return 0 if res.all_ok else 1


def run_report(res) -> dict:
    cmp = res.comparison
    return {
        "settings": {"exact": sorted(res.settings.exact), "mode": res.settings.mode,
                     "prefill": res.settings.prefill, "forcing": res.settings.forcing},
        "subject": res.sub.backend,
        "positions": len(res.sub.positions),
        "first_diff": cmp.first_diff,
        "all_ok": res.all_ok,
        "counts": {st.value: n for st, n in cmp.counts.items()},
        "top1_flips": [{"t": s.t, "ref": s.ref_top1, "sub": s.sub_top1} for s in res.tokens if s.flip],
        "tokens": [{"t": s.t, "prompt": s.prompt, "ref_top1": s.ref_top1, "sub_top1": s.sub_top1,
                    "n_diff": s.n_diff} for s in res.tokens],
    }


def print_run(res) -> None:
    cmp = res.comparison
    console.print(f"reference cpu vs subject {res.sub.backend}, {len(res.sub.positions)} positions")
    table = Table()
    for col in ("status", "keys"):
        table.add_column(col, justify="right" if col == "keys" else "left")
    for st, n in cmp.counts.items():
        if n:
            table.add_row(st.value, str(n))
    console.print(table)
    if res.all_ok:
        console.print(f"[bold green]all ok[/]: {len(cmp.status)} keys over {len(res.sub.positions)} positions")
        return
    console.print(f"first DIFF: [bold red]{cmp.first_diff}[/]")
    st = res.stats(cmp.first_diff) if cmp.first_diff else None
    if st is not None:
        console.print(f"  {st.n_diff}/{st.n} elements differ, max {st.max_ulp} ULP, max abs {st.max_abs_err:.3g},"
                      f" first at [{st.first_index}]: {st.first_a!r} vs {st.first_b!r}")
    flips = [s for s in res.tokens if s.flip]
    console.print(f"top-1 flips: {len(flips)}" + "".join(f"  t{s.t}: {s.ref_top1}->{s.sub_top1}" for s in flips[:8]))


def cmd_bisect(args: argparse.Namespace) -> int:
    from .engine.bisect import bisect

    _check_subject(args.subject)
    session = _session(args)
    with console.status("bisecting") as status:
        session.reference()

        def on_move(move):
            status.update(f"bisecting: {move.line()}")
            if not args.json:
                console.print(move.line())
        result = bisect(session, on_move=on_move)
    if args.json:
        print(json.dumps({"moves": [{"change": m.change, "before": m.before, "after": m.after} for m in result.moves],
                          "all_ok": result.all_ok, "final": sorted(result.final),
                          "minimal": sorted(result.minimal) if result.minimal is not None else None}, indent=2))
    elif result.all_ok:
        console.print(f"[bold green]all ok[/] with {len(result.final)} exact ops;"
                      f" minimal set: [bold]{','.join(sorted(result.minimal)) or '(none)'}[/]")
    else:
        console.print("[bold red]still DIFF with every op exact[/]")
    return 0 if result.all_ok else 1


def cmd_iso(args: argparse.Namespace) -> int:
    from .backends.toggles import parse_exact
    from .engine.build import make_backend
    from .engine.iso import iso

    _check_subject(args.subject)
    if args.m < 1:
        raise UsageError(f"--m {args.m}: the batch-verify width must be at least 1")
    model = load_model_args(args)
    args.tokens = max(args.tokens, args.m)
    prompt = resolve_prompt(args, model)
    exact = parse_exact(args.exact)
    with console.status(f"iso M={args.m}"):
        cols = iso(lambda: make_backend(args.subject, model, kv=args.kv, exact=exact), prompt, args.m)
    if args.json:
        print(json.dumps([c.__dict__ for c in cols], indent=2))
    else:
        table = Table(title=f"batch-verify M={args.m} vs M=1 ({args.subject}, exact: {args.exact})",
                      title_justify="left")
        for col in ("col", "pos", "token", "ndiff", "first logit", "max ULP", "first DIFF key", "top1 M=1/batch"):
            table.add_column(col)
        for c in cols:
            table.add_row(str(c.j), str(c.t), str(c.token), f"[{'red' if c.ndiff else 'green'}]{c.ndiff}[/]",
                          "-" if c.first_index is None else str(c.first_index), str(c.max_ulp),
                          c.first_diff_key or "-", f"{c.top1_single}/{c.top1_batch}")
        console.print(table)
    return 0 if all(c.ndiff == 0 for c in cols) else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args)


def cmd_tui(args: argparse.Namespace) -> int:
    from .app.main import run_app

    return run_app(args)
