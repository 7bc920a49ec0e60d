"""The compiled reference's whole step against the numpy reference, key by key, bit for bit.

Every probe buffer of every position (the deep set included) must have the same bytes, shape and
dtype, the same hash and the same logits, for M-column steps (prefill, decode, batch-verify) on
the embedded model and on held-out shapes: head_dim 64/96/128, GQA ratios 1-8, 8-128 experts,
dense and MoE layers, q4_0 and f32 weights, q8 and f32 KV, attention biases and yarn RoPE.
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from kestrel_tui.backends.base import NumpyBackend
from kestrel_tui.cref.backend import CompiledBackend
from kestrel_tui.model.config import Config, Yarn, default_config
from kestrel_tui.model.weights import rope_tables, synthetic_model


@pytest.fixture(scope="module")
def lib_path(cref):
    return os.environ.get("KESTREL_TEST_CREF_LIB") or cref._name


def assert_same_steps(model, steps, lib_path, kv="q8", deep=True, threads=2):
    """Run both references through `steps` ((tokens, pos0) each) and compare everything they give."""
    cap = max(p + len(t) for t, p in steps)
    c, n = CompiledBackend(model, kv=kv, deep=deep, threads=threads, lib_path=lib_path), \
        NumpyBackend(model, kv=kv, deep=deep)
    c.reset(cap)
    n.reset(cap)
    for tokens, pos0 in steps:
        oc, on = c.step(np.array(tokens), pos0), n.step(np.array(tokens), pos0)
        assert oc.logits.view(np.uint32).tobytes() == on.logits.view(np.uint32).tobytes(), (pos0, len(tokens))
        assert oc.logits.base is None  # its own buffer: a view would keep the step's whole arena alive
        for m in range(len(tokens)):
            assert list(oc.hashes[m]) == list(on.hashes[m])  # the same keys, in dataflow order
            bad = [k for k in on.hashes[m] if oc.hashes[m][k] != on.hashes[m][k]]
            assert not bad, f"position {pos0 + m}: first differing key {bad[0]} ({len(bad)} in all)"
            for key, want in on.raw[m].items():
                got = oc.raw[m][key]
                assert (got.dtype, got.shape) == (want.dtype, want.shape), key
                assert got.tobytes() == want.tobytes(), key
    for li, (a, b) in enumerate(zip(c.cache.layers, n.cache.layers)):
        for name in a:
            assert a[name].tobytes() == b[name].tobytes(), f"layer {li} cache {name}"


def decode_steps(prompt: list[int], tokens: list[int], verify: list[int]):
    """A prefill, single-token decode steps, then one batch-verify step of len(verify) columns."""
    steps, pos = [(prompt, 0)], len(prompt)
    for t in tokens:
        steps.append(([t], pos))
        pos += 1
    return steps + [(verify, pos)] if verify else steps


def test_embedded_default_48_layers(default_model, lib_path):
    assert_same_steps(default_model, decode_steps([1, 2, 3, 4, 5, 6], [7, 1999], [3, 4, 5, 6]), lib_path)


@pytest.mark.parametrize("weights,kv", [("f32", "f32"), ("f32", "q8"), ("q4_0", "f32")])
def test_embedded_formats(weights, kv, lib_path):
    model = synthetic_model(default_config().with_layers(3), weights, seed=5)
    assert_same_steps(model, decode_steps([11, 12, 13, 14, 15], [16], [17, 18, 19]), lib_path, kv=kv)


def test_threads_do_not_change_bits(small_model, lib_path, cref):
    """1 and 3 threads with every op of two or more pieces shared (by default an op of less than ~2 us
    runs on the calling thread alone, which at these sizes is most of them)."""
    steps = decode_steps([9, 8, 7, 6, 5, 4, 3, 2], [1], [0, 1, 2])
    cref.kc_team_share_min(0)
    try:
        for threads in (1, 3):
            assert_same_steps(small_model, steps, lib_path, threads=threads)
    finally:
        cref.kc_team_share_min(-1)


def held_out(arch, hd, n_heads, n_kv, experts=0, top_k=0, **kw) -> Config:
    moe = dict(n_experts=experts, top_k=top_k, moe_intermediate=64) if arch == "qwen3_moe" else {}
    return Config(arch=arch, n_layers=2, hidden=kw.pop("hidden", 192), n_heads=n_heads, n_kv_heads=n_kv,
                  head_dim=hd, vocab=kw.pop("vocab", 500), rope_theta=kw.pop("rope_theta", 1e6), eps=1e-6,
                  tie_embeddings=kw.pop("tie", False), max_positions=4096, intermediate=kw.pop("intermediate", 96),
                  **moe, **kw)


HELD_OUT = {
    "dense-hd128-gqa8": held_out("qwen3", 128, 8, 1),
    "moe-hd96-gqa2-e8": held_out("qwen3_moe", 96, 6, 3, experts=8, top_k=2, norm_topk_prob=False),
    "moe-hd64-gqa1-e128": held_out("qwen3_moe", 64, 4, 4, experts=128, top_k=8, tie=True),
    "moe-hd128-gqa4-mlp-only": held_out("qwen3_moe", 128, 4, 1, experts=16, top_k=4, mlp_only_layers=(0,)),
    "dense-yarn-hd64-gqa2": held_out("qwen3", 64, 4, 2, rope_theta=1e4,
                                     yarn=Yarn(factor=4.0, original_max_positions=1024, attention_factor=1.2)),
}


@pytest.mark.parametrize("weights,kv", [("q4_0", "q8"), ("f32", "f32")])
@pytest.mark.parametrize("name", sorted(HELD_OUT))
def test_held_out_shapes(name, weights, kv, lib_path):
    model = synthetic_model(HELD_OUT[name], weights, seed=len(name))
    assert_same_steps(model, decode_steps([1, 2, 3], [4, 499], [5, 6, 7, 8, 9]), lib_path, kv=kv)


def test_attention_bias(lib_path):
    """attention_bias: q/k/v biases added after the GEMV, o's before the residual (contract L2, L7)."""
    model = synthetic_model(held_out("qwen3", 64, 4, 2, attention_bias=True), "q4_0", seed=3)
    rng = np.random.default_rng(0)
    layers = tuple(replace(L, **{f"{p}_bias": rng.standard_normal(n).astype(np.float32)
                                 for p, n in (("q", 256), ("k", 128), ("v", 128), ("o", 192))})
                   for L in model.layers)
    model = replace(model, layers=layers)
    assert_same_steps(model, decode_steps([1, 2, 3, 4], [5], [6, 7]), lib_path)


def test_yarn_tables_are_the_models(lib_path):
    """The yarn model above really scales cos/sin (otherwise its test would not cover step 4's factor)."""
    cfg = HELD_OUT["dense-yarn-hd64-gqa2"]
    assert not np.array_equal(rope_tables(cfg)[0], rope_tables(replace(cfg, yarn=None))[0])


def test_bad_token_is_one_line(small_model, lib_path):
    c = CompiledBackend(small_model, lib_path=lib_path)
    c.reset(4)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        c.step(np.array([small_model.cfg.vocab]), 0)


def test_qwen3_30b_a3b_dims(lib_path):
    """Real dims: hidden 2048, 32/4 heads of 128, 128 experts top-8, vocab 151936 (one layer, the
    device generator's q4_0 weights)."""
    from kestrel_tui.model.config import qwen3_30b_a3b_config
    from kestrel_tui.model.device_synthetic import device_synthetic_model

    model = device_synthetic_model(qwen3_30b_a3b_config(1), seed=0, threads=2)
    assert_same_steps(model, decode_steps([100, 151935, 7], [42], [5, 6, 7]), lib_path, deep=False)
