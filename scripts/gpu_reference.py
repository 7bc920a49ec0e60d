"""Compute a CPU-reference trace ahead of a GPU session and save it for the device machine.

The device time is scarce; the reference only needs a CPU. This writes the
hashes of every key of every position and the consumed tokens (teacher forcing
input for the GPU run) to a JSON file that scripts/gpu_acceptance.py reads.

    python scripts/gpu_reference.py --model 30b --layers 4 --prompt 16 --tokens 240 --out .gpuref/ref_30b.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_tui.backends.base import NumpyBackend  # noqa: E402
from kestrel_tui.engine.inputs import default_prompt  # noqa: E402
from kestrel_tui.model.config import default_config, qwen3_30b_a3b_config  # noqa: E402
from kestrel_tui.model.weights import synthetic_model  # noqa: E402

def build_model(name: str, layers: int | None):
    cfg = qwen3_30b_a3b_config(layers or 48) if name == "30b" else default_config()
    if name != "30b" and layers:
        cfg = cfg.with_layers(layers)
    return synthetic_model(cfg)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("default", "30b"), default="30b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=240)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.time()
    model = build_model(args.model, args.layers)
    print(f"model built in {time.time() - t0:.1f} s", flush=True)
    prompt = default_prompt(model.cfg.vocab, args.prompt)
    t0 = time.time()
    done = [0]

    def progress(pos):
        done[0] += 1
        if done[0] % 16 == 0:
            print(f"  {done[0]} positions, {time.time() - t0:.1f} s", flush=True)

    # One position per step, the prompt too: every column of a step is computed on
    # its own (docs/numerics.md), so this equals an M=16 prefill bit for bit and
    # needs 1/16 of the memory. Greedy decode from the last prompt position.
    backend = NumpyBackend(model)
    backend.reset(len(prompt) + args.tokens)
    tokens, hashes = [], []
    tok = prompt[0]
    for t in range(len(prompt) + args.tokens):
        tok = prompt[t] if t < len(prompt) else tok
        out = backend.step(np.array([tok]), t, raw=False)
        tokens.append(int(tok))
        hashes.append({k: f"{v:016x}" for k, v in out.hashes[0].items()})
        tok = int(np.argmax(out.logits[0]))
        progress(t)
    elapsed = time.time() - t0
    out = {
        "model": args.model, "layers": model.cfg.n_layers, "prompt": prompt,
        "tokens": tokens, "hashes": hashes,
        "cpu_seconds": elapsed, "cpu_threads": os.cpu_count(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out))
    print(f"{len(tokens)} positions in {elapsed:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
