"""Fuzz the serving-dump readers through `kestrel-tui diff`, `diff --tol` and `run` with the dump engine.

    .venv/bin/python scripts/fuzz_dumps.py --cases 100000 --seed 0

(results/fuzz-dumps.md has the rate; split seeds over processes)

Each case mutates a valid tiny one-pass (or few-pass) vLLM or SGLang-legacy dump folder — a field's dtype,
shape, a stride-0 `expand`, a sparse or `meta` tensor, huge or negative positions and ids, a missing
field, a non-tensor value, a truncated file, many passes — and runs the three commands in-process
against the valid folder. Each must give exit 0, 1 (a DIFF: both folders read) or 2 with exactly one
stderr line; no traceback; each case within 5 s; all under RLIMIT_AS 3 GB, set before torch is imported.
A summary counts the outcomes and names the slowest case; any violation prints its case and exits 1.
What is the same in every case is made once per process: the embedded model, cut to 4 layers (`run`
would build all 48 each time), the valid folders and the bytes of every unmutated pass file. (`run`
decodes the reference each time, with --no-cache: for this 5-position run the cache's read is slower
than the decode.)
tests/test_fuzz_dumps.py runs the same strategies under pytest (fewer cases, derandomized).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

LIMIT_AS = 3 * 2**30
SECONDS = 5.0


def limit_memory() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > LIMIT_AS:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, hard))


if __name__ == "__main__":
    limit_memory()  # before torch: it must import under the limit too

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kestrel_tui.model.hf as model_hf  # noqa: E402
from kestrel_tui.cli import main as cli_main  # noqa: E402

IDS, POSITIONS = "model.forward_batch_info.input_ids", "model.forward_batch_info.positions"
SEQ_LENS = "model.forward_batch_info.seq_lens"
EMB = "model.embed_tokens"
HIDDEN = 256  # the embedded synthetic model's (run's reference): the valid dump's emb fits it
PROMPT = [5, 77, 19, 33]
FIELDS = (IDS, POSITIONS, SEQ_LENS, EMB)


def valid(fmt: str, n: int = 0) -> dict:
    """A forward of PROMPT: the first pass the prompt, the later ones one decode token each."""
    ids = torch.tensor(PROMPT) if n == 0 else torch.tensor([7])
    pos = torch.arange(4) if n == 0 else torch.tensor([3 + n])
    d = {IDS: ids, POSITIONS: pos, EMB: torch.ones(len(ids), HIDDEN)}
    if fmt == "sglang":
        d[SEQ_LENS] = torch.tensor([int(pos[-1]) + 1])
    return d


_BIG = st.sampled_from([2**18 + 1, 2**30, 2**31, 2**40, 2**62, -1, -1000, -(2**40)])
_VALUES = st.one_of(
    st.builds(lambda b: ("add", b), _BIG),
    st.sampled_from([("dtype", t) for t in (torch.int32, torch.int8, torch.uint8, torch.float16, torch.bfloat16,
                                             torch.float32, torch.float64, torch.bool, torch.complex64)]),
    st.sampled_from([("expand", k) for k in (2**10, 2**31, 2**34, 2**40)]),
    st.just(("sparse", None)), st.just(("meta", None)), st.just(("drop", None)),
    st.sampled_from([("value", v) for v in ("x", 3, None, [1, 2], {"a": 1}, 1.5)]),
    st.sampled_from([("shape", s) for s in ((), (0,), (4, 1), (2,), (4, 8, 2), (1, 0))]),
)
MUTATION = st.tuples(st.sampled_from(FIELDS), _VALUES)


def mutate(t, how: str, arg):
    if how == "value":
        return arg
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.is_meta:
        return t  # an earlier mutation left no dense tensor to mutate further
    if how in ("add", "dtype", "sparse") and 0 in t.stride() and t.numel() > 2**16:
        # an expanded field stays expanded: mutate one element per stride-0 dim, then expand it again
        small = t
        for d, stride in enumerate(t.stride()):
            if stride == 0:
                small = small.narrow(d, 0, 1)
        small = mutate(small.contiguous(), how, arg)
        return small if how == "sparse" else small.expand(t.shape)
    if how == "add":
        with warnings.catch_warnings():  # a complex field cast to ids: the point of the case, not news
            warnings.simplefilter("ignore")
            return t.to(torch.int64) + arg
    if how == "dtype":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return t.to(arg)
    if how == "expand":
        if t.numel() == 0:
            return t  # nothing to repeat
        one = t[(slice(0, 1),) * t.ndim].clone()  # one element, as many dims
        return one.reshape(-1).expand(arg) if t.ndim < 2 else one.reshape(1, 1).expand(t.shape[0], arg)
    if how == "sparse":
        return t.to_sparse()
    if how == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    if how == "shape":
        return torch.zeros(arg, dtype=t.dtype)
    raise ValueError(how)


@st.composite
def cases(draw):
    fmt = draw(st.sampled_from(["vllm", "sglang"]))
    # a 200-pass folder reads for 0.2 s a command, 40 times a small one's: 1 case in 21
    passes = draw(st.sampled_from([1, 1, 1, 2, 2, 3, 3, 5, 8, 13] * 2 + [200]))
    muts = draw(st.lists(st.tuples(st.integers(0, passes - 1), MUTATION), min_size=0, max_size=3))
    truncate = draw(st.none() | st.tuples(st.integers(0, passes - 1), st.integers(0, 400)))
    return fmt, passes, muts, truncate


@functools.cache
def valid_bytes(fmt: str, n: int) -> bytes:
    buf = io.BytesIO()
    torch.save(valid(fmt, n), buf)
    return buf.getvalue()


def write(folder: Path, case) -> None:
    fmt, passes, muts, truncate = case
    rank = folder / "TP0_PP0_Rank0_pid1"
    rank.mkdir(parents=True)
    for n in range(passes):
        mine = [(field, how, arg) for i, (field, (how, arg)) in muts if i == n]
        if mine:
            d = valid(fmt, n)
            for field, how, arg in mine:
                if field in d:
                    if how == "drop":
                        del d[field]
                    else:
                        d[field] = mutate(d[field], how, arg)
            buf = io.BytesIO()
            torch.save(d, buf)
            data = buf.getvalue()
        else:
            data = valid_bytes(fmt, n)
        if truncate and truncate[0] == n:
            data = data[:truncate[1]]
        (rank / f"Pass{n:05d}.pt").write_bytes(data)


@functools.cache
def shared_root() -> Path:
    """The per-process folder of the valid folders every case compares against."""
    root = Path(tempfile.mkdtemp(prefix="fuzz-dumps-"))
    for fmt in ("vllm", "sglang"):
        write(root / f"good-{fmt}", (fmt, 1, [], None))
    # run builds the embedded model each time (0.15 s) and decodes its 48 layers (0.05 s): the readers are
    # what is fuzzed, so run takes the model's first 4 layers, built once
    model_hf.synthetic_model = functools.cache(model_hf.synthetic_model)
    full = model_hf.default_config
    model_hf.default_config = lambda: full().with_layers(4)
    return root


def _cli(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = cli_main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        except BaseException as e:  # noqa: BLE001 - a crash is what this looks for
            return -1, f"{type(e).__name__}: {e}"
    return code, err.getvalue()


def check(case, root: Path) -> list[tuple[str, int, float, str]]:
    """(command, exit, seconds, violation or "") of each command on the case's folder against a valid one."""
    good, bad = shared_root() / f"good-{case[0]}", root / "bad"
    write(bad, case)
    prof = root / "p.toml"
    prof.write_text(f'[reference]\nengine = "cpu"\n[subject]\nengine = "{case[0]}-dump"\n'
                    f'[subject.options]\nfolder = "{bad}"\n')
    out = []
    for name, argv in (("diff", ("diff", bad, good)), ("diff --tol", ("diff", bad, good, "--tol", "nmse=1e-7")),
                       ("run", ("run", "--profile", prof, "--prompt-ids", ",".join(map(str, PROMPT)),
                                "--tokens", "1", "--kv", "f32", "--weights", "f32", "--no-cache"))):
        t0 = time.monotonic()
        code, err = _cli(argv)
        took = time.monotonic() - t0
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        bad_why = ""
        if code not in (0, 1, 2):
            bad_why = f"exit {code}: {err[-600:]}"
        elif "Traceback" in err:
            bad_why = f"a traceback: {err[-600:]}"
        elif code == 2 and len(lines) != 1:
            bad_why = f"exit 2 with {len(lines)} lines: {err[-600:]}"
        elif took > SECONDS:
            bad_why = f"{took:.1f} s"
        out.append((name, code, took, bad_why))
    return out


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM, which starts afresh at exec (ru_maxrss keeps the peak of the process
    this one was forked from, e.g. a pytest that had run other tests)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Tally:
    def __init__(self):
        self.outcomes, self.violations, self.slowest = Counter(), [], (0.0, None)
        self.cases, self.seconds, self.max_rss_mb = 0, 0.0, 0.0

    def add(self, case, results) -> None:
        self.cases += 1
        for name, code, took, why in results:
            self.outcomes[f"{name}: exit {code}"] += 1
            if took > self.slowest[0]:
                self.slowest = (took, (name, case))
            if why:
                self.violations.append((name, case, why))

    def merge(self, other: dict) -> None:
        self.outcomes.update(other["outcomes"])
        self.violations += [tuple(v) for v in other["violations"]]
        self.slowest = max(self.slowest, tuple(other["slowest"]), key=lambda s: s[0])
        self.cases += other["cases"]
        self.max_rss_mb = max(self.max_rss_mb, other["max_rss_mb"])

    def as_json(self) -> str:
        return json.dumps({"outcomes": self.outcomes, "violations": [(n, repr(c), w) for n, c, w in self.violations],
                           "slowest": (self.slowest[0], repr(self.slowest[1])), "cases": self.cases,
                           "max_rss_mb": peak_rss_mb()})

    def report(self) -> str:
        lines = [f"{k}: {v}" for k, v in sorted(self.outcomes.items())]
        lines.append(f"slowest: {self.slowest[0]:.2f} s {self.slowest[1]}")
        lines.append(f"max RSS of a worker: {self.max_rss_mb:.0f} MB")
        lines += [f"VIOLATION {n}: {why} in {c}" for n, c, why in self.violations[:5]]
        lines.append(f"{self.cases} cases in {self.seconds:.0f} s, {len(self.violations)} violations")
        return "\n".join(lines)


def run_cases(n: int, seed_: int, derandomize: bool = False) -> Tally:
    tally = Tally()

    @seed(seed_)
    @settings(max_examples=n, deadline=None, database=None, derandomize=derandomize,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(cases())
    def one(case):
        with tempfile.TemporaryDirectory() as d:
            tally.add(case, check(case, Path(d)))

    one()
    return tally


def fuzz(n: int, seed_: int, jobs: int) -> Tally:
    """n cases over `jobs` processes of this script, seeds seed_, seed_ + 1, ...; their tallies merged."""
    t0 = time.monotonic()
    per = [n // jobs + (i < n % jobs) for i in range(jobs)]
    procs = [subprocess.Popen([sys.executable, __file__, "--cases", str(k), "--seed", str(seed_ + i), "--json"],
                              stdout=subprocess.PIPE, text=True) for i, k in enumerate(per)]
    tally = Tally()
    for i, proc in enumerate(procs):
        out, _ = proc.communicate()
        if proc.returncode not in (0, 1) or not out.strip():
            raise RuntimeError(f"worker {i} (seed {seed_ + i}) ended with exit {proc.returncode}")
        tally.merge(json.loads(out.strip().splitlines()[-1]))
    tally.seconds = time.monotonic() - t0
    return tally


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="processes, each with its own seed (seed, seed+1, ...)")
    ap.add_argument("--json", action="store_true", help="print the tally as one JSON line (what --jobs reads)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.jobs > 1:
        tally = fuzz(args.cases, args.seed, args.jobs)
    else:
        tally = run_cases(args.cases, args.seed)
        tally.seconds = time.monotonic() - t0
        tally.max_rss_mb = peak_rss_mb()
    print(tally.as_json() if args.json else tally.report())
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
