"""The cuda backend's bits and speed, for comparing two trees of this project on one GPU.

    python3 scripts/gpu/gpu_same_bits.py --out after.json       # with PYTHONPATH at one tree, then the other
    python3 scripts/gpu/gpu_same_bits.py --compare before.json after.json

Every key's hash of: batch-verify steps M = 2..8 after a prefill, on the embedded model and on
Qwen3-30B-A3B's dims with 4 layers, fast and exact; M=1 steps replayed as a CUDA graph and the
same steps launched directly; the full-size 48-layer model decoding fast and exact. Then the
full-size decode speed (perf.decode_bench, context 1024): a step's wall time with and without
hashing, and the device time of a graph replay (CUDA events), the figure to compare: it moves
±0.01 ms between processes where the wall time moves ±0.1 (results/gpu-h200-speed.md).
Uses only what both trees have: make_cuda_backend(model, exact=, graph=), reset, step,
decode_bench (kestrel_tui/perf/cuda.py since commit 380c10f; kestrel_tui/backends/cuda/perf.py in
older trees). results/gpu-h200-same-bits.md records a run.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def hashes(b, prompt, steps) -> dict[str, str]:
    """Every key's hash: the prompt as one step, then each step's tokens as one step of M columns."""
    b.reset(len(prompt) + sum(len(s) for s in steps) + 1)
    out: dict[str, str] = {}
    pos = 0
    for toks in [prompt, *steps]:
        for col in b.step(np.array(toks, np.int32), pos, raw=False).hashes:
            out.update({k: f"{v:016x}" for k, v in col.items()})
        pos += len(toks)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    if a.compare:
        x, y = (json.load(open(p)) for p in a.compare)
        for sec in x["bits"]:
            diff = [k for k in x["bits"][sec] if x["bits"][sec][k] != y["bits"].get(sec, {}).get(k)]
            print(f"{sec:<28} {len(x['bits'][sec]):>7} keys  {'same bits' if not diff else f'{len(diff)} differ, first {diff[0]}'}")
        for m in x["ms"]:
            if m in y["ms"]:  # a tree's json from before device time was recorded lacks it
                print(f"full-size {m:<18} {x['ms'][m]:.3f} -> {y['ms'][m]:.3f} ms/token"
                      f" ({100 * (y['ms'][m] / x['ms'][m] - 1):+.1f} %)")
        return

    from kestrel_tui.backends.cuda import make_cuda_backend
    try:
        from kestrel_tui.perf import cuda as perf
    except ImportError:  # a tree from before 380c10f: the bench code inside the backend
        from kestrel_tui.backends.cuda import perf
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.backends.toggles import TOGGLES
    from kestrel_tui.model.config import default_config, qwen3_30b_a3b_config
    from kestrel_tui.model.weights import synthetic_model

    modes = {"exact": frozenset(TOGGLES), "fast": frozenset()}
    res: dict = {"bits": {}, "ms": {}}
    t0 = time.time()
    models = {"default": synthetic_model(default_config()),
              "30b4": DeviceSyntheticModel(qwen3_30b_a3b_config(4), name="30b4")}
    prompt = [5, 900, 17, 33, 2, 71, 8, 1000]
    for mname, model in models.items():
        for mode, exact in modes.items():
            b = make_cuda_backend(model, exact=exact)
            res["bits"][f"{mname} {mode} M=2..8"] = hashes(b, prompt, [[(7 * M + j) % 1000 for j in range(M)]
                                                                      for M in range(2, 9)])
            singles = [[(11 * i + 3) % 1000] for i in range(6)]
            res["bits"][f"{mname} {mode} graph"] = hashes(b, prompt, singles)
            res["bits"][f"{mname} {mode} direct"] = hashes(make_cuda_backend(model, exact=exact, graph=False), prompt,
                                                           singles)
            print(f"{mname} {mode}: {time.time() - t0:.0f} s", flush=True)
    full = DeviceSyntheticModel(qwen3_30b_a3b_config(48), name="30b48")
    for mode, exact in modes.items():
        res["bits"][f"30b48 {mode} decode"] = hashes(make_cuda_backend(full, exact=exact), prompt,
                                                     [[(13 * i + 1) % 1000] for i in range(4)])
    r = perf.decode_bench(full, ctx=1024, steps=a.steps, log=lambda *_: None)
    for mode in modes:
        res["ms"][f"{mode} (graph)"] = r[mode]["graph_ms"]
        res["ms"][f"{mode} (no hashing)"] = r[mode]["graph_nohash_ms"]
        if r[mode].get("graph_gpu_ms") is not None:  # older trees' decode_bench does not time it
            res["ms"][f"{mode} (device)"] = r[mode]["graph_gpu_ms"]
    print({k: round(v, 3) for k, v in res["ms"].items()}, f"{time.time() - t0:.0f} s", flush=True)
    json.dump(res, open(a.out, "w"))


if __name__ == "__main__":
    main()
