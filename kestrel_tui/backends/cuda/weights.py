"""The model's weights resident on the device, in the GEMV kernels' layout.

q4_0 matrices (host: block-major `qs` int8 [..., nb, out, 32] in -8..7 and
`d` f32 [..., nb, out]) become row-major blocks: nibbles [..., out, nb, 16]
packed like ggml (byte j = (q[j]+8) | (q[j+16]+8) << 4) and f16 scales
[..., out, nb] — a warp reads one row's blocks contiguously. f32 matrices go up
as they are. Uploaded once per Model object and shared by every backend
instance made for it (the session makes a new backend for every run).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np

from ...model.weights import Linear, Model

F32 = np.float32


@dataclass
class DeviceLinear:
    out: int
    inp: int
    fmt: str  # "q4_0" | "f32"
    w: int = 0  # device pointers: q4_0 nibbles or f32 weights
    d: int = 0  # q4_0 f16 scales
    nb: int = 0
    experts: int = 0  # 0: one matrix


def pack_q4_0(qs: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block-major (qs [..., nb, out, 32], d [..., nb, out]) -> (nibbles [..., out, nb, 16] uint8,
    scales [..., out, nb] float16)."""
    q = np.swapaxes(qs, -3, -2).view(np.uint8) + np.uint8(8)  # [..., out, nb, 32], 0..15
    packed = q[..., :16] | (q[..., 16:] << np.uint8(4))
    return np.ascontiguousarray(packed), np.ascontiguousarray(np.swapaxes(d, -2, -1).astype(np.float16))


class DeviceModel:
    def __init__(self, rt, model: Model):
        self.rt = rt
        self._allocs: list = []  # keep the DeviceAllocations alive
        self.nbytes = 0
        cuda = rt.cuda
        done: dict[int, DeviceLinear] = {}

        def up(arr: np.ndarray) -> int:
            arr = np.ascontiguousarray(arr)
            alloc = cuda.mem_alloc(max(arr.nbytes, 1))
            cuda.memcpy_htod(alloc, arr)
            self._allocs.append(alloc)
            self.nbytes += arr.nbytes
            return int(alloc)

        def lin(L: Linear) -> DeviceLinear:
            if id(L) in done:  # tied embeddings: one upload
                return done[id(L)]
            if L.w is not None:
                experts = L.w.shape[0] if L.w.ndim == 3 else 0
                dl = DeviceLinear(L.out, L.inp, "f32", w=up(L.w.astype(F32)), experts=experts)
            else:
                experts = L.qs.shape[0] if L.qs.ndim == 4 else 0
                packed, scales = pack_q4_0(L.qs, L.d)
                dl = DeviceLinear(L.out, L.inp, "q4_0", w=up(packed), d=up(scales), nb=L.inp // 32,
                                  experts=experts)
            done[id(L)] = dl
            return dl

        self.fmt = model.fmt
        self.embed = lin(model.embed_tokens)
        self.lm_head = lin(model.lm_head)
        self.norm = up(model.norm.astype(F32))
        self.inv_freq = up(model.inv_freq.astype(F32))
        self.layers = []
        for L in model.layers:
            layer = dict(
                input_layernorm=up(L.input_layernorm.astype(F32)),
                post_attention_layernorm=up(L.post_attention_layernorm.astype(F32)),
                q_norm=up(L.q_norm.astype(F32)), k_norm=up(L.k_norm.astype(F32)),
                q_proj=lin(L.q_proj), k_proj=lin(L.k_proj), v_proj=lin(L.v_proj), o_proj=lin(L.o_proj),
                gate=lin(L.gate) if L.gate is not None else None,
                gate_proj=lin(L.gate_proj), up_proj=lin(L.up_proj), down_proj=lin(L.down_proj),
            )
            self.layers.append(layer)


_cache_lock = threading.Lock()
_cache: dict[int, tuple[weakref.ref, DeviceModel]] = {}


def device_model(rt, model: Model) -> DeviceModel:
    """The DeviceModel of `model`, uploaded on first use (call inside rt.active())."""
    with _cache_lock:
        hit = _cache.get(id(model))
        if hit is not None and hit[0]() is model:
            return hit[1]
        dm = DeviceModel(rt, model)
        key = id(model)

        def dropped(_ref, k=key):  # the Model is gone: free its weights with the context current
            hit = _cache.pop(k, None)
            if hit is not None:
                rt.bury(hit[1]._allocs)
                hit[1]._allocs = []
        _cache[key] = (weakref.ref(model, dropped), dm)
        return dm
