"""Checkpoints as they come: every config corner transformers' qwen3 / qwen3_moe honour
for decoding, and sharded safetensors, each against HF transformers as the oracle.

Each corner is a tiny random model built by transformers itself (Qwen3Config / Qwen3MoeConfig), saved with
save_pretrained, loaded by model/hf.py with f32 weights and run by the reference (f32 KV). The oracle is HF's
own from_pretrained of the very same directory, so HF's reading of the config.json (absent fields, the old
and the new rope style) is what ours is compared with. Metric, as in test_hf_oracle.py: per position
max|ours - hf| / max|hf| over the vocabulary, <= 1e-4 at every position (teacher-forced, 12 positions: one
4-token prefill step, then single decode steps), and the same greedy tokens over 6 steps.
Plus the bad input of item 3: sharded checkpoints that do not add up and config values we cannot honour,
each one ModelError line naming the file and the field or tensor (exit 2 from the CLI).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

from kestrel_tui.backends.base import NumpyBackend  # noqa: E402
from kestrel_tui.cli import main  # noqa: E402
from kestrel_tui.engines.build import make_backend  # noqa: E402
from kestrel_tui.engines.builtin import run_decode  # noqa: E402
from kestrel_tui.errors import UsageError  # noqa: E402
from kestrel_tui.model.config import ModelError, load_config  # noqa: E402
from kestrel_tui.model.hf import INDEX, load_hf_model  # noqa: E402
from kestrel_tui.trace.keys import FIELDS  # noqa: E402

REL_TOL = 1e-4
VOCAB = 256
N_TOK, PROMPT, GREEDY = 12, 4, 6

MOE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
           norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128,
           tie_word_embeddings=False)
DENSE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=64, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128,
             tie_word_embeddings=False)
MEASURED: dict[str, float] = {}


def _build(kind: str, seed: int, drop: tuple[str, ...] = (), **over):
    """A random HF model built by transformers, weights large enough that logits and routing are far from flat."""
    base = {k: v for k, v in (MOE if kind == "moe" else DENSE).items() if k not in drop}
    config_cls = transformers.Qwen3MoeConfig if kind == "moe" else transformers.Qwen3Config
    cls = transformers.Qwen3MoeForCausalLM if kind == "moe" else transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config_cls(**{**base, **over}, attn_implementation="eager")).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # norm weights
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
    return model


def _save(model, path: Path, **kw) -> Path:
    model.save_pretrained(path, **kw)
    return path


def _edit_config(path: Path, fn) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


def _hf(path: Path):
    """HF's own reading of the directory (f32, eager attention): the oracle."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per position max|a-b| / max|b|."""
    return np.abs(ours.astype(np.float64) - ref).max(axis=-1) / np.abs(ref).max(axis=-1)


def _check(name: str, path: Path, hf=None):
    """Ours (f32 weights, f32 KV) against HF on the same directory: teacher-forced logits and greedy tokens.
    Returns our model."""
    hf = _hf(path) if hf is None else hf
    model = load_hf_model(path, "f32")
    tokens = np.random.default_rng(7).integers(0, VOCAB, N_TOK).tolist()
    trace = run_decode(NumpyBackend(model, kv="f32"), tokens[:PROMPT], N_TOK - PROMPT, forced=tokens[PROMPT:])
    assert [p.token for p in trace.positions] == tokens
    ours = np.stack([p.logits for p in trace.positions])
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].numpy()
    err = _rel_err(ours, ref)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    prompt = tokens[:PROMPT]
    greedy = run_decode(NumpyBackend(model, kv="f32"), prompt, GREEDY).generated[:GREEDY]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY):
            ids.append(int(torch.argmax(hf(torch.tensor([ids])).logits[0, -1])))
    MEASURED[name] = float(err.max())
    print(f"\n{name}: teacher-forced max rel err {err.max():.2e}; greedy {greedy}")
    assert err.max() <= REL_TOL, (name, err)
    assert greedy == ids[PROMPT:], (greedy, ids[PROMPT:])
    assert len(set(greedy)) > 1, "degenerate model: greedy repeats one token, the test would be too weak"
    return model


# ---------------------------------------------------------------- sharded checkpoints

@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = _save(_build("moe", 21), tmp_path_factory.mktemp("corners") / "sharded", max_shard_size="40KB")
    return path


def test_sharded_with_index(sharded):
    index = json.loads((sharded / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and sorted(p.name for p in sharded.glob("*.safetensors")) == shards
    _check("shards+index", sharded)


def test_sharded_bf16(tmp_path):
    """bf16 is read from the raw bytes at each shard's own header offsets."""
    hf = _build("moe", 35).to(torch.bfloat16)
    path = _save(hf, tmp_path / "bf16", max_shard_size="20KB")
    assert len(set(json.loads((path / INDEX).read_text())["weight_map"].values())) >= 3
    ours = load_hf_model(path, "f32")
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    for i, L in enumerate(ours.layers):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(L.o_proj.w, sd[p + "self_attn.o_proj.weight"])
        np.testing.assert_array_equal(L.down_proj.w, sd[p + "mlp.experts.down_proj"])
    np.testing.assert_array_equal(ours.lm_head.w, sd["lm_head.weight"])


def test_index_is_the_authority(sharded, tmp_path):
    """A stray *.safetensors beside the index (say an old consolidated file) is not read."""
    d = shutil.copytree(sharded, tmp_path / "m")
    first = next(iter(json.loads((d / INDEX).read_text())["weight_map"].values()))
    shutil.copy(d / first, d / "stale-copy.safetensors")  # would be "present in both" without the index
    a, b = load_hf_model(sharded, "f32"), load_hf_model(d, "f32")
    np.testing.assert_array_equal(a.layers[1].q_proj.w, b.layers[1].q_proj.w)


# ---------------------------------------------------------------- config corners

def test_mlp_only_layers(tmp_path):
    path = _save(_build("moe", 22, num_hidden_layers=3, mlp_only_layers=[1]), tmp_path / "m")
    assert json.loads((path / "config.json").read_text())["mlp_only_layers"] == [1]
    model = _check("mlp_only_layers=[1]", path)
    assert [L.gate is None for L in model.layers] == [False, True, False]
    assert model.layers[1].gate_proj.w.shape == (64, 64)  # intermediate_size, not moe_intermediate_size
    # q4_0 builds and decodes too (no oracle: the 4-bit weights move the logits)
    q = load_hf_model(path, "q4_0")
    assert q.layers[1].gate is None and q.layers[1].gate_proj.fmt == "q4_0"
    run_decode(NumpyBackend(q, kv="q8"), [1, 2, 3], 2)


def test_decoder_sparse_step_2(tmp_path):
    path = _save(_build("moe", 23, num_hidden_layers=4, decoder_sparse_step=2), tmp_path / "m")
    model = _check("decoder_sparse_step=2", path)
    # transformers: sparse iff (i + 1) % step == 0
    assert [L.gate is not None for L in model.layers] == [False, True, False, True]
    assert model.cfg.dense_layers == (0, 2)


def test_dense_layer_keys(tmp_path):
    """11 keys a layer whatever its MLP; --deep: a dense layer's router/topk/topw are empty buffers and its
    moe key is the MLP output (x = ores + moe), as decided in docs/decisions.md."""
    path = _save(_build("moe", 24, num_hidden_layers=3, mlp_only_layers=[0]), tmp_path / "m")
    model = load_hf_model(path, "f32")
    trace = run_decode(NumpyBackend(model, kv="f32"), [5, 6], 1)
    assert len(trace.positions[0].hashes) == 11 * 3 + 2
    deep = run_decode(NumpyBackend(model, kv="f32", deep=True), [5, 6], 1)
    raw = deep.positions[1].raw
    assert len(raw) == len(deep.positions[1].hashes) == 17 * 3 + 2
    assert raw["t1_l0_router"].shape == (0,) and raw["t1_l0_topk"].dtype == np.int32 and raw["t1_l0_topw"].size == 0
    assert raw["t1_l1_router"].shape == (4,) and raw["t1_l1_topk"].shape == (2,)
    for l in range(3):
        np.testing.assert_array_equal(raw[f"t1_l{l}_x"], raw[f"t1_l{l}_ores"] + raw[f"t1_l{l}_moe"])
    # the default keys are those of the run without --deep
    assert {k: h for k, h in deep.positions[1].hashes.items() if k.split("_")[-1] in FIELDS + ("emb", "logits")} \
        == trace.positions[1].hashes


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_head_dim_absent(tmp_path, kind):
    """Qwen3MoeConfig has no head_dim (hidden // heads = 16 here); Qwen3Config's default is 128 whatever the
    other dims. The config.json is written without head_dim and read back by HF as the oracle."""
    model = _build(kind, 25, drop=("head_dim",), num_attention_heads=2, num_key_value_heads=1)
    path = _save(model, tmp_path / "m")
    cfg = _edit_config(path, lambda c: c.pop("head_dim", None))
    assert "head_dim" not in cfg
    ours = _check(f"head_dim absent ({kind})", path)
    assert ours.cfg.head_dim == {"moe": 32, "dense": 128}[kind]
    assert ours.layers[0].q_proj.w.shape == (2 * ours.cfg.head_dim, 64)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_attention_bias(tmp_path, kind):
    path = _save(_build(kind, {"moe": 26, "dense": 41}[kind], attention_bias=True), tmp_path / "m")
    ours = _check(f"attention_bias ({kind})", path)
    L = ours.layers[1]
    assert L.q_bias.shape == (64,) and L.k_bias.shape == (32,) and L.v_bias.shape == (32,) and L.o_bias.shape == (64,)
    assert np.abs(L.o_bias).max() > 0.05
    q = load_hf_model(path, "q4_0")  # biases stay f32 next to q4_0 matrices
    np.testing.assert_array_equal(q.layers[1].k_bias, L.k_bias)


@pytest.mark.parametrize("tied", [True, False])
def test_tie_word_embeddings(tmp_path, tied):
    path = _save(_build("moe", 27 + tied, tie_word_embeddings=tied), tmp_path / "m")
    ours = _check(f"tie_word_embeddings={str(tied).lower()}", path)
    assert ours.cfg.tie_embeddings == tied and (ours.lm_head is ours.embed_tokens) == tied


def _to_v4_style(c: dict) -> None:
    """transformers 4.x's spelling of the same model: top-level rope_theta, rope_scaling, torch_dtype."""
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    c["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    c["torch_dtype"] = c.pop("dtype")


@pytest.mark.parametrize("style", ["rope_parameters/dtype", "rope_theta/torch_dtype"])
def test_config_styles(tmp_path, style):
    path = _save(_build("dense", 29, rope_theta=5e5), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_parameters"] == {"rope_theta": 5e5, "rope_type": "default"} and cfg["dtype"] == "float32"
    if style == "rope_theta/torch_dtype":
        cfg = _edit_config(path, _to_v4_style)
        assert "rope_parameters" not in cfg and "dtype" not in cfg and cfg["rope_scaling"] is None
    ours = _check(f"config style {style}", path)
    assert ours.cfg.rope_theta == 5e5 and ours.cfg.yarn is None


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("variant", ["rope_parameters", "rope_scaling+mscale"])
def test_yarn(tmp_path, variant):
    """yarn (max_position_embeddings 128 over an original 32): inv_freq and attention_factor as HF's
    _compute_yarn_parameters; positions up to 12 with head_dim 16 turn the interpolated dims enough to
    move the logits (checked against default RoPE below)."""
    rope = dict(YARN)
    if variant == "rope_scaling+mscale":  # 4.x style, the attention factor from mscale / mscale_all_dim
        rope.update(factor=8.0, mscale=1.0, mscale_all_dim=0.5, beta_fast=16, truncate=False)
    hf = _build("moe", 30, rope_parameters=rope)
    path = _save(hf, tmp_path / "m")
    if variant == "rope_scaling+mscale":
        cfg = _edit_config(path, _to_v4_style)
        assert cfg["rope_scaling"]["type"] == "yarn"
    hf = _hf(path)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    ours = _check(f"yarn ({variant})", path, hf)
    rot = hf.model.rotary_emb
    assert ours.cfg.yarn.attention_factor == rot.attention_scaling != 1.0
    # ours: f64 rounded once; HF: the same formula in f32
    np.testing.assert_allclose(ours.inv_freq, rot.inv_freq.numpy(), rtol=1e-6)
    plain = _edit_config(shutil.copytree(path, tmp_path / "plain"),
                         lambda c: c.update(rope_scaling=None, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e4}))
    assert plain["rope_parameters"]["rope_type"] == "default"
    a = run_decode(NumpyBackend(ours, kv="f32"), [3, 1, 4, 1, 5, 9, 2, 6], 0).positions[-1].logits
    b = run_decode(NumpyBackend(load_hf_model(tmp_path / "plain", "f32"), kv="f32"), [3, 1, 4, 1, 5, 9, 2, 6],
                   0).positions[-1].logits
    assert _rel_err(a[None], b[None])[0] > 1e-2  # yarn really changes the model


def test_export_round_trips_corners(tmp_path):
    """hf_export.to_hf_model of a model with every corner at once (dense layers inside MoE, biases, yarn,
    tied) gives HF's logits back."""
    from kestrel_tui.model.hf_export import to_hf_model

    path = _save(_build("moe", 31, num_hidden_layers=3, mlp_only_layers=[2], attention_bias=True,
                        tie_word_embeddings=True, rope_parameters=dict(YARN)), tmp_path / "m")
    hf = _hf(path)
    ours = load_hf_model(path, "f32")
    tokens = [7, 3, 9, 200, 17, 5]
    with torch.no_grad():
        a = to_hf_model(ours)(torch.tensor([tokens])).logits[0].numpy()
        b = hf(torch.tensor([tokens])).logits[0].numpy()
    assert _rel_err(a, b).max() <= 1e-6


# ---------------------------------------------------------------- bad input: one line, naming file and field

def _one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.strip() == msg and msg, repr(msg)
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def _shard_of(path: Path, name: str) -> Path:
    return path / json.loads((path / INDEX).read_text())["weight_map"][name]


def _rewrite_shard(path: Path, name: str, fn) -> Path:
    shard = _shard_of(path, name)
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


def test_shard_missing_from_index(sharded, tmp_path):
    d = shutil.copytree(sharded, tmp_path / "m")
    shard = _shard_of(d, "model.layers.1.self_attn.o_proj.weight")
    shard.unlink()
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, shard.name, INDEX, "missing")


def test_tensor_in_index_missing_from_its_shard(sharded, tmp_path):
    d = shutil.copytree(sharded, tmp_path / "m")
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    shard = _rewrite_shard(d, name, lambda t: t.pop(name))
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, name, INDEX, shard.name)


def test_tensor_missing_from_index_and_shards(sharded, tmp_path):
    d = shutil.copytree(sharded, tmp_path / "m")
    name = "model.layers.1.post_attention_layernorm.weight"
    _rewrite_shard(d, name, lambda t: t.pop(name))
    index = json.loads((d / INDEX).read_text())
    del index["weight_map"][name]
    (d / INDEX).write_text(json.dumps(index))
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, name, "missing", INDEX)


def test_tensor_misshapen_in_one_shard(sharded, tmp_path):
    d = shutil.copytree(sharded, tmp_path / "m")
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = _rewrite_shard(d, name, lambda t: t.__setitem__(name, np.zeros((48, 64), np.float32)))
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, name, shard.name, "[32, 64]", "[48, 64]")


def test_bad_index(sharded, tmp_path):
    d = shutil.copytree(sharded, tmp_path / "m")
    (d / INDEX).write_text('{"metadata": {}}')
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, INDEX, "weight_map")


def test_missing_bias(tmp_path):
    path = _save(_build("dense", 32, attention_bias=True), tmp_path / "m")
    name = "model.layers.0.self_attn.v_proj.bias"
    f = next(path.glob("*.safetensors"))
    t = load_file(str(f))
    del t[name]
    save_file(t, str(f))
    with pytest.raises(ModelError) as e:
        load_hf_model(path, "f32")
    _one_line(e, name, "attention_bias")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return _save(_build("moe", 33), tmp_path_factory.mktemp("corners") / "small")


BAD_CONFIGS = [
    ("rope dynamic", lambda c: c.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}),
     ("rope_parameters.rope_type", "'dynamic'", "not supported")),
    ("rope longrope 4.x", lambda c: c.update(rope_scaling={"type": "longrope", "short_factor": [1.0]}),
     ("rope_scaling.rope_type", "'longrope'", "not supported")),
    ("rope linear", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}),
     ("rope_scaling.rope_type", "'linear'")),
    ("yarn without factor", lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}),
     ("rope_parameters.factor", "missing")),
    ("yarn bad factor", lambda c: c.update(rope_parameters={**YARN, "factor": "big"}),
     ("rope_parameters.factor", "invalid")),
    ("partial rotary", lambda c: c.update(partial_rotary_factor=0.5), ("partial_rotary_factor",)),
    ("sliding window", lambda c: c.update(use_sliding_window=True), ("use_sliding_window",)),
    ("sparse step 0", lambda c: c.update(decoder_sparse_step=0), ("decoder_sparse_step",)),
    ("mlp_only_layers", lambda c: c.update(mlp_only_layers="1,2"), ("mlp_only_layers",)),
    ("attention_bias", lambda c: c.update(attention_bias="yes"), ("attention_bias",)),
    ("dense layer without intermediate_size", lambda c: (c.update(mlp_only_layers=[0]), c.pop("intermediate_size")),
     ("intermediate_size", "missing")),
    ("dtype", lambda c: c.update(dtype="float8_e4m3fn"), ("dtype", "float8_e4m3fn")),
    ("quantized", lambda c: c.update(quantization_config={"quant_method": "fp8"}), ("quantization_config", "fp8")),
    ("nested rope", lambda c: c.update(rope_parameters={"full_attention": {"rope_type": "default"}}),
     ("rope_parameters", "per layer type")),
]


@pytest.mark.parametrize("what, edit, needles", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_config_values_we_cannot_honour(small, tmp_path, what, edit, needles):
    d = shutil.copytree(small, tmp_path / "m")
    _edit_config(d, edit)
    with pytest.raises(ModelError) as e:
        load_config(d, "f32")
    _one_line(e, "config.json", *needles)


@pytest.mark.parametrize("case", ["shard", "rope"])
def test_cli_exit_2_one_line(sharded, tmp_path, capsys, case):
    d = shutil.copytree(sharded, tmp_path / "m")
    if case == "shard":
        needle = _shard_of(d, "lm_head.weight").name
        (d / needle).unlink()
    else:
        needle = "'longrope'"
        _edit_config(d, lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6}))
    code = main(["generate", "--model", str(d), "--prompt-ids", "1,2,3", "--tokens", "2", "--weights", "f32"])
    out, err = capsys.readouterr()
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0] and "generate" in lines[0]


def test_cuda_subject_refuses_what_it_cannot_run(tmp_path):
    """Checked before any device work, so this runs without a GPU."""
    for over, needle in (({"attention_bias": True}, "attention_bias"), ({"rope_parameters": dict(YARN)}, "yarn")):
        path = _save(_build("moe", 34, **over), tmp_path / needle.replace(" ", "_"))
        with pytest.raises(UsageError) as e:
            make_backend("cuda", load_hf_model(path, "f32"), kv="f32")
        _one_line(e, "cuda subject", needle, "--subject sim")


@pytest.mark.parametrize("over", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
def test_cuda_subject_takes_dense_layers_inside_moe(tmp_path, over):
    """A qwen3_moe checkpoint with dense MLP layers passes the cuda subject's check (the kernels run
    them: tests/test_cuda_fake_driver.py checks the launches, tests/test_cuda.py the bits)."""
    from kestrel_tui.engines.decoders import check_decoder

    model = load_hf_model(_save(_build("moe", 34, num_hidden_layers=2, **over), tmp_path / "m"), "f32")
    assert model.cfg.is_mixed
    check_decoder("cuda", model)


def test_report(request):
    """Prints what the corners measured (run with -s)."""
    if MEASURED:
        print("\nmax rel err per corner: " + ", ".join(f"{k} {v:.1e}" for k, v in MEASURED.items()))
