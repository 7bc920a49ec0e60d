"""The full-size proof (issue 17 item 7): all exact == cpu on every key at Qwen3-30B-A3B's size.

The 48-layer model's weights are made on the GPU (backends/cuda/weights.py
DeviceSyntheticModel); model/device_synthetic.py makes the same bytes on the
host, so the numpy reference can run on exactly those weights. Two parts, so
each fits one device call (the reference is the slow one):

    python scripts/gpu_fullsize_proof.py reference --out ref.json   # host only: hashes + tokens
    python scripts/gpu_fullsize_proof.py cuda --ref ref.json --out proof.json   # the GPU, compares

`both` runs them in one process. Prints progress per position and, at the end,
the counts; exit 0 only when every key of every position is identical.

`--forced spread`: both sides consume 48 given, spread-out tokens instead of
greedy ones. The device generator's weights are uniform nibbles with positive
scales, which biases every logit row the same way: greedy decode repeats one
token (141002 at seed 0), so the spread run is the one that reaches many
embedding rows and expert choices.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_tui.model.config import qwen3_30b_a3b_config  # noqa: E402

PROMPT_LEN, N_TOKENS, SEED = 16, 48, 0


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _progress(label: str, t0: float):
    def on_position(pos) -> None:
        print(f"{label} t{pos.t}: {time.perf_counter() - t0:.1f} s, peak RSS {_peak_gb():.1f} GB", flush=True)
    return on_position


def spread_tokens(vocab: int) -> list[int]:
    return [(7 + 104729 * i) % vocab for i in range(N_TOKENS)]


def reference(n_layers: int, threads: int, forced: bool) -> dict:
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.engine.run import run_decode
    from kestrel_tui.model.device_synthetic import device_synthetic_model

    cfg = qwen3_30b_a3b_config(n_layers)
    t0 = time.perf_counter()
    model = device_synthetic_model(cfg, seed=SEED, threads=threads)
    t_model = time.perf_counter() - t0
    print(f"host twin of the device weights: {n_layers} layers in {t_model:.1f} s, peak RSS {_peak_gb():.1f} GB",
          flush=True)
    prompt = [(1 + 7919 * i) % cfg.vocab for i in range(PROMPT_LEN)]
    t0 = time.perf_counter()
    trace = run_decode(NumpyBackend(model), prompt, N_TOKENS, raw=False, on_position=_progress("cpu", t0),
                       forced=spread_tokens(cfg.vocab) if forced else None)
    tokens = spread_tokens(cfg.vocab) if forced else trace.generated[:N_TOKENS]
    return {"n_layers": n_layers, "seed": SEED, "prompt": prompt, "tokens": tokens, "forced": forced,
            "top1": [p.top1 for p in trace.positions],
            "hashes": trace.hashes(), "twin_s": t_model, "reference_s": time.perf_counter() - t0,
            "peak_rss_gb": _peak_gb(), "cpu_count": os.cpu_count()}


def cuda(ref: dict) -> dict:
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.backends.toggles import TOGGLES
    from kestrel_tui.engine.run import run_decode
    from kestrel_tui.trace.compare import compare

    cfg = qwen3_30b_a3b_config(ref["n_layers"])
    backend = make_cuda_backend(DeviceSyntheticModel(cfg, seed=ref["seed"]), exact=frozenset(TOGGLES))
    t0 = time.perf_counter()
    sub = run_decode(backend, ref["prompt"], len(ref["tokens"]), forced=ref["tokens"], raw=False,
                     on_position=_progress("cuda", t0))
    cmp = compare(ref["hashes"], sub.hashes())
    return {"device": backend.device_name, "keys": len(cmp.status), "positions": len(sub.positions),
            "identical": cmp.identical, "first_diff": cmp.first_diff, "first_mismatch": cmp.first_mismatch,
            "counts": {st.value: n for st, n in cmp.counts.items()},
            "top1_equal": [p.top1 for p in sub.positions] == ref["top1"],
            "cuda_s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("reference", "cuda", "both"))
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads making the host twin")
    ap.add_argument("--ref", help="the reference part's JSON (for `cuda`)")
    ap.add_argument("--forced", choices=("greedy", "spread"), default="greedy",
                    help="tokens after the prompt: each side's greedy ones, or 48 given spread-out ids")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = {}
    if args.part in ("reference", "both"):
        out["reference"] = reference(args.layers, args.threads, args.forced == "spread")
    ref = out.get("reference") or json.loads(Path(args.ref).read_text())["reference"]
    if args.part in ("cuda", "both"):
        out["cuda"] = cuda(ref)
        print(json.dumps({k: v for k, v in out["cuda"].items()}, indent=1))
    if "reference" in out:
        r = out["reference"]
        print(f"reference: {len(r['hashes'])} keys, twin {r['twin_s']:.1f} s, decode {r['reference_s']:.1f} s,"
              f" peak RSS {r['peak_rss_gb']:.1f} GB, {r['cpu_count']} CPUs")
    Path(args.out).write_text(json.dumps(out))
    return 0 if "cuda" not in out or out["cuda"]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
