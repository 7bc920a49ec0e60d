"""The bundle fuzzer (scripts/fuzz_bundles.py) in CI: 10^4 damaged repro bundles, each replayed by the
bundle's replay.py (its main, in workers under RLIMIT_AS 3 GB), with a fixed seed so that a fresh clone
runs the same cases. Every case ends in exit 0/1 with the genuine verdict where the damage left what
the replay reads intact, or exit 2 in one stderr line naming the file; no traceback, warning, raw
control character or case past 5 s. The script runs 10^5 (results/fuzz-bundles.md)."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")

_path = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_bundles.py"
_spec = importlib.util.spec_from_file_location("fuzz_bundles", _path)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_bundles"] = fuzz
_spec.loader.exec_module(fuzz)

CASES, SEED = 10_000, 20261205
FAMILIES = {"case", "text", "print", "path", "arrays", "npy", "file"}


def test_ten_thousand_damaged_bundles_end_in_a_verdict_or_one_line(capsys):
    r = fuzz.fuzz(CASES, SEED, workers=2, log=lambda *_: None)
    failures = r["failures"]
    assert not failures, f"{len(failures)} failures, the first: {failures[:5]}"
    out = r["outcomes"]
    assert sum(out.values()) == CASES and out.get("exit2", 0) > 0.5 * CASES, out
    assert out.get("exit0", 0) + out.get("exit1", 0) > 0.1 * CASES, out  # the harmless damage replays
    families = {k.split()[0] for k in r["by_family"]}
    refused = {k.split()[0] for k, v in r["by_family"].items() if k.endswith("exit2") and v}
    assert families == refused == FAMILIES, r["by_family"]
    assert r["max_case_s"] < fuzz.CASE_SECONDS and r["max_rss_mb"] < 1024, r
    with capsys.disabled():
        print(f"\n  fuzz_bundles: {CASES} cases in {r['time_s']:.0f} s ({r['rate_per_s']:.0f} a second), {out},"
              f" slowest case {r['max_case_s']:.2f} s ({r['slowest']['what']}), max RSS {r['max_rss_mb']:.0f} MB")
