"""Per-rank shards back into one tensor: the layouts the engines declare.

* ``full``: every rank holds the whole tensor (replicated, or already all-reduced); rank 0's is
  taken.
* ``heads`` (axis a): column-parallel by attention head; the ranks' slices are concatenated along
  axis a in rank order. Where there are fewer KV heads than ranks, each KV head sits on
  ``tp // n_kv`` ranks in a row (vLLM's and SGLang's QKVParallelLinear); one copy of each is kept.
* ``partial``: a row-parallel output *before* its all-reduce — each rank holds a partial sum over
  its slice of the inner dimension (or of the experts). The full tensor is their sum, taken in
  rank order in float32. The sum is never the engine's own reduced tensor bit for bit (its
  all-reduce may add in another order, in bf16, in a tree), so such a key is judged by tolerance;
  ``Assembled.partial`` says so and ``per_rank`` keeps each rank's values. Ranks holding the same
  bytes have already reduced (a source version that reduces inside the layer): that tensor is
  taken as it is.

SGLang's dumper declares the layout per tensor in its ``dims`` string (``t h[tp]``,
``t h[tp:partial]``, ``b s (nh*hd)[attn_tp]``); ``parse_dims`` reads the part this reader uses.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class Assembled:
    value: np.ndarray                         # tokens first: [rows, ...]
    partial: bool = False                     # the sum of pre-reduction partial sums: judge by tolerance
    per_rank: tuple[np.ndarray, ...] | None = None  # each rank's tensor, where shards were put together


def to_numpy(t, what: str) -> np.ndarray | str:
    """A dumped tensor, as load.check passed it for its field, as numpy: floats widened to float32 exactly
    (bf16, f16), integers as int64; a string saying why not for a value that is no tensor."""
    import torch

    if not isinstance(t, torch.Tensor):
        return f"{what} is a {type(t).__name__}, not a tensor"
    return t.detach().to(torch.float32 if t.is_floating_point() else torch.int64).contiguous().numpy()


def reduce_partial(parts: list[np.ndarray]) -> np.ndarray:
    """Σ ranks in rank order, float32: r0 + r1, then + r2, ..."""
    total = parts[0].astype(F32, copy=True)
    for p in parts[1:]:
        total += p.astype(F32, copy=False)
    return total


def kv_ranks(tp: int, n_kv: int | None) -> list[int]:
    """The ranks that hold distinct KV heads: all of them, or one of each group of replicas."""
    if n_kv is None or n_kv >= tp or tp % n_kv:
        return list(range(tp))
    rep = tp // n_kv
    return list(range(0, tp, rep))


def assemble(parts: list[np.ndarray], layout: str, axis: int = -1, keep: list[int] | None = None) -> Assembled | str:
    """``parts[r]`` is rank r's tensor; ``layout`` one of full / heads / partial."""
    if len(parts) == 1:
        return Assembled(parts[0])
    shapes = {p.shape for p in parts}
    if layout == "full":
        return Assembled(parts[0])
    if layout == "partial":
        if len(shapes) != 1:
            return f"the ranks' partial sums have shapes {' vs '.join(str(p.shape) for p in parts)}"
        if all(p.tobytes() == parts[0].tobytes() for p in parts[1:]):
            return Assembled(parts[0])  # already reduced: every rank holds the same bytes
        return Assembled(reduce_partial(parts), partial=True, per_rank=tuple(parts))
    if layout == "heads":
        chosen = [parts[r] for r in (keep or range(len(parts)))]
        if len({p.shape for p in parts}) != 1:  # both engines split heads and columns evenly
            return f"the ranks' shards disagree: {' vs '.join(str(p.shape) for p in parts)}"
        return Assembled(np.concatenate(chosen, axis=axis), per_rank=tuple(parts))
    raise ValueError(f"unknown layout {layout!r}")


# ---- SGLang dumper's dims annotation: "t h[tp]", "b s (nh*hd)[attn_tp:partial]", "... # tp:replicated"

_DIM = re.compile(r"(?P<name>[A-Za-z_]\w*|\([^)]+\)|1)(?:\[(?P<mods>[^\]]+)\])?")


@dataclass(frozen=True)
class DimsLayout:
    names: tuple[str, ...]
    token_axis: int | None          # the "t" (or "s" under "b s") dim
    shard_axis: int | None          # the dim sharded over a parallel axis of size > 1
    parallel: str | None            # that parallel axis (tp, attn_tp, ...)
    partial_over: str | None        # a partial sum over this axis


def parse_dims(text: str) -> DimsLayout | str:
    """The shape part of a dims string (before #): names, the token dim, a sharded or partial dim."""
    shape = text.split("#", 1)[0].split()
    if not shape:
        return "an empty dims string"
    names, shard, parallel, partial = [], None, None, None
    for i, tok in enumerate(shape):
        m = _DIM.fullmatch(tok)
        if not m:
            return f"dims token {tok[:30]!r} is not name[axis] or (a*b)[axis]"
        names.append(m["name"])
        for mod in (m["mods"] or "").split(","):
            if not mod.strip():
                continue
            axis, _, quals = mod.strip().partition(":")
            if "partial" in quals.split("+"):
                partial = axis
            else:
                if shard is not None:
                    return f"dims {text[:60]!r} shards two dims; the reader puts one back together"
                shard, parallel = i, axis
    token = names.index("t") if "t" in names else (names.index("s") if "s" in names else None)
    return DimsLayout(tuple(names), token, shard, parallel, partial)
