"""q4_0 weights resident as ggml's bytes, and the chunked GEMV over them.

The chunked GEMV (numerics/linalg.py) must equal, bit for bit, the straightforward
unchunked computation of the contract on the block-major layout it replaced — for
shapes that cross chunk boundaries, 1 row, the real lm_head shape, M = 1 and 16
columns, stacked matrices and expert subsets — and so must the sim's fast order.
The bytes a Linear holds are q4_0_to_ggml of the old layout; the cuda upload prep
splits them into exactly the arrays the old pack_q4_0 made. A Qwen3-0.6B-shaped
model (real vocabulary) decodes on the reference and the sim, q4_0 and f32.
"""
from __future__ import annotations

import numpy as np
import pytest

from kestrel_tui.backends import ops_exact, ops_fast
from kestrel_tui.backends.base import NumpyBackend
from kestrel_tui.backends.cuda.weights import device_q4_0
from kestrel_tui.backends.ops_fast import sim_ops
from kestrel_tui.backends.toggles import TOGGLES
from kestrel_tui.engines.builtin import run_decode
from kestrel_tui.model import weights
from kestrel_tui.model.config import Config
from kestrel_tui.model.quant import (dequantize_q4_0, q4_0_from_ggml, q4_0_to_ggml, quantize_q4_0,
                                     quantize_q4_0_ggml, quantize_q8_0)
from kestrel_tui.model.weights import (Linear, linear_from_ggml, linear_from_q4, linear_from_rows, make_linear,
                                       synthetic_model)
from kestrel_tui.numerics import linalg
from kestrel_tui.numerics.reduce import lane_sum

F32 = np.float32


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype == F32 else a.view(np.uint8)


def _same(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    bad = np.flatnonzero(_bits(a).ravel() != _bits(b).ravel())
    assert bad.size == 0, f"{bad.size} of {a.size} differ; first at flat index {bad[0]}"


def _random_q4(rng, shape):
    """Block-major (qs, d) with every nibble value and f16 scales of both signs and many binades."""
    *lead, out, inp = shape
    qs = rng.integers(-8, 8, (*lead, inp // 32, out, 32)).astype(np.int8)
    d = (rng.choice([-1, 1], (*lead, inp // 32, out)) * 2.0 ** rng.uniform(-14, 2, (*lead, inp // 32, out)))
    return qs, d.astype(np.float16).astype(F32)


def _act(rng, shape):
    x = rng.standard_normal(shape).astype(F32)
    x[..., :32] = 0  # an all-zero block: d = 0, inverse 0
    return x


# ------------------------------------------------ the unchunked references, on the old layout

def _ref_isum(qs, qx, expert=None):
    """int64 block dots, no BLAS: qs [..., nb, out, 32] (old layout), qx [..., nb, 32] int8."""
    w = qs.astype(np.int64) if expert is None else qs[expert].astype(np.int64)
    return np.einsum("...bok,...bk->...bo", w, qx.astype(np.int64)).astype(F32)


def _ref_exact(qs, d, x, expert=None):
    """The contract, as the pre-packing code computed it: term = float(isum) * (dw*dx), lane sum."""
    qx, dx = quantize_q8_0(x)
    wd = d if expert is None else d[expert]
    return lane_sum(_ref_isum(qs, qx, expert) * (wd * dx[..., None]), axis=-2)


def _ref_fast(qs, d, x, M, expert=None):
    qx, dx = quantize_q8_0(x)
    wd = d if expert is None else d[expert]
    terms = (_ref_isum(qs, qx, expert) * wd) * dx[..., None]
    return ops_fast._split_k(terms, 1 if M == 1 else 2)


def _ref_f32(w, x, expert=None):
    ww = w if expert is None else w[expert]
    return lane_sum(ww * x[..., None, :], axis=-1)


@pytest.fixture(params=[None, 1 << 12], ids=["default-chunks", "tiny-chunks"])
def chunk(request, monkeypatch):
    """The default chunk size, and one so small that every matrix is cut mid-way."""
    if request.param is not None:
        monkeypatch.setattr(linalg, "CHUNK_ELEMS", request.param)
    return request.param


@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("outs,inp", [((1,), 64), ((37,), 96), ((300, 41, 41), 256), ((129, 3), 32)],
                         ids=["1row", "odd", "qkv", "in32"])
def test_gemv_equals_unchunked(chunk, M, outs, inp):
    rng = np.random.default_rng(sum(outs) * 7 + inp + M)
    mats = [_random_q4(rng, (o, inp)) for o in outs]
    lins = tuple(linear_from_q4(qs, d, "q4_0") for qs, d in mats)
    x = _act(rng, (M, inp))
    got = ops_exact.project(lins, x)
    fast = ops_fast.project(lins, x)
    for (qs, d), g, f in zip(mats, got, fast):
        _same(g, _ref_exact(qs, d, x))
        _same(f, _ref_fast(qs, d, x, M))
    # f32 weights: the contract's lane sum over elements, chunked the same way
    flins = tuple(linear_from_q4(qs, d, "f32") for qs, d in mats)
    for (qs, d), g in zip(mats, ops_exact.project(flins, x)):
        _same(g, _ref_f32(dequantize_q4_0(qs, d), x))


@pytest.mark.parametrize("M,k,shared", [(1, 4, True), (1, 4, False), (16, 3, True), (16, 3, False)])
def test_expert_gemv_equals_unchunked(chunk, M, k, shared):
    """Experts [E, out, in]: only the selected ones are widened (several to a chunk, column lists
    padded), x [M, 1, in] shared by the k slots (gate/up) or [M, k, in] per slot (down)."""
    rng = np.random.default_rng(M * 10 + k + shared)
    E, inp = 8, 128
    mats = [_random_q4(rng, (E, o, inp)) for o in (48, 17)]
    lins = tuple(linear_from_q4(qs, d, "q4_0") for qs, d in mats)
    expert = np.stack([rng.choice(E - 2, k, replace=False) for _ in range(M)])  # experts 6, 7 unused
    x = _act(rng, (M, 1 if shared else k, inp))
    got = ops_exact.project_experts(lins, x, expert)
    fast = ops_fast.project_experts(lins, x, expert)
    for (qs, d), g, f in zip(mats, got, fast):
        assert g.shape == (M, k, qs.shape[-2])
        _same(g, _ref_exact(qs, d, x, expert))
        _same(f, _ref_fast(qs, d, x, M, expert))
    flins = tuple(linear_from_q4(qs, d, "f32") for qs, d in mats)
    for (qs, d), g in zip(mats, ops_exact.project_experts(flins, x, expert)):
        _same(g, _ref_f32(dequantize_q4_0(qs, d), x, expert))


def test_experts_widened_are_only_the_selected(monkeypatch):
    """An expert nobody chose is never read: poison it with NaN scales, the outputs stay finite."""
    rng = np.random.default_rng(5)
    qs, d = _random_q4(rng, (6, 40, 64))
    d[3] = np.nan
    lin = linear_from_q4(qs, d, "q4_0")
    expert = np.array([[0, 5], [1, 2], [5, 4]])
    x = _act(rng, (3, 1, 64))
    (y,) = ops_exact.project_experts((lin,), x, expert)
    assert np.isfinite(y).all()
    _same(y, _ref_exact(qs, d, x, expert))


def test_lm_head_shape_once():
    """The real Qwen3-0.6B lm_head: vocab 151936 x hidden 1024 (the old code had no path for it)."""
    rng = np.random.default_rng(11)
    out, inp = 151936, 1024
    raw = rng.integers(0, 256, (out, inp // 32, 18), dtype=np.uint8)
    raw[..., :2] = (rng.standard_normal((out, inp // 32)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    lin = linear_from_ggml(raw.reshape(out, -1), "q4_0")
    assert np.shares_memory(lin.blocks, raw)
    x = _act(rng, (1, inp))
    (y,) = ops_exact.project((lin,), x)
    qs, d = q4_0_from_ggml(raw, out, inp)
    qx, dx = quantize_q8_0(x)
    # the unchunked old computation: the whole matrix widened, one batched matmul (exact: integers)
    isum = np.matmul(qs.astype(F32), qx.astype(F32)[..., None])[..., 0]  # [1, nb, out]
    _same(y, lane_sum(isum * (d * dx[..., None]), axis=-2))


# ------------------------------------------------ the bytes

@pytest.mark.parametrize("shape", [(3, 64), (5, 7, 96), (1, 32)])
def test_bytes_are_ggml_of_the_old_layout(shape, tmp_path):
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    w = rng.standard_normal(shape).astype(F32) * F32(0.1)
    qs, d = quantize_q4_0(w)
    want = q4_0_to_ggml(qs, d)  # [..., out, nb, 18]
    lin = make_linear(w, "q4_0")
    _same(lin.blocks, want)
    _same(quantize_q4_0_ggml(w), want)
    _same(linear_from_q4(qs, d, "q4_0").blocks, want)
    assert lin.blocks.flags.c_contiguous and lin.nbytes == w.size // 32 * 18
    _same(lin.ggml, want.reshape(*shape[:-1], -1))  # GGUF's tensor shape [..., out, nb*18]
    # the compatibility views of the old layout, and the dequantized values
    _same(lin.qs, qs)
    _same(lin.d, d)
    _same(lin.dense(), dequantize_q4_0(qs, d))
    # ggml bytes in: used as they are, no copy, from a read-only memmap of a file too
    path = tmp_path / "w.bin"
    lin.ggml.tofile(path)
    mm = np.memmap(path, np.uint8, "r", shape=lin.ggml.shape)
    back = linear_from_ggml(mm, "q4_0")
    assert np.shares_memory(back.blocks, mm) and (back.out, back.inp) == shape[-2:]
    _same(back.blocks, want)
    _same(linear_from_ggml(mm, "f32").w, dequantize_q4_0(qs, d))
    flat = linear_from_ggml(np.fromfile(path, np.uint8), "q4_0", shape=shape)
    _same(flat.blocks, want)
    x = _act(rng, (2, *shape[:-2], shape[-1])) if len(shape) == 2 else None
    if x is not None:
        _same(ops_exact.project((back,), x)[0], ops_exact.project((lin,), x)[0])
    with pytest.raises(ValueError):
        linear_from_ggml(np.zeros((4, 17), np.uint8), "q4_0")


def test_embedding_rows():
    rng = np.random.default_rng(2)
    qs, d = _random_q4(rng, (50, 96))
    lin = linear_from_q4(qs, d, "q4_0")
    idx = np.array([0, 49, 7, 7])
    _same(lin.rows(idx), dequantize_q4_0(qs, d)[idx])


def _old_pack_q4_0(qs, d):
    """backends/cuda/weights.py pack_q4_0 as it was: the device layout's definition."""
    q = np.swapaxes(qs, -3, -2).view(np.uint8) + np.uint8(8)
    packed = q[..., :16] | (q[..., 16:] << np.uint8(4))
    return np.ascontiguousarray(packed), np.ascontiguousarray(np.swapaxes(d, -2, -1).astype(np.float16))


@pytest.mark.parametrize("shape", [(5, 64), (4, 9, 128), (3, 32)])
def test_device_upload_prep_equals_old_pack(shape):
    rng = np.random.default_rng(shape[-1] + len(shape))
    qs, d = _random_q4(rng, shape)
    d.reshape(-1)[:3] = [0.0, -0.0, 65504.0]
    want_nib, want_sc = _old_pack_q4_0(qs, d)
    nib, sc = device_q4_0(linear_from_q4(qs, d, "q4_0").blocks)
    assert nib.dtype == np.uint8 and sc.dtype == np.float16
    assert nib.flags.c_contiguous and sc.flags.c_contiguous
    _same(nib, want_nib)
    assert nib.shape == want_nib.shape and sc.shape == want_sc.shape
    assert np.array_equal(sc.view(np.uint16), want_sc.view(np.uint16))


def test_device_model_uploads_the_old_arrays():
    """DeviceModel, run against a stand-in for PyCUDA: every q4_0 matrix goes up as exactly the
    nibbles and scales the old pack_q4_0 made of the old layout (experts, tied embedding)."""
    from types import SimpleNamespace

    from kestrel_tui.backends.cuda.weights import DeviceModel
    from kestrel_tui.model.config import default_config

    uploads: dict[int, np.ndarray] = {}

    class Alloc(int):
        pass

    def mem_alloc(n):
        return Alloc(len(uploads) + 1)

    def memcpy_htod(alloc, arr):
        uploads[int(alloc)] = np.array(arr, copy=True)

    rt = SimpleNamespace(cuda=SimpleNamespace(mem_alloc=mem_alloc, memcpy_htod=memcpy_htod))
    model = synthetic_model(default_config().with_layers(2))
    dm = DeviceModel(rt, model)
    pairs = [(dm.embed, model.embed_tokens), (dm.lm_head, model.lm_head)]
    for dl, L in zip(dm.layers, model.layers):
        pairs += [(dl[n], getattr(L, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate",
                                                    "gate_proj", "up_proj", "down_proj")]
    for dlin, lin in pairs:
        nib, sc = _old_pack_q4_0(lin.qs, lin.d)
        _same(uploads[dlin.w], nib)
        assert np.array_equal(uploads[dlin.d].view(np.uint16), sc.view(np.uint16))
        assert dlin.nb == lin.inp // 32 and dlin.experts == (lin.blocks.shape[0] if lin.blocks.ndim == 4 else 0)


@pytest.mark.parametrize("fmt", ["q4_0", "f32"])
def test_streamed_rows_equal_whole_matrix(fmt, monkeypatch):
    """The loader's row-chunked build (linear_from_rows) equals quantizing the whole tensor."""
    monkeypatch.setattr(weights, "STREAM_ELEMS", 1000)  # 15 rows a read: the last read is short
    rng = np.random.default_rng(4)
    w = rng.standard_normal((100, 64)).astype(F32)
    reads = []

    def read(r0, r1):
        reads.append((r0, r1))
        return w[r0:r1].copy()

    lin = linear_from_rows(read, 100, 64, fmt)
    whole = make_linear(w, fmt)
    _same(lin.w if fmt == "f32" else lin.blocks, whole.w if fmt == "f32" else whole.blocks)
    assert len(reads) == 7 and reads[-1] == (90, 100)


def test_linear_checks_its_blocks():
    with pytest.raises(ValueError):
        Linear(4, 64, blocks=np.zeros((4, 3, 18), np.uint8))


# ------------------------------------------------ a real vocabulary, end to end

QWEN3_06B_1L = Config(arch="qwen3", n_layers=1, hidden=1024, n_heads=16, n_kv_heads=8, head_dim=128,
                      vocab=151936, rope_theta=1e6, eps=1e-6, tie_embeddings=True, max_positions=40960,
                      intermediate=3072)


@pytest.mark.parametrize("fmt", ["q4_0", "f32"])
def test_qwen3_06b_shape_decodes(fmt):
    """Qwen3-0.6B's shape (vocab 151936, tied, dense, head_dim 128), 1 layer: the reference and the
    sim decode; the sim with every op exact equals the reference bit for bit; every key is finite."""
    model = synthetic_model(QWEN3_06B_1L, fmt)
    if fmt == "q4_0":  # packed as ggml: 18 bytes per 32 weights
        assert model.embed_tokens.nbytes == 151936 * 1024 // 32 * 18 and model.lm_head is model.embed_tokens
    prompt = [1, 151935, 42]
    ref = run_decode(NumpyBackend(model), prompt, 2)
    exact = run_decode(NumpyBackend(model, ops=sim_ops(frozenset(TOGGLES)), name="sim"), prompt, 2,
                       forced=ref.generated[:2])
    fast = run_decode(NumpyBackend(model, ops=sim_ops(frozenset()), name="sim"), prompt, 2,
                      forced=ref.generated[:2])
    assert len(ref.positions) == 5 and len(ref.generated) == 3
    assert exact.hashes() == ref.hashes()
    assert fast.hashes().keys() == ref.hashes().keys()
    for p in ref.positions + fast.positions:
        assert p.logits.shape == (151936,) and np.isfinite(p.logits).all()
    # the 3-column prefill's last column equals the same position computed alone (batch invariance)
    solo = NumpyBackend(model)
    solo.reset(3)
    solo.step(np.array(prompt[:2]), 0, raw=False)
    _same(solo.step(np.array(prompt[2:]), 2, raw=False).logits[0], ref.positions[2].logits)
