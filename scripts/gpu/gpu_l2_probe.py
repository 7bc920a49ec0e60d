"""Does a decode GEMV get faster when its weights are already in L2, and does an L2 prefetch
put them there? One q4_0 GEMV at M = 1 (the committed gemv_q4_fast kernel) over a matrix the
size of a layer's expert gate/up weights (~14 MB), timed alone (CUDA events, median of --reps), behind a
--spin-us busy wait on the same stream:

    cold        L2 flushed first (a 256 MB memset)
    warm        right after the same GEMV ran (its weights left in L2 by its own loads)
    bulk        flushed, then cp.async.bulk.prefetch.L2 of the weights, then the GEMV
    lines       flushed, then prefetch.global.L2 of every 128-byte line, then the GEMV

The step-level A/B of the same prefetch on a side branch of the decode graph measured no
gain (results/gpu-h200-speed.md, 2026-11-30 16:08–16:47 UTC); this says whether the lever exists at all.

    python3 scripts/gpu/gpu_l2_probe.py [--rows 12288] [--reps 30]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SRC = r"""
extern "C" __global__ void bulk(const char *p, unsigned long long bytes) {
  for (unsigned long long o = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) * 16384ull; o < bytes;
       o += (unsigned long long)gridDim.x * blockDim.x * 16384ull) {
    const unsigned n = (unsigned)min(16384ull, bytes - o) & ~15u;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + o), "r"(n) : "memory");
  }
}
// holds the stream for ns nanoseconds of the global timer (a prefetch lands meanwhile, and the
// GPU stays busy, so its clocks do not drop before the timed GEMV)
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
extern "C" __global__ void lines(const char *p, unsigned long long bytes) {
  for (unsigned long long o = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) * 128ull; o < bytes;
       o += (unsigned long long)gridDim.x * blockDim.x * 128ull)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--inp", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--spin-us", type=int, default=30, help="busy wait between the preparation and the GEMV")
    args = ap.parse_args()

    from pycuda.compiler import SourceModule

    from kestrel_tui.backends.cuda.runtime import runtime

    rt = runtime()
    cuda = rt.cuda
    if int(rt.arch.removeprefix("sm_")) < 90:
        raise SystemExit(f"{rt.name} is {rt.arch}: cp.async.bulk.prefetch needs sm_90 or later")
    with rt.active():
        mod = SourceModule(SRC, arch=rt.arch, no_extern_c=True)
        k_bulk, k_lines = mod.get_function("bulk"), mod.get_function("lines")
        gemv = rt.kernel("gemv", "gemv_q4_fast")
        gen = rt.kernel("gemv", "gen_q4")
        out, nb = args.rows, args.inp // 32
        n = out * nb
        W, D = cuda.mem_alloc(n * 16), cuda.mem_alloc(n * 2)
        gen.prepared_call((min(65535, -(-n // 256)), 1, 1), (256, 1, 1), W, D, n, 7, 0.01)
        xq = cuda.to_device(np.random.default_rng(0).integers(-127, 128, args.inp).astype(np.int8))
        xd = cuda.to_device(np.full(nb, 0.01, np.float32))
        y = cuda.mem_alloc(out * 4)
        flush_bytes = 256 << 20
        flush = cuda.mem_alloc(flush_bytes)
        grid = (-(-out // 16), 1, 1)  # launches.py q4_rows_a_block at M = 1: 4 warps x 4 rows
        n_sm = rt.device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)

        def run_gemv():
            gemv.prepared_call(grid, (128, 1, 1), W, D, xq, xd, 0, y, out, nb, 1)

        k_spin = mod.get_function("spin")

        def timed(prep) -> float:
            times = []
            for _ in range(args.reps):
                cuda.Context.synchronize()
                prep()
                k_spin(np.uint64(args.spin_us * 1000), block=(32, 1, 1), grid=(1, 1))
                e0, e1 = cuda.Event(), cuda.Event()
                e0.record()
                run_gemv()
                e1.record()
                e1.synchronize()
                times.append(e0.time_till(e1) * 1e3)
            return float(np.median(times))

        def do_flush():
            cuda.memset_d32(flush, 0, flush_bytes // 4)

        def pf(kernel):
            def prep():
                do_flush()
                for ptr, size in ((W, n * 16), (D, n * 2)):
                    kernel(ptr, np.uint64(size), block=(128, 1, 1), grid=(n_sm, 1))
            return prep

        print(f"q4_0 GEMV {out} x {args.inp} at M = 1: {(n * 18) / 1e6:.1f} MB of weights, "
              f"{args.reps} reps, median us", flush=True)
        res = {
            "cold": timed(do_flush),
            "warm": timed(run_gemv),
            "bulk": timed(pf(k_bulk)),
            "lines": timed(pf(k_lines)),
            "cold again": timed(do_flush),
        }
        for k, v in res.items():
            print(f"  {k:12} {v:8.2f} us", flush=True)


if __name__ == "__main__":
    main()
