"""Model configuration: a frozen dataclass read from an HF config.json.

Only the two architectures the reference decoder implements are accepted —
`qwen3_moe` (sparse MoE, no shared expert) and dense `qwen3` — and every
dimension is checked up front, so a bad checkpoint fails with one line instead
of a shape error deep inside a decode step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UsageError

QK = 32  # q4_0 / q8_0 block size


class ModelError(UsageError):
    """Bad model input: the message is one line naming the problem and the fix."""


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
    # MoE (qwen3_moe); for dense qwen3 n_experts == 0 and `intermediate` is the MLP width
    n_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    norm_topk_prob: bool = True
    intermediate: int = 0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        return self.moe_intermediate if self.is_moe else self.intermediate

    @property
    def n_keys_per_token(self) -> int:
        return 11 * self.n_layers + 2

    def validate(self, weights: str = "q4_0") -> "Config":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ModelError(msg)

        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab", "max_positions"):
            need(getattr(self, name) > 0, f"config: {name} must be > 0 (got {getattr(self, name)})")
        need(self.n_heads % self.n_kv_heads == 0,
             f"config: num_attention_heads {self.n_heads} is not a multiple of num_key_value_heads {self.n_kv_heads}")
        need(self.head_dim % 2 == 0, f"config: head_dim {self.head_dim} must be even for RoPE")
        need(self.eps > 0 and self.rope_theta > 0, "config: rms_norm_eps and rope_theta must be > 0")
        if self.is_moe:
            need(0 < self.top_k <= self.n_experts,
                 f"config: num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.n_experts})")
            need(self.moe_intermediate > 0, "config: moe_intermediate_size must be > 0")
        else:
            need(self.intermediate > 0, "config: intermediate_size must be > 0")
        if weights == "q4_0":
            # every GEMV input dimension is cut into 32-blocks
            for name, dim in (("hidden_size", self.hidden), ("num_attention_heads*head_dim", self.q_dim),
                              ("ffn intermediate size", self.ffn_dim)):
                need(dim % QK == 0, f"config: {name} = {dim} is not a multiple of {QK}, so q4_0 cannot block it;"
                                    f" use --weights f32")
        return self

    def with_layers(self, n_layers: int) -> "Config":
        return replace(self, n_layers=n_layers)


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


def load_config(model_dir: str | Path, weights: str = "q4_0") -> Config:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelError(f"{model_dir}: not a directory; pass an HF model directory (config.json + *.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path}: missing; an HF model directory needs config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e}); re-export the checkpoint's config.json") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object")
    model_type = raw.get("model_type")
    if model_type not in ("qwen3_moe", "qwen3"):
        archs = raw.get("architectures") or []
        model_type = next((_ARCHS[a] for a in archs if a in _ARCHS), None)
    if model_type is None:
        raise ModelError(f"{path}: unsupported architecture (model_type={raw.get('model_type')!r});"
                         f" kestrel-tui supports qwen3_moe and qwen3")
    if raw.get("attention_bias"):
        raise ModelError(f"{path}: attention_bias=true is not supported (Qwen3 has no attention bias)")

    def get(key: str, cast=int, default=None):
        val = raw.get(key, default)
        if val is None:
            raise ModelError(f"{path}: missing field {key!r}")
        try:
            return cast(val)
        except (TypeError, ValueError):
            raise ModelError(f"{path}: field {key!r} has invalid value {val!r}") from None

    hidden = get("hidden_size")
    n_heads = get("num_attention_heads")
    moe = model_type == "qwen3_moe"
    cfg = Config(
        arch=model_type,
        n_layers=get("num_hidden_layers"),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads", default=n_heads),
        # defaults as in transformers' config classes: Qwen3Config.head_dim = 128, Qwen3Moe has none
        head_dim=get("head_dim", default=hidden // max(n_heads, 1) if moe else 128),
        vocab=get("vocab_size"),
        rope_theta=get("rope_theta", float, (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        eps=get("rms_norm_eps", float, 1e-6),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_positions=get("max_position_embeddings", default=40960),
        n_experts=get("num_experts", default=raw.get("num_local_experts")) if moe else 0,
        top_k=get("num_experts_per_tok") if moe else 0,
        moe_intermediate=get("moe_intermediate_size") if moe else 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if moe else True,  # HF's default is False
        intermediate=0 if moe else get("intermediate_size"),
    )
    if moe:
        sparse_step = raw.get("decoder_sparse_step", 1)
        mlp_only = raw.get("mlp_only_layers") or []
        if sparse_step != 1 or mlp_only:
            raise ModelError(f"{path}: mixed dense/MoE layers (decoder_sparse_step={sparse_step},"
                             f" mlp_only_layers={mlp_only}) are not supported")
    for rope_key in ("rope_scaling", "rope_parameters"):
        rope_type = (raw.get(rope_key) or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ModelError(f"{path}: {rope_key}.rope_type={rope_type!r} is not supported; only default RoPE")
    if raw.get("use_sliding_window"):
        raise ModelError(f"{path}: use_sliding_window=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{path}: hidden_act={raw.get('hidden_act')!r} is not supported; Qwen3 uses silu")
    return cfg.validate(weights)
