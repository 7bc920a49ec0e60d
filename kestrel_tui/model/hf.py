"""HF checkpoints: a model directory (config.json + *.safetensors [+ tokenizer.json]) -> Model.

Tensors are read one at a time from the safetensors files (`safe_open`,
framework "numpy"), widened to f32 and, for `--weights q4_0`, quantized at
once, so at most one f32 tensor (one expert matrix for expert stacks) is alive
next to the model being built. bf16 is not a numpy dtype: its raw bytes are
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
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import numpy as np

from .config import ModelError, default_config, load_config
from .quant import quantize_q4_0
from .weights import FORMATS, Layer, Linear, Model, linear_from_q4, make_linear, rope_tables, synthetic_model

F32 = np.float32
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


class _Checkpoint:
    """Every tensor of the directory's *.safetensors files by name; reads one at a time as f32."""

    def __init__(self, model_dir: Path, stack: ExitStack):
        try:
            from safetensors import safe_open
        except ImportError:
            raise ModelError("reading HF checkpoints needs the safetensors package; pip install safetensors"
                             " (or pip install kestrel-tui[hf])") from None
        self.dir = model_dir
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{model_dir}: no *.safetensors files; an HF model directory needs its weights"
                             f" as safetensors (convert .bin/.pt checkpoints with transformers' save_pretrained)")
        self.where: dict[str, tuple[Path, object]] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="numpy"))
                names = list(handle.keys())
            except Exception as e:  # safetensors raises its own error type for a corrupt file
                raise ModelError(f"{path}: not a readable safetensors file ({_one_line(e)});"
                                 f" re-download or re-export it") from None
            for name in names:
                if name in self.where:
                    raise ModelError(f"{name}: present in both {self.where[name][0].name} and {path.name};"
                                     f" remove the stale file from {model_dir}")
                self.where[name] = (path, handle)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _header(self, path: Path) -> tuple[int, dict]:
        if path not in self._headers:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + n, json.loads(f.read(n)))
        return self._headers[path]

    def get(self, name: str, shape: tuple[int, ...], hint: str = "") -> np.ndarray:
        """The tensor as a fresh f32 array, checked for presence, shape, dtype and finiteness."""
        if name not in self.where:
            raise ModelError(f"{name}: missing from the checkpoint in {self.dir}{hint};"
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
            raw = np.fromfile(path, dtype="<u2", count=n, offset=base + start)
            w = (raw.astype(np.uint32) << np.uint32(16)).view(F32).reshape(shape)
        else:
            w = handle.get_tensor(name)  # a fresh, writable array (not a view of the file)
            w = w.astype(F32) if w.dtype != F32 else np.ascontiguousarray(w)
        if not np.isfinite(w).all():
            raise ModelError(f"{name}: contains NaN or inf values (in {path.name}); the checkpoint is corrupt")
        return w


def _experts(ck: _Checkpoint, p: str, E: int, F: int, H: int, fmt: str) -> tuple[Linear, Linear, Linear]:
    """gate_proj, up_proj [E, F, H] and down_proj [E, H, F], from either checkpoint layout."""
    per_expert = f"{p}mlp.experts.0.gate_proj.weight" in ck
    fused = not per_expert and f"{p}mlp.experts.gate_up_proj" in ck
    shapes = {"gate": (F, H), "up": (F, H), "down": (H, F)}
    if fmt == "f32":
        bufs = {k: np.empty((E, *s), F32) for k, s in shapes.items()}
    else:
        bufs = {k: (np.empty((E, s[1] // 32, s[0], 32), np.int8), np.empty((E, s[1] // 32, s[0]), F32))
                for k, s in shapes.items()}

    def put(kind: str, e: int, w: np.ndarray) -> None:
        if fmt == "f32":
            bufs[kind][e] = w
        else:  # per-expert quantization == quantizing the stack (q4_0 blocks never span rows)
            qs, d = quantize_q4_0(w)
            bufs[kind][0][e], bufs[kind][1][e] = qs, d

    if fused:
        gu = ck.get(f"{p}mlp.experts.gate_up_proj", (E, 2 * F, H))
        for e in range(E):
            put("gate", e, gu[e, :F])
            put("up", e, gu[e, F:])
        del gu
        down = ck.get(f"{p}mlp.experts.down_proj", (E, H, F))
        for e in range(E):
            put("down", e, down[e])
        del down
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
        return linear_from_q4(*bufs[kind], fmt)

    return lin("gate"), lin("up"), lin("down")


def _load_tokenizer(model_dir: Path):
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
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
                  n_layers: int | None = None) -> Model:
    """Load an HF Qwen3-MoE / Qwen3 directory; weights "q4_0" (quantized at load) or "f32".

    `kv` is accepted for symmetry with the CLI and unused (the KV format belongs to
    the backend). `n_layers` keeps only the first n layers.
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
        ck = _Checkpoint(model_dir, stack)

        def lin(name: str, shape: tuple[int, int]) -> Linear:
            return make_linear(ck.get(name, shape), weights)

        layers = []
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            if cfg.is_moe:
                gate = lin(p + "mlp.gate.weight", (cfg.n_experts, h))
                ffn = _experts(ck, p, cfg.n_experts, cfg.moe_intermediate, h, weights)
            else:
                f = cfg.intermediate
                gate = None
                ffn = (lin(p + "mlp.gate_proj.weight", (f, h)), lin(p + "mlp.up_proj.weight", (f, h)),
                       lin(p + "mlp.down_proj.weight", (h, f)))
            layers.append(Layer(
                input_layernorm=ck.get(p + "input_layernorm.weight", (h,)),
                post_attention_layernorm=ck.get(p + "post_attention_layernorm.weight", (h,)),
                q_norm=ck.get(p + "self_attn.q_norm.weight", (hd,)),
                k_norm=ck.get(p + "self_attn.k_norm.weight", (hd,)),
                q_proj=lin(p + "self_attn.q_proj.weight", (cfg.q_dim, h)),
                k_proj=lin(p + "self_attn.k_proj.weight", (cfg.kv_dim, h)),
                v_proj=lin(p + "self_attn.v_proj.weight", (cfg.kv_dim, h)),
                o_proj=lin(p + "self_attn.o_proj.weight", (h, cfg.q_dim)),
                gate=gate, gate_proj=ffn[0], up_proj=ffn[1], down_proj=ffn[2],
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
    inv_freq, scale = rope_tables(cfg)
    return Model(cfg=cfg, fmt=weights, name=model_dir.resolve().name, embed_tokens=embed, layers=tuple(layers),
                 norm=norm, lm_head=lm_head, inv_freq=inv_freq, attn_scale=scale,
                 tokenizer=_load_tokenizer(model_dir))


def load_model(spec: str | Path | None, weights: str = "q4_0", kv: str | None = None,
               n_layers: int | None = None) -> Model:
    """The CLI's model argument: None / "default" -> the embedded synthetic model; a directory -> HF."""
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
    if not Path(spec).is_dir():
        raise ModelError(f"{spec}: no such model directory; pass an HF model directory"
                         f" (config.json + *.safetensors) or 'default'")
    return load_hf_model(spec, weights, kv, n_layers=n_layers)
