"""The headless commands on profiles that name foreign engines: the process toy (tests/engines/toy_engine.py)
and hf; bad input is one line on stderr, exit 2, and nothing written.

The profiles name a 2-layer GGUF of the embedded model (written once per module): the cpu reference
decodes it, and the toy decodes the same 2-layer model, so with every op exact they agree bit for bit.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kestrel_tui.backends.toggles import TOGGLES
from kestrel_tui.engines.build import make_backend
from kestrel_tui.engines.builtin import run_decode
from kestrel_tui.engines.builtin import OP_TOGGLES
from kestrel_tui.trace.compare import compare
from kestrel_tui.trace.dump import read_dump

from clitools import one_line_error, run_cli as run
from toytools import gguf, model  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]
TOY = str(ROOT / "tests" / "engines" / "toy_engine.py")
PROMPT = [1, 1775, 1501]
N = 3


@pytest.fixture(scope="module")
def ref(model):
    return run_decode(make_backend("cpu", model), PROMPT, N)


def sim_hashes(model, ref, exact):
    return run_decode(make_backend("sim", model, exact=exact), PROMPT, N, forced=ref.generated[:N]).hashes()


def q(s) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(str(s))


def toy_command(*extra, raw=False) -> str:
    cmd = [sys.executable, TOY, "--prompt-ids", "{prompt_ids}", "--tokens", "{n_tokens}",
           "--forced-ids", "{forced_ids}", *extra]
    if raw:
        cmd += ["--raw", "{raw}"]
    return "[" + ", ".join(q(a) for a in cmd) + "]"


EXACT_TOGGLE = '[[toggle]]\nname = "exact"\nkey = "TOY_EXACT"\nfast = "none"\nexact = "all"\n'


def toy_profile(gguf, *extra, raw=False, options="", toggles=EXACT_TOGGLE, head="") -> str:
    return (f"{head}model = {q(gguf)}\ntokens = {N}\nprompt_ids = {PROMPT}\n\n"
            f'[reference]\nengine = "cpu"\n\n'
            f'[subject]\nengine = "process"\n\n'
            f"[subject.options]\ncommand = {toy_command(*extra, raw=raw)}\n"
            f'dump_env = "TOY_DUMP"\n{options}\n{toggles}')


def write(tmp_path, text: str, name: str = "p.toml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


def nothing_written(tmp_path, out: Path) -> bool:
    return not out.exists() and not list(tmp_path.glob(out.name + "*")) and not list(tmp_path.glob(f".{out.name}*"))


def bad(capsys, tmp_path, f: Path, *extra) -> list[str]:
    """`run` and `dump --out` on a bad profile: each exit 2 with one line, and dump writes nothing."""
    lines = []
    for argv in (("run", "--profile", f, "--json", *extra),
                 ("dump", "--profile", f, "--backend", "subject", "--out", tmp_path / "out.txt", *extra)):
        code, out, err = run(capsys, *argv)
        assert code == 2, (argv, out, err)
        lines.append(one_line_error(err))
        assert out == ""  # no half report on stdout
    assert nothing_written(tmp_path, tmp_path / "out.txt")
    return lines


# ---- bad input ------------------------------------------------------------------------------------


def test_unknown_engine_in_a_profile(capsys, tmp_path, gguf):
    text = toy_profile(gguf).replace('engine = "process"', 'engine = "bogus"')
    f = write(tmp_path, text)
    for ln in bad(capsys, tmp_path, f):
        assert f"{f}:{line_of(text, 'bogus')}: subject.engine: unknown engine 'bogus'" in ln
        assert "choose from cpu, sim, cuda, hf, hf-dist, process" in ln


def test_unknown_engine_on_the_command_line(capsys):
    code, out, err = run(capsys, "run", "--subject", "bogus", "--tokens", "1")
    ln = one_line_error(err)
    assert code == 2 and out == ""
    assert "--subject 'bogus'" in ln and "choose sim, cuda, hf" in ln and "--profile" in ln
    code, _, err = run(capsys, "bisect", "--subject", "bogus", "--tokens", "1")
    assert code == 2 and "--subject 'bogus'" in one_line_error(err)


def test_subject_process_without_a_profile_says_name_it_in_a_profile(capsys):
    code, _, err = run(capsys, "run", "--subject", "process", "--tokens", "1")
    ln = one_line_error(err)
    assert code == 2 and "--subject 'process'" in ln and "--profile" in ln


def test_unknown_process_option_names_the_file_and_line(capsys, tmp_path, gguf):
    text = toy_profile(gguf, options="bogus = 1\n")
    f = write(tmp_path, text)
    for ln in bad(capsys, tmp_path, f):
        assert f"{f}:{line_of(text, 'bogus = 1')}: subject.options.bogus: " in ln
        assert "unknown option 'bogus'" in ln and "the options are command, dump_env" in ln


def test_unknown_hf_option_names_the_file_and_line(capsys, tmp_path, gguf, monkeypatch):
    from kestrel_tui.engines import hf

    monkeypatch.setattr(hf, "needs_torch", lambda engine: None)  # the option check needs no torch: keep the test fast
    text = (f"model = {q(gguf)}\ntokens = 1\n\n[reference]\nengine = \"cpu\"\n\n[subject]\nengine = \"hf\"\n\n"
            f"[subject.options]\ndevice = \"cpu\"\nbogus = 1\n")
    f = write(tmp_path, text)
    for ln in bad(capsys, tmp_path, f):
        assert f"{f}:{line_of(text, 'bogus = 1')}: subject.options.bogus: hf engine: unknown option 'bogus'" in ln
        assert "choose from attn_implementation" in ln


def test_bad_toml_names_the_line(capsys, tmp_path, gguf):
    text = toy_profile(gguf).replace('dump_env = "TOY_DUMP"', 'dump_env = "TOY_DUMP')
    f = write(tmp_path, text)
    for ln in bad(capsys, tmp_path, f):
        assert f"{f}:{line_of(text, 'dump_env')}: TOML syntax: " in ln and "fix that line" in ln


def test_missing_model_names_the_line(capsys, tmp_path, gguf):
    gone = tmp_path / "gone.gguf"
    text = toy_profile(gone, head="# a profile\n")
    f = write(tmp_path, text)
    for ln in bad(capsys, tmp_path, f):
        assert f"{f}:2: model: {gone} does not exist" in ln and "or pass --model PATH" in ln


def test_hf_subject_without_transformers_is_one_line_with_the_pip_fix(capsys, tmp_path, gguf, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    text = f"model = {q(gguf)}\ntokens = 1\n\n[reference]\nengine = \"cpu\"\n\n[subject]\nengine = \"hf\"\n"
    f = write(tmp_path, text)
    for ln in bad(capsys, tmp_path, f):
        assert "hf engine needs transformers and torch: pip install -e '.[test]'" in ln
    code, _, err = run(capsys, "run", "--subject", "hf", "--model", gguf, "--tokens", "1")
    assert code == 2 and "pip install" in one_line_error(err)


def test_process_command_not_found_is_one_line(capsys, tmp_path, gguf):
    text = toy_profile(gguf).replace(toy_command(), '["/nonexistent/kestrel-xyz", "--flag"]')
    f = write(tmp_path, text)
    code, out, err = run(capsys, "run", "--profile", f, "--json")
    assert code == 2 and out == ""
    assert "command '/nonexistent/kestrel-xyz' not found; fix `command` in the profile" in one_line_error(err)
    code, out, err = run(capsys, "bisect", "--profile", f, "--json")
    assert code == 2 and "not found" in one_line_error(err)


def test_dump_with_a_process_command_not_found_writes_nothing(capsys, tmp_path, gguf):
    text = toy_profile(gguf).replace(toy_command(), '["/nonexistent/kestrel-xyz"]')
    f = write(tmp_path, text)
    out = tmp_path / "out.txt"
    code, _, err = run(capsys, "dump", "--profile", f, "--backend", "subject", "--out", out)
    assert code == 2 and "not found" in one_line_error(err)
    assert nothing_written(tmp_path, out)


@pytest.mark.parametrize("cmd", ["run", "bisect", "iso"])
def test_subject_together_with_profile_is_one_line(capsys, tmp_path, gguf, cmd):
    f = write(tmp_path, toy_profile(gguf))
    code, out, err = run(capsys, cmd, "--subject", "sim", "--profile", f)
    ln = one_line_error(err)
    assert code == 2 and out == ""
    assert f"--subject sim and --profile {f}: the profile names the subject; drop one" in ln


def test_tui_subject_together_with_profile_is_one_line(capsys, tmp_path, gguf, monkeypatch):
    from kestrel_tui.app import main as app_main

    started = []
    monkeypatch.setattr(app_main, "run_app", lambda args: started.append(args) or 0)
    f = write(tmp_path, toy_profile(gguf))
    code, _, err = run(capsys, "tui", "--subject", "sim", "--profile", f)
    assert not started, "the app must not start"
    assert code == 2 and "drop one" in one_line_error(err)


# ---- runs -------------------------------------------------------------------------------------------


def test_run_json_on_the_toy_diff_then_all_ok(capsys, tmp_path, gguf, model, ref):
    f = write(tmp_path, toy_profile(gguf))
    code, out, err = run(capsys, "run", "--profile", f, "--json")
    rep = json.loads(out)
    want = compare(ref.hashes(), sim_hashes(model, ref, "none"))  # the toy with TOY_EXACT=none
    assert code == 1
    assert rep["first_diff"] == want.first_diff is not None and not rep["all_ok"]
    assert rep["counts"] == {st.value: n for st, n in want.counts.items()}
    assert rep["positions"] == len(PROMPT) + N and rep["missing"] == 0
    assert rep["subject"].startswith("toy_engine.py") and rep["settings"]["exact"] == []
    assert any("runs its own prefill" in n for n in rep["notes"])
    assert any(ln.startswith("note: ") and "runs its own prefill" in ln for ln in err.splitlines())

    code, out, _ = run(capsys, "run", "--profile", f, "--json", "--exact", "all")
    rep = json.loads(out)
    assert code == 0 and rep["all_ok"] and rep["first_diff"] is None and rep["settings"]["exact"] == ["exact"]
    assert rep["subject"] == "toy_engine.py (exact=all)"
    assert rep["counts"]["DIFF"] == 0 and rep["counts"]["ok"] == len(ref.hashes())


def test_run_json_on_a_process_that_fails_midway(capsys, tmp_path, gguf, ref):
    f = write(tmp_path, toy_profile(gguf, "--fail-after", "4"))
    code, out, err = run(capsys, "run", "--profile", f, "--json", "--exact", "all")
    rep = json.loads(out)
    assert code == 3 and not rep["all_ok"] and rep["first_diff"] is None  # an engine failed: not a DIFF
    assert rep["positions"] == 4 and rep["missing"] == len(ref.hashes()) - len(ref.hashes(4))
    failed = [n for n in rep["notes"] if "exited with code 3 after 4 positions" in n]
    assert len(failed) == 1 and "failing after position 4 as asked" in failed[0]
    assert rep["failed"] == {"side": "subject", "engine": "toy_engine.py", "reason": failed[0]}
    lines = [ln for ln in err.splitlines() if "exited with code 3" in ln]
    assert len(lines) == 1 and lines[0].startswith("kestrel-tui run: the subject failed: ")


def test_hash_only_subject_has_no_top1_flips(capsys, tmp_path, gguf):
    f = write(tmp_path, toy_profile(gguf))
    code, out, _ = run(capsys, "run", "--profile", f, "--json", "--exact", "all")
    rep = json.loads(out)
    assert code == 0 and rep["all_ok"]
    assert rep["top1_flips"] == []


def test_run_with_the_sidecar_and_a_tolerance_gives_per_key_metrics(capsys, tmp_path, gguf, model, ref):
    f = write(tmp_path, toy_profile(gguf, raw=True))
    code, out, _ = run(capsys, "run", "--profile", f, "--json", "--tol", "nmse=1e-7")
    rep = json.loads(out)
    want = compare(ref.hashes(), sim_hashes(model, ref, "none"))
    diff_keys = [k for k, st in want.status.items() if st.value == "DIFF"]
    name, value = rep["tolerance"].split("=")
    assert (name, float(value)) == ("nmse", 1e-7) and rep["first_diff"] == want.first_diff
    assert list(rep["key_metrics"]) == diff_keys
    for k, m in rep["key_metrics"].items():
        assert m is not None, f"{k}: the sidecar gave raw values, so every DIFF key is judged"
        assert m["verdict"] in ("close", "far") and m["nmse"] > 0
        assert m["verdict"] == ("close" if m["nmse"] <= 1e-7 else "far"), k
    cf = rep["counts_close_far"]
    assert cf["unjudged"] == 0 and cf["close"] + cf["far"] == len(diff_keys)
    far = [k for k, m in rep["key_metrics"].items() if m["verdict"] == "far"]
    assert rep["first_far"] == (far[0] if far else None)
    assert code == (1 if far else 0)
    assert rep["top1_flips"] == [t for t in rep["top1_flips"] if t["sub"] >= 0]  # logits from the sidecar


def test_bisect_json_ends_at_the_minimal_set(capsys, tmp_path, gguf, model, ref):
    chosen = ("norm", "rope", "expf")
    needed = {op for op in chosen if sim_hashes(model, ref, frozenset(set(TOGGLES) - {op})) != ref.hashes()}
    assert needed
    toggles = "".join(f'[[toggle]]\nname = "{t.name}"\nkey = "TOY_{t.name.upper()}_EXACT"\nfast = "0"\nexact = "1"\n'
                      f"owns = {json.dumps(list(t.owns))}\n\n" for t in OP_TOGGLES if t.name in chosen)
    toggles += '[[toggle]]\nname = "unused"\nkey = "TOY_UNUSED"\nfast = "0"\nexact = "1"\n'
    others = ",".join(op for op in TOGGLES if op not in chosen)
    f = write(tmp_path, toy_profile(gguf, options=f"env = {{ TOY_EXACT = {q(others)} }}\n", toggles=toggles))
    code, out, _ = run(capsys, "bisect", "--profile", f, "--json")
    rep = json.loads(out)
    assert code == 0 and rep["all_ok"]
    assert set(rep["minimal"]) == needed and set(rep["final"]) >= needed and "unused" not in rep["minimal"]
    assert rep["moves"] and rep["moves"][-1]["after"] is None
    assert all(m["change"].startswith("+") for m in rep["moves"])


def test_dump_of_the_subject_reads_back_in_diff(capsys, tmp_path, gguf, model, ref):
    f = write(tmp_path, toy_profile(gguf))
    r, s_fast, s_exact = tmp_path / "ref.txt", tmp_path / "fast.txt", tmp_path / "exact.txt"
    assert run(capsys, "dump", "--profile", f, "--backend", "reference", "--out", r)[0] == 0
    code, out, _ = run(capsys, "dump", "--profile", f, "--backend", "subject", "--out", s_fast, "--exact", "none")
    assert code == 0 and f"wrote {s_fast}: {len(PROMPT) + N} positions" in out and "(toy_engine.py)" in out
    code, out, _ = run(capsys, "dump", "--profile", f, "--out", s_exact, "--exact", "all")  # the subject, all exact
    assert code == 0 and "(toy_engine.py (exact=all))" in out
    s_start = tmp_path / "start.txt"  # no --exact: the subject as the session starts it (its toggles' defaults)
    assert run(capsys, "dump", "--profile", f, "--out", s_start)[0] == 0
    assert read_dump(s_start) == read_dump(s_fast)
    assert read_dump(r) == ref.hashes() == read_dump(s_exact)
    # dump asks for no teacher forcing: the toy decodes its own tokens, as the in-process sim does
    assert read_dump(s_fast) == run_decode(make_backend("sim", model, exact="none"), PROMPT, N).hashes()
    code, out, _ = run(capsys, "diff", r, s_exact)
    assert code == 0 and "identical" in out
    code, out, _ = run(capsys, "diff", r, s_fast)
    assert code == 1 and f"first DIFF: {compare(ref.hashes(), read_dump(s_fast)).first_diff}" in out
    assert not list(tmp_path.glob("*.partial"))


def test_dump_backend_other_than_a_side_with_a_profile(capsys, tmp_path, gguf):
    f = write(tmp_path, toy_profile(gguf))
    out = tmp_path / "out.txt"
    code, _, err = run(capsys, "dump", "--profile", f, "--backend", "sim", "--out", out)
    ln = one_line_error(err)
    assert code == 2 and "--backend 'sim'" in ln and "reference or subject" in ln
    assert nothing_written(tmp_path, out)
