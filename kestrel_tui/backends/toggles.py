"""The op registry: one entry per toggle, naming everything about the op.

Each toggle switches one op family between a *fast* version and the contract's *exact* one. An
entry names the contract steps it covers (docs/numerics.md), the entries of the decoder's op
table it switches (backends/decoder.Ops: the exact functions are decoder.EXACT's, the sim's fast
ones backends/ops_fast.py's of the same names), its CUDA kernels by their role in the cuda step
(each role a kernels/<module>.cu kernel of each version), the bits its exact version sets in the
cuda step's flags (kernel arguments that carry the choice into kernels of other ops or into the
fused kernels, and attention's own launch shape), and the probe fields it may own: where a first DIFF
can originate in it, ranked (0 = the most likely owner of that field). TOGGLES, OWNERS (what
bisection follows), the sim's op table and the cuda backend's kernel choice
(backends/cuda/launches.select_kernels) are all built from REGISTRY.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from ..errors import UsageError
from ..trace.fields import NAMES as FIELD_NAMES


@dataclass(frozen=True)
class Kernel:
    """One role of an op in the cuda step: its kernel of each version, in kernels/<module>.cu."""
    module: str
    fast: str
    exact: str

    def version(self, exact: bool) -> str:
        return self.exact if exact else self.fast


@dataclass(frozen=True)
class Op:
    name: str
    steps: str                       # docs/numerics.md steps and rules the op follows
    ops: tuple[str, ...]             # decoder.Ops entries it switches (exact: decoder.EXACT, fast: ops_fast)
    kernels: Mapping[str, Kernel]    # role in the cuda step (a launches.Kernels field or a choice of one) -> kernels
    flags: Mapping[str, int]         # a launches.Kernels flag -> the bits its exact version sets in it
    owns: Mapping[str, int]          # probe field -> rank among the ops that can first make it differ

    @property
    def cuda(self) -> Mapping[str, tuple[str, ...]]:
        """"fast" / "exact" -> its kernels of that version, in role order."""
        return MappingProxyType({v: tuple(k.version(v == "exact") for k in self.kernels.values())
                                 for v in ("fast", "exact")})


def _op(name, steps, ops, kernels, flags, owns) -> Op:
    return Op(name, steps, tuple(ops), MappingProxyType(dict(kernels)), MappingProxyType(dict(flags)),
              MappingProxyType(dict(owns)))


def _pair(module: str, stem: str) -> Kernel:
    """A kernel whose versions are named `<stem>_fast` and `<stem>_exact`."""
    return Kernel(module, f"{stem}_fast", f"{stem}_exact")


def _pairs(module: str, *stems: str) -> dict[str, Kernel]:
    """Kernels named `<stem>_fast` / `<stem>_exact`, each in the role of its stem."""
    return {s: _pair(module, s) for s in stems}


# Role names are the kernels' stems where both versions share one; no role is named like a
# toggle (the cuda step names roles, never toggles: tests/test_kernel_choice.py).
REGISTRY: tuple[Op, ...] = (
    _op("norm", "L1, L3, L8, L9 (R2, R3)", ("rmsnorm", "qknorm"),
        {**_pairs("norm", "rmsnorm", "qknorm"), **_pairs("fused", "combine_rmsnorm")},
        {"heads_flags": 1},
        {"nrm": 0, "knorm": 0, "pnrm": 0, "logits": 0, "qrope": 1, "x": 3}),
    _op("gemm", "L2, L7, L8, L9 (G1, G2, Q2, R1)", ("project", "project_experts"),
        {"quantize": _pair("gemv", "quantize_q8_0"),
         **_pairs("gemv", "gemv_q4", "gemv_q4_x3", "gemv_q4_experts", "gemv_f32", "gemv_f32_experts"),
         **_pairs("fused", "experts_swiglu", "down_combine")},
        {"quant_exact": 1},
        {"kraw": 0, "ores": 0, "router": 0, "v": 1, "vs": 1, "moe": 1, "x": 1, "logits": 1, "qrope": 2}),
    _op("rope", "L4 (T2)", ("rope_cos_sin",),
        {"rope_table": _pair("rope", "rope_table"), "rotate": _pair("rope", "rope")},
        {"heads_flags": 2},
        {"kpre": 0, "qrope": 0, "k": 1, "ks": 1}),
    # no kernels of its own: the exp inside attention, the router and silu follows its toggle
    _op("expf", "L6, L8 (T1, T3)", ("expf",), {}, {"exp_exact": 1},
        {"attn": 1, "topk": 1, "topw": 1, "moe": 2, "x": 2}),
    # one kernel over an f32 cache or a head_dim that is not a multiple of 32; else two: the
    # per-tile pass (exact: the scores; fast: scores and a partial P.V a tile) and the pass
    # across the tiles (exact: P.V in position order; fast: the partials combined)
    _op("attention", "L6", ("attention",),
        {"single_q8": Kernel("attention", "attn_fast_q8", "attn_exact_q8"),
         "single_f32": Kernel("attention", "attn_fast_f32", "attn_exact_f32"),
         "split_tiles": Kernel("attention", "attn_fast_part_q8", "attn_exact_scores_q8"),
         "split_reduce": Kernel("attention", "attn_fast_combine", "attn_exact_pv_q8")},
        {"attn_exact": 1},
        {"attn": 0}),
    # an f32 cache stores its rows as they are: one kernel for both versions
    _op("kvquant", "L5 (Q3)", ("kvquant",),
        {"kv_rows_q8": _pair("kvquant", "kvquant"), "kv_rows_f32": Kernel("kvquant", "kv_rows_f32", "kv_rows_f32")},
        {"heads_flags": 4},
        {"k": 0, "ks": 0, "v": 0, "vs": 0}),
    _op("moe", "L8 (T3)", ("route", "combine", "silu"), _pairs("moe", "router", "silu_mul", "combine"),
        {"moe_exact": 1},
        {"topk": 0, "topw": 0, "moe": 0, "x": 0}),
)
# The fused QK-norm/RoPE/KV kernel takes norm's, rope's and kvquant's bits in one argument.

BY_NAME: dict[str, Op] = {op.name: op for op in REGISTRY}
TOGGLES: tuple[str, ...] = tuple(BY_NAME)

# field -> ops whose fast version can first make this key differ, most likely first
OWNERS: dict[str, tuple[str, ...]] = {
    f: tuple(op.name for op in sorted((op for op in REGISTRY if f in op.owns), key=lambda op: op.owns[f]))
    for f in FIELD_NAMES}


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
