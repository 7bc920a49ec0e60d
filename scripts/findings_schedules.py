"""One engine, two schedules: decode against every other schedule, per engine and model, as a findings page.

    .venv/bin/python scripts/findings_schedules.py --out results/schedule-findings.md

For the embedded model (its first --layers layers) and a Qwen3-0.6B-shaped checkpoint made and saved by
transformers (tests/hfmodels.py: vocab 151936, hidden 1024, 16 heads of 128, 8 KV heads; --layers layers), on the cpu
reference, hf float32, hf bfloat16 (eager attention, CPU) and llama.cpp (a GGUF of the same f32 weights,
CPU): each schedule against the same engine's decode, on the same --prompt random token ids and
--tokens teacher-forced tokens — first DIFF, first far key (nmse 1e-7), far keys, top-1 flips, the
fractions of tokens outside the clip bands, max |dp| and the bitwise-equal tokens. Prints each row as it
is measured and writes the page (with the command, date, machine and commit) to --out.
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # hfmodels: the Qwen3-0.6B-shaped checkpoint

import numpy as np  # noqa: E402

from kestrel_tui.engines.base import EngineSpec, Toggle  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.session.session import RunSettings, Session  # noqa: E402
from kestrel_tui.trace.compare import parse_tolerance  # noqa: E402

TOL = "nmse=1e-7"
HEAD = ("| schedule | first DIFF | first far | far keys | top-1 flips | outside [0.8,1.2] | outside [0.9,1.1]"
        " | max abs dp | bitwise tokens |")


def schedules(P: int) -> list[str]:
    return ["forward", "chunked:1", "chunked:16", "chunked:64", f"prefix:{P // 2}", f"prefix:{P - 1}",
            *(f"verify:{m}" for m in range(2, 9))]


def engine(kind: str, model_dir: str | None, ours, all_schedules: list[str], tmp: Path):
    """(engine, its model) with a list toggle `schedule` over decode (its default) and all_schedules."""
    toggle = (Toggle("schedule", ("decode", *all_schedules), key="schedule"),)
    if kind == "cpu":
        return None, ours
    if kind.startswith("hf"):
        dtype = "float32" if kind == "hf f32" else "bfloat16"
        opts = {"device": "cpu", "dtype": dtype, "attn_implementation": "eager"}
        return make_engine(EngineSpec("hf", model_dir, opts, toggle), ours, kv="f32"), ours
    from kestrel_tui.model.gguf import write_gguf

    path = tmp / f"{ours.name}.gguf"
    if not path.exists():
        write_gguf(ours, path)
    theirs = load_model(str(path), "f32", kv="f32")
    return make_engine(EngineSpec("llama.cpp", str(path), {"repack": "off"}, toggle), theirs, kv="f32"), theirs


def row(res, schedule: str) -> str:
    tol = res.tolerance(parse_tolerance(TOL))
    flips = sum(1 for s in res.tokens if s.flip)
    mm = res.mismatch
    f = mm.tally.figures() if mm is not None else {}

    def pct(k):
        return f"{f[k]:.1%}" if f.get(k) is not None else "-"

    return (f"| {schedule} | {res.comparison.first_diff or 'none'} | {tol.first_far or 'none'} | {tol.n_far} | {flips}"
            f" | {pct('outside_0.8_1.2')} | {pct('outside_0.9_1.1')} | {f.get('max_abs_dp', 0):.2e}"
            f" | {f.get('bitwise_tokens', 0)}/{f.get('tokens', 0)} |")


def measure(kind: str, model_dir, ours, prompt, n_tokens, tmp: Path, out: list[str]) -> None:
    all_s = schedules(len(prompt))
    eng, m = engine(kind, model_dir, ours, all_s, tmp)
    out += [f"### {ours.name}: {kind}", "", HEAD, "|" + "---|" * 9]
    t0 = time.perf_counter()
    if eng is None:  # the cpu reference: two engines, the subject's schedule its option
        ref = make_engine(EngineSpec("cpu"), m, kv="f32")
        for s in all_s:
            sub = make_engine(EngineSpec("cpu", options={"schedule": s}), m, kv="f32")
            res = Session(m, prompt, n_tokens, reference=ref, subject=sub, kv="f32").run(
                RunSettings(prefill="subject"))
            out.append(row(res, s))
            print(out[-1], flush=True)
    else:
        session = Session(m, prompt, n_tokens, reference=eng, subject=eng, kv="f32")
        t = eng.toggle("schedule")
        for s in all_s:
            res = session.run(RunSettings(prefill="subject").pick(t, s), record=False)
            out.append(row(res, s))
            print(out[-1], flush=True)
        eng.close()
    out += ["", f"({time.perf_counter() - t0:.0f} s)", ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/schedule-findings.md")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=72, help="random prompt token ids")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--engines", default="cpu,hf f32,hf bf16,llama.cpp")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    out = [f"    {' '.join(['.venv/bin/python', 'scripts/findings_schedules.py', *sys.argv[1:]])}", "",
           f"- date {date.today()}, commit {commit}, {platform.machine()} {platform.processor() or ''}"
           f" {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores,"
           f" Python {platform.python_version()}, numpy {np.__version__}", ""]
    try:
        import llama_cpp
        import torch
        import transformers

        out[-2] += (f", torch {torch.__version__}, transformers {transformers.__version__},"
                    f" llama-cpp-python {llama_cpp.__version__}")
    except ImportError:
        pass
    from hfmodels import qwen3_06b_shaped  # torch and transformers: imported where they are needed

    engines = [e.strip() for e in args.engines.split(",")]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        qdir = qwen3_06b_shaped(tmp / "qwen3-0.6b-shaped", args.layers)
        for model_dir, ours in ((None, load_model(None, "f32", n_layers=args.layers)),
                                (str(qdir), load_model(str(qdir), "f32", n_layers=args.layers))):
            prompt = [int(x) for x in rng.integers(0, ours.cfg.vocab, args.prompt)]
            for kind in engines:
                measure(kind, model_dir, ours, prompt, args.tokens, tmp, out)
    Path(args.out).write_text("\n".join(out) + "\n") if args.out != "-" else print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
