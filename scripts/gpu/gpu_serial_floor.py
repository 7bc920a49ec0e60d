"""The exact path's serial floor: what the contract's ordered sums cost a step however fast the rest is.

docs/numerics.md fixes the order of some sums: RMSNorm's block-8 sum of squares (R2, hidden/8
terms), QK-norm's and the router softmax's sequential sums (R3, head_dim and n_experts terms),
the top-k renormalisation (R3, top_k terms) and the online softmax L6d, one step a cache position
(acc and l: a multiply and an add, the add alone where c = 1 — acc*1 is acc). Each is a chain
of dependent float adds that no schedule can shorten without changing bits; the fast path does
the same reductions as trees. This measures, with clock64 on one thread, the cycles a step of
each chain and of a block's tree reduction of a hidden-sized row, the SM clock (clock64 against
%globaltimer), then multiplies by the chain lengths of a model (Qwen3-30B-A3B's by default) at a
context: the part of exact's extra time over fast that only a change of contract could remove.

    python3 scripts/gpu/gpu_serial_floor.py [--ctx 1024] [--layers 48]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SRC = r"""
#define UNROLL 64
// One thread, n dependent steps (n a multiple of UNROLL), the operands in registers so that only
// the chain is timed. kind 0: acc = acc + t (R2, R3, L6d where c = 1); kind 1: acc = acc*c + t,
// the product rounded first (L6d where the maximum moves).
extern "C" __global__ void chain(float *out, long long *cyc, unsigned long long *ns, int n, int kind, float c,
                                 float t) {
  float acc = out[0];
  unsigned long long g0, g1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
  const long long c0 = clock64();
  if (kind == 0) {
    for (int i = 0; i < n; i += UNROLL) {
#pragma unroll
      for (int u = 0; u < UNROLL; u++) acc = __fadd_rn(acc, t);
    }
  } else {
    for (int i = 0; i < n; i += UNROLL) {
#pragma unroll
      for (int u = 0; u < UNROLL; u++) acc = __fadd_rn(__fmul_rn(acc, c), t);
    }
  }
  out[1] = acc;  // the store depends on the chain's end, so the second clock waits for it
  __threadfence_block();
  const long long c1 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
  cyc[0] = c1 - c0;
  ns[0] = g1 - g0;
}

// The fast path's counterpart: a block of 256 threads sums a row of n floats from shared memory
// as a tree (each thread its strided share, then warp shuffles, then one warp over the warps).
extern "C" __global__ void tree(const float *x, float *out, long long *cyc, int n) {
  __shared__ float row[8192];
  __shared__ float red[32];
  for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] = x[i];
  __syncthreads();
  const long long c0 = clock64();
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += row[i];
  for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
    for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (threadIdx.x == 0) red[0] = s;
  }
  __syncthreads();
  const float total = red[0];
  const long long c1 = clock64();
  if (threadIdx.x == 0) {
    out[0] = total;
    cyc[0] = c1 - c0;
  }
}
"""


def chain_lengths(cfg, ctx: int) -> dict[str, tuple[int, int]]:
    """(steps of kind 0, steps of kind 1) a step of the whole model, by contract rule."""
    moe = sum(cfg.layer_is_moe(layer) for layer in range(cfg.n_layers))
    return {
        "R2 RMSNorm sums (2 a layer + the final norm)": ((2 * cfg.n_layers + 1) * (cfg.hidden // 8), 0),
        "R3 QK-norm sums": (cfg.n_layers * cfg.head_dim, 0),
        "R3 router softmax sums": (moe * cfg.n_experts, 0),
        "R3 top-k renormalisation": (moe * cfg.top_k if cfg.norm_topk_prob else 0, 0),
        # positions 0..ctx, ctx + 1 steps: a multiply and an add where the maximum moves (at least
        # once a layer), an add alone elsewhere
        "L6d online softmax": (cfg.n_layers * ctx, cfg.n_layers),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    args = ap.parse_args()

    import pycuda.autoinit  # noqa: F401
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    from kestrel_tui.model.config import qwen3_30b_a3b_config

    dev = cuda.Context.get_device()
    major, minor = dev.compute_capability()
    mod = SourceModule(SRC, arch=f"sm_{major}{minor}", no_extern_c=True)
    chain, tree = mod.get_function("chain"), mod.get_function("tree")
    out = cuda.mem_alloc(8)
    cuda.memcpy_htod(out, np.array([1.0, 0.0], np.float32))
    cyc, ns = cuda.mem_alloc(8), cuda.mem_alloc(8)

    def fewest_cycles(launch) -> tuple[int, int]:
        """(cycles, ns) of the launch with the fewest cycles of five."""
        runs = []
        for _ in range(5):
            launch()
            cuda.Context.synchronize()
            runs.append((int(cuda.from_device(cyc, (1,), np.int64)[0]), int(cuda.from_device(ns, (1,), np.uint64)[0])))
        return min(runs)

    def run_chain(n: int, kind: int) -> tuple[float, float]:
        c, t = fewest_cycles(lambda: chain(out, cyc, ns, np.int32(n), np.int32(kind), np.float32(0.999),
                                           np.float32(1e-3), block=(1, 1, 1), grid=(1, 1)))
        return c / n, c / t  # cycles a step, cycles a ns (GHz)

    add, ghz = run_chain(1 << 20, 0)
    mul_add, _ = run_chain(1 << 20, 1)
    cfg = qwen3_30b_a3b_config(args.layers)
    x = cuda.to_device(np.random.default_rng(0).standard_normal(cfg.hidden).astype(np.float32))
    tree_cycles, _ = fewest_cycles(lambda: tree(x, out, cyc, np.int32(cfg.hidden), block=(256, 1, 1), grid=(1, 1)))
    print(f"{dev.name()}: SM clock {ghz:.3f} GHz (clock64 / globaltimer over 2^20 steps)")
    print(f"dependent float add: {add:.2f} cycles a step; multiply then add: {mul_add:.2f}")
    print(f"a 256-thread block's tree sum of {cfg.hidden} floats in shared memory: {tree_cycles} cycles"
          f" (R2's serial part alone: {cfg.hidden // 8 * add:.0f})")
    total = 0.0
    print(f"\nQwen3-30B-A3B dims, {cfg.n_layers} layers, context {args.ctx}: the ordered chains of one decode step")
    for name, (n0, n1) in chain_lengths(cfg, args.ctx).items():
        ms = (n0 * add + n1 * mul_add) / ghz / 1e6
        total += ms
        print(f"  {name:<46} {n0 + n1:>8} steps  {ms:.4f} ms")
    print(f"  {'total':<46} {'':>8}        {total:.4f} ms")


if __name__ == "__main__":
    main()
