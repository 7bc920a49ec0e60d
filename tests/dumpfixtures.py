"""Test fixtures for the serving-dump readers: a tiny Qwen3 / Qwen3-MoE with vLLM's and SGLang's module
tree and tensor parallelism, and dump writers that follow the engines' own dumper sources.

Neither vLLM nor SGLang runs here (no CUDA build installs on a CPU box), so the model is written to
their module names and shard layouts (vllm/model_executor/models/qwen3.py, qwen3_moe.py, qwen2.py;
python/sglang/srt/models/qwen3.py, qwen3_moe.py): QKVParallelLinear rows [q | k | v] of the rank's
heads, RMSNorm called with the residual returning (normed, residual + x), rotary_emb returning
(q, k), RowParallelLinear all-reduced over torch.distributed, VocabParallelEmbedding, a logits
processor that gathers to rank 0 (vLLM) or returns a LogitsProcessorOutput on every rank (SGLang),
FusedMoE holding its quant method as a child module. The writers follow vllm/debug/tensor_dump.py,
SGLang's tensor_dump_forward_hook.py and dumper.py (`PassDumper`, `write_dumper_record`);
tests/test_dump_readers_upstream.py checks them against SGLang's real code where it is given.

Every op that makes a key a column shard can hold is computed so that a head's or a column's
value does not depend on how many others are computed beside it (ordered sums over the inner
dimension, attention a head at a time, exp in float64): a TP=2 run's column shards, put together,
equal the TP=1 run bit for bit, and only the all-reduced sums (o_proj, down_proj, the experts)
differ, by rounding.

With ``hf_from`` (a checkpoint folder) the modules run transformers' own instead (`hf_ops`): the model
from_pretrained loads, sharded by its own TP plan when TP>1, does every projection, norm, rotary
embedding, attention (the modeling file's eager_attention_forward over a cache grown as DynamicCache
grows it), router and experts call; this tree only names and fuses their outputs as vLLM's and
SGLang's modules do. Such a dump is the hf engines' computation in a serving engine's module tree and
file format. The experts are a partial sum over a slice of each on every rank, as FusedMoE holds them,
whether transformers' TP plan slices them (up to 5.24) or leaves them whole (from 5.25;
`hf_experts_partial`).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

F = torch.float32
VOCAB = 128
DIMS = dict(hidden=64, heads=4, kv=2, hd=16, inter=48, experts=4, top_k=2, moe_inter=32, layers=2)


# ---------------------------------------------------------------------------------------------- weights


def hf_config(kind: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=DIMS["hidden"], num_hidden_layers=DIMS["layers"],
                  num_attention_heads=DIMS["heads"], num_key_value_heads=DIMS["kv"], head_dim=DIMS["hd"],
                  rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False)
    if kind == "moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=DIMS["experts"], num_experts_per_tok=DIMS["top_k"],
                                           moe_intermediate_size=DIMS["moe_inter"], norm_topk_prob=True), \
            transformers.Qwen3MoeForCausalLM
    return transformers.Qwen3Config(**common, intermediate_size=DIMS["inter"]), transformers.Qwen3ForCausalLM


def write_checkpoint(kind: str, path: Path, seed: int) -> dict[str, torch.Tensor]:
    """A tiny HF checkpoint with large weights (logits and routing far from ties); its state dict."""
    cfg, cls = hf_config(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.ndim == 1 else 0.25 * noise)
    model.save_pretrained(path)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if kind == "moe" and not any(".experts.0." in k for k in sd):  # transformers 5 fuses the experts
        for li in range(DIMS["layers"]):
            pre = f"model.layers.{li}.mlp.experts"
            gate_up, down = sd.pop(f"{pre}.gate_up_proj"), sd.pop(f"{pre}.down_proj")
            for e in range(DIMS["experts"]):
                g_, u_ = gate_up[e].chunk(2, dim=0)
                sd[f"{pre}.{e}.gate_proj.weight"], sd[f"{pre}.{e}.up_proj.weight"] = g_, u_
                sd[f"{pre}.{e}.down_proj.weight"] = down[e]
    return sd


# ---------------------------------------------------------------------------------------------- exact ops


def _sum_last(a: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim as a scan: each result depends on its own row only, whatever the shape."""
    return (a.cumsum(-1)[..., -1] if a.shape[-1] else a.sum(-1)).contiguous()  # gloo needs contiguous


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w[N, K]^T, each output column summed on its own (the same bits in any shard)."""
    return _sum_last(x[:, None, :] * w[None])


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    ss = _sum_last(x * x)
    return x * (1.0 / torch.sqrt(ss / x.shape[-1] + eps))[..., None] * w


# ---------------------------------------------------------------------------------------------- hf ops

HF = None  # the transformers model whose modules compute (hf_ops); None: the exact ops above


@contextlib.contextmanager
def hf_ops(ckpt: Path | None):
    """Within: the modules run the checkpoint's transformers model, as the hf (TP=1) and hf-dist (TP>1)
    engines load it: float32, eager attention, transformers' own TP plan over the process group."""
    global HF
    if ckpt is None:
        yield None
        return
    import transformers

    kwargs = dict(dtype=F, attn_implementation="eager")
    if tp_info()[1] > 1:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=tp_info()[1])
    HF = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), **kwargs).eval()
    try:
        yield HF
    finally:
        HF = None


def _hf(path: str) -> nn.Module:
    return HF.get_submodule(path)


def _modeling():
    return sys.modules[type(HF).__module__]


def tp_info() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


# ---------------------------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, w, hf: str):
        super().__init__()
        self.weight = nn.Parameter(w, requires_grad=False)
        self.hf = hf  # the transformers module of the same norm

    def norm(self, x):
        return rms(x, self.weight) if HF is None else _hf(self.hf)(x)

    def forward(self, x, residual=None):
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x


class Linear(nn.Module):
    """Column- or row-parallel or replicated: the weight is the rank's slice; returns (output, None) as
    vLLM's and SGLang's linear layers do."""

    def __init__(self, w, reduce: bool = False, hf: tuple[str, ...] = ()):
        super().__init__()
        self.weight = nn.Parameter(w, requires_grad=False)
        self.reduce = reduce
        self.hf = hf  # the transformers modules whose outputs this one's is, side by side (q, k, v; gate, up)

    def forward(self, x):
        if HF is not None:  # transformers' row-parallel layers all-reduce themselves
            outs = [_hf(p)(x[None]) for p in self.hf]  # [1, T, hidden], as transformers calls them
            return torch.cat([(o[0] if isinstance(o, tuple) else o).reshape(x.shape[0], -1) for o in outs],
                             dim=-1), None
        y = linear(x, self.weight)
        return (all_reduce(y) if self.reduce else y), None


class Embedding(nn.Module):
    def __init__(self, w):
        super().__init__()
        r, n = tp_info()
        self.per = w.shape[0] // n
        self.lo = r * self.per
        self.weight = nn.Parameter(w[self.lo:self.lo + self.per].clone(), requires_grad=False)

    def forward(self, ids):
        if HF is not None:
            return _hf("model.embed_tokens")(ids)
        local = ids - self.lo
        hit = (local >= 0) & (local < self.per)
        out = self.weight[local.clamp(0, self.per - 1)] * hit[:, None]
        return all_reduce(out)


class Rotary(nn.Module):
    def __init__(self, hd, theta=1e6):
        super().__init__()
        self.hd = hd
        self.inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def forward(self, positions, q, k):
        if HF is not None:  # the model's rotary embedding and apply_rotary_pos_emb on [1, heads, T, hd] views
            T = q.shape[0]
            cos, sin = HF.model.rotary_emb(q, positions[None])
            q4, k4 = (t.view(1, T, -1, self.hd).transpose(1, 2) for t in (q, k))
            q4, k4 = _modeling().apply_rotary_pos_emb(q4, k4, cos, sin)
            return tuple(t.transpose(1, 2).reshape(T, -1) for t in (q4, k4))
        ang = positions.to(torch.float64)[:, None] * self.inv[None]
        cos, sin = torch.cos(ang).to(F), torch.sin(ang).to(F)

        def rot(x):
            x = x.view(x.shape[0], -1, self.hd)
            a, b = x[..., :self.hd // 2], x[..., self.hd // 2:]
            c, s = cos[:, None], sin[:, None]
            return torch.cat((a * c - b * s, b * c + a * s), dim=-1).reshape(x.shape[0], -1)
        return rot(q), rot(k)


class Attention(nn.Module):
    """Causal attention over a per-request cache, one head at a time (a leaf, as vLLM's and SGLang's)."""

    def __init__(self, heads, kv, hd, hf: str):
        super().__init__()
        self.heads, self.kv, self.hd, self.hf = heads, kv, hd, hf
        self.batch = None  # set per forward: [(request id, row slice)], and the caches

    def forward(self, q, k, v):
        if HF is not None:
            return self._hf_attention(q, k, v)
        T = q.shape[0]
        q, k, v = (t.view(T, -1, self.hd) for t in (q, k, v))
        out = torch.zeros(T, self.heads, self.hd, dtype=F)
        caches, layer = self.batch
        for rid, rows in caches["segments"]:
            ck, cv = caches.setdefault((rid, layer), ([], []))
            ck.append(k[rows])
            cv.append(v[rows])
            K, V = torch.cat(ck), torch.cat(cv)
            n0 = K.shape[0] - (rows.stop - rows.start)
            g = torch.arange(self.heads) // (self.heads // self.kv)
            for i, row in enumerate(range(rows.start, rows.stop)):
                n = n0 + i + 1
                s = _sum_last(q[row][None] * K[:n, g]) * self.hd ** -0.5      # [n, heads]
                e = torch.exp((s - s.max(0).values).double()).to(F)
                p = e / _sum_last(e.T)
                out[row] = _sum_last((p[:, :, None] * V[:n, g]).permute(1, 2, 0))
        return out.reshape(T, -1)

    def _hf_attention(self, q, k, v):
        """The modeling file's eager_attention_forward, a request at a time, on its Qwen3Attention module;
        K and V grown as DynamicCache grows them (torch.cat of [1, kv, T, hd] views)."""
        out = torch.empty(q.shape[0], self.heads * self.hd, dtype=F)
        caches, layer = self.batch
        module = _hf(self.hf)
        for rid, rows in caches["segments"]:
            T = rows.stop - rows.start
            q4, k4, v4 = (t[rows].view(1, T, -1, self.hd).transpose(1, 2) for t in (q, k, v))
            empty = torch.zeros(1, self.kv, 0, self.hd, dtype=F)
            K, V = caches.get(("hf", rid, layer), (empty, empty))
            K, V = torch.cat([K, k4], dim=-2), torch.cat([V, v4], dim=-2)
            caches["hf", rid, layer] = (K, V)
            n = K.shape[-2]
            allowed = torch.arange(n)[None] <= torch.arange(n - T, n)[:, None]
            mask = torch.zeros(T, n, dtype=F).masked_fill(~allowed, torch.finfo(F).min)[None, None]
            o, _ = _modeling().eager_attention_forward(module, q4, K, V, mask, scaling=module.scaling)
            out[rows] = o.reshape(T, -1)
        return out


class SelfAttn(nn.Module):
    def __init__(self, sd, pre, r, n):
        super().__init__()
        H, KV, hd = DIMS["heads"], DIMS["kv"], DIMS["hd"]
        self.hl, self.kl = H // n, max(1, KV // n)
        kv0 = (r // max(1, n // KV)) * self.kl  # the rank's first KV head (replicated when KV < n)
        q = sd[f"{pre}.q_proj.weight"][r * self.hl * hd:(r + 1) * self.hl * hd]
        k = sd[f"{pre}.k_proj.weight"][kv0 * hd:(kv0 + self.kl) * hd]
        v = sd[f"{pre}.v_proj.weight"][kv0 * hd:(kv0 + self.kl) * hd]
        self.qkv_proj = Linear(torch.cat([q, k, v]), hf=tuple(f"{pre}.{p}_proj" for p in "qkv"))
        cols = slice(r * self.hl * hd, (r + 1) * self.hl * hd)
        self.o_proj = Linear(sd[f"{pre}.o_proj.weight"][:, cols].clone(), reduce=True, hf=(f"{pre}.o_proj",))
        self.rotary_emb = Rotary(hd)
        self.attn = Attention(self.hl, self.kl, hd, hf=pre)
        self.q_norm = RMSNorm(sd[f"{pre}.q_norm.weight"], hf=f"{pre}.q_norm")
        self.k_norm = RMSNorm(sd[f"{pre}.k_norm.weight"], hf=f"{pre}.k_norm")

    def forward(self, positions, x):
        hd = DIMS["hd"]
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.hl * hd, self.kl * hd, self.kl * hd], dim=-1)
        q = self.q_norm(q.reshape(q.shape[0], -1, hd)).reshape(q.shape)
        k = self.k_norm(k.reshape(k.shape[0], -1, hd)).reshape(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class SiluAndMul(nn.Module):
    def forward(self, x):
        g, u = x.chunk(2, dim=-1)
        if HF is not None:  # the act_fn of transformers' MLP and experts
            from transformers.activations import ACT2FN

            g, u = g.contiguous(), u.contiguous()  # two tensors, as transformers' two layers give them
            return ACT2FN[HF.config.hidden_act](g) * u
        return (g.double() * torch.sigmoid(g.double())).to(F) * u


class MLP(nn.Module):
    def __init__(self, sd, pre, r, n):
        super().__init__()
        I = sd[f"{pre}.gate_proj.weight"].shape[0]
        s = slice(r * I // n, (r + 1) * I // n)
        self.gate_up_proj = Linear(torch.cat([sd[f"{pre}.gate_proj.weight"][s], sd[f"{pre}.up_proj.weight"][s]]),
                                   hf=(f"{pre}.gate_proj", f"{pre}.up_proj"))
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(sd[f"{pre}.down_proj.weight"][:, s].clone(), reduce=True, hf=(f"{pre}.down_proj",))

    def forward(self, x):
        y, _ = self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))
        return y


class TopK(nn.Module):
    """SGLang's TopK: (weights, ids, router logits); softmax, top-k, renormalised."""

    def forward(self, logits):
        if HF is not None:  # Qwen3MoeTopKRouter's steps after its F.linear
            p = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
            w, ids = torch.topk(p, DIMS["top_k"], dim=-1)
            w /= w.sum(dim=-1, keepdim=True)
            return w.to(logits.dtype), ids.to(torch.int32), logits
        p = torch.softmax(logits.double(), dim=-1)
        w, ids = torch.topk(p, DIMS["top_k"], dim=-1)
        return (w / w.sum(-1, keepdim=True)).to(F), ids.to(torch.int32), logits


class QuantMethod(nn.Module):
    """FusedMoE's unquantized method: an nn.Module child in both sources (CustomOp), so FusedMoE is no leaf."""


class FusedMoE(nn.Module):
    def __init__(self, sd, pre, r, n):
        super().__init__()
        I = DIMS["moe_inter"]
        s = slice(r * I // n, (r + 1) * I // n)
        E = DIMS["experts"]
        self.w13 = [torch.cat([sd[f"{pre}.{e}.gate_proj.weight"][s], sd[f"{pre}.{e}.up_proj.weight"][s]])
                    for e in range(E)]
        self.w2 = [sd[f"{pre}.{e}.down_proj.weight"][:, s].clone() for e in range(E)]
        self.quant_method = QuantMethod()
        self.act = SiluAndMul()
        self.hf = pre

    def forward(self, x, weights, ids):
        if HF is not None:
            return hf_experts_partial(_hf(self.hf), x, ids.long(), weights)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=F)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                out[t] = out[t] + weights[t, j] * linear(self.act(linear(x[t:t + 1], self.w13[e])), self.w2[e])[0]
        return out  # a partial sum over the rank's slice of each expert (reduce_results=False)


def hf_experts_partial(experts: nn.Module, x, ids, weights) -> torch.Tensor:
    """This rank's partial sum of transformers' experts module over a slice of every expert's intermediate,
    as vLLM's and SGLang's FusedMoE gives it under TP (reduce_results=False). Up to transformers 5.24 its TP
    plan shards the experts so (``moe_tp_experts``) and all-reduces their output: the tensor it hands to the
    all-reduce is kept. From 5.25 the TP plan leaves the experts whole on every rank: its forward runs on
    the rank's slice of the weights ([gate; up] rows and down_proj's columns), the same sum the old plan
    made."""
    gate_up = experts.gate_up_proj
    gate_up = gate_up.to_local() if hasattr(gate_up, "to_local") else gate_up
    r, n = tp_info()
    I = DIMS["moe_inter"]
    if n == 1 or gate_up.shape[-2] != 2 * I:  # one rank, or transformers sharded the experts itself
        handed, real = [], dist.all_reduce

        def keep(t, *a, **k):
            handed.append(t.detach().clone())
            return real(t, *a, **k)
        dist.all_reduce = keep
        try:
            out = experts(x, ids, weights)
        finally:
            dist.all_reduce = real
        return handed[-1] if handed else out
    s = slice(r * I // n, (r + 1) * I // n)
    down = experts.down_proj
    down = down.to_local() if hasattr(down, "to_local") else down
    mine = {"gate_up_proj": torch.cat([gate_up[:, s], gate_up[:, I:][:, s]], dim=1),
            "down_proj": down[:, :, s]}
    return torch.func.functional_call(experts, mine, (x, ids, weights))


class MoEBlock(nn.Module):
    def __init__(self, sd, pre, r, n, engine, dumper=None):
        super().__init__()
        self.gate = Linear(sd[f"{pre}.gate.weight"], hf=(f"{pre}.gate",))
        self.topk = TopK()
        self.experts = FusedMoE(sd, f"{pre}.experts", r, n)
        self.engine, self.dumper, self.layer = engine, dumper, int(pre.split(".")[2])

    def forward(self, x):
        logits, _ = self.gate(x)
        w, ids, _ = self.topk(logits)
        partial = self.experts(x, w, ids)
        if self.dumper is not None:  # the explicit dump call a user adds: the pre-reduction sum
            self.dumper.dump("moe", partial, dims="t h[tp:partial]")  # layer_id: the layer's ctx hook
        return all_reduce(partial.clone())


class Layer(nn.Module):
    def __init__(self, sd, li, r, n, kind, engine, dumper=None):
        super().__init__()
        pre = f"model.layers.{li}"
        self.self_attn = SelfAttn(sd, f"{pre}.self_attn", r, n)
        self.mlp = MoEBlock(sd, f"{pre}.mlp", r, n, engine, dumper) if kind == "moe" else MLP(sd, f"{pre}.mlp", r, n)
        self.input_layernorm = RMSNorm(sd[f"{pre}.input_layernorm.weight"], hf=f"{pre}.input_layernorm")
        self.post_attention_layernorm = RMSNorm(sd[f"{pre}.post_attention_layernorm.weight"],
                                                hf=f"{pre}.post_attention_layernorm")
        self.layer_id = li

    def forward(self, positions, x, residual):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


@dataclass
class Batch:
    """What SGLang's ForwardBatch carries that the dumpers read."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor | None = None
    rids: list | None = None


class Model(nn.Module):
    def __init__(self, sd, kind, engine, dumper=None):
        super().__init__()
        r, n = tp_info()
        self.embed_tokens = Embedding(sd["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(Layer(sd, li, r, n, kind, engine, dumper) for li in range(DIMS["layers"]))
        self.norm = RMSNorm(sd["model.norm.weight"], hf="model.norm")

    def forward(self, input_ids, positions, batch=None):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LogitsProcessor(nn.Module):
    def __init__(self, engine, output_cls=None):
        super().__init__()
        self.engine, self.output_cls = engine, output_cls

    def forward(self, lm_head, hidden, last):
        r, n = tp_info()
        if HF is not None:  # transformers' lm_head over every row, as the hf engines call it; gathered already
            local = lm_head(hidden)[0][last]
            return None if self.engine == "vllm" and r != 0 else (
                local if self.output_cls is None else self.output_cls(next_token_logits=local))
        local = linear(hidden[last], lm_head.weight)
        if n > 1:
            parts = [torch.empty_like(local) for _ in range(n)]
            dist.all_gather(parts, local)
            local = torch.cat(parts, dim=-1)
            if self.engine == "vllm" and r != 0:
                return None  # vLLM gathers to rank 0 only
        return local if self.output_cls is None else self.output_cls(next_token_logits=local)


class ForCausalLM(nn.Module):
    def __init__(self, sd, kind, engine, output_cls=None, dumper=None):
        super().__init__()
        r, n = tp_info()
        self.model = Model(sd, kind, engine, dumper)
        per = VOCAB // n
        self.lm_head = Linear(sd["lm_head.weight"][r * per:(r + 1) * per].clone(), hf=("lm_head",))
        self.logits_processor = LogitsProcessor(engine, output_cls)
        self.engine = engine

    def forward(self, ids, positions, batch, segments, caches):
        caches["segments"] = segments
        for layer in self.model.layers:
            layer.self_attn.attn.batch = (caches, layer.layer_id)
        if self.engine == "vllm":
            hidden = self.model(ids, positions)
        else:
            hidden = self.model(ids, positions, batch)
        last = torch.tensor([rows.stop - 1 for _, rows in segments])
        return self.logits_processor(self.lm_head, hidden, last)


# ---------------------------------------------------------------------------------------------- serving


def serve(model: ForCausalLM, prompts: list[list[int]], n_new: int, on_forward=None) -> list[list[int]]:
    """Greedy decode of every request together: one prefill forward of all prompts, then one forward per
    step with a token of each request (rows in request order); returns each request's tokens."""
    caches: dict = {}
    seqs = [list(p) for p in prompts]
    todo = [(i, list(range(len(p)))) for i, p in enumerate(prompts)]
    for step in range(n_new + 1):
        ids, pos, segs, row = [], [], [], 0
        for rid, ps in todo:
            ids += [seqs[rid][p] for p in ps]
            pos += ps
            segs.append((rid, slice(row, row + len(ps))))
            row += len(ps)
        batch = Batch(torch.tensor(ids), torch.tensor(pos), torch.tensor([len(seqs[r]) for r, _ in todo]))
        with torch.no_grad():
            out = model(batch.input_ids, batch.positions, batch, segs, caches)
        if on_forward:
            on_forward()
        logits = out if isinstance(out, torch.Tensor) or out is None else out.next_token_logits
        if step == n_new:
            break
        if logits is None:  # a vLLM rank other than 0: rank 0 samples and broadcasts
            nxt = torch.zeros(len(todo), dtype=torch.int64)
        else:
            nxt = torch.argmax(logits, dim=-1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(nxt, 0)
        for (rid, _), t in zip(todo, nxt.tolist()):
            seqs[rid].append(int(t))
        todo = [(rid, [len(seqs[rid]) - 1]) for rid, _ in todo]
    return seqs


# ---------------------------------------------------------------------------------------------- dumpers


class PassDumper:
    """Follows vllm/debug/tensor_dump.py's TensorDumper and SGLang's tensor_dump_forward_hook.py: forward
    hooks on every leaf module and on the top-level `model`, whose hook records the forward's ids and
    positions, writes ``Pass{NNNNN}.pt`` of everything recorded so far, then records its own output
    (so the logits processor, which runs after it, lands in the next pass)."""

    def __init__(self, root: Path, engine: str, tp_size: int, tp_rank: int, pp_rank: int = 0):
        self.engine, self.pass_id, self.current = engine, 0, {}
        rank = tp_size * pp_rank + tp_rank
        self.dir = Path(root) / f"TP{tp_rank}_PP{pp_rank}_Rank{rank}_pid{os.getpid()}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def add(self, name, item):
        if isinstance(item, (tuple, list)):
            keep = (lambda t: isinstance(t, torch.Tensor)) if self.engine == "vllm" else (lambda t: t is not None)
            ts = [t.cpu() for t in item if keep(t)]
            if len(ts) == 1:
                self.current[name] = ts[0]
            elif len(ts) > 1 or self.engine == "sglang":
                self.current[name] = ts
        elif isinstance(item, torch.Tensor):
            self.current[name] = item.cpu()
        elif isinstance(item, Batch):  # SGLang's ForwardBatch
            for f in ("input_ids", "seq_lens", "positions"):
                self.current[f"{name}.forward_batch_info.{f}"] = getattr(item, f).cpu()
        elif hasattr(item, "next_token_logits"):  # SGLang's LogitsProcessorOutput
            self.current[name] = item.next_token_logits.cpu()

    def flush(self):
        if self.current:
            torch.save(self.current, self.dir / f"Pass{self.pass_id:05d}.pt")
            self.current = {}
            self.pass_id += 1

    def install(self, model: nn.Module, prefix: str = "") -> int:
        for name, module in model._modules.items():
            top = not prefix and name == "model"
            cur = name if not prefix else f"{prefix}.{name}"
            n_sub = self.install(module, cur)
            if n_sub == 0 or top:
                module.register_forward_hook(self._hook(cur, top))
        return len(model._modules)

    def _hook(self, name, top):
        def hook(module, args, output):
            if top:
                if self.engine == "vllm":
                    self.add(f"{name}.forward_batch_info.input_ids", args[0])
                    self.add(f"{name}.forward_batch_info.positions", args[1])
                else:
                    for a in args:
                        if isinstance(a, Batch):
                            self.add(name, a)
                self.flush()
            if output is not None:
                self.add(name, output)
        return hook


class DumperWriter:
    """Follows SGLang's dumper.py _Dumper._dump_single: one file per tensor, ``step=..___rank=..___
    dump_index=..___name=..[___tag=v].pt`` holding {"value", "meta"} in one experiment folder; the
    non-intrusive mode's names for module outputs and the forward batch's core fields."""

    def __init__(self, root: Path, rank: int, world: int):
        self.dir = Path(root) / "dump_fixture"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world, self.step_no, self.index, self.ctx = rank, world, 0, 0, {}

    def dump(self, name, value, dims=None, **tags):
        self.index += 1
        full = dict(step=self.step_no, rank=self.rank, dump_index=self.index, name=name,
                    recompute_status="disabled", **tags, **self.ctx)
        meta = dict(**full, world_rank=self.rank, world_size=self.world,
                    sglang_parallel_info=dict(tp_rank=self.rank, tp_size=self.world))
        if dims is not None:
            meta["dims"] = dims
        fname = "___".join(f"{k}={v}" for k, v in full.items()) + ".pt"
        torch.save({"value": value.detach().clone(), "meta": meta}, self.dir / fname)

    def step(self):
        self.step_no += 1

    def install(self, model: nn.Module):
        for mname, module in model.named_modules():
            if mname.startswith("model.layers.") and mname.count(".") == 2:
                li = int(mname.split(".")[2])
                module.register_forward_pre_hook(lambda m, a, li=li: self.ctx.update(layer_id=li))
                module.register_forward_hook(lambda m, a, o: self.ctx.clear())
            module.register_forward_pre_hook(self._pre(mname), with_kwargs=True)
            module.register_forward_hook(self._post(mname))

    def _pre(self, mname):
        def hook(module, args, kwargs):
            for a in args:
                if isinstance(a, Batch) and mname == "":
                    for f in ("input_ids", "positions", "seq_lens"):
                        self.dump(f, getattr(a, f))
        return hook

    def _post(self, mname):
        def hook(module, args, output):
            if output is None or mname == "":
                return
            if isinstance(output, torch.Tensor):
                self.dump(f"non_intrusive__{mname}.output", output)
            elif isinstance(output, (tuple, list)):
                ts = [t for t in output if isinstance(t, torch.Tensor)]
                if len(ts) == 1:
                    self.dump(f"non_intrusive__{mname}.output", ts[0])
                else:
                    for i, t in enumerate(ts):
                        self.dump(f"non_intrusive__{mname}.output.{i}", t)
            elif hasattr(output, "next_token_logits"):
                self.dump(f"non_intrusive__{mname}.output.next_token_logits", output.next_token_logits)
        return hook


@dataclass
class LogitsOutput:
    """SGLang's LogitsProcessorOutput, as far as the dumpers read it."""
    next_token_logits: torch.Tensor


def run_all(sd: dict, kind: str, prompts: list[list[int]], n_new: int, out: Path,
            hf_from: Path | None = None) -> dict[str, list[list[int]]]:
    """This rank's dumps of one batch in the three formats: out/vllm, out/sglang (legacy), out/dumper;
    computed by the exact ops, or by transformers' model of the checkpoint folder ``hf_from``."""
    with hf_ops(hf_from):
        return _dump_three(sd, kind, prompts, n_new, out)


def _dump_three(sd, kind, prompts, n_new, out):
    r, n = tp_info()
    got = {}
    m = ForCausalLM(sd, kind, "vllm").eval()
    PassDumper(out / "vllm", "vllm", n, r).install(m)
    got["vllm"] = serve(m, prompts, n_new)
    m = ForCausalLM(sd, kind, "sglang", LogitsOutput).eval()
    PassDumper(out / "sglang", "sglang", n, r).install(m)
    got["sglang"] = serve(m, prompts, n_new)
    w = DumperWriter(out / "dumper", r, n)
    m = ForCausalLM(sd, kind, "sglang", LogitsOutput, dumper=w).eval()
    w.install(m)
    got["dumper"] = serve(m, prompts, n_new, on_forward=w.step)
    return got


def _rank_main(rank: int, world: int, port: int, jobs: list[tuple], target):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)  # as the hf-dist engine's ranks
        for sd_path, kind, prompts, n_new, out, hf_from in jobs:
            target(torch.load(sd_path, weights_only=True), kind, prompts, n_new, Path(out),
                   Path(hf_from) if hf_from else None)
    finally:
        dist.destroy_process_group()


def run_tp(jobs: list[tuple], world: int = 2, target=run_all) -> None:
    """``target`` (run_all: the three dumps) of each job (weights, kind, prompts, new tokens, folder[, the
    checkpoint folder for hf ops]) in a TP=world run: `world` processes over gloo on this machine, started
    once for all the jobs. A target takes the five and hf_from (the checkpoint folder, or None)."""
    import socket

    import torch.multiprocessing as mp

    args = []
    for sd, kind, prompts, n_new, out, *hf_from in jobs:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(sd, out / "weights.pt")
        args.append((str(out / "weights.pt"), kind, prompts, n_new, str(out), str(hf_from[0]) if hf_from else ""))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(world, port, args, target), nprocs=world, start_method="spawn")
    for a in args:
        Path(a[0]).unlink()
