"""The race: llama.cpp CUDA vs kestrel fast and exact, same weights, same H200, one run (results/llamacpp-findings.md).

The full-size synthetic Qwen3-30B-A3B (48 layers, q4_0) is made on the host with the
device generator's host twin (model/device_synthetic.py: the very bytes gen_q4 writes on
the GPU) and written as a GGUF (model/gguf.py); llama.cpp's own llama-bench decodes it
at batch 1 after a 1024-token context (`-d 1024 -n N -p 0`, all layers on the GPU,
flash attention off and on); then kestrel's cuda backend decodes the same weights,
generated on the device with the same seed, at context 1024, fast and exact
(kestrel_tui/perf/cuda.py decode_bench: CUDA graph per step, median of N steps).

    python scripts/race.py --llama-bench /path/to/llama-bench --gguf /tmp/race.gguf --steps 64 --json out.json

Prints one table; --json keeps every figure.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED = 0
CTX = 1024


def write_race_gguf(path: Path, threads: int) -> dict:
    from kestrel_tui.model.config import qwen3_30b_a3b_config
    from kestrel_tui.model.device_synthetic import device_synthetic_model
    from kestrel_tui.model.gguf import write_gguf

    t0 = time.perf_counter()
    model = device_synthetic_model(qwen3_30b_a3b_config(48), seed=SEED, threads=threads)
    t_twin = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_gguf(model, path)
    out = {"twin_s": round(t_twin, 1), "write_s": round(time.perf_counter() - t0, 1),
           "gguf_bytes": path.stat().st_size}
    print(f"GGUF {path}: {out['gguf_bytes'] / 2**30:.2f} GiB; host twin {t_twin:.1f} s, written in"
          f" {out['write_s']} s", flush=True)
    return out


def llama_bench(binary: str, gguf: Path, steps: int) -> list[dict]:
    cmd = [binary, "-m", str(gguf), "-ngl", "99", "-p", "0", "-n", str(steps), "-d", str(CTX), "-fa", "0,1",
           "-r", "3", "-o", "json"]
    print("$ " + " ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"llama-bench failed ({res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(res.stdout)
    out = []
    for r in rows:
        ms = 1e3 / r["avg_ts"]
        out.append({"flash_attn": r.get("flash_attn"), "n_gen": r.get("n_gen"), "n_depth": r.get("n_depth"),
                    "tok_per_s": r["avg_ts"], "ms_per_token": ms, "gpu": r.get("gpu_info"),
                    "build": r.get("build_commit")})
        print(f"llama.cpp CUDA fa={r.get('flash_attn')}: {ms:.3f} ms/token ({r['avg_ts']:.1f} tok/s)", flush=True)
    return out


def kestrel(steps: int) -> dict:
    from kestrel_tui.perf import cuda as perf
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.model.config import qwen3_30b_a3b_config

    r = perf.decode_bench(DeviceSyntheticModel(qwen3_30b_a3b_config(48), seed=SEED), ctx=CTX, steps=steps,
                          direct=False)
    for label in ("fast", "exact"):
        print(f"kestrel {label}: {r[label]['graph_ms']:.3f} ms/token with hashing,"
              f" {r[label]['graph_nohash_ms']:.3f} without", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--gguf", default="/tmp/race.gguf")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    gguf = Path(args.gguf)
    made = write_race_gguf(gguf, args.threads) if not gguf.exists() else {}
    lc = llama_bench(args.llama_bench, gguf, args.steps)
    ks = kestrel(args.steps)
    best = min(r["ms_per_token"] for r in lc)
    print("\n| engine | ms/token at context 1024 (batch 1) |\n|---|---|")
    for r in lc:
        print(f"| llama.cpp CUDA, flash_attn={r['flash_attn']} | {r['ms_per_token']:.3f} |")
    for label in ("fast", "exact"):
        print(f"| kestrel {label} (hashing on / off) | {ks[label]['graph_ms']:.3f} / {ks[label]['graph_nohash_ms']:.3f} |")
    print(f"kestrel fast {'faster' if ks['fast']['graph_nohash_ms'] < best else 'slower'} than llama.cpp's best;"
          f" kestrel exact {'faster' if ks['exact']['graph_nohash_ms'] < best else 'slower'}")
    if args.json:
        slim = {k: {kk: v for kk, v in ks[k].items() if isinstance(v, (int, float, str, bool))}
                for k in ("fast", "exact")}
        Path(args.json).write_text(json.dumps({"gguf": made, "llama_cpp": lc, "kestrel": slim}, indent=1) + "\n")


if __name__ == "__main__":
    main()
