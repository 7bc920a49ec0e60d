#!/usr/bin/env python3
"""Replay one op of an LLM decode step from this folder, with numpy only.

This folder is a repro bundle written by kestrel-tui (`kestrel-tui repro`). It holds one op of
one decode step, as two engines ran it: the op's inputs as each side consumed them
(inputs/reference/, inputs/subject/), both sides' outputs (outputs/), the weights the op reads in
the format the reference stores them (weights/), and case.json, which says what it is (model,
prompt, position, layer, op, engines, versions, tolerance, verdict).

    python replay.py          # prints one line per comparison and the verdict
    python replay.py FOLDER   # the same for the bundle in FOLDER (this replay.py on another bundle)

It recomputes the reference's op (the numerics contract, whose rules case.json names: "L2 (G1, Q2)"
and so on) from the inputs, three times over:

  reference  ref-op(reference's inputs) against the reference's recorded output: bit for bit
             when the reference is the contract (else this replay cannot speak for it: exit 2)
  op         ref-op(subject's inputs) against the subject's output, judged by the tolerance:
             far here means the subject's op itself computes otherwise
  run        the reference's output against the subject's, as the run judged it

and ends with the verdict (the op line's): ok, close or far, with the metric and its threshold.
Exit 0 for ok and close, 1 for far, 2 when the bundle cannot be replayed: one line on stderr naming
the file or field and the fix.

It trusts nothing in its folder (kestrel-tui's docs/repro.md, "What replay.py checks"): case.json is
checked against the schema below (CASE, KINDS), every array's .npy header against the dtype and shape
case.json declares, and those against the op, before any data is read; only regular files inside the
folder are opened, never through a link; sizes are bounded; the text it prints is made inert.

Everything below is self-contained: the contract's ordered sums, the q8_0 / q4_0 formats, an exact
fused multiply-add, and literal scalar transcriptions of the UCRT expf / cosf / sinf that the
contract's reference uses (slow but plain: a few thousand calls a second). Each function names
the contract rule it states. kestrel-tui's tests check every one of them against its own code,
bit for bit, on random inputs.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
import sys
import unicodedata
import warnings

import numpy as np

F32 = np.float32
QK = 32  # elements per q4_0 / q8_0 block


# ---------------------------------------------------------------- N3: exact fused multiply-add

def fma(a: float, b: float, c: float) -> float:
    """RN(a*b + c) of binary64 values, exactly: every finite double is an integer over a power of two,
    the sum is computed exactly on integers, and Python's integer true division rounds correctly."""
    an, ad = a.as_integer_ratio()
    bn, bd = b.as_integer_ratio()
    cn, cd = c.as_integer_ratio()
    num = an * bn * cd + cn * ad * bd
    if num == 0:  # an exact zero: IEEE gives -0 only for (-0) + (-0)
        return a * b + c if a * b == 0 and c == 0 else 0.0
    return num / (ad * bd * cd)


def _bits64(b: int) -> float:
    return float(np.array(b, dtype=np.uint64).view(np.float64))


# ---------------------------------------------------------------- T1: expf (the UCRT's)

EXP_K = _bits64(0x40571547652B82FE)   # 64/ln2
EXP_C2 = _bits64(0x3F862E42FEFA39EF)  # ln2/64
EXP_C0 = _bits64(0x3FC5555555555555)  # 1/6
EXP_C1 = 0.5
EXP_X_MAX = float(np.array(0x42B17218, dtype=np.uint32).view(np.float32))  # 88.7228394f
EXP_T = [_bits64(b) for b in (  # T[j] = 2^(j/64), correctly rounded
    0x3FF0000000000000, 0x3FF02C9A3E778061, 0x3FF059B0D3158574, 0x3FF0874518759BC8,
    0x3FF0B5586CF9890F, 0x3FF0E3EC32D3D1A2, 0x3FF11301D0125B51, 0x3FF1429AAEA92DE0,
    0x3FF172B83C7D517B, 0x3FF1A35BEB6FCB75, 0x3FF1D4873168B9AA, 0x3FF2063B88628CD6,
    0x3FF2387A6E756238, 0x3FF26B4565E27CDD, 0x3FF29E9DF51FDEE1, 0x3FF2D285A6E4030B,
    0x3FF306FE0A31B715, 0x3FF33C08B26416FF, 0x3FF371A7373AA9CB, 0x3FF3A7DB34E59FF7,
    0x3FF3DEA64C123422, 0x3FF4160A21F72E2A, 0x3FF44E086061892D, 0x3FF486A2B5C13CD0,
    0x3FF4BFDAD5362A27, 0x3FF4F9B2769D2CA7, 0x3FF5342B569D4F82, 0x3FF56F4736B527DA,
    0x3FF5AB07DD485429, 0x3FF5E76F15AD2148, 0x3FF6247EB03A5585, 0x3FF6623882552225,
    0x3FF6A09E667F3BCD, 0x3FF6DFB23C651A2F, 0x3FF71F75E8EC5F74, 0x3FF75FEB564267C9,
    0x3FF7A11473EB0187, 0x3FF7E2F336CF4E62, 0x3FF82589994CCE13, 0x3FF868D99B4492ED,
    0x3FF8ACE5422AA0DB, 0x3FF8F1AE99157736, 0x3FF93737B0CDC5E5, 0x3FF97D829FDE4E50,
    0x3FF9C49182A3F090, 0x3FFA0C667B5DE565, 0x3FFA5503B23E255D, 0x3FFA9E6B5579FDBF,
    0x3FFAE89F995AD3AD, 0x3FFB33A2B84F15FB, 0x3FFB7F76F2FB5E47, 0x3FFBCC1E904BC1D2,
    0x3FFC199BDD85529C, 0x3FFC67F12E57D14B, 0x3FFCB720DCEF9069, 0x3FFD072D4A07897C,
    0x3FFD5818DCFBA487, 0x3FFDA9E603DB3285, 0x3FFDFC97337B9B5F, 0x3FFE502EE78B3FF6,
    0x3FFEA4AFA2A490DA, 0x3FFEFA1BEE615A27, 0x3FFF50765B6E4540, 0x3FFFA7C1819E90D8)]


def expf1(x: float) -> float:
    """T1 on one float32 value (given as a Python float); returns the binary64 to round to float32.
    n = rint(x*K); j = n & 63; m = n >> 6; r = fma(-n, C2, x); z = r*r;
    p = fma(fma(r, C0, C1), z, r); result 2^m * fma(T[j], p, T[j])."""
    if x > EXP_X_MAX:
        return math.inf
    if x < -104.0:
        return 0.0
    n = round(x * EXP_K)  # ties to even
    j, m = n & 63, n >> 6
    r = fma(-float(n), EXP_C2, x)
    z = r * r
    p = fma(fma(r, EXP_C0, EXP_C1), z, r)
    return math.ldexp(fma(EXP_T[j], p, EXP_T[j]), m)


def expf(x: np.ndarray) -> np.ndarray:
    """T1 elementwise on a float32 array; a NaN comes out as it went in, quieted."""
    x = np.asarray(x, dtype=F32)
    flat = x.reshape(-1)
    out = np.array([v if v != v else expf1(v) for v in flat.astype(np.float64).tolist()], dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return out.astype(F32).reshape(x.shape)


def silu(x: np.ndarray) -> np.ndarray:
    """T3: x / (1 + expf(-x))."""
    with np.errstate(invalid="ignore"):
        return x / (F32(1) + expf(-x))


# ---------------------------------------------------------------- T2: cosf / sinf (the UCRT's)

INV_PIO2 = _bits64(0x3FE45F306DC9C883)  # 2/pi
PIO2_HI = _bits64(0x3FF921FB54400000)
PIO2_LO = _bits64(0x3DD0B4611A626331)
A3, A5, A7, A9 = (_bits64(b) for b in (0x3FA5555555555555, 0xBF56C16C16C16C16, 0x3EFA01A01A01A019,
                                       0xBE927E4FB7789F5C))
B3, B5, B7, B9 = (_bits64(b) for b in (0xBFC5555555555555, 0x3F81111111111111, 0xBF2A01A01A01A01A,
                                       0x3EC71DE3A556C734))
AU_PIO4, AU_TINY, AU_SMALL = 0x3F490FDB, 0x39000000, 0x3C000000  # pi/4, 2^-13, 2^-7 as float32 bits
AU_HUGE = {"cos": 0x4F490FDB, "sin": 0x4B800456}  # beyond: the UCRT's Payne-Hanek, not replicated


def _cos_poly(x: float) -> float:
    z = x * x
    return fma(fma(z, fma(z, fma(z, A9, A7), A5), A3), z * z, 1.0 - 0.5 * z)


def _sin_poly(x: float) -> float:
    z = x * x
    return fma(fma(z, fma(z, fma(z, B9, B7), B5), B3), x * z, x)


def trig1(x: float, au: int, which: str) -> float:
    """T2 on one float32 value (x, and au the float32 bits of |x|): the binary64 to round to float32."""
    if au >= AU_HUGE[which]:  # huge, inf, nan: each side's binary64 cos/sin, bits not promised
        return float((np.cos if which == "cos" else np.sin)(np.float64(x)))
    if au <= AU_PIO4:
        if which == "cos":
            return 1.0 if au < AU_TINY else fma(-(x * 0.5), x, 1.0) if au < AU_SMALL else _cos_poly(x)
        return x if au < AU_TINY else fma(-(x * x * x), -B3, x) if au < AU_SMALL else _sin_poly(x)
    ax = abs(x)
    n = math.trunc(fma(ax, INV_PIO2, 0.5))  # Cody-Waite
    r = fma(-float(n), PIO2_HI, ax) - n * PIO2_LO
    if which == "cos":
        res = _sin_poly(r) if n & 1 else _cos_poly(r)
        return -res if (((n & 3) + 1) >> 1) & 1 else res
    res = _cos_poly(r) if n & 1 else _sin_poly(r)
    return -res if ((n & 3) >= 2) != (x < 0) else res


def sincosf(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=F32)
    flat = x.reshape(-1)
    au = (flat.view(np.uint32) & np.uint32(0x7FFFFFFF)).tolist()
    vals = flat.astype(np.float64).tolist()
    with np.errstate(invalid="ignore"):
        return tuple(np.array([trig1(v, a, which) for v, a in zip(vals, au)], np.float64).astype(F32)
                     .reshape(x.shape) for which in ("cos", "sin"))


# ---------------------------------------------------------------- R: ordered sums

def seq_sum(t: np.ndarray, axis: int = -1) -> np.ndarray:
    """R3: s = 0; s = s + t[i] ascending."""
    return np.add.accumulate(t, axis=axis).take(-1, axis=axis) + F32(0)


def lane_sum(t: np.ndarray, axis: int = -1) -> np.ndarray:
    """R1: 32 lanes, lane i = ((0 + t[i]) + t[i+32]) + ...; then v[i] += v[i^off], off = 16, 8, 4, 2, 1."""
    t = np.moveaxis(t, axis, 0)
    n = t.shape[0]
    lanes = min(n, 32)
    v = t[:lanes] + F32(0)
    for start in range(32, n, 32):
        chunk = t[start:start + 32]
        v[: len(chunk)] += chunk
    for off in (16, 8, 4, 2, 1):
        if lanes > off:
            v[: lanes - off] += v[off:lanes]
            v = v[:off]
            lanes = off
    return v[0]


def sumsq_block8(x: np.ndarray) -> np.ndarray:
    """R2: per 8-block lo[k] = x[b+k]^2 + x[b+4+k]^2, (lo0+lo1) + (lo2+lo3), added to ss ascending;
    then the tail element by element."""
    n = x.shape[-1]
    n8 = n & ~7
    sq = x[..., :n8].reshape(*x.shape[:-1], n8 // 8, 8)
    sq = sq * sq
    lo = sq[..., :4] + sq[..., 4:]
    terms = (lo[..., 0] + lo[..., 1]) + (lo[..., 2] + lo[..., 3])
    if n8 < n:
        tail = x[..., n8:]
        terms = np.concatenate([terms, tail * tail], axis=-1)
    return seq_sum(terms)


# ---------------------------------------------------------------- Q: quantization

def roundf(x: np.ndarray) -> np.ndarray:
    """C roundf: half away from zero."""
    a = np.abs(x)
    fl = np.floor(a)
    return np.copysign(fl + np.floor((a - fl) * F32(2)), x)


def inverse(d: np.ndarray) -> np.ndarray:
    """1/d, or 0 where that is not finite."""
    with np.errstate(divide="ignore", over="ignore"):
        inv = F32(1) / d
    return np.where(np.isfinite(inv), inv, F32(0)).astype(F32)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q2: per 32-block d = max|x| / 127, q = roundf(x * (1/d)); d stored as f16 (returned as f32)."""
    blocks = np.asarray(x, dtype=F32).reshape(-1, QK)
    d = np.abs(blocks).max(axis=-1) / F32(127)
    q = roundf(blocks * inverse(d)[:, None]).astype(np.int8)
    return q, d.astype(np.float16).astype(F32)


def quantize_rows_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3 / Q4: per row d = max|x| / 127 kept in f32, q = clamp(roundf(x * (1/d)), -127, 127)."""
    x = np.asarray(x, dtype=F32)
    d = np.abs(x).max(axis=-1) / F32(127)
    q = np.clip(roundf(x * inverse(d)[..., None]), -127, 127).astype(np.int8)
    return q, d


def q4_0_values(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q1, ggml's bytes [..., nb, 18] -> (codes q-8 as int32 [..., nb, 32], scales d as f32 [..., nb]):
    2 bytes f16 d, then byte j = q[j] | q[j+16] << 4."""
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(F32)
    nib = blocks[..., 2:]
    q = np.concatenate([nib & np.uint8(15), nib >> np.uint8(4)], axis=-1).astype(np.int32) - 8
    return q, d


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """value = d * f32(q - 8), rows [..., nb*32]."""
    q, d = q4_0_values(blocks)
    return (d[..., None] * q.astype(F32)).reshape(*blocks.shape[:-2], -1)


# ---------------------------------------------------------------- G: GEMV

ROWS = 1024  # output rows per step: bounds the temporaries whatever the matrix


def gemv(w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = W x in the contract's order. q4_0 bytes [out, nb, 18] (G1: x quantized to q8_0 (Q2),
    isum = sum(qw*qx) per block, exact; term = f32(isum) * (dw*dx); y = lane_sum over blocks) or
    f32 [out, in] (G2: y = lane_sum(w[i]*x[i]) over elements). A bias is one f32 add after (L2)."""
    x = np.asarray(x, dtype=F32).reshape(-1)
    y = np.empty(w.shape[0], F32)
    if w.dtype == np.uint8:
        qx, dx = quantize_q8_0(x)
        qx = qx.astype(np.int32)
        for r0 in range(0, w.shape[0], ROWS):
            qw, dw = q4_0_values(w[r0:r0 + ROWS])
            isum = (qw * qx[None]).sum(axis=-1, dtype=np.int64)  # exact in any order (N4)
            y[r0:r0 + ROWS] = lane_sum(isum.astype(F32) * (dw * dx[None]), axis=-1)
    else:
        for r0 in range(0, w.shape[0], ROWS):
            y[r0:r0 + ROWS] = lane_sum(w[r0:r0 + ROWS] * x[None], axis=-1)
    return y if bias is None else y + bias


# ---------------------------------------------------------------- L: the layer's ops

def normalize(x: np.ndarray, ss: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rms = 1 / sqrt(ss/d + eps) (IEEE divide, add, sqrt, divide); out = (x*rms)*w."""
    rms = F32(1) / np.sqrt(ss / F32(x.shape[-1]) + F32(eps))
    return (x * rms[..., None]) * w


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """L1 / L8 / L9: the hidden-size RMSNorm, sum of squares in 8-blocks (R2)."""
    return normalize(x, sumsq_block8(x), w, eps)


def qknorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """L3: per head over head_dim, sequential sum of squares (R3). x [heads, hd]."""
    return normalize(x, seq_sum(x * x), w, eps)


def rope_tables(c: dict, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """L4a: a = f32(t) * inv_freq[i], cosf(a), sinf(a) (T2); L4c: times yarn's factor where it has one."""
    cos, sin = sincosf(F32(c["position"]) * inv_freq)
    if c.get("rope_factor") is not None:
        cos, sin = cos * F32(c["rope_factor"]), sin * F32(c["rope_factor"])
    return cos, sin


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """L4a half-split rotation: y[i] = x[i]*c - x[i+h]*s, y[i+h] = x[i+h]*c + x[i]*s. x [heads, hd]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def kv_row(x: np.ndarray, kv: str) -> tuple[np.ndarray, np.ndarray]:
    """L5: a cache row per kv head, q8 (Q3: int8 codes and an f32 scale) or f32 as it is (scales 1)."""
    if kv == "q8":
        return quantize_rows_q8(x)
    return x, np.ones(x.shape[:-1], F32)


def attention(q: np.ndarray, k: np.ndarray, ks: np.ndarray, v: np.ndarray, vs: np.ndarray,
              scale: float) -> np.ndarray:
    """L6 over the cache rows 0..t (k/v [T, n_kv, hd], int8 with f32 scales ks/vs [T, n_kv], or f32).
    Scores: q8 (L6a) s = (f32(isum) * (dq*dk)) * scale with the query row-quantized (Q4); f32 (L6b)
    s = lane_sum(q*k) * scale. Online softmax (L6d), position by position: m' = max(m, s),
    c = expf(m - m'), w = expf(s - m'), l = l*c + w, acc = acc*c + w*v, m = m'; out = acc / l."""
    n_heads, hd = q.shape
    n_kv = k.shape[1]
    kvh = np.arange(n_heads) // (n_heads // n_kv)  # q head h reads kv head h // group
    scale = F32(scale)
    if k.dtype == np.int8:
        qq, dq = quantize_rows_q8(q)
        isum = np.einsum("hd,thd->ht", qq.astype(np.int64), k[:, kvh].astype(np.int64))
        s = (isum.astype(F32) * (dq[:, None] * ks[:, kvh].T)) * scale  # [heads, T]
        vals = v.astype(F32) * vs[..., None]
    else:
        s = lane_sum(q[None] * k[:, kvh], axis=-1).T * scale
        vals = v
    m = np.full(n_heads, -np.inf, F32)
    l = np.zeros(n_heads, F32)
    acc = np.zeros((n_heads, hd), F32)
    for p in range(k.shape[0]):
        m_new = np.maximum(m, s[:, p])
        c = expf(m - m_new)
        w = expf(s[:, p] - m_new)
        l = l * c + w
        acc = acc * c[:, None] + w[:, None] * vals[p, kvh]
        m = m_new
    return (acc / l[:, None]).reshape(-1)


def route(r: np.ndarray, top_k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """L8a softmax over experts (expf, R3 sum in expert order), L8b top-k descending, ties to the lower
    index, renormalised (R3 in rank order) when norm_topk_prob."""
    e = expf(r - r.max())
    p = e / seq_sum(e)
    idx = np.argsort(-p, kind="stable")[:top_k]
    w = p[idx]
    if norm:
        w = w / seq_sum(w)
    return idx.astype(np.int32), w


def mlp(gate: np.ndarray, up: np.ndarray, down: np.ndarray, h: np.ndarray) -> np.ndarray:
    """L8c one SwiGLU: down(silu(gate h) * up h), the product re-quantized for down (Q2)."""
    return gemv(down, silu(gemv(gate, h)) * gemv(up, h))


def experts(w: dict, h: np.ndarray, idx: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """L8c-d: each chosen expert in rank order, moe = moe + w_j * y_j; L8e a dense MLP alone."""
    if "expert_ids" not in w:
        return mlp(w["gate_proj"], w["up_proj"], w["down_proj"], h)
    slot = {int(e): i for i, e in enumerate(w["expert_ids"])}
    for e in idx.tolist():
        if e not in slot:
            raise Damaged(f"the routing chose expert {e}, which weights expert_ids does not ship; {FIX}")
    out = np.zeros(h.shape, F32)
    for j, e in enumerate(idx.tolist()):
        i = slot[e]
        out = out + wt[j] * mlp(w["gate_proj"][i], w["up_proj"][i], w["down_proj"][i], h)
    return out


def ffn(w: dict, c: dict, ores: np.ndarray) -> np.ndarray:
    """L8: post-attention RMSNorm, then the router and experts (or the dense MLP)."""
    h = rmsnorm(ores, w["post_attention_layernorm"], c["eps"])
    if "gate" not in w:
        return experts(w, h, None, None)
    if c["top_k"] < 1:
        raise Damaged(f"const.top_k is {c['top_k']}, but the layer ships a router (weights gate); {FIX}", "case.json")
    idx, wt = route(gemv(w["gate"], h), c["top_k"], c["norm_topk_prob"])
    return experts(w, h, idx, wt)


# kind -> (inputs, weights, constants) -> the op's output; case.json names the kind
def _embed(i, w, c):
    token, ids = int(i["token"][0]), [int(r) for r in w["row_ids"]]
    if token not in ids:
        raise Damaged(f"the consumed token {token} (inputs token) is not one of the rows weights row_ids ships; {FIX}")
    row = w["rows"][ids.index(token)]
    return dequantize_q4_0(row[None])[0] if row.dtype == np.uint8 else row


def _heads(x, c, n):
    return x.reshape(c[n], c["head_dim"])


def _k_row(i, w, c):
    x = _heads(i["x"], c, "n_kv_heads")
    if c["from"] == "knorm":
        x = rope(x, *rope_tables(c, w["inv_freq"]))
    return kv_row(x, c["kv"])[c["out"] == "ks"]


def _v_row(i, w, c):
    return kv_row(_heads(gemv(w["v_proj"], i["x"], w.get("v_bias")), c, "n_kv_heads"), c["kv"])[c["out"] == "vs"]


def _q_heads(i, w, c):
    q = qknorm(_heads(gemv(w["q_proj"], i["x"], w.get("q_bias")), c, "n_heads"), w["q_norm"], c["eps"])
    return rope(q, *rope_tables(c, w["inv_freq"]))


def _attention(i, w, c):
    T, n_kv, hd = len(i["k"]), c["n_kv_heads"], c["head_dim"]
    rows = [i[n].reshape(T, n_kv, hd) for n in ("k", "v")]
    return attention(_heads(i["q"], c, "n_heads"), rows[0], i["ks"].reshape(T, n_kv), rows[1],
                     i["vs"].reshape(T, n_kv), c["scale"])


OPS = {
    "embed": _embed,
    "rmsnorm": lambda i, w, c: rmsnorm(i["x"], w["norm"], c["eps"]),
    "gemv": lambda i, w, c: gemv(w["w"], i["x"], w.get("bias")),
    "qknorm": lambda i, w, c: qknorm(_heads(i["x"], c, "n_kv_heads"), w["norm"], c["eps"]),
    "rope": lambda i, w, c: rope(_heads(i["x"], c, "n_kv_heads"), *rope_tables(c, w["inv_freq"])),
    "k_row": _k_row,
    "v_row": _v_row,
    "q_heads": _q_heads,
    "attention": _attention,
    "o_residual": lambda i, w, c: i["x"] + gemv(w["o_proj"], i["attn"], w.get("o_bias")),
    "route": lambda i, w, c: route(i["router"], c["top_k"], c["norm_topk_prob"])[c["out"] == "topw"],
    "experts": lambda i, w, c: experts(w, i["h"], i.get("topk"), i.get("topw")),
    "add": lambda i, w, c: i["a"] + i["b"],
    "ffn_residual": lambda i, w, c: i["ores"] + ffn(w, c, i["ores"]),
    "logits": lambda i, w, c: gemv(w["lm_head"], rmsnorm(i["x"], w["norm"], c["eps"])),
}


# What each kind reads, stated once: its constants (name -> type, below) and its arrays as
# (inputs, weights) name -> pattern. A pattern is a dtype class, then the dimensions: an integer, a
# symbol (bound where it first appears, checked everywhere after; n_heads, n_kv_heads and head_dim
# bind NH, NK and HD), SYM/32 (a q4_0 row of SYM values in blocks of 32) or A*B. "mat O I" is a matrix
# either way it ships: q4_0 blocks uint8 [O, I/32, 18] or float32 [O, I]; "mats" a stack of them.
# A weight must have its pattern's shape; an input its number of elements (an engine may hold a buffer
# flat or in heads: it is reshaped to the pattern). A name ending in ? may be absent. A kind of two
# variants (a MoE layer, a dense MLP) takes one of them whole.
HEADS = {"n_heads": "dim", "n_kv_heads": "dim", "head_dim": "even"}
ROPE = {"position": "position", "rope_factor": "real?"}
KV = ("q8", "f32")
EXPERTS = {"gate_proj": "mats NE F H", "up_proj": "mats NE F H", "down_proj": "mats NE H F", "expert_ids": "int NE"}
MLP = {"gate_proj": "mat F H", "up_proj": "mat F H", "down_proj": "mat H F"}
KINDS = {
    "embed": ({}, [({"token": "int 1"}, {"row_ids": "int R", "rows": "mat R H"})]),
    "rmsnorm": ({"eps": "real"}, [({"x": "f4 H"}, {"norm": "f4 H"})]),
    "gemv": ({}, [({"x": "f4 I"}, {"w": "mat O I", "bias?": "f4 O"})]),
    "qknorm": ({"eps": "real", **HEADS}, [({"x": "f4 NK HD"}, {"norm": "f4 HD"})]),
    "rope": ({**HEADS, **ROPE}, [({"x": "f4 NK HD"}, {"inv_freq": "f4 HD/2"})]),
    "k_row": ({**HEADS, **ROPE, "kv": KV, "from": ("kpre", "knorm"), "out": ("k", "ks")},
              [({"x": "f4 NK HD"}, {"inv_freq": "f4 HD/2"})]),
    "v_row": ({**HEADS, "kv": KV, "out": ("v", "vs")},
              [({"x": "f4 H"}, {"v_proj": "mat NK*HD H", "v_bias?": "f4 NK*HD"})]),
    "q_heads": ({"eps": "real", **HEADS, **ROPE},
                [({"x": "f4 H"}, {"q_proj": "mat NH*HD H", "q_bias?": "f4 NH*HD", "q_norm": "f4 HD",
                                  "inv_freq": "f4 HD/2"})]),
    "attention": ({**HEADS, "scale": "real"}, [({"q": "f4 NH HD", "k": "kv T NK HD", "ks": "f4 T NK",
                                                 "v": "kv T NK HD", "vs": "f4 T NK"}, {})]),
    "o_residual": ({}, [({"x": "f4 H", "attn": "f4 A"}, {"o_proj": "mat H A", "o_bias?": "f4 H"})]),
    "route": ({"top_k": "dim", "norm_topk_prob": "flag", "out": ("topk", "topw")}, [({"router": "f4 E"}, {})]),
    "experts": ({"top_k?": "top_k"}, [({"h": "f4 H", "topk": "int K", "topw": "f4 K"}, EXPERTS),
                                    ({"h": "f4 H"}, MLP)]),
    "add": ({}, [({"a": "f4 N", "b": "f4 N"}, {})]),
    "ffn_residual": ({"eps": "real", "top_k": "top_k", "norm_topk_prob": "flag"},
                     [({"ores": "f4 H"}, {"post_attention_layernorm": "f4 H", "gate": "mat E H", **EXPERTS}),
                      ({"ores": "f4 H"}, {"post_attention_layernorm": "f4 H", **MLP})]),
    "logits": ({"eps": "real"}, [({"x": "f4 H"}, {"norm": "f4 H", "lm_head": "mat V H"})]),
}
SYMBOLS = {"n_heads": "NH", "n_kv_heads": "NK", "head_dim": "HD"}
CLASSES = {"f4": ("<f4",), "int": ("<i4", "<i8"), "kv": ("|i1", "<f4")}


# ---------------------------------------------------------------- judging: kestrel-tui's metrics

NAN_ULP = (1 << 64) - 1


def _ordered(x: np.ndarray) -> np.ndarray:
    """Values as uint64 whose integer order is numeric order (adjacent floats differ by 1, +0 = -0)."""
    bias = np.uint64(1 << 63)
    if x.dtype.kind == "u":
        return x.astype(np.uint64)
    if x.dtype.kind == "i":
        return x.astype(np.int64).view(np.uint64) ^ bias
    w = x.dtype.itemsize
    s = x.view(f"i{w}").astype(np.int64)
    with np.errstate(over="ignore"):
        o = np.where(s < 0, np.int64(-(1 << (8 * w - 1))) - s, s)
    return o.view(np.uint64) ^ bias


def metrics(ref: np.ndarray, sub: np.ndarray) -> dict:
    """NMSE sum((ref-sub)^2) / sum(ref^2) (llama.cpp test-backend-ops' metric, in f64, over finite pairs),
    the max relative error, the max ULP distance; any differing non-finite pair makes all of them inf."""
    a, b = np.asarray(ref).ravel(), np.asarray(sub).ravel()
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"nmse": math.inf, "max_rel_err": math.inf, "max_ulp": NAN_ULP, "nonfinite": 1, "n_diff": a.size}
    u = f"u{a.dtype.itemsize}"
    diff = a.view(u) != b.view(u)
    oa, ob = _ordered(a), _ordered(b)
    dist = np.where(oa >= ob, oa - ob, ob - oa)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if a.dtype.kind == "f":
        dist[(np.isnan(a) | np.isnan(b)) & diff] = NAN_ULP
    out = {"max_ulp": int(dist.max(initial=0)), "n_diff": int(diff.sum()), "nonfinite": 0}
    finite = np.isfinite(a64) & np.isfinite(b64)
    nonfinite = int((diff & ~finite).sum())
    if nonfinite:
        return {**out, "nmse": math.inf, "max_rel_err": math.inf, "nonfinite": nonfinite}
    a64, b64 = a64[finite], b64[finite]
    d = np.abs(a64 - b64)
    biggest = float(np.max(np.maximum(np.abs(a64), np.abs(b64)), initial=0.0))
    if biggest == 0.0:
        return {**out, "nmse": 0.0, "max_rel_err": 0.0}
    scale = float(np.ldexp(1.0, np.frexp(biggest)[1]))
    num, den = float(np.sum(np.square(d / scale))), float(np.sum(np.square(a64 / scale)))
    nmse = (0.0 if num == 0.0 else math.inf) if den == 0.0 else num / den
    absa = np.abs(a64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(d == 0.0, 0.0, np.where(absa == 0.0, np.inf, d / np.where(absa == 0.0, 1.0, absa)))
    return {**out, "nmse": nmse, "max_rel_err": float(rel.max(initial=0.0))}


CRITERIA = (("nmse", "nmse"), ("ulp", "max_ulp"), ("rel", "max_rel_err"))


def judge(m: dict, criteria: dict) -> tuple[str, str]:
    """("ok" | "close" | "far", why): ok when the bits are equal, close when every criterion holds."""
    if m["n_diff"] == 0:
        return "ok", "bits equal"
    parts, holds = [], m["nonfinite"] == 0
    for name, metric in CRITERIA:
        if criteria.get(name) is None:
            continue
        ok = m[metric] <= criteria[name] and m["nonfinite"] == 0
        holds = holds and ok
        parts.append(f"{name} {_num(m[metric])} {'<=' if ok else '>'} {_num(criteria[name])}")
    if m["nonfinite"]:
        parts.append(f"{m['nonfinite']} non-finite mismatches")
    return ("close" if holds else "far"), ", ".join(parts) or "no criteria"


def _num(v) -> str:
    return str(v) if isinstance(v, int) else f"{v:.3g}"


# ---------------------------------------------------------------- reading the bundle: nothing in it is trusted
#
# The folder came by mail or an issue tracker: case.json is checked against the schema below, every
# array's .npy header against the dtype and shape case.json declares (and those against the op) before
# any data is read, files are opened only when they are regular files inside the folder (no symbolic
# link, no FIFO or device, no absolute path or ".."), sizes are bounded, and the text it prints is
# made inert. A bundle that fails any of it is one line on stderr and exit 2.

FORMAT = 2                   # case.json's "bundle": the layout this replay.py reads
MAX_CASE_BYTES = 8 << 20     # case.json: a few KB; a 40960-token prompt, both sides' tokens, ~1 MB
MAX_BUNDLE_BYTES = 4 << 30   # all arrays together; raise it here to replay a bigger genuine bundle
MAX_HEADER = 10000           # a .npy header's bytes (numpy's own bound)
DTYPES = ("<f4", "<f2", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8")
FIX = "the bundle is damaged or was edited: get it again from whoever sent it"
RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"{p}{i}" for p in ("COM", "LPT") for i in range(1, 10))}  # Windows devices
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class Damaged(Exception):
    """The bundle cannot be replayed: what is wrong (and the fix), and where (a file of the bundle)."""

    def __init__(self, message: str, where: str | None = None):
        super().__init__(message)
        self.where = where


class Unreproduced(Damaged):
    """The replay does not give the contract reference's bits: the report so far goes out with it."""

    def __init__(self, message: str, lines: list[str]):
        super().__init__(message)
        self.lines = lines


def inert(text: object, limit: int = 300) -> str:
    """``text`` with every control character escaped (\\x1b, \\n, \\u202e), clipped to ``limit`` characters:
    text from the bundle reaches a terminal that would obey it (kestrel_tui.text.inert's rule)."""
    s = text if isinstance(text, str) else str(text)
    more = len(s) - limit
    s = s[:limit] if more > 0 else s
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = "".join(
        (named.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}" if ord(ch) < 0x10000
                           else f"\\U{ord(ch):08x}"))
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn") else ch for ch in s)
    return out + (f"… ({more} more characters)" if more > 0 else "")


def _what(v) -> str:
    """A value of case.json in a few words, safe to print whatever it holds."""
    if isinstance(v, str):
        return f'"{inert(v, 80)}"'
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, int):
        return str(v) if abs(v) < 10**30 else "an integer of more than 30 digits"
    if isinstance(v, float):
        return json.dumps(v)  # Infinity and NaN as JSON writes them
    return {list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


# ---- case.json's schema

def _number(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


def _integer(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _path(v) -> bool:
    """A .npy file of the bundle named relative to it: names of letters, digits and _.- (none leading
    with a dot, so no . or ..), at most 4 deep."""
    if not isinstance(v, str) or len(v) > 255 or not v.endswith(".npy"):
        return False
    parts = v.split("/")
    return len(parts) <= 4 and all(p and p[0] != "." and set(p) <= NAME_CHARS and p.split(".")[0].upper()
                                   not in RESERVED for p in parts)


TYPES = {  # type -> (check, what it must be)
    "text": (lambda v: isinstance(v, str), "a string"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "real": (lambda v: _number(v) and abs(v) < 2.0**128, "a finite number"),
    "real?": (lambda v: v is None or _number(v) and abs(v) < 2.0**128, "null or a finite number"),
    "measure?": (lambda v: v is None or _number(v) and 0 <= v < 2.0**128, "null or a finite number >= 0"),
    "count?": (lambda v: v is None or _integer(v, 0, 2**64 - 1), "null or an integer from 0 to 2^64-1"),
    "dim": (lambda v: _integer(v, 1, 1 << 24), "an integer from 1 to 16777216"),
    "top_k": (lambda v: _integer(v, 0, 1 << 24), "an integer from 0 (a dense MLP) to 16777216"),
    "even": (lambda v: _integer(v, 2, 1 << 24) and v % 2 == 0, "an even integer from 2 to 16777216"),
    "position": (lambda v: _integer(v, 0, 2**31 - 1), "an integer from 0 to 2147483647"),
    "path": (_path, "the path of a .npy file inside the bundle (relative, such as weights/norm.npy; no ..)"),
}
CASE = {  # what replay.py reads of case.json (the rest of it describes the case to people)
    "key": "text", "op": "object", "op.kind": tuple(OPS), "op.name": "text", "op.rules": "text",
    "tolerance": "object", "tolerance.spec": "text", "tolerance.criteria": "object",
    "tolerance.criteria.nmse": "measure?", "tolerance.criteria.ulp": "count?", "tolerance.criteria.rel": "measure?",
    "reference_is_contract": "flag", "inputs_note": "text", "const": "object", "inputs": "object",
    "inputs.reference": "object", "inputs.subject": "object", "weights": "object", "outputs": "object",
    "outputs.reference": "path", "outputs.subject": "path", "arrays": "object",
}


def _check(v, want, field: str):
    """v if it is of type ``want`` (a TYPES name or a tuple of allowed strings), else Damaged."""
    if isinstance(want, tuple):
        if isinstance(v, str) and v in want:
            return v
        raise Damaged(f"{field} is {_what(v)}; it must be one of {', '.join(want)}; {FIX}", "case.json")
    ok, must = TYPES[want]
    if not ok(v):
        raise Damaged(f"{field} is {_what(v)}; it must be {must}; {FIX}", "case.json")
    return v


def _get(case: dict, field: str):
    v = case
    for name in field.split("."):
        if name not in v:
            raise Damaged(f"{field} is missing; {FIX}", "case.json")
        v = v[name]
    return v


def check_case(case) -> tuple[tuple[dict, dict], dict]:
    """case.json against the schema: the kind's variant (inputs, weights) and the array table."""
    if not isinstance(case, dict):
        raise Damaged(f"holds {_what(case)}, not an object; {FIX}", "case.json")
    fmt = case.get("bundle")
    if fmt != FORMAT or not _integer(fmt, 0, 2**31):
        if _integer(fmt, 0, FORMAT - 1):
            raise Damaged(f"bundle format {fmt}: this replay.py reads format {FORMAT} (with the arrays' shapes"
                          " declared); run the replay.py that came with the bundle", "case.json")
        have = f"is {_what(fmt)}" if "bundle" in case else "is missing"
        raise Damaged(f"bundle (the format) {have}; this replay.py reads format {FORMAT}; {FIX}", "case.json")
    for field, want in CASE.items():
        _check(_get(case, field), want, field)
    for field in ("inputs", "outputs"):
        for extra in sorted(set(case[field]) - {"reference", "subject"}):
            raise Damaged(f"{field} has {_what(extra)}; it holds reference and subject only; {FIX}", "case.json")
    kind = case["op"]["kind"]
    consts, variants = KINDS[kind]
    c = case["const"]
    for name, want in consts.items():
        name, optional = name.rstrip("?"), name.endswith("?")
        if name in c or not optional:
            _check(_get(case, f"const.{name}"), want, f"const.{name}")
    if "n_kv_heads" in consts and c["n_heads"] % c["n_kv_heads"]:
        raise Damaged(f"const.n_heads {c['n_heads']} is not a multiple of const.n_kv_heads {c['n_kv_heads']};"
                      f" {FIX}", "case.json")
    variant = _variant(case, kind, variants)
    arrays = case["arrays"]
    used = {p for side in ("reference", "subject") for p in case["inputs"][side].values()}
    used |= set(case["weights"].values()) | set(case["outputs"].values())
    for path in sorted(set(arrays) - used):
        raise Damaged(f"arrays declares {_what(path)}, which no input, weight or output uses; {FIX}", "case.json")
    for path in sorted(used):
        decl = arrays.get(path)
        field = f"arrays[{_what(path)}]"
        if not isinstance(decl, dict):
            raise Damaged(f"{field} is {'missing' if decl is None else _what(decl)}: every array's dtype and"
                          f" shape are declared; {FIX}", "case.json")
        _check(decl.get("dtype"), DTYPES, f"{field}.dtype")
        shape = decl.get("shape")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(_integer(d, 0, 2**40) for d in shape)):
            raise Damaged(f"{field}.shape is {_what(shape)}; it must be a list of at most 8 integers from 0 to"
                          f" 2^40; {FIX}", "case.json")
    return variant, arrays


def _names(spec: dict) -> str:
    need = [n for n in spec if not n.endswith("?")]
    maybe = [n.rstrip("?") for n in spec if n.endswith("?")]
    return (", ".join(need) or "none") + (f" (and {', '.join(maybe)} if it has one)" if maybe else "")


def _fits(names: dict, spec: dict) -> bool:
    need = {n for n in spec if not n.endswith("?")}
    return need <= set(names) <= {n.rstrip("?") for n in spec}


def _variant(case: dict, kind: str, variants: list) -> tuple[dict, dict]:
    """The variant of the kind whose inputs and weights case.json names, every name a path."""
    ins, weights = case["inputs"], case["weights"]
    for field, names in (("inputs.reference", ins["reference"]), ("inputs.subject", ins["subject"]),
                         ("weights", weights)):
        for name, path in names.items():
            _check(path, "path", f"{field}.{inert(name, 40)}")
    for inputs, wspec in variants:
        if _fits(ins["reference"], inputs) and _fits(ins["subject"], inputs) and _fits(weights, wspec):
            return inputs, wspec
    want = " or ".join(f"inputs {_names(i)} with weights {_names(w)}" for i, w in variants)
    have = (f"inputs {inert(', '.join(ins['reference']), 120)} / {inert(', '.join(ins['subject']), 120)} with weights"
            f" {inert(', '.join(weights), 120) or 'none'}")
    raise Damaged(f"the {kind} op reads {want}; case.json names {have}; {FIX}", "case.json")


# ---- the arrays' shapes against the op

def _alternatives(pattern: str) -> list[tuple[str, list[str]]]:
    cls, *dims = pattern.split()
    if cls in ("mat", "mats"):
        return [("|u1", dims[:-1] + [dims[-1] + "/32", "18"]), ("<f4", dims)]
    return [(dtype, dims) for dtype in CLASSES[cls]]


def _value(expr: str, env: dict) -> int | None:
    """A dimension's value, None while a symbol in it is unbound (or SYM/d does not divide)."""
    if expr.isdigit():
        return int(expr)
    if "*" in expr:
        vals = [env.get(s) for s in expr.split("*")]
        return None if None in vals else math.prod(vals)
    sym, _, d = expr.partition("/")
    if sym not in env or env[sym] % int(d or 1):
        return None
    return env[sym] // int(d or 1)


def _bind(expr: str, v: int, env: dict) -> bool:
    want = _value(expr, env)
    if want is not None:
        return v == want
    sym, _, d = expr.partition("/")
    if sym in env or "*" in expr or v < 1:  # bound but not divisible, or a product of unbound symbols
        return False
    env[sym] = v * int(d or 1)
    return True


def _bind_size(dims: list[str], n: int, env: dict) -> bool:
    """An input of n elements: every dimension bound, or one left that n determines."""
    known = [_value(e, env) for e in dims]
    free = [e for e, v in zip(dims, known) if v is None]
    size = math.prod(v for v in known if v is not None)
    if not free:
        return n == size
    if len(free) > 1 or n % size or n // size < 1 or not free[0].isidentifier():
        return False
    env[free[0]] = n // size
    return True


def fit(path: str, label: str, kind: str, decl: dict, pattern: str, env: dict, src: dict, exact: bool) -> tuple:
    """The shape the op takes the array in, its symbols bound in env (and where from in src); Damaged
    when it does not fit."""
    dtype, shape = decl["dtype"], decl["shape"]
    alts = _alternatives(pattern)
    dims = next((d for t, d in alts if t == dtype), None)
    if dims is None:
        raise Damaged(f"{label} is {dtype}; the {kind} op needs {' or '.join(t for t, _ in alts)}; {FIX}", path)
    trial = dict(env)
    ok = (len(shape) == len(dims) and all(_bind(e, v, trial) for e, v in zip(dims, shape)) if exact
          else _bind_size(dims, math.prod(shape), trial))
    if not ok:
        need = "[" + ", ".join(str(_value(e, env) or e) for e in dims) + "]"
        syms = sorted({sym for e in dims for sym in e.replace("/", "*").split("*") if sym in env})
        why = [] if exact else ["that many elements"]
        why += [f"{sym} = {env[sym]} from {src[sym]}" for sym in syms]
        raise Damaged(f"{label} is {dtype} {shape}; the {kind} op needs {dtype} {need}"
                      + (f" ({'; '.join(why)})" if why else "") + f"; {FIX}", path)
    src.update({sym: path for sym in trial if sym not in env})
    env.update(trial)
    return tuple(_value(e, env) for e in dims)


def plan(case: dict, variant: tuple[dict, dict], arrays: dict) -> dict:
    """The shape the op takes each input and weight in ({"reference": {name: shape}, "subject": ...,
    "weights": ...}), every declared shape checked against the op's patterns (before any file is
    opened)."""
    kind, c = case["op"]["kind"], case["const"]
    env = {sym: c[name] for name, sym in SYMBOLS.items() if name in c}
    src = {sym: f"case.json const.{name}" for name, sym in SYMBOLS.items() if name in c}
    inputs, wspec = variant
    shapes: dict = {"reference": {}, "subject": {}, "weights": {}}
    for side in ("reference", "subject"):
        for name, path in case["inputs"][side].items():
            pattern = inputs.get(name) or inputs[name + "?"]
            shapes[side][name] = fit(path, f"inputs {name}", kind, arrays[path], pattern, env, src, exact=False)
    for name, path in case["weights"].items():
        pattern = wspec.get(name) or wspec[name + "?"]
        shapes["weights"][name] = fit(path, f"weights {name}", kind, arrays[path], pattern, env, src, exact=True)
    return shapes


# ---- files: regular, inside the folder, bounded

KINDS_OF_FILE = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                 (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
O_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
DIR_FD = (os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd
          and os.stat in os.supports_follow_symlinks and hasattr(os, "O_DIRECTORY"))


def _not_regular(st, want_dir: bool) -> str | None:
    """What a file is when it is not what the bundle needs (a regular file, or a folder on the way)."""
    if getattr(st, "st_reparse_tag", 0):  # a Windows junction or symbolic link
        return "a link"
    if (stat.S_ISDIR if want_dir else stat.S_ISREG)(st.st_mode):
        return None
    return next((word for test, word in KINDS_OF_FILE if test(st.st_mode)), "not a regular file")


class Folder:
    """The bundle's folder: files opened by relative path, never through a link, only regular ones."""

    def __init__(self, root: str):
        self.root = root
        self.fd = None
        try:
            st = os.stat(root)
            if not stat.S_ISDIR(st.st_mode):
                raise Damaged("is not a folder; name the bundle's folder (the one holding case.json)")
            if DIR_FD:
                self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise Damaged(f"cannot be read ({e.strerror}); name the bundle's folder (the one holding case.json)")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def open(self, rel: str, limit: int, what: str):
        """(binary file, size) of the regular file rel, at most limit bytes; Damaged otherwise."""
        parts = rel.split("/")
        try:
            if self.fd is not None:
                st, fd = self._open_at(parts)
            else:
                st, fd = self._open_walk(parts)
        except OSError as e:
            word = "missing" if isinstance(e, FileNotFoundError) else f"unreadable ({e.strerror})"
            raise Damaged(f"is {word}; {FIX}", rel) from None
        f = os.fdopen(fd, "rb")
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            f.close()
            raise Damaged(f"changed while it was opened; {FIX}", rel)
        if now.st_size > limit:
            f.close()
            raise Damaged(f"is {now.st_size / 2**20:.1f} MB, over the {limit / 2**20:.0f} MB {what}; {FIX}", rel)
        return f, now.st_size

    def _open_at(self, parts: list[str]):
        """Walk from the folder's descriptor, never following a link (O_NOFOLLOW at every step)."""
        dfd = os.dup(self.fd)
        try:
            for i, name in enumerate(parts):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                last = i == len(parts) - 1
                bad = _not_regular(st, want_dir=not last)
                if bad:
                    raise Damaged(f"is {bad}; replay.py reads only regular files inside the bundle; {FIX}",
                                  "/".join(parts[:i + 1]))
                flags = O_FLAGS if last else os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0)
                fd = os.open(name, flags, dir_fd=dfd)
                if last:
                    return st, fd
                os.close(dfd)
                dfd = fd
        finally:
            os.close(dfd)

    def _open_walk(self, parts: list[str]):
        """Where there are no directory descriptors (Windows): lstat every step, then open."""
        path = self.root
        for i, name in enumerate(parts):
            path = os.path.join(path, name)
            st = os.lstat(path)
            bad = _not_regular(st, want_dir=i < len(parts) - 1)
            if bad:
                raise Damaged(f"is {bad}; replay.py reads only regular files inside the bundle; {FIX}",
                              "/".join(parts[:i + 1]))
        return st, os.open(path, O_FLAGS)


def _read_exactly(f, n: int, rel: str) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise Damaged(f"is truncated: {got} of {n} bytes of data; {FIX}", rel)
        got += k
    return buf


def read_case(folder: Folder) -> dict:
    f, size = folder.open("case.json", MAX_CASE_BYTES, "that replay.py reads of a case.json")
    with f:
        raw = _read_exactly(f, size, "case.json")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise Damaged(f"is not UTF-8 text (byte {e.start}); {FIX}", "case.json") from None
    except RecursionError:
        raise Damaged(f"nests too deep to be a case; {FIX}", "case.json") from None
    except ValueError as e:  # JSONDecodeError, or an integer of thousands of digits
        raise Damaged(f"is not JSON ({inert(str(e), 120)}); {FIX}", "case.json") from None


def open_array(folder: Folder, rel: str, decl: dict):
    """The file of one array, its .npy header checked against case.json's declaration, positioned at its
    data; nothing of the data read."""
    f, size = folder.open(rel, MAX_BUNDLE_BYTES + (1 << 20), "bound on a bundle's arrays (MAX_BUNDLE_BYTES)")
    try:
        if size == 0:
            raise Damaged(f"is empty; {FIX}", rel)
        head = f.read(12)
        if len(head) < 10 or head[:6] != b"\x93NUMPY":
            raise Damaged(f"is not a .npy file (it starts {inert(head[:8].decode('latin1'), 40)}); {FIX}", rel)
        version = (head[6], head[7])
        if version not in ((1, 0), (2, 0)):
            raise Damaged(f"has .npy format version {version[0]}.{version[1]}; repro writes 1.0; {FIX}", rel)
        field = head[8:10] if version == (1, 0) else head[8:12].ljust(4, b"\0")
        hlen = struct.unpack("<H" if version == (1, 0) else "<I", field)[0]
        if hlen > MAX_HEADER:
            raise Damaged(f"has a .npy header of {hlen} bytes (a genuine one has about 100); {FIX}", rel)
        f.seek(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # numpy warns (on stderr) of a Python 2 header: refused instead
                np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(f)
        except Exception as e:  # noqa: BLE001 - numpy's parser on outside bytes (ast, tokenize, dtype): any error
            raise Damaged(f"has a damaged .npy header ({type(e).__name__}: {inert(str(e), 120)}); {FIX}", rel) from None
        if fortran:
            raise Damaged(f"is stored in Fortran order; repro writes C order; {FIX}", rel)
        if dtype.str != decl["dtype"] or list(shape) != decl["shape"]:
            raise Damaged(f"its header says {inert(dtype.str, 40)} {list(shape)}; case.json declares {decl['dtype']}"
                          f" {decl['shape']}; {FIX}", rel)
        nbytes = math.prod(shape) * dtype.itemsize
        extra = size - f.tell() - nbytes
        if extra < 0:
            raise Damaged(f"is truncated: {size - f.tell()} bytes of data where its header declares {nbytes}; {FIX}",
                          rel)
        if extra > 0:
            raise Damaged(f"has {extra} bytes more than its header declares; {FIX}", rel)
        return f
    except BaseException:
        f.close()
        raise


def read_arrays(folder: Folder, arrays: dict) -> dict:
    """path -> array of every file ``arrays`` (case.json's, checked) declares, each file's header and
    size checked before any data is read."""
    total = sum(math.prod(a["shape"]) * np.dtype(a["dtype"]).itemsize for a in arrays.values())
    if total > MAX_BUNDLE_BYTES:
        raise Damaged(f"the arrays declare {total / 2**20:.0f} MB together, over replay.py's bound of"
                      f" {MAX_BUNDLE_BYTES / 2**20:.0f} MB (MAX_BUNDLE_BYTES: raise it there for a genuine bundle"
                      " that big)", "case.json")
    files = {}
    try:
        for p in sorted(arrays):
            files[p] = open_array(folder, p, arrays[p])
        out = {}
        for p, f in files.items():
            dtype, shape = np.dtype(arrays[p]["dtype"]), arrays[p]["shape"]
            data = _read_exactly(f, math.prod(shape) * dtype.itemsize, p)
            out[p] = np.frombuffer(data, dtype).reshape(shape)
        return out
    finally:
        for f in files.values():
            f.close()


# ---------------------------------------------------------------- the replay

def replay(folder) -> tuple[list[str], int]:
    """The report's lines and the exit status (0 ok or close, 1 far); Damaged when the bundle cannot be
    replayed."""
    root = Folder(os.path.abspath(folder))
    try:
        case = read_case(root)
        variant, declared = check_case(case)
        shapes = plan(case, variant, declared)
        arrays = read_arrays(root, declared)
    finally:
        root.close()
    op, c = case["op"], case["const"]
    fn = OPS[op["kind"]]
    weights = {k: arrays[p].reshape(shapes["weights"][k]) for k, p in case["weights"].items()}
    ins = {side: {k: arrays[p].reshape(shapes[side][k]) for k, p in case["inputs"][side].items()}
           for side in ("reference", "subject")}
    outs = {side: arrays[case["outputs"][side]] for side in ("reference", "subject")}
    criteria = case["tolerance"]["criteria"]
    lines = [f"{inert(case['key'])}: {inert(op['name'])} (contract {inert(op['rules'])});"
             f" tolerance {inert(case['tolerance']['spec'])}"]

    def compare(name: str, a: np.ndarray, b: np.ndarray, what: str) -> str:
        """a is the reference side (NMSE's denominator)."""
        m = metrics(a, b)
        verdict, why = judge(m, criteria)
        lines.append(f"{name:<9} {what}: {verdict} ({m['n_diff']} of {a.size} differ; {why})")
        return verdict

    ref_on_ref = np.asarray(fn(ins["reference"], weights, c))
    compare("reference", outs["reference"], ref_on_ref, "ref-op(reference's inputs) vs reference's output")
    same = ref_on_ref.dtype == outs["reference"].dtype and ref_on_ref.tobytes() == outs["reference"].tobytes()
    if case["reference_is_contract"] and not same:
        raise Unreproduced("this replay does not reproduce the reference's bits, so the bundle cannot judge the"
                           " subject; report this to kestrel-tui with the bundle", lines)
    if case["inputs_note"]:
        lines.append(f"note: {inert(case['inputs_note'])}")
    ref_on_sub = np.asarray(fn(ins["subject"], weights, c))
    verdict = compare("op", ref_on_sub, outs["subject"], "ref-op(subject's inputs) vs subject's output")
    run = compare("run", outs["reference"], outs["subject"], "reference's output vs subject's output")
    if verdict == "far":
        tail = "the subject's op computes otherwise on its own inputs"
    elif run == "far":
        tail = "the op agrees on the subject's inputs: only its inputs drifted (look earlier in the step)"
    else:
        tail = "the subject's op agrees with the reference's"
    lines.append(f"verdict: {verdict} - {tail}")
    return lines, 1 if verdict == "far" else 0


USAGE = "usage: python replay.py [FOLDER]   (FOLDER: the bundle, by default the one replay.py is in)"


def main(argv: list[str] | None = None) -> int:
    """Replay the bundle in argv's folder (default: replay.py's own): print the report, return the exit
    status; a bundle that cannot be replayed is one line on stderr and 2."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(args) > 1 or args[:1] and args[0].startswith("-"):
        print(f"replay.py: {inert(' '.join(args), 120)}: give at most one bundle folder; {USAGE}", file=sys.stderr)
        return 2
    root = os.path.abspath(args[0] if args else os.path.dirname(os.path.abspath(__file__)))
    try:
        with np.errstate(all="ignore"):  # the numbers are the report; numpy's warnings would be stray lines
            lines, status = replay(root)
    except Damaged as e:
        if isinstance(e, Unreproduced):
            print("\n".join(e.lines))
        where = root if e.where is None else os.path.join(root, e.where)
        print(f"replay.py: {inert(where)}: {e}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"replay.py: {inert(root)}: out of memory while replaying; run it where more memory is free",
              file=sys.stderr)
        return 2
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    for stream in (sys.stdout, sys.stderr):  # a console that cannot show a character gets its escape
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        sys.exit(main())
    except Exception as e:  # noqa: BLE001 - a bug of this file, not a verdict: never exit 1 ("far") for it
        print(f"replay.py: internal error ({type(e).__name__}: {inert(e, 200)}); report it to kestrel-tui with the"
              " bundle", file=sys.stderr)
        sys.exit(2)
