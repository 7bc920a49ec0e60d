"""q4_0 / q8_0 block quantization (ggml rounding rules) and the q8 KV/query rows.

q4_0 and q8_0 follow ggml's reference quantizers bit for bit (the `gguf`
package's numpy port is the oracle in the tests), so dumps and weights can be
cross-checked with llama.cpp tooling. The q8 *row* format (one f32 scale per
row, int8 values) is ours: it is the KV cache and query quantization of the
numerics contract (docs/numerics.md).

In memory a q4_0 matrix [out, in] is kept exactly as ggml (and so a GGUF
file) stores it: `blocks` uint8 [out, nb, 18], each block of 32 weights an f16
scale `d` (2 bytes, little-endian) then 16 bytes of nibbles — byte j holds
element j in its low nibble and element j+16 in its high one, value
`d * (nibble - 8)`. 18 bytes per 32 weights, so a GGUF tensor's bytes are used
as they are. The block-major pair (`qs` int8 [nb, out, 32] holding q-8,
`d` f32 [nb, out]) is the older exchange form, kept for the converters below.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import QK, ModelError


class RangeError(ModelError):
    """Weights too large for q4_0: a block's f16 scale would be infinite (the caller names the tensor)."""


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


BLOCK_BYTES = 18  # one q4_0 block: f16 scale + 16 nibble bytes
_CHUNK = 1 << 20  # elements per step of the whole-matrix conversions: bounds their temporaries


def _q4_0_codes(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., out, in] f32 -> (nibbles uint8 [..., out, nb, 32] in 0..15, d f32 [..., out, nb]):
    ggml's quantize_row_q4_0_ref, vectorised."""
    *lead, out, inp = w.shape
    blocks = w.reshape(*lead, out, inp // QK, QK)  # [..., out, nb, 32]
    imax = np.abs(blocks).argmax(axis=-1)[..., None]
    big = np.take_along_axis(blocks, imax, axis=-1)  # signed element of largest magnitude
    d = big / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.trunc(blocks * inv + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    return q, d[..., 0]


def _row_chunks(n_rows: int, row_len: int):
    step = max(1, _CHUNK // max(row_len, 1))
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


def quantize_q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., out, in] f32 -> (qs int8 [..., nb, out, 32] in -8..7, d f32 [..., nb, out])."""
    w = np.asarray(w, dtype=np.float32)
    q, d = _q4_0_codes(w)
    d16 = d.astype(np.float16).astype(np.float32)
    qs = (q.astype(np.int8) - np.int8(8))
    return np.ascontiguousarray(np.moveaxis(qs, -2, -3)), np.ascontiguousarray(np.moveaxis(d16, -1, -2))


def quantize_q4_0_ggml(w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """[..., rows, in] f32 -> ggml q4_0 bytes [..., rows, nb, 18] (written into `out` if given).
    Row by row the same blocks as quantize_q4_0 (blocks never span rows), a bounded number of
    rows at a time so the temporaries stay small whatever the matrix."""
    w = np.asarray(w, dtype=np.float32)
    *lead, rows, inp = w.shape
    nb = inp // QK
    if out is None:
        out = np.empty((*lead, rows, nb, BLOCK_BYTES), np.uint8)
    elif not out.flags.c_contiguous:  # the flat view below would be a copy, the bytes lost
        raise ValueError("quantize_q4_0_ggml: `out` must be C-contiguous")
    flat_w, flat_o = w.reshape(-1, inp), out.reshape(-1, nb, BLOCK_BYTES)
    for r0, r1 in _row_chunks(flat_w.shape[0], inp):
        q, d = _q4_0_codes(flat_w[r0:r1])
        with np.errstate(over="ignore"):
            d16 = d.astype(np.float16)
        if not np.isfinite(d16).all():  # a finite f32 weight beyond 8 * 65504 makes an infinite scale
            raise RangeError(f"weights of magnitude up to {float(np.abs(flat_w[r0:r1]).max()):.3g} do not fit q4_0"
                             f" blocks (f16 scales end at 65504); the weights are damaged, or use --weights f32")
        flat_o[r0:r1, :, :2] = d16[..., None].view(np.uint8)
        flat_o[r0:r1, :, 2:] = q[..., :16] | (q[..., 16:] << np.uint8(4))
    return out


def ggml_scales(blocks: np.ndarray) -> np.ndarray:
    """The f16 scales of ggml q4_0 bytes [..., nb, 18] as f32 [..., nb]."""
    return blocks[..., :2].view(np.float16)[..., 0].astype(np.float32)


def dequantize_ggml(blocks: np.ndarray) -> np.ndarray:
    """ggml q4_0 bytes [..., out, nb, 18] -> f32 [..., out, nb*32], value = d * f32(nibble - 8) —
    bit for bit dequantize_q4_0 of the same blocks (and the gguf package's)."""
    *lead, out, nb, _ = blocks.shape
    res = np.empty((*lead, out, nb, QK), np.float32)
    flat_b, flat_r = blocks.reshape(-1, nb, BLOCK_BYTES), res.reshape(-1, nb, QK)
    for r0, r1 in _row_chunks(flat_b.shape[0], nb * QK):
        b = flat_b[r0:r1]
        nib = b[..., 2:]
        vals = np.empty((r1 - r0, nb, QK), np.float32)
        vals[..., :16] = nib & np.uint8(15)
        vals[..., 16:] = nib >> np.uint8(4)
        vals -= np.float32(8)
        np.multiply(ggml_scales(b)[..., None], vals, out=flat_r[r0:r1])
    return res.reshape(*lead, out, nb * QK)


def dequantize_q4_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Inverse layout of quantize_q4_0 -> [..., out, in] f32 (value = d * (q-8))."""
    vals = d[..., None] * qs.astype(np.float32)  # [..., nb, out, 32]
    vals = np.moveaxis(vals, -3, -2)  # [..., out, nb, 32]
    return vals.reshape(*vals.shape[:-2], -1)


def q4_0_to_ggml(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Block-major (qs [..., nb, out, 32], d [..., nb, out]) -> ggml bytes [..., out, nb, 18]
    (f16 d, 16 packed nibble bytes)."""
    q = np.moveaxis(qs, -3, -2).view(np.uint8) + np.uint8(8)  # [..., out, nb, 32]: int8 -8..7 -> 0..15
    raw = np.empty((*q.shape[:-1], BLOCK_BYTES), np.uint8)  # C order, whatever the inputs' layout
    raw[..., :2] = np.moveaxis(d, -2, -1).astype(np.float16)[..., None].view(np.uint8)
    raw[..., 2:] = q[..., :16] | (q[..., 16:] << np.uint8(4))
    return raw


def q4_0_from_ggml(raw: np.ndarray, out: int, inp: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml q4_0 bytes of a [out, in] matrix -> block-major (qs, d)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(out, inp // QK, BLOCK_BYTES)
    d = ggml_scales(blocks)
    packed = blocks[..., 2:]
    q = np.concatenate([packed & np.uint8(15), packed >> np.uint8(4)], axis=-1).astype(np.int8) - np.int8(8)
    return np.ascontiguousarray(np.moveaxis(q, -2, -3)), np.ascontiguousarray(d.T)


def ggml_to_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml q4_0 bytes [..., out, nb, 18] (a stack too) -> block-major (qs [..., nb, out, 32], d [..., nb, out])."""
    packed = blocks[..., 2:]
    q = np.concatenate([packed & np.uint8(15), packed >> np.uint8(4)], axis=-1).view(np.int8) - np.int8(8)
    return (np.ascontiguousarray(np.moveaxis(q, -2, -3)),
            np.ascontiguousarray(np.moveaxis(ggml_scales(blocks), -1, -2)))


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., n] f32 -> (qs int8 [..., nb, 32], d f32 [..., nb] holding f16-rounded scales)."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = _inverse(d)
    qs = _roundf(blocks * inv[..., None]).astype(np.int8)
    return qs, d.astype(np.float16).astype(np.float32)


@dataclass(frozen=True)
class CodeFlips:
    """Where two q8_0 quantizations of nearly equal activations disagree (a q4_0 GEMV's input):
    in the int8 codes, in the blocks' f16 scales, or both."""
    n: int             # elements whose code differs
    n_blocks: int      # blocks holding one
    index: int | None  # the first such element (None: every code equal)
    scaled: tuple[float, float] | None  # x * (1/d) before rounding there, reference and subject
    codes: tuple[int, int] | None
    n_scales: int = 0             # blocks whose f16 scale differs
    scale_block: int | None = None  # the first such block
    scales: tuple[float, float] | None = None
    scale_steps: int = 0          # f16 steps between the two scales there


def q8_0_code_flips(ref: np.ndarray, sub: np.ndarray) -> CodeFlips | None:
    """Compare the q8_0 codes and block scales both sides' activations round to (None: all equal).

    A 1-ULP difference in an activation moves ``x/d`` across a .5 boundary now and then: the
    code changes by one, the GEMV's integer dot by a whole weight, and a far key follows. A
    block's max that differs moves its f16 scale by a step now and then: every product of the
    block is scaled otherwise, with all its codes equal.
    """
    ref, sub = (np.asarray(a, dtype=np.float32).reshape(-1) for a in (ref, sub))
    if ref.shape != sub.shape or ref.size % QK:
        return None
    (qa, da), (qb, db) = quantize_q8_0(ref), quantize_q8_0(sub)
    diff = (qa != qb).reshape(-1)
    ha, hb = (d.astype(np.float16).view(np.int16).astype(np.int32) for d in (da, db))
    sdiff = ha != hb
    if not diff.any() and not sdiff.any():
        return None
    index = scaled = codes = None
    if diff.any():
        i = int(np.argmax(diff))
        b = i // QK
        index = i
        scaled = tuple(float(np.float32(x[i]) * _inverse(np.abs(x[b * QK:(b + 1) * QK]).max() / np.float32(127)))
                       for x in (ref, sub))
        codes = (int(qa.reshape(-1)[i]), int(qb.reshape(-1)[i]))
    block = scales = None
    steps = 0
    if sdiff.any():
        block = int(np.argmax(sdiff))
        scales = (float(da[block]), float(db[block]))
        # f16 bits are ordered like the values within one sign; across signs the count is no step count
        steps = abs(int(ha[block]) - int(hb[block])) if (ha[block] < 0) == (hb[block] < 0) else 0
    return CodeFlips(int(diff.sum()), int((qa != qb).any(axis=-1).sum()), index, scaled, codes,
                     int(sdiff.sum()), block, scales, steps)


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
