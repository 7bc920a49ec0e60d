"""A/B of the cuda backend's runtime options: an M=1 decode step's time for each configuration.

On the full-size synthetic model at context --ctx, median of --steps, fast and exact.

A configuration is `label=` (the defaults) or `label=NAME=on|off,...` with the names of
backends/cuda/options.py CudaOptions (graph, pdl, fuse, pv_spread), as `--cuda-options` takes them,
applied to the environment's defaults (KESTREL_CUDA_GRAPH, KESTREL_CUDA_PDL, KESTREL_CUDA_FUSE,
KESTREL_PV_SPREAD). With the graph on, the figure is the device time of one decode-graph replay (CUDA
events on the graph's stream); with graph=off, the wall time of one direct step (CudaBackend.step, the
kernels launched one by one from Python). One process, one model (weights made on the device): the
configurations differ only in how the step is launched, so the medians are comparable within a run
(machines differ by about 0.1 ms). None of the options changes a bit (tests/test_cuda.py).

    python3 scripts/gpu_options_ab.py default= no-fuse=fuse=off no-pdl=pdl=off no-spread=pv_spread=off
    python3 scripts/gpu_options_ab.py graph= direct=graph=off --layers 4

Build options of the kernels (KESTREL_PDL_TRIGGER=0: wait-only) are read once, when the kernels
compile: A/B them with one process each (`KESTREL_PDL_TRIGGER=0 python3 scripts/gpu_options_ab.py wait-only=`).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(spec: str, base):
    """`label=graph=off,pdl=on` -> (label, CudaOptions)."""
    label, _, rest = spec.partition("=")
    return label or "?", base.parse(rest)


def step_ms(model, exact: frozenset, options, ctx: int, steps: int) -> tuple[float, str, str]:
    """(median ms, what was timed, graph nodes or '-') of an M=1 step at positions ctx + 1..."""
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.perf.cuda import prefill

    b = make_cuda_backend(model, exact=exact, options=options)
    b.reset(ctx + steps + 8)
    prompt = np.random.default_rng(1).integers(0, model.cfg.vocab, ctx).astype(np.int32)
    prefill(b, prompt)
    tok = int(prompt[-1])
    b.step(np.array([tok]), ctx, raw=False)  # captures the graph (when the graph option is on)
    cuda, times = b.rt.cuda, []
    if not options.graph:
        for i in range(steps):
            t0 = time.perf_counter()
            b.step(np.array([tok]), ctx + 1 + i, raw=False)
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times[2:])), "direct step, wall", "-"
    g = b._graph
    if g is None:
        raise RuntimeError(f"no decode graph: {b.graph_status}")
    with b.rt.active():
        for i in range(steps):
            e0, e1 = cuda.Event(), cuda.Event()
            e0.record(g.stream)
            g.launch(tok, ctx + 1 + i)
            e1.record(g.stream)
            e1.synchronize()
            times.append(e0.time_till(e1))
    what = f"graph replay, device{'' if g.pdl else ' (no PDL)'}"
    return float(np.median(times[2:])), what, str(g.n_nodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="label=NAME=on|off,... (label=: the defaults)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    from kestrel_tui.backends.cuda.options import CudaOptions
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.backends.toggles import TOGGLES
    from kestrel_tui.errors import UsageError
    from kestrel_tui.model.config import qwen3_30b_a3b_config

    base = CudaOptions.from_env()
    try:
        configs = [parse(spec, base) for spec in args.configs]  # every spec checked before the GPU starts
    except UsageError as e:
        ap.error(str(e))
    model = DeviceSyntheticModel(qwen3_30b_a3b_config(args.layers), name="options-ab")
    print(f"{'config':16} {'options':28} {'fast ms':>8} {'exact ms':>9} {'exact/fast':>10} {'nodes':>6}  timed",
          flush=True)
    for label, options in configs:
        fast, what, nodes = step_ms(model, frozenset(), options, args.ctx, args.steps)
        exact, _, _ = step_ms(model, frozenset(TOGGLES), options, args.ctx, args.steps)
        print(f"{label:16} {options.describe() or 'all on':28} {fast:8.3f} {exact:9.3f} {exact / fast:10.3f}"
              f" {nodes:>6}  {what}", flush=True)


if __name__ == "__main__":
    main()
