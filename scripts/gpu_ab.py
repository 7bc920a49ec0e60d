"""A/B of launch configurations on the full-size synthetic model: for each configuration
(environment variables the cuda backend reads when it is built, e.g. KESTREL_CUDA_FOLD or
KESTREL_CUDA_FUSE), the device time of one M=1 decode-graph replay at context --ctx, median
of --steps replays, fast and exact. One process, one model: the configurations differ only
in how the step is launched, so the medians are comparable within a run.

    python3 scripts/gpu_ab.py 'default=' 'no-folds=KESTREL_CUDA_FOLD=' 'separate=KESTREL_CUDA_FUSE=0'
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(spec: str) -> tuple[str, dict[str, str]]:
    label, _, rest = spec.partition("=")
    env = {}
    for item in filter(None, rest.split(";")):
        k, _, v = item.partition("=")
        env[k] = v
    return label, env


def replay_ms(model, exact: frozenset, ctx: int, steps: int) -> tuple[float, int]:
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.cuda.perf import prefill

    b = make_cuda_backend(model, exact=exact, graph=True)
    b.reset(ctx + steps + 8)
    prompt = np.random.default_rng(1).integers(0, model.cfg.vocab, ctx).astype(np.int32)
    prefill(b, prompt)
    tok = int(prompt[-1])
    b.step(np.array([tok]), ctx, raw=False)  # captures the graph
    g = b._graph
    if g is None:
        raise RuntimeError(f"no decode graph: {b.graph_status}")
    cuda, times = b.rt.cuda, []
    with b.rt.active():
        for i in range(steps):
            e0, e1 = cuda.Event(), cuda.Event()
            e0.record(g.stream)
            g.launch(tok, ctx + 1 + i)
            e1.record(g.stream)
            e1.synchronize()
            times.append(e0.time_till(e1))
    return float(np.median(times[2:])), g.n_nodes


def main() -> None:
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.backends.toggles import TOGGLES
    from kestrel_tui.model.config import qwen3_30b_a3b_config

    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+", help="label=VAR=value;VAR2=value (empty: the defaults)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    model = DeviceSyntheticModel(qwen3_30b_a3b_config(args.layers), name="ab")
    base = dict(os.environ)
    print(f"{'config':24} {'fast ms':>8} {'exact ms':>9} {'exact/fast':>10} {'nodes':>6}", flush=True)
    for spec in args.configs:
        label, env = parse(spec)
        os.environ.clear()
        os.environ.update(base)
        os.environ.update(env)
        fast, nodes = replay_ms(model, frozenset(), args.ctx, args.steps)
        exact, _ = replay_ms(model, frozenset(TOGGLES), args.ctx, args.steps)
        print(f"{label:24} {fast:8.3f} {exact:9.3f} {exact / fast:10.3f} {nodes:6d}", flush=True)


if __name__ == "__main__":
    main()
