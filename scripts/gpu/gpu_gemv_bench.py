"""Device time of the q4_0 GEMVs at M = 1, fast against exact, at the shapes of a Qwen3-30B-A3B
decode step: o_proj, the router's gate, lm_head (gemv_q4_*), q/k/v (gemv_q4_x3_*). Each kernel is
launched --n times back to back between two CUDA events, cycling over enough copies of its
weights that they come from DRAM, not L2 (as in a step, where every layer has its own); the
figure is the time a launch, the median of --reps such runs. The outputs of the two versions are
compared too (they may differ: fast sums in another order).

    python3 scripts/gpu/gpu_gemv_bench.py [--n 200] [--reps 5]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = (("o_proj", 2048, 4096), ("router gate", 128, 2048), ("lm_head", 151936, 2048), ("q/k/v", None, 2048))


def main() -> int:
    from kestrel_tui.backends.cuda.launches import q4_rows_a_block
    from kestrel_tui.backends.cuda.runtime import runtime

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="launches a timed run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dram-mb", type=int, default=160, help="weights cycled over (several times L2)")
    args = ap.parse_args()
    rt = runtime()
    cuda = rt.cuda
    rng = np.random.default_rng(0)
    print(f"device: {rt.name}; {args.n} launches a run, median of {args.reps} runs")
    print("| GEMV | out x in | MB a launch | fast µs | exact µs | fast GB/s | exact GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with rt.active():
        gen = rt.kernel("gemv", "gen_q4")
        for name, out, inp in SHAPES:
            nb = inp // 32
            outs = (4096, 512, 512) if out is None else (out,)  # q, k, v
            n_el = sum(outs) * nb
            copies = max(1, -(-(args.dram_mb << 20) // (n_el * 18)))
            mats = []
            for c in range(copies):
                W, D = cuda.mem_alloc(n_el * 16), cuda.mem_alloc(n_el * 2)
                gen.prepared_call((min(65535, -(-n_el // 256)), 1, 1), (256, 1, 1), W, D, n_el, 11 + c, 0.01)
                mats.append((W, D))
            xq = cuda.to_device(rng.integers(-127, 128, inp).astype(np.int8))
            xd = cuda.to_device(rng.uniform(0.005, 0.02, nb).astype(np.float32))
            y = cuda.mem_alloc(sum(outs) * 4)
            times, ys = {}, {}
            for version in ("fast", "exact"):
                rpb = q4_rows_a_block(1, version == "exact")
                if out is None:
                    k = rt.kernel("gemv", f"gemv_q4_x3_{version}")
                    grid = (sum(-(-o // rpb) for o in outs), 1, 1)

                    def launch(W, D):
                        o1, o2 = outs[0] * nb, (outs[0] + outs[1]) * nb
                        k.prepared_call(grid, (128, 1, 1), W, D, y, outs[0], int(W) + o1 * 16, int(D) + o1 * 2,
                                        int(y) + outs[0] * 4, outs[1], int(W) + o2 * 16, int(D) + o2 * 2,
                                        int(y) + (outs[0] + outs[1]) * 4, outs[2], xq, xd, nb, 1)
                else:
                    k = rt.kernel("gemv", f"gemv_q4_{version}")
                    grid = (-(-out // rpb), 1, 1)

                    def launch(W, D):
                        k.prepared_call(grid, (128, 1, 1), W, D, xq, xd, 0, y, out, nb, 1)
                for W, D in mats:  # warm-up
                    launch(W, D)
                runs = []
                for _ in range(args.reps):
                    e0, e1 = cuda.Event(), cuda.Event()
                    e0.record()
                    for i in range(args.n):
                        launch(*mats[i % copies])
                    e1.record()
                    e1.synchronize()
                    runs.append(e0.time_till(e1) * 1e3 / args.n)
                times[version] = float(np.median(runs))
                ys[version] = cuda.from_device(y, (sum(outs),), np.float32)
            mb = n_el * 18 / 1e6
            print(f"| {name} | {sum(outs)} x {inp} | {mb:.2f} | {times['fast']:.2f} | {times['exact']:.2f} |"
                  f" {mb * 1e3 / times['fast']:.0f} | {mb * 1e3 / times['exact']:.0f} |", flush=True)
            rel = np.abs(ys["fast"] - ys["exact"]).max() / max(1e-30, np.abs(ys["exact"]).max())
            if not rel < 1e-3:
                print(f"  {name}: fast and exact outputs differ by {rel:.2e} of the largest (expected ~1e-6)")
                return 1
            for W, D in mats:
                W.free()
                D.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
