"""The field registry (trace/fields.py) against everything that names or sizes a probe field: the key
schema and its 530-key count, the toggles' ownership table, the compiled reference's slots (cref.h's
order too), the cuda arena, and the hf and llama.cpp engines' key maps, both ways (an engine map may
name no field the registry lacks and miss none it has)."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kestrel_tui.backends import toggles
from kestrel_tui.backends.cuda.layout import Layout
from kestrel_tui.model.config import default_config
from kestrel_tui.trace import fields, keys
from kestrel_tui.trace.keys import parse_key, token_keys

ROOT = Path(__file__).resolve().parents[1]
NAMES = set(fields.NAMES)
SMALL = replace(default_config(), n_layers=3)
CONFIGS = {
    "moe": SMALL,
    "dense": replace(SMALL, arch="qwen3", n_experts=0, top_k=0, moe_intermediate=0, intermediate=128),
    "mixed": replace(SMALL, intermediate=128, mlp_only_layers=(1,)),
}


def _expect(cfg, kv: str, name: str) -> tuple[np.dtype, tuple[int, ...]]:
    """The registry's dtype and one column's shape for a key name."""
    k = parse_key(name)
    f = fields.BY_NAME[k.field]
    return f.np_dtype(kv), f.shape(cfg, k.layer)


def test_registry_is_the_key_schema():
    assert len(fields.NAMES) == len(NAMES), "a field is in the registry twice"
    assert [f.name for f in fields.TOKEN] == ["emb", "logits"]
    assert keys.ALL_FIELDS == tuple(f.name for f in fields.LAYER)
    assert keys.FIELDS == tuple(f.name for f in fields.LAYER if not f.deep)
    assert set(keys.DEEP_FIELDS) == {f.name for f in fields.REGISTRY if f.deep}
    assert all(f.dtype in ("f32", "i32", "kv") and f.meaning for f in fields.REGISTRY)
    assert set(keys.GEMV_INPUT) | set(keys.GEMV_INPUT.values()) <= NAMES
    for f in fields.REGISTRY:
        assert keys.order_key(f"t0_l0_{f.name}" if f.per_layer else f"t0_{f.name}")[2] == "", f.name  # known


def test_530_keys_per_token_for_the_embedded_model():
    cfg = default_config()
    assert cfg.n_layers == 48
    assert len(token_keys(0, cfg.n_layers)) == 530
    assert len(token_keys(0, cfg.n_layers, deep=True)) == 48 * len(fields.LAYER) + len(fields.TOKEN)


def test_toggles_own_registry_fields():
    assert tuple(toggles.OWNERS) == fields.NAMES
    for op in toggles.REGISTRY:
        assert set(op.owns) <= NAMES, (op.name, set(op.owns) - NAMES)


def test_cref_slots_follow_cref_h_and_the_registry():
    header = (ROOT / "kestrel_tui" / "cref" / "cref.h").read_text()
    enum = re.search(r"enum \{ (KC_NRM[^}]*)\};", header)[1]
    names = [n.strip() for n in enum.split(",") if n.strip()]
    assert names[-1] == "KC_NFIELDS"
    assert names[:-1] == [f"KC_{f.name.upper()}" for f in fields.LAYER], "cref.h's slot order is not the registry's"

    from kestrel_tui.cref import Unavailable, load
    from kestrel_tui.cref.backend import CompiledBackend
    from kestrel_tui.model.weights import synthetic_model

    try:
        load()
    except Unavailable as e:
        pytest.skip(str(e))

    for cfg in CONFIGS.values():
        model = synthetic_model(cfg, "q4_0", seed=1)
        for kv in ("q8", "f32"):
            slots = CompiledBackend(model, kv=kv, deep=True, threads=1)._slots()
            assert [(f, li) for f, li, _, _ in slots] == [(k.field, k.layer) for k in
                                                          map(parse_key, token_keys(0, cfg.n_layers, True))]
            for f, li, dt, shape in slots:
                assert (dt, shape) == _expect(cfg, kv, f"t0_{f}" if li is None else f"t0_l{li}_{f}"), (f, li)
                if f == "router" and cfg.layer_is_moe(li):  # the registry's width is the weights' own
                    assert shape == (model.layers[li].gate.out,)


@pytest.mark.parametrize("name", ["moe", "dense"])  # the cuda step runs every layer of a model one way
def test_cuda_layout_holds_each_key_at_the_registry_shape(name):
    cfg = CONFIGS[name]
    for kv in ("q8", "f32"):
        deep = cfg.is_moe  # --deep is refused on a dense model
        lay = Layout(cfg, kv, 2, deep)
        for key in token_keys(0, cfg.n_layers, deep):
            k = parse_key(key)
            r = lay.regions[k.field, k.layer]
            dt, shape = _expect(cfg, kv, key)
            assert (r.dtype, r.shape, r.col_bytes) == (dt, shape, int(np.prod(shape)) * dt.itemsize), key


# The engines' key maps against the registry, both ways: tests/test_structure.py (e).


@pytest.mark.parametrize("name", ["moe", "mixed"])
@pytest.mark.parametrize("kv", ["q8", "f32"])
def test_llamacpp_keys_from_its_nodes_are_the_registry_s(name, kv):
    """The engine's own assembly of a position's keys from captured node values (no llama.cpp needed)."""
    from kestrel_tui.engines import llamacpp as lc
    from kestrel_tui.model.weights import synthetic_model

    cfg = CONFIGS[name]
    eng = lc.LlamaCppEngine.__new__(lc.LlamaCppEngine)
    eng.ours, eng.kv, eng.deep = synthetic_model(cfg, "q4_0", seed=1), kv, True

    class Cap:
        cols = {0: {("emb", None): np.zeros(cfg.hidden, np.float32),
                    **{(f, li): np.full(int(np.prod(fields.BY_NAME[f].shape(cfg, li))), 0.5, np.float32)
                       for li in range(cfg.n_layers) for f in lc._CAPTURED}}}

    out = eng._keys(Cap(), 0, np.zeros(cfg.vocab, np.float32))
    assert list(out) == token_keys(0, cfg.n_layers, deep=True)
    for key, a in out.items():
        assert (a.dtype, a.shape) == _expect(cfg, kv, key), key


def test_hf_capture_reads_what_its_map_says():
    """One deep forward of a tiny transformers Qwen3-MoE through the hooks: the buffers they kept are
    CAPTURED's fields, and the keys made from them the registry's, at its dtypes and shapes."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import DynamicCache

    from kestrel_tui.engines import hf_hooks

    hc = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=16, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hc).eval()
    model.set_attn_implementation(hf_hooks.attention_name(model, "eager"))
    cfg = replace(SMALL, n_layers=2, hidden=32, n_heads=2, n_kv_heads=1, head_dim=16, vocab=64, n_experts=4,
                  top_k=2, moe_intermediate=16)
    cap = hf_hooks.Capture(model, "q8", deep=True)
    try:
        cap.begin()
        out = cap.step([3, 5], 0, DynamicCache(config=model.config))
        kept = {f for f, _ in cap.bufs}
    finally:
        cap.remove()
    assert kept == set(hf_hooks.CAPTURED)
    for col in out.raw:
        for key, a in col.items():
            assert (a.dtype, a.shape) == _expect(cfg, "q8", key), key
    assert [list(c) for c in out.raw] == [token_keys(t, 2, deep=True) for t in (0, 1)]
