"""scripts/fuzz_dumps.py's strategies under pytest: hostile vLLM and SGLang dump folders through diff, diff --tol
and run, derandomized. About 2 s a case on a loaded 2-core machine (three commands each), so a few dozen
here; the script's docstring has the 10^5 run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import fuzz_dumps  # noqa: E402

CASES = 30


def test_hostile_dump_folders_are_exit_0_1_or_one_line():
    tally = fuzz_dumps.run_cases(CASES, 0, derandomize=True)
    assert not tally.violations, tally.report()
    assert sum(tally.outcomes.values()) == 3 * CASES


def test_a_crash_is_a_violation(tmp_path, monkeypatch):
    """The checker can fail: a reader that raises is counted, not passed."""
    def boom(*_a, **_k):
        raise RuntimeError("planted")

    monkeypatch.setattr(fuzz_dumps, "cli_main", boom)
    results = fuzz_dumps.check(("vllm", 1, [], None), tmp_path)
    assert all(code == -1 and "planted" in why for _, code, _, why in results)
