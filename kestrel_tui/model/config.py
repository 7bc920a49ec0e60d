"""Model configuration: a frozen dataclass read from an HF config.json.

Only the two architectures the reference decoder implements are accepted —
`qwen3_moe` (sparse MoE, no shared expert; optionally with dense MLP layers)
and dense `qwen3` — and every field transformers' config classes honour for
decoding is either honoured or refused with one line naming config.json and
the field, so a bad checkpoint fails up front instead of with a shape error
deep inside a decode step (or, worse, decodes a different model than HF).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UsageError
from ..readers import LimitError, parse_json, read_regular

QK = 32  # q4_0 / q8_0 block size


class ModelError(UsageError):
    """Bad model input: the message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Yarn:
    """RoPE of rope_type "yarn", resolved as transformers' `_compute_yarn_parameters` does
    (modeling_rope_utils.py); model/weights.py rope_tables turns it into inv_freq."""

    factor: float
    original_max_positions: float  # the pre-training context (original_max_position_embeddings)
    attention_factor: float  # scales cos and sin (resolved at load from factor / mscale when not given)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class Config:
    arch: str  # "qwen3_moe" | "qwen3"
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    eps: float
    tie_embeddings: bool
    max_positions: int
    # MoE (qwen3_moe); for dense qwen3 n_experts == 0
    n_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    norm_topk_prob: bool = True
    # the dense MLP's width: every layer of qwen3, the dense layers of a qwen3_moe model
    intermediate: int = 0
    # which qwen3_moe layers are dense instead of sparse: see layer_is_moe
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    attention_bias: bool = False  # self_attn.{q,k,v,o}_proj.bias present
    yarn: Yarn | None = None  # None: default RoPE

    @property
    def is_moe(self) -> bool:
        """The architecture has experts (qwen3_moe); single layers may still be dense."""
        return self.n_experts > 0

    def layer_is_moe(self, i: int) -> bool:
        """transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and
        (i + 1) % decoder_sparse_step == 0; otherwise a dense MLP of `intermediate`."""
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Layers whose MLP is dense (all of them for qwen3)."""
        return tuple(i for i in range(self.n_layers) if not self.layer_is_moe(i))

    @property
    def has_dense(self) -> bool:
        """Some layer's MLP is dense; without a loop over the layers, whose count a config may claim
        before any tensor has confirmed it."""
        if not self.is_moe:
            return self.n_layers > 0
        # layer 0 is off-step for any step > 1
        return (self.decoder_sparse_step > 1 and self.n_layers > 0) or \
            any(0 <= i < self.n_layers for i in self.mlp_only_layers)

    @property
    def is_mixed(self) -> bool:
        """A qwen3_moe model with some dense layers."""
        return self.is_moe and self.has_dense

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        return self.moe_intermediate if self.is_moe else self.intermediate

    def layer_ffn_dim(self, i: int) -> int:
        """Layer i's MLP width: an expert's for a sparse layer, `intermediate` for a dense one."""
        return self.moe_intermediate if self.layer_is_moe(i) else self.intermediate

    def validate(self, weights: str = "q4_0") -> "Config":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ModelError(msg)

        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab", "max_positions"):
            need(getattr(self, name) > 0, f"config: {name} must be > 0 (got {getattr(self, name)})")
        need(self.n_heads % self.n_kv_heads == 0,
             f"config: num_attention_heads {self.n_heads} is not a multiple of num_key_value_heads {self.n_kv_heads}")
        need(self.head_dim % 2 == 0, f"config: head_dim {self.head_dim} must be even for RoPE")
        need(self.eps > 0 and self.rope_theta > 0 and math.isfinite(self.eps) and math.isfinite(self.rope_theta),
             f"config: rms_norm_eps and rope_theta must be finite and > 0 (got {self.eps}, {self.rope_theta})")
        ffn = []  # the MLP widths in use, each cut into q4_0 blocks
        if self.is_moe:
            need(self.decoder_sparse_step > 0, f"config: decoder_sparse_step must be > 0"
                                               f" (got {self.decoder_sparse_step})")
            need(0 < self.top_k <= self.n_experts,
                 f"config: num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.n_experts})")
            need(self.moe_intermediate > 0, "config: moe_intermediate_size must be > 0")
            ffn.append(("moe_intermediate_size", self.moe_intermediate))
        if self.has_dense:
            which = f" (the dense MLP of {self._dense_shown()})" if self.is_moe else ""
            need(self.intermediate > 0, f"config: intermediate_size must be > 0{which}")
            ffn.append(("intermediate_size", self.intermediate))
        if weights == "q4_0":
            # every GEMV input dimension is cut into 32-blocks
            for name, dim in (("hidden_size", self.hidden), ("num_attention_heads*head_dim", self.q_dim), *ffn):
                need(dim % QK == 0, f"config: {name} = {dim} is not a multiple of {QK}, so q4_0 cannot block it;"
                                    f" use --weights f32")
        return self

    def _dense_shown(self, n: int = 8) -> str:
        shown = []
        for i in range(self.n_layers):  # stops after n: n_layers may be a claim as large as 10^9
            if not self.layer_is_moe(i):
                shown.append(i)
                if len(shown) > n:
                    break
        return f"layers {shown[:n]}" + (" and more" if len(shown) > n else "")

    def with_layers(self, n_layers: int) -> "Config":
        return replace(self, n_layers=n_layers)


def cuda_unsupported(cfg: Config) -> str | None:
    """What of cfg the cuda subject's kernels do not implement (one phrase), or None.
    backends/cuda/launches.py refuse_unsupported asks it, with the kernels' size limits."""
    if cfg.attention_bias:
        return "attention_bias (q/k/v/o projection biases) is not implemented"
    if cfg.yarn is not None:
        return "yarn RoPE (rope_scaling) is not implemented"
    return None


def default_config() -> Config:
    """The embedded default: Qwen3-30B-A3B's structure (48 layers, 530 keys/token), small dims."""
    return Config(arch="qwen3_moe", n_layers=48, hidden=256, n_heads=8, n_kv_heads=2, head_dim=64,
                  vocab=2048, rope_theta=1e6, eps=1e-6, tie_embeddings=False, max_positions=4096,
                  n_experts=16, top_k=4, moe_intermediate=64, norm_topk_prob=True)


def qwen3_30b_a3b_config(n_layers: int = 48) -> Config:
    """Every dimension of Qwen3-30B-A3B (for GPU-scale runs with synthetic weights)."""
    return Config(arch="qwen3_moe", n_layers=n_layers, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                  vocab=151936, rope_theta=1e6, eps=1e-6, tie_embeddings=False, max_positions=40960,
                  n_experts=128, top_k=8, moe_intermediate=768, norm_topk_prob=True)


_ARCHS = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3ForCausalLM": "qwen3"}

# What a config.json may leave out, as transformers' Qwen3Config / Qwen3MoeConfig default it (the same in
# 4.5x and 5.x): an absent field must mean what it means to HF. Qwen3MoeConfig has no head_dim at all (the
# attention takes hidden_size // num_attention_heads); Qwen3Config's is 128 whatever the other dims are.
# The matrix sizes (hidden_size, num_hidden_layers, num_attention_heads, vocab_size, intermediate_size where a
# layer is dense, the expert dims) stay required: save_pretrained always writes them, and HF's defaults for
# them (hidden 4096, ...) would only turn a truncated config.json into a shape error.
_DEFAULTS = {
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768),
    "qwen3_moe": dict(num_key_value_heads=4, max_position_embeddings=32768, norm_topk_prob=False,
                      decoder_sparse_step=1),
}
CONFIG_MAX = 4 << 20  # a config.json is a few KB; a larger one is not a config
_DTYPE_NAMES = ("float32", "float16", "bfloat16")  # what the safetensors reader widens (model/hf.py)


def load_config(model_dir: str | Path, weights: str = "q4_0") -> Config:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelError(f"{model_dir}: not a directory; pass an HF model directory (config.json + *.safetensors)")
    try:
        raw = parse_json(read_regular(path, CONFIG_MAX, "config.json").decode("utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{path}: missing; an HF model directory needs config.json") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror}); an HF model directory needs config.json as"
                         f" a regular file") from None
    except LimitError as e:
        raise ModelError(f"{path}: {e}; the file is damaged, re-export the checkpoint's config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e}); re-export the checkpoint's config.json") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object")
    model_type = raw.get("model_type")
    if model_type not in ("qwen3_moe", "qwen3"):
        archs = raw.get("architectures") or []
        model_type = next((_ARCHS[a] for a in archs if a in _ARCHS), None) if isinstance(archs, list) else None
    if model_type is None:
        raise ModelError(f"{path}: unsupported architecture (model_type={raw.get('model_type')!r});"
                         f" kestrel-tui supports qwen3_moe and qwen3")
    moe = model_type == "qwen3_moe"
    defaults = _DEFAULTS[model_type]

    def bad(key: str, val, why: str = "") -> ModelError:
        return ModelError(f"{path}: field {key!r} has invalid value {_short(val)}{why}")

    def get(key: str, cast=int, default=None):
        val = raw.get(key, defaults.get(key, default))
        if val is None:
            raise ModelError(f"{path}: missing field {key!r}")
        if isinstance(val, bool) and cast is not bool:  # JSON true is not a size
            raise bad(key, val)
        if cast is bool:
            if not isinstance(val, bool):
                raise bad(key, val, "; expected true or false")
            return val
        try:
            out = cast(val)
        except (TypeError, ValueError, OverflowError):
            raise bad(key, val) from None
        if cast is int and out != val:  # 2.5 layers
            raise bad(key, val, "; expected an integer")
        if cast is int and not -2**63 <= out < 2**63:  # 1e308 is an integer too, and no size
            raise bad(key, val, "; expected an integer below 2^63")
        return out

    hidden = get("hidden_size")
    n_heads = get("num_attention_heads")
    # Qwen3Config turns an explicit null into num_attention_heads (its __post_init__)
    n_kv = n_heads if raw.get("num_key_value_heads", 0) is None and not moe else get("num_key_value_heads")
    n_layers = get("num_hidden_layers")
    max_pos = get("max_position_embeddings")
    head_dim = get("head_dim", default=hidden // n_heads if n_heads > 0 else 0)
    mlp_only, sparse_step = (), 1
    if moe:
        sparse_step = get("decoder_sparse_step")
        if sparse_step <= 0:  # HF divides by it
            raise bad("decoder_sparse_step", sparse_step, "; expected an integer >= 1")
        mlp_only = raw.get("mlp_only_layers") or []  # Qwen3MoeConfig: null -> []
        if not isinstance(mlp_only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in mlp_only):
            raise bad("mlp_only_layers", mlp_only, "; expected a list of layer indices")
        mlp_only = tuple(sorted(set(mlp_only)))
    rope_theta, yarn = _rope(raw, path, max_pos)
    cfg = Config(
        arch=model_type,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab=get("vocab_size"),
        rope_theta=rope_theta,
        eps=get("rms_norm_eps", float, 1e-6),
        tie_embeddings=get("tie_word_embeddings", bool, False),
        max_positions=max_pos,
        n_experts=get("num_experts", default=raw.get("num_local_experts")) if moe else 0,
        top_k=get("num_experts_per_tok") if moe else 0,
        moe_intermediate=get("moe_intermediate_size") if moe else 0,
        norm_topk_prob=get("norm_topk_prob", bool) if moe else True,
        mlp_only_layers=mlp_only,
        decoder_sparse_step=sparse_step,
        attention_bias=get("attention_bias", bool, False),
        yarn=yarn,
    )
    if cfg.has_dense:  # every layer of qwen3; mlp_only / off-step layers of qwen3_moe
        cfg = replace(cfg, intermediate=get("intermediate_size"))
    if get("use_sliding_window", bool, False):
        raise ModelError(f"{path}: use_sliding_window=true is not supported (kestrel-tui attends to every position)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{path}: hidden_act={raw.get('hidden_act')!r} is not supported; Qwen3 uses silu")
    for key in ("dtype", "torch_dtype"):  # transformers 5 writes dtype, 4.x torch_dtype; the tensors carry theirs
        if raw.get(key) is not None and raw[key] not in _DTYPE_NAMES:
            raise ModelError(f"{path}: {key}={_short(raw[key])} is not supported; kestrel-tui reads"
                             f" {', '.join(_DTYPE_NAMES)} checkpoints")
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ModelError(f"{path}: quantization_config (quant_method={method!r}) is not supported; use a bf16,"
                         f" f16 or f32 checkpoint")
    try:
        return cfg.validate(weights)
    except ModelError as e:
        raise ModelError(f"{path}: {str(e).removeprefix('config: ')}") from None


def _short(val) -> str:
    s = repr(val) if isinstance(val, str) else json.dumps(val)
    return s if len(s) <= 60 else s[:57] + "..."


def _rope(raw: dict, path: Path, max_pos: int) -> tuple[float, Yarn | None]:
    """rope_theta and the yarn parameters from either config style.

    transformers 5 writes `rope_parameters` {rope_type, rope_theta, ...}; 4.x writes a top-level `rope_theta`
    and `rope_scaling` (null, or {rope_type | type, factor, ...}). Resolved as PreTrainedConfig's
    convert_rope_params_to_dict / standardize_rope_params do: rope_scaling wins over rope_parameters, a
    rope_theta inside the dict over the top-level one (default 10000), rope_type falls back to the old `type`.
    """
    key = "rope_scaling" if raw.get("rope_scaling") is not None else "rope_parameters"
    params = raw.get(key)
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ModelError(f"{path}: field {key!r} has invalid value {_short(params)}; expected a JSON object")
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelError(f"{path}: {key} per layer type ({', '.join(params)}) is not supported;"
                         f" kestrel-tui takes one set of RoPE parameters for every layer")

    def num(name: str, val, positive: bool = True) -> float:
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) \
                or (positive and val <= 0):
            raise ModelError(f"{path}: field '{key}.{name}' has invalid value {_short(val)};"
                             f" expected a {'positive ' if positive else ''}number")
        return float(val)

    theta = num("rope_theta", params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelError(f"{path}: partial_rotary_factor={_short(partial)} is not supported; Qwen3 rotates the"
                         f" whole head (1.0)")
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ModelError(f"{path}: {key}.rope_type={_short(rope_type)} is not supported; kestrel-tui implements"
                         f" the default and yarn RoPE types")
    if "factor" not in params:
        raise ModelError(f"{path}: missing field '{key}.factor' (yarn needs it)")
    # a top-level original_max_position_embeddings wins over the dict's (standardize_rope_params)
    orig = raw.get("original_max_position_embeddings", params.get("original_max_position_embeddings", max_pos))
    orig = num("original_max_position_embeddings", orig)
    factor = num("factor", max_pos / orig if params["factor"] is None else params["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:  # get_mscale
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = params.get("attention_factor")
    if att is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        if ms and ms_all:
            att = mscale(factor, num("mscale", ms, False)) / mscale(factor, num("mscale_all_dim", ms_all, False))
        else:
            att = mscale(factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelError(f"{path}: field '{key}.truncate' has invalid value {_short(truncate)}; expected true or false")
    return theta, Yarn(factor=factor, original_max_positions=orig, attention_factor=num("attention_factor", att),
                       beta_fast=num("beta_fast", params.get("beta_fast") or 32, positive=False),
                       beta_slow=num("beta_slow", params.get("beta_slow") or 1, positive=False), truncate=truncate)
