"""Checks of the device functions against the numpy replicas, shared by tests/test_cuda.py
and scripts/gpu_acceptance.py."""
from __future__ import annotations

import numpy as np

from ...numerics import transcend

LIMITS = {"expf": np.inf, "cosf": 3.37e9, "sinf": 1.6e7}  # beyond: Payne-Hanek, not replicated


def replica_inputs(fn: str, n: int, seed: int = 0) -> np.ndarray:
    """>= n float32 inputs: the function's working range (uniform and dense), random bit
    patterns, and the special values; NaN and the unreplicated Payne-Hanek range left out."""
    rng = np.random.default_rng(seed)
    k = n // 4 + 1
    bits = rng.integers(0, 2**32, k, dtype=np.uint64).astype(np.uint32).view(np.float32)
    if fn == "expf":
        parts = [rng.uniform(-105, 89, k), rng.uniform(-1, 1, k), rng.uniform(-30, 0, k)]
        special = [0, -0.0, np.inf, -np.inf, 88.7228394, 88.72284, -104, -103.99, -104.01]
    else:
        parts = [rng.uniform(-50000, 50000, k), rng.uniform(-4, 4, k), np.arange(k) * np.float64(np.float32(0.0137))]
        special = [0, -0.0, 0.7853982, -0.7853982, 2.0**-13, 2.0**-7, 1e-5, -3e-3, 40960.0]
    limit = LIMITS[fn]
    x = np.concatenate([np.concatenate(parts).astype(np.float32), bits, np.float32(special)])
    x = x[~np.isnan(x) & (np.abs(x) < limit)]
    while x.size < n:  # top up with more random bit patterns
        more = rng.integers(0, 2**32, n - x.size + 1024, dtype=np.uint64).astype(np.uint32).view(np.float32)
        x = np.concatenate([x, more[~np.isnan(more) & (np.abs(more) < limit)]])
    return x


def device_eval(rt, kernel: str, x: np.ndarray) -> np.ndarray:
    """Run one of kernels/transcend.cu's eval_* kernels over x."""
    cuda = rt.cuda
    with rt.active():
        dx = cuda.to_device(x)
        dy = cuda.mem_alloc(x.nbytes)
        rt.kernel("transcend", kernel).prepared_call(((x.size + 255) // 256, 1, 1), (256, 1, 1), int(dx), int(dy),
                                                     x.size)
        y = np.empty_like(x)
        cuda.memcpy_dtoh(y, dy)
    return y


def replica_mismatches(rt, fn: str, n: int, seed: int = 0) -> tuple[int, int, np.ndarray]:
    """(inputs, mismatching inputs, the first few of them) for expf/cosf/sinf."""
    x = replica_inputs(fn, n, seed)
    got = device_eval(rt, f"eval_{fn}_ucrt", x)
    want = getattr(transcend, fn)(x)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    return x.size, bad.size, x[bad[:5]]
