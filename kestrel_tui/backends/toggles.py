"""The op registry: one entry per toggle, naming everything about the op.

Each toggle switches one op family between a *fast* version and the contract's *exact* one. An
entry names the contract steps it covers (docs/numerics.md), the entries of the decoder's op
table it switches (backends/decoder.Ops: the exact functions are decoder.EXACT's, the sim's fast
ones backends/ops_fast.py's of the same names), the CUDA kernels of each version (kernels/*.cu),
and the probe fields it may own: where a first DIFF can originate in it, ranked (0 = the most
likely owner of that field). TOGGLES, OWNERS (what bisection follows), the sim's op table and the
cuda backend's kernel choice are all built from REGISTRY.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from ..errors import UsageError
from ..trace.fields import NAMES as FIELD_NAMES


@dataclass(frozen=True)
class Op:
    name: str
    steps: str                       # docs/numerics.md steps and rules the op follows
    ops: tuple[str, ...]             # decoder.Ops entries it switches (exact: decoder.EXACT, fast: ops_fast)
    cuda: Mapping[str, tuple[str, ...]]  # "fast" / "exact" -> its kernels of that version
    owns: Mapping[str, int]          # probe field -> rank among the ops that can first make it differ


def _op(name, steps, ops, fast, exact, owns) -> Op:
    return Op(name, steps, tuple(ops), MappingProxyType({"fast": tuple(fast), "exact": tuple(exact)}),
              MappingProxyType(dict(owns)))


def _both(*stems: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(f"{s}_fast" for s in stems), tuple(f"{s}_exact" for s in stems)


REGISTRY: tuple[Op, ...] = (
    _op("norm", "L1, L3, L8, L9 (R2, R3)", ("rmsnorm", "qknorm"), *_both("rmsnorm", "qknorm", "combine_rmsnorm"),
        {"nrm": 0, "knorm": 0, "pnrm": 0, "logits": 0, "qrope": 1, "x": 3}),
    _op("gemm", "L2, L7, L8, L9 (G1, G2, Q2, R1)", ("project", "project_experts"),
        *_both("quantize_q8_0", "gemv_q4", "gemv_q4_x3", "gemv_q4_experts", "gemv_f32", "gemv_f32_experts",
               "down_combine"),
        {"kraw": 0, "ores": 0, "router": 0, "v": 1, "vs": 1, "moe": 1, "x": 1, "logits": 1, "qrope": 2}),
    _op("rope", "L4 (T2)", ("rope_cos_sin",), *_both("rope_table", "rope"),
        {"kpre": 0, "qrope": 0, "k": 1, "ks": 1}),
    _op("expf", "L6, L8 (T1, T3)", ("expf",), (), (), {"attn": 1, "topk": 1, "topw": 1, "moe": 2, "x": 2}),
    _op("attention", "L6", ("attention",), ("attn_fast_q8", "attn_fast_f32", "attn_fast_part_q8", "attn_fast_combine"),
        ("attn_exact_q8", "attn_exact_f32", "attn_exact_scores_q8", "attn_exact_pv_q8"), {"attn": 0}),
    _op("kvquant", "L5 (Q3)", ("kvquant",), *_both("kvquant"), {"k": 0, "ks": 0, "v": 0, "vs": 0}),
    _op("moe", "L8 (T3)", ("route", "combine", "silu"), *_both("router", "silu_mul", "combine"),
        {"topk": 0, "topw": 0, "moe": 0, "x": 0}),
)
# expf has no kernels of its own: the exp inside attention, the router and silu follows its toggle
# (an `exp_exact` argument); the fused QK-norm/RoPE/KV kernel takes norm's, rope's and kvquant's.

BY_NAME: dict[str, Op] = {op.name: op for op in REGISTRY}
TOGGLES: tuple[str, ...] = tuple(BY_NAME)

# field -> ops whose fast version can first make this key differ, most likely first
OWNERS: dict[str, tuple[str, ...]] = {
    f: tuple(op.name for op in sorted((op for op in REGISTRY if f in op.owns), key=lambda op: op.owns[f]))
    for f in FIELD_NAMES}


def kernel(stem: str, exact: frozenset[str]) -> str:
    """The version of a `_fast`/`_exact` kernel pair the toggles `exact` ask for, as the registry lists it."""
    for op in REGISTRY:
        for version in ("fast", "exact"):
            if f"{stem}_{version}" in op.cuda[version]:
                return f"{stem}_{'exact' if op.name in exact else 'fast'}"
    raise KeyError(f"kernel {stem}_fast/_exact is in no op of the registry")


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
