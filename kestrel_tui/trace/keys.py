"""Probe key schema: names, parsing and dataflow order.

Per position ``t``: ``t{t}_emb``, then per layer ``t{t}_l{l}_{field}`` for
each field in dataflow order, then ``t{t}_logits``. With 48 layers that is
48*11 + 2 = 530 keys per token (the seed's count). The fields themselves, their
dtypes and shapes, are the field registry's (trace/fields.py).

The opt-in deep set adds probes at the point where the buffer exists in the
layer's dataflow, so one ordering serves both sets (``ALL_FIELDS``); which
fields are deep, and what each buffer is, the registry says.

Ordering must also cope with dumps from other engines (same text format,
other field names), hence ``order_key``'s fallbacks.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from . import fields as _fields

# The per-layer fields in dataflow order (default and deep interleaved), the default set and the deep
# one: all of them from the field registry (trace/fields.py).
ALL_FIELDS = tuple(f.name for f in _fields.LAYER)
FIELDS = tuple(f.name for f in _fields.LAYER if not f.deep)
DEEP_FIELDS = tuple(f.name for f in _fields.LAYER if f.deep)

# field -> the field whose buffer a q4_0 GEMV quantizes to q8_0 to make it (same position and layer):
# where a 1-ULP input difference can flip an activation code (app: the detail panel shows it)
GEMV_INPUT = {f.name: f.gemv_input for f in _fields.REGISTRY if f.gemv_input}

_RANK = {f: i for i, f in enumerate(ALL_FIELDS)}
_UNKNOWN_RANK = len(ALL_FIELDS)
_STRIDE = len(ALL_FIELDS) + 1  # one slot per known field + one for foreign ones

# No leading zeros: a name must round-trip through key_name unchanged.
_NUM = r"(0|[1-9][0-9]*)"
_TOKEN_RE = re.compile(rf"t{_NUM}_(emb|logits)")
_LAYER_RE = re.compile(rf"t{_NUM}_l{_NUM}_([A-Za-z][A-Za-z0-9_]*)")
# Positions and layers are int32 in every engine we know; a larger index is a
# corrupt or hostile tag, and code that sizes anything by it must never see it.
MAX_INDEX = 2**31 - 1


@dataclass(frozen=True)
class Key:
    t: int
    layer: int | None  # None for the per-token keys emb / logits
    field: str

    @property
    def name(self) -> str:
        if self.layer is None:
            return f"t{self.t}_{self.field}"
        return key_name(self.t, self.layer, self.field)


def key_name(t: int, layer: int, field: str) -> str:
    return f"t{t}_l{layer}_{field}"


def emb_key(t: int) -> str:
    return f"t{t}_emb"


def logits_key(t: int) -> str:
    return f"t{t}_logits"


def layer_fields(deep: bool = False) -> tuple[str, ...]:
    """Per-layer fields in dataflow order for the default or deep probe set."""
    return ALL_FIELDS if deep else FIELDS


def token_keys(t: int, n_layers: int, deep: bool = False) -> list[str]:
    fields = layer_fields(deep)
    keys = [emb_key(t)]
    keys += [key_name(t, l, f) for l in range(n_layers) for f in fields]
    keys.append(logits_key(t))
    return keys


def parse_key(name: str) -> Key:
    """Parse a well-formed key; unknown layer fields are accepted (foreign engines)."""
    m = _TOKEN_RE.fullmatch(name)
    if m:
        return Key(int(m[1]), None, m[2])
    m = _LAYER_RE.fullmatch(name)
    if m:
        return Key(int(m[1]), int(m[2]), m[3])
    raise ValueError(f"malformed probe key {name!r}: expected t<T>_emb, t<T>_logits "
                     f"or t<T>_l<L>_<field>")


def index_problem(name: str) -> str | None:
    """Why a key-shaped tag cannot be a real key (an index beyond MAX_INDEX), or None."""
    try:
        k = parse_key(name)
    except ValueError:
        return None  # another engine's tag: kept as it is
    for what, i in (("position", k.t), ("layer", k.layer)):
        if i is not None and i > MAX_INDEX:
            shown = str(i) if len(str(i)) <= 20 else f"{str(i)[:12]}... ({len(str(i))} digits)"
            return f"{what} index {shown} in {name[:40]!r} is beyond {MAX_INDEX} (2^31-1)"
    return None


@functools.lru_cache(maxsize=1 << 16)
def order_key(name: str) -> tuple:
    """Sort key ``(t, dataflow_index, tiebreak)``; element 0 is the position.

    emb is index 0, a layer field is ``1 + layer*STRIDE + rank``, logits is
    +inf (after any number of layers). Unknown-but-well-formed layer fields
    take the last slot of their layer and tie-break by name; names that do
    not parse at all sort after everything, by name. Compare these tuples
    as a whole; only element 0 has a meaning of its own.
    """
    try:
        k = parse_key(name)
    except ValueError:
        return (math.inf, math.inf, name)
    if k.layer is None:
        return (k.t, 0 if k.field == "emb" else math.inf, "")
    rank = _RANK.get(k.field, _UNKNOWN_RANK)
    return (k.t, 1 + k.layer * _STRIDE + rank, "" if rank < _UNKNOWN_RANK else k.field)
