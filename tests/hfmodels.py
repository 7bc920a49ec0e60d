"""Checkpoints made with transformers' own Qwen3 / Qwen3-MoE classes, shared by the tests and the findings
scripts: tiny ones, one with Qwen3-0.6B's dimensions, and planted bugs (a saved copy with chosen weights
scaled). Import only where torch and transformers are."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def tiny(kind: str = "dense", seed: int = 2, n_layers: int = 2, **over):
    """A transformers Qwen3 ("dense") or Qwen3-MoE ("moe") with large random weights, so that logits and
    routing sit far from ties; ``over`` changes config fields."""
    if kind == "moe":
        cfg, cls = transformers.Qwen3MoeConfig(**{**COMMON, **MOE, "num_hidden_layers": n_layers, **over}), \
            transformers.Qwen3MoeForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**{**COMMON, "intermediate_size": 96, "num_hidden_layers": n_layers,
                                               **over}), transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.ndim == 1 else 0.25 * torch.randn(p.shape, generator=g))
    return model


def qwen3_06b_shaped(folder: Path, layers: int = 1) -> Path:
    """A checkpoint with Qwen3-0.6B's dimensions (vocab 151936, hidden 1024, 16 heads of 128, 8 KV heads,
    tied embeddings; ``layers`` layers) saved by transformers in bfloat16 at ``folder``. Seeded: the same
    bytes on every call, so that the figures measured on it (results/schedule-findings.md) hold."""
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                   num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                                   head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # far from flat logits, as a trained model's: a greedy token is not a near-tie
        for p in model.parameters():
            p.mul_(8 if p.ndim > 1 else 1)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def plant(clean: Path, out: Path, scales: dict[str, float]) -> Path:
    """A copy of the checkpoint folder ``clean`` at ``out`` with each named weight scaled."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(clean, out)
    sd = load_file(out / "model.safetensors")
    for name, scale in scales.items():
        sd[name] = sd[name] * scale
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


def cache_arg(model, cache) -> dict:
    """The KV cache as forward's keyword: `cache` since transformers 5.24, `past_key_values` before
    (the engines choose the same way, engines/hf_hooks.py)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}
