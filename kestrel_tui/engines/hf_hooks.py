"""Probe capture on transformers' own Qwen3 / Qwen3-MoE modules, through public hooks only.

Where each key is read (docs/engines-hf.md has the table):

* module forward hooks see a module's input and output at once, so one hook on
  ``input_layernorm`` gives the layer input (emb / previous x) and nrm, one on
  ``post_attention_layernorm`` gives ores and pnrm; ``k_proj`` / ``k_norm``
  give kraw / knorm; ``model.norm`` gives the last layer's x;
* a wrapper registered in transformers' AttentionInterface (around the real
  eager or sdpa function) sees Q and K after RoPE and V as the cache returns
  them — every position, so the step's own rows are the last M — and the
  attention output that o_proj takes.

Few hooks on purpose: a hooked module leaves torch's fast call path, and the
capture must stay a small share of a decode step. Isolate mode adds the
feeding hooks for its run only.
"""
from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..backends.base import StepOut
from ..backends.ops_exact import kvquant
from ..trace.fnv import fnv1a64
from ..trace.keys import layer_fields

F32 = np.float32

# key field -> the module (or attention call) whose input or output the capture reads it from; the docs'
# table (docs/engines-hf.md) says more. k, ks and vs are not read: they are made from kpre and v (KV_MADE).
CAPTURED = {
    "emb": "L[0].input_layernorm input", "nrm": "L.input_layernorm output", "kraw": "L.self_attn.k_norm input",
    "knorm": "L.self_attn.k_norm output", "kpre": "attention key", "v": "attention value",
    "qrope": "attention query", "attn": "attention output", "ores": "L.post_attention_layernorm input",
    "pnrm": "L.post_attention_layernorm output", "router": "L.mlp.gate output 0", "topw": "L.mlp.gate output 1",
    "topk": "L.mlp.gate output 2", "moe": "L.mlp output", "x": "L[l+1].input_layernorm / model.norm input",
    "logits": "the forward's logits"}
KV_MADE = {"k": "kpre", "ks": "kpre", "vs": "v"}  # kvquant of the row under q8; kpre itself and ones under f32
# where a graft (session/graft.py) puts the reference's value: a hook returning it in place of the module's
# output or input; the attention rows take the reference's rows of every position, as isolate does
GRAFTED = {
    "emb": "model.embed_tokens output", "nrm": "L.input_layernorm output", "kraw": "L.self_attn.k_norm input",
    "knorm": "L.self_attn.k_norm output", "qrope": "attention query", "kpre": "attention key rows",
    "k": "attention key rows", "ks": "attention key rows", "v": "attention value rows",
    "vs": "attention value rows", "attn": "L.self_attn.o_proj input",
    "ores": "L.post_attention_layernorm input, and the residual the layer adds its FFN output to",
    "pnrm": "L.post_attention_layernorm output",
    "router": "L.mlp.gate output", "topk": "L.mlp.gate output", "topw": "L.mlp.gate output",
    "moe": "L.mlp output", "x": "L output"}

# attention module -> the capture that owns it (the attention registry is global, the captures are not)
_OWNER: dict[int, "Capture"] = {}
_REGISTERED: set[str] = set()


def attention_name(model, impl: str) -> str:
    """Register (once) our wrapper of ``impl`` for this model's modeling module; return its registry name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(model).__module__]
    name = f"kestrel_{impl}_{model.config.model_type}"
    if name in _REGISTERED:
        return name
    # eager is no registry entry: it is the modeling file's own eager_attention_forward
    real = modeling.eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]

    def attention(module, query, key, value, attention_mask, **kwargs):
        cap = _OWNER.get(id(module))
        if cap is not None:
            query, key, value = cap.on_attention(module.layer_idx, query, key, value)
        out, weights = real(module, query, key, value, attention_mask, **kwargs)
        if cap is not None:
            cap.bufs["attn", module.layer_idx] = (out, _flat)
        return out, weights

    AttentionInterface.register(name, attention)
    # the mask builder is looked up by the same name: the wrapped function's own one
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    _REGISTERED.add(name)
    return name


@dataclass(frozen=True)
class Shape:
    n_layers: int
    n_heads: int
    n_kv: int
    head_dim: int
    moe_layers: frozenset[int]


def model_shape(model) -> Shape:
    cfg = model.config
    layers = model.model.layers[:cfg.num_hidden_layers]
    return Shape(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                 getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                 frozenset(i for i, L in enumerate(layers) if hasattr(L.mlp, "gate")))


class Capture:
    """Hooks on one torch model; `step` runs one forward of M tokens and returns its keys per column."""

    def __init__(self, model, kv: str, deep: bool):
        self.model, self.kv, self.deep = model, kv, deep
        self.shape = s = model_shape(model)
        self.fields = layer_fields(deep)
        self._ones = np.ones(s.n_kv, F32)
        self._ones_hash = fnv1a64(self._ones)
        self._none = np.zeros(0, F32), np.zeros(0, np.int32)  # a dense layer's router/topk/topw
        self._base, self._extra = [], []
        self.bufs: dict[tuple[str, int | None], torch.Tensor] = {}
        self._feed = None
        self._graft, self._graft_cols = None, None  # a graft's reference Trace and sites; this step's columns
        # transformers 5 renamed forward's past_key_values to cache (the old name still warns)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._install()

    # -- hooks
    def _install(self):
        m, s = self.model, self.shape
        layers = m.model.layers[:s.n_layers]
        for li, L in enumerate(layers):
            attn = L.self_attn
            _OWNER[id(attn)] = self
            self._base += [
                L.input_layernorm.register_forward_hook(self._nrm_hook(li)),
                attn.k_norm.register_forward_hook(self._knorm_hook(li)),
                L.post_attention_layernorm.register_forward_hook(self._pnrm_hook(li)),
            ]
            if self.deep:
                self._base.append(L.mlp.register_forward_hook(self._out_hook("moe", li)))
                if li in s.moe_layers:
                    self._base.append(L.mlp.gate.register_forward_hook(self._router_hook(li)))
        self._base.append(m.model.norm.register_forward_hook(self._final_hook))

    def remove(self):
        for h in self._base + self._extra:
            h.remove()
        self._base, self._extra = [], []
        for L in self.model.model.layers:
            if _OWNER.get(id(L.self_attn)) is self:
                del _OWNER[id(L.self_attn)]

    def record(self, field: str, layer: int | None, t: torch.Tensor, view=None):
        """Keep a tensor as the forward made it; ``view`` (batch-stripped by default) picks the key's
        [M, ...] layout later, on the numpy side, where indexing costs a fraction of a torch op."""
        self.bufs[field, layer] = (t, view or _batch)

    def _nrm_hook(self, li: int):
        def hook(module, args, out):
            if self._feed is None:  # isolated, the layer input is the reference's: x comes from the layer hook
                self.bufs["emb" if li == 0 else "x", None if li == 0 else li - 1] = (args[0], _batch)
            self.bufs["nrm", li] = (out, _batch)
            return self._fed("nrm", li, out)
        return hook

    def _knorm_hook(self, li: int):
        def hook(module, args, out):
            if self._feed is None:  # isolated, the input is the fed kraw: HF's own is kept by the pre-hook
                self.bufs["kraw", li] = (args[0], _flat)
            self.bufs["knorm", li] = (out, _batch)
            return self._fed("knorm", li, out)
        return hook

    def _pnrm_hook(self, li: int):
        def hook(module, args, out):
            if self._feed is None:  # isolated, the input is the fed ores: HF's own is kept by the pre-hook
                self.bufs["ores", li] = (args[0], _batch)
            if self.deep:
                self.bufs["pnrm", li] = (out, _batch)
        return hook

    def _out_hook(self, field: str, li: int):
        def hook(module, args, out):
            self.bufs[field, li] = (out, _batch)
        return hook

    def _router_hook(self, li: int):
        def hook(module, args, out):
            logits, weights, idx = out  # Qwen3MoeTopKRouter: (router logits, top-k weights, top-k ids)
            self.bufs["router", li], self.bufs["topw", li], self.bufs["topk", li] = \
                (logits, _same), (weights, _same), (idx, _same)
        return hook

    def _final_hook(self, module, args, out):
        if self._feed is None:
            self.bufs["x", self.shape.n_layers - 1] = (args[0], _batch)

    def on_attention(self, li: int, query, key, value):
        b = self.bufs
        b["qrope", li], b["kpre", li], b["v", li] = (query, _heads), (key, _new_rows), (value, _new_rows)
        if self._graft is not None:
            return self._grafted_attention(li, query, key, value)
        if self._feed is None:
            return query, key, value
        # isolate: the reference's Q, and its K/V rows for every position (what its cache holds)
        q = self._ref("qrope", li).transpose(0, 1)[None]
        k, v = self._ref_rows(li, key.shape[2])
        return q.to(query.dtype), k.to(key.dtype), v.to(value.dtype)

    # -- isolate: feeding the reference's buffers
    def _ref(self, field: str, layer: int | None) -> torch.Tensor:
        """The reference's buffer for this step's columns, [M, ...], on the model's device and dtype."""
        pos0, cols = self._feed
        name = f"t{{}}_{field}" if layer is None else f"t{{}}_l{layer}_{field}"
        a = np.stack([np.asarray(c[name.format(pos0 + m)]) for m, c in enumerate(cols)])
        return torch.from_numpy(np.ascontiguousarray(a)).to(self._device, self._dtype)

    def _ref_rows(self, li: int, T: int, trace=None):
        """K/V [1, n_kv, T, hd] from the reference trace (q8 rows dequantized), grown as the run goes."""
        have_k, have_v = self._rows.get(li, ([], []))
        for t in range(len(have_k), T):
            raw = (trace or self._trace).positions[t].raw
            k, v = (np.asarray(raw[f"t{t}_l{li}_{f}"], F32) for f in ("k", "v"))
            if self.kv == "q8":
                k = k * np.asarray(raw[f"t{t}_l{li}_ks"])[..., None]
                v = v * np.asarray(raw[f"t{t}_l{li}_vs"])[..., None]
            have_k.append(k)
            have_v.append(v)
        self._rows[li] = have_k, have_v
        k, v = (torch.from_numpy(np.stack(r[:T], axis=1)[None]).to(self._device) for r in (have_k, have_v))
        return k, v

    def _fed(self, field: str, li: int, out):
        if self._feed is None:
            return None
        return self._ref(field, li).reshape(out.shape)

    def _isolate_hooks(self):
        m, s = self.model, self.shape
        hooks = [m.model.embed_tokens.register_forward_hook(
            lambda mod, args, out: self.record("emb", None, out))]
        for li, L in enumerate(m.model.layers[:s.n_layers]):
            prev = ("emb", None) if li == 0 else ("x", li - 1)

            def layer_in(mod, args, kwargs, prev=prev):
                h = self._ref(*prev).reshape(args[0].shape)
                return (h, *args[1:]), kwargs

            def kraw_in(mod, args, li=li):  # k_norm takes the reference's kraw
                self.record("kraw", li, args[0], _flat)
                return (self._ref("kraw", li).reshape(args[0].shape), *args[1:])

            def attn_out(mod, args, li=li):  # o_proj takes the reference's attention output
                return (self._ref("attn", li).reshape(args[0].shape), *args[1:])

            def ffn_in(mod, args, li=li):
                self.record("ores", li, args[0])
                fed = self._ref("ores", li).reshape(args[0].shape)
                self.bufs["_ores", li] = fed
                return (fed, *args[1:])

            def layer_out(mod, args, out, li=li):
                # HF adds the FFN output to a residual it keeps in a local (its own ores): the reference
                # adds it to the fed ores, so the one add is redone here on the fed value
                y = self.bufs.pop(("_mlp", li))
                x = self.bufs.pop(("_ores", li)) + y
                self.record("x", li, x)
                return x if not isinstance(out, tuple) else (x, *out[1:])

            def mlp_out(mod, args, out, li=li):
                self.bufs["_mlp", li] = out

            hooks += [L.register_forward_pre_hook(layer_in, with_kwargs=True),
                      L.self_attn.k_norm.register_forward_pre_hook(kraw_in),
                      L.self_attn.o_proj.register_forward_pre_hook(attn_out),
                      L.post_attention_layernorm.register_forward_pre_hook(ffn_in),
                      L.mlp.register_forward_hook(mlp_out),
                      L.register_forward_hook(layer_out)]
        last = ("x", s.n_layers - 1)
        hooks.append(m.model.norm.register_forward_pre_hook(
            lambda mod, args: (self._ref(*last).reshape(args[0].shape), *args[1:])))
        return hooks

    # -- graft: the reference's value at chosen sites, the subject's own everywhere else
    def _graft_columns(self, field: str, layer: int | None) -> torch.Tensor:
        """The reference's buffer for this step's columns, [M, ...]."""
        pos0, cols = self._graft_cols
        name = f"t{{}}_{field}" if layer is None else f"t{{}}_l{layer}_{field}"
        return torch.from_numpy(np.ascontiguousarray(np.stack([np.asarray(c[name.format(pos0 + m)])
                                                               for m, c in enumerate(cols)])))

    def _graft_ref(self, field: str, layer: int | None, like: torch.Tensor) -> torch.Tensor:
        return self._graft_columns(field, layer).to(like.device, like.dtype).reshape(like.shape)

    def _grafted_attention(self, li: int, query, key, value):
        sites = self._graft[1]
        if ("qrope", li) in sites:  # [M, H, hd] -> the call's [1, H, M, hd]
            query = self._graft_columns("qrope", li).transpose(0, 1)[None].to(query.device, query.dtype)
        rows = [f for f in ("kpre", "k", "ks", "v", "vs") if (f, li) in sites]
        if rows:
            k, v = self._ref_rows(li, key.shape[2], self._graft[0])
            if set(rows) & {"kpre", "k", "ks"}:
                key = k.to(key.dtype)
            if set(rows) & {"v", "vs"}:
                value = v.to(value.dtype)
        return query, key, value

    def _graft_hooks(self, sites) -> list:
        unknown = sorted({f for f, _ in sites} - set(GRAFTED))
        if unknown:
            raise ValueError(f"no graft at {', '.join(unknown)}")
        m = self.model
        hooks = []

        def out_hook(field, layer):
            def hook(mod, args, out):
                if isinstance(out, tuple):  # a decoder layer, or a gate's (logits, weights, ids)
                    return (self._graft_ref(field, layer, out[0]), *out[1:])
                return self._graft_ref(field, layer, out)
            return hook

        def in_hook(field, layer):
            return lambda mod, args: (self._graft_ref(field, layer, args[0]), *args[1:])

        def gate_hook(layer):
            def hook(mod, args, out):
                logits, weights, idx = out
                return (self._graft_ref("router", layer, logits), self._graft_ref("topw", layer, weights),
                        self._graft_ref("topk", layer, idx.to(torch.int32)).to(idx.dtype))
            return hook

        def ores_hooks(li):
            # HF keeps ores in a local (the residual its FFN output is added to): the norm takes the
            # reference's value, and the layer's last add is redone on it, as isolate does
            L = m.model.layers[li]

            def ffn_in(mod, args):
                fed = self._graft_ref("ores", li, args[0])
                self.bufs["_graft_ores", li] = fed
                return (fed, *args[1:])

            def mlp_out(mod, args, out):
                self.bufs["_graft_mlp", li] = out

            def layer_out(mod, args, out):
                x = self.bufs.pop(("_graft_ores", li)) + self.bufs.pop(("_graft_mlp", li))
                return x if not isinstance(out, tuple) else (x, *out[1:])
            return [L.post_attention_layernorm.register_forward_pre_hook(ffn_in),
                    L.mlp.register_forward_hook(mlp_out), L.register_forward_hook(layer_out)]

        gated = set()
        for field, li in sorted(sites, key=lambda s: (s[1] is None, s[1] or 0, s[0])):
            L = m.model.layers[li] if li is not None else None
            if field == "emb":
                hooks.append(m.model.embed_tokens.register_forward_hook(out_hook("emb", None)))
            elif field == "nrm":
                hooks.append(L.input_layernorm.register_forward_hook(out_hook(field, li)))
            elif field == "knorm":
                hooks.append(L.self_attn.k_norm.register_forward_hook(out_hook(field, li)))
            elif field == "kraw":
                hooks.append(L.self_attn.k_norm.register_forward_pre_hook(in_hook(field, li)))
            elif field == "attn":
                hooks.append(L.self_attn.o_proj.register_forward_pre_hook(in_hook(field, li)))
            elif field == "ores":
                hooks += ores_hooks(li)
            elif field == "pnrm":
                hooks.append(L.post_attention_layernorm.register_forward_hook(out_hook(field, li)))
            elif field == "moe":
                hooks.append(L.mlp.register_forward_hook(out_hook(field, li)))
            elif field == "x":
                hooks.append(L.register_forward_hook(out_hook(field, li)))
            elif field in ("router", "topk", "topw") and hasattr(L.mlp, "gate") and li not in gated:
                gated.add(li)  # router, topk and topw are one site: the gate's output
                hooks.append(L.mlp.gate.register_forward_hook(gate_hook(li)))
        return hooks

    def begin(self, isolate_from=None, graft=None):
        """Start a run; ``isolate_from`` (a reference Trace) feeds every op the reference's buffers;
        ``graft`` (engines/base.Graft) feeds them only at its sites."""
        p = next(self.model.parameters())
        self._device, self._dtype = p.device, p.dtype
        self._trace, self._rows = isolate_from, {}
        for h in self._extra:
            h.remove()
        self._extra = self._isolate_hooks() if isolate_from is not None else []
        if graft is not None:
            self._graft = (graft.reference, frozenset(graft.sites))
            self._extra += self._graft_hooks(graft.sites)

    def end(self):
        for h in self._extra:
            h.remove()
        self._extra, self._trace, self._rows, self._feed = [], None, {}, None
        self._graft, self._graft_cols = None, None

    # -- one forward
    def step(self, ids: Sequence[int], pos0: int, cache, raw: bool = True) -> StepOut:
        M = len(ids)
        self.bufs = {}
        self._feed = None if self._trace is None else (
            pos0, [self._trace.positions[pos0 + m].raw for m in range(M)])
        if self._graft is not None:
            self._graft_cols = (pos0, [self._graft[0].positions[pos0 + m].raw for m in range(M)])
        try:
            with torch.inference_mode():
                out = self.model(input_ids=torch.tensor([list(ids)], device=self._device), use_cache=True,
                                 **{self._cache_kw: cache})
        finally:
            self._feed = None
        self.bufs["logits", None] = (out.logits, _batch)
        return self._collect(pos0, M, raw)

    def batch_step(self, ids, mask, positions, row: int, pad: int, pos0: int, cache, raw: bool = True) -> StepOut:
        """One forward of a left-padded batch (engines/hf_batch.py): row ``row``'s columns from ``pad`` on
        kept, in the keys of a single sequence; ``next_tokens`` then holds every row's greedy next token."""
        self.bufs = {}
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self._cache_kw: cache})
        self.bufs["logits", None] = (out.logits, _batch)
        rows, cols = ids.shape
        self.bufs = {k: (_one_row(t, view, row, pad, rows, cols), view) for k, (t, view) in self.bufs.items()
                     if not k[0].startswith("_")}
        step = self._collect(pos0, cols - pad, raw)
        self.next_tokens = out.logits[:, -1].argmax(-1).tolist()
        return step

    def _collect(self, pos0: int, M: int, raw: bool) -> StepOut:
        bufs = {k: v for k, v in self.bufs.items() if not k[0].startswith("_")}
        arrs = _to_numpy(bufs, M)
        s = self.shape
        layers = range(s.n_layers)
        if self.kv == "q8":  # quantized row by row, so all layers at once: one call instead of 2 a layer
            k, ks = kvquant(np.stack([arrs["kpre", li] for li in layers]))
            v, vs = kvquant(np.stack([arrs["v", li] for li in layers]))
        for li in layers:
            if self.kv == "q8":
                arrs["k", li], arrs["ks", li], arrs["v", li], arrs["vs", li] = k[li], ks[li], v[li], vs[li]
            else:
                arrs["k", li] = arrs["kpre", li]
            if self.deep and li not in s.moe_layers:
                arrs["router", li] = arrs["topw", li] = np.broadcast_to(self._none[0], (M, 0))
                arrs["topk", li] = np.broadcast_to(self._none[1], (M, 0))
        ones = self.kv != "q8"  # ks/vs are one shared ones row: hashed once
        hashes, raws = [], []
        for m in range(M):
            t = pos0 + m
            col: dict[str, np.ndarray] = {f"t{t}_emb": arrs["emb", None][m]}
            for li in range(s.n_layers):
                for f in self.fields:
                    col[f"t{t}_l{li}_{f}"] = self._ones if ones and f in ("ks", "vs") else arrs[f, li][m]
            col[f"t{t}_logits"] = arrs["logits", None][m]
            hashes.append({name: self._ones_hash if a is self._ones else fnv1a64(a) for name, a in col.items()})
            raws.append(col)
        return StepOut(logits=arrs["logits", None], hashes=hashes, raw=raws if raw else None)


# Key layouts from what the forward made (each works on a numpy array and on a torch tensor alike):
# hidden states [1, M, ...] -> [M, ...]; Q [1, H, M, hd] -> [M, H, hd]; the cache's K/V [1, n_kv, T, hd]
# -> the step's own rows [M, n_kv, hd]; kraw / attention output [1, M, heads, hd] -> [M, heads*hd].
def _batch(a, M):
    return a[0]


def _same(a, M):
    return a


def _flat(a, M):
    return a[0].reshape(M, -1)


def _heads(a, M):
    return a[0].swapaxes(0, 1)


def _new_rows(a, M):
    return a[0, :, a.shape[2] - M:].swapaxes(0, 1)


def _one_row(t, view, row: int, pad: int, rows: int, cols: int):
    """One row's part of a batch's tensor from column ``pad`` on, laid out as a batch of one (the views
    then apply)."""
    if view is _batch or view is _flat:   # [B, M, ...]
        return t[row:row + 1, pad:]
    if view is _heads:                    # Q [B, H, M, hd]
        return t[row:row + 1, :, pad:]
    if view is _new_rows:                 # the cache's K/V [B, n_kv, T, hd]: the row's new rows are the last
        return t[row:row + 1]
    if view is _same:                     # the router's [B*M, ...]
        return t.reshape(rows, cols, *t.shape[1:])[row, pad:]
    raise ValueError(f"no batch layout for the view {getattr(view, '__name__', view)!r}")


def _to_numpy(bufs: Mapping[tuple, tuple], M: int) -> dict[tuple, np.ndarray]:
    """Captured tensors -> f32 numpy (topk int32); a GPU's in one transfer instead of one sync each."""
    out: dict[tuple, np.ndarray] = {}
    gpu = []
    for k, (t, view) in bufs.items():
        if t.device.type != "cpu":
            gpu.append(k)
        elif k[0] == "topk":
            out[k] = t.numpy().astype(np.int32)
        elif t.dtype == torch.float32:  # no copy: a view of the tensor's memory
            a = view(t.numpy(), M)
            out[k] = np.array(a) if view is _new_rows else a  # a raw row must not pin the whole cache
        else:
            out[k] = view(t, M).float().numpy()
    floats = [k for k in gpu if k[0] != "topk"]
    if floats:
        views = [bufs[k][1](bufs[k][0], M) for k in floats]
        flat = torch.cat([v.float().reshape(-1) for v in views]).cpu().numpy()
        i = 0
        for k, v in zip(floats, views):
            n = v.numel()
            out[k] = flat[i:i + n].reshape(tuple(v.shape))
            i += n
    for k in gpu:
        if k[0] == "topk":
            out[k] = bufs[k][0].to(torch.int32).cpu().numpy()
    return out
