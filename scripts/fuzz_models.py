"""Fuzz the model loaders with hostile files; results/fuzz-models.md records a run.

    .venv/bin/python scripts/fuzz_models.py --cases 100000 [--seed N] [--workers 2]

Seeds, written once by the project's own writers: GGUF files from `write_gguf`
(a dense qwen3 in q4_0, one with a Qwen2-style byte-level BPE tokenizer that
loading rebuilds, a qwen3moe in f32, and a dense one whose tensors are
F16 / BF16 / Q8_0 / F32 as llama.cpp's converter writes them) and HF
directories (config.json + model.safetensors in f32 and bf16; a qwen3_moe
sharded in two files with model.safetensors.index.json, per-expert, f16; a
qwen3_moe with fused experts, bf16). Each case copies one seed and mutates it:

* GGUF: a header field (the key and tensor counts, a string or array length, a
  value or item type, a metadata value such as block_count, embedding_length,
  head_count, expert_count, a tensor's n_dims, dims, type or offset) set to an
  edge value (0, 1, 2^31, 2^32-1, 2^40, 2^63, 2^64-1, 10^9, the value ±1, ...),
  bytes flipped or inserted in the header, truncation anywhere;
* config.json: a field (num_hidden_layers, vocab_size, hidden_size,
  num_experts, ...) set to a huge, negative, float, string, null, nested or
  thousands-of-digits value, removed, or the text flipped / truncated / nested
  thousands deep;
* safetensors: the 8-byte header length set to edge values, a tensor's shape,
  dtype or data_offsets replaced, the header nested deep or given long digits,
  the data truncated;
* index.json: a weight_map entry pointed at a missing, absolute, `..` or
  non-safetensors shard, non-string values, deep nesting, long digits;
* a FIFO or a directory where config.json or the .gguf is expected.

Each case is loaded the way `--model` loads it (session/inputs.model_from_options,
q4_0 or f32), in worker processes under RLIMIT_AS 3 GB that take many cases each;
a case that runs past 5 s is a hang: its worker is killed and replaced. Outcomes:
``ok`` (loaded), ``refused`` (UsageError, the CLI's exit 2: checked to be one line
naming the file), and the failures: ``traceback`` (any other exception),
``hang``, ``died`` (the worker ended otherwise), ``multiline``/``unnamed`` (a
refusal that is not one line or names no file). A warning (numpy's RuntimeWarning
would print on the CLI's stderr beside its one line) is counted too; the exit
status is 1 on any failure or warning.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AS_LIMIT = 3 << 30
CASE_SECONDS = 5.0
FAILURES = ("traceback", "hang", "died", "multiline", "unnamed")

# ---------------------------------------------------------------- seeds


def _configs():
    from kestrel_tui.model.config import Config

    common = dict(hidden=32, n_heads=2, n_kv_heads=1, head_dim=16, vocab=64, rope_theta=1e6, eps=1e-6,
                  max_positions=64)
    dense = Config(arch="qwen3", n_layers=2, tie_embeddings=False, intermediate=32, **common)
    moe = Config(arch="qwen3_moe", n_layers=2, tie_embeddings=True, n_experts=4, top_k=2, moe_intermediate=32,
                 **common)
    return dense, moe


def _hf_config(cfg) -> dict:
    out = {"architectures": ["Qwen3MoeForCausalLM" if cfg.is_moe else "Qwen3ForCausalLM"],
           "model_type": cfg.arch, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "vocab_size": cfg.vocab, "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.eps,
           "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32"}
    if cfg.is_moe:
        out.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                   moe_intermediate_size=cfg.moe_intermediate, norm_topk_prob=True, decoder_sparse_step=1)
    else:
        out["intermediate_size"] = cfg.intermediate
    return out


def _encode(arr, dtype: str) -> bytes:
    import numpy as np

    a = np.ascontiguousarray(arr, dtype=np.float32)
    if dtype == "F32":
        return a.tobytes()
    if dtype == "F16":
        return a.astype("<f2").tobytes()
    return (a.view(np.uint32) >> np.uint32(16)).astype("<u2").tobytes()  # BF16: the top half


def write_safetensors(path: Path, tensors: dict[str, tuple[str, object]]) -> None:
    """{name: (dtype, f32 array)} as a safetensors file, written here so that BF16 needs no torch."""
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = _encode(arr, dtype)
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _per_expert(sd: dict, cfg) -> dict:
    out = {}
    F = cfg.moe_intermediate
    for name, arr in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            for e in range(arr.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = arr[e, :F]
                out[f"{p}{e}.up_proj.weight"] = arr[e, F:]
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(arr.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = arr[e]
        else:
            out[name] = arr
    return out


def _converter_gguf(src: Path, out: Path) -> None:
    """The dense f32 export rewritten with F16 / BF16 / Q8_0 / F32 tensors, as llama.cpp's converter mixes them.
    (gguf.GGUFReader reads the seed: a file of our own, sound by construction.)"""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, "qwen3")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        t, v = int(field.types[0]), field.contents()
        if t == 8:
            w.add_string(key, v)
        elif t == 9:
            w.add_array(key, v)
        elif t == 7:
            w.add_bool(key, v)
        elif t == 6:
            w.add_float32(key, v)
        else:
            w.add_uint32(key, v)
    tensors = {t.name: t for t in r.tensors}
    kinds = [gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.Q8_0,
             gguf.GGMLQuantizationType.F32]
    for i, (name, t) in enumerate(tensors.items()):
        arr = np.asarray(t.data, dtype=np.float32)
        kind = gguf.GGMLQuantizationType.F32 if arr.ndim == 1 else kinds[i % len(kinds)]
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _qwen2_tokenizer(vocab: int):
    """A small byte-level BPE with Qwen2's pre-tokenizer: written as gpt2 + qwen2, so loading rebuilds it."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from kestrel_tui.model.gguf import QWEN2_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - 4, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 3, "def f(x): return x * 2"],
                            trainer)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return tok


def make_seeds(root: Path) -> dict[str, Path]:
    """The valid files every case starts from; each must load (checked)."""
    from kestrel_tui.model.gguf import write_gguf
    from kestrel_tui.model.hf import load_model
    from kestrel_tui.model.hf_export import hf_state_dict
    from kestrel_tui.model.weights import synthetic_model

    dense, moe = _configs()
    seeds: dict[str, Path] = {}
    m_dense = synthetic_model(dense, "q4_0", seed=1, name="dense")
    m_dense32 = synthetic_model(dense, "f32", seed=1, name="dense")
    m_moe = synthetic_model(moe, "f32", seed=2, name="moe")
    write_gguf(m_dense, root / "dense_q4.gguf")
    write_gguf(m_moe, root / "moe_f32.gguf")
    write_gguf(m_dense32, root / "dense_f32.gguf")
    from dataclasses import replace

    m_tok = synthetic_model(replace(dense, vocab=320), "q4_0", seed=4, name="tok")
    write_gguf(replace(m_tok, tokenizer=_qwen2_tokenizer(320)), root / "dense_tok.gguf")
    _converter_gguf(root / "dense_f32.gguf", root / "dense_mixed.gguf")
    (root / "dense_f32.gguf").unlink()
    for name in ("dense_q4.gguf", "moe_f32.gguf", "dense_mixed.gguf", "dense_tok.gguf"):
        seeds[name] = root / name

    d = root / "hf_dense"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_hf_config(dense), indent=2))
    sd = hf_state_dict(m_dense32)
    write_safetensors(d / "model.safetensors", {n: ("BF16" if i % 2 else "F32", a) for i, (n, a) in
                                                enumerate(sd.items())})
    seeds["hf_dense"] = d

    d = root / "hf_moe_sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_hf_config(moe), indent=2))
    sd = _per_expert(hf_state_dict(m_moe), moe)
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, arr in sd.items():
        which = "model-00002-of-00002.safetensors" if ".layers.1." in name or name == "model.norm.weight" else \
            "model-00001-of-00002.safetensors"
        shards[which][name] = ("F16", arr)
    for shard, tensors in shards.items():
        write_safetensors(d / shard, tensors)
    index = {"metadata": {"total_size": 0}, "weight_map": {n: s for s, ts in shards.items() for n in ts}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    seeds["hf_moe_sharded"] = d

    d = root / "hf_moe_fused"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_hf_config(moe), indent=2))
    write_safetensors(d / "model.safetensors", {n: ("BF16", a) for n, a in hf_state_dict(m_moe).items()})
    seeds["hf_moe_fused"] = d

    for path in seeds.values():
        load_model(str(path), "f32")
    assert load_model(str(seeds["dense_tok.gguf"]), "q4_0").tokenizer is not None
    return seeds


# ---------------------------------------------------------------- GGUF mutations

_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_fields(data: bytes) -> tuple[list[tuple[int, str, str]], int]:
    """The header's fields of a valid GGUF as (offset, struct format, role) and the header's end."""
    out: list[tuple[int, str, str]] = []
    pos = 0

    def take(fmt: str, role: str):
        nonlocal pos
        out.append((pos, fmt, role))
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string(role: str) -> bytes:
        nonlocal pos
        n = take("<Q", role)
        s = data[pos:pos + n]
        pos += n
        return s

    def value(t: int, key: str):
        if t in _SCALAR_FMT:
            take(_SCALAR_FMT[t], f"value {key}")
        elif t == 8:
            string(f"string length {key}")
        else:
            item = take("<I", f"item type {key}")
            n = take("<Q", f"array length {key}")
            for _ in range(n):
                value(item, key)

    pos = 4
    take("<I", "version")
    n_t = take("<Q", "tensor count")
    n_kv = take("<Q", "key count")
    for _ in range(n_kv):
        key = string("key length").decode()
        t = take("<I", f"value type {key}")
        value(t, key)
    for _ in range(n_t):
        name = string("tensor name length").decode()
        nd = take("<I", f"n_dims {name}")
        for _ in range(nd):
            take("<Q", f"dim {name}")
        take("<I", f"tensor type {name}")
        take("<Q", f"tensor offset {name}")
    return out, pos


_EDGE = [0, 1, 2, 3, 7, 8, 16, 31, 32, 33, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53,
         2**62, 2**63 - 1, 2**63, 2**64 - 1, 10**6, 10**8, 10**9, 10**12]
_FLOATS = [0.0, -0.0, -1.0, 1e-30, 1e30, 1e300, float("inf"), float("-inf"), float("nan"), 3.4e38]
_GGUF_TYPES = list(range(0, 16)) + [2**31, 2**32 - 1]
_GGML_TYPES = [0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 20, 24, 28, 29, 30, 31, 39, 40, 99, 2**31, 2**32 - 1]


def _edge(rng: random.Random, fmt: str, orig) -> object:
    if fmt in ("<f", "<d"):
        v = rng.choice(_FLOATS)
        return float("inf") if fmt == "<f" and abs(v) > 3.4e38 and v == v else v
    if fmt == "<?":
        return rng.choice([True, False])
    bits = struct.calcsize(fmt) * 8
    signed = fmt[1].islower()
    v = rng.choice(_EDGE + [orig + 1, orig - 1, orig * 2, orig * 1000, rng.getrandbits(bits)] * 2)
    v %= 1 << bits
    if signed and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def mutate_gguf(data: bytes, rng: random.Random) -> bytes:
    fields, end = gguf_fields(data)
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.random()
        if op < 0.6:
            # the fields that counts and sizes come from are picked more often than the rest
            weighted = [f for f in fields if not f[2].startswith(("string length", "item type"))]
            off, fmt, role = rng.choice(weighted if rng.random() < 0.7 else fields)
            if off + struct.calcsize(fmt) > len(buf):
                continue
            orig = struct.unpack_from(fmt, buf, off)[0]
            if role.startswith("value type"):
                new = rng.choice(_GGUF_TYPES)
            elif role.startswith("item type"):
                new = rng.choice(_GGUF_TYPES)
            elif role.startswith("tensor type"):
                new = rng.choice(_GGML_TYPES)
            else:
                new = _edge(rng, fmt, orig)
            struct.pack_into(fmt, buf, off, new)
        elif op < 0.8:
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(min(len(buf), end + 64))
                buf[i] ^= 1 << rng.randrange(8)
        elif op < 0.9:
            cut = rng.randrange(len(buf)) if rng.random() < 0.5 else rng.randrange(min(len(buf), end + 1))
            del buf[cut:]
        else:
            i = rng.randrange(min(len(buf), end) + 1)
            if rng.random() < 0.5:
                buf[i:i] = rng.randbytes(rng.randint(1, 16))
            else:
                del buf[i:i + rng.randint(1, 16)]
        if not buf:
            break
    return bytes(buf)


# ---------------------------------------------------------------- JSON mutations

_DEEP = 5000


def _hostile_json(rng: random.Random) -> str:
    """A JSON value's text: huge, negative, float, other types, nested thousands deep, thousands of digits."""
    choices = [
        lambda: str(rng.choice(_EDGE)), lambda: str(-rng.choice(_EDGE)), lambda: "1e8", lambda: "1e12",
        lambda: "1e308", lambda: "1e999", lambda: "-1e999", lambda: "2.5", lambda: "-0.0", lambda: "NaN",
        lambda: "Infinity", lambda: '"32"', lambda: '""', lambda: "null", lambda: "true", lambda: "false",
        lambda: "[]", lambda: "{}", lambda: "[32]", lambda: '{"a": 1}', lambda: "9" * rng.choice([30, 101, 5000, 20000]),
        lambda: "-" + "9" * 5000, lambda: "1" + "0" * 400 + ".5", lambda: "[" * _DEEP + "]" * _DEEP,
        lambda: '{"a":' * _DEEP + "1" + "}" * _DEEP, lambda: "[" * 100 + "1" + "]" * 100,
        lambda: '"' + "x" * 100000 + '"', lambda: '"\\u0000\\u001b[2J"', lambda: "[" + ",".join(["0"] * 1000) + "]",
    ]
    return rng.choice(choices)()


def _with_value(doc: dict, key: str, text: str) -> str:
    """doc as JSON text with doc[key] replaced by the raw text (json.dumps cannot write 5000 digits)."""
    marker = "__fuzz_value__"
    return json.dumps({**doc, key: marker}).replace(json.dumps(marker), text, 1)


def mutate_json_text(text: str, rng: random.Random, keys: list[str]) -> str:
    doc = json.loads(text)
    op = rng.random()
    if op < 0.65 and isinstance(doc, dict):
        key = rng.choice(keys + list(doc) + ["unknown_field"])
        return _with_value(doc, key, _hostile_json(rng))
    if op < 0.75 and isinstance(doc, dict):
        doc.pop(rng.choice(list(doc)), None)
        return json.dumps(doc)
    if op < 0.85:
        b = bytearray(text.encode())
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return b.decode("utf-8", "replace")
    if op < 0.93:
        return text[:rng.randrange(len(text))]
    return _hostile_json(rng)


_CONFIG_KEYS = ["num_hidden_layers", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "max_position_embeddings", "rms_norm_eps", "rope_theta", "decoder_sparse_step", "mlp_only_layers",
                "rope_scaling", "rope_parameters", "tie_word_embeddings", "model_type", "architectures",
                "torch_dtype", "quantization_config", "attention_bias", "num_local_experts", "norm_topk_prob"]


def mutate_safetensors(data: bytes, rng: random.Random) -> bytes:
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    op = rng.random()
    if op < 0.2:
        new_n = rng.choice(_EDGE + [n - 1, n + 1, n * 2, len(data), len(data) - 8])
        return struct.pack("<Q", new_n % 2**64) + data[8:]
    if op < 0.7:
        name = rng.choice([k for k in header if k != "__metadata__"])
        entry = header[name]
        what = rng.choice(["shape", "shape", "dtype", "data_offsets", "data_offsets", "entry"])
        hostile = rng.random() < 0.5
        if what == "shape" and not hostile:
            shape = list(entry["shape"])
            if shape:
                shape[rng.randrange(len(shape))] = rng.choice(_EDGE + [-1])
            entry["shape"] = shape if rng.random() < 0.8 else shape + [1]
        elif what == "dtype" and not hostile:
            entry["dtype"] = rng.choice(["F32", "F16", "BF16", "I8", "U8", "F64", "I64", "BOOL", "F8_E4M3", "Q4", ""])
        elif what == "data_offsets" and not hostile:
            a, b = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[b, a], [a, a], [0, b - a], [a, b + 2], [a, 2**63], [2**64 - 1, 0],
                                                [a - 2, b - 2], [-1, b]])
        else:
            text = _with_value(header, name, _hostile_json(rng)) if what == "entry" or hostile else None
            if text is None:
                text = json.dumps(header)
            raw = text.encode()
            return struct.pack("<Q", len(raw)) + raw + body
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + body
    if op < 0.85:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(min(len(b), 8 + n))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    return data[:rng.randrange(len(data))]


def mutate_index(text: str, rng: random.Random) -> str:
    doc = json.loads(text)
    wm = doc["weight_map"]
    op = rng.random()
    if op < 0.5:
        name = rng.choice(list(wm))
        wm[name] = rng.choice(["model-00003-of-00002.safetensors", "/etc/passwd", "../x.safetensors",
                               "model.bin", "", "config.json", "sub/../model-00001-of-00002.safetensors",
                               "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
        return json.dumps(doc)
    if op < 0.7:
        return _with_value(doc, rng.choice(["weight_map", "metadata"]), _hostile_json(rng))
    if op < 0.8:
        name = rng.choice(list(wm))
        return json.dumps(doc).replace(json.dumps(wm[name]), _hostile_json(rng), 1)
    return mutate_json_text(text, rng, ["weight_map", "metadata"])


# ---------------------------------------------------------------- one case


def make_case(seeds: dict[str, Path], seed: int, index: int, work: Path) -> tuple[Path, str, str]:
    """Materialize case `index` under `work`: (the --model path, --weights, a few words of what it is)."""
    rng = random.Random(f"{seed}:{index}")
    weights = rng.choice(["q4_0", "f32"])
    family = rng.choices(["gguf", "config", "safetensors", "index", "special"], [45, 22, 20, 9, 4])[0]
    if family == "gguf":
        name = rng.choice(sorted(n for n in seeds if n.endswith(".gguf")))  # sorted: any seed dir, same case
        out = work / name
        out.write_bytes(mutate_gguf(seeds[name].read_bytes(), rng))
        return out, weights, f"gguf {name}"
    if family == "index":
        name = "hf_moe_sharded"
    else:
        name = rng.choice(sorted(n for n in seeds if n.startswith("hf_")))
    out = work / name
    shutil.copytree(seeds[name], out)
    if family == "config":
        p = out / "config.json"
        p.write_text(mutate_json_text(p.read_text(), rng, _CONFIG_KEYS), errors="surrogateescape")
    elif family == "safetensors":
        p = rng.choice(sorted(out.glob("*.safetensors")))
        p.write_bytes(mutate_safetensors(p.read_bytes(), rng))
    elif family == "index":
        p = out / "model.safetensors.index.json"
        p.write_text(mutate_index(p.read_text(), rng))
    else:
        what = rng.choice(["fifo config", "dir config", "fifo gguf", "dir gguf", "fifo shard", "fifo index"])
        if what.endswith("gguf"):
            shutil.rmtree(out)
            out = work / "special.gguf"
            os.mkfifo(out) if what.startswith("fifo") else out.mkdir()
        else:
            target = {"config": out / "config.json", "shard": next(iter(sorted(out.glob("*.safetensors")))),
                      "index": out / "model.safetensors.index.json"}[what.split()[1]]
            if target.exists():
                target.unlink()
            os.mkfifo(target) if what.startswith("fifo") else target.mkdir()
        return out, weights, f"special {what}"
    return out, weights, f"{family} {name}"


def run_case(seeds: dict[str, Path], seed: int, index: int, work: Path) -> dict:
    import warnings

    from kestrel_tui.session.inputs import RunConfig, model_from_options
    from kestrel_tui.errors import UsageError

    case_dir = work / f"c{index}"
    case_dir.mkdir()
    try:
        path, weights, what = make_case(seeds, seed, index, case_dir)
        t0 = time.perf_counter()
        out: dict = {"i": index, "what": what}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model = model_from_options(RunConfig(model=str(path), weights=weights))
                out["outcome"] = "ok"
                out["detail"] = f"{model.cfg.arch} {model.cfg.n_layers} layers"
            except UsageError as e:
                msg = str(e)
                names = [str(case_dir)] + [p.name for p in case_dir.rglob("*")]
                if "\n" in msg or "\r" in msg or not msg.strip():
                    out["outcome"] = "multiline"
                elif not any(n in msg for n in names):
                    out["outcome"] = "unnamed"
                else:
                    out["outcome"] = "refused"
                out["detail"] = msg[:300]
            except Exception as e:  # noqa: BLE001 - what the fuzzer is here to find
                import traceback

                tb = traceback.extract_tb(e.__traceback__)
                where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
                out["outcome"] = "traceback"
                out["detail"] = f"{type(e).__name__} at {where}: {str(e)[:200]}"
        out["t"] = time.perf_counter() - t0
        if caught:
            out["warning"] = f"{caught[0].category.__name__}: {str(caught[0].message)[:120]}"
        return out
    finally:
        shutil.rmtree(case_dir, ignore_errors=True)


def _peak_kb() -> int:
    """This process's peak RSS since exec (VmHWM): ru_maxrss would count the pages shared with the parent
    it was forked from (a pytest process with torch loaded is 300 MB)."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmHWM:")))


def worker_main(seed_dir: str, seed: int) -> None:
    """Read case indices on stdin, answer one JSON line each on the original stdout."""
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    seeds = {p.name: p for p in Path(seed_dir).iterdir()}
    import kestrel_tui.session.inputs  # noqa: F401 - imported before "ready": not part of any case's time
    import kestrel_tui.model.gguf  # noqa: F401
    import kestrel_tui.model.hf  # noqa: F401

    work = Path(tempfile.mkdtemp(prefix="kestrel-fuzz-"))
    try:
        proto.write("ready\n")
        for line in sys.stdin:
            out = run_case(seeds, seed, int(line), work)
            out["rss_kb"] = _peak_kb()
            proto.write(json.dumps(out) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- the parent


class _Worker:
    def __init__(self, seed_dir: Path, seed: int):
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(seed_dir),
                                      "--seed", str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, cwd=ROOT, text=True, bufsize=1)
        self.case: int | None = None
        self.deadline = 0.0
        self.ready = False
        self.buf = ""

    def send(self, index: int) -> None:
        self.case = index
        self.deadline = time.monotonic() + CASE_SECONDS
        self.proc.stdin.write(f"{index}\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def stderr_tail(self) -> str:
        self.err.seek(0)
        return self.err.read()[-400:].decode("utf-8", "replace")


def fuzz(cases: int, seed: int, workers: int = 2, log=print) -> dict:
    """Run `cases` cases; returns the figures (counts by outcome, failures, time, max RSS)."""
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="kestrel-fuzz-seeds-"))
    try:
        make_seeds(tmp)
        seed_time = time.monotonic() - start
        return _dispatch(cases, seed, workers, tmp, start, seed_time, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dispatch(cases, seed, n_workers, seed_dir, start, seed_time, log) -> dict:
    sel = selectors.DefaultSelector()
    results: Counter = Counter()
    by_family: Counter = Counter()
    failures: list[dict] = []
    warned: list[dict] = []
    max_rss = 0
    max_t = (0.0, None)
    restarts = 0
    todo = iter(range(cases))
    pool: list[_Worker] = []

    def spawn() -> _Worker:
        w = _Worker(seed_dir, seed)
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        pool.append(w)
        return w

    def retire(w: _Worker, outcome: str) -> None:
        nonlocal restarts
        sel.unregister(w.proc.stdout)
        pool.remove(w)
        w.kill()
        if w.case is None:
            raise RuntimeError(f"a fuzz worker ended before its first case: {w.stderr_tail()}")
        if w.case is not None:
            sig = -w.proc.returncode if w.proc.returncode and w.proc.returncode < 0 else None
            detail = (f"killed after {CASE_SECONDS:.0f} s" if outcome == "hang" else
                      f"worker ended ({'signal ' + signal.Signals(sig).name if sig else 'status ' + str(w.proc.returncode)})"
                      f": {w.stderr_tail()!r}")
            results[outcome] += 1
            failures.append({"i": w.case, "outcome": outcome, "detail": detail})
        restarts += 1
        nxt = next(todo, None)
        if nxt is not None:
            spawn().pending = nxt

    for _ in range(min(n_workers, cases)):
        spawn().pending = next(todo)
    done = 0
    while pool:
        now = time.monotonic()
        timeout = min([w.deadline - now for w in pool if w.case is not None] or [1.0])
        for key, _ in sel.select(timeout=max(0.0, timeout)):
            w: _Worker = key.data
            line = w.proc.stdout.readline()
            if not line:
                retire(w, "died")
                continue
            if line == "ready\n":
                w.ready = True
                w.send(w.pending)
                continue
            out = json.loads(line)
            done += 1
            results[out["outcome"]] += 1
            by_family[(out["what"].split()[0], out["outcome"])] += 1
            max_rss = max(max_rss, out["rss_kb"])
            if out["t"] > max_t[0]:
                max_t = (out["t"], out["i"])
            if out["outcome"] in FAILURES:
                failures.append(out)
            if "warning" in out:
                warned.append(out)
            if done % 10000 == 0:
                log(f"  {done} cases, {time.monotonic() - start:.0f} s, {dict(results)}")
            nxt = next(todo, None)
            if nxt is None:
                w.case = None
                sel.unregister(w.proc.stdout)
                pool.remove(w)
                w.proc.stdin.close()
                w.proc.wait()
            else:
                w.send(nxt)
        now = time.monotonic()
        for w in list(pool):
            if w.ready and w.case is not None and now > w.deadline:
                retire(w, "hang")
    return {"cases": cases, "seed": seed, "workers": n_workers, "outcomes": dict(results),
            "by_family": {f"{k[0]} {k[1]}": v for k, v in sorted(by_family.items())},
            "failures": failures, "warnings": len(warned), "warning_examples": warned[:5],
            "time_s": time.monotonic() - start, "seed_time_s": seed_time, "max_case_s": max_t[0],
            "slowest_case": max_t[1], "max_rss_mb": max_rss / 1024, "restarts": restarts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--worker", metavar="SEED_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--replay", type=int, metavar="INDEX", help="run one case in this process and print it")
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker, args.seed)
        return 0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    if args.replay is not None:
        tmp = Path(tempfile.mkdtemp(prefix="kestrel-fuzz-"))
        try:
            (tmp / "seeds").mkdir()
            seeds = make_seeds(tmp / "seeds")
            print(json.dumps(run_case(seeds, seed, args.replay, tmp), indent=2))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    print(f"seed {seed} (--seed {seed} replays it), {args.cases} cases, {args.workers} workers,"
          f" RLIMIT_AS {AS_LIMIT >> 30} GB, {CASE_SECONDS:.0f} s a case; {platform.machine()} {os.cpu_count()} cores")
    r = fuzz(args.cases, seed, args.workers)
    print(json.dumps({k: v for k, v in r.items() if k != "failures"}, indent=2))
    for f in r["failures"][:20]:
        print("FAIL", json.dumps(f))
    return 1 if r["failures"] or r["warnings"] else 0


if __name__ == "__main__":
    sys.exit(main())
