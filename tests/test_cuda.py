"""The cuda backend on a real GPU (marked `cuda`; skipped without PyCUDA or a device).

* the replica device functions equal the numpy replicas bit for bit on >= 10M
  inputs each;
* the device FNV-1a 64 equals trace.fnv on buffers around every chunk boundary;
* all exact: every key of every position equals the cpu reference (the default
  48-layer model, a short run; scripts/gpu_acceptance.py does the full one),
  with the prefill on either side, in isolate mode, with --deep, and with f32
  weights and KV; batch-verify columns equal M=1 decode; the M=1 step as a graph
  replay (the default) equals the direct launches on every key and raw buffer;
* all exact on qwen3_moe checkpoints with dense MLP layers (decoder_sparse_step,
  mlp_only_layers), q4_0 and f32, default and deep keys, chain and isolate: every
  key equals the cpu reference; and under the schedules forward, chunked, prefix
  and verify, every key, token and logit bit equals the cpu decode;
* all fast: the first DIFF is at position 0, layer 0 (prefill on the subject);
  switching toggles on one by one moves it monotonically to all ok.
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from kestrel_tui.backends.toggles import OWNERS, TOGGLES
from kestrel_tui.errors import UsageError
from kestrel_tui.trace.fnv import fnv1a64
from kestrel_tui.trace.keys import order_key, parse_key

pytestmark = pytest.mark.cuda

REPLICA_N = int(os.environ.get("KESTREL_REPLICA_N", 10_000_000))


@pytest.fixture(scope="module")
def rt():
    from kestrel_tui.backends.cuda.runtime import runtime

    try:
        return runtime()
    except UsageError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("fn", ["expf", "cosf", "sinf"])
def test_replica_device_functions_equal_numpy(rt, fn):
    from kestrel_tui.backends.cuda.selfcheck import replica_mismatches

    n, bad, first = replica_mismatches(rt, fn, REPLICA_N, seed=len(fn) + ord(fn[0]))
    assert n >= REPLICA_N
    assert bad == 0, f"{fn}: {bad}/{n} differ, first inputs {first}"


ROUTER_LOGITS = {  # a column's logits, by what they exercise in router_exact (kernels/moe.cuh)
    "trained": lambda rng, E: 2 * rng.standard_normal(E),  # a trained router's scale
    "wide": lambda rng, E: 50 * rng.standard_normal(E),  # the synthetic models': most e tiny, subnormal or 0
    "ties": lambda rng, E: np.round(rng.standard_normal(E)),  # equal e and p at the top k: ranks counted again
}


@pytest.mark.parametrize("E,k", [(128, 8), (8, 2), (992, 64)])
@pytest.mark.parametrize("case", list(ROUTER_LOGITS))
def test_router_exact_equals_numpy(rt, case, E, k):
    """router_exact (contract L8a, L8b with T1's expf), 64 columns a launch: the experts chosen and
    their renormalised weights bit for bit ops_exact.route's, on each kind of logits."""
    from kestrel_tui.backends import ops_exact

    rng = np.random.default_rng(E + k + len(case))
    logits = np.stack([ROUTER_LOGITS[case](rng, E) for _ in range(64)]).astype(np.float32)
    cuda = rt.cuda
    with rt.active():
        d_logits, topk, topw = cuda.to_device(logits), cuda.mem_alloc(4 * 64 * k), cuda.mem_alloc(4 * 64 * k)
        rt.kernel("moe", "router_exact").prepared_call((64, 1, 1), (-(-E // 32) * 32 + 32, 1, 1), int(d_logits),
                                                       int(topk), int(topw), E, k, 1, 1)
        got_idx, got_w = np.empty((64, k), np.int32), np.empty((64, k), np.float32)
        cuda.memcpy_dtoh(got_idx, topk)
        cuda.memcpy_dtoh(got_w, topw)
    idx, w = ops_exact.route(logits, k, True)
    assert np.array_equal(got_idx, idx.astype(np.int32))
    assert np.array_equal(got_w.view(np.uint32), w.astype(np.float32).view(np.uint32))


def test_device_fnv_equals_host(rt):
    from kestrel_tui.backends.cuda.backend import device_hash_work, launch_hash
    from kestrel_tui.backends.cuda.layout import HashWork

    from kestrel_tui.backends.cuda.layout import HASH_SCAN_MAX, SCAN_MAX

    rng = np.random.default_rng(7)
    lengths = [0, 4, 8, 28, 32, 36, 2044, 2048, 2052, 4096, 10_000, SCAN_MAX - 4, SCAN_MAX, SCAN_MAX + 4, 600_000,
               2048 * 17 + 4, 2 * SCAN_MAX + 36, *(rng.integers(1, SCAN_MAX // 4, 40) * 4),
               *(rng.integers(SCAN_MAX // 4, 20 * SCAN_MAX // 4, 8) * 4)]
    spans, off = [], 0
    for n in lengths:
        spans.append((off, n))
        off += (n + 255) // 256 * 256 + 256
    data = rng.integers(0, 256, off, dtype=np.uint8)
    cuda = rt.cuda
    want = [fnv1a64(data[o:o + n].tobytes()) for o, n in spans]
    with rt.active():
        base = cuda.to_device(data)
        # every span in chunks (two launches, or one), every span by fnv_scan, the short ones by it
        for onepass, scan_max in ((False, 0), (True, 0), (False, HASH_SCAN_MAX), (True, 2048), (False, SCAN_MAX)):
            hb = device_hash_work(cuda, HashWork(spans, scan_max=scan_max), onepass=onepass)
            for _ in range(3):  # later launches: the tickets reset themselves, the flags' epochs move on
                launch_hash(rt, hb, int(base))
                out = np.empty(len(spans), np.uint64)
                cuda.memcpy_dtoh(out, hb["ptr"]["out"])
                assert [int(h) for h in out] == want, f"onepass={onepass} scan_max={scan_max}"


ORDERED_SRC = r"""
#include "common.cuh"
// Thread i: the ordered sum of array i (16-byte aligned), as RMSNorm's, QK-norm's and the router's
// chains take it from shared memory; and x[i] / n[i] by div_by_count and by the divide.
extern "C" __global__ void ordered(const float *a, const int *off, const int *len, float *sums, int m,
                                   const float *x, const int *n, float *q, float *qd, int k) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < m) sums[i] = serial_sum_shared(a + off[i], len[i]);
  for (int j = i; j < k; j += gridDim.x * blockDim.x) {
    q[j] = div_by_count(x[j], n[j]);
    qd[j] = FDIV(x[j], (float)n[j]);
  }
}
"""


def test_ordered_sum_and_count_divide_equal_numpy(rt):
    """common.cuh's serial_sum_shared (loads a group ahead of the adds) is contract R3's ordered
    sum: bit for bit numpy's sequential float32 sum (cumsum) over every length 0..300 and the
    chains' own lengths, on values of mixed magnitude and sign. div_by_count (a multiply where n is
    a power of two) gives the divide's bits: against the device's FDIV and numpy's float32 divide
    on 2M inputs from every exponent, subnormals, zeros and infinities included."""
    from pycuda.compiler import SourceModule

    from kestrel_tui.backends.cuda.runtime import NVCC_OPTIONS, module_source

    rng = np.random.default_rng(11)
    lengths = [*range(0, 301), 512, 1024, 2048 // 8, 4096 // 8, 5120 // 8, 1023, 1025]
    arrays = [(rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32) for n in lengths]
    off = np.cumsum([0] + [(len(a) + 3) // 4 * 4 for a in arrays[:-1]]).astype(np.int32)
    flat = np.zeros(int(off[-1]) + len(arrays[-1]) + 4, np.float32)
    for o, a in zip(off, arrays):
        flat[o:o + len(a)] = a
    k = 2_000_000
    x = rng.integers(0, 2**32, k, dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    x[:8] = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4e38, 1.17549435e-38], np.float32)
    x[np.isnan(x)] = np.float32(1.5)  # NaN payloads are not the claim
    n = np.where(rng.random(k) < 0.5, 2 ** rng.integers(0, 31, k), rng.integers(1, 1 << 24, k)).astype(np.int32)
    cuda = rt.cuda
    with rt.active():
        fn = SourceModule(module_source("ordered", ORDERED_SRC), options=NVCC_OPTIONS,
                          no_extern_c=True).get_function("ordered")
        sums, q, qd = (cuda.mem_alloc(4 * m) for m in (len(arrays), k, k))
        fn(cuda.In(flat), cuda.In(off), cuda.In(np.array(lengths, np.int32)), sums, np.int32(len(arrays)),
           cuda.In(x), cuda.In(n), q, qd, np.int32(k), block=(256, 1, 1), grid=(1024, 1))
        got_sums = np.empty(len(arrays), np.float32)
        got_q, got_qd = np.empty(k, np.float32), np.empty(k, np.float32)
        for dst, src in ((got_sums, sums), (got_q, q), (got_qd, qd)):
            cuda.memcpy_dtoh(dst, src)
    want_sums = np.array([np.cumsum(a, dtype=np.float32)[-1] if len(a) else 0.0 for a in arrays], np.float32)
    assert np.array_equal(got_sums.view(np.uint32), want_sums.view(np.uint32))
    assert np.array_equal(got_q.view(np.uint32), got_qd.view(np.uint32))
    with np.errstate(all="ignore"):
        want_q = x / n.astype(np.float32)
    assert np.array_equal(got_q.view(np.uint32), want_q.view(np.uint32))
    assert (n & (n - 1) == 0).sum() > k // 3  # both paths of div_by_count well covered


# ------------------------------------------------------------ runs against the cpu reference

def _session(model, n_prompt=4, n_tokens=4, **kw):
    from kestrel_tui.session.inputs import default_prompt
    from kestrel_tui.session.session import Session

    return Session(model, default_prompt(model.cfg.vocab, n_prompt), n_tokens, subject="cuda", **kw)


def _run(session, exact, **kw):
    from kestrel_tui.session.session import RunSettings

    return session.run(RunSettings(exact=frozenset(exact), **kw), record=False)


@pytest.fixture(scope="module")
def default_session(rt, default_model):
    return _session(default_model)


@pytest.mark.parametrize("prefill", ["subject", "reference"])
def test_all_exact_equals_cpu(default_session, prefill):
    res = _run(default_session, TOGGLES, prefill=prefill)
    assert res.all_ok, f"first DIFF {res.first_diff}: {res.stats(res.first_diff)}"
    assert len(res.comparison.status) == 8 * 530


def test_all_exact_isolate_equals_cpu(default_session):
    res = _run(default_session, TOGGLES, mode="isolate")
    assert res.all_ok, f"first DIFF {res.first_diff}: {res.stats(res.first_diff)}"


def test_isolate_pins_each_fast_op_on_its_own_keys(default_session):
    """Isolate mode feeds every op the reference's inputs: a fast op's DIFFs stay in keys it owns."""
    for op in ("norm", "rope", "attention"):
        res = _run(default_session, set(TOGGLES) - {op}, mode="isolate", prefill="subject")
        diffs = [k for k, s in res.comparison.status.items() if s.value == "DIFF"]
        assert diffs, op
        assert all(op in OWNERS[parse_key(k).field] or parse_key(k).field == "logits" for k in diffs), \
            (op, sorted({parse_key(k).field for k in diffs}))


def test_fast_first_diff_at_position_0_layer_0(default_session):
    res = _run(default_session, (), prefill="subject")
    assert res.first_diff is not None and res.first_diff.startswith("t0_l0_"), res.first_diff


def test_toggles_one_by_one_move_first_diff_monotonically(default_session):
    exact: set[str] = set()
    seen = [_run(default_session, exact, prefill="subject").first_diff]
    for op in ("norm", "gemm", "rope", "kvquant", "attention", "expf", "moe"):
        exact.add(op)
        seen.append(_run(default_session, exact, prefill="subject").first_diff)
    assert seen[-1] is None, seen
    keys = [order_key(k) if k else (float("inf"),) for k in seen]
    assert keys == sorted(keys), seen


def test_batch_verify_equals_single_decode(rt, small_model):
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.session.inputs import default_prompt
    from kestrel_tui.session.iso import iso

    cols = iso(lambda: make_cuda_backend(small_model, exact=frozenset(TOGGLES)),
               default_prompt(small_model.cfg.vocab, 5), 4)
    assert all(c.ndiff == 0 and c.first_diff_key is None for c in cols), cols


@pytest.mark.parametrize("exact", ["all", "none"])
def test_batch_widths_2_to_8(rt, small_model, exact):
    """Exact: every column of every width equals M=1 decode. Fast: the GEMV's reduction order
    differs between M = 1 and every other width, so every width has differing columns."""
    from kestrel_tui.perf.cuda import batch_verify

    res = batch_verify(small_model, frozenset(TOGGLES) if exact == "all" else frozenset(), n_pos=24,
                       n_prompt=4, log=lambda *_: None)
    if exact == "all":
        assert all(w["columns_with_diff"] == 0 for w in res["widths"].values()), res["widths"]
    else:
        assert all(w["ndiff_total"] for w in res["widths"].values()), res["widths"]


@pytest.mark.parametrize("exact", ["all", "none"])
def test_graph_replay_equals_direct_steps(rt, small_model, exact):
    from kestrel_tui.perf.cuda import graph_equals_direct

    r = graph_equals_direct(small_model, frozenset(TOGGLES) if exact == "all" else frozenset(), n_pos=12)
    assert r["logits_ndiff"] == 0 and r["key_diffs"] == 0, r


@pytest.mark.parametrize("exact", ["all", "none"])
def test_step_graph_path_equals_direct_path(rt, small_model, exact):
    """CudaBackend.step's M=1 graph replay vs the same backend kind forced direct (graph=False):
    logits bit for bit, every key's hash (in token_keys order) and every raw buffer (name,
    shape, dtype, bytes), over a few decode positions; again after reset() (a new capture)."""
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.session.inputs import default_prompt

    ex = frozenset(TOGGLES) if exact == "all" else frozenset()
    g_b = make_cuda_backend(small_model, exact=ex, graph=True)
    d_b = make_cuda_backend(small_model, exact=ex, graph=False)
    prompt = np.array(default_prompt(small_model.cfg.vocab, 4))
    for rnd in range(2):
        for b in (g_b, d_b):
            b.reset(16 + 8 * rnd)
            b.step(prompt, 0, raw=False)  # M=4: direct on both
        tok = int(prompt[-1])
        for pos in range(len(prompt), len(prompt) + 5):
            g, d = g_b.step(np.array([tok]), pos, raw=True), d_b.step(np.array([tok]), pos, raw=True)
            assert g.logits.shape == d.logits.shape and g.logits.dtype == d.logits.dtype
            assert np.array_equal(g.logits.view(np.uint32), d.logits.view(np.uint32)), pos
            assert list(g.hashes[0].items()) == list(d.hashes[0].items()), pos
            assert list(g.raw[0]) == list(d.raw[0])
            for key, a in d.raw[0].items():
                b_ = g.raw[0][key]
                assert (b_.shape, b_.dtype) == (a.shape, a.dtype), key
                assert a.tobytes() == b_.tobytes(), key
            tok = int(np.argmax(d.logits[0]))
        assert g_b.graph_error is None, g_b.graph_status
        assert g_b.graph_steps == 5 * (rnd + 1) and d_b.graph_steps == 0


def test_deep_keys_exact(rt, small_model):
    res = _run(_session(small_model, deep=True), TOGGLES)
    assert res.all_ok, res.first_diff
    assert any(k.endswith("_topw") for k in res.comparison.status)


def test_deep_keys_exact_on_a_dense_model(rt):
    """--deep on qwen3 (every layer dense): the MLP output as moe, empty router buffers, all ok."""
    from kestrel_tui.model.config import Config
    from kestrel_tui.model.weights import synthetic_model

    cfg = Config(arch="qwen3", n_layers=2, hidden=256, n_heads=8, n_kv_heads=2, head_dim=64, vocab=2048,
                 rope_theta=1e6, eps=1e-6, tie_embeddings=False, max_positions=64, intermediate=320)
    res = _run(_session(synthetic_model(cfg, "q4_0"), deep=True), TOGGLES, prefill="subject")
    assert res.all_ok, res.first_diff
    assert any(k.endswith("_moe") for k in res.comparison.status)


def test_f32_weights_and_kv_exact(rt):
    from kestrel_tui.model.config import default_config
    from kestrel_tui.model.weights import synthetic_model

    model = synthetic_model(default_config().with_layers(3), "f32")
    res = _run(_session(model, kv="f32"), TOGGLES)
    assert res.all_ok, f"first DIFF {res.first_diff}: {res.stats(res.first_diff)}"


@pytest.mark.parametrize("head_dim", [64, 80])
def test_fast_ops_close_to_reference_in_isolate(rt, small_model, head_dim):
    """Fast kernels may differ in bits but not in meaning: fed the reference's inputs (isolate),
    every fast op's output lands near the reference's — f32 buffers within 2 % of the buffer's
    largest magnitude, int8 KV rows within one step — at a context long enough for several
    fast-attention tiles. head_dim 80 (not a multiple of 32) takes the single-kernel attention
    and whole-warp RoPE blocks with lanes over."""
    from dataclasses import replace

    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.model.weights import synthetic_model

    model = small_model if head_dim == small_model.cfg.head_dim else synthetic_model(
        replace(small_model.cfg, head_dim=head_dim), "q4_0")
    ref, sub = NumpyBackend(model), make_cuda_backend(model, exact=frozenset())
    ctx = 150  # > 2 x ATT_FAST_TILE, not a multiple of it
    for b in (ref, sub):
        b.reset(ctx + 4)
    prompt = np.random.default_rng(3).integers(0, model.cfg.vocab, ctx)
    sub.load_kv(0, ref.step(prompt, 0).raw)
    worst = {}
    for pos, tok in zip(range(ctx, ctx + 3), (5, 17, 400)):
        r = ref.step(np.array([tok]), pos)
        s = sub.step(np.array([tok]), pos, feed=r.raw)
        for key, a in r.raw[0].items():
            b_ = s.raw[0][key]
            assert (b_.shape, b_.dtype) == (a.shape, a.dtype), key
            field = parse_key(key).field
            if a.dtype == np.float32:
                err = float(np.max(np.abs(b_ - a)) / max(np.max(np.abs(a)), 1e-30))
                worst[field] = max(worst.get(field, 0.0), err)
            elif a.dtype == np.int8:
                assert int(np.max(np.abs(b_.astype(np.int32) - a))) <= 1, key
    assert worst and max(worst.values()) < 0.02, worst


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("prefill", ["subject", "reference"])
def test_all_exact_equals_cpu_over_several_attention_tiles(rt, head_dim, prefill):
    """Contexts past one 256-position tile (the exact attention carries its running max from
    tile to tile and loads each P.V chunk's operands a chunk ahead), ending off a tile boundary,
    at every head_dim the split kernels take and at 80, which takes the single-kernel version:
    every key equals the cpu reference."""
    from dataclasses import replace

    from kestrel_tui.model.config import default_config
    from kestrel_tui.model.weights import synthetic_model

    model = synthetic_model(replace(default_config().with_layers(2), head_dim=head_dim), "q4_0")
    res = _run(_session(model, n_prompt=600, n_tokens=3), TOGGLES, prefill=prefill)
    assert res.all_ok, f"first DIFF {res.first_diff}: {res.stats(res.first_diff)}"


def _split_attention(rt, q, k, ks, v, vs, pos0, scale):
    """attn_exact_scores_q8 + attn_exact_pv_q8 of M columns at positions pos0.. (q [M, n_q, hd])."""
    from kestrel_tui.backends.cuda.launches import ATT_PV_THREADS, ATT_SPLIT_TILE, blocks_for

    M, nh, hd = q.shape
    cap, nkv = k.shape[:2]
    cuda = rt.cuda
    with rt.active():
        dq, dk, dks, dv, dvs = (cuda.to_device(np.ascontiguousarray(a)) for a in (q, k, ks, v, vs))
        S, I = cuda.mem_alloc(M * nh * cap * 4), cuda.mem_alloc(M * nh * cap * 4)
        out = cuda.mem_alloc(M * nh * hd * 4)
        rt.kernel("attention", "attn_exact_scores_q8").prepared_call(
            (nh, M, blocks_for(pos0 + M, ATT_SPLIT_TILE)), (ATT_SPLIT_TILE, 1, 1),
            int(dq), int(dk), int(dks), int(S), int(I), cap, pos0, nh, nkv, hd, scale, 0)
        rt.kernel("attention", "attn_exact_pv_q8").prepared_call(
            (nh, M, hd // 32), (ATT_PV_THREADS, 1, 1),
            int(dv), int(dvs), int(S), int(I), int(out), cap, pos0, nh, nkv, hd, 1, 0, 0, 0, 0)
        cuda.Context.synchronize()
        return cuda.from_device(out, (M, nh * hd), np.float32)


def _kv_scales(pattern: str, rng, cap: int, nkv: int) -> np.ndarray:
    """K scales that move the running max as the pattern says (V scales are random)."""
    base = (rng.random((cap, nkv)) * 0.02 + 0.001).astype(np.float32)
    p = np.arange(cap, dtype=np.float32)[:, None]
    if pattern == "rising":  # a new maximum at many positions
        return base * (np.float32(1) + p * np.float32(8 / cap))
    if pattern == "saw":  # a rise inside every run of 5 positions, crossing the serial batches
        return base * (np.float32(1) + (p % 5) * np.float32(3))
    if pattern == "flat":  # every score equal: the max never moves after position 0
        return np.full((cap, nkv), 0.01, np.float32)
    if pattern == "zero":  # every scale 0: every score 0, every weight 1
        return np.zeros((cap, nkv), np.float32)
    return base


@pytest.mark.parametrize("pattern", ["random", "rising", "saw", "flat", "zero"])
def test_exact_split_attention_equals_the_contract(rt, pattern):
    """The exact split attention kernels (scores and prefix maxima by tiles, then P.V in stages of
    producers and two serial warps, acc and l) against contract L6 in numpy (ops_exact.attention), bit for bit, at
    contexts around the stage, batch and tile boundaries, for 1 to 3 columns, fresh random caches
    each run, with running maxima that move often, inside batches, never, or not at all."""
    from kestrel_tui.backends.ops_exact import attention

    rng = np.random.default_rng()
    nh, nkv = 8, 2
    for hd, T, M in [(128, 1, 1), (128, 15, 1), (128, 16, 1), (128, 17, 3), (128, 127, 1), (128, 128, 1),
                     (128, 129, 3), (64, 255, 1), (128, 256, 1), (256, 257, 3), (128, 700, 1), (128, 1500, 2)]:
        cap = T + M - 1 + int(rng.integers(0, 40))
        q = (rng.standard_normal((M, nh, hd)) * 3).astype(np.float32)
        k = rng.integers(-127, 128, (cap, nkv, hd)).astype(np.int8)
        v = rng.integers(-127, 128, (cap, nkv, hd)).astype(np.int8)
        ks, vs = _kv_scales(pattern, rng, cap, nkv), (rng.random((cap, nkv)) * 0.02).astype(np.float32)
        scale = np.float32(1 / np.sqrt(hd))
        pos0 = T - 1
        got = _split_attention(rt, q, k, ks, v, vs, pos0, float(scale))
        want = attention(q, {"k": k, "ks": ks, "v": v, "vs": vs}, np.arange(pos0, pos0 + M), scale)
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, f"hd={hd} T={T} M={M}: {bad.size} of {got.size} differ, first at {bad[:4]}"


def _fused_toggle_sets():
    """none, all, and random subsets (fresh each run; the failing set is in the test id)."""
    rng = np.random.default_rng()
    sets = [frozenset(), frozenset(TOGGLES)]
    sets += [frozenset(t for t in TOGGLES if rng.random() < 0.5) for _ in range(4)]
    return sets


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("exact", _fused_toggle_sets(), ids=lambda s: "+".join(sorted(s)) or "none")
def test_fused_launches_equal_separate_ones(rt, head_dim, exact):
    """kernels/fused.cu (QK-norm+RoPE+KV rows; down + expert sum) and the attention kernels' own q8_0
    of their output vs every op launched on its own (the fuse option off): logits bit for bit and
    every key's hash, for a prefill (M=6), batch steps (M=3) and M=1 decode through the graph,
    under any mix of fast and exact ops."""
    _assert_fused_equals_plain(head_dim, exact)


def test_combine_with_the_norm_equals_separate_launches(rt):
    """f32 weights: the down GEMV does not fold the expert sum, which goes with the next norm
    (combine_rmsnorm) instead; the same bits as separate launches too."""
    _assert_fused_equals_plain(128, _fused_toggle_sets()[-1], weights="f32")


@pytest.mark.parametrize("exact", [frozenset(), frozenset({"gemm"}), frozenset({"moe"}), frozenset({"gemm", "moe"})],
                         ids=lambda s: "+".join(sorted(s)) or "none")
def test_fused_swiglu_equals_separate_launches_at_30b_a3b_expert_shapes(rt, exact):
    """experts_swiglu (a MoE layer's gate, up and silu with the q8_0 of its output in one launch)
    vs gemv_q4_experts + silu_mul at Qwen3-30B-A3B's expert shapes: hidden 2048, moe_intermediate
    768 (24 q8_0 blocks a pair), the top 8 of 128 experts; every key bit for bit, gemm and moe
    each fast and exact."""
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.model.config import qwen3_30b_a3b_config

    _assert_model_fused_equals_plain(DeviceSyntheticModel(replace(qwen3_30b_a3b_config(2), vocab=4096), seed=1),
                                     exact)


def _assert_fused_equals_plain(head_dim, exact, weights="q4_0"):
    from kestrel_tui.model.config import default_config
    from kestrel_tui.model.weights import synthetic_model

    _assert_model_fused_equals_plain(synthetic_model(replace(default_config().with_layers(3), head_dim=head_dim),
                                                     weights), exact)


def _assert_model_fused_equals_plain(model, exact):
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.cuda.options import CudaOptions

    fused = make_cuda_backend(model, exact=exact, options=CudaOptions())
    plain = make_cuda_backend(model, exact=exact, options=CudaOptions(fuse=False))
    assert fused.fuse and not plain.fuse
    prompt = np.random.default_rng().integers(0, model.cfg.vocab, 6)
    outs = []
    for b in (fused, plain):
        b.reset(32)
        steps = [b.step(prompt, 0, raw=False), b.step(prompt[:3], 6, raw=False)]
        tok = int(np.argmax(steps[-1].logits[-1]))
        for pos in range(9, 15):
            steps.append(b.step(np.array([tok]), pos, raw=False))
            tok = int(np.argmax(steps[-1].logits[0]))
        outs.append(steps)
    assert fused.graph_steps > 0, fused.graph_status
    for i, (f, p) in enumerate(zip(*outs)):
        assert np.array_equal(f.logits.view(np.uint32), p.logits.view(np.uint32)), (sorted(exact), i)
        for m, (hf, hp) in enumerate(zip(f.hashes, p.hashes)):
            bad = [k for k in hp if hf.get(k) != hp[k]]
            assert not bad, f"step {i} column {m}: {len(bad)} keys differ, first {sorted(bad, key=order_key)[0]}"

def test_device_generator_equals_its_host_twin(rt):
    """gen_q4's bytes on the device == model/device_synthetic.py's, so the twin is the reference's input."""
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.model.config import Config
    from kestrel_tui.model.device_synthetic import gen_q4_blocks

    cfg = Config(arch="qwen3_moe", n_layers=1, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=1000,
                 rope_theta=1e6, eps=1e-6, tie_embeddings=False, max_positions=64, n_experts=8, top_k=2,
                 moe_intermediate=96)
    sm = DeviceSyntheticModel(cfg, seed=3)
    with rt.active():
        dm = sm.device_model(rt)
        lin = dm.layers[0]["gate_proj"]  # an expert stack: blocks over [E, out, nb]
        n = lin.experts * lin.out * lin.nb
        w = np.empty((n, 16), np.uint8)
        d = np.empty(n, np.float16)
        rt.cuda.memcpy_dtoh(w, lin.w)
        rt.cuda.memcpy_dtoh(d, lin.d)
    # gate_proj is the 5th generated matrix of layer 0: embed, lm_head, router, then the experts
    seed = (3 * 1_000_003 + 4) & 0x7FFFFFFF
    dscale = float(np.float32(cfg.hidden ** -0.5 / DeviceSyntheticModel.UNIFORM_NIBBLE_STD))
    host = gen_q4_blocks(n, seed, dscale)
    assert np.array_equal(host[:, 2:], w) and np.array_equal(host[:, :2].copy().view(np.float16)[:, 0], d)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3", "qwen3_moe-mixed"])
def test_device_synthetic_all_exact_equals_cpu_on_its_twin(rt, arch):
    """The full-size proof's method at small size: cuda on device-made weights vs cpu on the host twin."""
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.engines.builtin import run_decode
    from kestrel_tui.model.config import qwen3_30b_a3b_config
    from kestrel_tui.model.device_synthetic import device_synthetic_model
    from kestrel_tui.trace.compare import compare

    cfg = replace(qwen3_30b_a3b_config(2), vocab=4096)
    if arch == "qwen3":
        cfg = replace(cfg, arch="qwen3", n_experts=0, top_k=0, moe_intermediate=0, intermediate=1536)
    elif arch == "qwen3_moe-mixed":  # layer 0 dense, layer 1 sparse
        cfg = replace(cfg, intermediate=1536, mlp_only_layers=(0,))
    prompt = [(1 + 7919 * i) % cfg.vocab for i in range(8)]
    ref = run_decode(NumpyBackend(device_synthetic_model(cfg, seed=1)), prompt, 8, raw=False)
    sub = run_decode(make_cuda_backend(DeviceSyntheticModel(cfg, seed=1), exact=frozenset(TOGGLES)), prompt, 8,
                     forced=ref.generated[:8], raw=False)
    cmp = compare(ref.hashes(), sub.hashes())
    assert cmp.identical, (cmp.first_diff, cmp.counts)


@pytest.fixture(scope="module")
def real_shaped_dir(tmp_path_factory):
    """A Qwen3-0.6B-shaped HF directory: vocab 151936, hidden 1024, head_dim 128, tied, 2 layers."""
    from safetensors.numpy import save_file

    from kestrel_tui.model.config import Config
    from kestrel_tui.model.hf_export import hf_config, hf_state_dict
    from kestrel_tui.model.weights import synthetic_model

    folder = tmp_path_factory.mktemp("qwen3-0.6b-shaped")
    cfg = Config(arch="qwen3", n_layers=2, hidden=1024, n_heads=16, n_kv_heads=8, head_dim=128, vocab=151936,
                 rope_theta=1e6, eps=1e-6, tie_embeddings=True, max_positions=40960, intermediate=3072)
    src = synthetic_model(cfg, "q4_0")
    hf_config(src).to_json_file(str(folder / "config.json"))
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in hf_state_dict(src).items()},
              str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("weights", ["q4_0", "f32"])
def test_real_shaped_checkpoint_all_exact_equals_cpu(rt, real_shaped_dir, weights):
    """The loader's weights on the GPU: every key of prompt and decode equals the cpu reference."""
    from kestrel_tui.session.session import RunSettings, Session
    from kestrel_tui.model.hf import load_model

    model = load_model(real_shaped_dir, weights)
    assert model.cfg.vocab == 151936 and model.cfg.tie_embeddings
    session = Session(model, [1, 2, 3, 151935, 100000], 4, subject="cuda")
    res = session.run(RunSettings(exact=frozenset(TOGGLES), prefill="subject"))
    assert res.all_ok, (res.first_diff, res.comparison.counts)


# ------------------------------------------------------------ dense MLP layers inside a qwen3_moe model

# transformers' two ways to make a qwen3_moe layer dense, on 4 layers: every second one (layers 0 and 2,
# each after a MoE layer but the first) and one named (layer 1, between MoE layers); intermediate_size
# 320 is wider than the 4 expert slots of 64 a sparse layer computes
MIXED = {"sparse-step-2": (dict(decoder_sparse_step=2), (0, 2)), "mlp-only-1": (dict(mlp_only_layers=(1,)), (1,))}


@pytest.fixture(scope="module")
def mixed_dirs(tmp_path_factory):
    """A tiny HF checkpoint of each style: transformers' Qwen3MoeConfig (save_pretrained's config.json)
    and safetensors of a synthetic model's weights."""
    from safetensors.numpy import save_file

    from kestrel_tui.model.config import default_config
    from kestrel_tui.model.hf_export import hf_config, hf_state_dict
    from kestrel_tui.model.weights import synthetic_model

    dirs = {}
    for style, (over, _) in MIXED.items():
        folder = dirs[style] = tmp_path_factory.mktemp(style)
        src = synthetic_model(replace(default_config().with_layers(4), intermediate=320, **over), "q4_0")
        hf_config(src).save_pretrained(str(folder))
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in hf_state_dict(src).items()},
                  str(folder / "model.safetensors"))
    return dirs


def _mixed_model(dirs, style, weights):
    from kestrel_tui.model.hf import load_model

    model = load_model(dirs[style], weights)
    assert model.cfg.dense_layers == MIXED[style][1], model.cfg
    return model


@pytest.mark.parametrize("style", MIXED)
@pytest.mark.parametrize("weights", ["q4_0", "f32"])
def test_mixed_checkpoint_all_exact_equals_cpu(rt, mixed_dirs, style, weights):
    """Dense MLP layers inside a qwen3_moe model, all exact: every key of the prompt (on the subject)
    and the decode equals the cpu reference, in chain and isolate mode, with the default keys and
    the deep ones (a dense layer's MLP output as moe, its empty router buffers)."""
    model = _mixed_model(mixed_dirs, style, weights)
    kv = "q8" if weights == "q4_0" else "f32"
    for deep in (False, True):
        session = _session(model, kv=kv, deep=deep)
        for how in (dict(prefill="subject"), dict(mode="isolate")):
            res = _run(session, TOGGLES, **how)
            assert res.all_ok, (deep, how, res.first_diff, res.first_diff and res.stats(res.first_diff))
            assert len(res.comparison.status) == 8 * (2 + 4 * (17 if deep else 11))


SCHEDULE_PROMPT = [5, 77, 19, 33, 8, 9, 100, 3]


def _bits(trace):
    return ([p.hashes for p in trace.positions], [p.token for p in trace.positions],
            [p.logits.view(np.uint32).tobytes() for p in trace.positions])


@pytest.mark.parametrize("which", ["default-4-layers", "sparse-step-2"])
@pytest.mark.parametrize("schedule", ["forward", "chunked:2", "prefix:2", "verify:3"])
def test_all_exact_is_bitwise_under_schedules(rt, small_model, mixed_dirs, which, schedule):
    """numerics.md G3 (columns are independent) on the device: the cuda subject with every toggle
    exact, run under a schedule with the cpu decode's tokens given, has every key, token and logit
    bit of the cpu reference's decode."""
    from kestrel_tui.engines.base import EngineSpec, RunRequest
    from kestrel_tui.engines.build import make_engine
    from kestrel_tui.engines.builtin import OP_TOGGLES

    model = small_model if which == "default-4-layers" else _mixed_model(mixed_dirs, which, "q4_0")
    n = 6
    cpu = make_engine(EngineSpec("cpu"), model).run(RunRequest(list(SCHEDULE_PROMPT), n, {}))
    forced = [p.token for p in cpu.positions[len(SCHEDULE_PROMPT):]]
    exact = {t.name: t.exact for t in OP_TOGGLES}
    cuda = make_engine(EngineSpec("cuda", options={"schedule": schedule}), model)
    got = cuda.run(RunRequest(list(SCHEDULE_PROMPT), n, exact, forced=forced))
    assert len(got.positions) == len(SCHEDULE_PROMPT) + n
    assert _bits(got) == _bits(cpu)
