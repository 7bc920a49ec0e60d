"""The dump-folder fuzzer (scripts/fuzz_dumps.py) in CI: 10^4 hostile vLLM and SGLang dump folders through
diff, diff --tol and run, in two processes of the script (each under RLIMIT_AS 3 GB) with fixed seeds so
that a fresh clone runs the same cases. Each command ends in exit 0, 1 (both folders read: a DIFF) or 2
in one stderr line, with no traceback, within 5 s. The script runs 10^5 (results/fuzz-dumps.md)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import fuzz_dumps  # noqa: E402

CASES, SEED = 10_000, 20261205


def test_ten_thousand_hostile_dump_folders_are_exit_0_1_or_one_line(capsys):
    tally = fuzz_dumps.fuzz(CASES, SEED, jobs=2)
    assert not tally.violations, tally.report()
    assert tally.cases == CASES and sum(tally.outcomes.values()) == 3 * CASES, tally.report()
    for command in ("diff", "diff --tol", "run"):  # the cases reach both a verdict and a refusal of each command
        assert tally.outcomes[f"{command}: exit 2"] > CASES // 2, tally.report()
        assert sum(tally.outcomes[f"{command}: exit {c}"] for c in (0, 1)) > CASES // 20, tally.report()
    with capsys.disabled():
        print(f"\n  fuzz_dumps: {tally.report().splitlines()[-1]}; slowest {tally.slowest[0]:.2f} s,"
              f" max RSS of a worker {tally.max_rss_mb:.0f} MB")


def test_a_crash_is_a_violation(tmp_path, monkeypatch):
    """The checker can fail: a reader that raises is counted, not passed."""
    def boom(*_a, **_k):
        raise RuntimeError("planted")

    monkeypatch.setattr(fuzz_dumps, "cli_main", boom)
    results = fuzz_dumps.check(("vllm", 1, [], None), tmp_path)
    assert all(code == -1 and "planted" in why for _, code, _, why in results)


def test_a_violation_in_a_worker_reaches_the_tally(tmp_path):
    """fuzz() merges what its worker processes found: a worker's violation is the parent's."""
    t = fuzz_dumps.Tally()
    t.add(("vllm", 1, [], None), [("diff", -1, 0.1, "RuntimeError: planted")])
    merged = fuzz_dumps.Tally()
    merged.merge(json.loads(t.as_json()))
    assert merged.violations and merged.cases == 1 and merged.outcomes["diff: exit -1"] == 1
