"""HF transformers as the oracle: tiny random Qwen3-MoE / Qwen3 checkpoints saved with save_pretrained,
loaded by model/hf.py and run by the reference decoder (f32 weights, f32 KV) must reproduce HF's logits
(max|a-b| / max|b| <= 1e-4 at every position) and its greedy tokens. Plus the loader's error paths."""
from __future__ import annotations

import copy
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
from kestrel_tui.engines.builtin import run_decode  # noqa: E402
from kestrel_tui.model.config import ModelError  # noqa: E402
from kestrel_tui.model.hf import load_hf_model, load_model  # noqa: E402
from kestrel_tui.model.quant import dequantize_q4_0, quantize_q4_0  # noqa: E402

REL_TOL = 1e-4
N_TOK = 16
PROMPT = 4  # the first 4 tokens are one prefill step (M=4), the other 12 single decode steps
VOCAB = 256

MOE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False)
DENSE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=96, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128,
             tie_word_embeddings=False)


def _build(kind: str, seed: int, **over):
    """A random HF model with weights large enough that logits and routing are far from flat."""
    if kind == "moe":
        cfg = transformers.Qwen3MoeConfig(**{**MOE, **over}, attn_implementation="eager")
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.Qwen3Config(**{**DENSE, **over}, attn_implementation="eager")
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm weights
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
    return model


def _save(model, path: Path, dtype=None) -> Path:
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    assert list(path.glob("*.safetensors"))
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (checkpoint dir, HF f32 reference model holding exactly the saved values)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, kind, seed, over, dtype in [
        ("moe", "moe", 1, {}, None),
        ("dense", "dense", 2, {}, None),
        ("dense_tied", "dense", 3, {"tie_word_embeddings": True}, None),
        ("moe_bf16", "moe", 4, {}, torch.bfloat16),
    ]:
        model = _build(kind, seed, **over)
        path = _save(model, root / name, dtype)
        if dtype is not None:
            # HF's own load widened to f32 (exact for bf16): the reference sees the stored values.
            # (Not model.float(): .to(bf16) also rounded the RoPE inv_freq buffer, which HF
            # recomputes in f32 on load.)
            model = type(model).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
            assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        out[name] = (path, model)
    return out


def _hf_logits(hf, tokens):
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]


def _hf_greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(torch.argmax(hf(torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt):]


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per position max|a-b| / max|b|."""
    return np.abs(ours.astype(np.float64) - ref).max(axis=-1) / np.abs(ref).max(axis=-1)


def _layer_report(trace, hidden, n_layers) -> str:
    """Where ours and HF part: per-layer max rel error of the residual stream (HF hidden_states[l+1]
    is layer l's output; the last one has the final norm applied, so it is skipped)."""
    lines = []
    for t, pos in enumerate(trace.positions):
        errs = [_rel_err(pos.raw[f"t{t}_emb"], hidden[0][t])]
        errs += [_rel_err(pos.raw[f"t{t}_l{l}_x"], hidden[l + 1][t]) for l in range(n_layers - 1)]
        lines.append(f"t{t}: " + " ".join(f"{e:.1e}" for e in errs))
    return "per-layer rel err (emb, x of layers 0..L-2):\n" + "\n".join(lines)


def _ours(model, tokens, forced=True):
    backend = NumpyBackend(model, kv="f32")
    if forced:
        return run_decode(backend, tokens[:PROMPT], len(tokens) - PROMPT, forced=tokens[PROMPT:])
    return run_decode(backend, tokens, N_TOK)


MEASURED: dict[str, float] = {}


@pytest.mark.parametrize("name", ["moe", "dense", "dense_tied", "moe_bf16"])
def test_teacher_forced_logits_match_hf(ckpts, name):
    path, hf = ckpts[name]
    model = load_hf_model(path, "f32")
    assert model.cfg.n_layers == 2 and model.cfg.vocab == VOCAB
    assert model.cfg.tie_embeddings == (name == "dense_tied")
    assert (model.lm_head is model.embed_tokens) == (name == "dense_tied")
    tokens = np.random.default_rng(7).integers(0, VOCAB, N_TOK).tolist()
    trace = _ours(model, tokens)
    assert [p.token for p in trace.positions] == tokens
    ours = np.stack([p.logits for p in trace.positions])
    ref, hidden = _hf_logits(hf, tokens)
    err = _rel_err(ours, ref)
    MEASURED[f"{name} forced"] = float(err.max())
    print(f"\n{name}: teacher-forced max rel err {err.max():.3e} (per position {np.array2string(err, precision=1)})")
    assert err.max() <= REL_TOL, _layer_report(trace, hidden, model.cfg.n_layers)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("name", ["moe", "dense", "dense_tied", "moe_bf16"])
def test_greedy_tokens_match_hf(ckpts, name):
    path, hf = ckpts[name]
    model = load_hf_model(path, "f32")
    prompt = np.random.default_rng(11).integers(0, VOCAB, PROMPT).tolist()
    trace = _ours(model, prompt, forced=False)
    ours = trace.generated[:N_TOK]
    ref = _hf_greedy(hf, prompt, N_TOK)
    seq = prompt + ref
    ref_logits, _ = _hf_logits(hf, seq[:len(trace.positions)])
    err = _rel_err(np.stack([p.logits for p in trace.positions]), ref_logits)
    MEASURED[f"{name} greedy"] = float(err.max())
    print(f"\n{name}: greedy {ours} max rel err {err.max():.3e}")
    assert ours == ref
    assert len(set(ours)) > 1, "degenerate model: greedy repeats one token, the test would be too weak"
    assert err.max() <= REL_TOL


def test_routing_is_exercised(ckpts):
    """The MoE checkpoints route different tokens to different experts (else the oracle proves little)."""
    path, _ = ckpts["moe"]
    model = load_hf_model(path, "f32")
    backend = NumpyBackend(model, kv="f32", deep=True)
    tokens = np.random.default_rng(7).integers(0, VOCAB, N_TOK).tolist()
    trace = run_decode(backend, tokens, 0)
    chosen = {tuple(p.raw[f"t{p.t}_l0_topk"].tolist()) for p in trace.positions}
    assert len(chosen) > 3


# ---------------------------------------------------------------- the loader's tensors

def test_loaded_tensors_equal_hf_parameters(ckpts):
    path, hf = ckpts["moe_bf16"]
    model = load_hf_model(path, "f32")
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    E, F = 8, 32
    for i, L in enumerate(model.layers):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(L.q_proj.w, sd[p + "self_attn.q_proj.weight"])
        np.testing.assert_array_equal(L.k_norm, sd[p + "self_attn.k_norm.weight"])
        np.testing.assert_array_equal(L.gate.w, sd[p + "mlp.gate.weight"])
        gu = sd[p + "mlp.experts.gate_up_proj"]  # HF's in-memory fused layout
        assert L.gate_proj.w.shape == (E, F, 64) and L.down_proj.w.shape == (E, 64, F)
        np.testing.assert_array_equal(L.gate_proj.w, gu[:, :F])
        np.testing.assert_array_equal(L.up_proj.w, gu[:, F:])
        np.testing.assert_array_equal(L.down_proj.w, sd[p + "mlp.experts.down_proj"])
    np.testing.assert_array_equal(model.embed_tokens.w, sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(model.lm_head.w, sd["lm_head.weight"])
    np.testing.assert_array_equal(model.norm, sd["model.norm.weight"])
    # the bf16 values really are bf16 (low 16 bits zero) and were not all zero
    assert (model.layers[0].q_proj.w.view(np.uint32) & 0xFFFF == 0).all()
    assert np.abs(model.layers[0].q_proj.w).max() > 0.1


def test_fused_expert_layout(ckpts, tmp_path):
    """A checkpoint written from transformers 5's in-memory state_dict (mlp.experts.gate_up_proj
    [E, 2*ffn, hidden], mlp.experts.down_proj [E, hidden, ffn]) loads to the same model."""
    path, hf = ckpts["moe"]
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(path / "config.json", fused / "config.json")
    save_file({k: v.numpy().copy() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(fused / "model.safetensors"))
    for fmt in ("f32", "q4_0"):
        a, b = load_hf_model(path, fmt), load_hf_model(fused, fmt)
        for La, Lb in zip(a.layers, b.layers):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                la, lb = getattr(La, proj), getattr(Lb, proj)
                for attr in ("w", "qs", "d"):
                    if getattr(la, attr) is not None:
                        np.testing.assert_array_equal(getattr(la, attr), getattr(lb, attr))


def test_q4_0_load_and_decode(ckpts):
    """--weights q4_0: every matrix (embedding and expert stacks included) is q4_0 of the checkpoint
    value, experts quantized one by one equal the stack quantized at once; the default q8 KV runs."""
    path, hf = ckpts["moe"]
    model = load_hf_model(path, "q4_0")
    assert model.fmt == "q4_0" and model.embed_tokens.fmt == "q4_0" and model.lm_head.fmt == "q4_0"
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    L0 = model.layers[0]
    assert L0.gate_proj.qs.shape == (8, 2, 32, 32) and L0.down_proj.qs.shape == (8, 1, 64, 32)
    qs, d = quantize_q4_0(sd["model.layers.0.mlp.experts.gate_up_proj"][:, :32])
    np.testing.assert_array_equal(L0.gate_proj.qs, qs)
    np.testing.assert_array_equal(L0.gate_proj.d, d)
    np.testing.assert_array_equal(model.embed_tokens.dense(), dequantize_q4_0(*quantize_q4_0(
        sd["model.embed_tokens.weight"])))
    # HF on the q4_0-dequantized weights: what is left is q8_0 activations and the q8 KV cache
    hfq = copy.deepcopy(hf)
    with torch.no_grad():
        for p in hfq.parameters():
            if p.ndim >= 2:
                p.copy_(torch.from_numpy(dequantize_q4_0(*quantize_q4_0(p.numpy()))))
    tokens = np.random.default_rng(7).integers(0, VOCAB, N_TOK).tolist()
    trace = run_decode(NumpyBackend(model, kv="q8"), tokens[:PROMPT], N_TOK - PROMPT, forced=tokens[PROMPT:])
    ours = np.stack([p.logits for p in trace.positions])
    # measured: cos >= 0.998 vs the dequantized weights, ~0.81 vs the original ones (4-bit weights
    # of a random 2-layer model move its logits a lot)
    for ref_model, what, min_cos in ((hfq, "q4_0-dequantized", 0.99), (hf, "original", 0.5)):
        ref, _ = _hf_logits(ref_model, tokens)
        cos = (ours * ref).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(ref, axis=-1)
        print(f"\nq4_0/q8 vs HF {what}: min cos {cos.min():.4f}, max rel err {_rel_err(ours, ref).max():.3e}")
        assert cos.min() > min_cos, (what, cos)


def test_f16_checkpoint(tmp_path):
    hf = _build("dense", 5)
    path = _save(hf, tmp_path / "f16", torch.float16)
    model = load_hf_model(path, "f32")
    with torch.no_grad():
        np.testing.assert_array_equal(model.layers[1].down_proj.w, hf.model.layers[1].mlp.down_proj.weight.float().numpy())
        np.testing.assert_array_equal(model.embed_tokens.w, hf.model.embed_tokens.weight.float().numpy())


def test_hidden_48_loads_f32_but_not_q4_0(tmp_path):
    hf = _build("dense", 6, hidden_size=48, head_dim=16, intermediate_size=40)
    path = _save(hf, tmp_path / "h48")
    model = load_hf_model(path, "f32")  # f32 GEMVs need no blocking
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    trace = _ours(model, tokens)
    ref, _ = _hf_logits(hf.float(), tokens)
    assert _rel_err(np.stack([p.logits for p in trace.positions]), ref).max() <= REL_TOL
    with pytest.raises(ModelError) as e:
        load_hf_model(path, "q4_0")
    _one_line(e, "hidden_size", "48", "multiple of 32", "--weights f32")


def test_tokenizer_loaded_when_present(ckpts, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path, _ = ckpts["dense"]
    assert load_hf_model(path, "f32").tokenizer is None
    d = _copy(path, tmp_path / "tok")
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    model = load_hf_model(d, "f32")
    assert model.tokenizer.encode("w3 w17 zz").ids == [3, 17, VOCAB - 1]
    (d / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, "tokenizer.json")


def test_load_model_spec(ckpts):
    path, _ = ckpts["dense"]
    m = load_model(str(path), "f32")
    assert m.cfg.arch == "qwen3" and m.fmt == "f32" and m.name == "dense"
    m = load_model(None, "q4_0", n_layers=2)
    assert m.cfg.n_layers == 2 and m.cfg.hidden == 256 and m.fmt == "q4_0"
    assert load_model("default", "f32", n_layers=1).fmt == "f32"
    with pytest.raises(ModelError) as e:
        load_model("/nonexistent/model", "f32")
    _one_line(e, "/nonexistent/model", "directory")
    with pytest.raises(ModelError) as e:
        load_model(str(path), "q8_0")
    _one_line(e, "q8_0")


# ---------------------------------------------------------------- bad input: one-line ModelErrors

def _one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.strip() == msg and msg, repr(msg)
    for n in needles:
        assert n in msg, (n, msg)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(path: Path, fn) -> None:
    f = next(path.glob("*.safetensors"))
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f))


def test_missing_config(ckpts, tmp_path):
    d = _copy(ckpts["moe"][0], tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, "config.json", "missing")


def test_invalid_json(ckpts, tmp_path):
    d = _copy(ckpts["moe"][0], tmp_path / "m")
    (d / "config.json").write_text('{"model_type": "qwen3_moe",\n  "hidden_size": 64,,}')
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, "config.json", "JSON")


def test_unsupported_architecture(ckpts, tmp_path):
    d = _copy(ckpts["moe"][0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, "unsupported architecture", "llama")


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelError) as e:
        load_hf_model(tmp_path / "nope", "f32")
    _one_line(e, "nope")


def test_no_safetensors(ckpts, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(ckpts["moe"][0] / "config.json", d / "config.json")
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, "no *.safetensors")


def test_wrong_shape(ckpts, tmp_path):
    d = _copy(ckpts["moe"][0], tmp_path / "m")
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(d, lambda t: t.__setitem__(name, np.zeros((96, 64), np.float32)))
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, name, "expected [64, 64]", "[96, 64]")


def test_wrong_expert_shape(ckpts, tmp_path):
    d = _copy(ckpts["moe"][0], tmp_path / "m")
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    _rewrite(d, lambda t: t.__setitem__(name, t[name].T.copy()))
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "q4_0")
    _one_line(e, name, "expected [64, 32]", "[32, 64]")


def test_missing_tensor(ckpts, tmp_path):
    d = _copy(ckpts["moe"][0], tmp_path / "m")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(d, lambda t: t.pop(name))
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, name, "missing")


def test_missing_lm_head_untied(ckpts, tmp_path):
    d = _copy(ckpts["dense"][0], tmp_path / "m")
    _rewrite(d, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, "lm_head.weight", "tie_word_embeddings")


def test_unsupported_dtype(ckpts, tmp_path):
    d = _copy(ckpts["dense"][0], tmp_path / "m")
    name = "model.layers.0.self_attn.q_norm.weight"
    _rewrite(d, lambda t: t.__setitem__(name, t[name].astype(np.float64)))
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, name, "F64", "not supported")


def test_nonfinite_weights(ckpts, tmp_path):
    d = _copy(ckpts["dense"][0], tmp_path / "m")
    name = "model.layers.1.mlp.up_proj.weight"

    def poison(t):
        t[name][3, 5] = np.nan
    _rewrite(d, poison)
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, name, "NaN")


def test_corrupt_safetensors(ckpts, tmp_path):
    d = _copy(ckpts["dense"][0], tmp_path / "m")
    next(d.glob("*.safetensors")).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ModelError) as e:
        load_hf_model(d, "f32")
    _one_line(e, "safetensors")
