"""Per-op exact toggles and which op owns which probe key.

Each toggle switches one op family between the GPU-style *fast* version and
the contract's *exact* one. The ownership table is what bisection follows: the
first DIFF's field names the ops that can originate a difference there, most
likely first (an inherited DIFF is ruled out because everything earlier in the
dataflow already agrees).
"""
from __future__ import annotations

from ..errors import UsageError

TOGGLES = ("norm", "gemm", "rope", "expf", "attention", "kvquant", "moe")

# field -> ops whose fast version can first make this key differ, most likely first
OWNERS: dict[str, tuple[str, ...]] = {
    "emb": (),
    "nrm": ("norm",),
    "kraw": ("gemm",),
    "knorm": ("norm",),
    "kpre": ("rope",),
    "k": ("kvquant", "rope"),
    "ks": ("kvquant", "rope"),
    "v": ("kvquant", "gemm"),
    "vs": ("kvquant", "gemm"),
    "qrope": ("rope", "norm", "gemm"),
    "attn": ("attention", "expf"),
    "ores": ("gemm",),
    "pnrm": ("norm",),
    "router": ("gemm",),
    "topk": ("moe", "expf"),
    "topw": ("moe", "expf"),
    "moe": ("moe", "gemm", "expf"),
    "x": ("moe", "gemm", "expf", "norm"),
    "logits": ("norm", "gemm"),
}


def parse_exact(spec: str | None, toggles: tuple[str, ...] = TOGGLES) -> frozenset[str]:
    """'all' | 'none' | 'norm,gemm' -> the set of toggles (the op families, or an engine's) switched to exact."""
    spec = (spec or "none").strip()
    if spec == "all":
        return frozenset(toggles)
    if spec in ("none", ""):
        return frozenset()
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in toggles]
    if bad:
        raise UsageError(f"unknown toggle {bad[0]!r}; choose from {', '.join(toggles) or '(none)'} (or all / none)")
    return frozenset(names)


def describe(exact: frozenset[str]) -> str:
    if exact == frozenset(TOGGLES):
        return "all exact"
    if not exact:
        return "all fast"
    return "exact: " + ",".join(t for t in TOGGLES if t in exact)
