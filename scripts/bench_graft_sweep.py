"""How long graft and sweep take on the embedded model, and that they reuse the reference.

    python scripts/bench_graft_sweep.py [--tokens 16] [--runs 3]

One session (the embedded default model, 48 layers, the sim subject): the reference is computed
once, then timed: a sweep of the batch-verify width M over 8 values (1..8, every op fast), a sweep
of one toggle over its two values, and a graft of every source with every op exact but norm
(limit 8). The reference engine's runs are counted: graft and sweep must not run it again.
Prints a Markdown table (median, min and max over --runs); results/graft-sweep-bench.md records a run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_tui.backends.toggles import TOGGLES  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.session.graft import graft  # noqa: E402
from kestrel_tui.session.inputs import default_prompt  # noqa: E402
from kestrel_tui.session.session import RunSettings, Session  # noqa: E402
from kestrel_tui.session.sweep import sweep  # noqa: E402
from kestrel_tui.trace.compare import Tolerance  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    model = load_model(None)
    ref = make_engine("cpu", model)
    calls = {"n": 0}
    run = ref.run

    def counted(req):
        calls["n"] += 1
        return run(req)
    ref.run = counted
    session = Session(model, default_prompt(model.cfg.vocab), a.tokens, reference=ref, subject="sim")
    t0 = time.perf_counter()
    session.reference()
    ref_s = time.perf_counter() - t0
    fast = RunSettings(exact=frozenset())
    jobs = {
        "sweep M 1..8 (all fast)": lambda: sweep(session, "m", list(range(1, 9)), Tolerance(), fast),
        "sweep toggle:norm fast,exact": lambda: sweep(session, "toggle:norm", ["fast", "exact"], Tolerance(), fast),
        "graft, all exact but norm, limit 8": lambda: graft(session, RunSettings(exact=frozenset(TOGGLES) - {"norm"})),
    }
    rows = []
    for name, job in jobs.items():
        times = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            job()
            times.append(time.perf_counter() - t0)
        rows.append((name, statistics.median(times), min(times), max(times)))
    print(f"embedded model ({model.cfg.n_layers} layers), {len(session.prompt)} prompt + {a.tokens} tokens;"
          f" the reference once: {ref_s:.2f} s; reference runs in all: {calls['n']}")
    print("\n| job | median s | min s | max s |\n|---|---|---|---|")
    for name, med, lo, hi in rows:
        print(f"| {name} | {med:.2f} | {lo:.2f} | {hi:.2f} |")


if __name__ == "__main__":
    main()
