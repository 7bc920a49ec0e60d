"""The reference's speed beside its peers: the same weights, prompt and thread count, runs interleaved.

    python scripts/bench_reference.py --runs 5 --markdown results/reference-bench.md   # the whole page
    python scripts/bench_reference.py [--model FILE.gguf|HF_DIR] [--threads 2] [--prompt 16] [--tokens 64]
    python scripts/bench_reference.py --a3b-layers 4      # Qwen3-30B-A3B's dims, 4 layers

Rows: the compiled reference (kestrel_tui/cref), the numpy reference, HF transformers eager (f32,
the same weights dequantized; skipped without torch) and llama.cpp on the CPU (llama-cpp-python; the
model written as a GGUF of the same q4_0 bytes; in a child process that keeps it loaded between runs).
A run is a fresh cache, the prompt in one step, then --tokens single-token steps: its prefill figure
is ms per prompt position, its decode figure the median ms/token of its steps. The rows take turns
(compiled, llama.cpp, ..., then the next round starting one row later), --runs rounds, so that a
machine shared with other work slows them alike; each figure is the median of the runs with the
fastest and the slowest, and compiled / llama.cpp is the median of the rounds' paired ratios.

llama.cpp computes the logits of every prompt position, as the reference does (its keys include
every position's logits) and as the llama.cpp engine runs it; a second prefill per run with the last
position's logits only is reported beside it.

With --markdown and neither --model nor --a3b-layers, both shapes of results/reference-bench.md are
run and the page is written whole: date, machine, commit, versions, command, figures.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("compiled", "llama", "numpy", "hf")
LABELS = {"compiled": "kestrel compiled", "numpy": "kestrel numpy", "hf": "HF transformers eager (f32)",
          "llama": "llama.cpp CPU"}


# ---------------------------------------------------------------------------------------------- llama.cpp child

def llama_child(path: str, threads: int, n_ctx: int, n_batch: int) -> None:
    """In the child: load once, then one run per stdin line `PROMPT_CSV N_TOKENS`, one JSON line each."""
    import llama_cpp as L  # first, before numpy (engines/child_main.py says why)

    L.llama_backend_init()
    quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *a: None)
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = False  # q4_0 repack segfaults on AMX CPUs (results/llamacpp-findings.md)
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(n_batch, 0, 1)

    def decode(tokens: list[int], pos0: int, every_logit: bool) -> float:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = t, pos0 + i, 1, 0
            batch.logits[i] = every_logit or i == len(tokens) - 1
        t0 = time.perf_counter()
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return time.perf_counter() - t0

    def clear():
        L.llama_memory_clear(L.llama_get_memory(ctx), True)

    print("ready", flush=True)
    for line in sys.stdin:
        csv, n = line.split()
        prompt = [int(t) for t in csv.split(",")]
        clear()
        last_only = decode(prompt, 0, False)
        clear()
        prefill = decode(prompt, 0, True)
        steps = [decode([step_token(i)], len(prompt) + i, False) for i in range(int(n))]
        print(json.dumps({"prefill_s": prefill, "prefill_last_s": last_only, "step_s": statistics.median(steps)}),
              flush=True)


def step_token(i: int) -> int:
    """The token fed at decode step i (every row feeds the same ones)."""
    return (7 * i + 3) % 100


# ---------------------------------------------------------------------------------------------- the rows

class KestrelRow:
    def __init__(self, backend):
        self.backend = backend

    def run(self, prompt: list[int], n_tokens: int) -> dict:
        import numpy as np

        b = self.backend
        b.reset(len(prompt) + n_tokens)
        t0 = time.perf_counter()
        b.step(np.array(prompt), 0)
        prefill = time.perf_counter() - t0
        steps = []
        for i in range(n_tokens):
            t0 = time.perf_counter()
            b.step(np.array([step_token(i)]), len(prompt) + i)
            steps.append(time.perf_counter() - t0)
        return {"prefill_s": prefill, "step_s": statistics.median(steps)}

    def close(self):
        pass


class HFRow:
    def __init__(self, model, threads: int):
        import torch

        from kestrel_tui.model.hf_export import to_hf_model

        torch.set_num_threads(threads)
        self.torch, self.hf = torch, to_hf_model(model)

    def run(self, prompt: list[int], n_tokens: int) -> dict:
        torch = self.torch
        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.hf(torch.tensor([prompt]), use_cache=True)
            prefill = time.perf_counter() - t0
            past, steps = out.past_key_values, []
            for i in range(n_tokens):
                t0 = time.perf_counter()
                out = self.hf(torch.tensor([[step_token(i)]]), past_key_values=past, use_cache=True)
                steps.append(time.perf_counter() - t0)
                past = out.past_key_values
        return {"prefill_s": prefill, "step_s": statistics.median(steps)}

    def close(self):
        pass


class LlamaRow:
    def __init__(self, gguf: str, threads: int, n_ctx: int, n_batch: int):
        self.p = subprocess.Popen([sys.executable, __file__, "--llama-child", gguf, str(threads), str(n_ctx),
                                   str(n_batch)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        if self.p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"llama.cpp child did not start: {self._why()}")

    def _why(self) -> str:
        self.p.kill()
        err = self.p.communicate()[1].strip().splitlines()
        return f"rc {self.p.returncode}: {err[-1] if err else 'no message'}"

    def run(self, prompt: list[int], n_tokens: int) -> dict:
        self.p.stdin.write(f"{','.join(map(str, prompt))} {n_tokens}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp child failed: {self._why()}")
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def make_rows(model, a, tmp: str) -> tuple[dict, dict]:
    """The rows asked for, and why each row left out is left out."""
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.cref.backend import CompiledBackend
    from kestrel_tui.model.gguf import write_gguf

    skip = set(filter(None, a.skip.split(",")))
    rows, skipped = {"compiled": KestrelRow(CompiledBackend(model, threads=a.threads, lib_path=a.lib))}, {}
    if "llama" in skip:
        pass
    elif importlib_find("llama_cpp"):
        gguf = a.model if a.model and a.model.endswith(".gguf") else str(Path(tmp) / "m.gguf")
        if gguf != a.model:
            write_gguf(model, gguf)
        rows["llama"] = LlamaRow(gguf, a.threads, a.prompt + a.tokens + 8, max(a.prompt, 1))
    else:
        skipped["llama"] = "not run: llama-cpp-python is not installed"
    if "numpy" not in skip:
        rows["numpy"] = KestrelRow(NumpyBackend(model))
    if "hf" in skip:
        pass
    elif importlib_find("torch") and importlib_find("transformers"):
        rows["hf"] = HFRow(model, a.threads)
    else:
        skipped["hf"] = "not run: torch or transformers is not installed"
    return rows, skipped


def importlib_find(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ---------------------------------------------------------------------------------------------- one shape

@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, xs: list[float]) -> "Spread":
        return cls(statistics.median(xs), min(xs), max(xs))

    def cell(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}–{self.high:.{digits}f})"


@dataclass(frozen=True)
class Shape:
    title: str
    describe: str
    rows: dict            # row -> {"decode": Spread, "prefill": Spread[, "prefill_last": Spread]} (ms)
    skipped: dict         # row -> why
    ratio: Spread | None  # compiled / llama.cpp decode, paired by round
    prefill_ratio: Spread | None
    load: tuple[float, float]  # the 1-minute load average before and after
    peak_rss_gib: float


def load_model_for(a):
    sys.path.insert(0, str(ROOT))
    if a.a3b_layers:
        from kestrel_tui.model.config import qwen3_30b_a3b_config
        from kestrel_tui.model.device_synthetic import device_synthetic_model

        return device_synthetic_model(qwen3_30b_a3b_config(a.a3b_layers), seed=0, threads=a.threads)
    from kestrel_tui.model.hf import load_model

    return load_model(a.model)


def bench_shape(a, title: str) -> Shape:
    import resource

    model = load_model_for(a)
    cfg = model.cfg
    prompt = [(31 * i + 1) % min(cfg.vocab, 1000) for i in range(a.prompt)]
    describe = (f"{cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_heads}/{cfg.n_kv_heads} heads of {cfg.head_dim},"
                f" {cfg.n_experts} experts top-{cfg.top_k}, vocab {cfg.vocab}, {model.fmt}; prompt {len(prompt)},"
                f" {a.tokens} decode steps a run, {a.threads} threads, {a.runs} interleaved runs")
    print(f"{title}: {describe}", flush=True)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        rows, skipped = make_rows(model, a, tmp)
        results = {name: [] for name in rows}
        try:
            order = list(rows)
            for r in range(a.runs):
                for name in order[r % len(order):] + order[:r % len(order)]:
                    results[name].append(rows[name].run(prompt, a.tokens))
                print(f"  round {r + 1}: " + ", ".join(f"{n} {results[n][-1]['step_s'] * 1e3:.2f}" for n in order),
                      flush=True)
        finally:
            for row in rows.values():
                row.close()
    P = len(prompt)
    table = {}
    for name, runs in results.items():
        table[name] = {"decode": Spread.of([x["step_s"] * 1e3 for x in runs]),
                       "prefill": Spread.of([x["prefill_s"] * 1e3 / P for x in runs])}
        if "prefill_last_s" in runs[0]:
            table[name]["prefill_last"] = Spread.of([x["prefill_last_s"] * 1e3 / P for x in runs])
    ratio = prefill_ratio = None
    if "llama" in results:
        c, ll = results["compiled"], results["llama"]
        ratio = Spread.of([x["step_s"] / y["step_s"] for x, y in zip(c, ll)])
        prefill_ratio = Spread.of([x["prefill_s"] / y["prefill_s"] for x, y in zip(c, ll)])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return Shape(title, describe, table, skipped, ratio, prefill_ratio, (load0, os.getloadavg()[0]), rss)


def print_shape(s: Shape) -> None:
    print(f"{'engine':<30} {'decode ms/token':>28} {'prefill ms/position':>28}")
    for name, r in s.rows.items():
        print(f"{LABELS[name]:<30} {r['decode'].cell():>28} {r['prefill'].cell():>28}")
        if "prefill_last" in r:
            print(f"{'  (last logits only)':<30} {'':>28} {r['prefill_last'].cell():>28}")
    for name, why in s.skipped.items():
        print(f"{LABELS[name]:<30} {why}")
    if s.ratio:
        print(f"compiled / llama.cpp: decode {s.ratio.cell()}, prefill {s.prefill_ratio.cell()}")
    print(f"load average {s.load[0]:.2f} -> {s.load[1]:.2f}; peak RSS {s.peak_rss_gib:.2f} GiB", flush=True)


# ---------------------------------------------------------------------------------------------- the page

def machine() -> str:
    """The machine in words: cores, CPU model, memory, whether a VM."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
                platform.processor() or "unknown CPU")
    vm = " VM" if " hypervisor" in info else ""
    mem = next((int(ln.split()[1]) / 2**20 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), 0) if Path("/proc/meminfo").exists() else 0
    arch = {"x86_64": "x86-64", "AMD64": "x86-64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return f"{os.cpu_count()}-core {arch}{vm} ({name}, {mem:.0f} GiB)"


def versions() -> str:
    import importlib.metadata as md

    out = [f"Python {platform.python_version()}"]
    for dist in ("numpy", "llama_cpp_python", "torch", "transformers"):
        try:
            out.append(f"{dist.replace('_', '-')} {md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(out)


def commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "kestrel_tui/cref", "scripts/bench_reference.py")
    return head + (" (with uncommitted changes to the compiled reference)" if dirty else "")


def simd_level(lib_path) -> str:
    from kestrel_tui.cref import load

    return {0: "scalar", 1: "AVX2", 2: "AVX-VNNI", 3: "AVX-512 VBMI + VNNI"}.get(load(lib_path).kc_gemv_simd(-1), "?")


def markdown(shapes: list[Shape], command: str, a, bits: str) -> str:
    lines = ["# The reference's speed: compiled, numpy, HF eager, llama.cpp", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit()}, {machine()};"
             f" {versions()}; the compiled reference's GEMV level {simd_level(a.lib)}.", "",
             f"`{command}` wrote this page. Every row runs on the same weights (q4_0; llama.cpp on a GGUF of"
             " the same bytes, written by `write_gguf`; HF eager on them dequantized to f32), the same prompt"
             " and the same thread count. A run is a fresh cache, the prompt in one step, then single-token"
             " steps; the rows take turns run by run. Each figure is the **median of the runs** with the"
             " fastest and slowest in brackets: decode is ms/token (a run's median step), prefill ms per"
             " prompt position. llama.cpp computes every prompt position's logits, as the reference does; its"
             " prefill with the last position's logits only is the row below it. llama.cpp runs as the"
             " llama.cpp engine does: `use_extra_bufts = false` (its q4_0 repack for AMX segfaults in"
             " multi-token decode on some CPUs, results/llamacpp-findings.md).", ""]
    for s in shapes:
        lines += [f"## {s.title}", "", s.describe + ".", "",
                  "| engine | decode ms/token | prefill ms/position |", "|---|---|---|"]
        for name, r in s.rows.items():
            bold = "**" if name == "compiled" else ""
            lines.append(f"| {LABELS[name]} | {bold}{r['decode'].cell()}{bold} | {r['prefill'].cell()} |")
            if "prefill_last" in r:
                lines.append(f"| {LABELS[name]}, last position's logits only | — | {r['prefill_last'].cell()} |")
        for name, why in s.skipped.items():
            lines.append(f"| {LABELS[name]} | {why} | |")
        lines.append("")
        if s.ratio:
            verdict = "at or below" if s.ratio.median <= 1.0 else "above"
            lines.append(f"compiled / llama.cpp, paired by round: decode **{s.ratio.cell(3)}** ({verdict} llama.cpp's"
                         f" time), prefill {s.prefill_ratio.cell(3)}.")
        lines += [f"Load average (1 min) {s.load[0]:.2f} before, {s.load[1]:.2f} after; peak RSS of the benchmark"
                  f" process {s.peak_rss_gib:.1f} GiB.", ""]
    if bits:
        lines += ["## The bits", "", bits, ""]
    lines += ["## Elsewhere", "", ELSEWHERE, ""]
    return "\n".join(lines)


# the compiled reference's bit-identity tests: every key of whole steps against the numpy reference, and
# >= 10^6 fresh random inputs per primitive (a new seed every run)
BIT_TESTS = ("tests/test_cref_step.py", "tests/test_cref_ops.py", "tests/test_cref_gemv.py",
             "tests/test_cref_transcend.py", "tests/test_cref_select.py", "tests/test_reference.py")


def run_bit_tests(lib) -> str:
    """The page's paragraph on the bits: the tests run now, on this build."""
    if not all((ROOT / t).exists() for t in BIT_TESTS):
        return "The bit-identity tests are not in this checkout; not run."
    env = {**os.environ, **({"KESTREL_TEST_CREF_LIB": str(Path(lib).resolve())} if lib else {})}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *BIT_TESTS], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    tail = (r.stdout.strip().splitlines() or ["no output"])[-1].strip("= ")
    return (f"`pytest -q {' '.join(BIT_TESTS)}` on the same build, after the runs: **{tail}** (exit status"
            f" {r.returncode}, {time.perf_counter() - t0:.0f} s wall). They compare every probe buffer, hash,"
            " logit and KV-cache byte of whole compiled steps with the numpy reference's (the embedded model,"
            " the held-out shapes, Qwen3-30B-A3B's dims with one layer; 1, 2 and 3 threads), and each"
            " primitive (the expf/cosf/sinf/silu replicas, q8 quantizers, the GEMV at every SIMD level this CPU"
            " has, RMSNorm, attention, routing, the probe hashes) on at least 10^6 fresh random inputs, bit"
            " for bit.")


PAGE_SHAPES = (  # (title, --a3b-layers, rows left out and why)
    ("Embedded default model", None, {}),
    ("Qwen3-30B-A3B dims, 4 layers", 4, {"hf": "not run: its f32 copy of the weights takes ~12 GiB more"}),
)

# Figures of other machines, not measured by this command: where to read them
ELSEWHERE = ("The NVIDIA H200 host's CPU (16 cores, 16 threads, all 48 layers at Qwen3-30B-A3B's dims) and the"
             " GEMV alone (`python scripts/bench_cref_gemv.py`) on an earlier commit:"
             " `git show 3318a6e:results/reference-bench.md`.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .gguf or HF directory (default: the embedded model)")
    ap.add_argument("--a3b-layers", type=int, help="a Qwen3-30B-A3B-dims model with this many layers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16, help="prompt length")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps a run")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs of every row")
    ap.add_argument("--skip", help="comma list of rows to leave out: numpy,hf,llama")
    ap.add_argument("--lib", help="another build of the compiled reference (default: the installed one)")
    ap.add_argument("--markdown", help="write the page here (both shapes, unless --model / --a3b-layers)")
    ap.add_argument("--no-bits", action="store_true", help="leave the bit-identity tests off the page")
    ap.add_argument("--llama-child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.llama_child:
        path, threads, n_ctx, n_batch = a.llama_child
        llama_child(path, int(threads), int(n_ctx), int(n_batch))
        return
    if a.runs < 1:
        raise SystemExit("--runs must be at least 1")
    command = "python scripts/bench_reference.py " + " ".join(sys.argv[1:])
    if a.markdown and not (a.model or a.a3b_layers):
        plan = [(title, layers, why) for title, layers, why in PAGE_SHAPES]
    else:
        title = f"Qwen3-30B-A3B dims, {a.a3b_layers} layers" if a.a3b_layers else (a.model or "Embedded default model")
        plan = [(title, a.a3b_layers, {})]
    shapes = []
    for title, layers, why in plan:
        skip = ",".join(filter(None, [a.skip or "", *why]))
        shape = bench_shape(argparse.Namespace(**{**vars(a), "a3b_layers": layers, "skip": skip}), title)
        shape.skipped.update(why)
        print_shape(shape)
        shapes.append(shape)
    if a.markdown:
        bits = "" if a.no_bits else run_bit_tests(a.lib)
        Path(a.markdown).write_text(markdown(shapes, command, a, bits))
        print(f"wrote {a.markdown}")


if __name__ == "__main__":
    main()
