"""The model's weights resident on the device, in the GEMV kernels' layout.

q4_0 matrices (host: ggml's bytes `blocks` uint8 [..., out, nb, 18], model/weights.py)
go up split into their two parts: nibbles [..., out, nb, 16] (byte j =
(q[j]+8) | (q[j+16]+8) << 4, as ggml packs them) and f16 scales [..., out, nb] —
a warp reads one row's blocks contiguously. f32 matrices go up as they are.
Uploaded once per Model object and shared by every backend instance made for
it (the session makes a new backend for every run).
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


def device_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml q4_0 bytes [..., out, nb, 18] -> the kernels' arrays: (nibbles [..., out, nb, 16] uint8,
    scales [..., out, nb] float16), each contiguous — the host bytes split, not re-encoded."""
    nibbles = np.ascontiguousarray(blocks[..., 2:])
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    return nibbles, scales


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
                experts = L.blocks.shape[0] if L.blocks.ndim == 4 else 0
                packed, scales = device_q4_0(L.blocks)
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
    if isinstance(model, DeviceSyntheticModel):
        return model.device_model(rt)
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


# ------------------------------------------------------------ full-size synthetic model, made on the device


class DeviceSyntheticModel:
    """A synthetic q4_0 model whose weights exist only on the device: every matrix is filled
    in place by kernels/gemv.cu gen_q4 (a counter-based RNG: splitmix64 of seed and block
    index), so a 48-layer Qwen3-30B-A3B-sized model (~17 GB of q4_0) needs no host copy.

    Its values are NOT those of model/weights.synthetic_model (which draws Gaussian weights
    on the host and quantizes them): the nibbles are uniform and the f16 scales are set so a
    row has the same standard deviation as the host generator's (std = in^-0.5, o_proj
    0.5 * q_dim^-0.5, router and embedding 1.0). Norm weights (0.9 + 0.2 u) are made on the
    host — they are small. There is no cpu reference for it: it exists for speed figures
    (`kestrel-tui bench --subject cuda`), where only the shapes and the format matter.
    Stands in for model.weights.Model wherever CudaBackend reads one (cfg, fmt, name,
    attn_scale, inv_freq)."""

    UNIFORM_NIBBLE_STD = float(np.sqrt((16 ** 2 - 1) / 12))  # std of q - 8, q uniform in 0..15

    def __init__(self, cfg, seed: int = 0, name: str | None = None):
        from ...model.weights import rope_tables

        cfg.validate("q4_0")
        self.cfg, self.fmt, self.seed = cfg, "q4_0", seed
        self.name = name or f"device-synthetic {cfg.n_layers}L hidden {cfg.hidden}"
        self.inv_freq, self.attn_scale = rope_tables(cfg)
        self._dm: DeviceModel | None = None

    def device_model(self, rt) -> DeviceModel:
        if self._dm is None:
            self._dm = generate_device_model(rt, self)
        return self._dm

    def free(self) -> None:
        """Drop the device weights (freed the next time the runtime's context is current)."""
        if self._dm is not None:
            self._dm.rt.bury(self._dm._allocs)
            self._dm._allocs = []
            self._dm = None


def generate_device_model(rt, sm: DeviceSyntheticModel) -> DeviceModel:
    """Allocate every matrix of sm.cfg on the device and fill it with gen_q4 (inside rt.active())."""
    cuda, cfg = rt.cuda, sm.cfg
    dm = DeviceModel.__new__(DeviceModel)
    dm.rt, dm._allocs, dm.nbytes, dm.fmt = rt, [], 0, "q4_0"
    gen = rt.kernel("gemv", "gen_q4")
    rng = np.random.default_rng(sm.seed)
    counter = [0]

    def alloc(n: int) -> int:
        a = cuda.mem_alloc(max(n, 1))
        dm._allocs.append(a)
        dm.nbytes += n
        return int(a)

    def lin(out: int, inp: int, std: float, experts: int = 0) -> DeviceLinear:
        nb = inp // 32
        n = max(experts, 1) * out * nb  # q4_0 blocks
        w, d = alloc(n * 16), alloc(n * 2)
        counter[0] += 1
        seed = (sm.seed * 1_000_003 + counter[0]) & 0x7FFFFFFF
        dscale = float(std / DeviceSyntheticModel.UNIFORM_NIBBLE_STD / 1.0)  # d ~ dscale * U(0.5, 1.5)
        gen.prepared_call((min(65535, -(-n // 256)), 1, 1), (256, 1, 1), w, d, n, seed, dscale)
        return DeviceLinear(out, inp, "q4_0", w=w, d=d, nb=nb, experts=experts)

    def up(arr: np.ndarray) -> int:
        arr = np.ascontiguousarray(arr, dtype=F32)
        a = alloc(arr.nbytes)
        cuda.memcpy_htod(a, arr)
        return a

    def norm(n: int) -> int:
        return up(np.float32(0.9) + np.float32(0.2) * rng.random(n, dtype=np.float32))

    h, hd = cfg.hidden, cfg.head_dim
    dm.embed = lin(cfg.vocab, h, 1.0)
    dm.lm_head = dm.embed if cfg.tie_embeddings else lin(cfg.vocab, h, h ** -0.5)
    dm.norm = norm(h)
    dm.inv_freq = up(sm.inv_freq)
    dm.layers = []
    for li in range(cfg.n_layers):
        if cfg.layer_is_moe(li):  # a qwen3_moe model may have dense layers
            e, f = cfg.n_experts, cfg.moe_intermediate
            gate = lin(e, h, 1.0)
            ffn = (lin(f, h, h ** -0.5, e), lin(f, h, h ** -0.5, e), lin(h, f, f ** -0.5, e))
        else:
            f = cfg.intermediate
            gate = None
            ffn = (lin(f, h, h ** -0.5), lin(f, h, h ** -0.5), lin(h, f, f ** -0.5))
        dm.layers.append(dict(
            input_layernorm=norm(h), post_attention_layernorm=norm(h), q_norm=norm(hd), k_norm=norm(hd),
            q_proj=lin(cfg.q_dim, h, h ** -0.5), k_proj=lin(cfg.kv_dim, h, h ** -0.5),
            v_proj=lin(cfg.kv_dim, h, h ** -0.5), o_proj=lin(h, cfg.q_dim, 0.5 * cfg.q_dim ** -0.5),
            gate=gate, gate_proj=ffn[0], up_proj=ffn[1], down_proj=ffn[2]))
    cuda.Context.synchronize()
    return dm
