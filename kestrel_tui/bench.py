"""`kestrel-tui bench`: speed figures, printed (the committed copies live in results/).

reference  ms/token of the CPU reference decode (P prompt + N generated tokens; the compiled
           reference where built, --cpu-impl numpy for the numpy one),
           the hashing cost per token, and HF transformers eager on the same
           weights as the peer figure (skipped with a note when torch is absent).
toggle     wall time from changing one toggle to the new first DIFF (sim subject).

--subject cuda (needs the GPU): decode speed of the full-size synthetic
Qwen3-30B-A3B (48 layers, weights generated on the device) at context 1024,
fast and exact kernels, each M=1 step replayed as a CUDA graph, beside the
memory-bandwidth floor (perf/cuda.py says how each figure is taken).
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np
from rich.table import Table

from .terminal import console
from .errors import UsageError


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def bench_reference(model, prompt: list[int], n_tokens: int, impl: str = "auto") -> dict:
    from .engines.build import make_backend
    from .trace.fnv import fnv1a64

    backend = make_backend("cpu", model, impl=impl)
    backend.reset(len(prompt) + n_tokens)
    t0 = time.perf_counter()
    out = backend.step(np.array(prompt), 0)
    prefill = time.perf_counter() - t0
    tok = int(np.argmax(out.logits[-1]))
    steps, hash_times = [], []
    for i in range(n_tokens):
        t0 = time.perf_counter()
        out = backend.step(np.array([tok]), len(prompt) + i)
        steps.append(time.perf_counter() - t0)
        bufs = list(out.raw[0].values())
        t0 = time.perf_counter()
        for b in bufs:
            fnv1a64(b)
        hash_times.append(time.perf_counter() - t0)
        tok = int(np.argmax(out.logits[0]))
    return {"prefill_s": prefill, "step_s": float(np.median(steps)), "hash_s": float(np.median(hash_times)),
            "keys_per_token": len(out.hashes[0]), "impl": type(backend).__name__}


def bench_hf_peer(model, prompt: list[int], n_tokens: int) -> dict | None:
    try:
        import torch
        from .model.hf_export import to_hf_model
    except ImportError as e:
        return {"skipped": f"{e.name or e} not installed (pip install -e '.[test]')"}
    torch.set_num_threads(max(1, torch.get_num_threads()))
    hf = to_hf_model(model)
    ids = torch.tensor([prompt])
    steps = []
    with torch.no_grad():
        t0 = time.perf_counter()
        out = hf(ids, use_cache=True)
        prefill = time.perf_counter() - t0
        past = out.past_key_values
        tok = out.logits[0, -1].argmax()
        for _ in range(n_tokens):
            t0 = time.perf_counter()
            out = hf(tok.view(1, 1), past_key_values=past, use_cache=True)
            steps.append(time.perf_counter() - t0)
            past, tok = out.past_key_values, out.logits[0, -1].argmax()
    return {"prefill_s": prefill, "step_s": float(np.median(steps)), "threads": torch.get_num_threads()}


def bench_toggle(model, prompt: list[int], n_tokens: int, impl: str = "auto") -> dict:
    from .backends.toggles import TOGGLES
    from .session.session import RunSettings, Session
    from .engines.build import make_engine

    session = Session(model, prompt, n_tokens, subject="sim", reference=make_engine("cpu", model, impl=impl))
    t0 = time.perf_counter()
    session.reference()
    ref_s = time.perf_counter() - t0
    base = RunSettings(exact=frozenset(TOGGLES) - {"norm", "gemm"})
    session.run(base)
    rows = []
    for toggled in ("norm", "gemm"):
        settings = RunSettings(exact=base.exact | {toggled})
        t0 = time.perf_counter()
        first = session.run(settings, stop_at_first_diff=True, record=False)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        full = session.run(settings, record=False)
        rows.append((f"+{toggled}", first.first_diff or "all ok", t_first, time.perf_counter() - t0,
                     full.first_diff or "all ok"))
    return {"reference_s": ref_s, "rows": rows}


CUDA_BENCH_CTX = 1024


def run_bench_cuda(args: argparse.Namespace, config) -> int:
    from .perf import cuda as perf
    from .backends.cuda.runtime import CudaUnavailable, runtime
    from .backends.cuda.weights import DeviceSyntheticModel
    from .model.config import qwen3_30b_a3b_config

    try:
        rt = runtime()
    except CudaUnavailable as e:
        raise UsageError(f"--subject cuda: {e.reason}; plain `kestrel-tui bench` gives the CPU figures") from None
    if config.model:
        from .terminal import load_model

        model = load_model(config)
    else:
        model = DeviceSyntheticModel(qwen3_30b_a3b_config(48))
    cfg, ctx = model.cfg, CUDA_BENCH_CTX
    console.print(f"model {model.name} ({cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_experts} experts"
                  f" top-{cfg.top_k}, vocab {cfg.vocab}, q4_0) on {rt.name}; context {ctx}, {config.tokens} steps")
    bw = perf.copy_bandwidth(rt)
    from .backends.cuda.options import CudaOptions
    from .session.inputs import side_specs

    spec = side_specs(config, "cuda")["subject"]  # a profile's cuda subject brings its own switches
    cuda_options = CudaOptions.of(spec.options if spec.engine == "cuda" else {}, config.cuda_options)
    r = perf.decode_bench(model, ctx=ctx, steps=max(4, config.tokens), log=lambda *_: None, options=cuda_options)
    need = perf.active_bytes(cfg, ctx)
    floor_ms = need["total"] / (bw["gbps_rw"] * 1e9) * 1e3
    fast, exact = r["fast"], r["exact"]
    t = Table(title=f"decode at context {ctx} (cuda, M=1, CUDA graph per step)", title_justify="left")
    for col in ("what", "ms/token", "note"):
        t.add_column(col)
    t.add_row("bandwidth floor", f"{floor_ms:.3f}", f"{need['total'] / 1e9:.3f} GB a token (weights"
              f" {(need['total'] - need['kv']) / 1e9:.3f} + KV {need['kv'] / 1e9:.3f}) / {bw['gbps_rw']:.0f} GB/s"
              f" (device copy, read + write)")
    for label, v in (("fast", fast), ("exact", exact)):
        t.add_row(f"{label} step", f"{v['graph_ms']:.3f}", f"{v['graph_ms'] / floor_ms:.2f}x the floor"
                  + (f"; target <= {perf.TARGET_FLOOR_X:g}x" if label == "fast" else
                     f"; {r['exact_over_fast']:.2f}x fast, target <= {perf.TARGET_EXACT_OVER_FAST:g}x"))
        t.add_row(f"  {label} without hashing", f"{v['graph_nohash_ms']:.3f}",
                  f"hashing {100 * v['hash_overhead']:.1f}% of the step; target <= {100 * perf.TARGET_HASH_SHARE:g}%")
        t.add_row(f"  {label}, kernels launched one by one", f"{v['direct_ms']:.3f}",
                  f"launch overhead {100 * v['launch_share']:.0f}% of that; the graph has {v['graph_nodes']} nodes")
    console.print(t)
    return 0


def run_bench(args: argparse.Namespace, config) -> int:
    from .terminal import load_model, whole_columns_table
    from .session.inputs import resolve_prompt

    if args.subject == "cuda":
        return run_bench_cuda(args, config)

    model = load_model(config)
    prompt = resolve_prompt(config, model)
    what = args.what
    console.print(f"model {model.name} ({model.cfg.n_layers} layers, hidden {model.cfg.hidden}, {model.fmt}),"
                  f" {len(prompt)} prompt + {config.tokens} tokens; {platform.processor() or platform.machine()},"
                  f" numpy {np.__version__}")
    if what in ("reference", "all"):
        ref = bench_reference(model, prompt, config.tokens, config.cpu_impl)
        peer = bench_hf_peer(model, prompt, config.tokens)
        t = Table(title="reference decode (CPU)", title_justify="left")
        for col in ("what", "ms/token", "note"):
            t.add_column(col)
        impl = "compiled" if ref["impl"] == "CompiledBackend" else "numpy"
        t.add_row(f"kestrel reference step ({impl})", _ms(ref["step_s"]), f"median of {config.tokens}; target <= 100")
        t.add_row("  of which hashing", _ms(ref["hash_s"]),
                  f"{ref['keys_per_token']} keys, {100 * ref['hash_s'] / ref['step_s']:.1f}% of the step; target <= 10%")
        t.add_row("kestrel prefill (whole prompt)", _ms(ref["prefill_s"]), f"{len(prompt)} positions in one step")
        if peer and "skipped" not in peer:
            t.add_row("HF transformers eager step", _ms(peer["step_s"]), f"torch threads {peer['threads']}, f32")
            t.add_row("HF prefill", _ms(peer["prefill_s"]), "")
        else:
            t.add_row("HF transformers eager", "-", peer["skipped"] if peer else "")
        console.print(t)
    if what in ("toggle", "all"):
        tog = bench_toggle(model, prompt, config.tokens, config.cpu_impl)
        rows = [[change, first, f"{t_first:.2f}", f"{t_full:.2f}", full]
                for change, first, t_first, t_full, full in tog["rows"]]
        console.print(whole_columns_table(
            f"toggle -> first DIFF (sim subject; reference computed once in {tog['reference_s']:.2f} s)",
            [("change", True), ("first DIFF", True), ("to first DIFF (s)", True), ("full run (s)", True),
             ("after full run", True)], rows))
    return 0
