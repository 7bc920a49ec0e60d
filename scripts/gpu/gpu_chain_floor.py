"""What a chain of dependent kernels costs in a CUDA graph, with no work in them.

The decode step at M = 1 is a chain of ~12 dependent kernels a layer (587 graph nodes for
the full-size model). This captures N launches of a kernel that only waits on its
predecessor (griddepcontrol.wait) and adds 1 to one float a thread, in one stream, as a
graph — with and without programmatic dependent launch (PDL), for a one-block grid and a
one-wave grid — replays it and prints the device time per node: the floor a step with that
many kernels pays before any of them does work. Then the alternative a persistent kernel
would use: one launch of a one-wave grid that runs the same N phases with a grid-wide
barrier (an arrival counter and a generation word) between them, and the time per barrier;
and with tile-level dependencies instead (a block waits on the progress flags of the few
blocks whose output it reads), the time per phase for several fan-ins.

    python3 scripts/gpu/gpu_chain_floor.py [--nodes 576] [--reps 50]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SRC = r"""
extern "C" __global__ void touch(float *p, int n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1.0f;
}

__device__ unsigned int bar_count = 0, bar_gen = 0;

// Every block's thread 0 arrives on the counter; the last one resets it and moves the
// generation on, the others spin until it moves. All blocks must be resident (one wave).
__device__ __forceinline__ void grid_barrier(unsigned int nblocks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned int *gen = &bar_gen;
    const unsigned int g = *gen;
    __threadfence();
    if (atomicAdd(&bar_count, 1u) == nblocks - 1) {
      atomicExch(&bar_count, 0u);
      __threadfence();
      atomicAdd(&bar_gen, 1u);
    } else {
      while (*gen == g) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// Per-block progress words for the flag version: the phases a block has finished, counted on
// from launch to launch (base), so they never need a reset.
__device__ unsigned int flag_done[4096];

// The same phases with tile-level dependencies instead of a grid barrier, as a persistent
// "megakernel" would have them: a block waits only for the fanin blocks whose output it reads
// (itself and the next fanin - 1) to have finished the phase before, then publishes its own.
extern "C" __global__ void phases_flags(float *p, int n, int nphases, int fanin, unsigned int base) {
  const unsigned int b = blockIdx.x;
  const int i = b * blockDim.x + threadIdx.x;
  for (int k = 0; k < nphases; k++) {
    if (k > 0 && threadIdx.x < fanin) {
      const unsigned int *f = flag_done + (b + threadIdx.x) % gridDim.x;
      unsigned int v;
      do {
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
      } while (v < base + k);
    }
    __syncthreads();
    if (i < n) p[i] += 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(flag_done + b), "r"(base + k + 1) : "memory");
    }
  }
}

extern "C" __global__ void phases(float *p, int n, int nphases) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  for (int k = 0; k < nphases; k++) {
    if (i < n) p[i] += 1.0f;
    grid_barrier(gridDim.x);
  }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=576)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()

    import pycuda.autoinit  # noqa: F401
    import pycuda.driver as cuda
    from pycuda.compiler import compile as nvcc_compile

    from kestrel_tui.backends.cuda.graph import CAPTURE_MODE_RELAXED, _check, stream_handle
    from kestrel_tui.backends.cuda.pdl import (LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttribute,
                                               LaunchConfig)

    lib = ctypes.CDLL("libcuda.so.1")
    major, minor = cuda.Context.get_device().compute_capability()
    cubin = nvcc_compile(SRC, arch=f"sm_{major}{minor}", no_extern_c=True)
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    _check(lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin)), "cuModuleLoadData")
    _check(lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"touch"), "cuModuleGetFunction")
    n_sm = cuda.Context.get_device().get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
    buf = cuda.mem_alloc(4 * n_sm * 256)
    cuda.memset_d8(buf, 0, 4 * n_sm * 256)
    stream = cuda.Stream(1)
    h = ctypes.c_void_p(stream_handle(stream))
    attr = LaunchAttribute(id=LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    print(f"{cuda.Context.get_device().name()}: {args.nodes} dependent kernels in one graph, "
          f"{args.reps} replays; device time per node")
    for blocks, threads in ((1, 128), (n_sm, 256)):
        for pdl in (False, True):
            p, n = ctypes.c_uint64(int(buf)), ctypes.c_int32(blocks * threads)
            params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p),
                                           ctypes.cast(ctypes.pointer(n), ctypes.c_void_p))
            cfg = LaunchConfig(blocks, 1, 1, threads, 1, 1, 0, h, ctypes.pointer(attr) if pdl else None,
                               1 if pdl else 0)
            graph, exe = ctypes.c_void_p(), ctypes.c_void_p()
            _check(lib.cuStreamBeginCapture_v2(h, ctypes.c_int(CAPTURE_MODE_RELAXED)), "cuStreamBeginCapture")
            for _ in range(args.nodes):
                _check(lib.cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None), "cuLaunchKernelEx")
            _check(lib.cuStreamEndCapture(h, ctypes.byref(graph)), "cuStreamEndCapture")
            _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, ctypes.c_ulonglong(0)),
                   "cuGraphInstantiateWithFlags")
            for _ in range(3):  # warm
                _check(lib.cuGraphLaunch(exe, h), "cuGraphLaunch")
            t0, t1 = cuda.Event(), cuda.Event()
            t0.record(stream)
            for _ in range(args.reps):
                _check(lib.cuGraphLaunch(exe, h), "cuGraphLaunch")
            t1.record(stream)
            t1.synchronize()
            ms = t1.time_since(t0) / args.reps
            print(f"  grid {blocks:4d} x {threads:3d}  PDL {'on ' if pdl else 'off'}  "
                  f"{ms:7.3f} ms a replay = {ms * 1e3 / args.nodes:5.2f} us a node")
            lib.cuGraphExecDestroy(exe)
            lib.cuGraphDestroy(graph)
    lib.cuModuleUnload(mod)

    def ms_a_launch(run) -> float:
        for _ in range(3):  # warm
            run()
        t0, t1 = cuda.Event(), cuda.Event()
        t0.record()
        for _ in range(args.reps):
            run()
        t1.record()
        t1.synchronize()
        return t1.time_since(t0) / args.reps

    module = cuda.module_from_buffer(cubin)  # the cubin compiled above
    phases, flags = module.get_function("phases"), module.get_function("phases_flags")
    for threads in (128, 256):
        n = n_sm * threads
        ms = ms_a_launch(lambda: phases(buf, np.int32(n), np.int32(args.nodes), block=(threads, 1, 1),
                                        grid=(n_sm, 1)))
        print(f"  one persistent kernel, grid {n_sm:4d} x {threads:3d}, {args.nodes} grid barriers  "
              f"{ms:7.3f} ms a launch = {ms * 1e3 / args.nodes:5.2f} us a barrier")

    launches = 0  # the flags count on from launch to launch
    threads = 256  # a thread a flag: up to every block of the grid
    n = n_sm * threads
    for fanin in (1, 2, 8, 32, n_sm):
        if fanin > threads:
            continue

        def run_flags() -> None:
            nonlocal launches
            flags(buf, np.int32(n), np.int32(args.nodes), np.int32(fanin), np.uint32(launches * args.nodes),
                  block=(threads, 1, 1), grid=(n_sm, 1))
            launches += 1

        ms = ms_a_launch(run_flags)
        print(f"  one persistent kernel, grid {n_sm:4d} x {threads:3d}, {args.nodes} phases, a block waits on "
              f"{fanin:3d} blocks' flags  {ms:7.3f} ms a launch = {ms * 1e3 / args.nodes:5.2f} us a phase")


if __name__ == "__main__":
    main()
