"""`kestrel-tui logprobs A.jsonl B.jsonl`: the figures against numpy computed here from the same files, and
every kind of bad file as one line naming the file and the line, exit 2 (fuzzed too: never a traceback)."""
import contextlib
import io
import json
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kestrel_tui.cli import main
from kestrel_tui.trace import logprob_files

from clitools import one_line_error, run_cli as run

SUM_REL = 1e-12  # k1 / k3: the tally adds per sequence, numpy all at once; relative to the mean |term|


def write(path, lines) -> str:
    """A JSONL file: dicts are dumped, str / bytes written as they are."""
    with open(path, "wb") as f:
        for line in lines:
            data = json.dumps(line) if isinstance(line, dict) else line
            f.write((data.encode() if isinstance(data, str) else data) + b"\n")
    return str(path)


def seq(ids, lps) -> dict:
    return {"token_ids": list(ids), "logprobs": list(lps)}


GOOD = seq([1, 2, 3], [-0.5, -1.0, -2.0])


def fail(capsys, tmp_path, a_lines, b_lines=(GOOD,)) -> str:
    a = write(tmp_path / "a.jsonl", a_lines)
    b = write(tmp_path / "b.jsonl", b_lines)
    code, out, err = run(capsys, "logprobs", a, b)
    assert code == 2, (out, err)
    return one_line_error(err)


# ---------------------------------------------------------------- the figures, computed again with numpy

def _files(tmp_path, rng):
    """Random sequences: some tokens bitwise-equal, some far outside the bands, a null first token in A, and
    B logging prompt + response where A logs the response (a suffix pair) on some lines."""
    a_lines, b_lines, pairs = [], [], []
    for i in range(7):
        n = int(rng.integers(3, 40))
        ids = rng.integers(0, 50_000, n).tolist()
        a = -rng.exponential(1.0, n)
        b = -np.abs(a + rng.normal(0, 0.08, n))
        same = rng.random(n) < 0.3
        b[same] = a[same]
        far = rng.random(n) < 0.1
        b[far] = a[far] - rng.uniform(0.5, 4.0, far.sum())
        a_lp = [None] + a[1:].tolist()
        if i % 2:  # a trainer's line: the prompt's tokens first
            prompt = rng.integers(0, 50_000, 5).tolist()
            b_lines.append(seq(prompt + ids, [None] + (-rng.exponential(1, 4)).tolist() + b.tolist()))
        else:
            b_lines.append(seq(ids, b.tolist()))
        a_lines.append(seq(ids, a_lp))
        pairs.append((ids, a[1:], b[1:]))  # what is scored: every token but A's null first
    return write(tmp_path / "a.jsonl", a_lines), write(tmp_path / "b.jsonl", b_lines), pairs


def _histogram(lr: np.ndarray) -> list[int]:
    """The bins as the tally documents them: below -1, [e_i, e_i+1) up to 0, 0 alone, (0, 1e-6), [e_i, e_i+1)
    up to 1, at or above 1, NaN."""
    bands = [math.log(v) for v in (0.8, 0.9, 1.1, 1.2)]
    neg = sorted([-1.0, -0.5, -0.05, -0.01, -1e-4, -1e-6, *[e for e in bands if e < 0], 0.0])
    pos = sorted([1e-6, 1e-4, 1e-2, 0.05, *[e for e in bands if e > 0], 0.5, 1.0])
    counts = [int((lr < neg[0]).sum())]
    counts += [int(((lr >= lo) & (lr < hi)).sum()) for lo, hi in zip(neg, neg[1:])]
    counts += [int((lr == 0).sum()), int(((lr > 0) & (lr < pos[0])).sum())]
    counts += [int(((lr >= lo) & (lr < hi)).sum()) for lo, hi in zip(pos, pos[1:])]
    return counts + [int((lr >= pos[-1]).sum()), int(np.isnan(lr).sum())]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_figures_equal_numpy_s_on_the_same_files(capsys, tmp_path, seed):
    rng = np.random.default_rng([seed, os.getpid()])  # fresh inputs each run; the seed list is printed on failure
    a_path, b_path, pairs = _files(tmp_path, rng)
    code, out, err = run(capsys, "logprobs", a_path, b_path, "--json")
    got = json.loads(out)
    a = np.concatenate([p[1] for p in pairs])
    b = np.concatenate([p[2] for p in pairs])
    lr = b - a
    r = np.exp(lr)
    assert code == 1 and err == ""
    assert (got["a"], got["b"], got["sequences"], got["tokens"]) == (a_path, b_path, len(pairs), a.size)
    assert got["bitwise_tokens"] == int((a == b).sum())
    assert got["outside_0.8_1.2"] == int(((r < 0.8) | (r > 1.2)).sum()) / a.size
    assert got["outside_0.9_1.1"] == int(((r < 0.9) | (r > 1.1)).sum()) / a.size
    assert got["outside_0.8_1.2"] > 0  # the far tokens are there
    assert abs(got["k1"] - np.mean(-lr)) <= SUM_REL * np.mean(np.abs(lr))
    k3 = r - 1 - lr
    assert abs(got["k3"] - np.mean(k3)) <= SUM_REL * np.mean(np.abs(k3))
    assert got["max_abs_dp"] == np.max(np.abs(np.exp(b) - np.exp(a)))
    geo = [np.exp(np.mean(pb - pa)) for _, pa, pb in pairs]
    assert (got["seq_geo_ratio_min"], got["seq_geo_ratio_max"]) == (min(geo), max(geo))
    assert list(got["histogram"].values()) == _histogram(lr)
    k = int(np.argmax(np.abs(lr)))
    line = int(np.searchsorted(np.cumsum([p[1].size for p in pairs]), k, side="right"))
    j = k - sum(p[1].size for p in pairs[:line]) + 1  # A's index: past its null first token
    ids = pairs[line][0]
    assert got["worst_token"]["line"] == line + 1 and got["worst_token"]["index_a"] == j
    assert got["worst_token"]["token_id"] == ids[j] and got["worst"]["abs_log_ratio"] == abs(lr[k])
    assert got["worst_token"]["index_b"] == j + (5 if line % 2 else 0)


def test_the_same_floats_everywhere_exit_0_and_the_text_names_the_figures(capsys, tmp_path):
    a = write(tmp_path / "a.jsonl", [GOOD, GOOD])
    code, out, err = run(capsys, "logprobs", a, a)
    assert code == 0 and err == ""
    assert "over 6 token(s) of 2 sequence(s): 6 bitwise-equal" in out and "0.00% outside [0.8, 1.2]" in out


def test_suffix_either_way_nulls_and_crlf(capsys, tmp_path):
    a = write(tmp_path / "a.jsonl", [json.dumps(seq([9, 1, 2, 3], [None, -0.1, -1.0, -2.0])) + "\r",
                                     seq([2, 3], [None, -3.0])])
    b = write(tmp_path / "b.jsonl", [seq([1, 2, 3], [-0.5, None, -2.5]), seq([7, 2, 3], [-1.0, -1.0, -3.0])])
    code, out, _ = run(capsys, "logprobs", a, b, "--json")
    got = json.loads(out)
    assert code == 1 and (got["tokens"], got["bitwise_tokens"]) == (3, 1)  # 1: -0.1/-0.5, 3: -2/-2.5, 3: -3/-3
    assert got["worst_token"] == {"line": 1, "index_a": 3, "index_b": 2, "token_id": 3, "logprob_a": -2.0,
                                  "logprob_b": -2.5}


def test_minus_infinity_in_b_is_a_zero_probability(capsys, tmp_path):
    a = write(tmp_path / "a.jsonl", [GOOD])
    b = write(tmp_path / "b.jsonl", ['{"token_ids": [1, 2, 3], "logprobs": [-0.5, -Infinity, -2.0]}'])
    code, out, _ = run(capsys, "logprobs", a, b)
    assert code == 1 and "k1 inf" in out


@pytest.mark.parametrize("tty", [True, False])
def test_a_progress_bar_over_both_files_bytes_on_a_terminal_only(capsys, tmp_path, monkeypatch, tty):
    from rich.progress import Progress

    from kestrel_tui import terminal

    advanced = []
    monkeypatch.setattr(terminal.err_console, "_force_terminal", tty)
    monkeypatch.setattr(Progress, "advance", lambda self, task, n: advanced.append(n))
    a = write(tmp_path / "a.jsonl", [GOOD] * 3)
    b = write(tmp_path / "b.jsonl", [GOOD, GOOD, seq([0, 1, 2, 3], [None, -0.5, -1.0, -2.0])])
    code, _, _ = run(capsys, "logprobs", a, b)
    assert code == 0
    assert sum(advanced) == (os.path.getsize(a) + os.path.getsize(b) if tty else 0)
    assert len(advanced) == (6 if tty else 0)  # a line at a time


# ---------------------------------------------------------------- bad files: one line, exit 2

BAD_LINES = [
    ("{", "a.jsonl:1: not JSON"),
    ("[1, 2]", "a.jsonl:1: an array, not an object"),
    ('{"token_ids": [1]}', 'a.jsonl:1: no "logprobs" key (its keys: token_ids)'),
    ('{"token_ids": [1], "logprobs": -1}', '"logprobs" is an integer, not an array'),
    (seq([1, 2], [-1.0]), "a.jsonl:1: 2 token_ids but 1 logprobs"),
    (seq([1], ["-1"]), "logprobs[0] is a string, not a number or null"),
    (seq([1], [True]), "logprobs[0] is true, not a number or null"),
    ('{"token_ids": [1], "logprobs": [NaN]}', "logprobs[0] is NaN"),
    ('{"token_ids": [1], "logprobs": [Infinity]}', "logprobs[0] is Infinity"),
    (seq([1, 2], [-1.0, 0.5]), "logprobs[1] is 0.5, above 0"),
    ('{"token_ids": [1], "logprobs": [-Infinity]}', "the reference chose this token"),
    ('{"token_ids": [1], "logprobs": [-1e400]}', "beyond float64's range"),
    ('{"token_ids": [1], "logprobs": [-1%s]}' % ("0" * 400), "logprobs[0] is beyond float64's range"),
    ('{"token_ids": [1], "logprobs": [-1%s]}' % ("0" * 5000), "a number of thousands of digits"),
    (seq([3.0], [-1.0]), "token_ids[0] is a number, not an integer"),
    (seq(["3"], [-1.0]), "token_ids[0] is a string, not an integer"),
    (seq([False], [-1.0]), "token_ids[0] is false, not an integer"),
    (seq([-1], [-1.0]), "token_ids[0] is -1, not a token id"),
    (seq([2 ** 31], [-1.0]), "token_ids[0] is 2147483648, not a token id"),
    (seq([10 ** 90], [-1.0]), "not a token id"),
    ("   ", "a.jsonl:1: a blank line"),
    (b"\xff{}", "a.jsonl:1: not UTF-8 (byte 0xff at column 1)"),
    ("[" * 100_000 + "]" * 100_000, "a.jsonl:1: not JSON"),
    ("\ufeff" + json.dumps(GOOD), "a.jsonl:1: not JSON"),
]


@pytest.mark.parametrize("line, says", BAD_LINES, ids=[s for _, s in BAD_LINES])
def test_a_bad_line_is_one_line_naming_the_file_and_line(capsys, tmp_path, line, says):
    assert says in fail(capsys, tmp_path, [line])


def test_the_line_number_is_the_bad_one_s_and_b_is_named_too(capsys, tmp_path):
    msg = fail(capsys, tmp_path, [GOOD, GOOD], [GOOD, seq([1, 2, 3], [-1.0, 0.25, -1.0])])
    assert "b.jsonl:2: logprobs[1] is 0.25, above 0" in msg


def test_other_tokens_are_one_line_naming_where_they_differ(capsys, tmp_path):
    msg = fail(capsys, tmp_path, [seq([5, 1, 2, 3], [-1.0] * 4)], [seq([1, 9, 3], [-1.0] * 3)])
    assert "a.jsonl:1 and" in msg and "first differ at A[2] = 2, B[1] = 9" in msg


@pytest.mark.parametrize("a_lines, b_lines, says", [
    ([GOOD, GOOD], [GOOD], "b.jsonl has 1 line(s) and"),
    ([GOOD], [GOOD, GOOD], "a.jsonl has 1 line(s) and"),
    ([], [GOOD], "a.jsonl is empty and"),
    ([], [], "are empty: no sequence"),
    ([seq([1, 2], [None, -1.0])], [seq([1, 2], [-1.0, None])], "no token has a log-probability on both sides"),
])
def test_files_that_do_not_pair(capsys, tmp_path, a_lines, b_lines, says):
    assert says in fail(capsys, tmp_path, a_lines, b_lines)


def test_a_directory_a_fifo_and_a_missing_file(capsys, tmp_path):
    good = write(tmp_path / "good.jsonl", [GOOD])
    os.mkfifo(tmp_path / "fifo")
    for path, says in ((tmp_path, "is a directory"), (tmp_path / "fifo", "a FIFO"),
                       (tmp_path / "nope.jsonl", "no such file")):
        code, _, err = run(capsys, "logprobs", good, path)
        assert code == 2 and says in one_line_error(err) and str(path) in err


def test_a_line_past_the_limit_is_refused_at_that_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(logprob_files, "LINE_LIMIT", 1000)
    msg = fail(capsys, tmp_path, [GOOD, seq(range(200), [-1.0] * 200)])
    assert "a.jsonl:2: a line longer than" in msg


def test_outside_text_in_messages_is_inert(capsys, tmp_path):
    name = tmp_path / "[red]x\x1b]0;owned\x07.jsonl"
    write(name, ['{"\\u001b[2J": 1, "logprobs": []}'])  # a key holding ESC
    code, _, err = run(capsys, "logprobs", name, name)
    line = one_line_error(err)
    assert code == 2 and "\x1b" not in err and "\x07" not in err
    assert "[red]x\\x1b]0;owned\\x07.jsonl:1:" in line and '"token_ids"' in line and "\\x1b[2J" in line


# ---------------------------------------------------------------- fuzzed lines: one line or a result

_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                  max_size=3), max_leaves=10)
_number = st.none() | st.floats(max_value=0.0) | st.integers(-3, 1) | _value
_object = st.builds(lambda ids, lps, extra: {"token_ids": ids, "logprobs": lps, **extra},
                    st.lists(st.integers(-2, 2 ** 31) | _value, max_size=4), st.lists(_number, max_size=4),
                    st.dictionaries(st.sampled_from(["token_ids", "logprobs", "x"]), _value, max_size=1))
_line = (_object.map(json.dumps) | _value.map(json.dumps) | st.text(max_size=30)
         | st.binary(max_size=30).map(lambda b: b.decode("latin-1")))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a_lines=st.lists(_line, max_size=3), b_lines=st.lists(_line, max_size=3))
def test_fuzzed_lines_give_one_line_or_a_result(tmp_path, a_lines, b_lines):
    a = write(tmp_path / "a.jsonl", [s.replace("\n", " ").encode("utf-8", "surrogatepass") for s in a_lines])
    b = write(tmp_path / "b.jsonl", [s.replace("\n", " ").encode("utf-8", "surrogatepass") for s in b_lines])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["logprobs", a, b])
    if code == 2:
        one_line_error(err.getvalue())
    else:
        assert code in (0, 1) and err.getvalue() == "" and "logprob mismatch over" in out.getvalue()
