"""The hf engine on transformers' own Qwen3 / Qwen3-MoE code: every key at every position, the same
values as the reference on identical f32 weights, planted bugs found at the right key (chained and
isolated), the reference's prefill, and the options' one-line errors. Tiny checkpoints made here."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kestrel_tui.backends.ops_exact import kvquant  # noqa: E402
from kestrel_tui.trace.run import Cancelled  # noqa: E402
from kestrel_tui.engines.base import EngineSpec, RunRequest, Toggle  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.errors import UsageError  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.trace.compare import Tolerance, key_metrics  # noqa: E402
from kestrel_tui.trace.keys import order_key, parse_key, token_keys  # noqa: E402
from hfmodels import cache_arg  # noqa: E402

VOCAB, PROMPT, N = 256, [5, 77, 190, 33], 4


def _build(kind: str, seed: int):
    from hfmodels import tiny

    return tiny(kind, seed)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """kind -> (checkpoint dir, our f32 Model of it)."""
    root = tmp_path_factory.mktemp("hf_engine")
    out = {}
    for kind, seed in (("moe", 1), ("dense", 2)):
        path = root / kind
        _build(kind, seed).save_pretrained(path)
        out[kind] = (str(path), load_model(str(path), "f32"))
    return out


@pytest.fixture(scope="module")
def refs(ckpt):
    """(kind, kv, deep) -> the reference trace (cpu engine, the same f32 weights)."""
    cache = {}

    def get(kind, kv="f32", deep=True):
        if (kind, kv, deep) not in cache:
            cache[kind, kv, deep] = make_engine("cpu", ckpt[kind][1], kv=kv, deep=deep).run(RunRequest(PROMPT, N, {}))
        return cache[kind, kv, deep]
    return get


def _hf(ckpt, kind, kv="f32", deep=True, **options):
    return make_engine(EngineSpec("hf", ckpt[kind][0], options), ckpt[kind][1], kv=kv, deep=deep)


def _defaults(eng, **over):
    return {**{t.name: t.default for t in eng.toggles}, **over}


def _run(eng, ref, values=None, **kw):
    forced = [p.token for p in ref.positions[len(PROMPT):]]
    return eng.run(RunRequest(PROMPT, N, values or _defaults(eng), forced=forced, **kw))


def _far(ref, sub) -> list[str]:
    """Keys whose hashes differ and whose raw buffers are beyond the default tolerance, in dataflow order."""
    rh, sh = ref.hashes(), sub.hashes()
    assert list(rh) == list(sh)
    return sorted((k for k in rh if rh[k] != sh[k] and not Tolerance().holds(key_metrics(ref.raw(k), sub.raw(k)))),
                  key=order_key)


def _fields(keys) -> set[tuple[str, int | None]]:
    return {(parse_key(k).field, parse_key(k).layer) for k in keys}


# ---------------------------------------------------------------- keys and values

@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("deep", [False, True])
def test_every_key_at_every_position(ckpt, refs, kind, deep):
    eng = _hf(ckpt, kind, deep=deep)
    ref = refs(kind, deep=deep)
    sub = _run(eng, ref)
    assert len(sub.positions) == len(PROMPT) + N
    for p in sub.positions:
        assert list(p.hashes) == token_keys(p.t, 2, deep)
        assert all(eng.produces(k) for k in p.hashes)
        for k in p.hashes:  # the reference's dtype and layout, so hashes and uint32 views compare
            a, b = ref.raw(k), p.raw[k]
            assert (a.dtype, a.shape) == (b.dtype, b.shape), k
        assert p.logits.dtype == np.float32 and p.logits.shape == (VOCAB,)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_matches_the_reference(ckpt, refs, kind):
    """f32 eager HF vs our reference on the same weights: no far key, the same tokens, forced and free."""
    eng, ref = _hf(ckpt, kind), refs(kind)
    for over in ({}, {"attn_implementation": "sdpa"}, {"prefill": "token"}):
        sub = _run(eng, ref, _defaults(eng, **over))
        assert _far(ref, sub) == [], over
        assert sub.generated == ref.generated
    free = eng.run(RunRequest(PROMPT, N, _defaults(eng)))
    assert free.generated == ref.generated and len(set(ref.generated)) > 1
    assert _far(ref, free) == []


def test_hooks_leave_the_computation_alone(ckpt):
    """The engine's logits are bit-equal to transformers' own decode of the same tokens, no hooks."""
    path = ckpt["moe"][0]
    eng = _hf(ckpt, "moe")
    sub = eng.run(RunRequest(PROMPT, N, _defaults(eng)))
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    cache = transformers.DynamicCache(config=plain.config)
    tokens = [p.token for p in sub.positions]
    with torch.inference_mode():
        rows = [plain(input_ids=torch.tensor([PROMPT]), **cache_arg(plain, cache), use_cache=True).logits[0]]
        rows += [plain(input_ids=torch.tensor([[t]]), **cache_arg(plain, cache), use_cache=True).logits[0] for t in tokens[4:]]
    np.testing.assert_array_equal(torch.cat(rows).numpy(), np.stack([p.logits for p in sub.positions]))


def test_q8_keys_are_our_quantizer_of_hf_rows(ckpt, refs):
    eng = _hf(ckpt, "moe", kv="q8")
    assert not eng.caps.prefill_from and "f32" in eng.prefill_problem(make_engine("cpu", ckpt["moe"][1]))
    sub = _run(eng, refs("moe", "q8"))
    for p in sub.positions:
        for li in range(2):
            key = lambda f: p.raw[f"t{p.t}_l{li}_{f}"]  # noqa: E731
            k, ks = kvquant(key("kpre"))
            assert key("k").dtype == np.int8 and key("ks").dtype == np.float32
            np.testing.assert_array_equal(key("k"), k)
            np.testing.assert_array_equal(key("ks"), ks)


def test_bf16_buffers_are_f32_and_models_are_cached(ckpt, refs):
    eng = _hf(ckpt, "dense")
    m32 = eng.torch_model(_defaults(eng))
    assert eng.torch_model(_defaults(eng, prefill="token")) is m32  # same dtype/attention/device: no reload
    sub = _run(eng, refs("dense"), _defaults(eng, dtype="bfloat16"))
    assert next(eng.torch_model(_defaults(eng, dtype="bfloat16")).parameters()).dtype == torch.bfloat16
    raw = sub.positions[-1].raw
    assert all(a.dtype == np.float32 for k, a in raw.items() if not k.endswith("topk"))
    assert eng.torch_model(_defaults(eng)) is not m32  # the dtype change dropped it


# ---------------------------------------------------------------- planted bugs

def _rope_theta(m, li):
    rot = m.model.rotary_emb
    d = rot.inv_freq.numel() * 2
    rot.inv_freq.copy_(1.0 / (1e4 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)))


def _v_proj(m, li):
    m.model.layers[li].self_attn.v_proj.weight[3] += 0.5


def _eps(m, li):
    m.model.layers[li].input_layernorm.variance_epsilon = 0.1


def _swap_experts(m, li, ref=None):
    topk = ref.positions[0].raw["t0_l1_topk"]
    a, b = int(topk[0]), next(e for e in range(8) if e not in topk)  # t0 uses a and not b: t0 must change
    ex = m.model.layers[li].mlp.experts
    for w in (ex.gate_up_proj, ex.down_proj):
        w[[a, b]] = w[[b, a]].clone()


BUGS = {  # name -> (kind, plant, layer, first far with deep keys, first far with the default keys)
    "rope_theta": ("dense", _rope_theta, 0, "t1_l0_kpre", "t1_l0_k"),  # position 0 has no rotation
    "v_proj": ("moe", _v_proj, 1, "t0_l1_v", "t0_l1_v"),
    "eps": ("dense", _eps, 1, "t0_l1_nrm", "t0_l1_nrm"),
    "swap_experts": ("moe", _swap_experts, 1, "t0_l1_moe", "t0_l1_x"),
}


def _plant(eng, name, ref):
    kind, plant, li, *_ = BUGS[name]
    with torch.no_grad():
        if name == "swap_experts":
            plant(eng.torch_model(_defaults(eng)), li, ref)
        else:
            plant(eng.torch_model(_defaults(eng)), li)


@pytest.mark.parametrize("deep", [True, False])
@pytest.mark.parametrize("name", list(BUGS))
def test_planted_bug_first_far(ckpt, refs, name, deep):
    kind, _, _, first_deep, first = BUGS[name]
    ref = refs(kind, deep=deep)
    eng = _hf(ckpt, kind, deep=deep)
    _plant(eng, name, refs(kind))
    far = _far(ref, _run(eng, ref))
    assert far and far[0] == (first_deep if deep else first), far[:4]


@pytest.mark.parametrize("name,only", [("v_proj", {"v"}), ("eps", {"nrm"}), ("rope_theta", {"kpre", "k", "qrope"}),
                                       ("swap_experts", {"moe", "x"})])
def test_isolated_bug_stays_in_its_op(ckpt, refs, name, only):
    """Isolated (every op fed the reference's inputs), a bug is far only in the keys of its own op."""
    kind, _, li, *_ = BUGS[name]
    ref = refs(kind)
    eng = _hf(ckpt, kind)
    assert _far(ref, _run(eng, ref, feed_from=ref)) == []  # unperturbed, isolated: nothing far
    _plant(eng, name, ref)
    far = _far(ref, _run(eng, ref, feed_from=ref))
    assert far and {f for f, _ in _fields(far)} == only, far
    assert {layer for _, layer in _fields(far)} == ({0, 1} if name == "rope_theta" else {li})


def test_isolated_q8(ckpt, refs):
    """With a q8 reference, isolation feeds HF's attention the dequantized rows: v_proj's bug is first."""
    ref = refs("moe", "q8")
    eng = _hf(ckpt, "moe", kv="q8")
    _plant(eng, "v_proj", ref)
    far = _far(ref, _run(eng, ref, feed_from=ref))
    assert far[0] == "t0_l1_v"


# ---------------------------------------------------------------- prefill, cancel, flags

def test_prefill_from_the_reference(ckpt, refs):
    ref = refs("moe")
    eng = _hf(ckpt, "moe")
    assert eng.caps.prefill_from and eng.prefill_problem(make_engine("cpu", ckpt["moe"][1], kv="f32")) is None
    sub = _run(eng, ref, prefill_from=ref)
    assert all(s is r for s, r in zip(sub.positions[:4], ref.positions[:4]))
    assert _far(ref, sub) == []
    _plant(eng, "v_proj", ref)  # the prompt's rows came from the reference: the bug shows at the first decode
    far = _far(ref, _run(eng, ref, prefill_from=ref))
    assert far[0] == "t4_l1_v"


def test_cancel_stop_and_torch_flags(ckpt, refs):
    import threading

    eng, ref = _hf(ckpt, "dense"), refs("dense")
    ev = threading.Event()
    ev.set()
    with pytest.raises(Cancelled):
        _run(eng, ref, cancel=ev)
    seen = []
    sub = _run(eng, ref, on_position=seen.append, stop=lambda: len(seen) >= 5)
    assert len(sub.positions) == 5 and seen == sub.positions
    before = torch.are_deterministic_algorithms_enabled()
    _run(eng, ref, _defaults(eng, deterministic="on" if not before else "off"))
    assert torch.are_deterministic_algorithms_enabled() == before


# ---------------------------------------------------------------- options and errors

def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


@pytest.mark.parametrize("options,words", [
    ({"dtpye": "float32"}, ("dtpye", "dtype", "attn_implementation")),
    ({"dtype": "float64"}, ("dtype", "float64", "float32|bfloat16|float16")),
    ({"attn_implementation": "flash"}, ("attn_implementation", "eager|sdpa")),
    ({"prefill": 1}, ("prefill", "batched|token")),
])
def test_bad_options(ckpt, options, words):
    with pytest.raises(UsageError) as e:
        _hf(ckpt, "dense", **options)
    msg = _one_line(e)
    assert all(w in msg for w in words), msg


def test_device_cuda_refused_without_cuda(ckpt):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(UsageError) as e:
        _hf(ckpt, "dense", device="cuda")
    assert "cuda" in _one_line(e)


def test_toggles(ckpt):
    eng = _hf(ckpt, "dense", dtype="bfloat16", attn_implementation="sdpa")
    by = {t.name: t for t in eng.toggles}
    assert by["dtype"].values[0] == "bfloat16" and by["dtype"].exact is None
    assert by["attn_implementation"].values == ("sdpa", "eager") and by["attn_implementation"].exact == "eager"
    assert by["prefill"].exact == "token" and by["tf32"].exact == "off" and by["deterministic"].exact == "on"
    assert ("device" in by) == torch.cuda.is_available()
    assert all(t.key == t.name for t in eng.toggles)
    profile = (Toggle("attention", ("sdpa", "eager"), "eager", key="attn_implementation"),)
    eng = make_engine(EngineSpec("hf", ckpt["dense"][0], {}, profile), ckpt["dense"][1], kv="f32")
    assert eng.toggles == profile
    assert eng.settings({"attention": "sdpa"})["attn_implementation"] == "sdpa"
    for bad in (Toggle("x", ("a", "b"), key="colour"), Toggle("x", ("float32", "float8"), key="dtype")):
        with pytest.raises(UsageError) as e:
            make_engine(EngineSpec("hf", ckpt["dense"][0], {}, (bad,)), ckpt["dense"][1])
        _one_line(e)


def test_model_dirs_transformers_refuses(tmp_path, ckpt):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    for d in (bad, other, tmp_path / "missing"):
        with pytest.raises(UsageError) as e:
            make_engine(EngineSpec("hf", str(d)), ckpt["dense"][1])
        assert "hf engine" in _one_line(e)
