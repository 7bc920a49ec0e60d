"""The host twin of the GPU weight generator: its RNG and rounding against a scalar,
pure-Python reading of kernels/gemv.cu gen_q4 (the cuda test compares the bytes with
the kernel itself)."""
import struct

import numpy as np

from kestrel_tui.model.config import Config
from kestrel_tui.model.device_synthetic import device_synthetic_model, gen_q4_blocks

M64 = (1 << 64) - 1


def splitmix64_scalar(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def block_scalar(i: int, seed: int, dscale: float) -> bytes:
    base = splitmix64_scalar(((seed & 0xFFFFFFFF) << 32) ^ ((i * 0xD1342543DE82EF95) & M64))
    a, b, c = splitmix64_scalar(base), splitmix64_scalar((base + 1) & M64), splitmix64_scalar((base + 2) & M64)
    u = f32((c >> 40) * (1.0 / 16777216.0))  # exact: 24 bits
    d = struct.pack("<e", f32(f32(dscale) * f32(0.5 + u)))  # each f32 op rounded once; 'e' rounds to nearest even
    return d + struct.pack("<QQ", a, b)


def test_blocks_equal_the_scalar_reading_of_the_kernel():
    rng = np.random.default_rng(3)
    n = 1 << 24
    for seed, dscale in ((1, 0.0625), (0x7FFFFFFF, 1.0 / 3.0), (1_000_004, 0.002)):
        idx = np.concatenate([[0, 1, n - 1], rng.integers(0, n, 2000)])
        for i in idx:
            blk = gen_q4_blocks(n, seed, dscale, start=int(i), count=1)[0].tobytes()
            assert blk == block_scalar(int(i), seed, dscale), (seed, i)


def test_chunked_generation_equals_one_call():
    whole = gen_q4_blocks(5000, 77, 0.01)
    parts = np.concatenate([gen_q4_blocks(5000, 77, 0.01, start=s, count=min(1234, 5000 - s))
                            for s in range(0, 5000, 1234)])
    assert np.array_equal(whole, parts)


def test_model_builds_and_decodes_at_small_size():
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.engines.builtin import run_decode

    cfg = Config(arch="qwen3_moe", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab=512,
                 rope_theta=1e6, eps=1e-6, tie_embeddings=False, max_positions=64, n_experts=8, top_k=2,
                 moe_intermediate=64)
    m = device_synthetic_model(cfg, seed=5)
    assert m.layers[0].gate_proj.dense().shape == (8, 64, 128)
    trace = run_decode(NumpyBackend(m), [1, 2, 3], 2, raw=False)
    assert len(trace.positions) == 5 and all(len(p.hashes) == 24 for p in trace.positions)


def test_mixed_model_has_dense_layers_where_the_config_says():
    """decoder_sparse_step 2: layers 0 and 2 are dense MLPs of intermediate_size (no router), as the
    device generator makes them (the order of matrices is checked against it in
    test_cuda_fake_driver.py)."""
    from dataclasses import replace

    cfg = Config(arch="qwen3_moe", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab=512,
                 rope_theta=1e6, eps=1e-6, tie_embeddings=False, max_positions=64, n_experts=8, top_k=2,
                 moe_intermediate=64)
    cfg = replace(cfg, intermediate=96, decoder_sparse_step=2)
    m = device_synthetic_model(cfg, seed=5)
    for li, L in enumerate(m.layers):
        if li % 2 == 0:
            assert L.gate is None and L.gate_proj.dense().shape == (96, 128) and L.down_proj.dense().shape == (128, 96)
        else:
            assert L.gate.dense().shape == (8, 128) and L.gate_proj.dense().shape == (8, 64, 128)
