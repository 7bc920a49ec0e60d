"""The cuda backend's bits and speed, for comparing two trees of this project on one GPU.

    python3 scripts/gpu/gpu_same_bits.py --out after.json       # with PYTHONPATH at one tree, then the other
    python3 scripts/gpu/gpu_same_bits.py --compare before.json after.json
    python3 scripts/gpu/gpu_same_bits.py --ab BEFORE_TREE AFTER_TREE --pairs 2 --dir out/

--ab runs --out in each tree, alternating process by process (before, after, before, after, ...:
a machine's drift then falls on both), and prints each section's bits over every pair and each
figure per process with the medians.

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
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def summary(before: list[dict], after: list[dict]) -> list[str]:
    """The lines --ab prints for the runs of two trees (--out's JSON, alternated): a section is "same
    bits" only if every key of it is equal in every pair; a figure lists each process's value."""
    lines = []
    for sec in before[0]["bits"]:
        diff = sorted({k for x, y in zip(before, after) for k in x["bits"][sec]
                       if x["bits"][sec][k] != y["bits"].get(sec, {}).get(k)})
        n = len(before[0]["bits"][sec])
        pairs = f" ({len(before)} pairs)" if len(before) > 1 else ""
        lines.append(f"{sec:<28} {n:>7} keys  " + (f"same bits{pairs}" if not diff else
                                                   f"{len(diff)} keys differ{pairs}, first {diff[0]}"))
    for m in before[0]["ms"]:
        xs, ys = [r["ms"][m] for r in before], [r["ms"].get(m) for r in after]
        if None in ys:  # a tree from before the device time was recorded
            continue
        mx, my = statistics.median(xs), statistics.median(ys)
        lines.append(f"full-size {m:<18} {' / '.join(f'{v:.3f}' for v in xs)} -> {' / '.join(f'{v:.3f}' for v in ys)}"
                     f" ms; median {mx:.3f} -> {my:.3f} ({my - mx:+.3f})")
    return lines


def ab(trees: list[str], pairs: int, out_dir: Path, steps: int) -> None:
    """--out in each tree (its own kestrel_tui first on PYTHONPATH), alternating, then summary()."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[list[dict]] = [[], []]
    for i in range(pairs):
        for t, tree in enumerate(trees):
            out = out_dir / f"{'ab'[t]}{i + 1}.json"
            path = os.pathsep.join(p for p in (str(Path(tree).resolve()), os.environ.get("PYTHONPATH")) if p)
            rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--out", str(out.resolve()),
                                 "--steps", str(steps)], cwd=tree, env={**os.environ, "PYTHONPATH": path}).returncode
            if rc:
                sys.exit(f"gpu_same_bits.py --ab: the run in {tree} exited with {rc} (its output is above)")
            runs[t].append(json.loads(out.read_text()))
    print("\n".join(summary(*runs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ab", nargs=2, metavar=("BEFORE_TREE", "AFTER_TREE"))
    ap.add_argument("--pairs", type=int, default=2, help="--ab: processes a tree")
    ap.add_argument("--dir", default="same-bits", help="--ab: where each process's JSON goes")
    a = ap.parse_args()
    if a.ab:
        ab(a.ab, a.pairs, Path(a.dir), a.steps)
        return
    if a.compare:
        x, y = (json.load(open(p)) for p in a.compare)
        print("\n".join(summary([x], [y])))
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
