"""GGUF in and out (model/gguf.py): our export read back bit-identical to the model it came from (HF
directories and the embedded default, q4_0 and f32), GGUF files written here the way llama.cpp's
convert_hf_to_gguf.py writes them (gguf.GGUFWriter, the gguf package's own tensor-name map and key
writers; F16 / BF16 / Q8_0 / Q4_0 / F32 tensors) giving the same keys as an HF directory of the same
values, the tokenizer round trip, and bad files -> one line, exit 2."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from kestrel_tui.backends.base import NumpyBackend  # noqa: E402
from kestrel_tui.engines.builtin import run_decode  # noqa: E402
from kestrel_tui.model import gguf as kg  # noqa: E402
from kestrel_tui.model.config import ModelError  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402

from clitools import one_line_error as one_line, run_cli as run  # noqa: E402

PROMPT, N_NEW = [3, 17, 42], 3  # 6 positions: a prefill step of 3 and 3 decode steps

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128)
MOE = dict(COMMON, vocab_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           norm_topk_prob=True, tie_word_embeddings=False)
DENSE = dict(COMMON, vocab_size=256, intermediate_size=96, tie_word_embeddings=True)


def _hf_model(kind: str, seed: int, **over):
    if kind == "moe":
        cfg, cls = transformers.Qwen3MoeConfig(**{**MOE, **over}), transformers.Qwen3MoeForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**{**DENSE, **over}), transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # far from flat logits and routing
        for _, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.ndim == 1 else
                    0.25 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, kind, seed in (("moe", "moe", 1), ("dense", "dense", 2)):
        _hf_model(kind, seed).save_pretrained(root / name)
        out[name] = root / name
    return out


def _hashes(model) -> dict[str, int]:
    trace = run_decode(NumpyBackend(model, kv="q8"), PROMPT, N_NEW, raw=False)
    hashes = trace.hashes()
    assert len(hashes) == len(trace.positions) * (11 * model.cfg.n_layers + 2)
    return hashes


def _logits(model) -> np.ndarray:
    trace = run_decode(NumpyBackend(model, kv="f32"), PROMPT, N_NEW, forced=[5, 6, 7], raw=False)
    return np.stack([p.logits for p in trace.positions])


# ---------------------------------------------------------------- our export, read back

@pytest.mark.parametrize("name", ["moe", "dense"])
@pytest.mark.parametrize("fmt", ["q4_0", "f32"])
def test_hf_dir_and_its_gguf_give_identical_keys(hf_dirs, tmp_path, name, fmt):
    hf = load_model(hf_dirs[name], fmt)
    path = tmp_path / f"{name}.gguf"
    assert kg.write_gguf(hf, path) == []
    back = load_model(path, fmt)
    assert back.cfg == hf.cfg and back.fmt == fmt and back.name == name
    assert back.cfg.tie_embeddings == (name == "dense") and (back.lm_head is back.embed_tokens) == (name == "dense")
    assert _hashes(back) == _hashes(hf)
    # the file holds our q4_0 bytes as they are (what llama.cpp reads), F32 otherwise
    reader = gguf.GGUFReader(path)
    t = {t.name: t for t in reader.tensors}
    q = t["blk.1.attn_q.weight"]
    assert [int(x) for x in q.shape] == [64, 128]  # ne: [in, out]
    if fmt == "q4_0":
        assert q.tensor_type == QT.Q4_0 and np.array_equal(np.asarray(q.data), kg._q4_bytes(hf.layers[1].q_proj))
    else:
        assert q.tensor_type == QT.F32 and np.array_equal(np.asarray(q.data), hf.layers[1].q_proj.w)
    assert t["blk.0.attn_norm.weight"].tensor_type == QT.F32
    if name == "moe":
        assert [int(x) for x in t["blk.0.ffn_down_exps.weight"].shape] == [32, 64, 8]  # [F, hidden, E]


@pytest.mark.parametrize("fmt", ["q4_0", "f32"])
def test_embedded_default_exported_and_read_back(tmp_path, fmt):
    model = load_model(None, fmt, n_layers=2)
    path = tmp_path / "default.gguf"
    assert kg.write_gguf(model, path) == []
    notes: list[str] = []
    back = kg.load_gguf_model(path, fmt, notes=notes)
    assert back.cfg == model.cfg and back.tokenizer is None and notes == []
    assert _hashes(back) == _hashes(model)


def test_names_and_keys_are_llama_cpps(tmp_path):
    """Every key and tensor name we write, checked against the gguf package's own constants
    (what llama.cpp's loader and converter use)."""
    model = load_model(None, "q4_0", n_layers=2)
    path = tmp_path / "m.gguf"
    kg.write_gguf(model, path)
    reader = gguf.GGUFReader(path)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE]
    assert arch == "qwen3moe" and gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3] == "qwen3"
    fields = reader.fields
    K = gguf.Keys
    for key, want in [(K.General.ARCHITECTURE, arch), (K.LLM.BLOCK_COUNT, 2), (K.LLM.EMBEDDING_LENGTH, 256),
                      (K.LLM.CONTEXT_LENGTH, 4096), (K.Attention.HEAD_COUNT, 8), (K.Attention.HEAD_COUNT_KV, 2),
                      (K.Attention.KEY_LENGTH, 64), (K.Attention.VALUE_LENGTH, 64), (K.Rope.FREQ_BASE, 1e6),
                      (K.LLM.EXPERT_COUNT, 16), (K.LLM.EXPERT_USED_COUNT, 4), (K.LLM.EXPERT_FEED_FORWARD_LENGTH, 64),
                      (K.LLM.EXPERT_WEIGHTS_NORM, True), (K.LLM.VOCAB_SIZE, 2048),
                      (K.General.FILE_TYPE, int(gguf.LlamaFileType.MOSTLY_Q4_0)),
                      (K.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION), (K.Tokenizer.MODEL, "gpt2")]:
        key = key.format(arch=arch)
        assert fields[key].contents() == want, key
    assert fields[K.Attention.LAYERNORM_RMS_EPS.format(arch=arch)].contents() == pytest.approx(1e-6, rel=1e-7)
    assert len(fields[K.Tokenizer.LIST].contents()) == 2048
    allowed = set()
    for tensor in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE]:
        for bid in range(2):
            allowed.add(gguf.TENSOR_NAMES[tensor].format(bid=bid) + ".weight")
    names = [t.name for t in reader.tensors]
    assert set(names) <= allowed and len(names) == 3 + 2 * 12
    assert kg.ARCHS == {gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3]: "qwen3",
                        gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE]: "qwen3_moe"}


# ---------------------------------------------------------------- GGUF files as llama.cpp's converter writes them

def _encode(arr: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(what the converter hands GGUFWriter.add_tensor, the f32 values a reader gets back)."""
    arr = np.asarray(arr, np.float32)
    if qtype == QT.F32:
        return arr, arr
    if qtype == QT.F16:
        data = arr.astype(np.float16)
        return data, data.astype(np.float32)
    data = gguf.quants.quantize(arr, qtype)  # BF16, Q8_0, Q4_0: raw bytes
    return data, gguf.quants.dequantize(data, qtype).astype(np.float32)


def _converter_gguf(hf_dir: Path, out: Path, types: dict[str, object], drop: tuple[str, ...] = (),
                    arch: str | None = None, extra=None) -> None:
    """Write `out` from `hf_dir` as convert_hf_to_gguf.py's Qwen3Model / Qwen3MoeModel do (experts of a
    layer stacked [E, out, in] under model.layers.{i}.mlp.experts.{w}.weight, names through the gguf
    package's TensorNameMap, hparams through GGUFWriter's add_* methods), with tensor types chosen
    by GGUF name suffix in `types` (default F32); then rewrite the HF directory's safetensors with
    exactly the values the GGUF holds, so that both describe the same model."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    moe = cfg["model_type"] == "qwen3_moe"
    L = cfg["num_hidden_layers"]
    sd: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    arch_enum = gguf.MODEL_ARCH.QWEN3MOE if moe else gguf.MODEL_ARCH.QWEN3
    arch_name = arch or gguf.MODEL_ARCH_NAMES[arch_enum]
    w = gguf.GGUFWriter(out, arch_name)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg.get("intermediate_size", cfg.get("moe_intermediate_size")))
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if moe:
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])  # transformers 5 writes the latter
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for fn in extra or ():
        fn(w)
    tmap = gguf.get_tensor_name_map(arch_enum, L)
    merged: dict[str, tuple[str, list[str]]] = {}  # merged name -> (kind, per-expert names)
    tensors: list[tuple[str, np.ndarray]] = []
    for name in sorted(sd):
        if ".mlp.experts." in name:
            i, e, kind = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
            key = f"model.layers.{i}.mlp.experts.{kind}.weight"
            merged.setdefault(key, (kind, []))[1].append(name)
            continue
        tensors.append((name, sd[name]))
    for key, (kind, names) in merged.items():
        names.sort(key=lambda n: int(n.split(".")[5]))
        tensors.append((key, np.stack([sd[n] for n in names])))
    for hf_name, arr in tensors:
        gname = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        if gname in drop:
            continue
        qtype = next((t for suffix, t in types.items() if gname == suffix or gname.endswith("." + suffix)), QT.F32)
        data, values = _encode(arr, qtype)
        if qtype in (QT.F32, QT.F16):
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_dtype=qtype)
        if hf_name in merged:
            for e, n in enumerate(merged[hf_name][1]):
                sd[n] = values[e]
        else:
            sd[hf_name] = values.reshape(arr.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for f in hf_dir.glob("*.safetensors"):
        f.unlink()
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, hf_dir / "model.safetensors",
              metadata={"format": "pt"})


DENSE_TYPES = {"token_embd.weight": QT.F16, "attn_q.weight": QT.Q8_0, "attn_k.weight": QT.BF16,
               "attn_output.weight": QT.Q8_0, "ffn_gate.weight": QT.BF16,
               "ffn_up.weight": QT.F16, "ffn_down.weight": QT.Q8_0, "attn_v.weight": QT.Q4_0}
MOE_TYPES = {"token_embd.weight": QT.BF16, "output.weight": QT.Q8_0, "attn_q.weight": QT.F16,
             "attn_k.weight": QT.Q8_0, "attn_v.weight": QT.BF16, "attn_output.weight": QT.Q4_0,
             "ffn_gate_exps.weight": QT.Q8_0, "ffn_up_exps.weight": QT.F16, "ffn_down_exps.weight": QT.BF16,
             "ffn_gate_inp.weight": QT.F16}


@pytest.mark.parametrize("name, types", [("dense", DENSE_TYPES), ("moe", MOE_TYPES)])
def test_converter_style_gguf_matches_the_hf_dir_of_its_values(hf_dirs, tmp_path, name, types):
    hf_dir = tmp_path / name
    shutil.copytree(hf_dirs[name], hf_dir)
    path = tmp_path / f"{name}.gguf"
    _converter_gguf(hf_dir, path, types)
    for fmt in ("f32", "q4_0"):
        ours, hf = load_model(path, fmt), load_model(hf_dir, fmt)
        assert ours.cfg == hf.cfg
        # every GGUF value is exact in f32, so the two loads hold the same weights: the same keys.
        # q4_0: the GGUF's Q4_0 tensors are used as they are, the HF load re-quantizes their exact
        # values, which gives back the same blocks (q4_0 quantization is idempotent).
        assert _hashes(ours) == _hashes(hf), fmt
    # and the logits of f32 weights (f32 KV) agree as well (bit for bit: same weights, same maths)
    a, b = _logits(load_model(path, "f32")), _logits(load_model(hf_dir, "f32"))
    assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()


# ---------------------------------------------------------------- tokenizer

def _qwen2_style_tokenizer(vocab: int):
    """A small byte-level BPE with Qwen2's normalizer, pre-tokenizer, decoder and added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(kg.QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x * 2  # 42\n",
            "Qwen3 and llama.cpp read the same bytes; kestrel-tui hashes them.", "naïve café 数字 1234567"]
    trainer = trainers.BpeTrainer(vocab_size=vocab - 4, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False),
                            AddedToken("<|im_start|>", special=True, normalized=False)])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    assert tok.get_vocab_size() <= vocab - 1  # at least one padding row
    return tok


def test_tokenizer_round_trip(hf_dirs, tmp_path):
    hf_dir = tmp_path / "tok"
    _hf_model("dense", 5, vocab_size=384).save_pretrained(hf_dir)
    tok = _qwen2_style_tokenizer(384)
    tok.save(str(hf_dir / "tokenizer.json"))
    hf = load_model(hf_dir, "q4_0")
    assert hf.tokenizer is not None
    path = tmp_path / "tok.gguf"
    assert kg.write_gguf(hf, path) == []
    fields = gguf.GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2" and fields["tokenizer.ggml.pre"].contents() == "qwen2"
    types = fields["tokenizer.ggml.token_type"].contents()
    toks = fields["tokenizer.ggml.tokens"].contents()
    assert len(toks) == 384 and types[toks.index("<|endoftext|>")] == 3 and types[toks.index("<think>")] == 4
    assert toks[-1] == "[PAD383]" and types[-1] == 5
    notes: list[str] = []
    back = kg.load_gguf_model(path, "q4_0", notes=notes)
    assert notes == [] and back.tokenizer is not None
    for text in ["The quick brown fox.", "  def f(x):\n\treturn 42\n\n", "<|im_start|>user naïve café<think>",
                 "数字 and ÉMOJI 😀 <|endoftext|>", "it's we'RE 1234 !!?"]:
        ids = tok.encode(text).ids
        assert back.tokenizer.encode(text).ids == ids, text
        assert back.tokenizer.decode(ids) == tok.decode(ids)
    assert back.tokenizer.decode([383]) == tok.decode([383]) == ""  # a padding row is no token
    assert _hashes(back) == _hashes(hf)
    again = tmp_path / "again.gguf"  # GGUF -> GGUF keeps the tokenizer metadata as it was
    assert kg.write_gguf(back, again) == []
    fields2 = gguf.GGUFReader(again).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.pre"):
        assert fields2[key].contents() == fields[key].contents(), key


def _llama_bpe_gguf(hf_dirs, tmp_path) -> Path:
    """The dense model as a GGUF whose tokenizer (gpt2 with llama-bpe pre) we do not rebuild."""
    hf_dir = tmp_path / "dense"
    shutil.copytree(hf_dirs["dense"], hf_dir)
    path = tmp_path / "llama-bpe.gguf"
    _converter_gguf(hf_dir, path, {}, extra=[
        lambda w: w.add_tokenizer_model("gpt2"), lambda w: w.add_tokenizer_pre("llama-bpe"),
        lambda w: w.add_token_list([f"t{i}" for i in range(256)]), lambda w: w.add_token_merges(["t 1"])])
    return path


def test_other_tokenizers_are_not_used_and_say_so(hf_dirs, tmp_path):
    path = _llama_bpe_gguf(hf_dirs, tmp_path)
    notes: list[str] = []
    model = kg.load_gguf_model(path, "f32", notes=notes)
    assert model.tokenizer is None and len(notes) == 1 and kg.NO_TOKENIZER in notes[0] and "llama-bpe" in notes[0]
    assert model.notes == tuple(notes)


def test_the_cli_says_why_a_gguf_has_no_tokenizer(hf_dirs, tmp_path, capsys):
    path = _llama_bpe_gguf(hf_dirs, tmp_path)
    code, out, err = run(capsys, "generate", "--model", path, "--tokens", "1", "--prompt-ids", "1,2")
    assert code == 0 and err.startswith("note: ") and kg.NO_TOKENIZER in err
    code, out, err = run(capsys, "generate", "--model", path, "--tokens", "1", "--prompt", "hi")
    assert code == 2 and "--prompt needs a model with a tokenizer" in err and "llama-bpe" in err


# ---------------------------------------------------------------- the CLI

def test_export_command(hf_dirs, tmp_path, capsys):
    out = tmp_path / "moe.gguf"
    code, stdout, err = run(capsys, "export", "--model", hf_dirs["moe"], "--weights", "f32", "--out", out)
    assert code == 0 and f"wrote {out}" in stdout and "qwen3moe, 2 layers, f32" in stdout, err
    assert load_model(out, "f32").fmt == "f32"
    code, _, err = run(capsys, "export", "--model", hf_dirs["moe"], "--out", out)
    assert code == 2 and "already exists" in one_line(err)
    code, _, err = run(capsys, "export", "--out", tmp_path / "x.bin")
    assert code == 2 and ".gguf" in one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe.gguf"]  # no temporary file left behind
    # the embedded default (all 48 layers): generate on its GGUF == generate on the model itself
    default = tmp_path / "default.gguf"
    assert run(capsys, "export", "--out", default)[0] == 0
    a = run(capsys, "generate", "--tokens", "2", "--prompt-ids", "1,2,3")
    b = run(capsys, "generate", "--tokens", "2", "--prompt-ids", "1,2,3", "--model", default)
    assert a[0] == b[0] == 0 and a[1] == b[1]


def _bad(hf_dirs, tmp_path, name, **kw) -> Path:
    hf_dir = tmp_path / f"hf_{name}"
    shutil.copytree(hf_dirs["dense"], hf_dir)
    path = tmp_path / f"{name}.gguf"
    _converter_gguf(hf_dir, path, {}, **kw)
    return path


def test_bad_ggufs_are_one_line_exit_2(hf_dirs, tmp_path, capsys):
    good = tmp_path / "good.gguf"
    kg.write_gguf(load_model(hf_dirs["dense"], "q4_0"), good)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    short_header = tmp_path / "header.gguf"
    short_header.write_bytes(data[:40])
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello\n")
    llama = _bad(hf_dirs, tmp_path, "llama", arch="llama")
    missing = _bad(hf_dirs, tmp_path, "missing", drop=("blk.1.ffn_norm.weight",))
    yarn = _bad(hf_dirs, tmp_path, "yarn", extra=[lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN)])
    bias = tmp_path / "bias.gguf"  # an attention bias tensor: llama.cpp's qwen3 has none, nor do we
    _converter_gguf(shutil.copytree(hf_dirs["dense"], tmp_path / "hf_bias"), bias, {}, extra=[
        lambda w: w.add_tensor("blk.0.attn_q.bias", np.zeros(128, np.float32))])
    cases = [(truncated, "truncated"), (short_header, "not a whole GGUF file"), (not_gguf, "not a GGUF file"),
             (llama, "general.architecture is 'llama'"), (missing, "tensor blk.1.ffn_norm.weight is missing"),
             (yarn, "rope.scaling.type is 'yarn'"), (bias, "tensor blk.0.attn_q.bias is not part of"),
             (tmp_path / "absent.gguf", "no such GGUF file")]
    for path, needle in cases:
        code, _, err = run(capsys, "generate", "--model", path, "--prompt-ids", "1,2", "--tokens", "1")
        line = one_line(err)
        assert code == 2 and needle in line and str(path) in line, line


def test_unsupported_quant_type_names_type_and_fix(tmp_path, capsys):
    """A Q4_K tensor (needs rows of 256): one line naming the tensor, the type and the fix."""
    hf_dir = tmp_path / "hf"
    _hf_model("dense", 7, hidden_size=256, head_dim=64, intermediate_size=256).save_pretrained(hf_dir)
    path = tmp_path / "q4k.gguf"
    q4k = np.random.default_rng(0).integers(0, 255, size=(256, 256 // 256 * 144), dtype=np.uint8)
    q4k[:, :4] = 0  # d and dmin (f16) zero: finite

    def put_q4k(w):
        w.add_tensor("blk.0.attn_q.weight", q4k, raw_dtype=QT.Q4_K)
    _converter_gguf(hf_dir, path, {}, drop=("blk.0.attn_q.weight",), extra=[put_q4k])
    code, _, err = run(capsys, "generate", "--model", path, "--prompt-ids", "1,2", "--tokens", "1")
    line = one_line(err)
    assert code == 2 and "tensor blk.0.attn_q.weight is Q4_K: not supported" in line
    assert "llama-quantize to Q4_0 or Q8_0" in line and "F16" in line
    with pytest.raises(ModelError, match="Q4_K"):
        kg.load_gguf_model(path, "f32")


def test_export_is_whole_or_not_there(tmp_path, monkeypatch):
    """A write that fails part way (disk full) leaves no file under the real name, only `.partial`,
    which the reader refuses."""
    import errno

    from kestrel_tui.files import PartialFileError

    model = load_model(None, "q4_0", n_layers=1)
    calls = []

    def full(self, tensor, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, tensor, *a, **k)
    real = gguf.GGUFWriter.write_tensor_data
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full)
    out = tmp_path / "m.gguf"
    with pytest.raises(PartialFileError, match="No space left on device") as e:
        kg.write_gguf(model, out)
    assert not out.exists() and e.value.partial == tmp_path / "m.gguf.partial"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf.partial"]
    with pytest.raises(ModelError, match=r"a \.partial file"):
        kg.load_gguf_model(e.value.partial, "q4_0")
