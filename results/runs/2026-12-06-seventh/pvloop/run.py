"""Cycles a position of the exact P.V serial loop alone (pvloop.cu), by variant."""
import sys
from pathlib import Path
import numpy as np
import pycuda.autoinit  # noqa
import pycuda.driver as cuda
from pycuda.compiler import SourceModule

here = Path(__file__).resolve().parent
root = here.parents[1]
src = (here / "pvloop.cu").read_text()
mod = SourceModule(src, options=["-fmad=false", "-std=c++17", "-I" + str(root / "kernels")], no_extern_c=True, arch="sm_90")
rng = np.random.default_rng(0)
data = cuda.to_device(rng.standard_normal(2 * 32 * 132 + 300).astype(np.float32))
out = cuda.mem_alloc(132 * 64 * 4)
cyc = cuda.mem_alloc(132 * 2 * 8)
NST = 64
names = {0: "real loop + barrier", 1: "real loop, no barrier", 2: "no flag loads (adds only)", 3: "chain alone (registers)",
         4: "real loop + busy producers", 5: "flags hoisted a stage"}
for grid in (1, 128):
    for mulpath in (0, 1):
        flags = np.array([0xFFFFFFFF if mulpath else 0] * 8 + [mulpath], dtype=np.uint32)
        f = cuda.to_device(flags)
        for v in range(6):
            if mulpath and v in (2, 3):
                continue
            fn = mod.get_function(f"pvloop{v}")
            res = []
            for rep in range(3):
                fn(data, f, out, cyc, np.int32(NST), grid=(grid, 1, 1), block=(192, 1, 1))
                cuda.Context.synchronize()
                c = cuda.from_device(cyc, (132, 2), np.int64)[:grid]
                res.append(c)
            c = np.concatenate(res)
            per = c / (NST * 128)
            print(f"grid {grid:3d} {'mul' if mulpath else 'add'} V{v} {names[v]:30s} acc warp {np.median(per[:, 0]):6.2f}"
                  f" (min {per[:, 0].min():.2f} max {per[:, 0].max():.2f})  l warp {np.median(per[:, 1]):6.2f} cycles/pos")
