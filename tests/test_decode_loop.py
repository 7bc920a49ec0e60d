"""The engines' one decode loop (engines/decode.py), on a step that only records what it was asked, and
the engines that step a model feeding it (read from their source: no torch, no llama.cpp needed)."""
from __future__ import annotations

import ast
import threading
from pathlib import Path

import numpy as np
import pytest

from kestrel_tui.backends.base import StepOut
from kestrel_tui.engines.base import RunRequest
from kestrel_tui.engines.decode import decode_loop
from kestrel_tui.trace.run import Cancelled, Position, Trace

VOCAB = 16
ENGINES = Path(__file__).resolve().parents[1] / "kestrel_tui" / "engines"
STEPPING = ("builtin.py", "hf.py", "hf_dist.py", "llamacpp.py", "hf_batch.py")  # the engines that step a model


class Recorder:
    """A step whose top-1 after token ``tok`` is ``(tok * 3 + 1) % VOCAB``; ``calls`` lists its (tokens, pos0)."""

    def __init__(self):
        self.calls = []

    def __call__(self, tokens, pos0):
        self.calls.append((list(tokens), pos0))
        logits = np.zeros((len(tokens), VOCAB), np.float32)
        for m, tok in enumerate(tokens):
            logits[m, (tok * 3 + 1) % VOCAB] = 1.0
        keys = [f"t{pos0 + m}_emb" for m in range(len(tokens))]
        return StepOut(logits=logits, hashes=[{k: pos0 + m} for m, k in enumerate(keys)],
                       raw=[{k: np.full(2, pos0 + m, np.float32)} for m, k in enumerate(keys)])


def _run(req, **kw):
    step = Recorder()
    trace = decode_loop(req, Trace("fake", list(req.prompt)), step, **kw)
    return trace, step.calls


def test_the_prompt_in_one_step_or_token_by_token_then_its_own_top1():
    trace, calls = _run(RunRequest([5, 2, 7], 3, {}))
    assert calls == [([5, 2, 7], 0), ([6], 3), ([3], 4), ([10], 5)]  # 7 -> 6 -> 3 -> 10
    assert [p.token for p in trace.positions] == [5, 2, 7, 6, 3, 10]
    assert [p.prompt for p in trace.positions] == [True] * 3 + [False] * 3
    assert trace.positions[4].raw["t4_emb"].tolist() == [4.0, 4.0]
    _, calls = _run(RunRequest([5, 2, 7], 1, {}), token_prefill=True)
    assert calls == [([5], 0), ([2], 1), ([7], 2), ([6], 3)]


def test_forced_tokens_stop_raw_and_on_position():
    seen = []
    trace, calls = _run(RunRequest([1], 4, {}, forced=[9, 8, 7, 6], raw=False, on_position=seen.append,
                                   stop=lambda: len(seen) >= 3))
    assert calls == [([1], 0), ([9], 1), ([8], 2)]  # stopped before the fourth position
    assert seen == trace.positions and all(p.raw is None for p in trace.positions)


def test_cancel_between_prompt_tokens_and_positions():
    for token_prefill, steps in ((True, [([1], 0)]), (False, [([1, 2, 3], 0)])):
        cancel = threading.Event()
        req = RunRequest([1, 2, 3], 2, {}, cancel=cancel, on_position=lambda p: cancel.set())
        step = Recorder()
        with pytest.raises(Cancelled):
            decode_loop(req, Trace("fake", [1, 2, 3]), step, token_prefill=token_prefill)
        assert step.calls == steps  # set at the first position told: nothing more was asked of the engine


def test_the_reference_prefill_where_the_engine_takes_one():
    ref = [Position(t, tok, True, {f"t{t}_emb": 0}, None, np.eye(VOCAB, dtype=np.float32)[4]) for t, tok
           in enumerate([1, 2])]
    taken = []
    req = RunRequest([1, 2], 1, {}, prefill_from=Trace("ref", [1, 2], ref))
    trace, calls = _run(req, take_prefill=taken.append)
    assert taken == [ref] and trace.positions[:2] == ref
    assert calls == [([4], 2)]  # the reference's top-1 after the prompt
    _, calls = _run(req)  # an engine that takes none runs its own prefill
    assert calls[0] == ([1, 2], 0)


def test_an_empty_prompt_is_refused_by_the_request_itself():
    with pytest.raises(ValueError, match="the prompt is empty"):
        RunRequest([], 3, {})


def _reads(path: Path) -> tuple[set[str], set[str], str]:
    """(names called, attributes read, the source) of one module."""
    src = path.read_text()
    tree = ast.parse(src)
    called = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return called, attrs, src


@pytest.mark.parametrize("module", STEPPING)
def test_every_stepping_engine_feeds_the_one_loop(module):
    """Its step goes to decode_loop; choosing the next token, telling on_position and the empty-prompt
    guard are the loop's and the request's, not the engine's."""
    called, attrs, src = _reads(ENGINES / module)
    assert "decode_loop" in called
    assert not {"top1", "on_position"} & attrs
    assert "the prompt is empty" not in src
