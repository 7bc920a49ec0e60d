"""GGUF files in and out: llama.cpp's `qwen3` / `qwen3moe` files <-> Model, with the `gguf` package.

Reading (`load_gguf_model`) memory-maps the file, reads its header with every
count checked against the bytes that hold it (`_parse`; gguf.GGUFReader trusts
them), and builds one tensor at a time. Tensor types: **Q4_0** is used as it is — ggml's q4_0
blocks are our q4_0 blocks, so with `--weights q4_0` the reference runs
exactly the bytes llama.cpp runs, and `--weights f32` takes their exact
dequantized values; **Q8_0, F16, BF16, F32** are widened to f32 exactly
(a q8_0 value d*q is exact in f32) and, for `--weights q4_0`, quantized to
q4_0 like an HF checkpoint (model/hf.py), so an HF directory and a GGUF of the
same values give the same bits. Anything else (Q4_K, Q6_K, IQ…, MXFP4) is
refused with one line naming the tensor, its type and the fix.

Writing (`write_gguf`, `kestrel-tui export`) puts every matrix in the model's
own format (q4_0 -> Q4_0 bytes, f32 -> F32) and the norms in F32, with the
metadata llama.cpp's loader reads, so llama.cpp and kestrel-tui read the same
bytes. The file is whole or not there (files.create_whole_path).

Shapes: GGUF lists dimensions innermost first (ne0 = the row length), so a
torch/HF weight [out, in] is stored with ne [in, out] and an expert stack
[E, out, in] with ne [in, out, E]; the bytes are the same row-major order.
llama.cpp's converter (convert_hf_to_gguf.py, classes Qwen3Model /
Qwen3MoeModel) permutes nothing for Qwen3: its RoPE is NEOX (rotate_half),
as HF's, unlike llama's q/k permutation.

Tensors (ne in GGUF order; HF names under model.layers.{i}. for blk.{i}; torch order last):

| GGUF tensor                 | GGUF ne          | HF tensor (Model / Layer field)               | torch shape      |
|-----------------------------|------------------|-----------------------------------------------|------------------|
| token_embd.weight           | [hidden, vocab]  | model.embed_tokens.weight (embed_tokens)      | [vocab, hidden]  |
| output_norm.weight          | [hidden]         | model.norm.weight (norm)                      | [hidden]         |
| output.weight               | [hidden, vocab]  | lm_head.weight (lm_head); absent: tied        | [vocab, hidden]  |
| blk.{i}.attn_norm.weight    | [hidden]         | input_layernorm.weight                        | [hidden]         |
| blk.{i}.attn_q.weight       | [hidden, nh*hd]  | self_attn.q_proj.weight                       | [nh*hd, hidden]  |
| blk.{i}.attn_k.weight       | [hidden, nkv*hd] | self_attn.k_proj.weight                       | [nkv*hd, hidden] |
| blk.{i}.attn_v.weight       | [hidden, nkv*hd] | self_attn.v_proj.weight                       | [nkv*hd, hidden] |
| blk.{i}.attn_output.weight  | [nh*hd, hidden]  | self_attn.o_proj.weight                       | [hidden, nh*hd]  |
| blk.{i}.attn_q_norm.weight  | [hd]             | self_attn.q_norm.weight                       | [hd]             |
| blk.{i}.attn_k_norm.weight  | [hd]             | self_attn.k_norm.weight                       | [hd]             |
| blk.{i}.ffn_norm.weight     | [hidden]         | post_attention_layernorm.weight               | [hidden]         |
| qwen3 only:                 |                  |                                               |                  |
| blk.{i}.ffn_gate.weight     | [hidden, ffn]    | mlp.gate_proj.weight                          | [ffn, hidden]    |
| blk.{i}.ffn_up.weight       | [hidden, ffn]    | mlp.up_proj.weight                            | [ffn, hidden]    |
| blk.{i}.ffn_down.weight     | [ffn, hidden]    | mlp.down_proj.weight                          | [hidden, ffn]    |
| qwen3moe only:              |                  |                                               |                  |
| blk.{i}.ffn_gate_inp.weight | [hidden, E]      | mlp.gate.weight (the router, Layer.gate)      | [E, hidden]      |
| blk.{i}.ffn_gate_exps.weight| [hidden, F, E]   | mlp.experts.{e}.gate_proj.weight, stacked     | [E, F, hidden]   |
| blk.{i}.ffn_up_exps.weight  | [hidden, F, E]   | mlp.experts.{e}.up_proj.weight, stacked       | [E, F, hidden]   |
| blk.{i}.ffn_down_exps.weight| [F, hidden, E]   | mlp.experts.{e}.down_proj.weight, stacked     | [E, hidden, F]   |

Metadata ({a} = "qwen3" or "qwen3moe"; R = read, W = written):

| key                                  | Config field         | notes                                              |
|--------------------------------------|----------------------|----------------------------------------------------|
| general.architecture                 | arch                 | qwen3 -> "qwen3", qwen3moe -> "qwen3_moe"          |
| {a}.block_count                      | n_layers             | R (required) W                                     |
| {a}.embedding_length                 | hidden               | R (required) W                                     |
| {a}.attention.head_count             | n_heads              | R (required) W                                     |
| {a}.attention.head_count_kv          | n_kv_heads           | R (default head_count) W                           |
| {a}.attention.key_length             | head_dim             | R (default hidden/head_count) W                    |
| {a}.attention.value_length           | (= head_dim)         | R (must equal key_length) W                        |
| {a}.rope.dimension_count             | (= head_dim)         | R (must equal head_dim: llama.cpp asserts it)      |
| {a}.rope.freq_base                   | rope_theta           | R (default 10000) W, f32                           |
| {a}.attention.layer_norm_rms_epsilon | eps                  | R (required) W, f32                                |
| {a}.context_length                   | max_positions        | R (required) W                                     |
| {a}.feed_forward_length              | intermediate (qwen3) | R W; qwen3moe: W = the expert width, R ignored     |
| {a}.expert_count                     | n_experts (qwen3moe) | R (required) W                                     |
| {a}.expert_used_count                | top_k                | R (required) W                                     |
| {a}.expert_feed_forward_length       | moe_intermediate     | R (required) W                                     |
| {a}.expert_weights_norm              | norm_topk_prob       | R (default true) W; llama.cpp always renormalises  |
| {a}.vocab_size                       | vocab                | W; R only to check it against token_embd           |
| general.file_type                    | -                    | W: 0 (ALL_F32) or 2 (MOSTLY_Q4_0)                  |
| general.quantization_version         | -                    | W: 2                                               |
| general.name                         | Model.name           | R W                                                |
| tokenizer.ggml.*                     | Model.tokenizer      | see below                                          |

vocab = the rows of token_embd (a token list, when present, must have as many
entries: llama.cpp requires it); tie_embeddings = output.weight absent.
Refused with one line (Config cannot hold it, or llama.cpp's qwen3 has no such
thing): rope scaling (yarn, linear), rope dimension count != head_dim, value
length != key length, shared experts, leading dense blocks, a gating function
other than softmax, and any tensor not in the table (attention biases,
rope_freqs, …).

Tokenizer. Reading: `tokenizer.huggingface.json` when present is used as it
is; else `tokenizer.ggml.model` "gpt2" with `tokenizer.ggml.pre` "qwen2" (what
llama.cpp's converter writes for every Qwen3) is rebuilt as the HF Qwen2
tokenizer is: NFC, the Qwen2 split regex, byte-level BPE from
tokenizer.ggml.tokens + merges, CONTROL tokens (type 3) as special added
tokens and USER_DEFINED ones (type 4) as added tokens. Any other tokenizer is
not used: the model has no tokenizer and `notes` says so (run on
`--prompt-ids`). Writing: a byte-level BPE tokenizer as "gpt2" tokens / types /
merges as the converter writes them (CONTROL / USER_DEFINED for added tokens,
"[PAD{id}]" UNUSED rows up to the embedding's size, "qwen2" pre when the
pre-tokenizer is Qwen2's, else "default" and a note). A model without
tokenizer (the embedded default) gets a stand-in llama.cpp can run: "gpt2"
with the 256 byte tokens as ids 0..255, "<id>" for the others, one merge, and
`kestrel_tui.synthetic_vocab` = true (so kestrel-tui reads it back as "no
tokenizer"). llama.cpp refuses a file without tokenizer.ggml.model, and its
"no_vocab" type loads but aborts in every tool that prints a token.

Checked against llama.cpp itself (the xllamacpp wheel, llama.cpp of 2026-10,
not a dependency): our exports of HF Qwen3 / Qwen3-MoE directories in q4_0 and
f32, the embedded default's, and converter-style F16/BF16/Q8_0/Q4_0 files load
and greedy-decode the same tokens as the reference; the tokenizer export
tokenizes as HF does.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import replace
from pathlib import Path
from stat import S_ISREG
from typing import NamedTuple

import numpy as np

from ..files import create_whole_path, is_partial_name
from ..readers import kind_of, open_regular
from ..text import inert
from .config import QK, Config, ModelError
from .progress import Progress, Tally
from .quant import RangeError
from .weights import (FORMATS, Layer, Linear, Model, linear_from_ggml, linear_from_rows, make_linear,
                      rope_tables)

F32 = np.float32


# ---------------------------------------------------------------- q4_0 bytes in and out
#
# A q4_0 Linear holds ggml's bytes (model/weights.py), so a GGUF tensor is used as it is:
# a view of the memory-mapped file, never a copy.

def _linear_from_q4_bytes(raw: np.ndarray, out: int, inp: int, fmt: str) -> Linear:
    """ggml q4_0 bytes uint8 [out, in/32*18] (or [E, out, in/32*18]) -> Linear in `fmt`."""
    return linear_from_ggml(raw, fmt, shape=(*raw.shape[:-2], out, inp))


def _q4_bytes(lin: Linear) -> np.ndarray:
    """A q4_0 Linear's ggml bytes: uint8 [out, in/32*18], or [E, out, in/32*18] for an expert stack."""
    return lin.ggml


# ---------------------------------------------------------------- names

ARCHS = {"qwen3": "qwen3", "qwen3moe": "qwen3_moe"}  # GGUF general.architecture -> Config.arch
GGUF_ARCH = {v: k for k, v in ARCHS.items()}

TOKEN_EMBD, OUTPUT_NORM, OUTPUT = "token_embd.weight", "output_norm.weight", "output.weight"
# per block: GGUF name -> Layer field
BLOCK_COMMON = {"attn_norm": "input_layernorm", "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                "attn_output": "o_proj", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
                "ffn_norm": "post_attention_layernorm"}
BLOCK_DENSE = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
BLOCK_MOE = {"ffn_gate_inp": "gate", "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
             "ffn_down_exps": "down_proj"}

# GGML type ids (gguf.GGMLQuantizationType) we read
_F32, _F16, _Q4_0, _Q8_0, _BF16 = 0, 1, 2, 8, 30
_SUPPORTED = {_F32: "F32", _F16: "F16", _Q4_0: "Q4_0", _Q8_0: "Q8_0", _BF16: "BF16"}
# GGUF value types (gguf.GGUFValueType)
_INTS = {0, 1, 2, 3, 4, 5, 10, 11}  # u8 i8 u16 i16 u32 i32 u64 i64
_FLOATS = {6, 12}  # f32 f64
_BOOL, _STRING, _ARRAY = 7, 8, 9
# llama.cpp token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
_FILE_TYPE = {"f32": 0, "q4_0": 2}  # gguf.LlamaFileType ALL_F32, MOSTLY_Q4_0
_QUANT_VERSION = 2  # gguf.GGML_QUANT_VERSION

# HF's Qwen2 / Qwen3 tokenizer.json pre-tokenizer regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2)
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NO_TOKENIZER = "the GGUF's tokenizer is not used; use --prompt-ids"
SYNTHETIC_KEY = "kestrel_tui.synthetic_vocab"  # true: the token list is _synthetic_vocab's stand-in


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ModelError("GGUF files need the gguf package; pip install gguf") from None
    return gguf


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _ne(shape: tuple[int, ...]) -> list[int]:
    """A torch-order shape as GGUF lists it (innermost first)."""
    return [int(s) for s in reversed(shape)]


# ---------------------------------------------------------------- reading

# The header is read here, not by gguf.GGUFReader: the reader trusts every count in the file (a
# 133-byte file declaring an array of 2^40 elements loops and allocates without end). Every count and
# length is checked against the bytes left before anything is allocated or looped over, so reading a
# header costs at most a few times the file's own size.

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
       12: "<f8"}
_ITEM_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALAR.items()}, _STRING: 8, _ARRAY: 12}  # the fewest
_U64 = struct.Struct("<Q")
_KV_BYTES = 8 + 4 + 1  # a key's length, its value type, the smallest value
_TI_BYTES = 8 + 4 + 4 + 8  # a tensor's name length, n_dims, type, offset
_VERSIONS = (2, 3)  # what gguf.GGUFReader reads; llama.cpp writes 3
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NEST = 8  # arrays of arrays: no model key has any


class _Field(NamedTuple):
    type: int  # GGUF value type
    value: object  # int / float / bool / str, or for an array a list (strings, nested arrays) or numpy array
    item: int | None = None  # an array's item type

    def count(self) -> int:
        return len(self.value) if self.type == _ARRAY else 1


class _Tensor:
    """A tensor's header entry; `data` is a view of the memory-mapped file, made when asked for."""

    def __init__(self, name: str, tensor_type, shape: tuple[int, ...], n_bytes: int, start: int, mm):
        self.name, self.tensor_type, self.shape, self.n_bytes, self.start = name, tensor_type, shape, n_bytes, start
        self._mm = mm

    @property
    def data(self) -> np.ndarray:
        raw = self._mm[self.start:self.start + self.n_bytes]
        kind = int(self.tensor_type)
        dims = tuple(reversed(self.shape))  # torch order, as gguf.GGUFReader gives it
        if kind in (_F32, _F16):
            return raw.view(F32 if kind == _F32 else np.float16).reshape(dims)
        if not dims:
            return raw
        return raw.reshape(*dims[:-1], -1)  # quantized and 16-bit rows as bytes, as GGUFReader gives them


class _Header:
    """A cursor over the file's bytes whose every read is checked against what is left."""

    def __init__(self, path: Path, buf, size: int):
        # a memoryview: slicing it costs a fraction of slicing the memmap (150k token strings)
        self.path, self.buf, self.size, self.pos = path, memoryview(buf), size, 0

    def short(self, what) -> ModelError:
        what = what() if callable(what) else what
        return ModelError(f"{self.path}: not a whole GGUF file ({self.size} bytes; its header ends inside {what});"
                          f" it is truncated or corrupt — re-download or re-convert it")

    def too_many(self, what, n: str) -> ModelError:
        what = what() if callable(what) else what
        return ModelError(f"{self.path}: not a whole GGUF file: {what} declares {n}, more than its {self.size}"
                          f" bytes can hold; it is truncated, damaged or not a GGUF — re-download or re-convert it")

    def left(self) -> int:
        return self.size - self.pos

    def take(self, fmt: str, what):
        """`what` (a phrase, or a function that makes it: most reads never fail) names the field."""
        n = struct.calcsize(fmt)
        if n > self.left():
            raise self.short(what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def raw_string(self, what) -> bytes:
        n = self.take("<Q", what)
        if n > self.left():
            raise self.too_many(lambda: f"{what() if callable(what) else what} (a string)", f"{n} bytes")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def name(self, what: str) -> str:
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelError(f"{self.path}: {what} '{inert(raw.decode('utf-8', 'replace'), 60)}' is not UTF-8;"
                             f" the file is damaged or not a GGUF (re-download or re-convert it)") from None

    def value(self, t: int, key: str, depth: int = 0):
        if t in _SCALAR:
            return self.take(_SCALAR[t], lambda: f"the value of '{inert(key, 60)}'")
        if t == _STRING:
            return self.raw_string(lambda: f"metadata key '{inert(key, 60)}'").decode("utf-8", "replace")
        if t != _ARRAY:
            raise self.bad_type(key, t)
        item = self.take("<I", lambda: f"the array '{inert(key, 60)}'")
        n = self.take("<Q", lambda: f"the array '{inert(key, 60)}'")
        if item not in _ITEM_BYTES:
            raise self.bad_type(key, item)
        if n * _ITEM_BYTES[item] > self.left():
            raise self.too_many(f"metadata key '{inert(key, 60)}'", f"an array of {n} elements")
        if item in _NP:
            arr = np.frombuffer(self.buf, dtype=_NP[item], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return (arr != 0) if item == _BOOL else arr
        if item == _STRING:
            return self._strings(n, key)
        if item == _ARRAY and depth + 1 >= _MAX_NEST:
            raise ModelError(f"{self.path}: metadata key '{inert(key, 60)}' nests arrays more than {_MAX_NEST}"
                             f" deep; the file is damaged or not a GGUF (re-download or re-convert it)")
        return [self.value(item, key, depth + 1) for _ in range(n)]

    def _strings(self, n: int, key: str) -> list[str]:
        """An array of n strings (a tokenizer's 150k tokens): value()'s checks in one tight loop."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        length = _U64.unpack_from
        for _ in range(n):
            if pos + 8 > size:
                self.pos = pos
                raise self.short(f"the array '{inert(key, 60)}'")
            (k,) = length(buf, pos)
            pos += 8
            if k > size - pos:
                self.pos = pos
                raise self.too_many(f"metadata key '{inert(key, 60)}' (a string)", f"{k} bytes")
            out.append(str(buf[pos:pos + k], "utf-8", "replace"))
            pos += k
        self.pos = pos
        return out

    def bad_type(self, key: str, t: int) -> ModelError:
        return ModelError(f"{self.path}: metadata key '{inert(key, 60)}' has unknown value type {t}; the file is"
                          f" damaged or of a GGUF version kestrel-tui does not read")


def _parse(path: Path, mm, size: int) -> tuple[dict[str, _Field], dict[str, _Tensor]]:
    gguf = _gguf()
    h = _Header(path, mm, size)
    if h.take("<I", "the magic") != 0x46554747:
        raise ModelError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    version = h.take("<I", "the version")
    if version & 0xFFFF == 0 and version:
        raise ModelError(f"{path}: a GGUF file of the other byte order; convert it on a little-endian machine")
    if version not in _VERSIONS:
        raise ModelError(f"{path}: GGUF version {version}; kestrel-tui reads versions 2 and 3 (re-convert it with"
                         f" a current llama.cpp)")
    n_tensors = h.take("<Q", "the tensor count")
    n_kv = h.take("<Q", "the key count")
    if n_kv * _KV_BYTES > h.left():
        raise h.too_many("its header", f"{n_kv} metadata keys")
    if n_kv * _KV_BYTES + n_tensors * _TI_BYTES > h.left():
        raise h.too_many("its header", f"{n_tensors} tensors")
    fields: dict[str, _Field] = {}
    for _ in range(n_kv):
        key = h.name("a metadata key name")
        if key in fields:
            raise ModelError(f"{path}: metadata key '{inert(key, 60)}' appears twice; the file is damaged"
                             f" (re-convert it)")
        t = h.take("<I", lambda: f"the type of '{inert(key, 60)}'")
        item = struct.unpack_from("<I", mm, h.pos)[0] if t == _ARRAY and h.left() >= 4 else None
        fields[key] = _Field(t, h.value(t, key), item)
    if n_tensors * _TI_BYTES > h.left():
        raise h.too_many("its header", f"{n_tensors} tensors")
    infos = []
    for _ in range(n_tensors):
        name = h.name("a tensor name")
        what = lambda: f"tensor '{inert(name, 60)}'"  # noqa: E731
        n_dims = h.take("<I", what)
        if n_dims > _MAX_DIMS:
            raise ModelError(f"{path}: tensor '{inert(name, 60)}' has {n_dims} dimensions, more than GGML's"
                             f" {_MAX_DIMS}; the file is damaged (re-download or re-convert it)")
        ne = tuple(h.take("<Q", what) for _ in range(n_dims))
        ttype = h.take("<I", what)
        offset = h.take("<Q", what)
        infos.append((name, ne, ttype, offset))
    align = fields.get("general.alignment")
    alignment = 32  # GGUF_DEFAULT_ALIGNMENT
    if align is not None:
        if align.type != 4 or not align.value or align.value & (align.value - 1):
            raise ModelError(f"{path}: general.alignment must be a power of two as a u32 (got {align.value!r});"
                             f" the file is damaged (re-convert it)")
        alignment = align.value
    data_start = -(-h.pos // alignment) * alignment
    tensors: dict[str, _Tensor] = {}
    for name, ne, ttype, offset in infos:
        shown = inert(name, 60)
        if name in tensors:
            raise ModelError(f"{path}: tensor '{shown}' appears twice; the file is damaged (re-convert it)")
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelError(f"{path}: tensor '{shown}' has unknown GGML type id {ttype}; the file is damaged or"
                             f" newer than this gguf package (pip install -U gguf)") from None
        n_elems = math.prod(ne)
        if ne and ne[0] % block:
            raise ModelError(f"{path}: tensor '{shown}' of type {qtype.name} has rows of {ne[0]} values, not a"
                             f" multiple of its block of {block}; the file is damaged (re-convert it)")
        n_bytes = n_elems // block * type_size
        if offset % alignment:
            raise ModelError(f"{path}: tensor '{shown}' starts at data offset {offset}, not a multiple of the"
                             f" alignment {alignment}; the file is damaged (re-convert it)")
        start = data_start + offset
        if start + n_bytes > size:
            raise ModelError(f"{path}: tensor '{shown}' declares {n_bytes} bytes at byte {start}, past the end of"
                             f" the file's {size} bytes; it is truncated or corrupt — re-download or re-convert it")
        tensors[name] = _Tensor(name, qtype, ne, n_bytes, start, mm)
    # tensors may not share bytes: otherwise a small file could declare its data many times over
    end = 0
    for t in sorted(tensors.values(), key=lambda t: t.start):
        if t.n_bytes and t.start < end:
            raise ModelError(f"{path}: tensor '{inert(t.name, 60)}' overlaps the data of another tensor; the file"
                             f" is damaged (re-convert it)")
        end = max(end, t.start + t.n_bytes)
    return fields, tensors


class _File:
    """A GGUF file's metadata and tensors, with one-line errors that name the file."""

    def __init__(self, path: Path):
        _gguf()
        self.path = path
        try:
            with open_regular(path) as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < 24:
                    magic = fh.read(4)
                    if magic != b"GGUF"[:len(magic)] or not magic:
                        raise ModelError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
                    raise ModelError(f"{path}: not a whole GGUF file ({size} bytes; its header ends early); it is"
                                     f" truncated or corrupt — re-download or re-convert it")
                mm = np.memmap(fh, dtype=np.uint8, mode="r")
        except OSError as e:
            raise ModelError(f"{path}: cannot read ({e.strerror}); pass a .gguf file") from None
        self.fields, self.tensors = _parse(path, mm, size)

    def err(self, msg: str) -> ModelError:
        return ModelError(f"{self.path}: {msg}")

    def has(self, key: str) -> bool:
        return key in self.fields

    def count(self, key: str) -> int:
        return self.fields[key].count()

    def _scalar(self, key: str):
        f = self.fields[key]
        if f.type == _ARRAY:
            return f.value.tolist() if isinstance(f.value, np.ndarray) else list(f.value)
        return f.value

    def get(self, key: str, kind: str, default=None, required: bool = True):
        """kind: int | float | bool | str | list."""
        if key not in self.fields:
            if default is not None or not required:
                return default
            raise self.err(f"metadata {key} is missing; the file is not a complete GGUF model (re-convert it)")
        f = self.fields[key]
        t = f.type
        ok = {"int": t in _INTS, "float": t in _FLOATS or t in _INTS, "bool": t == _BOOL,
              "str": t == _STRING, "list": t == _ARRAY}[kind]
        if kind == "int" and t == _ARRAY and f.item in _INTS:
            ok = True  # per-layer values (feed_forward_length): the caller checks they agree
        if not ok:
            raise self.err(f"metadata {key} has the wrong type (GGUF value type {t}); expected {kind}")
        return self._scalar(key)

    def int_(self, key: str, default: int | None = None, required: bool = True) -> int | None:
        val = self.get(key, "int", default, required)
        if isinstance(val, list):
            if not val or any(v != val[0] for v in val):
                raise self.err(f"metadata {key} differs between layers ({val[:8]}); kestrel-tui needs one"
                               f" value for every layer")
            val = val[0]
        return None if val is None else int(val)


def _f32_value(v: float) -> float:
    """A GGUF f32 as the decimal it was written from: the shortest repr that rounds to the same f32
    (1e-06, not 9.99999997e-07), so a Config read back equals the HF one wherever f32 holds it."""
    if not math.isfinite(v) or abs(v) > float(np.finfo(F32).max):
        return float(v)  # an f64 beyond f32 (or inf, NaN): Config.validate refuses it by name
    return float(str(np.float32(v)))


def _config(f: _File, weights: str) -> Config:
    arch = f.get("general.architecture", "str", required=False)
    if arch is None:
        raise f.err("no general.architecture in its metadata; not a GGUF model file")
    if arch not in ARCHS:
        raise f.err(f"general.architecture is '{inert(arch, 60)}'; kestrel-tui reads qwen3 and qwen3moe GGUF files")
    a, moe = arch, arch == "qwen3moe"
    hidden = f.int_(f"{a}.embedding_length")
    n_heads = f.int_(f"{a}.attention.head_count")
    if n_heads <= 0:
        raise f.err(f"metadata {a}.attention.head_count is {n_heads}; it must be > 0")
    head_dim = f.int_(f"{a}.attention.key_length", hidden // n_heads)
    v_len = f.int_(f"{a}.attention.value_length", head_dim)
    if v_len != head_dim:
        raise f.err(f"{a}.attention.value_length {v_len} != key_length {head_dim}; kestrel-tui needs equal"
                    f" K and V head sizes")
    n_rot = f.int_(f"{a}.rope.dimension_count", head_dim)
    if n_rot != head_dim:
        raise f.err(f"{a}.rope.dimension_count {n_rot} != head dim {head_dim}: partial RoPE is not supported")
    scaling = f.get(f"{a}.rope.scaling.type", "str", required=False)
    if scaling not in (None, "", "none"):
        raise f.err(f"{a}.rope.scaling.type is '{inert(scaling, 60)}': only default RoPE is read from GGUF")
    for key in (f"{a}.expert_shared_feed_forward_length", f"{a}.leading_dense_block_count"):
        if f.int_(key, required=False):
            raise f.err(f"metadata {key} = {f.int_(key)} is not supported (no shared experts, no dense layers"
                        f" in a qwen3moe model)")
    gating = f.int_(f"{a}.expert_gating_func", required=False)
    if gating not in (None, 1):
        raise f.err(f"{a}.expert_gating_func {gating} is not supported; Qwen3-MoE routes with softmax (1)")
    if TOKEN_EMBD not in f.tensors:
        raise f.err(f"tensor {TOKEN_EMBD} is missing; the GGUF is incomplete (re-convert it)")
    ne = [int(x) for x in f.tensors[TOKEN_EMBD].shape]
    if len(ne) != 2 or ne[0] != hidden:
        raise f.err(f"tensor {TOKEN_EMBD} has GGUF shape {ne}, expected [{hidden}, vocab]; the file is"
                    f" inconsistent (re-convert it)")
    vocab = ne[1]
    for key in (f"{a}.vocab_size",):
        if f.has(key) and f.int_(key) != vocab:
            raise f.err(f"{key} {f.int_(key)} != the {vocab} rows of {TOKEN_EMBD}; the file is inconsistent")
    if f.has("tokenizer.ggml.tokens"):
        n_tok = f.count("tokenizer.ggml.tokens")
        if n_tok != vocab:
            raise f.err(f"tokenizer.ggml.tokens has {n_tok} entries but {TOKEN_EMBD} {vocab} rows;"
                        f" llama.cpp refuses such a file too (re-convert it)")
    # checked against the blocks present before anything is built per layer: a 27 KB file claiming 10^9
    # blocks would otherwise list 10^10 expected tensors
    n_layers = f.int_(f"{a}.block_count")
    blocks = {int(m.group(1)) for name in f.tensors if (m := _BLOCK.match(name))}
    if n_layers > len(blocks):
        raise f.err(f"metadata {a}.block_count is {n_layers} but the file holds tensors of {len(blocks)} blocks;"
                    f" the file is damaged or inconsistent (re-convert it)")
    cfg = Config(
        arch=ARCHS[arch],
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=f.int_(f"{a}.attention.head_count_kv", n_heads),
        head_dim=head_dim,
        vocab=vocab,
        rope_theta=_f32_value(f.get(f"{a}.rope.freq_base", "float", 10000.0)),
        eps=_f32_value(f.get(f"{a}.attention.layer_norm_rms_epsilon", "float")),
        tie_embeddings=OUTPUT not in f.tensors,
        max_positions=f.int_(f"{a}.context_length"),
        n_experts=f.int_(f"{a}.expert_count") if moe else 0,
        top_k=f.int_(f"{a}.expert_used_count") if moe else 0,
        moe_intermediate=f.int_(f"{a}.expert_feed_forward_length") if moe else 0,
        norm_topk_prob=bool(f.get(f"{a}.expert_weights_norm", "bool", True)) if moe else True,
        intermediate=0 if moe else f.int_(f"{a}.feed_forward_length"),
    )
    try:
        return cfg.validate(weights)
    except ModelError as e:
        raise f.err(f"{str(e).removeprefix('config: ')} (from the GGUF metadata)") from None


_BLOCK = re.compile(r"blk\.(0|[1-9][0-9]{0,8})\.")  # blk.{i}. of a block's tensors (a longer number is no block)


def _expected(cfg: Config, n_layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of cfg has (its first n_layers blocks), name -> torch-order shape."""
    h, hd, E, F = cfg.hidden, cfg.head_dim, cfg.n_experts, cfg.ffn_dim
    out = {TOKEN_EMBD: (cfg.vocab, h), OUTPUT_NORM: (h,)}
    if not cfg.tie_embeddings:
        out[OUTPUT] = (cfg.vocab, h)
    shapes = {"attn_norm": (h,), "attn_q": (cfg.q_dim, h), "attn_k": (cfg.kv_dim, h), "attn_v": (cfg.kv_dim, h),
              "attn_output": (h, cfg.q_dim), "attn_q_norm": (hd,), "attn_k_norm": (hd,), "ffn_norm": (h,)}
    if cfg.is_moe:
        shapes.update({"ffn_gate_inp": (E, h), "ffn_gate_exps": (E, F, h), "ffn_up_exps": (E, F, h),
                       "ffn_down_exps": (E, h, F)})
    else:
        shapes.update({"ffn_gate": (F, h), "ffn_up": (F, h), "ffn_down": (h, F)})
    for i in range(n_layers):
        for name, shape in shapes.items():
            out[f"blk.{i}.{name}.weight"] = shape
    return out


def _check_tensors(f: _File, cfg: Config, n_layers: int) -> dict[str, tuple[int, ...]]:
    """Before any conversion: no tensor we would ignore, every tensor present, of a type we read, in shape."""
    every = _expected(cfg, cfg.n_layers)
    extra = [name for name in f.tensors if name not in every]
    if extra:
        raise f.err(f"tensor {extra[0]} is not part of a {GGUF_ARCH[cfg.arch]} model kestrel-tui can run"
                    f" (attention biases, rope_freqs, dense layers in a MoE model are not supported)")
    need = _expected(cfg, n_layers)
    for name, shape in need.items():
        t = f.tensors.get(name)
        if t is None:
            raise f.err(f"tensor {name} is missing; the GGUF is incomplete or not a {GGUF_ARCH[cfg.arch]}"
                        f" model (re-convert it)")
        if int(t.tensor_type) not in _SUPPORTED:
            raise f.err(f"tensor {name} is {t.tensor_type.name}: not supported; re-quantize with llama-quantize"
                        f" to Q4_0 or Q8_0 (with --pure, so that no tensor gets a k-quant), or convert to F16")
        got = [int(x) for x in t.shape]
        if got != _ne(shape):
            raise f.err(f"tensor {name} has GGUF shape {got}, expected {_ne(shape)} from the metadata;"
                        f" the file is inconsistent (re-convert it)")
    return need


def _widen(t, sl=()) -> np.ndarray:
    """A tensor (or the expert t.data[sl]) as a fresh f32 array in torch order; exact for every type we read.
    An infinite scale times a zero code makes NaN without a warning: the caller refuses non-finite values."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _widen_raw(t, sl)


def _widen_raw(t, sl=()) -> np.ndarray:
    data = np.asarray(t.data[sl])
    kind = int(t.tensor_type)
    if kind == _F32:
        w = np.array(data, dtype=F32)
    elif kind == _F16:
        w = data.astype(F32)
    elif kind == _BF16:
        w = (np.ascontiguousarray(data).view("<u2").astype(np.uint32) << np.uint32(16)).view(F32)
    elif kind == _Q8_0:
        blocks = np.ascontiguousarray(data).reshape(*data.shape[:-1], -1, 34)
        d = blocks[..., :2].copy().view("<f2").astype(F32)  # [..., nb, 1]
        w = (blocks[..., 2:].view(np.int8).astype(F32) * d).reshape(*data.shape[:-1], -1)
    else:  # Q4_0 (a norm weight stored as q4_0, or --weights f32 of a matrix)
        n = data.shape[-1] // 18 * QK
        rows = np.ascontiguousarray(data).reshape(-1, data.shape[-1])
        w = _linear_from_q4_bytes(rows, rows.shape[0], n, "f32").w.reshape(*data.shape[:-1], n)
    return w


class _Reader:
    def __init__(self, f: _File, weights: str, tally: Tally):
        self.f, self.fmt, self.tally = f, weights, tally

    def _counted(self, name: str, value):
        self.tally.read(int(self.f.tensors[name].n_bytes), True)
        return value

    def _finite(self, name: str, w: np.ndarray) -> np.ndarray:
        if not np.isfinite(w).all():
            raise self.f.err(f"tensor {name} contains NaN or inf values; the file is corrupt")
        return w

    def vector(self, name: str) -> np.ndarray:
        return self._counted(name, self._finite(name, _widen(self.f.tensors[name])))

    def linear(self, name: str, shape: tuple[int, ...]) -> Linear:
        try:
            return self._counted(name, self._linear(name, shape))
        except RangeError as e:
            raise self.f.err(f"tensor {name}: {e}") from None

    def _linear(self, name: str, shape: tuple[int, ...]) -> Linear:
        t = self.f.tensors[name]
        out, inp = shape[-2:]
        if int(t.tensor_type) == _Q4_0:
            raw = np.asarray(t.data)
            scales = raw.reshape(-1, 18)[:, :2].copy().view("<f2")
            self._finite(name, scales)
            return _linear_from_q4_bytes(raw, out, inp, self.fmt)
        if len(shape) == 2 or self.fmt == "f32":
            if len(shape) == 2:  # a bounded number of rows at a time: a vocabulary-sized F16 matrix
                return linear_from_rows(  # never exists whole in f32 (the bytes equal make_linear's)
                    lambda r0, r1: self._finite(name, _widen(t, slice(r0, r1))), out, inp, self.fmt)
            w = np.empty(shape, F32)
            for e in range(shape[0]):
                w[e] = self._finite(name, _widen(t, e))
            return make_linear(w, "f32")
        # an expert stack to q4_0: expert by expert (q4_0 blocks never span rows, so this equals
        # quantizing the stack), through ggml bytes so that only the adaptors know the layout
        raw = np.stack([_q4_bytes(make_linear(self._finite(name, _widen(t, e)), "q4_0"))
                        for e in range(shape[0])])
        return _linear_from_q4_bytes(raw, out, inp, self.fmt)


def tensor_types(path: str | Path) -> set[int]:
    """The GGML type ids of a GGUF file's tensors, read with the header's bounds (gguf.GGUFReader would
    follow any count the file declares); ModelError for a file that is not a sound GGUF."""
    return {int(t.tensor_type) for t in _File(Path(path)).tensors.values()}


def load_gguf_model(path: str | Path, weights: str = "q4_0", kv: str | None = None,
                    n_layers: int | None = None, notes: list[str] | None = None,
                    progress: Progress | None = None) -> Model:
    """Load a qwen3 / qwen3moe GGUF file; weights "q4_0" or "f32" (see the module docstring).

    `kv` is accepted for symmetry with load_hf_model and unused; `n_layers` keeps the first n
    layers; `notes` (when given) receives one line per thing the user should know (a tokenizer
    that was not used); `progress` is called as tensors are read (model/progress.py)."""
    if weights not in FORMATS:
        raise ModelError(f"weights {weights!r}: unknown format; use one of {', '.join(FORMATS)}")
    path = Path(path)
    if is_partial_name(path):
        raise ModelError(f"{path}: a .partial file (writing it stopped part way); export the model again")
    try:
        st = path.stat()
    except OSError:
        raise ModelError(f"{path}: no such GGUF file") from None
    if not S_ISREG(st.st_mode):
        raise ModelError(f"{path}: {kind_of(st.st_mode)}, not a GGUF file; pass a .gguf file")
    f = _File(path)
    cfg = _config(f, weights)
    keep = cfg.n_layers
    if n_layers is not None:
        if not 0 < n_layers <= cfg.n_layers:
            raise ModelError(f"n_layers {n_layers}: the GGUF has {cfg.n_layers} layers; pick 1..{cfg.n_layers}")
        keep = n_layers
    shapes = _check_tensors(f, cfg, keep)
    cfg = replace(cfg, n_layers=keep)
    tensors = list(f.tensors.values())
    rd = _Reader(f, weights, Tally(progress, len(tensors), sum(int(t.n_bytes) for t in tensors)))
    layers = []
    for i in range(keep):
        p = f"blk.{i}."
        fields: dict[str, object] = {"gate": None}
        for gname, field in {**BLOCK_COMMON, **(BLOCK_MOE if cfg.is_moe else BLOCK_DENSE)}.items():
            name = f"{p}{gname}.weight"
            shape = shapes[name]
            fields[field] = rd.vector(name) if len(shape) == 1 else rd.linear(name, shape)
        layers.append(Layer(**fields))
    embed = rd.linear(TOKEN_EMBD, shapes[TOKEN_EMBD])
    lm_head = embed if cfg.tie_embeddings else rd.linear(OUTPUT, shapes[OUTPUT])
    norm = rd.vector(OUTPUT_NORM)
    rd.tally.finish()
    tokenizer, note = _read_tokenizer(f)
    if note and notes is not None:
        notes.append(note)
    name = f.get("general.name", "str", required=False) or path.stem
    inv_freq, scale = rope_tables(cfg)
    return Model(cfg=cfg, fmt=weights, name=name, embed_tokens=embed, layers=tuple(layers), norm=norm,
                 lm_head=lm_head, inv_freq=inv_freq, attn_scale=scale, tokenizer=tokenizer,
                 notes=(note,) if note else ())


def _read_tokenizer(f: _File):
    """(tokenizers.Tokenizer or None, a note or None) from the GGUF's tokenizer metadata."""
    if f.get(SYNTHETIC_KEY, "bool", required=False):
        return None, None  # our stand-in for a model without tokenizer (the embedded default)
    if not f.has("tokenizer.ggml.model") and not f.has("tokenizer.huggingface.json"):
        return None, None
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    except ImportError:
        return None, f"{NO_TOKENIZER} (the tokenizers package is not installed)"
    if f.has("tokenizer.huggingface.json"):
        try:
            return Tokenizer.from_str(f.get("tokenizer.huggingface.json", "str")), None
        except Exception as e:
            return None, f"{NO_TOKENIZER} (tokenizer.huggingface.json: {_one_line(e)})"
    model = f.get("tokenizer.ggml.model", "str")
    pre = f.get("tokenizer.ggml.pre", "str", required=False)
    if model == "no_vocab" or model == "none":
        return None, None
    if model != "gpt2" or pre != "qwen2":
        return None, (f"{NO_TOKENIZER} (tokenizer.ggml.model '{inert(model, 60)}', pre '{inert(pre, 60)}': only Qwen's byte-level BPE,"
                      f" gpt2 + qwen2, is rebuilt)")
    tokens = f.get("tokenizer.ggml.tokens", "list", required=False) or []
    merges = f.get("tokenizer.ggml.merges", "list", required=False) or []
    types = f.get("tokenizer.ggml.token_type", "list", required=False) or [_NORMAL] * len(tokens)
    if not all(isinstance(t, str) for t in (*tokens, *merges)) or not all(isinstance(t, int) for t in types):
        return None, f"{NO_TOKENIZER} (its token list, types or merges are arrays of the wrong type)"
    pairs = [tuple(m.split(" ")) for m in merges]
    used = [(t, i) for i, (t, ty) in enumerate(zip(tokens, types)) if ty != _UNUSED]  # padding rows: no token
    vocab = dict(used)
    if not tokens or len(vocab) != len(used) or len(types) != len(tokens) or any(len(p) != 2 for p in pairs):
        return None, f"{NO_TOKENIZER} (its token list or merges are not a byte-level BPE vocabulary)"
    try:
        tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        added = [AddedToken(t, special=ty == _CONTROL, normalized=False)
                 for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])
    except Exception as e:
        return None, f"{NO_TOKENIZER} ({_one_line(e)})"
    return tok, None


# ---------------------------------------------------------------- writing

def _check_exportable(model: Model) -> None:
    cfg = model.cfg
    what = None
    if getattr(cfg, "is_mixed", False):
        what = "dense MLP layers inside a qwen3moe model (llama.cpp's qwen3moe has none)"
    elif getattr(cfg, "attention_bias", False):
        what = "attention biases (llama.cpp's qwen3 has none)"
    elif getattr(cfg, "yarn", None) is not None:
        what = "yarn RoPE (not written to GGUF yet)"
    if what:
        raise ModelError(f"{model.name}: {what}: this model cannot be exported as GGUF")


def _tokenizer_keys(tok, vocab: int, notes: list[str]) -> dict[str, object] | None:
    """tokenizer.ggml.* for a byte-level BPE tokenizers.Tokenizer, as llama.cpp's converter writes them."""
    try:
        spec = json.loads(tok.to_str())
    except Exception:
        spec = {}
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        notes.append(f"the tokenizer ({model.get('type', 'unknown')}) is not a byte-level BPE: the GGUF gets none"
                     f" (no_vocab)")
        return None
    ids = tok.get_vocab(with_added_tokens=True)
    if any(i >= vocab for i in ids.values()):
        notes.append(f"the tokenizer has ids beyond the {vocab} embedding rows: the GGUF gets none (no_vocab)")
        return None
    tokens: list[str | None] = [None] * vocab
    for t, i in ids.items():
        tokens[i] = t
    special = {a["id"]: bool(a.get("special")) for a in spec.get("added_tokens", [])}
    types = []
    for i, t in enumerate(tokens):
        if t is None:  # embedding rows past the tokenizer: llama.cpp's converter pads them the same way
            tokens[i] = f"[PAD{i}]"
            types.append(_UNUSED)
        elif i in special:
            types.append(_CONTROL if special[i] else _USER_DEFINED)
        elif t == f"[PAD{i}]":  # a padding row of a tokenizer read from a GGUF
            types.append(_UNUSED)
        else:
            types.append(_NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = "qwen2" if _is_qwen2(spec) else "default"
    if pre != "qwen2":
        notes.append("the tokenizer's pre-tokenizer is not Qwen2's: written as 'default', which neither llama.cpp"
                     " nor kestrel-tui reproduces exactly (token ids are exact; text may tokenize differently)")
    keys: dict[str, object] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                               "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                               "tokenizer.ggml.merges": merges}
    eos = ids.get("<|endoftext|>")
    if eos is not None:  # Qwen's end of text; llama.cpp would otherwise take id 11 for a gpt2 vocabulary
        keys["tokenizer.ggml.eos_token_id"] = eos
        keys["tokenizer.ggml.padding_token_id"] = eos
    return keys


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0..255."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
          *range(ord("\u00ae"), ord("\u00ff") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:  # the bytes that are not printable stand for 256, 257, …
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _synthetic_vocab(vocab: int) -> dict[str, object]:
    """A stand-in vocabulary for a model without tokenizer: llama.cpp refuses a file without one, and
    its "no_vocab" type loads but aborts in every tool that prints a token. Ids below 256 are the 256
    byte tokens of a byte-level BPE (so any text tokenizes, byte by byte), the others "<id>"; one merge,
    because llama.cpp requires the key and the gguf package drops an empty array."""
    chars = _byte_chars()
    tokens = [chars[i] if i < 256 else f"<{i}>" for i in range(vocab)]
    return {SYNTHETIC_KEY: True, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [_NORMAL] * vocab,
            "tokenizer.ggml.merges": [f"{chars[ord('<')]} {chars[ord('>')]}"]}


def _is_qwen2(spec: dict) -> bool:
    pre = spec.get("pre_tokenizer") or {}
    seq = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not seq or len(seq) != 2:
        return False
    split, bl = seq
    return (split.get("type") == "Split" and (split.get("pattern") or {}).get("Regex") == QWEN2_REGEX
            and str(split.get("behavior")).lower() == "isolated" and not split.get("invert")
            and bl.get("type") == "ByteLevel" and not bl.get("add_prefix_space") and not bl.get("use_regex", True))


def _plan(model: Model):
    """(GGUF name, torch-order shape, "q4_0" | "f32", producer of the array to write) in file order."""
    cfg = model.cfg

    def lin(name: str, lin_: Linear, shape: tuple[int, ...]):
        if lin_.w is not None:
            return name, shape, "f32", lambda: np.ascontiguousarray(lin_.w, dtype=F32)
        return name, shape, "q4_0", lambda: np.ascontiguousarray(_q4_bytes(lin_))

    def vec(name: str, v: np.ndarray):
        return name, tuple(v.shape), "f32", lambda: np.ascontiguousarray(v, dtype=F32)

    shapes = _expected(cfg, cfg.n_layers)
    yield lin(TOKEN_EMBD, model.embed_tokens, shapes[TOKEN_EMBD])
    yield vec(OUTPUT_NORM, model.norm)
    if not cfg.tie_embeddings:
        yield lin(OUTPUT, model.lm_head, shapes[OUTPUT])
    for i, L in enumerate(model.layers):
        for gname, field in {**BLOCK_COMMON, **(BLOCK_MOE if cfg.is_moe else BLOCK_DENSE)}.items():
            name = f"blk.{i}.{gname}.weight"
            val = getattr(L, field)
            yield vec(name, val) if isinstance(val, np.ndarray) else lin(name, val, shapes[name])


def write_gguf(model: Model, path: str | Path) -> list[str]:
    """Write `model` as a llama.cpp-loadable GGUF file at `path` (new; whole or not there).

    Matrices go in the model's format (q4_0 -> Q4_0, f32 -> F32), norms as F32. Returns notes:
    one line per thing the user should know (e.g. a setting llama.cpp ignores)."""
    gguf = _gguf()
    _check_exportable(model)
    cfg, a = model.cfg, GGUF_ARCH[model.cfg.arch]
    notes: list[str] = []
    kv: list[tuple[str, str, object]] = [  # (key, type, value)
        ("general.name", "str", model.name),
        ("general.file_type", "u32", _FILE_TYPE[model.fmt]),
        ("general.quantization_version", "u32", _QUANT_VERSION),
        (f"{a}.block_count", "u32", cfg.n_layers),
        (f"{a}.context_length", "u32", cfg.max_positions),
        (f"{a}.embedding_length", "u32", cfg.hidden),
        (f"{a}.feed_forward_length", "u32", cfg.ffn_dim),
        (f"{a}.attention.head_count", "u32", cfg.n_heads),
        (f"{a}.attention.head_count_kv", "u32", cfg.n_kv_heads),
        (f"{a}.attention.key_length", "u32", cfg.head_dim),
        (f"{a}.attention.value_length", "u32", cfg.head_dim),
        (f"{a}.rope.freq_base", "f32", cfg.rope_theta),
        (f"{a}.attention.layer_norm_rms_epsilon", "f32", cfg.eps),
        (f"{a}.vocab_size", "u32", cfg.vocab),
    ]
    if cfg.is_moe:
        kv += [(f"{a}.expert_count", "u32", cfg.n_experts), (f"{a}.expert_used_count", "u32", cfg.top_k),
               (f"{a}.expert_feed_forward_length", "u32", cfg.moe_intermediate),
               (f"{a}.expert_weights_norm", "bool", cfg.norm_topk_prob)]
        if not cfg.norm_topk_prob:
            notes.append("norm_topk_prob is false: written as qwen3moe.expert_weights_norm=false, which kestrel-tui"
                         " reads back but llama.cpp ignores (its qwen3moe always renormalises the top-k weights)")
    if float(np.float32(cfg.rope_theta)) != cfg.rope_theta:
        notes.append(f"rope_theta {cfg.rope_theta} is not exact in f32 (GGUF's type for it): the file holds"
                     f" {float(np.float32(cfg.rope_theta))!r}, so its RoPE tables differ in the last bits")
    tok = _tokenizer_keys(model.tokenizer, cfg.vocab, notes) if model.tokenizer is not None else None
    if tok is None:
        tok = _synthetic_vocab(cfg.vocab)
    kv += [(k, "bool" if k == SYNTHETIC_KEY else "u32" if k.endswith("_id") else "str" if isinstance(v, str)
            else "list", v) for k, v in tok.items()]
    plan = list(_plan(model))
    Q4_0 = gguf.GGMLQuantizationType.Q4_0
    with create_whole_path(path, what="GGUF file") as tmp:
        w = gguf.GGUFWriter(tmp, a)
        try:
            for key, kind, val in kv:
                {"str": w.add_string, "u32": w.add_uint32, "f32": w.add_float32, "bool": w.add_bool,
                 "list": w.add_array}[kind](key, val)
            for name, shape, kind, _ in plan:
                n = int(np.prod(shape, dtype=np.int64))
                if kind == "q4_0":
                    w.add_tensor_info(name, (*shape[:-1], shape[-1] // QK * 18), np.dtype(np.uint8), n // QK * 18,
                                      raw_dtype=Q4_0)
                else:
                    w.add_tensor_info(name, shape, np.dtype(F32), 4 * n)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for _, _, _, make in plan:  # one tensor's bytes in memory at a time
                w.write_tensor_data(make())
        finally:
            w.close()
    return notes
