"""Device time of a decode step's hash launches, the way the backend splits them, for the key
layout of a model (default: the full-size Qwen3-30B-A3B, M = 1): the body (every key but the
logits, on the hash stream while the final norm and lm_head run) and the logits (on the step's
critical path), each hashed

    scan        every key by fnv_scan, a block a SCAN_MAX-byte segment (what the backend does)
    chunks      every key in chunks: fnv_states + fnv_chunks (the backend before fnv_scan)

over random bytes, checked against the host's FNV-1a 64 (trace.fnv) and timed with CUDA events
(median of --reps launches, each version on its own; where a version launches several
kernels, each of them alone too: the hashes are those of the whole, the kernel's time is its own).

    python3 scripts/gpu/gpu_hash_bench.py [--layers 48] [--m 1] [--reps 200]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


KERNELS = ("fnv_scan", "fnv_states", "fnv_chunks")


def _launches(work, kernel: str) -> bool:
    return work.n_seg > 0 if kernel == "fnv_scan" else work.n_chunks > 0


def main() -> int:
    from kestrel_tui.backends.cuda.backend import device_hash_work, launch_hash
    from kestrel_tui.backends.cuda.layout import HASH_SCAN_MAX, HashWork, Layout
    from kestrel_tui.backends.cuda.runtime import runtime
    from kestrel_tui.model.config import qwen3_30b_a3b_config
    from kestrel_tui.trace.fnv import fnv1a64

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--m", type=int, default=1, help="columns of the step")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()

    lay = Layout(qwen3_30b_a3b_config(args.layers), "q8", args.m, False)
    arena = np.random.default_rng(3).integers(0, 256, lay.total, dtype=np.uint8)
    rt = runtime()
    cuda = rt.cuda
    rows = []
    with rt.active():
        base = cuda.to_device(arena)
        for which, idx in (("body", lay.body_index), ("logits", lay.logits_index)):
            spans = [lay.spans[i] for i in idx]
            want = [fnv1a64(arena[o:o + n].tobytes()) for o, n in spans]
            for label, scan_max in (("scan", HASH_SCAN_MAX), ("chunks", 0)):
                work = HashWork(spans, scan_max=scan_max)
                hb = device_hash_work(cuda, work)
                launch_hash(rt, hb, int(base))
                out = np.empty(len(spans), np.uint64)
                cuda.memcpy_dtoh(out, hb["ptr"]["out"])
                bad = sum(int(h) != w for h, w in zip(out, want))
                parts = [("all", KERNELS)] + [(k, (k,)) for k in KERNELS if _launches(work, k)]
                for part, kernels in parts if len(parts) > 2 else parts[:1]:
                    times = []
                    for _ in range(args.reps):
                        e0, e1 = cuda.Event(), cuda.Event()
                        e0.record()
                        launch_hash(rt, hb, int(base), kernels=kernels)
                        e1.record()
                        e1.synchronize()
                        times.append(e0.time_till(e1) * 1e3)
                    t = np.array(times)
                    rows.append((which, label, part, len(spans), sum(n for _, n in spans), work.n_seg,
                                 work.n_chunks, float(np.median(t)), float(t.min()), float(t.max()), bad))
    print(f"device: {rt.name}; {args.layers} layers, M = {args.m}; median of {args.reps} launches (CUDA events)")
    print("| keys | version | kernels timed | spans | bytes | fnv_scan segments | chunks | median µs | min | max |"
          " hashes wrong |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print("| {} | {} | {} | {} | {:,} | {} | {} | {:.1f} | {:.1f} | {:.1f} | {} |".format(*r))
    return 1 if any(r[-1] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
