"""Device time per kernel of one decode step as ncu measures it: one decode-graph replay of the
full-size model at context 1024, bracketed by cuProfilerStart/Stop so that ncu
(--profile-from-start off --graph-profiling node) sees only that replay; then, from ncu's CSV, the
device time per kernel name. (scripts/gpu_acceptance.py --only profile times the same kernels
without ncu, with CUDA events around each launch of a direct step.)

    ncu --profile-from-start off --graph-profiling node --cache-control none \
        --metrics gpu__time_duration.sum --csv \
        python3 scripts/gpu/gpu_ncu_kernel_times.py run --exact none|all [--layers 48] > trace.csv
    python3 scripts/gpu/gpu_ncu_kernel_times.py summarize trace.csv
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def prefilled_backend(exact: str, layers: int, ctx: int, spare: int = 8):
    """The synthetic Qwen3-30B-A3B's cuda backend (decode graph on) with a random prompt of ctx
    tokens prefilled, room for `spare` more: (backend, the prompt's last token). exact: none, all,
    or toggles joined by commas. (gpu_step_timeline.py starts the same way.)"""
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.backends.toggles import parse_exact
    from kestrel_tui.model.config import qwen3_30b_a3b_config
    from kestrel_tui.perf.cuda import prefill

    m = DeviceSyntheticModel(qwen3_30b_a3b_config(layers), name="timeline")
    b = make_cuda_backend(m, exact=parse_exact(exact), graph=True)
    b.reset(ctx + spare)
    prompt = np.random.default_rng(1).integers(0, m.cfg.vocab, ctx).astype(np.int32)
    prefill(b, prompt)
    return b, int(prompt[-1])


def run(args) -> None:
    ctx = args.ctx
    b, tok = prefilled_backend(args.exact, args.layers, ctx)
    for i in range(3):  # capture + warm
        b.step(np.array([tok]), ctx + i, raw=False)
    g = b._graph
    print(b.graph_status, flush=True)
    lib = ctypes.CDLL("libcuda.so.1")
    with b.rt.active():
        b.rt.cuda.Context.synchronize()
        lib.cuProfilerStart()
        for i in range(args.reps):
            g.launch(tok, ctx + 3 + i)
            b.rt.cuda.Context.synchronize()
        lib.cuProfilerStop()


def summarize(args) -> None:
    """Device time per kernel name from `ncu --csv --metrics gpu__time_duration.sum` (kernels
    serialized by the profiler, so no gaps between them)."""
    with open(args.csv) as f:
        lines = [ln for ln in f if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "Kernel Name" in ln), None)
    if start is None:
        sys.exit(f"{args.csv}: no ncu --csv kernel rows (run the profiler with --csv); nothing to summarize")
    per = defaultdict(lambda: [0, 0.0])
    for r in csv.DictReader(lines[start:]):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            v = per[r["Kernel Name"].split("(")[0]]
            v[0] += 1
            v[1] += float(r["Metric Value"].replace(",", "")) * (1e3 if r["Metric Unit"] == "usecond" else 1)
    tot = sum(v[1] for v in per.values())
    print(f"kernels {sum(v[0] for v in per.values())}, kernel time {tot / 1e6:.3f} ms (ncu, serialized)")
    for n, (c, d) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:34} {c:5d} {d / 1e6:8.3f} {d / c / 1e3:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--exact", default="none")
    r.add_argument("--layers", type=int, default=48)
    r.add_argument("--ctx", type=int, default=1024)
    r.add_argument("--reps", type=int, default=1)
    s = sub.add_parser("summarize")
    s.add_argument("csv")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else summarize(args)


if __name__ == "__main__":
    main()
