"""What the hf engine's capture costs: transformers' own decode step vs the same step with our hooks.

The embedded default model (48 layers, Qwen3-30B-A3B's structure at small dims) is exported with
to_hf_model and loaded back by from_pretrained. After a 16-token prompt each step consumes one token
with the KV cache on; the figure is the median over the steps. Three runs of the same tokens, step
by step in turn:

  plain   transformers' forward alone (no hooks, eager attention)
  hashes  the hf engine: hooks + numpy conversion + FNV hashing of every key (raw=False)
  raw     the same keeping every raw buffer in the trace's RawStore (the app's default)

Usage: .venv/bin/python scripts/bench_hf_hooks.py [--steps 72] [--device cpu] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=72)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv", default="q8", choices=("q8", "f32"), help="the KV format k/ks/v/vs are made in")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--warmup", type=int, default=8, help="first steps left out (allocator warm-up)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from kestrel_tui.engines.base import EngineSpec
    from kestrel_tui.engines.hf import make_hf_engine
    from kestrel_tui.model.hf import load_model
    from kestrel_tui.model.hf_export import to_hf_model
    from kestrel_tui.trace.rawstore import RawStore

    from transformers.utils import logging

    logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    ours = load_model(None, "f32")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, ours.cfg.vocab, args.prompt + args.steps).tolist()
    prompt, forced = tokens[:args.prompt], tokens[args.prompt:]

    with tempfile.TemporaryDirectory() as d:
        to_hf_model(ours).save_pretrained(d)
        plain = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        plain = plain.to(args.device).eval()
        eng = make_hf_engine(EngineSpec("hf", d, {"device": args.device}), ours, kv=args.kv)
        values = {t.name: t.default for t in eng.toggles}

        cap = eng.capture(values)
        store = RawStore()

        def step_plain(cache, tok):
            logits = plain(input_ids=torch.tensor([[tok]], device=args.device), cache=cache, use_cache=True).logits
            logits[0, -1].float().cpu().numpy()  # the step is done when its logits are on the host

        def step_hooked(cache, t, tok, raw):
            out = cap.step([tok], t, cache, raw=raw)
            if raw:
                store.keep(out.raw[0])

        # The three runs go step by step in turn (each its own KV cache), so a busy machine slows
        # all three alike instead of whichever run it happened to overlap.
        times = {"plain": [], "hashes": [], "raw": []}
        caches = {name: DynamicCache(config=plain.config) for name in times}
        cap.begin(None)
        with torch.inference_mode():
            plain(input_ids=torch.tensor([prompt], device=args.device), cache=caches["plain"], use_cache=True)
            cap.step(prompt, 0, caches["hashes"], raw=False)
            cap.step(prompt, 0, caches["raw"], raw=True)
            for i, tok in enumerate(forced):
                t = args.prompt + i
                for name, fn in (("plain", lambda: step_plain(caches["plain"], tok)),
                                 ("hashes", lambda: step_hooked(caches["hashes"], t, tok, False)),
                                 ("raw", lambda: step_hooked(caches["raw"], t, tok, True))):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        cap.end()
        eng.close()

    cfg = ours.cfg
    ms = {k: statistics.median(v[args.warmup:]) * 1e3 for k, v in times.items()}
    n_keys = 2 + cfg.n_layers * 11
    print(f"model: embedded default ({cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_experts} experts top-"
          f"{cfg.top_k}, vocab {cfg.vocab}), {n_keys} keys/token; device {args.device}, kv {args.kv}, torch threads "
          f"{torch.get_num_threads()}; prompt {args.prompt}, median over {args.steps - args.warmup} decode steps "
          f"(after {args.warmup} warm-up steps)")
    print(f"transformers decode step (no hooks):      {ms['plain']:8.3f} ms/token")
    for name, what in (("hashes", "hooks + hashing"), ("raw", "hooks + hashing + raw capture")):
        over = 100 * (ms[name] - ms["plain"]) / ms["plain"]
        print(f"{what + ':':41s} {ms[name]:8.3f} ms/token  overhead {over:+6.1f} %")


if __name__ == "__main__":
    main()
