"""One reference, several subject settings: first DIFF, first far key and top-1 flips for each.

The headless `run` recomputes the reference per call; a findings table wants one
reference and many subject settings, each named like `run`'s flags:

    python scripts/findings.py --profile profiles/cpu-vs-hf.toml \\
        "prefill=subject" "prefill=subject,exact=attn+prefill" "prefill=subject,toggle=dtype:bfloat16"

A setting is comma-separated: exact=A+B (the subject's binary toggles switched to
exact; default: each toggle's default), toggle=NAME:VALUE (repeatable), prefill=,
forcing=, mode=. Prints one row per setting and writes --json FILE.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_tui.session.inputs import engines_from_options, model_from_options, resolve_prompt, run_config  # noqa: E402
from kestrel_tui.session.session import Session  # noqa: E402
from kestrel_tui.trace.compare import Status, parse_tolerance  # noqa: E402


def settings_of(session: Session, spec: str):
    s = session.initial_settings()
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if name == "exact":
            s = replace(s, exact=frozenset(v for v in value.split("+") if v and v != "none"))
        elif name == "toggle":
            tname, _, tval = value.partition(":")
            t = next(t for t in session.toggles if t.name == tname)
            s = s.pick(t, tval)
        elif name in ("prefill", "forcing", "mode"):
            s = replace(s, **{name: value})
        else:
            raise SystemExit(f"setting {item!r}: expected exact=, toggle=, prefill=, forcing= or mode=")
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model")
    ap.add_argument("--weights", choices=("q4_0", "f32"), help="overrides the profile's")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("settings", nargs="+")
    cli = ap.parse_args()
    config = run_config(profile=cli.profile, model=cli.model, weights=cli.weights)
    model = model_from_options(config)
    prompt = resolve_prompt(config, model)
    ref, sub = engines_from_options(config, model)
    session = Session(model, prompt, config.tokens, reference=ref, subject=sub, kv=config.kv, deep=config.deep)
    tol = config.tolerance or parse_tolerance("nmse=1e-7")
    t0 = time.perf_counter()
    session.reference()
    print(f"reference {ref.name}: {len(prompt)} + {config.tokens} positions in {time.perf_counter() - t0:.1f} s;"
          f" tolerance {tol.spec()}")
    rows = []
    for spec in cli.settings:
        settings = settings_of(session, spec)
        t0 = time.perf_counter()
        res = session.run(settings)
        summary = res.tolerance(tol)
        flips = [(s.t, s.ref_top1, s.sub_top1) for s in res.tokens if s.flip]
        row = {"setting": spec, "subject": res.sub.backend, "first_diff": res.first_diff,
               "first_far": summary.first_far, "n_ok": res.comparison.counts[Status.OK],
               "n_close": summary.n_close, "n_far": summary.n_far, "flips": flips, "notes": list(res.notes),
               "seconds": round(time.perf_counter() - t0, 2)}
        rows.append(row)
        print(f"{spec:<48} {res.sub.backend:<40} first DIFF {res.first_diff or '-':<16} first far"
              f" {summary.first_far or '-':<16} close {summary.n_close:>5} far {summary.n_far:>5}"
              f" flips {len(flips)}" + (f"  notes: {'; '.join(res.notes)}" if res.notes else ""))
    if cli.json:
        Path(cli.json).write_text(json.dumps({"profile": cli.profile, "tolerance": tol.spec(), "rows": rows},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
