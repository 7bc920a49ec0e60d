"""The model in memory: per-layer tensors in the GEMV's format, HF tensor names kept.

A `Linear` holds one weight matrix (or a stack of experts) either as q4_0
blocks or as f32. Two sources fill a `Model`: the deterministic synthetic
generator (the embedded default) and HF safetensors checkpoints (model/hf.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import QK, Config
from .quant import dequantize_q4_0, quantize_q4_0

FORMATS = ("q4_0", "f32")
KV_FORMATS = ("q8", "f32")


@dataclass(frozen=True)
class Linear:
    """y = W x for W [..., out, in]; the leading axis, when present, indexes experts."""

    out: int
    inp: int
    w: np.ndarray | None = None  # f32 [..., out, in]
    qs: np.ndarray | None = None  # int8 [..., nb, out, 32], q-8 in -8..7
    d: np.ndarray | None = None  # f32 [..., nb, out], f16-exact scales
    # qs widened to f32 once: integer products and their block sums stay exact in
    # f32 (|sum| <= 32*8*127 < 2^24), so the block dot can run on BLAS.
    qsf: np.ndarray | None = field(default=None, repr=False)

    @property
    def fmt(self) -> str:
        return "f32" if self.w is not None else "q4_0"

    def dense(self) -> np.ndarray:
        """The weights as f32 [..., out, in] (dequantized for q4_0)."""
        return self.w if self.w is not None else dequantize_q4_0(self.qs, self.d)

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows of a 2-D matrix as f32 [len(idx), in] (embedding lookup)."""
        if self.w is not None:
            return self.w[idx]
        vals = self.d[:, idx, None] * self.qs[:, idx, :].astype(np.float32)  # [nb, n, 32]
        return np.ascontiguousarray(vals.transpose(1, 0, 2).reshape(len(idx), self.inp))


def concat_rows(lins: tuple[Linear, ...]) -> Linear:
    """Stack several matrices of one input along `out` (q/k/v, gate/up): each output
    row is computed on its own, so one GEMV over the stack equals the separate ones."""
    if lins[0].w is not None:
        return Linear(sum(l.out for l in lins), lins[0].inp, w=np.concatenate([l.w for l in lins], axis=-2))
    qs = np.concatenate([l.qs for l in lins], axis=-2)
    qsf = np.concatenate([l.qsf for l in lins], axis=-2) if all(l.qsf is not None for l in lins) else None
    return Linear(sum(l.out for l in lins), lins[0].inp, qs=qs, d=np.concatenate([l.d for l in lins], axis=-1),
                  qsf=qsf)


def make_linear(w: np.ndarray, fmt: str) -> Linear:
    w = np.asarray(w, dtype=np.float32)
    if fmt == "f32":
        out, inp = w.shape[-2:]
        return Linear(out, inp, w=np.ascontiguousarray(w))
    return linear_from_q4(*quantize_q4_0(w), fmt)


# Matrices up to this many elements keep an f32-widened copy of their q4_0 values
# (4x the memory, no per-call conversion); larger expert stacks — a real 30B
# layer would need ~116 GB of copies — widen only the selected experts per call.
WIDEN_MAX = 1 << 26


def linear_from_q4(qs: np.ndarray, d: np.ndarray, fmt: str) -> Linear:
    nb, out = d.shape[-2:]
    if fmt == "f32":
        return Linear(out, nb * QK, w=dequantize_q4_0(qs, d))
    return Linear(out, nb * QK, qs=qs, d=d, qsf=qs.astype(np.float32) if qs.size <= WIDEN_MAX else None)


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
    gate: Linear | None  # router [n_experts, hidden]; None for dense qwen3
    gate_proj: Linear  # [E, ffn, hidden] (MoE) or [ffn, hidden] (dense)
    up_proj: Linear
    down_proj: Linear  # [E, hidden, ffn] or [hidden, ffn]


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

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def rope_tables(cfg: Config) -> tuple[np.ndarray, np.float32]:
    """inv_freq[i] = 1/theta^(2i/d) and head_dim^-0.5, each rounded once from f64 (the contract)."""
    i = np.arange(cfg.head_dim // 2, dtype=np.float64)
    inv_freq = (1.0 / cfg.rope_theta ** (2.0 * i / cfg.head_dim)).astype(np.float32)
    return inv_freq, np.float32(1.0 / np.sqrt(np.float64(cfg.head_dim)))


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
    raw = bits.random_raw(n_vals // 16)  # 16 nibbles per draw
    nib = (raw[:, None] >> (np.arange(16, dtype=np.uint64) * np.uint64(4))) & np.uint64(15)
    qs = (nib.astype(np.int8) - np.int8(8)).reshape(*lead, nb, out, QK)
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
        if cfg.is_moe:
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
