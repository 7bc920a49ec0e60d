"""Every float32 input through the C (and CUDA) replicas of expf, cosf and sinf, bit for bit against
the numpy replicas that define them (kestrel_tui/numerics/transcend.py, docs/numerics.md T1, T2);
results/replica-exhaustive.md records the runs.

    python scripts/replica_exhaustive.py --json all.json                  # 3 x 2^32 inputs
    python scripts/replica_exhaustive.py --functions expf --stop 2**31 --json a.json
    python scripts/replica_exhaustive.py --functions expf --start 2**31 --json b.json
    python scripts/replica_exhaustive.py --merge a.json b.json --json expf.json
    python scripts/replica_exhaustive.py --stride 97 --workers 2          # every exponent, sampled
    python scripts/replica_exhaustive.py --cuda ...                       # the device functions too
    python scripts/replica_exhaustive.py --c-base ...                     # and the C build for any x86-64

The bit patterns [--start, --stop) are walked in chunks of 2^24 over --workers processes; each
chunk goes through the numpy replica (in slices of 2^20, so a worker holds a few hundred MB) and
the C replica (kestrel_tui/cref's kc_expf/kc_cosf/kc_sinf); with --cuda this process also runs the
chunk through the device functions (kernels/common.cuh, selfcheck.device_eval) against the same
numpy bits. The C replica is the one `pip install` built; where none is built, the script builds
kestrel_tui/cref into a temporary folder with setup.py's own flags (needs a C compiler and
setuptools), or takes --lib.

Each difference falls in one of three classes (docs/numerics.md T1, T2):

  differ       bits that the contract fixes: every input of expf (a NaN keeps its sign and
               payload on the CPU, T1), every |x| of cosf/sinf below the Payne-Hanek thresholds,
               and a NaN where a NaN is due (cosf/sinf of inf or NaN, expf of NaN on the GPU);
               any of these makes the exit status 1;
  nan_payload  both outputs NaN with different bits where the contract promises a NaN but not
               its bits: cosf/sinf of inf/NaN, expf of NaN on the GPU (its canonical NaN);
  fallback     cosf/sinf at finite |x| >= 3.37e9 / 16779436: not replicated, each side rounds
               its own double cos/sin (numpy's, libm's, the device's) to float32.

The C replicas are built twice (transcend.c: for any x86-64, and for AVX2 + FMA where the CPU has
them); side "c" is the build this CPU runs (the JSON's c_build says which), and --c-base adds side
"c_base", the any-x86-64 build forced on the same inputs.

--json writes, per function and side (c, c_base, cuda): the count of each class and its first 100
inputs as [input bits, numpy bits, other bits], plus the inputs covered, the bit ranges, the
seconds (wall, and the workers' CPU: the rate that scales with cores) and the workers. --merge
adds partial files up (ranges must not overlap) so that a run too long for one sitting can be
split by function or by range. Progress goes to stderr; the summary table to stdout.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kestrel_tui import cref  # noqa: E402
from kestrel_tui.errors import UsageError  # noqa: E402
from kestrel_tui.numerics import transcend  # noqa: E402

FUNCTIONS = ("expf", "cosf", "sinf")
TOTAL = 1 << 32
CHUNK = 1 << 24  # the unit of work, progress and resumption
SLICE = 1 << 20  # what the numpy replica evaluates at once (its float64 temporaries: ~40 x 8 MB)
KEEP = 100  # differing inputs listed per class
CLASSES = ("differ", "nan_payload", "fallback")
# |x| bits from which the UCRT reduces by Payne-Hanek, which no replica follows (transcend.py)
HUGE = {"expf": None, "cosf": transcend._AU_HUGE["cos"], "sinf": transcend._AU_HUGE["sin"]}
INF_BITS = 0x7F800000


# ---------------------------------------------------------------------------------- one chunk


def bit_patterns(lo: int, hi: int, stride: int = 1, origin: int = 0) -> np.ndarray:
    """The float32 inputs origin + k*stride that lie in [lo, hi), as uint32 bit patterns."""
    first = lo + (origin - lo) % stride
    return np.arange(first, hi, stride, dtype=np.uint64).astype(np.uint32)


def numpy_replica(fn: str, bits: np.ndarray) -> np.ndarray:
    """The contract's output bits, evaluated a slice at a time (the replica is vectorised; the
    slices only bound its memory)."""
    out = np.empty_like(bits)
    f = getattr(transcend, fn)
    with np.errstate(all="ignore"):  # signalling NaNs and overflow to inf are inputs here
        for i in range(0, bits.size, SLICE):
            out[i:i + SLICE] = f(bits[i:i + SLICE].view(np.float32)).view(np.uint32)
    return out


SIDES = ("c", "c_base", "cuda")


def c_replica(lib, fn: str, base: bool = False):
    """The compiled reference's batch function as bits -> bits; ``base``: its any-x86-64 build (the SIMD
    level at 0 while it runs, which turns kc_v3 off; a worker runs one call at a time)."""
    kc = getattr(lib, f"kc_{fn}")

    def run(bits: np.ndarray) -> np.ndarray:
        bits = np.ascontiguousarray(bits)
        out = np.empty_like(bits)
        top = lib.kc_gemv_simd(-1)
        if base:
            lib.kc_gemv_simd(0)
        try:
            kc(bits.ctypes.data, out.ctypes.data, bits.size)
        finally:
            lib.kc_gemv_simd(top)
        return out
    return run


def c_build(lib) -> str:
    return "AVX2 + FMA (KC_V3)" if lib.kc_v3() else "any x86-64"


def empty_tallies() -> dict:
    return {c: {"count": 0, "first": []} for c in CLASSES}


def classify(fn: str, bits: np.ndarray, want: np.ndarray, got: np.ndarray, nan_bits_promised: bool) -> dict:
    """Each differing input sorted into its class (module docstring): {class: {count, first}}."""
    tallies = empty_tallies()
    diff = np.flatnonzero(want != got)
    if diff.size == 0:
        return tallies
    x, w, g = bits[diff], want[diff], got[diff]
    both_nan = np.isnan(w.view(np.float32)) & np.isnan(g.view(np.float32))
    au = x & np.uint32(0x7FFFFFFF)
    if HUGE[fn] is None:
        payload = both_nan & (not nan_bits_promised)
        fallback = np.zeros(diff.size, bool)
    else:  # cosf/sinf promise a NaN for inf/NaN, never its bits
        payload = both_nan & (au >= INF_BITS)
        fallback = (au >= HUGE[fn]) & (au < INF_BITS)
    for name, mask in (("differ", ~payload & ~fallback), ("nan_payload", payload), ("fallback", fallback)):
        k = np.flatnonzero(mask)
        tallies[name] = {"count": int(k.size),
                         "first": [[int(x[i]), int(w[i]), int(g[i])] for i in k[:KEEP]]}
    return tallies


def check_chunk(fn: str, bits: np.ndarray, c_eval) -> tuple[dict, np.ndarray]:
    """The numpy replica against c_eval (bits -> bits) on these inputs: (tallies, numpy's bits)."""
    want = numpy_replica(fn, bits)
    return classify(fn, bits, want, c_eval(bits), nan_bits_promised=True), want


def fallback_inputs(fn: str, bits: np.ndarray) -> int:
    """How many of these inputs lie in the range no replica follows (finite, Payne-Hanek)."""
    if HUGE[fn] is None:
        return 0
    au = bits & np.uint32(0x7FFFFFFF)
    return int(np.count_nonzero((au >= HUGE[fn]) & (au < INF_BITS)))


def merge_tallies(parts) -> dict:
    out = empty_tallies()
    for t in parts:
        for c in CLASSES:
            out[c]["count"] += t[c]["count"]
            out[c]["first"].extend(t[c]["first"])
    for c in CLASSES:
        out[c]["first"] = sorted(out[c]["first"])[:KEEP]
    return out


# ------------------------------------------------------------------------------ the workers

_C_EVAL: dict = {}


def _init_worker(lib_path: str) -> None:
    lib = cref.load(lib_path)
    _C_EVAL.update({fn: c_replica(lib, fn) for fn in FUNCTIONS})
    _C_EVAL.update({(fn, "base"): c_replica(lib, fn, base=True) for fn in FUNCTIONS})


def _work(task):
    fn, lo, hi, stride, origin, keep_numpy, with_base = task
    t0 = time.process_time()
    bits = bit_patterns(lo, hi, stride, origin)
    tallies, want = check_chunk(fn, bits, _C_EVAL[fn])
    out = {"lo": lo, "hi": hi, "inputs": int(bits.size), "fallback_inputs": fallback_inputs(fn, bits),
           "c": tallies, "numpy": want if keep_numpy else None}
    if with_base:
        out["c_base"] = classify(fn, bits, want, _C_EVAL[fn, "base"](bits), nan_bits_promised=True)
    out["cpu_seconds"] = time.process_time() - t0
    return out


def chunks(start: int, stop: int) -> list[tuple[int, int]]:
    """[start, stop) cut at the multiples of CHUNK, so that split runs meet at chunk edges."""
    edges = [start] + list(range((start // CHUNK + 1) * CHUNK, stop, CHUNK)) + [stop]
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


def _device(rt):
    from kestrel_tui.backends.cuda.selfcheck import device_eval

    def run(fn: str, bits: np.ndarray) -> np.ndarray:
        return device_eval(rt, f"eval_{fn}_ucrt", bits.view(np.float32)).view(np.uint32)
    return run


def _progress(fn: str, i: int, n: int, done: int, t0: float) -> None:
    el = time.perf_counter() - t0
    rate = done / el if el > 0 else 0.0
    eta = el * (n - i) / i
    print(f"{fn}: chunk {i}/{n} · {rate / 1e6:.1f} M inputs/s · {el:.0f} s · ETA {eta:.0f} s",
          file=sys.stderr, flush=True)


def run_function(fn: str, args, pool, device) -> dict:
    spans = chunks(args.start, args.stop)
    tasks = [(fn, lo, hi, args.stride, args.start, device is not None, args.c_base) for lo, hi in spans]
    results = pool.imap_unordered(_work, tasks) if pool else map(_work, tasks)
    t0 = time.perf_counter()
    last = t0
    c_parts, base_parts, cuda_parts, inputs, fallback, cpu = [], [], [], 0, 0, 0.0
    for i, r in enumerate(results, 1):
        inputs += r["inputs"]
        cpu += r["cpu_seconds"]
        fallback += r["fallback_inputs"]
        c_parts.append(r["c"])
        if "c_base" in r:
            base_parts.append(r["c_base"])
        if device is not None:
            bits = bit_patterns(r["lo"], r["hi"], args.stride, args.start)
            cuda_parts.append(classify(fn, bits, r["numpy"], device(fn, bits), nan_bits_promised=False))
        now = time.perf_counter()
        if now - last >= 5 or i == len(tasks):
            _progress(fn, i, len(tasks), inputs, t0)
            last = now
    record = {"inputs": inputs, "fallback_inputs": fallback, "ranges": [[args.start, args.stop]],
              "stride": args.stride, "seconds": round(time.perf_counter() - t0, 1),
              "cpu_seconds": round(cpu, 1), "workers": args.workers, "c": merge_tallies(c_parts)}
    if base_parts:
        record["c_base"] = merge_tallies(base_parts)
    if device is not None:
        record["cuda"] = merge_tallies(cuda_parts)
    return record


# ------------------------------------------------------------------------- the C library


def find_lib(path: str | None, tmp: str) -> str:
    """The compiled reference to check: --lib, the built one, or one built now into tmp."""
    if path:
        cref.load(path)  # Unavailable (a UsageError-like one-liner) if it is not a build of cref
        return path
    built = cref.built_path()
    if built is not None:
        return str(built)
    print("the compiled reference is not built: building kestrel_tui/cref (setup.py build_ext)",
          file=sys.stderr, flush=True)
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", f"{tmp}/lib", "--build-temp", f"{tmp}/obj"]
    log = Path(tmp) / "build.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    found = sorted(Path(tmp, "lib").rglob("_kcref*"))
    if rc != 0 or not found:
        last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise UsageError(f"could not build the compiled reference ({last[0][:160]}); install a C compiler"
                         " (cc, with OpenMP) and setuptools, or pass --lib with a build of kestrel_tui/cref")
    return str(found[0])


# ------------------------------------------------------------------------------- the files


def machine() -> str:
    try:
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1).strip()
    except (OSError, AttributeError):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores"


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def merge_files(paths: list[str]) -> dict:
    """Partial runs added up per function; ranges must not overlap and strides must agree."""
    docs = []
    for p in paths:
        try:
            docs.append((p, json.loads(Path(p).read_text())))
        except (OSError, ValueError) as e:
            raise UsageError(f"--merge: cannot read {p} ({e}); give the --json files of earlier runs")
    out = {"what": f"{len(docs)} runs added up"}
    for k in ("date", "machine", "c_build", "gpu", "commit", "numpy", "python"):  # each value the parts had
        out[k] = list(dict.fromkeys(d.get(k) for _, d in docs))
    out["functions"] = {}
    for fn in FUNCTIONS:
        parts = [(p, d["functions"][fn]) for p, d in docs if fn in d.get("functions", {})]
        if not parts:
            continue
        strides = {r["stride"] for _, r in parts}
        sides = {tuple(s for s in SIDES if s in r) for _, r in parts}
        if len(strides) > 1 or len(sides) > 1:
            raise UsageError(f"--merge: the {fn} parts differ in --stride, --cuda or --c-base; merge runs made"
                             " alike")
        ranges = sorted((lo, hi, p) for p, r in parts for lo, hi in r["ranges"])
        for (a_lo, a_hi, a), (b_lo, b_hi, b) in zip(ranges, ranges[1:]):
            if b_lo < a_hi:
                raise UsageError(f"--merge: {a} and {b} both cover {fn} [{b_lo:#x}, {min(a_hi, b_hi):#x});"
                                 " merge runs of disjoint ranges")
        rec = {"inputs": sum(r["inputs"] for _, r in parts),
               "fallback_inputs": sum(r["fallback_inputs"] for _, r in parts),
               "ranges": [[lo, hi] for lo, hi, _ in ranges], "stride": strides.pop(),
               "seconds": round(sum(r["seconds"] for _, r in parts), 1),
               "cpu_seconds": round(sum(r["cpu_seconds"] for _, r in parts), 1),
               "workers": sorted({r["workers"] for _, r in parts})}
        for side in sides.pop():
            rec[side] = merge_tallies(r[side] for _, r in parts)
        out["functions"][fn] = rec
    return out


def covers_all(rec: dict) -> bool:
    pos = 0
    for lo, hi in sorted(rec["ranges"]):
        if lo > pos:
            return False
        pos = max(pos, hi)
    return pos >= TOTAL and rec["stride"] == 1


def summary(doc: dict) -> tuple[str, int]:
    """The figures as a Markdown table, and the count of contract differences."""
    rows = ["| function | side | inputs covered | all 2^32 | differ | nan_payload | fallback (of inputs) "
            "| seconds | workers | M inputs per worker CPU-second |", "|---|---|---|---|---|---|---|---|---|---|"]
    bad = 0
    for fn, rec in doc["functions"].items():
        for side in SIDES:
            if side not in rec:
                continue
            t = rec[side]
            bad += t["differ"]["count"]
            rows.append(f"| {fn} | {side} | {rec['inputs']:,} | {'yes' if covers_all(rec) else 'no'} "
                        f"| {t['differ']['count']} | {t['nan_payload']['count']} "
                        f"| {t['fallback']['count']} (of {rec['fallback_inputs']:,}) | {rec['seconds']} "
                        f"| {rec['workers']} | {rec['inputs'] / max(rec['cpu_seconds'], 1e-9) / 1e6:.2f} |")
    return "\n".join(rows), bad


# ---------------------------------------------------------------------------------- the CLI


def bit_index(text: str) -> int:
    """0x3f800000, 268435456 or 2**28."""
    m = re.fullmatch(r"\s*(\w+)\s*\*\*\s*(\d+)\s*", text)
    try:
        v = int(m.group(1), 0) ** int(m.group(2)) if m else int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a bit index (write 0x3f800000, 268435456 or 2**28)")
    if not 0 <= v <= TOTAL:
        raise argparse.ArgumentTypeError(f"{text} is outside [0, 2**32]")
    return v


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--functions", default=",".join(FUNCTIONS), help="comma-separated, of expf,cosf,sinf")
    ap.add_argument("--start", type=bit_index, default=0, help="first bit pattern (default 0)")
    ap.add_argument("--stop", type=bit_index, default=TOTAL, help="end of the bit range, exclusive (default 2**32)")
    ap.add_argument("--stride", type=int, default=1, help="every k-th bit pattern only (a sample; default 1: all)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    ap.add_argument("--cuda", action="store_true", help="the CUDA device functions against numpy too (PyCUDA)")
    ap.add_argument("--c-base", action="store_true",
                    help="the C replicas' any-x86-64 build too, beside the one this CPU runs")
    ap.add_argument("--lib", help="a build of kestrel_tui/cref (default: the installed one, else built now)")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="add up the --json files of partial runs")
    args = ap.parse_args(argv)
    names = [f.strip() for f in args.functions.split(",") if f.strip()]
    unknown = [f for f in names if f not in FUNCTIONS]
    if unknown or not names:
        ap.error(f"--functions: {', '.join(unknown) or 'none given'}; choose from {','.join(FUNCTIONS)}")
    args.functions = names
    if args.start >= args.stop:
        ap.error(f"--start {args.start:#x} is not below --stop {args.stop:#x}")
    if args.stride < 1 or args.workers < 1:
        ap.error("--stride and --workers must be at least 1")
    return args


def run(args) -> dict:
    doc = {"what": "numpy replicas against the C (and CUDA) replicas, bit for bit",
           "date": date.today().isoformat(), "machine": machine(), "gpu": None, "commit": commit(),
           "numpy": np.__version__, "python": platform.python_version(), "functions": {}}
    with tempfile.TemporaryDirectory(prefix="kcref-") as tmp:
        lib_path = find_lib(args.lib, tmp)
        _init_worker(lib_path)  # here too: the --workers 1 path, and a bad build fails before the pool
        doc["c_build"] = c_build(cref.load(lib_path))
        pool = None
        if args.workers > 1:  # before CUDA starts in this process: the workers never touch the device
            pool = multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, (lib_path,))
        try:
            device = None
            if args.cuda:
                from kestrel_tui.backends.cuda.runtime import runtime
                rt = runtime()  # CudaUnavailable (a UsageError) names what is missing
                doc["gpu"] = rt.name
                device = _device(rt)
            for fn in args.functions:
                doc["functions"][fn] = run_function(fn, args, pool, device)
        finally:
            if pool:
                pool.terminate()
                pool.join()
    return doc


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        doc = merge_files(args.merge) if args.merge else run(args)
    except (UsageError, cref.Unavailable) as e:
        print(f"replica_exhaustive: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    table, bad = summary(doc)
    print(table)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
