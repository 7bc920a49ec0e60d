"""Speed of the compiled reference's q4_0 GEMV (kestrel_tui/cref, kc_gemv_q4) at Qwen3-30B-A3B's shapes.

For each shape, each SIMD level the CPU has (kc_gemv_simd: 0 scalar, 1 AVX2, 2 VNNI) and 1 and 2
threads: ns per 32-weight block and the weight bytes streamed per second (18 bytes a block), the best
of --reps calls; then numpy's q4_gemv (numerics/linalg.py) on the same matrix, once. Every C result is
checked bit for bit against numpy's before it is timed.

The matrices are random ggml q4_0 bytes (finite scales); timings do not depend on the values. The
same matrix is called again and again, so it is as hot in the caches as a matrix that size can be
(this machine's L3 holds even the lm_head): a real decode streams each matrix from memory once per
token, which is what the GB/s column is to be compared with.

    python scripts/bench_cref_gemv.py                   # the library pip install built
    python scripts/bench_cref_gemv.py --lib /tmp/x.so   # another build of kestrel_tui/cref
    python scripts/bench_cref_gemv.py --columns 40      # a prefill-like call
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kestrel_tui.cref import Job, load
from kestrel_tui.model.quant import quantize_q8_0
from kestrel_tui.model.weights import Linear
from kestrel_tui.numerics.linalg import q4_gemv

# (name, in, out): attention q/o, an expert's gate|up and down, the lm_head
SHAPES = [
    ("q_proj 2048->4096", 2048, 4096),
    ("o_proj 4096->2048", 4096, 2048),
    ("expert gate 2048->768", 2048, 768),
    ("expert down 768->2048", 768, 2048),
    ("lm_head 2048->151936", 2048, 151936),
]
LEVEL_NAMES = {0: "scalar", 1: "avx2", 2: "vnni", 3: "avx512"}


def random_blocks(rng: np.random.Generator, out: int, nb: int) -> np.ndarray:
    blocks = rng.integers(0, 256, (out, nb, 18), dtype=np.uint8)
    blocks[..., :2] = (rng.standard_normal((out, nb)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    return blocks


def c_gemv(lib, blocks: np.ndarray, qx: np.ndarray, dx: np.ndarray, threads: int) -> tuple[np.ndarray, float]:
    out, nb, _ = blocks.shape
    m = qx.shape[0]
    y = np.empty((m, out), np.float32)
    jobs = (Job * 1)()
    jobs[0].w, jobs[0].out, jobs[0].n, jobs[0].y_off = blocks.ctypes.data, out, m, 0
    t = time.perf_counter()
    lib.kc_gemv_q4(jobs, 1, nb, qx.ctypes.data, dx.ctypes.data, y.ctypes.data, out, threads)
    return y, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", help="a build of kestrel_tui/cref (default: the installed one)")
    ap.add_argument("--columns", type=int, default=1, help="columns per call (1: decode)")
    ap.add_argument("--reps", type=int, default=20, help="calls per figure; the best one counts")
    ap.add_argument("--no-numpy", action="store_true", help="skip numpy's q4_gemv (slow on the lm_head)")
    args = ap.parse_args()
    lib = load(args.lib)
    rng = np.random.default_rng(0)
    top = lib.kc_gemv_simd(99)
    levels = list(range(top + 1))
    print(f"kc_gemv_q4, {args.columns} column(s); ns per block (per block-column when columns > 1), GB/s of"
          f" q4_0 weights; best of {args.reps}")
    head = "".join(f"  {LEVEL_NAMES[lv]:>6} t1        t2     " for lv in levels)
    print(f"{'shape':<24}{head}  numpy")
    try:
        for name, inp, out in SHAPES:
            nb = inp // 32
            blocks = random_blocks(rng, out, nb)
            x = rng.standard_normal((args.columns, inp)).astype(np.float32)
            qs, d = quantize_q8_0(x)
            qx, dx = np.ascontiguousarray(qs.reshape(args.columns, inp)), np.ascontiguousarray(d)
            ref = None
            if not args.no_numpy:
                t = time.perf_counter()
                ref = q4_gemv((Linear(out, inp, blocks=blocks),), (qs.astype(np.float32), d))
                t_np = time.perf_counter() - t
            cells = []
            for lv in levels:
                lib.kc_gemv_simd(lv)
                for threads in (1, 2):
                    y, _ = c_gemv(lib, blocks, qx, dx, threads)  # warm-up, and the bit check
                    if ref is not None and not np.array_equal(y.view(np.uint32), ref.view(np.uint32)):
                        raise SystemExit(f"{name}: level {lv}, {threads} threads differs from numpy")
                    best = min(c_gemv(lib, blocks, qx, dx, threads)[1] for _ in range(args.reps))
                    ns = best * 1e9 / (out * nb * args.columns)
                    cells.append(f"{ns:7.3f} {blocks.nbytes / best / 1e9:6.1f}")
            line = f"{name:<24}" + "".join(f"  {c}" for c in cells)
            if ref is not None:
                line += f"  {t_np * 1e9 / (out * nb * args.columns):7.2f} {blocks.nbytes / t_np / 1e9:5.2f}"
            print(line, flush=True)
    finally:
        lib.kc_gemv_simd(top)


if __name__ == "__main__":
    main()
