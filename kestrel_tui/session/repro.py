"""Repro bundles: one op of one decode step, in a folder an engine's maintainers can run without us.

For a key of a run (default: the first far key) a bundle holds the op that made it: its inputs as
each side consumed them (the run's raw buffers at the op's input keys, same position and layer), both
outputs, the weights the op reads as the reference stores them (only that op's: one matrix, the chosen
experts), case.json saying what it is, replay.py (numpy only: kestrel_tui/session/replay_template.py,
copied as it is) and a README. The replay recomputes the reference's op on each side's inputs: on the
reference's it must give the reference's bits, on the subject's it says whether the subject's op
itself computes otherwise or only its inputs drifted. docs/repro.md has the layout and the sizes.

One registry, PLANS: per field, the op that makes it (replay_template.OPS names the kind), the
contract rules it follows (docs/numerics.md) and where its inputs and weights come from.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import procs
from ..bounds import Number
from ..errors import UsageError
from ..files import check_new_path
from ..model.weights import Linear, Model, rope_attention_factor
from ..numerics import CONTRACT_VERSION
from ..text import inert
from ..trace.compare import FAR, CLOSE, Status, Tolerance, key_metrics
from ..trace.keys import emb_key, key_name, parse_key
from .session import RunResult, Session

FORMAT = 2  # case.json's "bundle"; 2: every array's dtype and shape declared ("arrays"), which replay.py checks
DEFAULT_MAX_MB = 64.0
# A bundle is an attachment: the largest op input at real size (an f32 lm_head, 151936 x 4096) is
# 2.3 GiB, and past 64 GiB a bundle is no longer one. nan or inf would switch the bound off unseen.
MAX_MB = Number(lo=0, above=True, hi=65536, unit="MB")
MB = 2**20
TEMPLATE = Path(__file__).with_name("replay_template.py")
SIDES = ("reference", "subject")
BITS = Tolerance(nmse=None, ulp=0)  # the criteria without a tolerance: a DIFF is far
ENV_PREFIXES = ("KESTREL_", "CUDA_", "NCCL_", "CUBLAS_", "TORCH_", "PYTORCH_", "OMP_", "VLLM_", "SGLANG_")
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL")


@dataclass(frozen=True)
class Source:
    """An op input as the run holds it: one key's buffer, rows of several positions stacked, or the
    token a position consumed."""
    keys: tuple[str, ...]
    stack: bool = False
    token: bool = False


@dataclass(frozen=True)
class Plan:
    kind: str                                  # replay_template.OPS entry
    name: str                                  # the op in words
    rules: str                                 # docs/numerics.md rule numbers
    inputs: dict[str, Source]
    weights: Callable[[dict], dict[str, np.ndarray]]  # (side -> input name -> array) -> name -> array
    const: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Bundle:
    path: Path
    key: str
    op: str
    nbytes: int
    verdict: str          # the run's: ok | close | far
    inputs_note: str = ""

    def line(self) -> str:
        return (f"{self.path}: {self.key} ({self.op}), {self.verdict}, {size(self.nbytes)};"
                f" run `python {self.path / 'replay.py'}`")


def size(n: int) -> str:
    return f"{n / MB:.1f} MB" if n >= MB // 10 else f"{n / 1024:.0f} KB"


@dataclass(frozen=True)
class _Ctx:
    model: Model
    t: int
    layer: int | None
    kv: str
    deep: bool  # the reference's trace holds the deep keys (kpre, pnrm, moe, ...)

    def key(self, name: str, layer: int | None = None) -> str:
        return key_name(self.t, self.layer if layer is None else layer, name)

    def layer_input(self) -> str:
        return emb_key(self.t) if self.layer == 0 else key_name(self.t, self.layer - 1, "x")

    @property
    def L(self):
        return self.model.layers[self.layer]

    def heads(self) -> dict:
        c = self.model.cfg
        return {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim}

    def rope(self) -> dict:
        af = rope_attention_factor(self.model.cfg)
        return {"position": self.t, "rope_factor": None if af is None else float(af)}


def _w(lin: Linear, ids: list[int] | None = None) -> np.ndarray:
    """A matrix in its stored format: q4_0 as ggml's bytes [..., out, nb, 18], or f32 [..., out, in]."""
    a = lin.blocks if lin.w is None else lin.w
    return np.ascontiguousarray(a if ids is None else a[ids])


def _biased(weights: dict, name: str, bias) -> dict:
    return weights if bias is None else {**weights, name: bias}


def _union(ins: dict, name: str) -> list[int]:
    return sorted({int(e) for side in SIDES for e in np.asarray(ins[side][name]).ravel()})


def _chosen_experts(ctx: _Ctx, ins: dict) -> list[int]:
    """The experts the reference's routing picks on either side's ores (only those ship)."""
    from ..backends import ops_exact
    from ..numerics.linalg import gemv

    L, cfg = ctx.L, ctx.model.cfg
    ids: set[int] = set()
    for side in SIDES:
        h = ops_exact.rmsnorm(np.asarray(ins[side]["ores"], np.float32)[None], L.post_attention_layernorm, cfg.eps)
        idx, _ = ops_exact.route(gemv(L.gate, h), cfg.top_k, cfg.norm_topk_prob)
        ids.update(int(e) for e in idx.ravel())
    return sorted(ids)


def _ffn_weights(ctx: _Ctx, ids: list[int] | None) -> dict:
    L = ctx.L
    w = {"gate_proj": _w(L.gate_proj, ids), "up_proj": _w(L.up_proj, ids), "down_proj": _w(L.down_proj, ids)}
    if L.gate is not None:
        w["expert_ids"] = np.asarray(ids, np.int64)
    return w


def _plan_emb(ctx):
    tab = ctx.model.embed_tokens

    def weights(ins):
        ids = _union(ins, "token")
        return {"rows": _w(tab, ids), "row_ids": np.asarray(ids, np.int64)}
    return Plan("embed", "the embedding row of the consumed token", "L9",
                {"token": Source((emb_key(ctx.t),), token=True)}, weights)


def _plan_nrm(ctx):
    return Plan("rmsnorm", "input_layernorm (RMSNorm over hidden)", "L1 (R2)",
                {"x": Source((ctx.layer_input(),))}, lambda ins: {"norm": ctx.L.input_layernorm},
                {"eps": ctx.model.cfg.eps})


def _plan_kraw(ctx):
    return Plan("gemv", f"k_proj GEMV ({ctx.model.fmt} weights)", _gemv_rules(ctx, "L2"),
                {"x": Source((ctx.key("nrm"),))}, lambda ins: _biased({"w": _w(ctx.L.k_proj)}, "bias", ctx.L.k_bias))


def _plan_knorm(ctx):
    return Plan("qknorm", "k_norm (per-head RMSNorm over head_dim)", "L3 (R3)",
                {"x": Source((ctx.key("kraw"),))}, lambda ins: {"norm": ctx.L.k_norm},
                {"eps": ctx.model.cfg.eps, **ctx.heads()})


def _plan_kpre(ctx):
    return Plan("rope", "RoPE of the normed K", "L4 (T2)", {"x": Source((ctx.key("knorm"),))},
                lambda ins: {"inv_freq": ctx.model.inv_freq}, {**ctx.heads(), **ctx.rope()})


def _plan_k(ctx, out: str):
    src = "kpre" if ctx.deep else "knorm"
    what = "the K cache row" + (" (q8)" if ctx.kv == "q8" else " (f32)")
    name = what if src == "kpre" else f"RoPE, then {what}"
    rules = ("L5 (Q3)" if src == "kpre" else "L4 (T2), L5 (Q3)") if ctx.kv == "q8" else "L4 (T2), L5"
    return Plan("k_row", name, rules, {"x": Source((ctx.key(src),))},
                lambda ins: {"inv_freq": ctx.model.inv_freq},
                {**ctx.heads(), **ctx.rope(), "kv": ctx.kv, "from": src, "out": out})


def _plan_v(ctx, out: str):
    return Plan("v_row", f"v_proj GEMV ({ctx.model.fmt} weights), then the V cache row ({ctx.kv})",
                _gemv_rules(ctx, "L2") + (", L5 (Q3)" if ctx.kv == "q8" else ", L5"),
                {"x": Source((ctx.key("nrm"),))},
                lambda ins: _biased({"v_proj": _w(ctx.L.v_proj)}, "v_bias", ctx.L.v_bias),
                {**ctx.heads(), "kv": ctx.kv, "out": out})


def _plan_qrope(ctx):
    L = ctx.L
    return Plan("q_heads", f"q_proj GEMV ({ctx.model.fmt} weights), q_norm, RoPE",
                _gemv_rules(ctx, "L2") + ", L3 (R3), L4 (T2)", {"x": Source((ctx.key("nrm"),))},
                lambda ins: _biased({"q_proj": _w(L.q_proj), "q_norm": L.q_norm, "inv_freq": ctx.model.inv_freq},
                                    "q_bias", L.q_bias),
                {"eps": ctx.model.cfg.eps, **ctx.heads(), **ctx.rope()})


def _plan_attn(ctx):
    rows = {f: Source(tuple(key_name(p, ctx.layer, f) for p in range(ctx.t + 1)), stack=True)
            for f in ("k", "ks", "v", "vs")}
    return Plan("attention", f"attention over the {ctx.kv} cache rows 0..{ctx.t}",
                "L6 (Q4, T1)" if ctx.kv == "q8" else "L6 (R1, T1)", {"q": Source((ctx.key("qrope"),)), **rows},
                lambda ins: {}, {**ctx.heads(), "scale": float(ctx.model.attn_scale)})


def _plan_ores(ctx):
    L = ctx.L
    return Plan("o_residual", f"o_proj GEMV ({ctx.model.fmt} weights) plus the residual",
                _gemv_rules(ctx, "L7"), {"x": Source((ctx.layer_input(),)), "attn": Source((ctx.key("attn"),))},
                lambda ins: _biased({"o_proj": _w(L.o_proj)}, "o_bias", L.o_bias))


def _plan_pnrm(ctx):
    return Plan("rmsnorm", "post_attention_layernorm (RMSNorm over hidden)", "L8 (R2)",
                {"x": Source((ctx.key("ores"),))}, lambda ins: {"norm": ctx.L.post_attention_layernorm},
                {"eps": ctx.model.cfg.eps})


def _plan_router(ctx):
    _need_moe(ctx, "router")
    return Plan("gemv", f"the router's GEMV ({ctx.model.fmt} weights)", _gemv_rules(ctx, "L8a"),
                {"x": Source((ctx.key("pnrm"),))}, lambda ins: {"w": _w(ctx.L.gate)})


def _plan_route(ctx, out: str):
    _need_moe(ctx, out)
    cfg = ctx.model.cfg
    return Plan("route", "router softmax, top-k, renormalisation", "L8a, L8b (T1, R3)",
                {"router": Source((ctx.key("router"),))}, lambda ins: {},
                {"top_k": cfg.top_k, "norm_topk_prob": cfg.norm_topk_prob, "out": out})


def _plan_moe(ctx):
    cfg = ctx.model.cfg
    if ctx.L.gate is None:
        return Plan("experts", f"the dense MLP (SwiGLU, {ctx.model.fmt} weights)", "L8c, L8e (G1/G2, T3)",
                    {"h": Source((ctx.key("pnrm"),))}, lambda ins: _ffn_weights(ctx, None))
    return Plan("experts", f"the chosen experts (SwiGLU, {ctx.model.fmt} weights) and their weighted sum",
                "L8c, L8d (G1/G2, T3)",
                {"h": Source((ctx.key("pnrm"),)), "topk": Source((ctx.key("topk"),)),
                 "topw": Source((ctx.key("topw"),))},
                lambda ins: _ffn_weights(ctx, _union(ins, "topk")), {"top_k": cfg.top_k})


def _plan_x(ctx):
    if ctx.deep:  # a deep run holds the FFN's output: the layer output is one add
        return Plan("add", "the residual add ores + moe", "L8", {"a": Source((ctx.key("ores"),)),
                                                                 "b": Source((ctx.key("moe"),))}, lambda ins: {})
    L, cfg = ctx.L, ctx.model.cfg

    def weights(ins):
        w = {"post_attention_layernorm": L.post_attention_layernorm}
        if L.gate is None:
            return {**w, **_ffn_weights(ctx, None)}
        return {**w, "gate": _w(L.gate), **_ffn_weights(ctx, _chosen_experts(ctx, ins))}
    return Plan("ffn_residual", "post_attention_layernorm, the " + ("router and experts" if L.gate is not None
                else "dense MLP") + ", plus the residual", "L8 (R2, G1/G2, T1, T3)",
                {"ores": Source((ctx.key("ores"),))}, weights,
                {"eps": cfg.eps, "top_k": cfg.top_k, "norm_topk_prob": cfg.norm_topk_prob})


def _plan_logits(ctx):
    m = ctx.model
    return Plan("logits", f"the final norm and lm_head GEMV ({m.fmt} weights)", "L9 (R2, " + _gemv_rule(ctx) + ")",
                {"x": Source((key_name(ctx.t, m.cfg.n_layers - 1, "x"),))},
                lambda ins: {"norm": m.norm, "lm_head": _w(m.lm_head)}, {"eps": m.cfg.eps})


def _gemv_rule(ctx) -> str:
    return "G1, Q2" if ctx.model.fmt == "q4_0" else "G2"


def _gemv_rules(ctx, step: str) -> str:
    return f"{step} ({_gemv_rule(ctx)})"


def _need_moe(ctx, name: str) -> None:
    if ctx.L.gate is None:
        raise UsageError(f"{ctx.key(name)}: layer {ctx.layer} has a dense MLP, so its {name} buffer is empty;"
                         f" bundle its moe or x key")


PLANS: dict[str, Callable[[_Ctx], Plan]] = {
    "emb": _plan_emb, "nrm": _plan_nrm, "kraw": _plan_kraw, "knorm": _plan_knorm, "kpre": _plan_kpre,
    "k": lambda c: _plan_k(c, "k"), "ks": lambda c: _plan_k(c, "ks"),
    "v": lambda c: _plan_v(c, "v"), "vs": lambda c: _plan_v(c, "vs"),
    "qrope": _plan_qrope, "attn": _plan_attn, "ores": _plan_ores, "pnrm": _plan_pnrm, "router": _plan_router,
    "topk": lambda c: _plan_route(c, "topk"), "topw": lambda c: _plan_route(c, "topw"),
    "moe": _plan_moe, "x": _plan_x, "logits": _plan_logits,
}


# ---------------------------------------------------------------- choosing and reading the key

def default_key(result: RunResult, tol: Tolerance | None) -> str:
    """The first far key (the first DIFF without a tolerance)."""
    key = result.tolerance(tol).first_far if tol is not None else result.first_diff
    if key is None:
        raise UsageError("repro: the run has no " + (f"far key ({tol.spec()})" if tol is not None else "DIFF key")
                         + "; name the key to bundle with --key")
    return key


def free_folder(parent: str | os.PathLike, key: str) -> Path:
    """A bundle folder name under ``parent`` that is not taken: repro-KEY, else repro-KEY-2, -3, ..."""
    base = Path(parent) / f"repro-{key}"
    for n in range(1, 10_000):
        cand = base if n == 1 else base.with_name(f"{base.name}-{n}")
        if not cand.exists():
            return cand
    raise UsageError(f"{parent}: every repro-{key} name is taken; choose a folder")


def _raw(trace, key: str) -> np.ndarray | None:
    a = trace.raw(key)
    if a is None and parse_key(key).field == "logits":
        t = parse_key(key).t
        if t < len(trace.positions):
            a = trace.positions[t].logits
    return None if a is None else np.ascontiguousarray(a)


def _read(trace, src: Source, t: int) -> np.ndarray | None:
    if src.token:
        tok = trace.positions[t].token if t < len(trace.positions) else -1
        return None if tok < 0 else np.array([tok], np.int64)
    arrays = [_raw(trace, k) for k in src.keys]
    if any(a is None for a in arrays):
        return None
    return np.stack(arrays) if src.stack else arrays[0]


def _fed(session: Session, result: RunResult) -> bool:
    """The subject ran isolated: every op consumed the reference's inputs (its own recorded inputs are not
    what it used)."""
    eng = session.subject_engine
    # the test Session.run applies before it feeds (an engine that cannot be fed ran chained)
    return result.settings.mode == "isolate" and eng.caps.isolate and session.can_feed()


def _gather(session: Session, result: RunResult, plan: Plan, t: int) -> tuple[dict, str]:
    """Both sides' inputs and a note on where the subject's came from ('' when they are its own)."""
    ref = {}
    for name, src in plan.inputs.items():
        a = _read(result.ref, src, t)
        if a is None:
            raise UsageError(f"repro: the reference ({session.reference_engine.name}) gave no raw values for"
                             f" {src.keys[-1]}, an input of this op; bundle with a built-in reference")
        ref[name] = a
    if _fed(session, result):
        return {"reference": ref, "subject": dict(ref)}, ("the run was isolated: the subject consumed the"
                                                          " reference's inputs")
    sub, lacking = {}, []
    for name, src in plan.inputs.items():
        a = _read(result.sub, src, t)
        if a is None or a.shape != ref[name].shape or a.dtype != ref[name].dtype:
            lacking.append(name)
            a = ref[name]
        sub[name] = a
    note = ""
    if lacking:
        note = (f"the subject ({session.subject_engine.name}) gave no raw values in the reference's layout for"
                f" {', '.join(lacking)}: the reference's stand in")
    return {"reference": ref, "subject": sub}, note


# ---------------------------------------------------------------- what it is

def _versions() -> dict:
    out = {"python": platform.python_version(), "numpy": np.__version__, "contract": CONTRACT_VERSION,
           "machine": platform.machine(), "system": platform.system()}
    for dist in ("kestrel-tui", "torch", "transformers", "llama_cpp_python", "safetensors"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _env() -> dict:
    """The environment variables that can change an engine's numbers; secrets' values left out."""
    return {k: ("(left out)" if any(w in k.upper() for w in SECRET_WORDS) else inert(v))
            for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def _jsonable(x):
    if isinstance(x, (np.generic,)):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    return str(x)


def _case(session: Session, result: RunResult, key: str, plan: Plan, tol: Tolerance | None, verdict: str,
          metrics, files: dict, note: str) -> dict:
    from .refcache import ON_ITS_OWN, model_fingerprint

    k = parse_key(key)
    model, settings = session.model, result.settings
    criteria, rule = (tol or BITS).for_key(key)
    ref_eng, sub_eng = session.reference_engine, session.subject_engine
    return {
        "bundle": FORMAT,
        "what": "one op of one decode step, from a kestrel-tui run: the reference's op replayed on both sides' inputs",
        "key": key, "position": k.t, "layer": k.layer, "field": k.field,
        "op": {"kind": plan.kind, "name": plan.name, "rules": plan.rules},
        "model": {"name": inert(model.name), "fingerprint": model_fingerprint(model),
                  "fingerprint_of": "blake2b-160 of the config, format and every weight byte, an array of"
                                    f" {ON_ITS_OWN >> 20} MiB or more by its own blake2b-160 (kestrel-tui's"
                                    " reference cache key)",
                  "weights": model.fmt, "kv": session.kv, "config": dataclasses.asdict(model.cfg)},
        "prompt": list(session.prompt),
        "tokens": {side: [p.token for p in trace.positions[:k.t + 1]]
                   for side, trace in (("reference", result.ref), ("subject", result.sub))},
        "engines": {"reference": {"name": ref_eng.name,
                                  "describe": inert(ref_eng.describe({t.name: t.default for t in ref_eng.toggles}))},
                    "subject": {"name": sub_eng.name, "describe": inert(sub_eng.describe(
                        settings.values(sub_eng.toggles)))}},
        "settings": {"label": session.label(settings), "exact": sorted(settings.exact), "picks": dict(settings.picks),
                     "mode": settings.mode, "prefill": settings.prefill, "forcing": settings.forcing,
                     "deep": session.deep, "notes": [inert(n) for n in result.notes]},
        "versions": _versions(),
        "env": _env(),
        "tolerance": {"spec": (tol.spec() if tol is not None else "ulp=0 (no tolerance: bits)"), "rule": rule,
                      "criteria": {"nmse": criteria.nmse, "ulp": criteria.ulp, "rel": criteria.rel}},
        "verdict": {"run": verdict, "metrics": metrics.as_dict() if metrics is not None else None},
        "reference_is_contract": _is_contract(ref_eng),
        "const": plan.const,
        "inputs_note": note,
        **files,
    }


def _is_contract(engine) -> bool:
    from ..engines.builtin import BuiltinEngine

    return isinstance(engine, BuiltinEngine) and engine.name == "cpu"


def _verdict(result: RunResult, key: str, ref_out: np.ndarray, sub_out: np.ndarray, tol: Tolerance | None):
    if result.comparison.status.get(key) is Status.OK:
        return "ok", None
    m = key_metrics(ref_out, sub_out)
    return (CLOSE if (tol or BITS).for_key(key)[0].holds(m) else FAR), m


# ---------------------------------------------------------------- writing

def _layout(ins: dict, outs: dict, weights: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """case.json's file names, each array's dtype and shape (replay.py reads nothing else), and the
    arrays to write (C order: replay.py refuses a Fortran-order .npy); a subject input bit-equal to the
    reference's is the same file."""
    arrays: dict[str, np.ndarray] = {}
    names = {"inputs": {side: {} for side in SIDES}, "weights": {}, "outputs": {}}
    for name, a in ins["reference"].items():
        path = f"inputs/reference/{name}.npy"
        arrays[path] = a
        names["inputs"]["reference"][name] = path
        b = ins["subject"][name]
        same = b.dtype == a.dtype and b.shape == a.shape and b.tobytes() == a.tobytes()
        if not same:
            arrays[f"inputs/subject/{name}.npy"] = b
        names["inputs"]["subject"][name] = path if same else f"inputs/subject/{name}.npy"
    for side in SIDES:
        arrays[f"outputs/{side}.npy"] = outs[side]
        names["outputs"][side] = f"outputs/{side}.npy"
    for name, a in weights.items():
        arrays[f"weights/{name}.npy"] = a
        names["weights"][name] = f"weights/{name}.npy"
    arrays = {path: np.ascontiguousarray(np.asarray(a)) for path, a in arrays.items()}
    names["arrays"] = {path: {"dtype": a.dtype.str, "shape": list(a.shape)} for path, a in arrays.items()}
    return names, arrays


def _check_size(key: str, arrays: dict[str, np.ndarray], max_mb: float) -> int:
    total = sum(a.nbytes for a in arrays.values()) + TEMPLATE.stat().st_size
    if total > max_mb * MB:
        path, big = max(arrays.items(), key=lambda kv: kv[1].nbytes)
        raise UsageError(f"repro {key}: the bundle would take {total / MB:.1f} MB ({path} alone"
                         f" {big.nbytes / MB:.1f} MB), over --max-mb {max_mb:g}; raise it to"
                         f" {math.ceil(total / MB)} or bundle another key")
    return total


def write_bundle(session: Session, result: RunResult, folder: str | os.PathLike, key: str | None = None,
                 tol: Tolerance | None = None, max_mb: float = DEFAULT_MAX_MB) -> Bundle:
    """Write the repro bundle of ``key`` (default: the first far key under ``tol``, the first DIFF
    without one) of ``result`` into the new folder ``folder``; never over anything. ``tol`` None
    judges by bits. Raises UsageError (one line) for a folder that exists, a key the run lacks, a
    side without raw values, or a bundle over ``max_mb``."""
    final = check_new_path(folder, "bundle folder")
    MAX_MB.parse(max_mb, "--max-mb")
    key = key or default_key(result, tol)
    if key not in result.comparison.status:
        raise UsageError(f"repro --key {inert(key, 60)}: the run has no such key; name one of its keys"
                         f" (t<T>_l<L>_<field>, t<T>_emb, t<T>_logits)")
    k = parse_key(key)
    if k.field not in PLANS:
        raise UsageError(f"repro --key {key}: no op makes field {k.field!r}; bundle one of {', '.join(PLANS)}")
    ctx = _Ctx(session.model, k.t, k.layer, session.kv,
               _raw(result.ref, key_name(k.t, 0, "kpre")) is not None)
    plan = PLANS[k.field](ctx)
    outs = {side: _raw(trace, key) for side, trace in (("reference", result.ref), ("subject", result.sub))}
    for side, a in outs.items():
        if a is None:
            raise UsageError(f"repro {key}: the {side} gave no raw values for it; a bundle needs both outputs")
    ins, note = _gather(session, result, plan, k.t)
    names, arrays = _layout(ins, outs, plan.weights(ins))
    total = _check_size(key, arrays, max_mb)
    verdict, metrics = _verdict(result, key, outs["reference"], outs["subject"], tol)
    case = _case(session, result, key, plan, tol, verdict, metrics, names, note)
    _write_folder(final, case, arrays)
    return Bundle(final, key, plan.name, total, verdict, note)


def _write_folder(final: Path, case: dict, arrays: dict[str, np.ndarray]) -> None:
    """Everything into a hidden folder beside ``final``, renamed to it once whole: a bundle is there
    complete or not at all (a stopped write leaves nothing)."""
    tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.mkdir()
    except OSError as e:
        raise UsageError(f"{final}: cannot create ({e.strerror}); choose a writable folder") from None
    procs.add_folder(tmp)
    try:
        for sub in ("inputs/reference", "inputs/subject", "outputs", "weights"):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
        # the folder is private until the rename: its files need no temporary names of their own
        for rel, a in arrays.items():
            with open(tmp / rel, "xb") as f:
                np.save(f, a, allow_pickle=False)
        texts = {"case.json": json.dumps(case, indent=1, default=_jsonable) + "\n",
                 "README.md": readme(case, sum(a.nbytes for a in arrays.values())),
                 "replay.py": TEMPLATE.read_text(encoding="utf-8")}
        for rel, text in texts.items():
            with open(tmp / rel, "x", encoding="utf-8", newline="") as f:
                f.write(text)
        if final.exists():  # appeared while writing (a non-empty one would make the rename fail anyway)
            raise UsageError(f"{final}: appeared while the bundle was written; kestrel-tui never overwrites"
                             f" — choose another name")
        os.rename(tmp, final)
    except OSError as e:
        raise UsageError(f"{final}: not written ({e.strerror or e})") from None
    finally:
        procs.remove_folder(tmp)  # gone already when the rename happened


def readme(case: dict, nbytes: int) -> str:
    """The bundle's README: what it is, how to run it, what to attach upstream."""
    eng, tol, v = case["engines"], case["tolerance"], case["verdict"]
    m = v["metrics"]
    shown = ", ".join(f"{k} {m[k]:.3g}" if isinstance(m[k], float) else f"{k} {m[k]}" for k in m) if m else "bits equal"
    note = f"\n{case['inputs_note']}.\n" if case["inputs_note"] else ""
    return f"""# Repro bundle: {case['key']}

One op of one LLM decode step as two engines ran it, written by kestrel-tui.

* op: {case['op']['name']}, at position {case['position']}{'' if case['layer'] is None else f", layer {case['layer']}"};
  the numerics contract's rules {case['op']['rules']} (kestrel-tui docs/numerics.md)
* model: {case['model']['name']} ({case['model']['weights']} weights, {case['model']['kv']} KV cache),
  fingerprint {case['model']['fingerprint']}
* reference: {eng['reference']['describe']}; subject: {eng['subject']['describe']}
* the run's verdict: **{v['run']}** under the tolerance {tol['spec']} ({shown})
{note}
## Run it

    python replay.py

needs Python 3 and numpy only (no kestrel-tui, no torch). It recomputes the reference's op from the
inputs here — on the reference's inputs (it must give the reference's bits), then on the
subject's — and prints one line per comparison and the verdict: `far` when the subject's op
computes otherwise on its own inputs, `close` or `ok` when it agrees within the tolerance (then
only its inputs drifted, if the run's line says far). Exit 0 for ok and close, 1 for far, 2 when
the bundle cannot be replayed (one line naming the damaged file). `python replay.py FOLDER` replays
the bundle in FOLDER with that replay.py (your own reviewed copy, say): it checks every file before
it reads it, and reads nothing outside the folder.

## Files ({size(nbytes)})

* `case.json` — what this is: model and fingerprint, prompt and consumed tokens, position, layer,
  field, op and contract rules, both engines, settings and toggles, versions, environment,
  tolerance, verdict and metrics, the constants the op takes
* `inputs/reference/`, `inputs/subject/` — the op's inputs as each side consumed them (a subject
  input identical to the reference's is not repeated: case.json points both at one file)
* `outputs/reference.npy`, `outputs/subject.npy` — both sides' outputs
* `weights/` — only what this op reads, in the format the reference holds it (q4_0: ggml's block
  bytes [rows, blocks, 18]; f32: [rows, columns])
* `replay.py` — the replay, self-contained

## Attach to an upstream issue

This whole folder (zipped), the output of `python replay.py`, and the subject's version and launch
settings (case.json lists the versions and the environment it saw). The replay's `op` line is the
claim: the reference's op on the subject's own inputs against the subject's output.
"""
