"""Where a decode step's hashing cost goes: graphs captured with and without each part of it.

The hashing share (kestrel_tui/perf/cuda.py) is (step with hashing - step without) / step with
hashing, both the app's M = 1 step through the decode graph. This times, in one process and
alternating replay by replay, the same step through graphs captured with:

    nohash      no hash launches (the share's baseline)
    all         every key, as the app captures it
    body        the body's keys alone (the logits' hash left out)
    logits      the logits' hash alone (the body's left out)
    body-low    all, the body's hash kernels at the lowest node priority, the rest at the highest
    body-high   all, the body's hash kernels at the highest node priority, the rest at the lowest

(the last two instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY), each as the wall
time of CudaBackend.step and as the device time of a replay (events on the graph's stream). It
also times the host's part of a hashing step: naming the step's keys and filling in their hashes
(the graph step fills in the body's while the replay still runs, the logits' after its sync).

    python3 scripts/gpu/gpu_hash_share.py [--exact none|all] [--layers 48] [--ctx 1024] [--reps 30]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
ATTR_PRIORITY = 8  # CU_LAUNCH_ATTRIBUTE_PRIORITY (= CU_KERNEL_NODE_ATTRIBUTE_PRIORITY)
USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY


class KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def reprioritize(g, body_grid: int, body_prio: int, rest_prio: int) -> int:
    """Give the body hash's kernel nodes (grid body_grid x 1 x 1) body_prio and every other kernel
    node rest_prio, and instantiate g's graph again with per-node priorities; the body nodes found."""
    lib = g.lib
    n = ctypes.c_size_t(0)
    lib.cuGraphGetNodes(g.graph, None, ctypes.byref(n))
    nodes = (ctypes.c_void_p * n.value)()
    lib.cuGraphGetNodes(g.graph, nodes, ctypes.byref(n))
    found = 0
    for node in nodes:
        kind = ctypes.c_int(-1)
        lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value != NODE_KERNEL:
            continue
        kp = KernelParams()
        if lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(kp)):
            sys.exit("cuGraphKernelNodeGetParams_v2 failed")
        body = tuple(kp.grid) == (body_grid, 1, 1)
        found += body
        value = (ctypes.c_int * 16)(body_prio if body else rest_prio)  # CUlaunchAttributeValue, 64 bytes
        if lib.cuGraphKernelNodeSetAttribute(ctypes.c_void_p(node), ctypes.c_int(ATTR_PRIORITY), value):
            sys.exit("cuGraphKernelNodeSetAttribute(PRIORITY) failed")
    lib.cuGraphExecDestroy(g.exec)
    g.exec = ctypes.c_void_p()
    if lib.cuGraphInstantiateWithFlags(ctypes.byref(g.exec), g.graph, ctypes.c_ulonglong(USE_NODE_PRIORITY)):
        sys.exit("cuGraphInstantiateWithFlags(USE_NODE_PRIORITY) failed")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exact", default="none", help="none, all, or toggles joined by commas")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()

    from kestrel_tui.backends.cuda import backend as cuda_backend
    from kestrel_tui.backends.cuda.graph import DecodeGraph
    from gpu_ncu_kernel_times import prefilled_backend

    ctx, warm = args.ctx, 3
    b, tok = prefilled_backend(args.exact, args.layers, ctx, spare=args.reps + warm + 8)
    rt, cuda = b.rt, b.rt.cuda
    with rt.active():
        lay = b._layout(1)
        body_hb, logits_hb = b._hash_tables(lay, "body"), b._hash_tables(lay, "logits")
    plain = cuda_backend.launch_hash

    def capture(hashing: bool, leave_out=None) -> DecodeGraph:
        def launch_hash(rt_, hb, *a, **kw):
            if hb is not leave_out:
                plain(rt_, hb, *a, **kw)
        cuda_backend.launch_hash = launch_hash
        try:
            return DecodeGraph(b, hashing=hashing)
        finally:
            cuda_backend.launch_hash = plain

    graphs = {"nohash": capture(False), "all": capture(True), "body": capture(True, logits_hb),
              "logits": capture(True, body_hb)}
    least, greatest = ctypes.c_int(), ctypes.c_int()
    with rt.active():
        ctypes.CDLL("libcuda.so.1").cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest))
        for name, (bp, rp) in (("body-low", (least.value, greatest.value)),
                               ("body-high", (greatest.value, least.value))):
            g = graphs[name] = capture(True)
            found = reprioritize(g, body_hb["n_seg"], bp, rp)
            print(f"{name}: {found} body hash node(s) at priority {bp}, the rest at {rp}")
    print(f"{rt.name}; {b.graph_status}; graph nodes: " + ", ".join(f"{k} {g.n_nodes}" for k, g in graphs.items()),
          flush=True)

    wall = {k: [] for k in graphs}
    dev = {k: [] for k in graphs}
    with rt.active():
        start, end = cuda.Event(), cuda.Event()
    for i in range(args.reps + warm):
        pos = ctx + i  # the same token at each position, every variant: each writes the same KV row
        for name, g in graphs.items():
            b.hashing = name != "nohash"
            b._graphs[b.hashing] = g
            t0 = time.perf_counter()
            b.step(np.array([tok]), pos, raw=False)
            wall[name].append(time.perf_counter() - t0)
            with rt.active():
                start.record(g.stream)
                g.launch(tok, pos)
                end.record(g.stream)
                end.synchronize()
                dev[name].append(start.time_till(end) * 1e-3)

    def stats(xs):
        xs = sorted(x * 1e3 for x in xs[warm:])
        return statistics.median(xs), xs[0], xs[-1]

    base_w, base_d = stats(wall["nohash"])[0], stats(dev["nohash"])[0]
    print(f"{args.layers} layers, ctx {ctx}, exact {args.exact}; {args.reps} steps each, alternating;"
          " ms, median (min-max); share = (variant - nohash) / variant")
    print(f"{'graph':10} {'step wall':>24} {'share':>7} {'replay device':>24} {'share':>7}")
    for name in graphs:
        w, d = stats(wall[name]), stats(dev[name])
        print(f"{name:10} {w[0]:8.3f} ({w[1]:.3f}-{w[2]:.3f}) {100 * (w[0] - base_w) / w[0]:6.2f}%"
              f" {d[0]:8.3f} ({d[1]:.3f}-{d[2]:.3f}) {100 * (d[0] - base_d) / d[0]:6.2f}%")

    g = graphs["all"]
    names = g.keys(ctx)
    hv = g.hash_host[:lay.n_keys]
    reps = 2000  # host only
    t0 = time.perf_counter()
    for _ in range(reps):
        hashes = dict.fromkeys(names)
    t1 = time.perf_counter()
    for _ in range(reps):
        hashes.update(zip(names, (hv if lay.merge_identity else hv[lay.merge]).tolist()))
    t2 = time.perf_counter()
    print(f"host: the step's dict of {len(names)} keys {(t1 - t0) / reps * 1e6:.1f} us (during the replay), its"
          f" hashes filled in {(t2 - t1) / reps * 1e6:.1f} us (all but the logits' during the replay)")


if __name__ == "__main__":
    main()
