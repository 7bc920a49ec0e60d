"""Decode-speed figures of the cuda backend (`kestrel-tui bench --subject cuda`, scripts/gpu_acceptance.py).

decode_bench(model, ctx) for the fast and the exact kernels:
  * GPU prefill of ctx positions (steps of up to 256 columns, not hashed);
  * then, position by position from ctx, the same M=1 step through CudaBackend.step() four ways:
      graph        as the app runs it: a CUDA-graph replay (graph.py), every key hashed on the
                   device, logits and hashes on the host, the step's dict of hashes built,
      graph_nohash the same with hashing=False (the graph captured without the hash launches,
                   no hashes returned): everything else of the step is the same,
      direct /     the same two with graph=False: the kernels launched one by one from Python;
      direct_nohash
    wall clock in Python around the call, medians after warm-up; graph_gpu: device time of
    one replay (CUDA events).
  * hashing overhead = (graph - graph_nohash) / graph; launch share = 1 - graph / direct.
bandwidth_floor(cfg, ctx, bw): bytes a decode step must read (active weights + KV) / bandwidth.
copy_bandwidth(): device-to-device memcpy of 1 GiB, CUDA events; GB/s counted as read + write.
"""
from __future__ import annotations

import time

import numpy as np

Q4_BLOCK_BYTES = 18  # 32 weights: 16 bytes of nibbles + an f16 scale
# the decode-speed targets the figures are read against (results/gpu-h200-speed.md): fast within
# FLOOR_X times the bandwidth floor, exact at most EXACT_OVER_FAST times fast, hashing at most
# HASH_SHARE of a step
TARGET_FLOOR_X, TARGET_EXACT_OVER_FAST, TARGET_HASH_SHARE = 3.0, 1.10, 0.03


def q4_bytes(rows: int, cols: int) -> int:
    return rows * (cols // 32) * Q4_BLOCK_BYTES


def active_bytes(cfg, ctx: int, kv: str = "q8") -> dict:
    """Bytes one M=1 decode step at context ctx must read: attention + router + top-k experts
    (or a dense layer's MLP) (q4_0) + norms per layer, lm_head, the embedding row, and the KV
    cache rows 0..ctx."""
    h, hd, n = cfg.hidden, cfg.head_dim, cfg.n_layers
    attn = q4_bytes(cfg.q_dim, h) + 2 * q4_bytes(cfg.kv_dim, h) + q4_bytes(h, cfg.q_dim)
    n_moe = sum(cfg.layer_is_moe(li) for li in range(n))
    router = n_moe * q4_bytes(cfg.n_experts, h)
    ffn = n_moe * cfg.top_k * (2 * q4_bytes(cfg.moe_intermediate, h) + q4_bytes(h, cfg.moe_intermediate)) + \
        (n - n_moe) * (2 * q4_bytes(cfg.intermediate, h) + q4_bytes(h, cfg.intermediate))
    norms = (2 * h + 2 * hd) * 4
    esz = 1 if kv == "q8" else 4
    kv_bytes = (ctx + 1) * cfg.n_kv_heads * (2 * hd * esz + 2 * 4)
    out = dict(attention=attn * n, router=router, experts=ffn, norms=norms * n + h * 4, kv=kv_bytes * n,
               lm_head=q4_bytes(cfg.vocab, h), embed_row=q4_bytes(1, h))
    out["total"] = (attn + norms + kv_bytes) * n + router + ffn + out["lm_head"] + out["embed_row"] + h * 4
    return out


def copy_bandwidth(rt, nbytes: int = 1 << 30, reps: int = 10) -> dict:
    """Device-to-device cuMemcpy of nbytes, reps times, CUDA events. Returns GB/s counting the
    bytes read plus written (2 * nbytes per copy), the figure a read-only kernel can reach."""
    cuda = rt.cuda
    with rt.active():
        a, b = cuda.mem_alloc(nbytes), cuda.mem_alloc(nbytes)
        cuda.memset_d8(a, 1, nbytes)
        cuda.memcpy_dtod(b, a, nbytes)
        e0, e1 = cuda.Event(), cuda.Event()
        e0.record()
        for _ in range(reps):
            cuda.memcpy_dtod(b, a, nbytes)
        e1.record()
        e1.synchronize()
        ms = e0.time_till(e1) / reps
        del a, b
    return {"bytes": nbytes, "ms_per_copy": ms, "gbps_rw": 2 * nbytes / (ms * 1e-3) / 1e9,
            "gbps_copied": nbytes / (ms * 1e-3) / 1e9}


def prefill(b, tokens: np.ndarray, chunk: int = 256) -> float:
    """GPU prefill of len(tokens) positions from 0, no hashing; seconds."""
    cuda = b.rt.cuda
    t0 = time.perf_counter()
    with b.rt.active():
        for p0 in range(0, len(tokens), chunk):
            lay, T = b.prepare(tokens[p0:p0 + chunk], p0, None)
            b.forward(lay, T, p0)
        cuda.Context.synchronize()
    return time.perf_counter() - t0


def _timed_step(b, tok: int, pos: int, graph: bool, hashing: bool):
    """(seconds, StepOut) of one M=1 CudaBackend.step, through the graph or not, hashing or not."""
    b.use_graph, b.hashing = graph, hashing
    t0 = time.perf_counter()
    o = b.step(np.array([tok]), pos, raw=False)
    return time.perf_counter() - t0, o


def decode_bench(model, ctx: int = 1024, steps: int = 20, warm: int = 3, direct: bool = True,
                 log=print, options=None) -> dict:
    from ..backends.cuda import make_cuda_backend
    from ..backends.toggles import TOGGLES

    cfg = model.cfg
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cfg.vocab, ctx).astype(np.int32)
    out = {}
    for label, exact in (("fast", frozenset()), ("exact", frozenset(TOGGLES))):
        b = make_cuda_backend(model, exact=exact, graph=True, options=options)
        b.reset(ctx + steps + warm + 8)
        r = {"prefill_s": prefill(b, prompt)}
        cuda = b.rt.cuda
        tok = int(prompt[-1])

        t0 = time.perf_counter()
        for hashing in (True, False):  # capture both graphs (the first M=1 step of each)
            _timed_step(b, tok, ctx, True, hashing)
        r["capture_s"] = time.perf_counter() - t0
        if set(b._graphs) != {True, False}:
            raise RuntimeError(f"decode graphs not captured: {b.graph_status}")
        g, g0 = b._graphs[True], b._graphs[False]
        r["graph_nodes"], r["graph_nodes_nohash"] = g.n_nodes, g0.n_nodes
        full, nohash, dirs, dirs0, gpu = [], [], [], [], []
        for i in range(steps + warm):
            pos = ctx + i  # the same token at each position, five ways; each writes the same KV row
            dt, o = _timed_step(b, tok, pos, True, True)
            full.append(dt)
            nohash.append(_timed_step(b, tok, pos, True, False)[0])
            if direct:
                dirs.append(_timed_step(b, tok, pos, False, True)[0])
                dirs0.append(_timed_step(b, tok, pos, False, False)[0])
            with b.rt.active():  # device time of one replay (CUDA events on the graph's stream)
                e0, e1 = cuda.Event(), cuda.Event()
                e0.record(g.stream)
                g.launch(tok, pos)
                e1.record(g.stream)
                e1.synchronize()
                gpu.append(e0.time_till(e1) * 1e-3)
            logits = o.logits[0]
            tok = int(np.argmax(logits))
        b.use_graph, b.hashing = True, True
        med = lambda xs: float(np.median(xs[warm:])) * 1e3 if xs else None  # noqa: E731
        r.update(graph_ms=med(full), graph_nohash_ms=med(nohash), direct_ms=med(dirs), direct_nohash_ms=med(dirs0),
                 graph_gpu_ms=med(gpu), keys_per_token=len(o.hashes[0]),
                 finite_logits=bool(np.isfinite(logits).all()))
        r["hash_overhead"] = (r["graph_ms"] - r["graph_nohash_ms"]) / r["graph_ms"]
        if direct:
            r["launch_share"] = 1 - r["graph_ms"] / r["direct_ms"]
            r["direct_hash_overhead"] = (r["direct_ms"] - r["direct_nohash_ms"]) / r["direct_ms"]
        log(f"  {label}: graph {r['graph_ms']:.3f} ms/token (no hashing {r['graph_nohash_ms']:.3f}, device"
            f" {r['graph_gpu_ms']:.3f}), direct launches {r['direct_ms'] if direct else float('nan'):.3f}"
            f" (no hashing {r['direct_nohash_ms'] if direct else float('nan'):.3f});"
            f" {g.n_nodes} graph nodes; prefill {r['prefill_s']:.2f} s, capture {r['capture_s']:.2f} s")
        out[label] = r
        del b, g, g0
    out["exact_over_fast"] = out["exact"]["graph_ms"] / out["fast"]["graph_ms"]
    return out


# ------------------------------------------------------------ batch-verify over many positions


def _ndiff(a: np.ndarray, b: np.ndarray) -> tuple[int, int | None]:
    d = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    return int(d.size), (int(d[0]) if d.size else None)


def batch_verify(model, exact: frozenset, n_pos: int = 64, widths=range(2, 9), n_prompt: int = 16,
                 log=print) -> dict:
    """M=1 decode of n_pos positions (the first n_prompt tokens fixed, then greedy), then for
    each width M a fresh backend steps the same tokens M columns at a time (windows 0..M-1,
    M..2M-1, ...; the last one shorter). Every column's logits are compared bit by bit with
    the M=1 step of its position, and its keys' hashes. Returns per width: positions with a
    difference, total differing logits, per column index j the differing logits summed over
    the windows, and the first differing key."""
    from ..backends.cuda import make_cuda_backend
    from ..session.inputs import default_prompt

    vocab = model.cfg.vocab
    b = make_cuda_backend(model, exact=exact)
    b.reset(n_pos)
    toks = list(default_prompt(vocab, n_prompt))
    ref_logits, ref_hashes = [], []
    for t in range(n_pos):
        out = b.step(np.array([toks[t]]), t, raw=False)
        ref_logits.append(out.logits[0].copy())
        ref_hashes.append(out.hashes[0])
        if t + 1 >= len(toks):
            toks.append(int(np.argmax(out.logits[0])))
    toks = np.array(toks[:n_pos], np.int32)
    res = {"tokens": toks.tolist(), "widths": {}}
    for M in widths:
        b = make_cuda_backend(model, exact=exact)
        b.reset(n_pos)
        per_col, keys_col = [0] * M, [0] * M
        cols_diff, total, first_key, key_diffs = 0, 0, None, 0
        for p0 in range(0, n_pos, M):
            out = b.step(toks[p0:p0 + M], p0, raw=False)
            for j in range(out.logits.shape[0]):
                t = p0 + j
                nd, _ = _ndiff(ref_logits[t], out.logits[j])
                kd = [k for k, v in ref_hashes[t].items() if out.hashes[j][k] != v]
                per_col[j] += nd
                keys_col[j] += len(kd)
                total += nd
                key_diffs += len(kd)
                if nd or kd:
                    cols_diff += 1
                    if first_key is None:
                        first_key = kd[0] if kd else "logits only"
        res["widths"][M] = dict(columns_with_diff=cols_diff, ndiff_total=total, ndiff_per_column=per_col,
                                key_diffs=key_diffs, key_diffs_per_column=keys_col, first_diff_key=first_key)
        log(f"    M={M}: {cols_diff}/{n_pos} positions differ; logits ndiff per column index {per_col};"
            f" differing keys per column index {keys_col}; first differing key {first_key}")
    return res


def graph_equals_direct(model, exact: frozenset, n_pos: int = 16) -> dict:
    """The graph replay's logits and hashes vs direct M=1 steps, positions 0..n_pos-1."""
    from ..backends.cuda import make_cuda_backend
    from ..backends.cuda.graph import DecodeGraph
    from ..session.inputs import default_prompt

    vocab = model.cfg.vocab
    toks = default_prompt(vocab, n_pos)
    a, b = make_cuda_backend(model, exact=exact, graph=False), make_cuda_backend(model, exact=exact)
    a.reset(n_pos)
    b.reset(n_pos)
    g = DecodeGraph(b, hashing=True)
    bad_logits = bad_keys = 0
    for t in range(n_pos):
        out = a.step(np.array([toks[t]]), t, raw=False)
        logits, hashes = g.step(toks[t], t)
        bad_logits += _ndiff(out.logits[0], logits)[0]
        hv = dict(zip(g.keys(t), hashes.tolist()))
        bad_keys += sum(1 for k, v in out.hashes[0].items() if hv.get(k) != v)
    g.close()
    return {"positions": n_pos, "logits_ndiff": bad_logits, "key_diffs": bad_keys,
            "keys": n_pos * len(g.keys(0)), "graph_nodes": g.n_nodes}


def kernel_profile(model, exact: frozenset, ctx: int = 1024, reps: int = 2) -> dict:
    """Device time of every kernel of one M=1 step at context ctx (a CUDA event pair around each
    launch, so kernels do not overlap here): {kernel name: (launches a step, ms a step)}, the
    sum, and the step's wall time with the events in."""
    from ..backends.cuda import backend as be
    from ..backends.cuda import launches, make_cuda_backend

    cfg = model.cfg
    b = make_cuda_backend(model, exact=exact)
    b.reset(ctx + reps + 2)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, ctx).astype(np.int32)
    prefill(b, prompt)
    cuda = b.rt.cuda
    orig = launches.launch  # the step's launches (launches.py) and the hash launches (backend.py)
    records: list = []

    def timed(k, grid, block, stream, *args, shared: int = 0, launcher=None):
        e0, e1 = cuda.Event(), cuda.Event()
        e0.record(stream)
        orig(k, grid, block, stream, *args, shared=shared, launcher=launcher)
        e1.record(stream)
        records.append((b.rt.kernel_names.get(id(k), ("", getattr(k, "name", "?")))[1], e0, e1))

    be.launch = launches.launch = timed
    try:
        for r in range(reps):
            records.clear()
            with b.rt.active():
                lay, T = b.prepare(np.array([int(prompt[-1])], np.int32), ctx + r, None)
                b.forward(lay, T, ctx + r, hash_body=True)
                b.copy_logits(lay, T)
                b.hash(lay, T)
                cuda.Context.synchronize()
                per: dict[str, list] = {}
                for name, e0, e1 in records:
                    v = per.setdefault(name, [0, 0.0])
                    v[0] += 1
                    v[1] += e0.time_till(e1)
    finally:
        be.launch = launches.launch = orig
    total = sum(v[1] for v in per.values())
    return {"kernels": dict(sorted(per.items(), key=lambda kv: -kv[1][1])), "sum_ms": total,
            "launches": sum(v[0] for v in per.values())}
