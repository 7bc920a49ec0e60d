"""The reference's speed beside its peers, one run, the same weights, the same thread count.

    python scripts/bench_reference.py [--model FILE.gguf|HF_DIR] [--threads 2] [--prompt 16] [--tokens 16]
    python scripts/bench_reference.py --a3b-layers 4      # a GGUF with Qwen3-30B-A3B's dims, 4 layers

Rows: the compiled reference (kestrel_tui/cref), the numpy reference, HF transformers eager (f32,
the same weights dequantized; skipped without torch) and llama.cpp on the CPU (the model written as
a GGUF, the same q4_0 bytes; in a child process, as the engine runs it; skipped without
llama-cpp-python). Decode: median ms/token over --tokens single-token steps after the prompt;
prefill: the prompt in one step, ms per position. Peak RSS of this process at the end.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def llama_child(path: str, prompt: list[int], n_tokens: int, threads: int) -> None:
    """In the child: llama.cpp's own decode of the prompt, then n_tokens single tokens; prints JSON."""
    import llama_cpp as L  # first, before numpy (engines/child_main.py says why)

    L.llama_backend_init()
    quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *a: None)
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = False  # q4_0 repack segfaults on AMX CPUs (results/llamacpp-findings.md)
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = len(prompt) + n_tokens + 8
    cp.n_batch = cp.n_ubatch = max(len(prompt), 1)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(len(prompt), 0, 1)

    def decode(tokens: list[int], pos0: int) -> float:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = t, pos0 + i, 1, 0
            batch.logits[i] = i == len(tokens) - 1
        t0 = time.perf_counter()
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return time.perf_counter() - t0

    prefill = decode(prompt, 0)
    steps = [decode([(7 * i + 3) % 100], len(prompt) + i) for i in range(n_tokens)]
    steps.sort()
    print(json.dumps({"prefill_s": prefill, "step_s": steps[len(steps) // 2]}))


def bench_kestrel(backend, prompt: list[int], n_tokens: int) -> dict:
    import numpy as np

    backend.reset(len(prompt) + n_tokens)
    t0 = time.perf_counter()
    backend.step(np.array(prompt), 0)
    prefill = time.perf_counter() - t0
    steps = []
    for i in range(n_tokens):
        t0 = time.perf_counter()
        backend.step(np.array([(7 * i + 3) % 100]), len(prompt) + i)
        steps.append(time.perf_counter() - t0)
    return {"prefill_s": prefill, "step_s": float(np.median(steps))}


def bench_hf(model, prompt: list[int], n_tokens: int, threads: int) -> dict:
    try:
        import torch

        from kestrel_tui.model.hf_export import to_hf_model
    except ImportError as e:
        return {"skipped": f"{e.name} not installed"}
    torch.set_num_threads(threads)
    hf = to_hf_model(model)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = hf(torch.tensor([prompt]), use_cache=True)
        prefill = time.perf_counter() - t0
        past, steps = out.past_key_values, []
        for i in range(n_tokens):
            t0 = time.perf_counter()
            out = hf(torch.tensor([[(7 * i + 3) % 100]]), past_key_values=past, use_cache=True)
            steps.append(time.perf_counter() - t0)
            past = out.past_key_values
    steps.sort()
    return {"prefill_s": prefill, "step_s": steps[len(steps) // 2]}


def bench_llama(gguf: str, prompt: list[int], n_tokens: int, threads: int) -> dict:
    try:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            return {"skipped": "llama-cpp-python not installed"}
    except ImportError:
        return {"skipped": "llama-cpp-python not installed"}
    r = subprocess.run([sys.executable, __file__, "--llama-child", gguf, ",".join(map(str, prompt)), str(n_tokens),
                        str(threads)], capture_output=True, text=True)
    if r.returncode:
        return {"skipped": f"llama.cpp child failed (rc {r.returncode}): {r.stderr.strip().splitlines()[-1:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .gguf or HF directory (default: the embedded model)")
    ap.add_argument("--a3b-layers", type=int, help="a Qwen3-30B-A3B-dims model with this many layers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16, help="prompt length")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed")
    ap.add_argument("--skip", default="", help="comma list of rows to leave out: numpy,hf,llama")
    ap.add_argument("--lib", help="another build of the compiled reference (default: the installed one)")
    ap.add_argument("--llama-child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.llama_child:
        path, prompt, n, threads = a.llama_child
        llama_child(path, [int(t) for t in prompt.split(",")], int(n), int(threads))
        return
    sys.path.insert(0, str(ROOT))
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.cref.backend import CompiledBackend
    from kestrel_tui.model.gguf import write_gguf
    from kestrel_tui.model.hf import load_model

    skip = set(filter(None, a.skip.split(",")))
    t0 = time.perf_counter()
    if a.a3b_layers:
        from kestrel_tui.model.config import qwen3_30b_a3b_config
        from kestrel_tui.model.device_synthetic import device_synthetic_model

        model = device_synthetic_model(qwen3_30b_a3b_config(a.a3b_layers), seed=0, threads=a.threads)
    else:
        model = load_model(a.model)
    cfg = model.cfg
    prompt = [(31 * i + 1) % min(cfg.vocab, 1000) for i in range(a.prompt)]
    print(f"model {model.name}: {cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_experts} experts top-{cfg.top_k},"
          f" vocab {cfg.vocab}, {model.fmt}; loaded in {time.perf_counter() - t0:.1f} s; prompt {len(prompt)},"
          f" {a.tokens} decode steps, {a.threads} threads, {os.cpu_count()} CPUs", flush=True)
    rows = {"kestrel compiled": bench_kestrel(CompiledBackend(model, threads=a.threads, lib_path=a.lib), prompt,
                                              a.tokens)}
    print("compiled done", flush=True)
    if "numpy" not in skip:
        rows["kestrel numpy"] = bench_kestrel(NumpyBackend(model), prompt, a.tokens)
    if "hf" not in skip:
        rows["HF transformers eager (f32)"] = bench_hf(model, prompt, a.tokens, a.threads)
    if "llama" not in skip:
        with tempfile.TemporaryDirectory() as tmp:
            gguf = a.model if a.model and a.model.endswith(".gguf") else str(Path(tmp) / "m.gguf")
            if gguf != a.model:
                write_gguf(model, gguf)
            rows["llama.cpp CPU"] = bench_llama(gguf, prompt, a.tokens, a.threads)
    print(f"{'engine':<30} {'decode ms/token':>16} {'prefill ms/position':>20}")
    for name, r in rows.items():
        if "skipped" in r:
            print(f"{name:<30} {'-':>16} {'-':>20}  {r['skipped']}")
        else:
            print(f"{name:<30} {r['step_s'] * 1e3:>16.2f} {r['prefill_s'] * 1e3 / len(prompt):>20.2f}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
