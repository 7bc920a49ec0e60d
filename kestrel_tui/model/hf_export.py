"""Our Model as an HF transformers model (f32, eager attention): the peer in benchmarks.

Needs torch and transformers (the `test` extra). transformers 5 keeps MoE
experts fused: `mlp.experts.gate_up_proj` [E, 2*ffn, hidden] (gate rows first)
and `mlp.experts.down_proj` [E, hidden, ffn].
"""
from __future__ import annotations

import numpy as np

from .weights import Model


def hf_config(model: Model):
    from transformers import Qwen3Config, Qwen3MoeConfig

    cfg = model.cfg
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.yarn is not None:
        y = cfg.yarn
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": y.factor,
                "original_max_position_embeddings": y.original_max_positions,
                "attention_factor": y.attention_factor, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                "truncate": y.truncate}
    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.n_layers,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                  rms_norm_eps=cfg.eps, max_position_embeddings=cfg.max_positions,
                  tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.attention_bias, rope_parameters=rope)
    if cfg.is_moe:
        dense = dict(intermediate_size=cfg.intermediate) if cfg.is_mixed else {}
        return Qwen3MoeConfig(num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                              moe_intermediate_size=cfg.moe_intermediate, norm_topk_prob=cfg.norm_topk_prob,
                              mlp_only_layers=list(cfg.mlp_only_layers),
                              decoder_sparse_step=cfg.decoder_sparse_step, **dense, **common)
    return Qwen3Config(intermediate_size=cfg.intermediate, **common)


def hf_state_dict(model: Model) -> dict[str, np.ndarray]:
    sd = {"model.embed_tokens.weight": model.embed_tokens.dense(), "model.norm.weight": model.norm}
    if not model.cfg.tie_embeddings:
        sd["lm_head.weight"] = model.lm_head.dense()
    for i, L in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": L.input_layernorm,
                   p + "post_attention_layernorm.weight": L.post_attention_layernorm,
                   p + "self_attn.q_norm.weight": L.q_norm, p + "self_attn.k_norm.weight": L.k_norm})
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = getattr(L, name).dense()
            bias = getattr(L, name[0] + "_bias")
            if bias is not None:
                sd[p + f"self_attn.{name}.bias"] = bias
        if L.gate is not None:  # this layer is sparse (a qwen3_moe model may have dense layers)
            sd[p + "mlp.gate.weight"] = L.gate.dense()
            sd[p + "mlp.experts.gate_up_proj"] = np.concatenate([L.gate_proj.dense(), L.up_proj.dense()], axis=1)
            sd[p + "mlp.experts.down_proj"] = L.down_proj.dense()
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                sd[p + f"mlp.{name}.weight"] = getattr(L, name).dense()
    return sd


def to_hf_model(model: Model):
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    cls = Qwen3MoeForCausalLM if model.cfg.is_moe else Qwen3ForCausalLM
    config = hf_config(model)
    config._attn_implementation = "eager"
    # Built on the meta device and given our arrays as its parameters (assign=True: no copy, no random
    # init): one f32 copy of the weights in memory, not three — at Qwen3-30B-A3B's dims with 4 layers
    # (7.3 GB of f32) the eager way ran a 24 GiB machine out of memory.
    with torch.device("meta"):
        hf = cls(config).eval()
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in hf_state_dict(model).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (model.cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF export mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if model.cfg.tie_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)  # its buffers are computed, not loaded
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"HF export: {left[:3]} left unset")
    return hf
