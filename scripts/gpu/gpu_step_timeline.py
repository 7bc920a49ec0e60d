"""Where a decode step's time goes inside the CUDA graph: each kernel's share of the critical path.

ncu (gpu_ncu_kernel_times.py) serializes the kernels and holds the clock at its base, so its
figures carry every launch's ramp and none of the overlap that programmatic dependent launch
buys. Here the kernels are built with -DKESTREL_STAMPS (kernels/common.cuh kestrel_stamp):
thread 0 of block (0,0,0) of every kernel writes the GPU's global timer once its pdl_wait()
returns, i.e. once everything before it has finished. The main stream's kernels run one after
another, so the time from one kernel's stamp to the next one's is that kernel's share of the
step as the graph replays it: its own work after the wait, its end and the next one's start.
The stamps are matched to the launches the capture recorded (kernel name, grid, block) in order;
those of the hash stream, which overlap, are listed apart.

    python3 scripts/gpu/gpu_step_timeline.py [--exact none|all] [--layers 48] [--ctx 1024] [--reps 20]

It prints the global timer's resolution (the smallest step between stamps), the replay's device
time with the stamps written and without (their cost), and the share a step of each kernel name:
launches a step, microseconds a launch (median over layers and replays) and in all.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CAP = 8192  # kernels/common.cuh KESTREL_STAMP_CAP


def shape(grid, block) -> int:
    """A launch's grid and block packed as kernels/common.cuh kestrel_stamp packs them."""
    g = tuple(grid) + (1,) * (3 - len(grid))
    return g[0] | g[1] << 16 | g[2] << 32 | tuple(block)[0] << 48


def labels(launches: list[tuple[str, int]]) -> list[str]:
    """Each launch's row in the table: its kernel's name, with its grid where the same kernel runs
    with several grids in a step (gemv_q4: o_proj, the router, lm_head)."""
    grids: dict[str, set[int]] = defaultdict(set)
    for name, sh in launches:
        grids[name].add(sh & ((1 << 48) - 1))
    out = []
    for name, sh in launches:
        if len(grids[name]) == 1:
            out.append(name)
        else:
            out.append(f"{name} grid {sh & 0xFFFF}x{sh >> 16 & 0xFFFF}x{sh >> 32 & 0xFFFF}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exact", default="none", help="none, all, or toggles joined by commas")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    from kestrel_tui.backends.cuda import runtime
    runtime.NVCC_OPTIONS.append("-DKESTREL_STAMPS")  # before the runtime compiles the modules
    from kestrel_tui.backends.cuda import backend as cuda_backend, launches
    from gpu_ncu_kernel_times import prefilled_backend

    ctx = args.ctx
    b, tok = prefilled_backend(args.exact, args.layers, ctx, spare=args.reps + 8)
    rt, cuda = b.rt, b.rt.cuda
    recorded: list[tuple[str, int, int]] = []  # (kernel, shape, stream) in the order queued
    plain_launch = launches.launch

    def recording_launch(k, grid, block, stream, *a, **kw):
        name = rt.kernel_names.get(id(k), ("?", "?"))[1]
        recorded.append((name, shape(grid, block), id(stream)))
        return plain_launch(k, grid, block, stream, *a, **kw)

    launches.launch = cuda_backend.launch = recording_launch  # the plan's launches and the hashes'
    try:
        b.step(np.array([tok]), ctx, raw=False)  # the capture
    finally:
        launches.launch = cuda_backend.launch = plain_launch
    g = b._graph
    print(f"{rt.name}; {b.graph_status}; {len(recorded)} launches recorded", flush=True)
    streams = defaultdict(int)
    for _, _, s in recorded:
        streams[s] += 1
    main_stream = max(streams, key=streams.get)
    main = [(n, sh) for n, sh, s in recorded if s == main_stream]
    rows = labels(main)
    others = {sh: n for n, sh, s in recorded if s != main_stream}

    with rt.active():
        buf = cuda.mem_alloc(8 * (1 + 2 * CAP))
        # the pointer in every loaded copy of every module: PyCUDA's, and the PDL launcher's own
        # (pdl.py loads the same cubins again for cuLaunchKernelEx)
        ptrs = [mod.get_global("kestrel_stamps")[0] for mod in rt.modules.values()]
        if rt.pdl is not None:
            lib = ctypes.CDLL("libcuda.so.1")
            for handle in rt.pdl.modules.values():
                dptr, size = ctypes.c_uint64(), ctypes.c_size_t()
                if lib.cuModuleGetGlobal_v2(ctypes.byref(dptr), ctypes.byref(size), handle, b"kestrel_stamps"):
                    sys.exit("cuModuleGetGlobal(kestrel_stamps) failed in the PDL launcher's modules")
                ptrs.append(dptr.value)

        def stamps_to(addr: int) -> None:
            for p in ptrs:
                cuda.memcpy_htod(p, np.array([addr], dtype=np.uint64))

        start, end = cuda.Event(), cuda.Event()

        def replay_ms(pos: int) -> float:
            start.record(g.stream)
            g.launch(tok, pos)
            end.record(g.stream)
            end.synchronize()
            return start.time_till(end)

        pos = ctx + 1
        timed = {"on": [], "off": []}
        runs = []
        for i in range(args.reps):
            for mode in ("off", "on"):
                stamps_to(int(buf) if mode == "on" else 0)
                cuda.memset_d32(buf, 0, 2)
                timed[mode].append(replay_ms(pos))
                if mode == "on":
                    raw = np.empty(1 + 2 * CAP, dtype=np.uint64)
                    cuda.memcpy_dtoh(raw, buf)
                    n = int(min(raw[0], CAP))
                    runs.append(sorted(zip(raw[1:1 + 2 * n:2].tolist(), raw[2:2 + 2 * n:2].tolist())))
        stamps_to(0)

    print(f"replay device time (events), median of {args.reps}: stamps off {statistics.median(timed['off']):.3f} ms,"
          f" on {statistics.median(timed['on']):.3f} ms")
    steps = sorted({t2 - t1 for run in runs for (t1, _), (t2, _) in zip(run, run[1:]) if t2 > t1})
    print(f"global timer: smallest step between stamps {steps[0] if steps else '?'} ns")

    share = defaultdict(list)  # kernel -> shares (ns), every launch of every replay
    hash_stamps = defaultdict(int)
    spans = []
    for run in runs:
        j, times = 0, []
        for t, sh in run:
            if j < len(main) and sh == main[j][1]:
                times.append((t, rows[j]))
                j += 1
            else:
                hash_stamps[others.get(sh, "?")] += 1
        if j != len(main):
            print(f"a replay matched {j} of {len(main)} main-stream launches; left out")
            continue
        spans.append(times[-1][0] - times[0][0])
        for (t1, name), (t2, _) in zip(times, times[1:]):
            share[name].append(t2 - t1)
    if not spans:
        sys.exit("no replay's stamps matched the recorded launches")
    per_step = len(spans)
    print(f"first to last main-stream stamp: {statistics.median(spans) / 1e3:.1f} us (median of {per_step} replays);"
          f" stamps of other streams: {dict(hash_stamps)}")
    print(f"{'kernel':44} {'a step':>7} {'us each':>8} {'us a step':>10} {'share':>6}  (us each: the median)")
    total = sum(sum(v) for v in share.values()) / per_step
    for name, v in sorted(share.items(), key=lambda kv: -sum(kv[1])):
        each = statistics.median(v) / 1e3
        step = sum(v) / per_step / 1e3
        print(f"{name:44} {len(v) // per_step:7d} {each:8.2f} {step:10.1f} {100 * step * 1e3 / total:5.1f}%")


if __name__ == "__main__":
    main()
