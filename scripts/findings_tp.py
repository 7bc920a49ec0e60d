"""TP and EP findings on the CPU: the hf-dist engine against itself and against the cpu reference.

Recorded in results/tp-cpu-findings.md. Each row is one reference and one subject setting, run as the
session runs them (teacher forcing on the reference's tokens, the subject consuming the prompt itself
token by token) and once free (each side greedy on its own): first DIFF, first far key, close / far
counts, top-1 flips; for the rows with an all-reduce, where the reduction order shows (which fields of
the first differing layer differ, and whether each all-reduce returned exactly the sum of the two
ranks' partials).

planted: bugs that exist only under parallelism planted in a rank's shard at layer 20
(tests/rankfaults.py's ShardFault, through the hooks module the ranks are handed), the cpu reference
against hf-dist TP=2 with the deep keys: where the first far key lands, and each rank's share of that
layer's split keys against a clean run of the same settings (and, for a column-parallel key, against
the reference's slice).

    python scripts/findings_tp.py [--model DIR] [--tokens 16] [--part moe|dense|planted|shapes|all] [--json FILE]

shapes: tiny dense Qwen3 checkpoints made with transformers' Qwen3Config (2 layers, head_dim 16, the
(hidden, heads, kv heads) of SHAPES), against TP=1 with the prompt token by token: TP=2 with the prompt
token by token (one row a GEMM) and batched, and TP=1 batched (the control): per head-split field, how
many keys are bit-equal and the worst NMSE of the others.

moe: without --model the embedded default (synthetic Qwen3-MoE, 48 layers, hidden 256, 8 heads / 2 kv
heads, 16 experts top-4, vocab 2048); dense: a synthetic dense Qwen3 of the same dims with 4 kv heads
(so 4 ranks split them) and a 512-wide MLP. Float32 weights, f32 KV.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import replace as with_fields
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # rankfaults: the planted bugs

from kestrel_tui.engines.base import EngineSpec  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.engines.hf_dist import make_hf_dist_engine  # noqa: E402
from kestrel_tui.model.config import default_config  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.model.weights import synthetic_model  # noqa: E402
from kestrel_tui.session.session import Session  # noqa: E402
from kestrel_tui.trace.compare import Status, diff_stats, parse_tolerance  # noqa: E402
from kestrel_tui.trace.keys import parse_key  # noqa: E402
from kestrel_tui.trace.ranks import compare_shares, line, rank_values, sum_key  # noqa: E402
from rankfaults import planted  # noqa: E402

PROMPT = [1, 2, 3, 4]
TOL = parse_tolerance("nmse=1e-7")
BASE = {"prefill": "token", "attn_implementation": "eager", "threads": 1}
PLANTED = (  # (model, fault, the subject's options); each held against a clean run with the same options
    ("dense", "1:scale_shard:L20.self_attn.k_proj", {}),
    ("dense", "*:swap_shards:L20.mlp.down_proj", {}),
    ("moe", "1:ep_misplace:L20", {"ep": "on"}),
)


def hf_dist(model, path, deep: bool = False, **options):
    return make_hf_dist_engine(EngineSpec("hf-dist", path, {**BASE, **options}), model, kv="f32", deep=deep)


def where_the_sums_show(res) -> dict:
    """The first differing layer (position, layer): which of its fields differ, with their worst ULP distance."""
    layered = [k for k, st in res.comparison.status.items() if st is Status.DIFF and parse_key(k).layer is not None]
    if not layered:
        return {}
    k = parse_key(layered[0])
    keys = [key for key in res.comparison.status if (parse_key(key).t, parse_key(key).layer) == (k.t, k.layer)]
    return {"at": f"t{k.t}_l{k.layer}", **{parse_key(key).field: diff_stats(res.ref.raw(key), res.sub.raw(key)).max_ulp
                                           for key in keys if res.comparison.status[key] is Status.DIFF}}


def signed_zeros(res) -> dict:
    """The emb keys that differ, and whether every differing element is a zero of the other sign."""
    keys = [k for k, st in res.comparison.status.items() if st is Status.DIFF and k.endswith("_emb")]
    elements = only_zeros = 0
    for key in keys:
        a, b = np.asarray(res.ref.raw(key)), np.asarray(res.sub.raw(key))
        differ = a.view(np.uint32) != b.view(np.uint32)
        elements += int(differ.sum())
        only_zeros += int((differ & (a == 0) & (b == 0)).sum())
    return {"emb_keys": len(keys), "elements": elements, "signed_zeros": only_zeros}


def _bf16(x: np.ndarray) -> np.ndarray:
    """f32 values rounded to bfloat16 (nearest, ties to even), kept as f32."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def reductions(trace, dtype: str) -> dict:
    """Every all-reduce of the run: how many returned, bit for bit, the sum of the ranks' partials in rank
    order (each add rounded to the compute dtype, as the collective's own adds are)."""
    n = same = 0
    for p in trace.positions:
        for key in p.hashes:
            parts = rank_values(p.raw, key)
            if parts is None:
                continue
            n += 1
            total = parts[0].copy()
            for a in parts[1:]:
                total = total + a
                if dtype == "bfloat16":
                    total = _bf16(total)
            same += total.tobytes() == np.asarray(p.raw[sum_key(key)]).tobytes()
    return {"all_reduces": n, "rank_order_sum": same}


def chunk_orders(trace) -> list[list[str]] | None:
    """With more than 2 ranks: for each of N equal chunks of the reduced vectors, the left-to-right orders
    of the ranks' partials whose float sum the all-reduce returned bit for bit in every reduction."""
    fits: dict[int, set[tuple[int, ...]]] | None = None
    for p in trace.positions:
        for key in p.hashes:
            parts = rank_values(p.raw, key)
            if parts is None or len(parts) < 3:
                continue
            n = len(parts)
            reduced = np.asarray(p.raw[sum_key(key)]).view(np.uint32)
            width = reduced.size // n
            fits = fits or {c: set(itertools.permutations(range(n))) for c in range(n)}
            for c in range(n):
                part = slice(c * width, (c + 1) * width)
                for order in list(fits[c]):
                    total = parts[order[0]][part].copy()
                    for r in order[1:]:
                        total = total + parts[r][part]
                    if (total.view(np.uint32) != reduced[part]).any():
                        fits[c].discard(order)
    if fits is None:
        return None
    return [sorted({_fold(o) for o in fits[c]}) for c in sorted(fits)]


def _fold(order: tuple[int, ...]) -> str:
    """((r2+r3)+r1)+r0 for (2, 3, 1, 0); the first add's two sides in rank order (an add commutes)."""
    text = "+".join(f"r{r}" for r in sorted(order[:2]))
    for r in order[2:]:
        text = f"({text})+r{r}"
    return text


def row(name: str, session: Session, picks: dict[str, str]) -> dict:
    out = {"row": name}
    for forcing in ("teacher", "free"):
        s = with_fields(session.initial_settings(), prefill="subject", forcing=forcing)
        for tname, value in picks.items():
            s = s.pick(next(t for t in session.toggles if t.name == tname), value)
        t0 = time.perf_counter()
        res = session.run(s)
        summary = res.tolerance(TOL)
        flips = [(x.t, x.ref_top1, x.sub_top1) for x in res.tokens if x.flip]
        out[forcing] = {"subject": res.sub.backend, "reference": res.ref.backend, "first_diff": res.first_diff,
                        "first_far": summary.first_far, "n_ok": res.comparison.counts[Status.OK],
                        "n_close": summary.n_close, "n_far": summary.n_far, "flips": flips,
                        "generated_equal": res.ref.generated == res.sub.generated,
                        "seconds": round(time.perf_counter() - t0, 1)}
        if forcing == "teacher":
            out["first_layer_diffs"] = where_the_sums_show(res)
            dtype = session.subject_engine.settings(s.values(session.toggles))["dtype"]
            out["reductions"] = reductions(res.sub, dtype)
            out["emb"] = signed_zeros(res)
            out["chunk_orders"] = chunk_orders(res.sub)
            out["findings"] = list(getattr(session.subject_engine, "findings", []))
        f = out[forcing]
        print(f"{name:<34} {forcing:<7} first DIFF {f['first_diff'] or '-':<14} first far {f['first_far'] or '-':<14}"
              f" close {f['n_close']:>5} far {f['n_far']:>5} flips {len(flips)}", flush=True)
    print(f"{'':<34} first differing layer's fields (max ULP): {out['first_layer_diffs']}; {out['reductions']};"
          f" {out['emb']}" + (f"; each chunk's order: {out['chunk_orders']}" if out["chunk_orders"] else ""),
          flush=True)
    return out


def hunt(model, path, tokens: int, fault: str | None, options: dict):
    """The cpu reference against hf-dist TP=2 (deep keys, teacher forcing) with ``fault`` planted."""
    sub = hf_dist(model, path, deep=True, **options)
    session = Session(model, PROMPT, tokens, reference=make_engine("cpu", model, kv="f32", deep=True), subject=sub,
                      kv="f32", deep=True)
    with planted(fault):  # the ranks read it when the group starts
        try:
            return session.run(with_fields(session.initial_settings(), prefill="subject"))
        finally:
            sub.close()


def planted_rows(models: dict, tokens: int) -> list[dict]:
    clean, rows = {}, []
    for kind, fault, options in PLANTED:
        model, path = models[kind]
        key = (kind, tuple(sorted(options.items())))
        if key not in clean:
            clean[key] = hunt(model, path, tokens, None, options)
        base, res = clean[key], hunt(model, path, tokens, fault, options)
        far = res.tolerance(TOL).first_far
        k = parse_key(far) if far else None
        shares = {}
        for name in (res.comparison.status if k else ()):
            at = parse_key(name)
            if (at.t, at.layer) != (k.t, k.layer):
                continue
            vs_clean = compare_shares(base.sub, res.sub, name)
            if vs_clean is not None:
                vs_ref = compare_shares(res.ref, res.sub, name)
                shares[at.field] = {"vs_clean_tp2": line(vs_clean), "vs_reference": line(vs_ref)}
        row = {"row": f"{kind}: {fault}", "subject": res.sub.backend, "first_diff": res.first_diff, "first_far": far,
               "n_far": res.tolerance(TOL).n_far, "flips": sum(x.flip for x in res.tokens),
               "clean_first_far": base.tolerance(TOL).first_far, "clean_n_far": base.tolerance(TOL).n_far,
               "findings": list(res.sub.findings), "shares": shares}
        rows.append(row)
        print(f"{row['row']:<44} first far {far or '-':<14} far {row['n_far']:>5} flips {row['flips']}"
              f" (clean: first far {row['clean_first_far'] or '-'}, far {row['clean_n_far']})", flush=True)
        for field, s in shares.items():
            print(f"{'':<44} {field:<6} against the clean run {s['vs_clean_tp2']}; against the reference"
                  f" {s['vs_reference']}", flush=True)
    return rows


def dense_model():
    cfg = with_fields(default_config(), arch="qwen3", n_experts=0, top_k=0, moe_intermediate=0, intermediate=512,
                      n_kv_heads=4)
    return synthetic_model(cfg.validate("f32"), "f32")


SHAPES = ((64, 8, 4), (64, 8, 2), (128, 8, 2), (128, 8, 4), (128, 4, 2), (256, 16, 4))
HEAD_SPLIT = ("kraw", "knorm", "kpre", "v", "qrope", "attn")


def shape_checkpoint(folder: Path, hidden: int, heads: int, kv: int) -> str:
    import torch
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                                   num_key_value_heads=kv, head_dim=16, intermediate_size=96, rope_theta=1e6,
                                   rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(2)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, p in model.named_parameters():
            scale, shift = (0.2, 1.0) if p.ndim == 1 else (0.25, 0.0)
            p.copy_(shift + scale * torch.randn(p.shape, generator=g))
    path = folder / f"h{hidden}-q{heads}-kv{kv}"
    model.save_pretrained(path)
    return str(path)


def shape_rows(tokens: int) -> list[dict]:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for hidden, heads, kv in SHAPES:
            path = shape_checkpoint(Path(folder), hidden, heads, kv)
            model = load_model(path, "f32")
            ref, sub = hf_dist(model, path, deep=True, world_size="1"), hf_dist(model, path, deep=True)
            session = Session(model, PROMPT, tokens, reference=ref, subject=sub, kv="f32", deep=True)
            for world, prefill in (("2", "token"), ("2", "batched"), ("1", "batched")):
                s = with_fields(session.initial_settings(), prefill="subject")
                for tname, value in (("world_size", world), ("prefill", prefill)):
                    s = s.pick(next(t for t in session.toggles if t.name == tname), value)
                res = session.run(s, record=False)
                out = {"hidden": hidden, "heads": heads, "kv_heads": kv, "world_size": world, "prefill": prefill,
                       "first_diff": res.comparison.first_diff, "first_far": res.tolerance(TOL).first_far}
                for f in HEAD_SPLIT:
                    keys = [k for k in res.comparison.status if parse_key(k).field == f]
                    differ = [k for k in keys if res.comparison.status[k] is Status.DIFF]
                    worst = max((res.metrics(k).nmse for k in differ), default=0.0)
                    out[f] = f"{len(keys) - len(differ)}/{len(keys)} equal" + (f", nmse ≤ {worst:.1e}" if differ else "")
                rows.append(out)
                print(json.dumps(out), flush=True)
            ref.close()
            sub.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="an HF qwen3_moe directory for the moe part; default: the embedded model")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--part", choices=("moe", "dense", "planted", "shapes", "all"), default="all")
    ap.add_argument("--json", metavar="FILE")
    cli = ap.parse_args()
    engines, rows = [], []

    def session(model, reference, subject):
        engines.extend((reference, subject))
        return Session(model, PROMPT, cli.tokens, reference=reference, subject=subject, kv="f32")

    if cli.part in ("moe", "all"):
        model, path = load_model(cli.model, "f32"), cli.model
        tp = session(model, hf_dist(model, path, world_size="1"), hf_dist(model, path))
        rows.append(row("TP=2 vs TP=1", tp, {"world_size": "2"}))
        rows.append(row("TP=2 + EP=2 (all_reduce) vs TP=1", tp, {"world_size": "2", "ep": "on"}))
        rows.append(row("TP=2 + EP=2 (all_to_all) vs TP=1", tp,
                        {"world_size": "2", "ep": "on", "ep_impl": "all_to_all"}))
        ep = session(model, hf_dist(model, path, world_size="2"), hf_dist(model, path))
        rows.append(row("TP=2 + EP=2 vs TP=2", ep, {"ep": "on"}))
        bf16 = session(model, hf_dist(model, path, world_size="1", dtype="bfloat16"),
                       hf_dist(model, path, dtype="bfloat16"))
        rows.append(row("bfloat16: TP=2 vs TP=1", bf16, {"world_size": "2"}))
        threads = session(model, hf_dist(model, path, world_size="1"),
                          hf_dist(model, path, world_size="1", threads=2))
        rows.append(row("TP=1, 2 threads vs 1 thread", threads, {}))
        cpu = session(model, make_engine("cpu", model, kv="f32"), hf_dist(model, path))
        rows.append(row("cpu reference vs TP=1", cpu, {"world_size": "1"}))
        rows.append(row("cpu reference vs TP=2", cpu, {"world_size": "2"}))
    if cli.part in ("dense", "all"):
        model = dense_model()
        dense = session(model, hf_dist(model, None, world_size="1"), hf_dist(model, None))
        rows.append(row("dense: TP=2 vs TP=1", dense, {"world_size": "2"}))
        rows.append(row("dense: TP=4 vs TP=1", dense, {"world_size": "4"}))
        four = session(model, hf_dist(model, None, world_size="2"), hf_dist(model, None))
        rows.append(row("dense: TP=4 vs TP=2", four, {"world_size": "4"}))
    if cli.part in ("planted", "all"):
        rows += planted_rows({"moe": (load_model(cli.model, "f32"), cli.model), "dense": (dense_model(), None)},
                             cli.tokens)
    if cli.part in ("shapes", "all"):
        rows += shape_rows(cli.tokens)
    for e in engines:
        e.close()
    if cli.json:
        Path(cli.json).write_text(json.dumps({"tolerance": TOL.spec(), "tokens": cli.tokens, "rows": rows},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
