"""The headless commands: outputs, exit codes, one-line errors, never overwriting."""
import json
import os
import stat

import pytest

from kestrel_tui.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_dump_twice_identical_and_never_overwritten(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    assert run(capsys, "dump", "--tokens", "2", "--out", str(a))[0] == 0
    assert run(capsys, "dump", "--tokens", "2", "--out", str(b))[0] == 0
    assert a.read_bytes() == b.read_bytes()
    lines = a.read_text().splitlines()
    assert len(lines) == 18 * 530 and lines[0].startswith("t0_emb ") and lines[-1].startswith("t17_logits ")
    before = a.read_bytes()
    code, out, err = run(capsys, "dump", "--tokens", "1", "--out", str(a))
    assert code == 2 and "exists" in one_line_error(err)
    assert a.read_bytes() == before


def test_diff_exit_codes_and_first_diff(tmp_path, capsys):
    a = tmp_path / "ref.txt"
    assert run(capsys, "dump", "--tokens", "1", "--out", str(a))[0] == 0
    code, out, _ = run(capsys, "diff", str(a), str(a))
    assert code == 0 and "identical" in out
    lines = a.read_text().splitlines()
    i = lines.index(next(l for l in lines if l.startswith("t3_l5_attn ")))
    tag, h = lines[i].split()
    lines[i] = f"{tag} {int(h, 16) ^ 1:016x}"
    lines[i + 3] = lines[i + 3].split()[0] + " 0000000000000000"  # a later DIFF: not the first
    del lines[-1]  # a key missing on one side
    b = tmp_path / "sub.txt"
    b.write_text("\n".join(lines) + "\n")
    code, out, _ = run(capsys, "diff", str(a), str(b))
    assert code == 1 and "first DIFF: t3_l5_attn" in out


@pytest.mark.parametrize("content, needle", [
    ("", "empty"),
    ("t0_emb 0123456789abcdef\nt0_emb 0123456789abcdef\n", "duplicate"),
    ("t0_emb 0123456789abcdef\nt0_l0_nrm 12345\n", ":2:"),
    ("t0_emb 0123456789abcdef extra\n", ":1:"),
])
def test_diff_bad_dump_files(tmp_path, capsys, content, needle):
    good = tmp_path / "good.txt"
    good.write_text("t0_emb 0123456789abcdef\n")
    bad = tmp_path / "bad.txt"
    bad.write_text(content)
    code, _, err = run(capsys, "diff", str(good), str(bad))
    assert code == 2 and needle in one_line_error(err)


def test_diff_missing_file(tmp_path, capsys):
    code, _, err = run(capsys, "diff", str(tmp_path / "nope.txt"), str(tmp_path / "nope2.txt"))
    assert code == 2 and "nope.txt" in one_line_error(err)


def test_generate_prints_ids(capsys):
    code, out, _ = run(capsys, "generate", "--tokens", "3", "--prompt-ids", "1,2,3")
    ids = out.split()
    assert code == 0 and len(ids) == 3 and all(0 <= int(i) < 2048 for i in ids)


@pytest.mark.parametrize("argv, needle", [
    (["run", "--exact", "norm,bogus", "--tokens", "1"], "bogus"),
    (["run", "--tokens", "0"], "--tokens"),
    (["iso", "--m", "0"], "--m"),
    (["run", "--subject", "cpu", "--tokens", "1"], "--subject"),
    (["run", "--prompt-ids", ",".join(["1"] * 4096), "--tokens", "1"], "context"),
    (["generate", "--prompt-ids", "1,x"], "--prompt-ids"),
    (["generate", "--prompt-ids", "99999"], "vocabulary"),
    (["generate", "--prompt", "hello"], "tokenizer"),
    (["dump", "--tokens", "1", "--out", "/nonexistent-dir/x.txt"], "directory"),
])
def test_bad_input_one_line_exit_2(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in one_line_error(err)


def test_unwritable_output(tmp_path, capsys):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    # root ignores directory permissions; /proc refuses new files to everyone
    target = "/proc/kestrel-x.txt" if os.geteuid() == 0 else str(d / "x.txt")
    code, _, err = run(capsys, "dump", "--tokens", "1", "--out", target)
    assert code == 2 and "x.txt" in one_line_error(err)


def test_model_dir_errors(tmp_path, capsys):
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--tokens", "1")
    assert code == 2 and "config.json" in one_line_error(err)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--tokens", "1")
    assert code == 2 and "unsupported architecture" in one_line_error(err)


def test_run_json_and_exact_all(capsys):
    code, out, _ = run(capsys, "run", "--subject", "sim", "--exact", "all", "--tokens", "2", "--json")
    report = json.loads(out)
    assert code == 0 and report["all_ok"] and report["first_diff"] is None
    code, out, _ = run(capsys, "run", "--subject", "sim", "--exact", "none", "--tokens", "2", "--json")
    report = json.loads(out)
    assert code == 1 and report["first_diff"].startswith("t16_l0_")


def test_iso_cli(capsys):
    code, out, _ = run(capsys, "iso", "--m", "3", "--exact", "all", "--json", "--tokens", "3")
    cols = json.loads(out)
    assert code == 0 and [c["ndiff"] for c in cols] == [0, 0, 0]


def test_bisect_cli_twice_same_output(capsys):
    first = run(capsys, "bisect")
    second = run(capsys, "bisect")
    assert first[0] == 0 and "all ok" in first[1] and "minimal set" in first[1]
    assert "->" in first[1]
    assert first[1] == second[1]
