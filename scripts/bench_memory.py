"""Memory and speed of a real-sized q4_0 model on the reference (results/memory-bench.md records a run).

Writes a sharded bf16 HF checkpoint with Qwen3-30B-A3B's dimensions (hidden 2048,
32 q / 4 kv heads, head_dim 128, 128 experts top-8, moe_intermediate 768, vocab
151936) and --layers layers (4: ~5 GB) into --dir — shard by shard, each shard
generated, written and dropped, so the writer never holds the model — then, in a
fresh process, loads it with `load_model(dir, "q4_0")` and decodes on the
reference (NumpyBackend): a 16-token prefill (one M=16 step), then --tokens
decode steps. Prints:

* q4_0 size: the bytes of every resident weight array (ggml blocks, norms, ...);
* peak RSS while loading, and while decoding (Linux VmHWM, reset between the two
  through /proc/self/clear_refs; a 2 ms VmRSS sampler where that is refused —
  not getrusage's ru_maxrss, which a child started by fork+exec inherits from its parent);
* decode ms/token, prefill ms/position;
* the targets: peak <= 1.15 x q4_0 size + 1 GB; prefill of 16 <= 16 decode steps.

    python scripts/bench_memory.py --dir /tmp/kestrel-bench          # write, measure, delete
    python scripts/bench_memory.py --dir D --keep                      # keep the checkpoint
    python scripts/bench_memory.py --dir D --phase measure             # measure an existing one
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

SHARD_BYTES = 300 << 20  # one shard is generated in memory at a time: bounds the writer


def config(layers: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
            "hidden_size": 2048, "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
            "intermediate_size": 6144, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and shape, in the order written (HF's per-expert names)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    f, E = cfg["moe_intermediate_size"], cfg["num_experts"]
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                (p + "mlp.gate.weight", (E, h))]
        for e in range(E):
            out += [(p + f"mlp.experts.{e}.gate_proj.weight", (f, h)), (p + f"mlp.experts.{e}.up_proj.weight", (f, h)),
                    (p + f"mlp.experts.{e}.down_proj.weight", (h, f))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab_size"], h))]


def bf16_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """bf16 bit patterns (uint16): norms ~ 1 +- 0.1, matrices ~ N(0, 0.02^2); made 2^22 values at a
    time, so a vocabulary-sized tensor costs its 2 bytes a value and a few MB."""
    out = np.empty(shape, np.uint16)
    flat = out.reshape(-1)
    for a in range(0, flat.size, 1 << 22):
        n = min(flat.size, a + (1 << 22)) - a
        if len(shape) == 1:
            x = np.float32(1) + np.float32(0.1) * rng.standard_normal(n, dtype=np.float32)
        else:
            x = np.float32(0.02) * rng.standard_normal(n, dtype=np.float32)
        flat[a:a + n] = x.view(np.uint32) >> np.uint32(16)  # truncated to bf16
    return out


def write_checkpoint(root: Path, layers: int) -> int:
    from safetensors import _safetensors_rust as st  # the library's own writer, fed one shard at a time

    cfg = config(layers)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    names = tensors(cfg)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in names:
        n = 2 * int(np.prod(shape))
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    rng = np.random.default_rng(17)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        keep = {name: bf16_values(rng, shape) for name, shape in shard}
        specs = {name: st.TensorSpec(dtype="bfloat16", shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
                 for name, a in keep.items()}
        st.serialize_file(specs, str(root / fname), metadata={"format": "pt"})
        for name, a in keep.items():
            weight_map[name] = fname
            total += a.nbytes
        del keep, specs
        print(f"\rwrote {fname} ({i + 1}/{len(shards)})", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


# ---------------------------------------------------------------- measuring (a fresh process)

def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRSS:
    """Peak resident set size over a section: VmHWM, reset through clear_refs where the kernel
    allows it; otherwise the largest VmRSS a 2 ms sampler saw."""

    def __enter__(self):
        self.method = "VmHWM"
        try:
            Path("/proc/self/clear_refs").write_text("5")
            if _status_kb("VmHWM") > _status_kb("VmRSS") * 1.02 + 1024:
                raise OSError("not reset")
        except OSError:
            self.method = "sampled VmRSS"
            self._peak, self._stop = 0, threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, _status_kb("VmRSS"))
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.method == "VmHWM":
            self.peak = _status_kb("VmHWM") * 1024
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._peak, _status_kb("VmRSS")) * 1024


def resident_bytes(model) -> int:
    seen, total = set(), 0

    def add(a):
        nonlocal total
        if a is not None and id(a) not in seen:
            seen.add(id(a))
            total += a.nbytes

    for lin in (model.embed_tokens, model.lm_head):
        add(lin.w if lin.w is not None else lin.blocks)
    add(model.norm)
    add(model.inv_freq)
    for L in model.layers:
        for name in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
                     "q_bias", "k_bias", "v_bias", "o_bias"):
            add(getattr(L, name, None))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "gate_proj", "up_proj", "down_proj"):
            lin = getattr(L, name)
            if lin is not None:
                add(lin.w if lin.w is not None else lin.blocks)
    return total


def measure(root: Path, prompt_len: int, n_tokens: int) -> dict:
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.model.hf import load_model

    base = _status_kb("VmRSS") * 1024
    with PeakRSS() as load_peak:
        t0 = time.perf_counter()
        model = load_model(str(root), "q4_0")
        load_s = time.perf_counter() - t0
    after_load = _status_kb("VmRSS") * 1024
    size = resident_bytes(model)
    prompt = np.random.default_rng(1).integers(0, model.cfg.vocab, prompt_len)
    backend = NumpyBackend(model)
    with PeakRSS() as dec_peak:
        backend.reset(prompt_len + n_tokens + 1)
        t0 = time.perf_counter()
        out = backend.step(prompt, 0, raw=False)
        prefill_s = time.perf_counter() - t0
        steps, tok = [], int(np.argmax(out.logits[-1]))
        for i in range(n_tokens):
            t0 = time.perf_counter()
            out = backend.step(np.array([tok]), prompt_len + i, raw=False)
            steps.append(time.perf_counter() - t0)
            tok = int(np.argmax(out.logits[-1]))
    return dict(layers=model.n_layers, q4_0_bytes=size, rss_before_load=base, rss_after_load=after_load,
                peak_load=load_peak.peak, peak_decode=dec_peak.peak, peak_method=load_peak.method, load_s=load_s,
                prefill_s=prefill_s, prompt_len=prompt_len, decode_s=steps)


def report(r: dict, disk: int | None) -> None:
    gb = 1e9
    size = r["q4_0_bytes"]
    target = 1.15 * size + gb
    dec = np.array(r["decode_s"])
    step = float(np.median(dec))
    print(f"model: Qwen3-30B-A3B dims, {r['layers']} layers, bf16 checkpoint"
          + (f" {disk / gb:.2f} GB on disk" if disk else ""))
    print(f"q4_0 size (resident weight arrays): {size} bytes = {size / gb:.3f} GB")
    print(f"RSS before loading: {r['rss_before_load'] / gb:.3f} GB; after loading: {r['rss_after_load'] / gb:.3f} GB"
          f" (load {r['load_s']:.1f} s)")
    print(f"peak RSS while loading:  {r['peak_load'] / gb:.3f} GB ({r['peak_method']})")
    print(f"peak RSS while decoding: {r['peak_decode'] / gb:.3f} GB")
    ok = {k: "OK" if r[k] <= target else "OVER" for k in ("peak_load", "peak_decode")}
    print(f"target 1.15 x q4_0 + 1 GB = {target / gb:.3f} GB: loading {ok['peak_load']}, decoding {ok['peak_decode']}")
    P = r["prompt_len"]
    verdict = "OK" if r["prefill_s"] <= P * step else "OVER"
    print(f"prefill: {r['prefill_s'] * 1e3:.0f} ms for {P} positions = {r['prefill_s'] / P * 1e3:.1f} ms/position"
          f" = {r['prefill_s'] / step:.1f} decode steps (target <= {P}: {verdict})")
    print(f"decode: {step * 1e3:.1f} ms/token (median of {len(dec)}: {', '.join(f'{t * 1e3:.0f}' for t in dec)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, type=Path, help="folder for the generated checkpoint")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16, help="prefill positions (one M-column step)")
    ap.add_argument("--tokens", type=int, default=4, help="decode steps after the prefill")
    ap.add_argument("--phase", choices=("all", "write", "measure"), default="all")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint after measuring")
    ap.add_argument("--json", action="store_true", help="(measure) print the raw figures as JSON")
    args = ap.parse_args()
    if args.phase == "measure":
        r = measure(args.dir, args.prompt, args.tokens)
        print(json.dumps(r) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            report(r, None)
        return 0
    disk = None
    if not (args.dir / "model.safetensors.index.json").is_file():
        t0 = time.perf_counter()
        disk = write_checkpoint(args.dir, args.layers)
        print(f"checkpoint: {disk / 1e9:.2f} GB of bf16 in {args.dir} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    if args.phase == "write":
        return 0
    try:  # a fresh process: nothing of the writer's memory counts
        res = subprocess.run([sys.executable, __file__, "--dir", str(args.dir), "--phase", "measure", "--json",
                              "--prompt", str(args.prompt), "--tokens", str(args.tokens)],
                             capture_output=True, text=True, env={**os.environ})
        if res.returncode:
            print(res.stderr, file=sys.stderr)
            return res.returncode
        r = json.loads(res.stdout.strip().splitlines()[-1])
        if disk is None:
            disk = sum(p.stat().st_size for p in args.dir.glob("*.safetensors"))
        report(r, disk)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
