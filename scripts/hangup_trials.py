"""A real hangup, many times: how many trials the app ends within 3 s of its terminal going away.

Each trial starts `kestrel-tui` under a pty (tests/ptytools.py: the app leads a session whose terminal
is the pty, as in a terminal window or a tmux pane), lets it work, closes the pty's master side as
`tmux kill-session` does, and times the app's end; then it checks that no process the app had started
still runs and that no private folder is left in its TMPDIR. The moment of the hangup moves across the
trials, evenly over the scenario's span.

Scenarios:
  hf-dist-run    the hf-dist subject of profiles/cpu-vs-hf-tp2.toml (2 ranks), 200 tokens: hung up 0-4 s
                 after both rank processes exist (loading the model, then decoding in lock step)
  hf-dist-start  the same, hung up 1-3 s after the app takes the screen: while the engine starts
                 (transformers' import, the checkpoint's export, the ranks' load; none looks at a cancel)
  busy-grid      the embedded model against the sim subject, 400 tokens: hung up 0.5-2 s in, while the
                 grid fills and the screen is written at its busiest
  process        a process reference (tests/engines/toy_engine.py) that hangs with a sleeping grandchild

    python scripts/hangup_trials.py [--scenario hf-dist-run] [--trials 20] [--within 3]

Prints a line per trial, then: how many ended within the bound, the slowest, and what was left.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from ptytools import descendants, hang_up  # noqa: E402

TOY = ROOT / "tests" / "engines" / "toy_engine.py"


def _ranks(pid: int) -> int:
    n = 0
    for p in descendants(pid):
        try:
            n += b"hf_dist_rank" in Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            pass
    return n


def _toy_profile(folder: Path) -> Path:
    prof = folder / "hang.toml"
    prof.write_text(f'''tokens = 3
prompt_ids = [1, 1775, 1501]
[reference]
engine = "process"
[reference.options]
command = [{sys.executable!r}, {str(TOY)!r}, "--prompt-ids", "{{prompt_ids}}", "--tokens", "{{n_tokens}}",
           "--hang-after", "2", "--pid-file", {str(folder / "toy.pid")!r},
           "--spawn-child", {str(folder / "grandchild.pid")!r}]
dump_env = "TOY_DUMP"
[subject]
engine = "sim"
''')
    return prof


def scenario(name: str, folder: Path):
    """(the app's arguments, the span of the hangup's moment in seconds, what must hold before it counts)"""
    tp2 = ["--profile", str(ROOT / "profiles" / "cpu-vs-hf-tp2.toml"), "--tokens", "200", "--no-cache"]
    if name == "hf-dist-run":
        return tp2, (0.0, 4.0), lambda pid: _ranks(pid) >= 2
    if name == "hf-dist-start":
        return tp2, (1.0, 3.0), None
    if name == "busy-grid":
        return ["--subject", "sim", "--tokens", "400", "--no-cache"], (0.5, 2.0), None
    if name == "process":
        grandchild = folder / "grandchild.pid"
        return (["--profile", str(_toy_profile(folder)), "--no-cache"], (0.0, 1.0),
                lambda pid: grandchild.exists() and grandchild.read_text().strip() != "")
    raise SystemExit(f"unknown scenario {name!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="hf-dist-run",
                    choices=("hf-dist-run", "hf-dist-start", "busy-grid", "process"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--within", type=float, default=3.0, help="the bound, in seconds (default 3)")
    ap.add_argument("--wait", type=float, default=20.0, help="seconds before a trial's app is killed")
    args = ap.parse_args()
    times, missed, left = [], 0, []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="hangup-trial-") as d:
            folder = Path(d)
            tmp = folder / "tmp"
            tmp.mkdir()
            argv, (lo, hi), ready = scenario(args.scenario, folder)
            busy = lo + (hi - lo) * i / max(1, args.trials - 1)
            h = hang_up(argv, tmp, folder, busy=busy, ready=ready, wait=args.wait)
        ended = "did not end (killed)" if h.ended_after is None else f"ended in {h.ended_after:.2f} s"
        print(f"trial {i + 1:2}: hung up {busy:.2f} s in, {len(h.descendants)} processes below the app; {ended},"
              f" status {h.status}; left running {h.left_running or 'none'}, folders {h.left_folders or 'none'}",
              flush=True)
        if h.ended_after is None:
            missed += 1
        else:
            times.append(h.ended_after)
        left += [*h.left_running, *h.left_folders]
    within = sum(t <= args.within for t in times)
    slowest = "never ended" if missed else f"{max(times):.2f} s"
    print(f"{args.scenario}: {within} of {args.trials} ended within {args.within:g} s; slowest {slowest}"
          + (f", median {statistics.median(times):.2f} s" if times else "")
          + f"; left behind: {left or 'nothing'}")
    return 0 if within == args.trials and not left else 1


if __name__ == "__main__":
    sys.exit(main())
