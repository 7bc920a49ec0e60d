"""`logprobs --model/--profile`: the worst sequence replayed with its own tokens on both sides, its first far
key and the graft from there."""
import json

import numpy as np
import pytest

from kestrel_tui.errors import UsageError
from kestrel_tui.model.config import default_config
from kestrel_tui.model.gguf import write_gguf
from kestrel_tui.model.weights import synthetic_model
from kestrel_tui.session.logprob_replay import replay_tokens, replay_worst
from kestrel_tui.trace.compare import Tolerance

from clitools import one_line_error, run_cli as run


@pytest.fixture(scope="module")
def two_layers():
    return synthetic_model(default_config().with_layers(2), "q4_0")


def test_the_replay_covers_the_positions_up_to_the_one_that_predicts_the_worst_token():
    assert replay_tokens([5, 6, 7, 8, 9], 3, vocab=10, max_positions=64) == ([5], [6, 7])
    assert replay_tokens([5, 6, 7], 1, vocab=10, max_positions=64) == ([5], [6])  # one forced token at least
    with pytest.raises(UsageError, match="past the model's vocabulary"):
        replay_tokens([5, 60, 7], 2, vocab=10, max_positions=64)
    with pytest.raises(UsageError, match="past the model's 2 positions"):
        replay_tokens([5, 6, 7, 8], 3, vocab=10, max_positions=2)


def test_both_sides_consume_the_file_s_tokens(two_layers):
    ids = [3, 1000, 17, 2000, 42, 7]
    session, result = replay_worst(two_layers, ids, 4, "cpu", "sim", kv="q8", deep=False, tol=Tolerance())
    consumed = [p.token for p in session.reference().positions]
    assert consumed == ids[:4]  # not the reference's greedy tokens
    assert [p.token for p in result.last.sub.positions] == ids[:4]
    assert result.start is not None and result.start.startswith("t1_")  # position 0 is the reference's prefill


def _files(tmp_path):
    rng = np.random.default_rng(7)
    a_lines, b_lines = [], []
    for i in range(3):
        ids = rng.integers(0, 2048, 6).tolist()
        a = -rng.exponential(1, 6)
        b = a.copy()
        b[i + 2] -= i + 1.0  # line 3, token 4: the largest |log-ratio|
        a_lines.append(json.dumps({"token_ids": ids, "logprobs": [None, *a[1:].tolist()]}))
        b_lines.append(json.dumps({"token_ids": ids, "logprobs": [None, *b[1:].tolist()]}))
    (tmp_path / "a.jsonl").write_text("\n".join(a_lines) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(b_lines) + "\n")
    return tmp_path / "a.jsonl", tmp_path / "b.jsonl"


def test_the_command_replays_the_worst_line_and_grafts(capsys, tmp_path, two_layers):
    write_gguf(two_layers, tmp_path / "m.gguf")
    a, b = _files(tmp_path)
    code, out, _ = run(capsys, "logprobs", a, b, "--model", tmp_path / "m.gguf", "--json")
    got = json.loads(out)
    assert code == 1 and got["worst_token"]["line"] == 3 and got["worst_token"]["index_a"] == 4
    replay = got["replay"]
    assert (replay["line"], replay["positions"], replay["tolerance"]) == (3, 4, Tolerance().spec())
    assert replay["first_far"] == replay["sources"][0]["key"] and replay["remaining"] is None
    code, out, _ = run(capsys, "logprobs", a, b, "--model", tmp_path / "m.gguf", "--tol", "ulp=0")
    assert code == 1 and "tolerance ulp=0): first far key t1_" in out


def test_tol_without_a_replay_is_one_line(capsys, tmp_path):
    a, b = _files(tmp_path)
    code, _, err = run(capsys, "logprobs", a, b, "--tol", "ulp=0")
    assert code == 2 and "needs --profile (or --model)" in one_line_error(err)
