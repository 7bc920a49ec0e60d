"""HF checkpoints: a model directory (config.json + *.safetensors [+ tokenizer.json]) -> Model.

Sharded checkpoints: when model.safetensors.index.json is present its weight_map says which shard
holds each tensor (see _Checkpoint); otherwise every *.safetensors file of the directory is read.

Tensors are read one at a time from the safetensors files (`safe_open`,
framework "numpy"), widened to f32 and, for `--weights q4_0`, quantized at
once into ggml's q4_0 bytes; matrices are read a bounded number of rows at a
time (weights.linear_from_rows; expert stacks one expert at a time), so only a
few MB of f32 are alive next to the model being built. bf16 is not a numpy dtype: its raw bytes are
read at the offsets in the file header and widened exactly (the 16 bits go
into the top half of a uint32). f16 and f32 are read directly.

Tensor names (HF transformers `qwen3_moe` / `qwen3`):

* `model.embed_tokens.weight` [vocab, hidden], `model.norm.weight` [hidden],
  `lm_head.weight` [vocab, hidden] (absent and tied to the embedding when
  `tie_word_embeddings` is true; a tied checkpoint's lm_head is ignored).
* per layer `model.layers.{i}.`: `input_layernorm.weight`,
  `post_attention_layernorm.weight` [hidden], `self_attn.{q,k,v,o}_proj.weight`,
  `self_attn.{q,k}_norm.weight` [head_dim].
* dense `qwen3`: `mlp.{gate,up}_proj.weight` [ffn, hidden], `mlp.down_proj.weight`
  [hidden, ffn].
* `attention_bias`: `self_attn.{q,k,v,o}_proj.bias` [out] (kept f32).
* a qwen3_moe layer that is dense (`mlp_only_layers`, `decoder_sparse_step`;
  Config.layer_is_moe) has the dense names below with `intermediate_size`.
* `qwen3_moe`: the router `mlp.gate.weight` [E, hidden] and the experts in one
  of two layouts:
  - **per expert** (what `save_pretrained` writes, transformers 4.x and 5.x —
    5.x converts its fused in-memory parameters back on save):
    `mlp.experts.{e}.{gate,up}_proj.weight` [ffn, hidden],
    `mlp.experts.{e}.down_proj.weight` [hidden, ffn];
  - **fused** (transformers 5.x's in-memory `state_dict()`, e.g. a checkpoint
    written with `safetensors.torch.save_file(model.state_dict())`):
    `mlp.experts.gate_up_proj` [E, 2*ffn, hidden] — rows [0, ffn) are gate,
    rows [ffn, 2*ffn) are up (`linear(x, W).chunk(2, dim=-1)`) — and
    `mlp.experts.down_proj` [E, hidden, ffn].
  Both become stacks [E, out, in].
"""
from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..readers import LimitError, check_regular, open_regular, parse_json, read_regular
from .config import ModelError, default_config, load_config
from .progress import Progress, Tally
from .quant import BLOCK_BYTES, RangeError, quantize_q4_0_ggml
from .weights import FORMATS, Layer, Linear, Model, linear_from_rows, rope_tables, synthetic_model

F32 = np.float32
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


INDEX = "model.safetensors.index.json"
INDEX_MAX = 256 << 20  # the index of a 10^5-tensor checkpoint is about 10 MB
_HEADER_MAX = 100_000_000  # the safetensors library's own cap on a header
_LAYER = re.compile(r"model\.layers\.(0|[1-9][0-9]{0,8})\.")  # a longer number is no layer


class _Checkpoint:
    """Every tensor of the checkpoint by name; reads one at a time as f32.

    With model.safetensors.index.json (what save_pretrained writes for a sharded model) its weight_map
    is the authority: each tensor is read from the shard it names, and other *.safetensors files in the
    directory are not opened. Without it, every *.safetensors file is read and a name held twice is an
    error."""

    def __init__(self, model_dir: Path, stack: ExitStack, progress: Progress | None = None):
        try:
            from safetensors import safe_open
        except ImportError:
            raise ModelError("reading HF checkpoints needs the safetensors package; pip install safetensors"
                             " (or pip install kestrel-tui[hf])") from None
        self.dir = model_dir
        self.where: dict[str, tuple[Path, object]] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        index = model_dir / INDEX
        weight_map = self._weight_map(index) if index.exists() else None  # a FIFO there is refused, not skipped
        if weight_map is None:
            files = sorted(model_dir.glob("*.safetensors"))
        else:
            by_shard: dict[Path, list[str]] = {}
            for name, shard in weight_map.items():
                by_shard.setdefault(model_dir / shard, []).append(name)
            files = list(by_shard)  # in index order
            for path in files:
                if not path.is_file():
                    raise ModelError(f"{path.name}: named in {index} but missing from {model_dir};"
                                     f" download that shard again")
        if not files:
            raise ModelError(f"{model_dir}: no *.safetensors files; an HF model directory needs its weights"
                             f" as safetensors (convert .bin/.pt checkpoints with transformers' save_pretrained)")
        for path in files:
            try:  # safe_open opens by name: a FIFO there would block it, a device feed it without end
                check_regular(path)
            except OSError as e:
                raise ModelError(f"{path}: cannot read ({e.strerror}); a checkpoint's weights are regular"
                                 f" .safetensors files") from None
            try:
                handle = stack.enter_context(safe_open(str(path), framework="numpy"))
                names = list(handle.keys())
            except Exception as e:  # safetensors raises its own error type for a corrupt file
                raise ModelError(f"{path}: not a readable safetensors file ({_one_line(e)});"
                                 f" re-download or re-export it") from None
            if weight_map is not None:
                held = set(names)
                names = by_shard[path]
                for name in names:
                    if name not in held:
                        raise ModelError(f"{name}: {INDEX} puts it in {path.name}, which does not hold it;"
                                         f" that shard is stale or truncated, download it again")
            for name in names:
                if name in self.where:
                    raise ModelError(f"{name}: present in both {self.where[name][0].name} and {path.name};"
                                     f" remove the stale file from {model_dir}")
                self.where[name] = (path, handle)
        self.tally = Tally(progress, len(self.where), sum(self._nbytes(n) for n in self.where))

    def _nbytes(self, name: str) -> int:
        path, _ = self.where[name]
        start, end = self._header(path)[1][name]["data_offsets"]
        return end - start

    @staticmethod
    def _weight_map(index: Path) -> dict[str, str]:
        try:
            raw = parse_json(read_regular(index, INDEX_MAX, INDEX).decode("utf-8"))
        except OSError as e:
            raise ModelError(f"{index}: cannot read ({e.strerror}); re-download it") from None
        except LimitError as e:
            raise ModelError(f"{index}: {e}; the file is damaged, re-download it") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelError(f"{index}: not valid JSON ({_one_line(e)}); re-download it") from None
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ModelError(f"{index}: no \"weight_map\" of tensor name -> shard file; re-download it")
        for shard in wm.values():
            p = Path(shard)
            if p.is_absolute() or ".." in p.parts or not shard.endswith(".safetensors"):
                raise ModelError(f"{index}: shard {shard!r} is not a .safetensors file inside the model"
                                 f" directory; re-download the index")
        return wm

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _header(self, path: Path) -> tuple[int, dict]:
        if path not in self._headers:
            # safe_open has checked this header already; the bounds keep a file changed since from costing more
            try:
                with open_regular(path) as f:
                    size = os.fstat(f.fileno()).st_size
                    n = int.from_bytes(f.read(8), "little")
                    if n > min(size - 8, _HEADER_MAX):
                        raise ModelError(f"{path}: its header declares {n} bytes, more than the file's {size}"
                                         f" hold; the file is corrupt, re-download it")
                    header = parse_json(f.read(n))
            except (OSError, ValueError) as e:
                raise ModelError(f"{path}: not a readable safetensors file ({_one_line(e)});"
                                 f" re-download or re-export it") from None
            self._headers[path] = (8 + n, header)
        return self._headers[path]

    def check(self, name: str, shape: tuple[int, ...], hint: str = "") -> None:
        """Presence, shape and dtype, from the header alone: asked before a buffer of `shape` (sizes that
        come from config.json) is allocated, so a config claiming vocab_size 10^12 costs nothing."""
        if name not in self.where:
            self.get(name, shape, hint)  # raises the missing-tensor error
        sl = self.where[name][1].get_slice(name)
        if tuple(sl.get_shape()) != tuple(shape) or sl.get_dtype() not in _DTYPES:
            self.get(name, shape, hint)  # raises the shape or dtype error, having read nothing

    def get(self, name: str, shape: tuple[int, ...], hint: str = "",
            rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor as a fresh f32 array, checked for presence, shape, dtype and finiteness.
        rows=(r0, r1): only rows r0..r1-1 of the first axis are read (the shape check is the whole
        tensor's) — how the loader streams a vocabulary-sized matrix without an f32 copy of it."""
        if name not in self.where:
            where = f" (and from {INDEX})" if (self.dir / INDEX).is_file() else ""
            raise ModelError(f"{name}: missing from the checkpoint in {self.dir}{where}{hint};"
                             f" the safetensors files do not match config.json (re-export the model)")
        path, handle = self.where[name]
        sl = handle.get_slice(name)
        got, dtype = tuple(sl.get_shape()), sl.get_dtype()
        if got != tuple(shape):
            raise ModelError(f"{name}: wrong shape, expected {_fmt_shape(shape)} from config.json but"
                             f" {path.name} has {_fmt_shape(got)}; the checkpoint does not match its config.json")
        if dtype not in _DTYPES:
            raise ModelError(f"{name}: dtype {dtype} is not supported (in {path.name}); convert the checkpoint"
                             f" to bf16, f16 or f32 (e.g. load it in transformers and save_pretrained)")
        if dtype == "BF16":
            base, header = self._header(path)
            start, end = header[name]["data_offsets"]
            n = int(np.prod(shape, dtype=np.int64))
            if end - start != 2 * n:
                raise ModelError(f"{name}: {path.name} holds {end - start} bytes for {n} bf16 values;"
                                 f" the file is corrupt, re-download it")
            r0, r1 = rows if rows is not None else (0, shape[0])
            per_row = n // shape[0] if shape[0] else 0
            raw = np.fromfile(path, dtype="<u2", count=(r1 - r0) * per_row, offset=base + start + 2 * r0 * per_row)
            w = (raw.astype(np.uint32) << np.uint32(16)).view(F32).reshape(r1 - r0, *shape[1:])
        else:
            # a fresh, writable array (not a view of the file)
            w = handle.get_tensor(name) if rows is None else sl[rows[0]:rows[1]]
            w = w.astype(F32) if w.dtype != F32 else np.ascontiguousarray(w)
        if not np.isfinite(w).all():
            raise ModelError(f"{name}: contains NaN or inf values (in {path.name}); the checkpoint is corrupt")
        whole = rows is None or rows[1] >= shape[0]
        self.tally.read(self._nbytes(name) * (1 if rows is None else rows[1] - rows[0]) // max(shape[0], 1), whole)
        return w


def _experts(ck: _Checkpoint, p: str, E: int, F: int, H: int, fmt: str) -> tuple[Linear, Linear, Linear]:
    """gate_proj, up_proj [E, F, H] and down_proj [E, H, F], from either checkpoint layout."""
    per_expert = f"{p}mlp.experts.0.gate_proj.weight" in ck
    fused = not per_expert and f"{p}mlp.experts.gate_up_proj" in ck
    shapes = {"gate": (F, H), "up": (F, H), "down": (H, F)}
    # every expert tensor is checked before the stacks are allocated from config.json's sizes
    if fused:
        ck.check(f"{p}mlp.experts.gate_up_proj", (E, 2 * F, H))
        ck.check(f"{p}mlp.experts.down_proj", (E, H, F))
    else:
        hint = f" (nor the fused {p}mlp.experts.gate_up_proj)" if not per_expert else ""
        if 3 * E > len(ck.where):
            raise ModelError(f"{p}mlp.experts: config.json says num_experts {E}, more than the {len(ck.where)}"
                             f" tensors of the checkpoint in {ck.dir} can hold (3 per expert); the checkpoint does"
                             f" not match its config.json")
        for e in range(E):
            for kind in ("gate", "up", "down"):
                ck.check(f"{p}mlp.experts.{e}.{kind}_proj.weight", shapes[kind], hint)
    if fmt == "f32":
        bufs = {k: np.empty((E, *s), F32) for k, s in shapes.items()}
    else:  # ggml q4_0 bytes [E, out, nb, 18], filled expert by expert
        bufs = {k: np.empty((E, s[0], s[1] // 32, BLOCK_BYTES), np.uint8) for k, s in shapes.items()}

    def put(kind: str, e: int, w: np.ndarray) -> None:
        if fmt == "f32":
            bufs[kind][e] = w
        else:  # per-expert quantization == quantizing the stack (q4_0 blocks never span rows)
            try:
                quantize_q4_0_ggml(w, out=bufs[kind][e])
            except RangeError as err:
                raise ModelError(f"{p}mlp.experts.{e}.{kind}_proj (in {ck.dir}): {err}") from None

    if fused:  # read one expert at a time: the stacks are never whole in f32
        for e in range(E):
            gu = ck.get(f"{p}mlp.experts.gate_up_proj", (E, 2 * F, H), rows=(e, e + 1))[0]
            put("gate", e, gu[:F])
            put("up", e, gu[F:])
        for e in range(E):
            put("down", e, ck.get(f"{p}mlp.experts.down_proj", (E, H, F), rows=(e, e + 1))[0])
    else:
        hint = f" (nor the fused {p}mlp.experts.gate_up_proj)" if not per_expert else ""
        for e in range(E):
            for kind in ("gate", "up", "down"):
                name = f"{p}mlp.experts.{e}.{kind}_proj.weight"
                put(kind, e, ck.get(name, shapes[kind], hint))

    def lin(kind: str) -> Linear:
        out, inp = shapes[kind]
        if fmt == "f32":
            return Linear(out, inp, w=bufs[kind])
        return Linear(out, inp, blocks=bufs[kind])

    return lin("gate"), lin("up"), lin("down")


def _load_tokenizer(model_dir: Path):
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    try:
        check_regular(path)
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror}); remove it to run on token ids") from None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # text is optional: token ids still work
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise ModelError(f"{path}: not a valid tokenizers file ({_one_line(e)}); re-download it or remove it"
                         f" to run on token ids") from None


def load_hf_model(model_dir: str | Path, weights: str = "q4_0", kv: str | None = None,
                  n_layers: int | None = None, progress: Progress | None = None) -> Model:
    """Load an HF Qwen3-MoE / Qwen3 directory; weights "q4_0" (quantized at load) or "f32".

    `kv` is accepted for symmetry with the CLI and unused (the KV format belongs to
    the backend). `n_layers` keeps only the first n layers; `progress` is called as tensors
    are read (model/progress.py).
    """
    if weights not in FORMATS:
        raise ModelError(f"weights {weights!r}: unknown format; use one of {', '.join(FORMATS)}")
    model_dir = Path(model_dir)
    cfg = load_config(model_dir, weights)
    if n_layers is not None:
        if not 0 < n_layers <= cfg.n_layers:
            raise ModelError(f"n_layers {n_layers}: the checkpoint has {cfg.n_layers} layers; pick 1..{cfg.n_layers}")
        cfg = replace(cfg, n_layers=n_layers)
    h, hd = cfg.hidden, cfg.head_dim
    with ExitStack() as stack:
        ck = _Checkpoint(model_dir, stack, progress)

        present = {int(m.group(1)) for name in ck.where if (m := _LAYER.match(name))}
        if cfg.n_layers > len(present):
            kept = "" if n_layers is None else f" (of the {n_layers} asked for)"
            raise ModelError(f"{model_dir / 'config.json'}: num_hidden_layers is {cfg.n_layers}{kept} but the"
                             f" checkpoint holds tensors of {len(present)} layers; the safetensors files do not"
                             f" match config.json (re-export the model)")

        def lin(name: str, shape: tuple[int, int]) -> Linear:
            ck.check(name, shape)  # before the result is allocated from config.json's sizes
            # read and quantized a bounded number of rows at a time: a vocabulary-sized matrix
            # never exists whole in f32 (the bytes equal quantizing it at once)
            try:
                return linear_from_rows(lambda r0, r1: ck.get(name, shape, rows=(r0, r1)), *shape, weights)
            except RangeError as e:
                raise ModelError(f"{name} (in {model_dir}): {e}") from None

        layers = []
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            if cfg.layer_is_moe(i):
                gate = lin(p + "mlp.gate.weight", (cfg.n_experts, h))
                ffn = _experts(ck, p, cfg.n_experts, cfg.moe_intermediate, h, weights)
            else:  # dense qwen3, or a qwen3_moe layer in mlp_only_layers / off decoder_sparse_step
                f = cfg.intermediate
                gate = None
                ffn = (lin(p + "mlp.gate_proj.weight", (f, h)), lin(p + "mlp.up_proj.weight", (f, h)),
                       lin(p + "mlp.down_proj.weight", (h, f)))
            bias = {}
            if cfg.attention_bias:  # vectors: kept f32 in both weight formats
                for proj, n in (("q", cfg.q_dim), ("k", cfg.kv_dim), ("v", cfg.kv_dim), ("o", h)):
                    bias[f"{proj}_bias"] = ck.get(f"{p}self_attn.{proj}_proj.bias", (n,),
                                                  " (config.json has attention_bias: true)")
            layers.append(Layer(
                input_layernorm=ck.get(p + "input_layernorm.weight", (h,)),
                post_attention_layernorm=ck.get(p + "post_attention_layernorm.weight", (h,)),
                q_norm=ck.get(p + "self_attn.q_norm.weight", (hd,)),
                k_norm=ck.get(p + "self_attn.k_norm.weight", (hd,)),
                q_proj=lin(p + "self_attn.q_proj.weight", (cfg.q_dim, h)),
                k_proj=lin(p + "self_attn.k_proj.weight", (cfg.kv_dim, h)),
                v_proj=lin(p + "self_attn.v_proj.weight", (cfg.kv_dim, h)),
                o_proj=lin(p + "self_attn.o_proj.weight", (h, cfg.q_dim)),
                gate=gate, gate_proj=ffn[0], up_proj=ffn[1], down_proj=ffn[2], **bias,
            ))
        embed = lin("model.embed_tokens.weight", (cfg.vocab, h))
        if cfg.tie_embeddings:
            lm_head = embed
        else:
            lm_head = lin("lm_head.weight", (cfg.vocab, h)) if "lm_head.weight" in ck else None
            if lm_head is None:
                raise ModelError(f"lm_head.weight: missing from the checkpoint in {model_dir}; if the model ties"
                                 f" it to the embedding set \"tie_word_embeddings\": true in config.json")
        norm = ck.get("model.norm.weight", (h,))
        ck.tally.finish()
    inv_freq, scale = rope_tables(cfg)
    return Model(cfg=cfg, fmt=weights, name=model_dir.resolve().name, embed_tokens=embed, layers=tuple(layers),
                 norm=norm, lm_head=lm_head, inv_freq=inv_freq, attn_scale=scale,
                 tokenizer=_load_tokenizer(model_dir))


def load_model(spec: str | Path | None, weights: str = "q4_0", kv: str | None = None,
               n_layers: int | None = None, progress: Progress | None = None) -> Model:
    """The CLI's model argument: None / "default" -> the embedded synthetic model; a directory -> HF;
    a file ending .gguf -> GGUF (model/gguf.py)."""
    if weights not in FORMATS:
        raise ModelError(f"weights {weights!r}: unknown format; use one of {', '.join(FORMATS)}")
    if spec is None or str(spec) == "default":
        cfg = default_config()
        if n_layers is not None:
            if not 0 < n_layers <= cfg.n_layers:
                raise ModelError(f"n_layers {n_layers}: the default model has {cfg.n_layers} layers;"
                                 f" pick 1..{cfg.n_layers}")
            cfg = cfg.with_layers(n_layers)
        return synthetic_model(cfg, weights)
    if str(spec).lower().endswith(".gguf") and not Path(spec).is_dir():
        from .gguf import load_gguf_model

        return load_gguf_model(spec, weights, kv, n_layers=n_layers, progress=progress)
    if not Path(spec).is_dir():
        raise ModelError(f"{spec}: no such model directory; pass an HF model directory"
                         f" (config.json + *.safetensors), a .gguf file or 'default'")
    if str(spec).lower().endswith(".gguf") and not (Path(spec) / "config.json").exists():
        raise ModelError(f"{spec}: a directory, not a GGUF file; pass the .gguf file itself (or an HF model"
                         f" directory: config.json + *.safetensors)")
    return load_hf_model(spec, weights, kv, n_layers=n_layers, progress=progress)
