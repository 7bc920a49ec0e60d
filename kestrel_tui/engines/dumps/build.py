"""A dump folder -> a Trace of our keys: the chosen request's positions, one forward at a time.

Only the forwards the request is in are loaded, one at a time (two for the passes formats, whose
logits come with the next forward), so memory holds one forward's tensors whatever the dump's size;
the positions' buffers go to a RawStore, which spills to disk past its budget.

Keys are the reference's: f32 buffers (topk int32) of the shapes trace/fields.py gives, hashed as
such. k / ks / v / vs are what our KV cache holds from the engine's K after RoPE and its V, in the
session's KV format (q8: our row quantization of their values; f32: the values, scales of ones) —
as the hf engine makes them.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ...backends.ops_exact import kvquant
from ...errors import UsageError
from ...trace.fnv import fnv1a64
from ...trace.keys import DEEP_FIELDS, FIELDS, emb_key, key_name, logits_key
from ...trace.rawstore import RawStore
from ...trace.run import Cancelled, Position, Trace
from .shards import Assembled
from .tokens import chains, pick

F32 = np.float32
MAX_SKIPPED = 2**18  # positions before a request's first kept as empty ones (a cached prefix): ~60 MB of them
HEADS = ("qrope", "kpre", "v", "knorm")  # [heads, head_dim] per position
_ROUTED = ("router", "topk", "topw")


@dataclass
class DumpTrace(Trace):
    """A Trace read from a serving engine's dump, with what the shards say beyond the values.

    ``partial``: the keys put together by adding per-rank partial sums (judge them by tolerance: the
    sum cannot be the engine's own reduced tensor bit for bit). ``rank_values(key)``: each rank's
    values of a key that was put together from shards. ``notes``: what could not be mapped."""
    partial: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    shards: dict[int, Mapping[str, np.ndarray]] = field(default_factory=dict, repr=False)
    shard_store: RawStore | None = field(default=None, repr=False)

    def rank_values(self, key: str) -> tuple[np.ndarray, ...] | None:
        t = int(key[1:key.index("_")])
        held = self.shards.get(t)
        if held is None or f"{key}@0" not in held:
            return None
        out, r = [], 0
        while f"{key}@{r}" in held:
            out.append(np.asarray(held[f"{key}@{r}"]))
            r += 1
        return tuple(out)


def _head_dim(fw, layer: int) -> int | None:
    kn = fw.keys.get(("knorm", layer))
    return int(kn.value.shape[-1]) if kn is not None and kn.value.ndim == 3 else None


def _row(a: Assembled, row: int, field_name: str, hd: int | None) -> np.ndarray:
    v = a.value[row]
    if field_name == "topk":
        return np.ascontiguousarray(v, dtype=np.int32)
    v = np.ascontiguousarray(v, dtype=F32)
    if field_name in HEADS and v.ndim == 1 and hd:
        v = v.reshape(-1, hd)
    if field_name in ("kraw", "attn") and v.ndim > 1:
        v = v.reshape(-1)
    return v


def read_trace(source, *, want: list[int] | None = None, request: int = 0, n_prompt: int | None = None,
               n_positions: int | None = None, kv: str = "f32", deep: bool = True, n_layers: int | None = None,
               name: str = "dump", raw: bool = True, n_heads: int | None = None, stop=None,
               on_position: Callable[[Position], None] | None = None,
               cancel=None) -> DumpTrace:
    steps = source.index()
    found, segs_by_step = chains(steps, want)
    chain, notes = pick(found, want, request, source.label)
    start = chain.rows[0].pos
    if start > MAX_SKIPPED:  # each position before the request's first is kept, empty: bound them before the loop
        raise UsageError(f"{source.positions_of(chain.rows[0].step)}: the request starts at position {start}; the"
                         f" reader keeps the positions before a request's first (a cached prefix) as empty ones,"
                         f" at most {MAX_SKIPPED}: dump the request from its first token (prefix caching off)")
    rows_by_step: dict[int, list] = {}
    for r in chain.rows:
        if n_positions is None or r.pos < n_positions:
            rows_by_step.setdefault(r.step, []).append(r)
    P = n_prompt if n_prompt is not None else sum(1 for r in chain.rows if r.step == chain.rows[0].step)
    prompt = list(want[:P]) if want is not None else [r.token for r in chain.rows[:P]]
    store, shard_store = RawStore(), RawStore()
    trace = DumpTrace(backend=name, prompt=prompt, store=store, shard_store=shard_store, notes=notes)
    fields = FIELDS + (DEEP_FIELDS if deep else ())
    missing: dict[str, int] = {}
    t_next = 0

    def emit(pos: Position):
        trace.positions.append(pos)
        if on_position:
            on_position(pos)

    for s in sorted(rows_by_step):
        if cancel is not None and cancel.is_set():
            raise Cancelled()
        fw = source.forward(s)
        q = fw.keys.get(("qrope", 0))
        if n_heads and q is not None and (hd := _head_dim(fw, 0)) and q.value.shape[-1] != n_heads * hd:
            raise UsageError(f"{source.label}: its ranks hold {q.value.shape[-1] // hd} of the model's {n_heads}"
                             f" query heads; a rank's folder is missing: copy every rank's folder of the run")
        ids = steps[s][0]
        segs = segs_by_step[s]
        layers = n_layers or 1 + max((l for (_, l) in fw.keys if l is not None), default=-1)
        # the layers the forward holds keys of; the others are counted missing, not walked (a dump of layers
        # 0 and 31, or a module name's layer 999999, costs what it holds)
        present = sorted({l for (_, l) in fw.keys if l is not None and l < layers})
        absent = layers - len(present)
        for r in rows_by_step[s]:
            while t_next < r.pos:  # positions the dump never computed (a cached prefix) stay empty
                emit(Position(t_next, want[t_next] if want and t_next < len(want) else -1, t_next < P, {}, None, None))
                t_next += 1
            col: dict[str, np.ndarray] = {}
            shards: dict[str, np.ndarray] = {}

            def put(key: str, a: Assembled | None, field_name: str, hd: int | None = None):
                if a is None:
                    missing[field_name] = missing.get(field_name, 0) + 1
                    return
                try:
                    col[key] = _row(a, r.row, field_name, hd)
                except ValueError:  # a row that cannot take the key's layout (a hand-written dump call)
                    raise UsageError(f"{source.label}: {key}: a row of shape {a.value.shape[1:]} does not fit"
                                     f" {field_name}'s [heads, {hd}] layout; dump it as the model makes it"
                                     ) from None
                if a.partial:
                    trace.partial.add(key)
                if a.per_rank is not None and raw:
                    for k, part in enumerate(a.per_rank):
                        shards[f"{key}@{k}"] = np.ascontiguousarray(part[r.row])

            put(emb_key(r.pos), fw.keys.get(("emb", None)), "emb")
            for li in present:
                hd = _head_dim(fw, li)
                kp, v = fw.keys.get(("kpre", li)), fw.keys.get(("v", li))
                for f in fields:
                    if f in ("k", "ks", "vs"):
                        continue
                    if f in _ROUTED and li in fw.dense:  # a dense layer's routing buffers are empty, as ours
                        col[key_name(r.pos, li, f)] = np.zeros(0, np.int32 if f == "topk" else F32)
                        continue
                    if f == "v" and v is not None and kv == "q8":
                        continue
                    put(key_name(r.pos, li, f), fw.keys.get((f, li)), f, hd)
                _kv_keys(col, r.pos, li, kv, kp, v, r.row, hd, fields, missing)
            if absent:  # each field of a layer without keys is missing, as the loop above counts them
                for f in (*(f for f in fields if f not in ("k", "ks", "vs")), "k", "ks", "vs"):
                    missing[f] = missing.get(f, 0) + absent
            lg = _logits_row(fw.logits, r.row, segs, len(ids))
            if lg is not None:
                col[logits_key(r.pos)] = lg
            elif "logits" in fields:
                missing["logits"] = missing.get("logits", 0) + 1
            order = {k: i for i, k in enumerate(_key_order(r.pos, present, fields))}
            col = dict(sorted(col.items(), key=lambda kv_: order.get(kv_[0], len(order))))
            hashes = {k: fnv1a64(a) for k, a in col.items()}
            if shards:
                trace.shards[r.pos] = shard_store.keep(shards)
            emit(Position(r.pos, r.token, r.pos < P, hashes, store.keep(col) if raw else None,
                          col.get(logits_key(r.pos))))
            t_next = r.pos + 1
            if stop is not None and stop():
                return trace  # the caller has what it needs
    for f, n in sorted(missing.items()):
        why = _WHY.get(f, "the dump has no module that gives it")
        trace.notes.append(f"{f}: not in the dump at {n} key{'s' * (n != 1)} ({why})")
    return trace


_WHY = {
    "logits": "a forward's logits come with the next forward's tensors, and only the sampled rows have logits",
    "moe": "a MoE layer's FusedMoE is no leaf module, so leaf-hook dumps skip its output",
    "topk": "the routing happens inside FusedMoE", "topw": "the routing happens inside FusedMoE",
    "kpre": "no rotary_emb output", "k": "made from kpre, which is not in the dump",
    "ks": "made from kpre, which is not in the dump", "vs": "made from v, which is not in the dump",
}


def _key_order(t: int, layers: list[int], fields) -> list[str]:
    from ...trace.keys import ALL_FIELDS

    return [emb_key(t)] + [key_name(t, li, f) for li in layers for f in ALL_FIELDS if f in fields] + [logits_key(t)]


def _kv_keys(col, t, li, kv, kp, v, row, hd, fields, missing) -> None:
    """k / ks / v / vs as our cache holds them, from the engine's K after RoPE and its V."""
    if kp is not None:
        k = _row(kp, row, "kpre", hd)
        if kv == "q8":
            kq, ks = kvquant(k)
            col[key_name(t, li, "k")], col[key_name(t, li, "ks")] = kq, ks
        else:
            col[key_name(t, li, "k")] = k
            col[key_name(t, li, "ks")] = np.ones(k.shape[0], F32)
    else:
        for f in ("k", "ks"):
            missing[f] = missing.get(f, 0) + 1
    if v is not None:
        vv = _row(v, row, "v", hd)
        if kv == "q8":
            vq, vs = kvquant(vv)
            col[key_name(t, li, "v")], col[key_name(t, li, "vs")] = vq, vs
        else:
            col[key_name(t, li, "vs")] = np.ones(vv.shape[0], F32)
    else:
        missing["vs"] = missing.get("vs", 0) + 1


def _logits_row(lg: Assembled | None, row: int, segs: list[tuple[int, int]], n_rows: int) -> np.ndarray | None:
    """This row's logits: a row per token, or (the engines' usual) a row per request, its last token's."""
    if lg is None:
        return None
    a = lg.value
    # a copy: the position keeps its logits, and a view would keep the dump file's mapping alive with them
    if a.shape[0] == n_rows:
        return np.array(a[row], dtype=F32)
    if a.shape[0] == len(segs):
        for j, (_, b) in enumerate(segs):
            if row == b - 1:
                return np.array(a[j], dtype=F32)
    return None
