"""What the hf-dist engine costs: transformers' own tensor-parallel decode on 2 ranks vs the same in the engine.

Recorded in results/hf-dist-bench.md. The same checkpoint, tokens and plan, 2 CPU ranks over gloo, one torch
thread each (the engine's default), float32, eager attention:

  plain    2 ranks started as torchrun starts them (RANK, WORLD_SIZE, a file store), each loading the
           checkpoint with transformers' TP plan (DistributedConfig(tp_size=2)) and running the decode
           itself: no hooks, nothing sent anywhere
  one      for scale: the same decode in one process with no plan (what the split itself costs)
  hf-dist  the hf-dist engine at world_size=2: the same load, the hf engine's hooks on every rank, every
           key sent to the engine, gathered in rank order, hashed and kept (q8 KV, the app's default)

The figure is the time of one decode step (plain: in rank 0, until its logits are on the host; hf-dist:
until the position reaches the engine), the median over a run's steps after the first two. The two go
step by step in turn — the engine decodes a token, the plain ranks the same token, the engine the next —
so a busy machine slows both alike. The page gives the median of the runs' figures with their min and
max, and for hf-dist the part spent in the engine's gathering (hf_dist.gather: checking, concatenating,
hashing); the rest is on the ranks (the hooks, converting and sending the keys).

--oversubscribe instead times the engine's step at 2 and 4 ranks with 1 and 2 threads each (what
hf_dist.THREADS_PER_CORE rests on; the rule is lifted here to measure past it), on a dense model of the
embedded dims with 4 kv heads; --pairs picks some of them (4x2: 4 ranks, 2 threads each).

Models: embedded (the embedded default: synthetic Qwen3-MoE, 48 layers, hidden 256, 16 experts top-4,
vocab 2048) and qwen3-0.6b (synthetic weights in Qwen3-0.6B's shape: 28 layers, hidden 1024, 16 q / 8 kv
heads of 128, MLP 3072, vocab 151936, tied embeddings).

    python scripts/bench_hf_dist.py [--model embedded|qwen3-0.6b] [--runs 5] [--steps 16] [--json FILE]
    python scripts/bench_hf_dist.py --oversubscribe [--pairs 2x1,4x1,2x2,4x2]
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 2
SKIP = 2  # first decode steps of a run left out (the allocator's and gloo's first rounds)
PLAIN_RANK = "--plain-rank"


# ---------------------------------------------------------------------------------------------- plain ranks

def plain_rank(model_dir: str, store: str, threads: int, world: int) -> None:
    """One rank of the plain decode: load with the TP plan, then per command line on stdin (JSON) run a
    prompt on a new cache ({"prompt": ids}) or decode one token ({"token": id}); rank 0 answers each with
    the seconds it took."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.distributed import DistributedConfig
    from transformers.utils import logging

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the libraries print stays off the answers
    logging.disable_progress_bar()
    rank = int(os.environ["RANK"])
    torch.set_num_threads(threads)
    plan = {}
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        plan = {"distributed_config": DistributedConfig(tp_size=world)}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 **plan).eval()
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out.write("ready\n")
    out.flush()
    cache = None
    for line in sys.stdin:
        job = json.loads(line)
        if "prompt" in job:
            cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([job.get("prompt") or [job["token"]]]), use_cache=True,
                           **{kw: cache}).logits
            logits[0, -1].float().numpy()  # the step is done when its logits are on the host
        if rank == 0:
            out.write(f"{time.perf_counter() - t0}\n")
            out.flush()


class PlainGroup:
    """The plain ranks, started once; each call is one forward on all of them."""

    def __init__(self, model_dir: str, folder: str, threads: int, world: int = WORLD):
        env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        store = os.path.join(folder, f"plain-store-{world}")
        self.procs = []
        try:
            for r in range(world):
                self.procs.append(subprocess.Popen(
                    [sys.executable, __file__, PLAIN_RANK, model_dir, store, str(threads), str(world)],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True))
            for p in self.procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a plain rank did not load the model (exit {p.wait()})")
        except BaseException:
            self.close()
            raise

    def prompt(self, ids: list[int]) -> float:
        return self._call({"prompt": ids})

    def token(self, tok: int) -> float:
        return self._call({"token": tok})

    def _call(self, job: dict) -> float:
        line = json.dumps(job) + "\n"
        for p in self.procs:
            p.stdin.write(line)
            p.stdin.flush()
        answer = self.procs[0].stdout.readline()
        if not answer:
            raise RuntimeError(f"plain rank 0 ended (exit {self.procs[0].wait()})")
        return float(answer)

    def close(self) -> None:
        for p in self.procs:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()  # a rank ends at the end of its input
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---------------------------------------------------------------------------------------------- the engine

class Gathering:
    """hf_dist.gather, timed: the engine's share of a step after the ranks answered."""

    def __init__(self):
        from kestrel_tui.engines import hf_dist

        self.module, self.real, self.seconds = hf_dist, hf_dist.gather, []
        hf_dist.gather = self

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.real(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - t0)

    def close(self):
        self.module.gather = self.real


def interleaved(eng, plain: dict[str, PlainGroup], prompt: list[int], forced: list[int],
                gathering: Gathering | None = None) -> dict:
    """One decode in the engine, and the same decode in each ``plain`` group, step by step in turn: after
    each position reaches the engine, the plain groups decode the same token before the engine goes on.
    The engine's step i runs from the end of the plain steps before it to its position's arrival."""
    from kestrel_tui.engines.base import RunRequest

    P, mine, theirs = len(prompt), [], {name: [] for name in plain}
    last = [0.0]

    def on_position(p):
        now = time.perf_counter()
        if p.t >= P:
            mine.append(now - last[0])
        if p.t < P - 1 or p.t == P + len(forced) - 1:
            return
        for name, group in plain.items():
            if p.t == P - 1:
                group.prompt(prompt)
            theirs[name].append(group.token(forced[p.t - P + 1]))
        last[0] = time.perf_counter()

    if gathering is not None:
        gathering.seconds = []
    trace = eng.run(RunRequest(prompt, len(forced), {t.name: t.default for t in eng.toggles}, forced=forced,
                               on_position=on_position))
    raw = trace.positions[-1].raw
    return {"hf-dist": mine, **theirs,
            "gather": gathering.seconds[1:] if gathering is not None else [],  # [0]: the prompt's step
            "keys": len(trace.positions[-1].hashes), "bytes": sum(np.asarray(a).nbytes for a in raw.values())}


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs[SKIP:]) * 1e3


def spread(figures: list[float]) -> dict:
    return {"median": round(statistics.median(figures), 2), "min": round(min(figures), 2),
            "max": round(max(figures), 2), "runs": [round(x, 2) for x in figures]}


# ---------------------------------------------------------------------------------------------- models

def make_checkpoint(name: str, folder: str):
    """(HF directory, our Model or None) for ``name``."""
    if name == "embedded":
        from kestrel_tui.model.hf import load_model
        from kestrel_tui.model.hf_export import to_hf_model

        ours = load_model(None, "f32")
        to_hf_model(ours).save_pretrained(folder)
        return folder, ours
    import torch
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                                   rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(folder)
    return folder, None


def bench(cli) -> dict:
    from kestrel_tui.engines.base import EngineSpec
    from kestrel_tui.engines.hf_dist import make_hf_dist_engine

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="bench-hf-dist-") as d:
        model_dir, ours = make_checkpoint(cli.model, os.path.join(d, "model"))
        vocab = ours.cfg.vocab if ours is not None else 151936
        tokens = rng.integers(0, vocab, cli.prompt + cli.steps).tolist()
        prompt, forced = tokens[:cli.prompt], tokens[cli.prompt:]
        eng = make_hf_dist_engine(EngineSpec("hf-dist", model_dir, {"threads": cli.threads, "world_size": str(WORLD),
                                                                    "timeout": 600}), ours)
        plain = {"plain": PlainGroup(model_dir, d, cli.threads), "one": PlainGroup(model_dir, d, cli.threads, 1)}
        gathering = Gathering()
        try:
            first = interleaved(eng, plain, prompt, forced)  # a warm-up run; it also starts the engine's ranks
            figures = {"plain": [], "hf-dist": [], "gather": [], "one": []}
            for i in range(cli.runs):
                got = interleaved(eng, plain, prompt, forced, gathering)
                for name in figures:
                    figures[name].append(median_ms(got[name]))
                print(f"run {i + 1}: plain {figures['plain'][-1]:8.2f} ms   hf-dist {figures['hf-dist'][-1]:8.2f} ms"
                      f" (gathering {figures['gather'][-1]:.2f} ms)   one process {figures['one'][-1]:8.2f} ms",
                      flush=True)
        finally:
            gathering.close()
            for group in plain.values():
                group.close()
            eng.close()
    out = {k: spread(v) for k, v in figures.items()}
    over = 100 * (out["hf-dist"]["median"] - out["plain"]["median"]) / out["plain"]["median"]
    print(f"{cli.model}: {first['keys']} keys, {first['bytes'] / 1e6:.2f} MB a position; median of {cli.runs} runs"
          f" (each the median of {cli.steps - SKIP} decode steps)")
    print(f"plain TP=2 decode step:  {out['plain']['median']:8.2f} ms  (min {out['plain']['min']}, max"
          f" {out['plain']['max']})")
    print(f"hf-dist TP=2 step:       {out['hf-dist']['median']:8.2f} ms  (min {out['hf-dist']['min']}, max"
          f" {out['hf-dist']['max']})  {over:+.1f} %; gathering {out['gather']['median']:.2f} ms of it")
    print(f"one process, no plan:    {out['one']['median']:8.2f} ms  (min {out['one']['min']}, max"
          f" {out['one']['max']})")
    return {"model": cli.model, "threads": cli.threads, "prompt": cli.prompt, "steps": cli.steps, "runs": cli.runs,
            "keys": first["keys"], "bytes_per_position": first["bytes"], **out, "overhead_pct": round(over, 1)}


def oversubscribe(cli) -> dict:
    from dataclasses import replace

    from kestrel_tui.engines import hf_dist
    from kestrel_tui.engines.base import EngineSpec
    from kestrel_tui.engines.hf_dist import make_hf_dist_engine
    from kestrel_tui.model.config import default_config
    from kestrel_tui.model.weights import synthetic_model

    cfg = replace(default_config(), arch="qwen3", n_experts=0, top_k=0, moe_intermediate=0, intermediate=512,
                  n_kv_heads=4).validate("f32")
    ours = synthetic_model(cfg, "f32")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, cli.prompt + cli.steps).tolist()
    prompt, forced = tokens[:cli.prompt], tokens[cli.prompt:]
    out = {}
    hf_dist.THREADS_PER_CORE = 64  # measured, not refused
    for pair in cli.pairs.split(","):
        world, threads = map(int, pair.split("x"))
        eng = make_hf_dist_engine(EngineSpec("hf-dist", None, {"threads": threads, "world_size": str(world),
                                                               "timeout": 600}), ours)
        try:
            interleaved(eng, {}, prompt, forced)
            ms = [median_ms(interleaved(eng, {}, prompt, forced)["hf-dist"]) for _ in range(cli.runs)]
        finally:
            eng.close()
        out[f"{world}x{threads}"] = spread(ms)
        print(f"{world} ranks × {threads} thread{'s' * (threads > 1)}: {out[f'{world}x{threads}']['median']:8.2f} ms"
              f" a step (min {min(ms):.2f}, max {max(ms):.2f})", flush=True)
    return {"oversubscribe": out, "cores": os.cpu_count(), "runs": cli.runs, "steps": cli.steps}


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == PLAIN_RANK:
        return plain_rank(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("embedded", "qwen3-0.6b"), default="embedded")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="decode steps a run (the first 2 left out)")
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    ap.add_argument("--oversubscribe", action="store_true")
    ap.add_argument("--pairs", default="2x1,4x1,2x2,4x2", help="with --oversubscribe: RANKSxTHREADS, comma-separated")
    ap.add_argument("--json", metavar="FILE")
    cli = ap.parse_args()
    report = oversubscribe(cli) if cli.oversubscribe else bench(cli)
    if cli.json:
        Path(cli.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
