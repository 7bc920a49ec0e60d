"""The host twin of the GPU's weight generator (kernels/gemv.cu `gen_q4`): the same bytes, vectorised.

`kestrel-tui bench --subject cuda` generates a full-size Qwen3-30B-A3B (~17 GB of
q4_0) on the device so no host copy is needed. To prove that the exact kernels
equal the reference *at that size*, the reference needs the same weights: this
module computes them on the host, block for block, with the kernel's
counter-based RNG (splitmix64 of seed and block index) and the kernel's float
rounding (`d = f16_rn(dscale * (0.5f + u))`, no FMA: the kernels build with
-fmad=false), in the order backends/cuda/weights.py `generate_device_model`
allocates the matrices. Norm weights come from the same numpy Generator calls.

A block's ggml bytes are its f16 scale then the 16 nibble bytes the kernel
stores as one uint4 — (a lo, a hi, b lo, b hi) little-endian — so the result is
ggml q4_0 bytes, which a `Linear` holds as they are.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .config import Config
from .weights import Layer, Linear, Model, linear_from_ggml, rope_tables

U64 = np.uint64
UNIFORM_NIBBLE_STD = float(np.sqrt((16 ** 2 - 1) / 12))  # std of q - 8, q uniform in 0..15
CHUNK_BLOCKS = 1 << 20  # blocks generated at a time: ~60 MB of uint64 temporaries


def splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 on uint64 arrays (numpy wraps uint64 arithmetic modulo 2^64, as C does)."""
    z = z + U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> U64(27))) * U64(0x94D049BB133111EB)
    return z ^ (z >> U64(31))


def gen_q4_blocks(n: int, seed: int, dscale: float, start: int = 0, count: int | None = None) -> np.ndarray:
    """ggml q4_0 bytes [count, 18] of blocks start..start+count of one gen_q4 call (n blocks)."""
    count = n - start if count is None else count
    i = np.arange(start, start + count, dtype=U64)
    with np.errstate(over="ignore"):
        base = splitmix64((U64(seed & 0xFFFFFFFF) << U64(32)) ^ (i * U64(0xD1342543DE82EF95)))
        a, b, c = splitmix64(base), splitmix64(base + U64(1)), splitmix64(base + U64(2))
    u = (c >> U64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    d = (np.float32(dscale) * (np.float32(0.5) + u)).astype(np.float16)
    out = np.empty((count, 18), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(count, 2)
    out[:, 2:10] = a.astype("<u8").view(np.uint8).reshape(count, 8)
    out[:, 10:] = b.astype("<u8").view(np.uint8).reshape(count, 8)
    return out


class _Generator:
    """Replays generate_device_model's sequence: matrix seeds by a counter, norms from one Generator."""

    def __init__(self, seed: int, fmt: str, pool: ThreadPoolExecutor | None):
        self.seed, self.fmt, self.counter, self.pool = seed, fmt, 0, pool
        self.rng = np.random.default_rng(seed)

    def lin(self, out: int, inp: int, std: float, experts: int = 0) -> Linear:
        nb = inp // 32
        n = max(experts, 1) * out * nb
        self.counter += 1
        seed = (self.seed * 1_000_003 + self.counter) & 0x7FFFFFFF
        dscale = float(np.float32(std / UNIFORM_NIBBLE_STD))  # the kernel's float argument
        # the kernel's block i is row-major over [experts, out, nb]: exactly ggml's byte order
        raw = np.empty((n, 18), np.uint8)
        starts = range(0, n, CHUNK_BLOCKS)

        def fill(start: int) -> None:
            count = min(CHUNK_BLOCKS, n - start)
            raw[start:start + count] = gen_q4_blocks(n, seed, dscale, start=start, count=count)

        if self.pool is not None:  # numpy's ufuncs release the GIL: threads fill disjoint chunks at once
            list(self.pool.map(fill, starts))
        else:
            for start in starts:
                fill(start)
        return linear_from_ggml(raw, self.fmt, shape=(*((experts,) if experts else ()), out, inp))

    def norm(self, n: int) -> np.ndarray:
        return np.float32(0.9) + np.float32(0.2) * self.rng.random(n, dtype=np.float32)


def device_synthetic_model(cfg: Config, seed: int = 0, fmt: str = "q4_0", name: str | None = None,
                           threads: int = 1) -> Model:
    """The Model whose weights are exactly DeviceSyntheticModel(cfg, seed)'s on the GPU."""
    cfg.validate("q4_0")
    with ThreadPoolExecutor(threads) if threads > 1 else contextlib.nullcontext() as pool:
        return _build(cfg, _Generator(seed, fmt, pool), name)


def _build(cfg: Config, g: _Generator, name: str | None) -> Model:
    h, hd = cfg.hidden, cfg.head_dim
    embed = g.lin(cfg.vocab, h, 1.0)
    lm_head = embed if cfg.tie_embeddings else g.lin(cfg.vocab, h, h ** -0.5)
    norm = g.norm(h)
    layers = []
    for li in range(cfg.n_layers):
        if cfg.layer_is_moe(li):
            e, f = cfg.n_experts, cfg.moe_intermediate
            gate = g.lin(e, h, 1.0)
            ffn = (g.lin(f, h, h ** -0.5, e), g.lin(f, h, h ** -0.5, e), g.lin(h, f, f ** -0.5, e))
        else:
            f = cfg.intermediate
            gate = None
            ffn = (g.lin(f, h, h ** -0.5), g.lin(f, h, h ** -0.5), g.lin(h, f, f ** -0.5))
        # the device generator makes the four norms first, then the projections, in this order
        norms = [g.norm(h), g.norm(h), g.norm(hd), g.norm(hd)]
        layers.append(Layer(
            input_layernorm=norms[0], post_attention_layernorm=norms[1], q_norm=norms[2], k_norm=norms[3],
            q_proj=g.lin(cfg.q_dim, h, h ** -0.5), k_proj=g.lin(cfg.kv_dim, h, h ** -0.5),
            v_proj=g.lin(cfg.kv_dim, h, h ** -0.5), o_proj=g.lin(h, cfg.q_dim, 0.5 * cfg.q_dim ** -0.5),
            gate=gate, gate_proj=ffn[0], up_proj=ffn[1], down_proj=ffn[2]))
    inv_freq, scale = rope_tables(cfg)
    return Model(cfg=cfg, fmt=g.fmt, name=name or f"device-synthetic {cfg.n_layers}L hidden {cfg.hidden}",
                 embed_tokens=embed, layers=tuple(layers), norm=norm, lm_head=lm_head,
                 inv_freq=inv_freq, attn_scale=scale)
