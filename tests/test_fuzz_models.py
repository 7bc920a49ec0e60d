"""The model-file fuzzer (scripts/fuzz_models.py) in CI: 10^4 cases of mutated GGUF headers and
metadata, config.json, safetensors headers and index.json, each loaded as `--model` loads it in
workers under RLIMIT_AS 3 GB, with a fixed seed so that a fresh clone runs the same cases. No case may
raise anything but UsageError (the CLI's exit 2, in one line naming the file), none may run past 5 s;
the script runs 10^5 (results/fuzz-models.md)."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("safetensors")

_path = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_models.py"
_spec = importlib.util.spec_from_file_location("fuzz_models", _path)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_models"] = fuzz
_spec.loader.exec_module(fuzz)

CASES, SEED = 10_000, 20261201


def test_ten_thousand_hostile_model_files_end_in_a_load_or_one_line(capsys):
    r = fuzz.fuzz(CASES, SEED, workers=2, log=lambda *_: None)
    failures = r["failures"]
    assert not failures, f"{len(failures)} failures, the first: {failures[:5]}"
    assert not r["warnings"], r["warning_examples"]  # a RuntimeWarning would be a second stderr line
    out = r["outcomes"]
    assert sum(out.values()) == CASES and out.get("ok", 0) > 0.03 * CASES and out.get("refused", 0) > 0.5 * CASES, out
    assert r["max_case_s"] < fuzz.CASE_SECONDS and r["max_rss_mb"] < 1024, r
    with capsys.disabled():
        print(f"\n  fuzz_models: {CASES} cases in {r['time_s']:.0f} s, {out}, slowest case {r['max_case_s']:.2f} s,"
              f" max RSS {r['max_rss_mb']:.0f} MB")


def test_every_seed_family_is_exercised():
    """A mutation that always missed its target would leave a family loading its seed untouched."""
    r = fuzz.fuzz(400, SEED + 1, workers=2, log=lambda *_: None)
    families = {k.split()[0] for k in r["by_family"]}
    assert families == {"gguf", "config", "safetensors", "index", "special"}, r["by_family"]
    refused = {k.split()[0] for k, v in r["by_family"].items() if k.endswith("refused") and v}
    assert refused == families, r["by_family"]
