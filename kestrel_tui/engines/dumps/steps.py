"""One forward of every rank -> our fields, tokens first, each put back together by its layout.

The input is, per rank, the dict a dumper wrote for one forward (module path -> tensor, or a list of
a tuple output's tensors); the output maps (field, layer) to an Assembled tensor [rows, ...] whose
rows are the forward's flattened tokens. names.py says which module gives which field and how it
is sharded; shards.py puts the shards together.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ...errors import UsageError
from ...text import inert
from .names import SHAPE_MODULES, Rule, rules_for
from .shards import Assembled, assemble, kv_ranks, to_numpy

Key = tuple[str, "int | None"]


@dataclass
class Forward:
    ids: np.ndarray                      # [rows] int64
    positions: np.ndarray                # [rows] int64
    keys: dict[Key, Assembled] = field(default_factory=dict)
    logits: Assembled | None = None      # this forward's logits: a row per token or per request
    dense: set[int] = field(default_factory=set)  # layers with a dense MLP (no router)
    notes: list[str] = field(default_factory=list)


def _part(value, rule: Rule):
    """The rule's tensor of a module's dumped output (a tensor, or a list for a tuple output)."""
    if isinstance(value, (list, tuple)):
        if rule.part is None:
            return value[0] if len(value) == 1 else None
        return value[rule.part] if rule.part < len(value) else None
    return value if rule.part in (None, 0) else None


def _numpy(value, label: str) -> np.ndarray:
    a = to_numpy(value, label)
    if isinstance(a, str):
        raise UsageError(f"{label}: {a}; the reader takes the dumpers' tensors only")
    return a


def _qkv_sizes(ranks: list[Mapping], layer: int, labels: list[str]) -> tuple[int, int]:
    """(q width, kv width) of one rank's qkv_proj row, from the rank's q_norm / k_norm [T, heads, hd]."""
    shapes = []
    for name in SHAPE_MODULES:
        v = ranks[0].get(f"model.layers.{layer}.{name}")
        a = None if v is None else _part(v, Rule(name, "", None, "full"))
        if a is None or getattr(a, "ndim", 0) < 2:
            raise UsageError(f"{labels[0]}: model.layers.{layer}.self_attn.qkv_proj needs {name}'s output to be"
                             f" split into q, k and v, and the dump has none; dump every module of the layer")
        shapes.append(int(a.shape[-2]) * int(a.shape[-1]))
    return shapes[0], shapes[1]


def logits_of(ranks: list[Mapping], labels: list[str], name: str = "logits_processor") -> Assembled | None:
    """The logits a forward's files hold: vLLM gathers them to rank 0 (the other ranks' logits processor
    returns None, which the dumper skips); SGLang has them on every rank. The first rank's are taken."""
    for d, label in zip(ranks, labels):
        if name in d:
            a = _numpy(_part(d[name], Rule(name, "logits", None, "full")), f"{label}: {name}")
            return Assembled(a.astype(np.float32, copy=False))
    return None


def assemble_forward(ranks: list[Mapping], labels: list[str], ids: np.ndarray, positions: np.ndarray,
                     n_kv: int | None = None, n_layers: int | None = None,
                     logits_key: str | None = "logits_processor") -> Forward:
    """``ranks[r]``: rank r's dict of this forward; ``labels[r]`` its file, for messages."""
    fw = Forward(ids, positions)
    tp = len(ranks)
    rows = len(ids)
    names = list(dict.fromkeys(k for r in ranks for k in r))
    for name in names:
        layer, rules = rules_for(name)
        if not rules:
            continue
        have = [r for r, d in enumerate(ranks) if name in d]
        if rules[0].field == "logits":
            if name == logits_key:
                fw.logits = logits_of(ranks, labels, name)
            continue
        if len(have) != tp:
            lacks = next(r for r in range(tp) if r not in have)
            raise UsageError(f"{labels[lacks]}: has no {inert(name, 80)}, which {labels[have[0]]} has; the ranks'"
                             f" dumps are of different forwards or models: dump every rank of one run")
        for rule in rules:
            parts = [_part(ranks[r][name], rule) for r in range(tp)]
            if any(p is None for p in parts):
                continue  # e.g. layer 0's input norm is called without a residual: no x of layer -1
            arrs = [_numpy(p, f"{labels[r]}: {inert(name, 80)}") for r, p in enumerate(parts)]
            for r, a in enumerate(arrs):
                if a.ndim == 0 or a.shape[0] != rows:
                    raise UsageError(f"{labels[r]}: {inert(name, 80)} has shape {tuple(a.shape)}, but the forward"
                                     f" has {rows} token rows (input_ids); the dump is damaged")
            keep = kv_ranks(tp, n_kv) if rule.kv else None
            if rule.layout in ("q", "k", "v"):
                q, kv = _qkv_sizes(ranks, layer, labels)
                lo, hi = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[rule.layout]
                for r, a in enumerate(arrs):
                    if a.shape[-1] != q + 2 * kv:
                        raise UsageError(f"{labels[r]}: {inert(name, 80)} rows are {a.shape[-1]} wide, q_norm and"
                                         f" k_norm say {q} + 2*{kv}; the ranks' dumps disagree")
                arrs = [a[..., lo:hi] for a in arrs]
                got = assemble(arrs, "heads", -1, keep)
            else:
                got = assemble(arrs, rule.layout, rule.axis, keep)
            if isinstance(got, str):
                raise UsageError(f"{labels[0]}: {inert(name, 80)}: {got}; the ranks' dumps disagree")
            if rule.module == "mlp.down_proj":
                fw.dense.add(layer)
            if rule.field == "x" and layer is None:
                fw.keys["x", None] = got  # model.norm: the last layer's, numbered once the layers are known
            else:
                fw.keys[rule.field, None if layer is None else layer + rule.shift] = got
    last = n_layers - 1 if n_layers else max((l for (_, l) in fw.keys if l is not None), default=-1)
    if ("x", None) in fw.keys:
        fw.keys["x", last] = fw.keys.pop(("x", None))
    return fw
