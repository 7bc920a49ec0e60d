"""The wall time and peak memory of `kestrel-tui logprobs` on two files of 10^5 sequences x 256 tokens.

Writes the two JSONL files in a temporary folder (A: the response's log-probabilities, the first null as a
serving engine gives it; B: a trainer's, 16 prompt tokens before the response, the log-probabilities off
by a little), runs the command in a child process and prints its wall time and peak RSS
(resource.getrusage of the child). results/logprobs-bench.md records it.

    python scripts/bench_logprobs.py [--sequences 100000] [--tokens 256]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np


def write_files(folder: str, sequences: int, tokens: int) -> tuple[str, str]:
    rng = np.random.default_rng(0)
    a_path, b_path = os.path.join(folder, "a.jsonl"), os.path.join(folder, "b.jsonl")
    with open(a_path, "w") as fa, open(b_path, "w") as fb:
        for _ in range(sequences):
            ids = rng.integers(0, 151_936, tokens + 16).tolist()
            a = -rng.exponential(1.0, tokens)
            b = -np.abs(a + rng.normal(0, 0.02, tokens))
            fa.write(json.dumps({"token_ids": ids[16:], "logprobs": [None] + a[1:].tolist()}) + "\n")
            fb.write(json.dumps({"token_ids": ids, "logprobs": [None] * 16 + b.tolist()}) + "\n")
    return a_path, b_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        t = time.perf_counter()
        a, b = write_files(folder, args.sequences, args.tokens)
        print(f"wrote {args.sequences} sequences x {args.tokens} tokens: A {os.path.getsize(a) / 2**20:.0f} MiB,"
              f" B {os.path.getsize(b) / 2**20:.0f} MiB in {time.perf_counter() - t:.0f} s")
        cmd = [sys.executable, "-m", "kestrel_tui.cli", "logprobs", a, b, "--json"]
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    figures = json.loads(done.stdout)
    print(f"kestrel-tui logprobs A B --json: exit {done.returncode}, {figures['tokens']} tokens scored,"
          f" wall {wall:.1f} s, peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
