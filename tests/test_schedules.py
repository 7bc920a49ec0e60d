"""Schedules (engines/schedule.py): the same tokens in other passes, on the built-in engines.

The cpu reference and the all-exact sim are bitwise under every schedule (numerics.md G3: columns are
independent), checked on every key and every logit bit; the fast sim's M>1 kernels are not, which is
what a schedule comparison is for. The hf and llama.cpp schedules are in tests/test_schedules_engines.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_tui.engines.base import EngineSpec, RunRequest
from kestrel_tui.engines.build import make_engine
from kestrel_tui.engines.builtin import OP_TOGGLES
from kestrel_tui.engines.schedule import KINDS, Schedule, parse_schedule
from kestrel_tui.errors import UsageError

from clitools import one_line_error, run_cli as run

PROMPT = [5, 77, 19, 33, 8, 9, 100, 3]
N = 6
SCHEDULES = ("forward", "chunked:1", "chunked:3", "chunked:64", "prefix:1", "prefix:5", "verify:2", "verify:4",
             "verify:8")


def _run(model, engine, schedule, values=None, forced=None, prompt=PROMPT, n=N):
    e = make_engine(EngineSpec(engine, options={"schedule": schedule}), model)
    return e.run(RunRequest(list(prompt), n, values or {}, forced=forced))


def _bits(trace):
    return ([p.hashes for p in trace.positions], [p.token for p in trace.positions],
            [p.logits.view(np.uint32).tobytes() for p in trace.positions])


@given(kind=st.sampled_from(KINDS), n=st.integers(1, 70), P=st.integers(1, 60), N=st.integers(0, 40),
       token_prefill=st.booleans())
@settings(max_examples=400, deadline=None)
def test_the_passes_cover_every_position_once_in_order(kind, n, P, N, token_prefill):
    s = Schedule(kind, n if kind in ("chunked", "prefix", "verify") else 0)
    if kind == "prefix" and n >= P:
        with pytest.raises(UsageError, match=r"^schedule prefix:\d+: the prompt has \d+ token"):
            s.groups(P, N)
        return
    groups = s.groups(P, N, token_prefill)
    covered = [t for pos0, m in groups for t in range(pos0, pos0 + m)]
    assert covered == list(range(P + N)) and all(m >= 1 for _, m in groups)
    if kind != "forward":  # the prompt and the generated positions never share a pass, but in forward
        assert any(pos0 + m == P for pos0, m in groups)
    widths = {"decode": None, "chunked": n, "verify": n}
    if kind in ("chunked", "verify"):
        assert max(m for _, m in groups) <= max(widths[kind], P if kind == "verify" else 0, 1)


@pytest.mark.parametrize("text,why", [("verify:0", "M is below 1"), ("chunked", "chunked needs its N"),
                                      ("forward:2", "forward takes no number"), ("decoder", "is no schedule"),
                                      ("prefix:1e3", "K "), ("chunked:99999999999999999999", "N ")])
def test_a_bad_schedule_is_one_line_naming_the_grammar(capsys, text, why):
    with pytest.raises(UsageError, match="write decode, forward, chunked:N, prefix:K or verify:M"):
        parse_schedule(text)
    code, out, err = run(capsys, "run", "--schedule", text, "--tokens", "1")
    assert code == 2 and why in one_line_error(err)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_cpu_reference_is_bitwise_under_every_schedule(default_model, schedule):
    decode = _run(default_model, "cpu", "decode")
    forced = [p.token for p in decode.positions[len(PROMPT):]]
    assert _bits(_run(default_model, "cpu", schedule, forced=forced)) == _bits(decode)


def test_a_scoring_schedule_without_tokens_decodes_them_first(default_model):
    """forward and verify score given tokens; given none, the engine's own rollout chooses them."""
    decode = _run(default_model, "cpu", "decode")
    for schedule in ("forward", "verify:3"):
        assert _bits(_run(default_model, "cpu", schedule)) == _bits(decode)


@pytest.mark.parametrize("schedule", ["forward", "verify:3", "chunked:3", "prefix:5"])
def test_the_all_exact_sim_is_bitwise_under_every_schedule(default_model, schedule):
    exact = {t.name: t.exact for t in OP_TOGGLES}
    decode = _run(default_model, "sim", "decode", exact)
    forced = [p.token for p in decode.positions[len(PROMPT):]]
    assert _bits(_run(default_model, "sim", schedule, exact, forced)) == _bits(decode)


def test_the_fast_sim_changes_bits_where_a_pass_widens_a_decode_position(default_model):
    """The fast kernels of M>1 columns are not those of M=1: forward's first DIFF is at the first generated
    position, where decode ran one column; chunked prefill keeps M>1 on the prompt and matches there."""
    decode = _run(default_model, "sim", "decode")
    forced = [p.token for p in decode.positions[len(PROMPT):]]
    forward = _run(default_model, "sim", "forward", forced=forced)
    first = next(p.t for p, q in zip(decode.positions, forward.positions) if p.hashes != q.hashes)
    assert first == len(PROMPT)
    assert _bits(_run(default_model, "sim", "chunked:3", forced=forced)) == _bits(decode)


def test_a_side_schedule_is_a_toggle_back_to_decode(default_model):
    e = make_engine(EngineSpec("sim", options={"schedule": "verify:4"}), default_model)
    t = e.toggle("schedule")
    assert (t.default, t.exact) == ("verify:4", "decode") and t.binary
    assert str(e.schedule({"schedule": "decode"})) == "decode" and str(e.schedule({})) == "verify:4"
    assert "schedule verify:4" in e.describe({}) and "schedule" not in e.describe({"schedule": "decode"})


def test_cli_schedule_flags_reach_each_side(capsys):
    code, out, err = run(capsys, "run", "--schedule", "forward", "--reference-schedule", "chunked:2",
                         "--subject", "sim", "--tokens", "3")
    assert code == 1 and "reference cpu schedule chunked:2 vs subject sim (all fast) schedule forward" in out, out
    assert "runs the prompt in its own passes: the subject prefills itself" in err
    assert "logprob mismatch over 4 token(s) of 1 sequence(s)" in out
    # --exact all is every toggle at its exact value: the schedule's is decode
    code, out, err = run(capsys, "run", "--schedule", "forward", "--subject", "sim", "--exact", "all", "--tokens", "3")
    assert code == 0 and "vs subject sim (all exact), " in out and "all ok" in out, out + err


def test_an_engine_that_runs_its_own_passes_refuses_a_schedule(capsys, tmp_path):
    prof = tmp_path / "p.toml"
    prof.write_text('[reference]\nengine = "cpu"\n[subject]\nengine = "process"\n[subject.options]\n'
                    'command = ["true"]\nschedule = "forward"\n')
    code, out, err = run(capsys, "run", "--profile", prof)
    assert code == 2 and "engine process runs its own passes" in one_line_error(err)
