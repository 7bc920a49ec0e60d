"""The headless commands: outputs, exit codes, one-line errors, never overwriting."""
import json
import os
import re
import stat

import numpy as np
import pytest

from kestrel_tui.backends.base import NumpyBackend
from kestrel_tui.backends.toggles import OWNERS, TOGGLES
from kestrel_tui.trace.keys import order_key

from clitools import one_line_error, run_cli as run


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


def test_generate_prints_ids(capsys, default_model):
    prompt, n = [1, 2, 3], 3
    code, out, _ = run(capsys, "generate", "--tokens", str(n), "--prompt-ids", ",".join(map(str, prompt)))
    # the greedy tokens, stepped here by hand on the reference (the embedded default model):
    # the argmax of the last prompt position's logits, fed back in, and so on
    backend = NumpyBackend(default_model, kv="q8")
    backend.reset(len(prompt) + n)
    logits = backend.step(np.array(prompt), 0, raw=False).logits[-1]
    want = []
    for i in range(n):
        want.append(int(np.argmax(logits)))
        if i < n - 1:
            logits = backend.step(np.array(want[-1:]), len(prompt) + i, raw=False).logits[0]
    assert code == 0 and out.split() == [str(t) for t in want]
    assert all(0 <= t < default_model.cfg.vocab for t in want)


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


_MOVE = re.compile(r"\+(\w+) +(\S+) -> (all ok|\S+)")
_FINAL = re.compile(r"all ok with (\d+) exact ops; minimal set: (\S+)")


def test_bisect_cli_twice_same_output(capsys):
    first = run(capsys, "bisect")
    second = run(capsys, "bisect")
    assert first[0] == 0 and second[0] == 0 and first[1] == second[1]
    *lines, final = first[1].strip().splitlines()
    moves = [_MOVE.fullmatch(line.rstrip()) for line in lines]
    assert moves and all(moves), first[1]
    ops, befores, afters = ([m[i] for m in moves] for i in (1, 2, 3))
    # all fast, the first DIFF is layer 0's input RMSNorm at the first decoded position; it reads
    # only the embedding (never different), so switching the norm op is the first move and stays needed
    assert befores[0] == "t16_l0_nrm" and ops[0] in OWNERS["nrm"]
    # each move starts where the last one left the first DIFF, never moves it earlier, and the last ends all ok
    assert befores[1:] == afters[:-1] and afters[-1] == "all ok"
    assert all(order_key(a) >= order_key(b) for b, a in zip(befores, afters[:-1]))
    assert len(set(ops)) == len(ops) and set(ops) <= set(TOGGLES)
    # one op switched per move; the minimal set is a sorted subset of them
    m = _FINAL.fullmatch(final.strip())
    assert m and int(m[1]) == len(ops), final
    minimal = m[2].split(",")
    assert minimal == sorted(minimal) and ops[0] in minimal and set(minimal) <= set(ops), final
