"""The cuda backend's acceptance on a GPU: every check, in named sections, in one process.

One JSON of every figure (written again after each section), and a table of the rows printed last. A
section that crashes is one FAIL row and the next section runs: time on a GPU machine is short, and
a run has to report everything it can. Exit 1 if any row fails.

Sections (--only picks sections or groups, run in the order given):

  bits
    replicas        the UCRT replica device functions (expf, cosf, sinf) == the numpy replicas,
                    >= --replica-n inputs each
    default         the embedded default model, 16 prompt + 48 tokens, all exact == cpu on every key:
                    prefill on the subject, prefill on the reference, isolate mode; all fast: the
                    first DIFF is at t0_l0_
    30b             Qwen3-30B-A3B layer dims, 4 layers, 256 positions against the cpu reference's
                    hashes (--ref; computed first when missing): all exact == cpu on every key; all
                    fast: the first DIFF at t0; then toggles switched on one by one (the owner of the
                    current first DIFF first, as the debugger's bisection does): monotonic, ends all ok
    iso             batch-verify: M = 2..8 columns a step over --positions positions vs M=1 decode, the
                    default model and the 30B dims x 4 layers; exact: no column differs; fast: the
                    logits' ndiff and the differing keys per column index
    graph           the M=1 graph replay == direct steps (logits bit for bit, every key), 16 positions,
                    both models, fast and exact
  speed
    bench           30B dims x 4 layers at --ctx: ms/token of the step as the app runs it (graph
                    replay) and launched directly, each with and without hashing; device time of a
                    replay; the attention kernels alone; exact/fast <= 1.1, hashing <= 3 %
    full            the full-size 48-layer model (weights made on the device): copy bandwidth, bytes a
                    token must read and the bandwidth floor; ms/token fast and exact (graph and direct,
                    with and without hashing), --full-runs runs: medians and spreads; fast <= 3x floor,
                    exact/fast <= 1.1, hashing <= 3 %, launch share, finite logits
    profile         the full-size step's device time per kernel (CUDA events around each launch)
  cli
    cli-run         `kestrel-tui run --subject cuda --exact all --tokens 8` (python -m kestrel_tui.cli)
    cli-iso         `kestrel-tui iso --subject cuda --m 8 --exact all|none`
    cli-bench       `kestrel-tui bench --subject cuda --tokens --steps`
    app             the Textual app headless (run_test) with the cuda subject: all fast, then 'a'
  proof (not in the default run: ~4 min each on the H200 machine, most of it the cpu reference)
    fullsize        the full-size proof: the 48-layer model's weights made on the device, the same
                    bytes made on the host (model/device_synthetic.py) for the cpu reference; all
                    exact == cpu on every key of 16 prompt + 48 greedy tokens (--fullsize-ref; computed
                    first when missing)
    fullsize-spread the same on 48 given, spread-out tokens (greedy decode of these weights repeats one
                    token; this run reaches many embedding rows and expert choices)

The default is `--only bits,speed,cli`; `--only all` adds the proof. --references-only computes and
writes the cpu references of the chosen sections (30b, fullsize, fullsize-spread) and touches no GPU:
run it ahead on any machine, and copy the folder along with the tree.

    python3 scripts/gpu_acceptance.py --only 30b --references-only        # ahead: .gpuref/ref_30b.json
    python3 scripts/gpu_acceptance.py --out acceptance.json               # on the H200 (.gpuref in the tree)
    python3 scripts/gpu_acceptance.py --only full,profile --steps 30 --out speed.json
    python3 scripts/gpu_acceptance.py --only fullsize --out proof.json

(The scripts it replaces are named in results/gpu-h200.md.)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kestrel_tui.backends.toggles import OWNERS, TOGGLES  # noqa: E402
from kestrel_tui.session.inputs import default_prompt  # noqa: E402
from kestrel_tui.model.config import default_config, qwen3_30b_a3b_config  # noqa: E402
from kestrel_tui.trace.keys import order_key, parse_key  # noqa: E402

ALL, NONE = frozenset(TOGGLES), frozenset()

# ------------------------------------------------------------ rows, the JSON record, the section runner

ROWS: list[tuple[str, str, str]] = []  # (check, figure, verdict)
RESULTS: dict = {}


def row(check: str, figure: str, ok: bool | None = None) -> None:
    verdict = "" if ok is None else ("PASS" if ok else "FAIL")
    ROWS.append((check, figure, verdict))
    print(f"  {verdict:4} {check}: {figure}", flush=True)


def run_sections(names: list[str], args, device: str) -> int:
    """Run the named sections in order, record their times, write args.out after each one,
    print the table of rows; exit status 1 if any row failed."""
    RESULTS["device"] = device
    RESULTS["argv"] = sys.argv[1:]
    print(f"device: {device}", flush=True)
    for name in names:
        print(f"== {name}", flush=True)
        t0 = time.time()
        try:
            SECTIONS[name][0](args)
        except Exception as e:
            traceback.print_exc()
            row(f"section {name}", f"crashed: {type(e).__name__}: {e}", False)
        RESULTS[f"section_{name}_s"] = time.time() - t0
        print(f"   ({name}: {time.time() - t0:.1f} s)", flush=True)
        Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    print("\n" + "=" * 100)
    w = max((len(c) for c, _, _ in ROWS), default=0)
    for check, figure, verdict in ROWS:
        print(f"{verdict:4}  {check:<{w}}  {figure}")
    return 0 if all(v != "FAIL" for _, _, v in ROWS) else 1


# ------------------------------------------------------------ models, built once a process

_MODELS: dict = {}


def model(name: str, layers: int = 4):
    """default: the embedded model; 30b-host: the 30B dims with `layers` layers, host weights (the cpu
    reference's); 30b4 / 30b48: the 30B dims, weights made on the device (speed and batch checks)."""
    key = (name, layers) if name == "30b-host" else name
    if key not in _MODELS:
        from kestrel_tui.model.weights import synthetic_model

        if name == "default":
            _MODELS[key] = synthetic_model(default_config())
        elif name == "30b-host":
            _MODELS[key] = synthetic_model(qwen3_30b_a3b_config(layers))
        else:
            from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel

            n = {"30b4": 4, "30b48": 48}[name]
            _MODELS[key] = DeviceSyntheticModel(qwen3_30b_a3b_config(n), name=(
                "30B-dims x 4 layers (device)" if n == 4 else "30B-A3B full size (device)"))
    return _MODELS[key]


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _run_cli(argv: list[str], env: dict | None = None) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "kestrel_tui.cli", *argv]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    text = (proc.stdout + proc.stderr).strip()
    print(text, flush=True)
    return proc.returncode, text, time.time() - t0


# ------------------------------------------------------------ bits

def sec_replicas(args) -> None:
    from kestrel_tui.backends.cuda.runtime import runtime
    from kestrel_tui.backends.cuda.selfcheck import replica_mismatches

    rt = runtime()
    for fn in ("expf", "cosf", "sinf"):
        t0 = time.time()
        n, bad, first = replica_mismatches(rt, fn, args.replica_n, seed=len(fn))
        RESULTS[f"replica_{fn}"] = {"inputs": n, "mismatches": bad, "first": first.tolist(), "s": time.time() - t0}
        row(f"{fn}_ucrt (device) == numpy replica", f"{bad} mismatches / {n:,} inputs",
            bad == 0 and n >= args.replica_n)


def _diag(res) -> str:
    st = res.stats(res.first_diff) if res.first_diff else None
    return f"first DIFF {res.first_diff}" + (f" ({st.n_diff}/{st.n} elements, max {st.max_ulp} ULP)" if st else "")


def sec_default(args) -> None:
    from kestrel_tui.session.session import RunSettings, Session

    m = model("default")
    session = Session(m, default_prompt(m.cfg.vocab, 16), 48, subject="cuda")
    t0 = time.time()
    session.reference()
    RESULTS["default_reference_s"] = time.time() - t0
    for label, settings in (("prefill=subject", RunSettings(exact=ALL, prefill="subject")),
                            ("prefill=reference", RunSettings(exact=ALL)),
                            ("isolate", RunSettings(exact=ALL, mode="isolate"))):
        t0 = time.time()
        res = session.run(settings, record=False)
        n = len(res.comparison.status)
        ok = sum(1 for s in res.comparison.status.values() if s.value == "ok")
        RESULTS[f"default_exact_{label}"] = {"keys": n, "ok": ok, "first_diff": res.first_diff,
                                             "positions": len(res.sub.positions), "s": time.time() - t0}
        row(f"default model 16+48, all exact, {label}", f"{ok}/{n} keys ok over {len(res.sub.positions)} positions"
            + ("" if res.all_ok else "; " + _diag(res)), res.all_ok and n == 64 * 530)
        if not res.all_ok and label == "prefill=subject":  # where does it come from? every op on its own
            iso = session.run(RunSettings(exact=ALL, mode="isolate", prefill="subject"), record=False)
            fields = sorted({parse_key(k).field for k, s in iso.comparison.status.items() if s.value == "DIFF"})
            row("  isolate diagnosis: fields with DIFF", ", ".join(fields) or "none")
    # fast: first DIFF at position 0
    res = session.run(RunSettings(prefill="subject"), record=False, stop_at_first_diff=True)
    RESULTS["default_fast_first_diff"] = res.first_diff
    row("default model, all fast, prefill=subject: first DIFF", str(res.first_diff),
        bool(res.first_diff) and res.first_diff.startswith("t0_l0_"))


def reference_30b(args) -> dict:
    """The cpu reference of the 30b section: every key's hash of every position and the tokens
    consumed (the GPU run's teacher-forced input), greedy from the last prompt position. One position
    a step, the prompt too: every column of a step is computed on its own (docs/numerics.md), so this
    equals an M=16 prefill bit for bit and needs 1/16 of the memory."""
    from kestrel_tui.backends.base import NumpyBackend

    t0 = time.time()
    m = model("30b-host", args.ref_layers)
    print(f"  30b model ({args.ref_layers} layers, host weights) built in {time.time() - t0:.1f} s", flush=True)
    prompt = default_prompt(m.cfg.vocab, args.ref_prompt)
    backend = NumpyBackend(m)
    backend.reset(len(prompt) + args.ref_tokens)
    tokens, hashes = [], []
    tok = prompt[0]
    t0 = time.time()
    for t in range(len(prompt) + args.ref_tokens):
        tok = prompt[t] if t < len(prompt) else tok
        out = backend.step(np.array([tok]), t, raw=False)
        tokens.append(int(tok))
        hashes.append({k: f"{v:016x}" for k, v in out.hashes[0].items()})
        tok = int(np.argmax(out.logits[0]))
        if (t + 1) % 16 == 0:
            print(f"  cpu reference: {t + 1} positions, {time.time() - t0:.1f} s", flush=True)
    ref = {"model": "30b", "layers": m.cfg.n_layers, "prompt": prompt, "tokens": tokens, "hashes": hashes,
           "cpu_seconds": time.time() - t0, "cpu_threads": os.cpu_count()}
    path = Path(args.ref)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ref))
    print(f"  {len(tokens)} positions in {ref['cpu_seconds']:.1f} s -> {path}", flush=True)
    return ref


class RefRunner:
    """The 30b model on the GPU against the saved cpu reference hashes (teacher-forced tokens)."""

    def __init__(self, m, ref: dict):
        self.model, self.ref = m, ref
        self.tokens = ref["tokens"]
        self.P = len(ref["prompt"])
        self.hashes = [{k: int(v, 16) for k, v in h.items()} for h in ref["hashes"]]

    def run(self, exact: frozenset, stop_at_first_diff: bool) -> tuple[str | None, int, int, float]:
        """-> (first DIFF, keys ok, keys compared, seconds); prefill on the subject (one M=16 step)."""
        from kestrel_tui.backends.cuda import make_cuda_backend

        b = make_cuda_backend(self.model, exact=exact)
        b.reset(len(self.tokens))
        t0 = time.time()
        ok = n = 0
        first = None
        pos = 0
        while pos < len(self.tokens):
            m = self.P if pos == 0 else 1
            out = b.step(np.array(self.tokens[pos:pos + m]), pos, raw=False)
            for j in range(m):
                ref = self.hashes[pos + j]
                for key, h in out.hashes[j].items():
                    n += 1
                    if ref.get(key) == h:
                        ok += 1
                    elif first is None or order_key(key) < order_key(first):
                        first = key
            pos += m
            if first is not None and stop_at_first_diff:
                break
        return first, ok, n, time.time() - t0


def sec_30b(args) -> None:
    path = Path(args.ref)
    if args.references_only or not path.exists():
        print(f"  computing the cpu reference ({path} {'not there' if not path.exists() else 'asked for'})",
              flush=True)
        ref = reference_30b(args)
        RESULTS["30b_reference"] = {k: ref[k] for k in ("layers", "cpu_seconds", "cpu_threads")} | {
            "positions": len(ref["tokens"]), "path": str(path)}
        if args.references_only:
            return
    else:
        ref = json.loads(path.read_text())
    t0 = time.time()
    m = model("30b-host", ref["layers"])
    RESULTS["30b_model_build_s"] = time.time() - t0
    runner = RefRunner(m, ref)
    npos = len(runner.tokens)
    t0 = time.time()
    first, ok, n, secs = runner.run(ALL, stop_at_first_diff=False)
    RESULTS["30b_exact"] = {"positions": npos, "keys": n, "ok": ok, "first_diff": first, "s": secs,
                            "upload_and_run_s": time.time() - t0, "cpu_reference_s": ref.get("cpu_seconds"),
                            "cpu_reference_threads": ref.get("cpu_threads")}
    row(f"30b dims x{ref['layers']} layers, {npos} positions, all exact", f"{ok}/{n} keys ok"
        + ("" if first is None else f"; first DIFF {first}"), first is None and n == npos * (ref["layers"] * 11 + 2))
    exact: frozenset = NONE
    first, *_ = runner.run(exact, stop_at_first_diff=True)
    moves = [{"change": "all fast", "first_diff": first}]
    row("30b all fast: first DIFF (prefill=subject)", str(first), bool(first) and first.startswith("t0_"))
    monotonic = True
    while first is not None and len(exact) < len(TOGGLES):
        field = parse_key(first).field
        owners = [t for t in OWNERS.get(field, ()) if t not in exact]
        op = owners[0] if owners else next(t for t in TOGGLES if t not in exact)
        exact = exact | {op}
        new, *_ = runner.run(exact, stop_at_first_diff=True)
        moved = new is None or order_key(new) >= order_key(first)
        monotonic &= moved
        moves.append({"change": f"+{op}", "before": first, "first_diff": new})
        row(f"  +{op}", f"{first} -> {new or 'all ok'}", moved)
        first = new
    RESULTS["30b_moves"] = moves
    row("30b toggles one by one: monotonic, ends all ok", f"{len(moves) - 1} moves", monotonic and first is None)


def sec_iso(args) -> None:
    from kestrel_tui.perf.cuda import batch_verify

    out = {}
    for mname in ("default", "30b4"):
        for label, ex in (("exact", ALL), ("fast", NONE)):
            print(f"  {mname} {label}:", flush=True)
            t0 = time.time()
            r = batch_verify(model(mname), ex, n_pos=args.positions)
            r["s"] = time.time() - t0
            out[f"{mname}_{label}"] = r
            w = r["widths"]
            if label == "exact":
                bad = {M: v["columns_with_diff"] for M, v in w.items() if v["columns_with_diff"]}
                row(f"iso {mname}, exact, M=2..8 x {args.positions} positions: columns with any diff",
                    f"{sum(v['columns_with_diff'] for v in w.values())} (keys differing"
                    f" {sum(v['key_diffs'] for v in w.values())})", not bad)
            else:
                for M, v in w.items():
                    row(f"iso {mname}, fast, M={M}: per column index, logits ndiff / differing keys (summed)",
                        f"{v['ndiff_per_column']} / {v['key_diffs_per_column']};"
                        f" {v['columns_with_diff']}/{args.positions} positions differ; first key {v['first_diff_key']}")
    RESULTS["iso"] = out


def sec_graph(args) -> None:
    from kestrel_tui.perf.cuda import graph_equals_direct

    out = {}
    for mname in ("30b4", "default"):
        for label, ex in (("exact", ALL), ("fast", NONE)):
            r = graph_equals_direct(model(mname), ex, n_pos=16)
            out[f"{mname}_{label}"] = r
            row(f"graph replay == direct steps, {mname} {label}, 16 positions",
                f"logits ndiff {r['logits_ndiff']}, keys differing {r['key_diffs']}/{r['keys']};"
                f" {r['graph_nodes']} nodes", r["logits_ndiff"] == 0 and r["key_diffs"] == 0)
    RESULTS["graph"] = out


# ------------------------------------------------------------ speed

def sec_bench(args) -> None:
    """perf.decode_bench (what `kestrel-tui bench --subject cuda` runs) on the 30B dims x 4 layers at
    context --ctx: at each position the same M=1 step through CudaBackend.step four ways — as the
    app runs it (graph replay, every key hashed, the dict of hashes built), the same with
    hashing=False, and both with the graph off (direct launches). Wall clock in Python, medians
    after 3 warm-ups. Hashing overhead = (step - step without hashing) / step. Then the
    attention kernels alone. The 30b section's host-weight model when it ran, else the same dims
    with weights made on the device (the kernels' times do not depend on the values)."""
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.perf import cuda as perf
    from kestrel_tui.perf.cuda import decode_bench

    m = _MODELS.get(("30b-host", 4)) or model("30b4")
    ctx = args.ctx
    out = decode_bench(m, ctx=ctx, steps=args.bench_tokens)
    out["model"] = getattr(m, "name", "30b-host")
    for label, exact in (("fast", NONE), ("exact", ALL)):
        r = out[label]
        b = make_cuda_backend(m, exact=exact)
        b.reset(ctx + 8)
        r["attention_kernel_ms_per_layer"] = att = _attention_only(b, ctx)
        del b
        row(f"bench 30b x4 ctx {ctx}, {label}: ms/token, app step (graph, {r['graph_nodes']} nodes)",
            f"{r['graph_ms']:.3f} (hashing off {r['graph_nohash_ms']:.3f}; device time of a replay"
            f" {r['graph_gpu_ms']:.3f}; {r['keys_per_token']} keys)")
        row(f"bench 30b x4 ctx {ctx}, {label}: ms/token, direct launches",
            f"{r['direct_ms']:.3f} (hashing off {r['direct_nohash_ms']:.3f}; attention kernel {att:.4f}/layer)")
    ratio = out["exact_over_fast"]
    ratio_d = out["exact"]["direct_ms"] / out["fast"]["direct_ms"]
    att_ratio = out["exact"]["attention_kernel_ms_per_layer"] / out["fast"]["attention_kernel_ms_per_layer"]
    ovh = {k: out[k]["hash_overhead"] for k in ("fast", "exact")}
    out.update(ratio_exact_fast=ratio, ratio_exact_fast_direct=ratio_d, ratio_attention=att_ratio)
    RESULTS["bench"] = out
    row(f"exact / fast ms/token, app step (target <= {perf.TARGET_EXACT_OVER_FAST:g})", f"{ratio:.3f}",
        ratio <= perf.TARGET_EXACT_OVER_FAST)
    row("exact / fast ms/token, direct launches", f"{ratio_d:.3f}")
    row("exact / fast attention kernel (seed: 2.25)", f"{att_ratio:.3f}", att_ratio <= 1.2)
    for k, v in ovh.items():
        row(f"hashing overhead per token, {k}, app step (target <= {100 * perf.TARGET_HASH_SHARE:g}%)",
            f"{100 * v:.2f}%", v <= perf.TARGET_HASH_SHARE)
    for k in ovh:
        row(f"hashing overhead per token, {k}, direct launches", f"{100 * out[k]['direct_hash_overhead']:.2f}%")


def _attention_only(b, ctx: int, reps: int = 50) -> float:
    """ms per launch of the layer-0 attention kernels alone at context ctx (CUDA events). The
    timed launches are queued behind ~1 ms of memset on the same stream, so they run back to
    back on the device whatever Python's launch rate: a fast pair is ~13 us of device time, about
    what queuing its two launches from Python takes, and timing it from an idle queue read
    13.5-18.5 us for the same kernels (before commit bc63692)."""
    from kestrel_tui.backends.cuda.launches import Launch, run
    from kestrel_tui.backends.cuda.plan import attention

    cuda = b.rt.cuda
    with b.rt.active():
        lay, T = b.prepare(np.array([1], np.int32), ctx - 1, None)  # the arena and scratch of an M=1 step
        q, out = T.base + lay.offset("qrope", 0), T.base + lay.offset("attn", 0)
        steps: list = []
        attention(b, T, lambda k, grid, block, *a, shared=0: steps.append(Launch(k, grid, block, a, shared)),
                  q, out, 0, ctx - 1, 1)
        run(b.rt, steps, None)
        backlog = cuda.mem_alloc(1 << 30)
        try:
            for _ in range(4):  # ~0.3 ms each on an H200
                cuda.memset_d32_async(backlog, 0, (1 << 30) // 4)
            e0, e1 = cuda.Event(), cuda.Event()
            e0.record()
            for _ in range(reps):
                run(b.rt, steps, None)
            e1.record()
            e1.synchronize()
            return e0.time_till(e1) / reps
        finally:
            backlog.free()


def _spread(xs: list[float], fmt: str = "{:.3f}") -> str:
    """median (min-max) of a few runs."""
    return f"{fmt.format(float(np.median(xs)))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def sec_full(args) -> None:
    from kestrel_tui.backends.cuda.runtime import runtime
    from kestrel_tui.perf import cuda as perf

    rt = runtime()
    m = model("30b48")
    ctx = args.ctx
    t0 = time.time()
    with rt.active():
        dm = m.device_model(rt)
    gen_s = time.time() - t0
    bw = perf.copy_bandwidth(rt)
    need = perf.active_bytes(m.cfg, ctx)
    floor_ms = need["total"] / (bw["gbps_rw"] * 1e9) * 1e3
    row("full-size weights generated on the device", f"{dm.nbytes / 1e9:.2f} GB in {gen_s:.2f} s")
    row("device copy bandwidth (1 GiB dtod, read+write)", f"{bw['gbps_rw']:.0f} GB/s ({bw['ms_per_copy']:.3f} ms a copy)")
    row(f"bytes a token at ctx {ctx} (active weights + KV)", f"{need['total'] / 1e9:.4f} GB -> floor {floor_ms:.3f} ms")
    runs = [perf.decode_bench(m, ctx=ctx, steps=args.steps) for _ in range(args.full_runs)]
    r = {"runs": runs, "copy_bw": bw, "active_bytes": need, "floor_ms": floor_ms, "weights_bytes": dm.nbytes,
         "gen_s": gen_s}
    RESULTS["full"] = r
    fast = [x["fast"]["graph_ms"] for x in runs]
    ratio = [x["exact_over_fast"] for x in runs]
    n = f"{len(runs)} runs, median (min-max)"
    r.update(fast_ms_median=float(np.median(fast)), exact_over_fast_median=float(np.median(ratio)))
    row(f"full 48L fast ms/token (graph) vs floor (target <= {perf.TARGET_FLOOR_X:g}x); {n}",
        f"{_spread(fast)} = {_spread([f / floor_ms for f in fast], '{:.2f}')}x",
        float(np.median(fast)) <= perf.TARGET_FLOOR_X * floor_ms)
    row(f"full 48L exact ms/token (graph); exact/fast (target <= {perf.TARGET_EXACT_OVER_FAST:g}); {n}",
        f"{_spread([x['exact']['graph_ms'] for x in runs])}; {_spread(ratio)}",
        float(np.median(ratio)) <= perf.TARGET_EXACT_OVER_FAST)
    for k in ("fast", "exact"):
        ovh = [x[k]["hash_overhead"] for x in runs]
        row(f"full 48L {k}: hashing overhead (target <= {100 * perf.TARGET_HASH_SHARE:g}%); {n}",
            f"{_spread([100 * v for v in ovh], '{:.2f}')}% (no hashing"
            f" {_spread([x[k]['graph_nohash_ms'] for x in runs])} ms)",
            float(np.median(ovh)) <= perf.TARGET_HASH_SHARE)
        v = runs[-1][k]
        row(f"full 48L {k}: kernels launched one by one; launch share (last run)",
            f"{v['direct_ms']:.3f} ms/token (no hashing {v['direct_nohash_ms']:.3f}); graph saves"
            f" {100 * v['launch_share']:.1f}%; graph device time {v['graph_gpu_ms']:.3f} ms; {v['graph_nodes']} nodes")
        row(f"full 48L {k}: logits finite", str(all(x[k]["finite_logits"] for x in runs)),
            all(x[k]["finite_logits"] for x in runs))


def sec_profile(args) -> None:
    from kestrel_tui.perf.cuda import kernel_profile

    out = {}
    for label, ex in (("fast", NONE), ("exact", ALL)):
        r = kernel_profile(model("30b48"), ex, ctx=args.ctx)
        out[label] = r
        top = ", ".join(f"{k} {v[1]:.3f} ms/{v[0]}" for k, v in list(r["kernels"].items())[:8])
        row(f"full 48L {label}: kernel device time a step (events around each launch)",
            f"sum {r['sum_ms']:.3f} ms over {r['launches']} launches; {top}")
    RESULTS["profile"] = out


# ------------------------------------------------------------ cli and app

def sec_cli_run(args) -> None:
    argv = ["run", "--subject", "cuda", "--exact", "all", "--tokens", "8"]
    rc, text, secs = _run_cli(argv)
    RESULTS["cli_run"] = {"cmd": " ".join(argv), "rc": rc, "output": text, "s": secs}
    row("kestrel-tui run --subject cuda --exact all --tokens 8", f"exit {rc}; "
        + next((ln for ln in text.splitlines() if "all ok" in ln or "first DIFF" in ln), text[-120:]),
        rc == 0 and "all ok" in text)


def sec_cli_iso(args) -> None:
    out = {}
    for ex in ("all", "none"):
        argv = ["iso", "--subject", "cuda", "--m", "8", "--exact", ex]
        rc, text, secs = _run_cli(argv)
        out[ex] = {"cmd": " ".join(argv), "rc": rc, "output": text, "s": secs}
        # all exact: every column equals M=1 decode (exit 0); all fast may differ (exit 1), not fail (2)
        row(f"kestrel-tui iso --subject cuda --m 8 --exact {ex}", f"exit {rc}",
            rc == 0 if ex == "all" else rc in (0, 1))
    RESULTS["cli_iso"] = out


def sec_cli_bench(args) -> None:
    argv = ["bench", "--subject", "cuda", "--tokens", str(args.steps)]
    rc, text, secs = _run_cli(argv, env={**os.environ, "COLUMNS": "160"})
    RESULTS["cli_bench"] = {"cmd": " ".join(argv), "rc": rc, "output": text, "s": secs}
    row("kestrel-tui bench --subject cuda", f"exit {rc} in {secs:.0f} s", rc == 0)


def sec_app(args) -> None:
    from kestrel_tui.app.app import KestrelApp
    from kestrel_tui.app.source import LiveSource, loaded
    from kestrel_tui.session.session import Session

    m = model("default")
    session = Session(m, default_prompt(m.cfg.vocab, 16), 8, subject="cuda")
    out_dir = Path(args.out).parent

    async def settle(pilot, timeout=300.0):
        app = pilot.app
        deadline = time.time() + timeout
        while True:
            await app.workers.wait_for_complete()
            await pilot.pause()
            if not app.main.busy and not getattr(app.screen, "busy", False):
                await pilot.pause()
                return
            if time.time() > deadline:
                raise TimeoutError("app still busy")
            await asyncio.sleep(0.02)

    async def drive():
        app = KestrelApp(LiveSource(lambda _progress: loaded(session)), export_dir=out_dir / "exports")
        async with app.run_test(size=(160, 50)) as pilot:
            await settle(pilot)
            first = app.main.result.first_diff
            await pilot.press("a")  # all exact
            await settle(pilot)
            res = app.main.result
            app.save_screenshot(filename="app_cuda_all_exact.svg", path=str(out_dir))
            return first, res.all_ok, res.sub.backend

    first, all_ok, backend = asyncio.run(drive())
    RESULTS["app"] = {"first_diff_all_fast": first, "all_exact_all_ok": all_ok, "subject": backend}
    row("app headless (run_test), cuda subject", f"all fast: first DIFF {first}; 'a' (all exact): "
        f"{'all ok' if all_ok else 'DIFF'} [{backend}]", all_ok and first is not None)


# ------------------------------------------------------------ proof: the full-size model against the cpu

PROOF_PROMPT, PROOF_TOKENS, PROOF_SEED = 16, 48, 0


def _spread_tokens(vocab: int) -> list[int]:
    return [(7 + 104729 * i) % vocab for i in range(PROOF_TOKENS)]


def _progress(label: str, t0: float, every: int = 8):
    def on_position(pos) -> None:
        if pos.t % every == every - 1:
            print(f"  {label} t{pos.t}: {time.perf_counter() - t0:.1f} s, peak RSS {_peak_gb():.1f} GB", flush=True)
    return on_position


def reference_fullsize(args, forced: bool) -> dict:
    """The cpu reference on the host twin of the device weights (model/device_synthetic.py: the
    same bytes gen_q4 writes): every key's hash, the tokens consumed and the top-1 of each position."""
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.engines.builtin import run_decode
    from kestrel_tui.model.device_synthetic import device_synthetic_model

    cfg = qwen3_30b_a3b_config(args.fullsize_layers)
    key = ("twin", args.fullsize_layers)
    t0 = time.perf_counter()
    if key not in _MODELS:  # ~17 GB of host memory: kept for the other proof section
        _MODELS[key] = device_synthetic_model(cfg, seed=PROOF_SEED, threads=args.threads)
    twin, t_model = _MODELS[key], time.perf_counter() - t0
    print(f"  host twin of the device weights: {args.fullsize_layers} layers in {t_model:.1f} s,"
          f" peak RSS {_peak_gb():.1f} GB", flush=True)
    prompt = [(1 + 7919 * i) % cfg.vocab for i in range(PROOF_PROMPT)]
    t0 = time.perf_counter()
    trace = run_decode(NumpyBackend(twin), prompt, PROOF_TOKENS, raw=False, on_position=_progress("cpu", t0),
                       forced=_spread_tokens(cfg.vocab) if forced else None)
    tokens = _spread_tokens(cfg.vocab) if forced else trace.generated[:PROOF_TOKENS]
    return {"n_layers": args.fullsize_layers, "seed": PROOF_SEED, "prompt": prompt, "tokens": tokens,
            "forced": forced, "top1": [p.top1 for p in trace.positions], "hashes": trace.hashes(),
            "twin_s": t_model, "reference_s": time.perf_counter() - t0, "peak_rss_gb": _peak_gb(),
            "cpu_count": os.cpu_count()}


def proof_cuda(ref: dict) -> dict:
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.engines.builtin import run_decode
    from kestrel_tui.trace.compare import compare

    if ref["n_layers"] == 48 and ref["seed"] == 0:
        m = model("30b48")  # the same weights as the speed sections' (made once on the device)
    else:
        m = DeviceSyntheticModel(qwen3_30b_a3b_config(ref["n_layers"]), seed=ref["seed"])
    backend = make_cuda_backend(m, exact=ALL)
    t0 = time.perf_counter()
    sub = run_decode(backend, ref["prompt"], len(ref["tokens"]), forced=ref["tokens"], raw=False,
                     on_position=_progress("cuda", t0))
    cmp = compare(ref["hashes"], sub.hashes())
    return {"device": backend.device_name, "keys": len(cmp.status), "positions": len(sub.positions),
            "identical": cmp.identical, "first_diff": cmp.first_diff, "first_mismatch": cmp.first_mismatch,
            "counts": {st.value: n for st, n in cmp.counts.items()},
            "top1_equal": [p.top1 for p in sub.positions] == ref["top1"], "cuda_s": time.perf_counter() - t0}


def _proof(args, forced: str) -> None:
    path = Path(args.fullsize_ref.format(forced=forced))
    if args.references_only or not path.exists():
        print(f"  computing the cpu reference ({path} {'not there' if not path.exists() else 'asked for'})",
              flush=True)
        ref = reference_fullsize(args, forced == "spread")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ref))
    else:
        ref = json.loads(path.read_text())
        ref = ref.get("reference", ref)  # gpu_fullsize_proof.py's files held it under "reference"
    summary = {k: v for k, v in ref.items() if k not in ("hashes", "prompt", "tokens", "top1")}
    RESULTS[f"fullsize_{forced}"] = {"reference": summary | {"keys": len(ref["hashes"]), "path": str(path)}}
    row(f"full-size cpu reference ({forced} tokens)", f"{len(ref['hashes'])} keys; twin {ref['twin_s']:.1f} s,"
        f" decode {ref['reference_s']:.1f} s, peak RSS {ref['peak_rss_gb']:.1f} GB, {ref['cpu_count']} CPUs")
    if args.references_only:
        return
    r = proof_cuda(ref)
    RESULTS[f"fullsize_{forced}"]["cuda"] = r
    ok = r["counts"].get("ok", 0)
    row(f"full-size {ref['n_layers']}L all exact == cpu, {forced} tokens",
        f"{ok}/{r['keys']} keys ok over {r['positions']} positions; top-1 equal {r['top1_equal']}"
        + ("" if r["identical"] else f"; first DIFF {r['first_diff']}") + f"; cuda {r['cuda_s']:.1f} s",
        r["identical"])


def sec_fullsize(args) -> None:
    _proof(args, "greedy")


def sec_fullsize_spread(args) -> None:
    _proof(args, "spread")


# ------------------------------------------------------------ the sections

SECTIONS: dict[str, tuple[Callable, bool]] = {  # name: (function, has a cpu reference of its own)
    "replicas": (sec_replicas, False), "default": (sec_default, False), "30b": (sec_30b, True),
    "iso": (sec_iso, False), "graph": (sec_graph, False),
    "bench": (sec_bench, False), "full": (sec_full, False), "profile": (sec_profile, False),
    "cli-run": (sec_cli_run, False), "cli-iso": (sec_cli_iso, False), "cli-bench": (sec_cli_bench, False),
    "app": (sec_app, False),
    "fullsize": (sec_fullsize, True), "fullsize-spread": (sec_fullsize_spread, True),
}
GROUPS = {"bits": ["replicas", "default", "30b", "iso", "graph"], "speed": ["bench", "full", "profile"],
          "cli": ["cli-run", "cli-iso", "cli-bench", "app"], "proof": ["fullsize", "fullsize-spread"]}
GROUPS["all"] = [s for g in ("bits", "speed", "cli", "proof") for s in GROUPS[g]]


def expand(only: str, ap: argparse.ArgumentParser) -> list[str]:
    names: list[str] = []
    for item in filter(None, (s.strip() for s in only.split(","))):
        if item not in SECTIONS and item not in GROUPS:
            ap.error(f"--only {item!r}: choose sections ({', '.join(SECTIONS)}) or groups ({', '.join(GROUPS)})")
        names += [n for n in GROUPS.get(item, [item]) if n not in names]
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="acceptance.json", help="the JSON of every figure")
    ap.add_argument("--only", default="bits,speed,cli", help="sections or groups, comma-separated")
    ap.add_argument("--references-only", action="store_true",
                    help="compute and write the cpu references of the chosen sections; no GPU")
    ap.add_argument("--replica-n", type=int, default=10_000_000, help="replicas: inputs a function")
    ap.add_argument("--ref", default=str(ROOT / ".gpuref" / "ref_30b.json"), help="30b: the cpu reference file")
    ap.add_argument("--ref-layers", type=int, default=4, help="30b reference: layers")
    ap.add_argument("--ref-prompt", type=int, default=16, help="30b reference: prompt tokens")
    ap.add_argument("--ref-tokens", type=int, default=240, help="30b reference: decoded tokens")
    ap.add_argument("--positions", type=int, default=64, help="iso: positions")
    ap.add_argument("--ctx", type=int, default=1024, help="bench, full, profile: context")
    ap.add_argument("--bench-tokens", type=int, default=100, help="bench: timed steps")
    ap.add_argument("--steps", type=int, default=50, help="full, cli-bench: timed steps")
    ap.add_argument("--full-runs", type=int, default=3, help="full: runs of the decode bench (median, spread)")
    ap.add_argument("--fullsize-ref", default=str(ROOT / ".gpuref" / "fullsize_{forced}.json"),
                    help="fullsize*: the cpu reference file ({forced}: greedy or spread)")
    ap.add_argument("--fullsize-layers", type=int, default=48, help="fullsize* reference: layers")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="fullsize*: threads making the host twin")
    args = ap.parse_args()
    names = expand(args.only, ap)
    if args.references_only:
        bad = [n for n in names if not SECTIONS[n][1]]
        if bad:
            ap.error(f"--references-only: {', '.join(bad)} have no cpu reference of their own"
                     f" (these do: {', '.join(n for n, v in SECTIONS.items() if v[1])})")
        return run_sections(names, args, f"host only (cpu references), {os.cpu_count()} CPUs")
    from kestrel_tui.backends.cuda.runtime import runtime

    rt = runtime()
    return run_sections(names, args, f"{rt.name} ({rt.arch})")


if __name__ == "__main__":
    sys.exit(main())
