"""The model in memory: per-layer tensors in the GEMV's format, HF tensor names kept.

A `Linear` holds one weight matrix (or a stack of experts) either as q4_0
blocks or as f32. Two sources fill a `Model`: the deterministic synthetic
generator (the embedded default) and HF safetensors checkpoints (model/hf.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .config import QK, Config
from .quant import (BLOCK_BYTES, dequantize_ggml, dequantize_q4_0, ggml_scales, ggml_to_q4_0, q4_0_to_ggml,
                    quantize_q4_0_ggml)

FORMATS = ("q4_0", "f32")
KV_FORMATS = ("q8", "f32")


@dataclass(frozen=True)
class Linear:
    """y = W x for W [..., out, in]; the leading axis, when present, indexes experts.

    q4_0 weights stay in ggml's bytes (`blocks`, model/quant.py): 18 bytes per 32
    weights, what a GGUF file holds, used as they are — a read-only memmap of the
    file works, nothing writes to them. The GEMV (numerics/linalg.py) widens a
    bounded number of rows at a time; nothing keeps a widened copy.
    """

    out: int
    inp: int
    w: np.ndarray | None = None  # f32 [..., out, in]
    blocks: np.ndarray | None = field(default=None, repr=False)  # uint8 [..., out, nb, 18]: ggml q4_0

    def __post_init__(self):
        if self.blocks is not None:
            b = self.blocks
            want = (self.out, self.inp // QK, BLOCK_BYTES)
            if b.dtype != np.uint8 or b.ndim < 3 or b.shape[-3:] != want or self.inp % QK:
                raise ValueError(f"q4_0 blocks {b.dtype}{list(b.shape)} do not hold a"
                                 f" [{self.out}, {self.inp}] matrix")
            # the GEMV casts whole chunks of rows: C order makes those casts contiguous (a no-op when
            # the bytes already are, a GGUF memmap included)
            object.__setattr__(self, "blocks", np.ascontiguousarray(b))

    @property
    def fmt(self) -> str:
        return "f32" if self.w is not None else "q4_0"

    @property
    def nbytes(self) -> int:
        """Resident bytes of the weights."""
        return (self.w if self.w is not None else self.blocks).nbytes

    @property
    def ggml(self) -> np.ndarray | None:
        """The q4_0 bytes in GGUF's tensor shape [..., out, nb*18] (a view, no copy); None for f32."""
        if self.blocks is None:
            return None
        return self.blocks.reshape(*self.blocks.shape[:-2], -1)

    # The block-major pair of the older layout, for code written against it (model/quant.py's
    # q4_0_to_ggml and friends): computed on each access, a full conversion — never in a decode step.
    @property
    def qs(self) -> np.ndarray | None:
        """int8 [..., nb, out, 32] holding q-8 (computed; use `ggml` for the bytes)."""
        return None if self.blocks is None else ggml_to_q4_0(self.blocks)[0]

    @property
    def d(self) -> np.ndarray | None:
        """f32 [..., nb, out], the f16 scales (computed; use `ggml` for the bytes)."""
        return None if self.blocks is None else np.ascontiguousarray(np.moveaxis(ggml_scales(self.blocks), -1, -2))

    def dense(self) -> np.ndarray:
        """The weights as f32 [..., out, in] (dequantized for q4_0)."""
        return self.w if self.w is not None else dequantize_ggml(self.blocks)

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows of a 2-D matrix as f32 [len(idx), in] (embedding lookup): only those rows are widened."""
        if self.w is not None:
            return self.w[idx]
        return dequantize_ggml(self.blocks[np.asarray(idx)])


def make_linear(w: np.ndarray, fmt: str) -> Linear:
    w = np.asarray(w, dtype=np.float32)
    out, inp = w.shape[-2:]
    if fmt == "f32":
        return Linear(out, inp, w=np.ascontiguousarray(w))
    return Linear(out, inp, blocks=quantize_q4_0_ggml(w))


def linear_from_q4(qs: np.ndarray, d: np.ndarray, fmt: str) -> Linear:
    """A Linear from the block-major pair (qs [..., nb, out, 32], d [..., nb, out])."""
    nb, out = d.shape[-2:]
    if fmt == "f32":
        return Linear(out, nb * QK, w=dequantize_q4_0(qs, d))
    return Linear(out, nb * QK, blocks=q4_0_to_ggml(qs, d))


def linear_from_ggml(raw: np.ndarray, fmt: str, shape: tuple[int, ...] | None = None) -> Linear:
    """A Linear from ggml q4_0 bytes, used as they are (a view: a GGUF memmap is not copied).

    `raw` is uint8 in GGUF's tensor shape [..., out, nb*18] (one row's blocks per line), or any
    buffer of the right size when `shape` = (..., out, in) is given. fmt "f32" dequantizes."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"q4_0 bytes must be uint8, got {raw.dtype}")
    if shape is None:
        if raw.ndim < 2 or raw.shape[-1] % BLOCK_BYTES:
            raise ValueError(f"q4_0 bytes of shape {raw.shape}: the last axis must be a row of 18-byte blocks")
        *lead, out, row_bytes = raw.shape
        shape = (*lead, out, row_bytes // BLOCK_BYTES * QK)
    *lead, out, inp = shape
    if inp % QK or raw.size != int(np.prod(shape, dtype=np.int64)) // QK * BLOCK_BYTES:
        raise ValueError(f"{raw.size} bytes are not q4_0 blocks of a {list(shape)} matrix")
    blocks = raw.reshape(*lead, out, inp // QK, BLOCK_BYTES)
    if fmt == "f32":
        return Linear(out, inp, w=dequantize_ggml(blocks))
    return Linear(out, inp, blocks=blocks)


STREAM_ELEMS = 1 << 22  # f32 elements read per step by linear_from_rows (16 MB)


def linear_from_rows(read_rows, out: int, inp: int, fmt: str) -> Linear:
    """A 2-D Linear [out, in] from f32 rows read a bounded number at a time: `read_rows(r0, r1)`
    returns rows r0..r1-1 as f32 [r1-r0, in]. Only the result is full size (q4_0 blocks never span
    rows, so the bytes equal make_linear's of the whole matrix) — how a checkpoint's vocabulary-sized
    tensors load without an f32 copy of them."""
    step = max(1, STREAM_ELEMS // max(inp, 1))
    if fmt == "f32":
        w = np.empty((out, inp), np.float32)
        for r0 in range(0, out, step):
            w[r0:r0 + step] = read_rows(r0, min(out, r0 + step))
        return Linear(out, inp, w=w)
    blocks = np.empty((out, inp // QK, BLOCK_BYTES), np.uint8)
    for r0 in range(0, out, step):
        quantize_q4_0_ggml(read_rows(r0, min(out, r0 + step)), out=blocks[r0:r0 + step])
    return Linear(out, inp, blocks=blocks)


@dataclass(frozen=True)
class Layer:
    input_layernorm: np.ndarray  # [hidden]
    post_attention_layernorm: np.ndarray  # [hidden]
    q_norm: np.ndarray  # [head_dim]
    k_norm: np.ndarray  # [head_dim]
    q_proj: Linear  # [n_heads*hd, hidden]
    k_proj: Linear  # [n_kv*hd, hidden]
    v_proj: Linear
    o_proj: Linear  # [hidden, n_heads*hd]
    gate: Linear | None  # router [n_experts, hidden]; None: the layer's MLP is dense (qwen3, mlp_only_layers)
    gate_proj: Linear  # [E, ffn, hidden] (MoE) or [ffn, hidden] (dense)
    up_proj: Linear
    down_proj: Linear  # [E, hidden, ffn] or [hidden, ffn]
    # attention_bias: self_attn.{q,k,v,o}_proj.bias, f32 in either weight format (as ggml keeps them)
    q_bias: np.ndarray | None = None  # [n_heads*hd]
    k_bias: np.ndarray | None = None  # [n_kv*hd]
    v_bias: np.ndarray | None = None  # [n_kv*hd]
    o_bias: np.ndarray | None = None  # [hidden]


@dataclass(frozen=True)
class Model:
    cfg: Config
    fmt: str  # weights: "q4_0" | "f32"
    name: str
    embed_tokens: Linear  # [vocab, hidden]
    layers: tuple[Layer, ...]
    norm: np.ndarray  # [hidden]
    lm_head: Linear  # [vocab, hidden]
    inv_freq: np.ndarray  # f32 [head_dim/2], a model constant shared with the GPU
    attn_scale: np.float32
    tokenizer: object | None = None
    notes: tuple[str, ...] = ()  # what the user should know about the load (a tokenizer left unused)

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def rope_tables(cfg: Config) -> tuple[np.ndarray, np.float32]:
    """inv_freq[i] = 1/theta^(2i/d) (yarn: see _yarn_inv_freq) and head_dim^-0.5, each rounded once
    from f64 (the contract)."""
    i = np.arange(cfg.head_dim // 2, dtype=np.float64)
    if cfg.yarn is None:
        inv_freq = (1.0 / cfg.rope_theta ** (2.0 * i / cfg.head_dim)).astype(np.float32)
    else:
        inv_freq = _yarn_inv_freq(cfg, i).astype(np.float32)
    return inv_freq, np.float32(1.0 / np.sqrt(np.float64(cfg.head_dim)))


def rope_attention_factor(cfg: Config) -> np.float32 | None:
    """yarn's factor on cos and sin, rounded once from f64; None for default RoPE (no multiply at all)."""
    return None if cfg.yarn is None else np.float32(cfg.yarn.attention_factor)


def _yarn_inv_freq(cfg: Config, i: np.ndarray) -> np.ndarray:
    """transformers' _compute_yarn_parameters step by step, in f64 (HF runs the array part in f32):
    frequencies below the correction range are interpolated (divided by factor), those above it kept,
    and a linear ramp over dims [low, high] blends the two."""
    y, base, dim = cfg.yarn, cfg.rope_theta, cfg.head_dim

    def correction_dim(n_rot: float) -> float:  # the dim that turns n_rot times over the original context
        return dim * math.log(y.original_max_positions / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # weight of the unscaled frequency
    pos_freqs = base ** (2.0 * i / dim)
    return (1.0 / (y.factor * pos_freqs)) * (1.0 - extrapolation) + (1.0 / pos_freqs) * extrapolation


# ---------------------------------------------------------------- synthetic weights
#
# The embedded default model's weights *are* q4_0 blocks drawn from PCG64's raw
# 64-bit stream (stable across numpy versions and machines, unlike the
# distribution samplers), so the bytes are identical everywhere and no f32 copy
# is ever quantized. `--weights f32` uses their exact dequantized values.

def _stream(seed: int, name: str) -> np.random.PCG64:
    key = int.from_bytes(name.encode()[:32].ljust(32, b"\0"), "little")
    return np.random.PCG64([seed, key & (2**64 - 1), key >> 64 & (2**64 - 1), key >> 128 & (2**64 - 1)])


def _uniform(bits: np.random.PCG64, n: int) -> np.ndarray:
    """n floats uniform in [0, 1) from the top 24 bits of raw draws (exact in f32)."""
    raw = bits.random_raw(n) >> np.uint64(40)
    return raw.astype(np.float32) * np.float32(2.0**-24)


def synthetic_q4(seed: int, name: str, shape: tuple[int, ...], std: float) -> tuple[np.ndarray, np.ndarray]:
    """Random q4_0 blocks for a [..., out, in] matrix whose values have roughly the given std."""
    *lead, out, inp = shape
    nb = inp // QK
    bits = _stream(seed, name)
    n_vals = int(np.prod(lead, dtype=np.int64)) * out * inp
    raw = bits.random_raw(n_vals // 16)  # 16 nibbles per draw, nibble i in bits 4i..4i+3
    # byte m of a little-endian draw holds nibbles 2m (low) and 2m+1 (high): unpacked bytewise,
    # the temporaries are one byte per value, not eight
    by = raw.astype("<u8", copy=False).view(np.uint8).reshape(-1, 8)
    nib = np.empty((by.shape[0], 16), np.uint8)
    nib[:, 0::2] = by & np.uint8(15)
    nib[:, 1::2] = by >> np.uint8(4)
    qs = (nib.view(np.int8) - np.int8(8)).reshape(*lead, nb, out, QK)
    # nibble-8 has std ~4.61 but mean -0.5: a random sign per block scale cancels
    # that bias (a shared direction would make every token predict the same next
    # one); the magnitude is jittered by +-25% so blocks differ
    u = _uniform(bits, int(np.prod(lead, dtype=np.int64)) * nb * out).reshape(*lead, nb, out)
    sign = np.where(u < 0.5, np.float32(-1), np.float32(1))
    mag = np.float32(0.75) + np.float32(0.5) * (np.float32(2) * u - (u >= 0.5))
    d = (sign * np.float32(std / 4.61) * mag).astype(np.float16).astype(np.float32)
    return qs, d


def synthetic_norm(seed: int, name: str, n: int) -> np.ndarray:
    return np.float32(0.9) + np.float32(0.2) * _uniform(_stream(seed, name), n)


def synthetic_model(cfg: Config, fmt: str = "q4_0", seed: int = 0, name: str = "synthetic") -> Model:
    cfg.validate("q4_0")  # synthetic weights are q4_0 blocks at the source
    h, hd = cfg.hidden, cfg.head_dim

    def lin(tname: str, shape: tuple[int, ...], std: float | None = None) -> Linear:
        qs, d = synthetic_q4(seed, tname, shape, std if std is not None else shape[-1] ** -0.5)
        return linear_from_q4(qs, d, fmt)

    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        if cfg.layer_is_moe(i):
            e, f = cfg.n_experts, cfg.moe_intermediate
            gate = lin(p + "mlp.gate.weight", (e, h), std=1.0)  # router logits O(1) so routing varies
            ffn = (lin(p + "mlp.experts.gate_proj", (e, f, h)), lin(p + "mlp.experts.up_proj", (e, f, h)),
                   lin(p + "mlp.experts.down_proj", (e, h, f)))
        else:
            f = cfg.intermediate
            gate = None
            ffn = (lin(p + "mlp.gate_proj.weight", (f, h)), lin(p + "mlp.up_proj.weight", (f, h)),
                   lin(p + "mlp.down_proj.weight", (h, f)))
        layers.append(Layer(
            input_layernorm=synthetic_norm(seed, p + "input_layernorm.weight", h),
            post_attention_layernorm=synthetic_norm(seed, p + "post_attention_layernorm.weight", h),
            q_norm=synthetic_norm(seed, p + "self_attn.q_norm.weight", hd),
            k_norm=synthetic_norm(seed, p + "self_attn.k_norm.weight", hd),
            q_proj=lin(p + "self_attn.q_proj.weight", (cfg.q_dim, h)),
            k_proj=lin(p + "self_attn.k_proj.weight", (cfg.kv_dim, h)),
            v_proj=lin(p + "self_attn.v_proj.weight", (cfg.kv_dim, h)),
            # scaled down so 48 residual additions keep the stream O(1)
            o_proj=lin(p + "self_attn.o_proj.weight", (h, cfg.q_dim), std=0.5 * cfg.q_dim ** -0.5),
            gate=gate, gate_proj=ffn[0], up_proj=ffn[1], down_proj=ffn[2],
        ))
    inv_freq, scale = rope_tables(cfg)
    embed = lin("model.embed_tokens.weight", (cfg.vocab, h), std=1.0)
    lm_head = embed if cfg.tie_embeddings else lin("lm_head.weight", (cfg.vocab, h))
    return Model(cfg=cfg, fmt=fmt, name=name, embed_tokens=embed, layers=tuple(layers),
                 norm=synthetic_norm(seed, "model.norm.weight", h), lm_head=lm_head,
                 inv_freq=inv_freq, attn_scale=scale)
