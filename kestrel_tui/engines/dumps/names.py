"""The serving engines' Qwen3 / Qwen3-MoE module names -> our keys, with each output's shard layout.

Read from the engines' own model files (docs/engines-serving-dumps.md names the versions): vLLM's
``vllm/model_executor/models/qwen3.py`` and ``qwen3_moe.py`` (with the MLP of ``qwen2.py``) and
SGLang's ``python/sglang/srt/models/qwen3.py`` and ``qwen3_moe.py`` build the same module tree:

    model.embed_tokens                       VocabParallelEmbedding: all-reduced inside -> full
    model.layers.L.input_layernorm           RMSNorm; from layer 1 on it is called with the residual and
                                             returns (normed, residual + input): nrm, and x of layer L-1
    model.layers.L.self_attn.qkv_proj        QKVParallelLinear: each rank's row is [its q | its k | its v]
    model.layers.L.self_attn.q_norm/k_norm   per-head RMSNorm of the rank's heads [T, heads, hd]
    model.layers.L.self_attn.rotary_emb      returns (q, k) after RoPE, the rank's heads flattened
    model.layers.L.self_attn.attn            Attention / RadixAttention: the rank's heads [T, heads*hd]
    model.layers.L.self_attn.o_proj          RowParallelLinear, reduce_results: full (not a key of ours)
    model.layers.L.post_attention_layernorm  (normed, residual + attention): pnrm and ores
    model.layers.L.mlp.down_proj             a dense MLP's RowParallelLinear: full -> moe (the MLP output)
    model.layers.L.mlp.gate                  ReplicatedLinear router: full -> router
    model.layers.L.mlp.topk                  SGLang's TopK: (weights, ids, router logits) -> topw, topk
    model.layers.L.mlp.experts               FusedMoE; pre-reduction where the block all-reduces after it
    model.norm                               (normed, residual + last MLP): x of the last layer
    logits_processor                         the sampled rows' logits

Both dumpers hook leaf modules only. FusedMoE holds its quant method as a child module in both
sources, so ``mlp.experts`` is no leaf and its output is not in a leaf-hook dump: a MoE layer's
``moe`` key is missing there (and vLLM's routing, inside FusedMoE, gives no topk / topw). Every
output of a tuple is read by its index, as the dumpers store a tuple as a list of its tensors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    module: str            # the module path after model.layers.L. (or the whole path, for per-token keys)
    field: str
    part: int | None       # the tensor's index in a tuple output; None: a single tensor
    layout: str            # full | heads | partial | q | k | v (a slice of each rank's qkv row, then heads)
    axis: int = -1         # the heads' axis in the dumped tensor
    kv: bool = False       # KV heads: replicated over ranks when there are fewer than ranks
    shift: int = 0         # x of layer L-1 is read at layer L's input norm


LAYER_RULES: tuple[Rule, ...] = (
    Rule("input_layernorm", "nrm", 0, "full"),
    Rule("input_layernorm", "x", 1, "full", shift=-1),
    Rule("self_attn.qkv_proj", "kraw", None, "k", kv=True),
    Rule("self_attn.qkv_proj", "v", None, "v", kv=True),
    Rule("self_attn.k_norm", "knorm", None, "heads", axis=-2, kv=True),
    Rule("self_attn.rotary_emb", "qrope", 0, "heads"),
    Rule("self_attn.rotary_emb", "kpre", 1, "heads", kv=True),
    Rule("self_attn.attn", "attn", None, "heads"),
    Rule("post_attention_layernorm", "pnrm", 0, "full"),
    Rule("post_attention_layernorm", "ores", 1, "full"),
    Rule("mlp.down_proj", "moe", None, "full"),
    Rule("mlp.gate", "router", None, "full"),
    Rule("mlp.topk", "topw", 0, "full"),
    Rule("mlp.topk", "topk", 1, "full"),
    Rule("mlp.experts", "moe", None, "partial"),
)
TOKEN_RULES: tuple[Rule, ...] = (
    Rule("model.embed_tokens", "emb", None, "full"),
    Rule("model.norm", "x", 1, "full"),       # the last layer's x: its layer is known once the layers are
    Rule("logits_processor", "logits", None, "full"),
)
# modules read for shapes only: the rank's q heads and head_dim
SHAPE_MODULES = ("self_attn.q_norm", "self_attn.k_norm")
FIELDS = frozenset(r.field for r in LAYER_RULES + TOKEN_RULES)

LAYER_NUMBER = r"(0|[1-9][0-9]{0,5})"  # a layer index as the names and tags write it: below 10^6
_LAYER = re.compile(rf"model\.layers\.{LAYER_NUMBER}\.(.+)")


def rules_for(module: str) -> tuple[int | None, list[Rule]]:
    """(layer or None, the rules that read this module's output)."""
    m = _LAYER.fullmatch(module)
    if m:
        return int(m[1]), [r for r in LAYER_RULES if r.module == m[2]]
    return None, [r for r in TOKEN_RULES if r.module == module]


def kind_of_fields(fields: set[str]) -> str | None:
    """What the dumped tensors of these fields must hold: TopK's expert ids are integers, every other
    field's values floats; None when no field reads it."""
    if not fields:
        return None
    return "ints" if "topk" in fields else "floats"


def value_kind(module: str, part: int | None) -> str | None:
    """What a module's dumped output must hold (``part``: the tensor's index in a tuple output's list, None
    for a bare tensor), as rules_for's readers take it: a bare tensor is read as part 0 or the whole
    output, and a list of one tensor as the whole output. None: nothing reads it but its shape."""
    _, rules = rules_for(module)
    if part is None:
        read = {r.field for r in rules if r.part in (None, 0)}
    else:
        read = {r.field for r in rules if r.part == part or (r.part is None and part == 0)}
    if not read and module.endswith(tuple("." + m for m in SHAPE_MODULES)):
        return "floats"  # q_norm: read for its shape, an activation like the rest
    return kind_of_fields(read)
