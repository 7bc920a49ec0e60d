"""q4_0 / q8_0 block quantization (ggml rounding rules) and the q8 KV/query rows.

q4_0 and q8_0 follow ggml's reference quantizers bit for bit (the `gguf`
package's numpy port is the oracle in the tests), so dumps and weights can be
cross-checked with llama.cpp tooling. The q8 *row* format (one f32 scale per
row, int8 values) is ours: it is the KV cache and query quantization of the
numerics contract (docs/numerics.md).

In memory a q4_0 matrix [out, in] is kept block-major: `qs` int8 [nb, out, 32]
holding q-8 in -8..7 and `d` f32 [nb, out] (the f16 scales widened), because
the reference GEMV runs one batched integer matmul per 32-block.
"""
from __future__ import annotations

import numpy as np

from .config import QK


def _roundf(x: np.ndarray) -> np.ndarray:
    """C roundf: half away from zero (ggml's rounding), exact in f32."""
    a = np.abs(x)
    fl = np.floor(a)
    return np.copysign(fl + np.floor((a - fl) * np.float32(2)), x)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d, or 0 where that is not finite (d == 0, or d so tiny that 1/d overflows:
    then every x*id would be inf or NaN and the int8 cast undefined)."""
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.float32(1) / d
    return np.where(np.isfinite(inv), inv, np.float32(0)).astype(np.float32)


def quantize_q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., out, in] f32 -> (qs int8 [..., nb, out, 32] in -8..7, d f32 [..., nb, out])."""
    w = np.asarray(w, dtype=np.float32)
    *lead, out, inp = w.shape
    blocks = w.reshape(*lead, out, inp // QK, QK)  # [..., out, nb, 32]
    imax = np.abs(blocks).argmax(axis=-1)[..., None]
    big = np.take_along_axis(blocks, imax, axis=-1)  # signed element of largest magnitude
    d = big / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.trunc(blocks * inv + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    d16 = d[..., 0].astype(np.float16).astype(np.float32)
    qs = (q.astype(np.int8) - np.int8(8))
    return np.ascontiguousarray(np.moveaxis(qs, -2, -3)), np.ascontiguousarray(np.moveaxis(d16, -1, -2))


def dequantize_q4_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Inverse layout of quantize_q4_0 -> [..., out, in] f32 (value = d * (q-8))."""
    vals = d[..., None] * qs.astype(np.float32)  # [..., nb, out, 32]
    vals = np.moveaxis(vals, -3, -2)  # [..., out, nb, 32]
    return vals.reshape(*vals.shape[:-2], -1)


def q4_0_to_ggml(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Block-major (qs, d) of one matrix -> ggml bytes [out, nb, 18] (f16 d, 16 packed nibble bytes)."""
    q = (np.moveaxis(qs, -3, -2).astype(np.int16) + 8).astype(np.uint8)  # [out, nb, 32]
    packed = q[..., :16] | (q[..., 16:] << np.uint8(4))
    d16 = np.moveaxis(d, -2, -1).astype(np.float16)[..., None].view(np.uint8)  # [out, nb, 2]
    return np.concatenate([d16, packed], axis=-1)


def q4_0_from_ggml(raw: np.ndarray, out: int, inp: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml q4_0 bytes of a [out, in] matrix -> block-major (qs, d)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(out, inp // QK, 18)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 2:]
    q = np.concatenate([packed & np.uint8(15), packed >> np.uint8(4)], axis=-1).astype(np.int8) - np.int8(8)
    return np.ascontiguousarray(np.moveaxis(q, -2, -3)), np.ascontiguousarray(d.T)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., n] f32 -> (qs int8 [..., nb, 32], d f32 [..., nb] holding f16-rounded scales)."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = _inverse(d)
    qs = _roundf(blocks * inv[..., None]).astype(np.int8)
    return qs, d.astype(np.float16).astype(np.float32)


def q8_0_to_ggml(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(qs [nb, 32], d [nb]) -> ggml q8_0 bytes [nb, 34]."""
    return np.concatenate([d.astype(np.float16)[..., None].view(np.uint8), qs.view(np.uint8)], axis=-1)


def quantize_rows_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KV / query rows: [..., n] f32 -> (int8 [..., n], f32 scale [...]); scale kept in f32."""
    x = np.asarray(x, dtype=np.float32)
    d = np.abs(x).max(axis=-1) / np.float32(127)
    inv = _inverse(d)
    q = np.clip(_roundf(x * inv[..., None]), -127, 127).astype(np.int8)
    return q, d
