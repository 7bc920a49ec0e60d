"""Invariance sweeps (session/sweep.py): where the answer changes, each time computed another way.

The batch-verify width M on the sim, against iso() run per M; a toggle on the sim, against the
session's own runs; batch composition on hf (a tiny Qwen3 made here), against a batched decode
written here with transformers alone; the JSON's shape; bad input in one line.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from kestrel_tui.engines.build import make_engine
from kestrel_tui.errors import UsageError
from kestrel_tui.model.config import default_config
from kestrel_tui.model.weights import synthetic_model
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.iso import iso
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.session.sweep import parse_values, sweep
from kestrel_tui.trace.compare import Tolerance, key_metrics
from kestrel_tui.trace.keys import order_key, parse_key

from hfmodels import cache_arg

N_TOKENS = 8


@pytest.fixture(scope="module")
def tiny():
    """The default's dims with 2 layers: a sweep of 8 widths in about a second."""
    return synthetic_model(default_config().with_layers(2), "q4_0")


def _session(model, n_tokens=N_TOKENS, **kw):
    return Session(model, default_prompt(model.cfg.vocab, 4), n_tokens, subject="sim", **kw)


def _all_exact(session) -> RunSettings:
    return RunSettings(exact=frozenset(session.binary_toggles))


def _changes(values, answers) -> list:
    """The values whose answer is not the previous value's."""
    return [v for v, a, prev in zip(values[1:], answers[1:], answers) if a != prev]


# ---------------------------------------------------------------- batch-verify width M

def test_m_all_exact_nothing_changes(tiny):
    s = _session(tiny)
    exact = _all_exact(s)
    result = sweep(s, "m", range(1, 9), settings=exact)
    assert result.changes == ()
    assert [r.first_diff for r in result.rows] == [None] * 8
    assert [r.logits_nmse for r in result.rows] == [0.0] * 8
    assert [(r.n_far, r.flips) for r in result.rows] == [(0, 0)] * 8
    # iso agrees: every column of every width byte-identical to the M=1 decode
    backend = s.subject_engine.backend
    values = exact.values(s.toggles)
    assert all(c.ndiff == 0 for m in (2, 8) for c in iso(lambda: backend(values), s.prompt, m))


def test_m_all_fast_changes_where_iso_says(tiny):
    """All fast: the first DIFF per width from iso() (the earliest differing key over its columns), and
    where it changes, against the sweep's rows and changes (bits only: iso judges no tolerance)."""
    s = _session(tiny)
    fast = RunSettings()
    widths = list(range(1, 9))
    result = sweep(s, "m", widths, tol=None, settings=fast)
    backend, values = s.subject_engine.backend, fast.values(s.toggles)
    expected = []
    for m, row in zip(widths, result.rows):
        cols = iso(lambda: backend(values), s.prompt, m)
        keys = [c.first_diff_key for c in cols if c.first_diff_key]
        expected.append(min(keys, key=order_key) if keys else None)
        assert row.first_diff == expected[-1], m
        assert (row.logits_nmse > 0) == any(c.ndiff for c in cols), m
        assert row.flips == sum(c.top1_single != c.top1_batch for c in cols), m
        assert row.n_far is None and row.first_far is None  # no tolerance: bits only
    assert list(result.changes) == _changes(widths, expected)
    assert result.rows[0].changed is False


def test_m_with_a_tolerance_judges_the_columns(tiny):
    """With a tolerance each width's far keys are the verify columns' keys beyond it."""
    s = _session(tiny)
    result = sweep(s, "m", [1, 4, 8], settings=RunSettings())
    for row in result.rows:
        assert row.n_far <= row.n_diff
        assert (row.first_far is None) == (row.n_far == 0)
        if row.first_far is not None:
            assert order_key(row.first_far) >= order_key(row.first_diff)
            assert parse_key(row.first_far).t >= len(s.prompt)  # the prompt is not compared
    answers = [(r.first_diff, r.first_far) for r in result.rows]
    assert list(result.changes) == _changes([1, 4, 8], answers)


# ---------------------------------------------------------------- a toggle

@pytest.mark.parametrize("name", ["norm", "attention"])
def test_toggle_against_the_sessions_own_runs(tiny, name):
    """Every other op exact, one toggle swept: each value's row is the session's run with it, and the
    exact value is the reference's bits (all exact is bit-exact by the contract)."""
    s = _session(tiny, n_tokens=4)
    base = _all_exact(s)
    toggle = s.subject_engine.toggle(name)
    result = sweep(s, f"toggle:{name}", settings=base)
    assert result.values == toggle.values
    answers = []
    for value, row in zip(toggle.values, result.rows):
        run = s.run(base.pick(toggle, value), record=False)
        far = run.tolerance(Tolerance())
        answers.append((run.first_diff, far.first_far))
        assert (row.first_diff, row.first_far, row.n_far) == (run.first_diff, far.first_far, far.n_far)
        assert row.flips == sum(t.flip for t in run.tokens)
    exact_row = result.rows[toggle.values.index(toggle.exact)]
    assert exact_row.first_diff is None and exact_row.logits_nmse == 0.0
    assert list(result.changes) == _changes(list(toggle.values), answers)


def test_prompt_lengths_compare_positions_from_the_prompts_end(tiny):
    s = _session(tiny, n_tokens=2)
    result = sweep(s, "prompt", [2, 3, 4], settings=_all_exact(s))
    assert result.changes == () and all(r.first_diff is None for r in result.rows)
    fast = sweep(s, "prompt", [2, 3, 4], tol=None)
    for n, row in zip([2, 3, 4], fast.rows):
        cut = Session(tiny, s.prompt[:n], 2, subject="sim")
        assert row.first_diff == cut.run(RunSettings(), record=False).first_diff
    relative = [(parse_key(r.first_diff).t - n, parse_key(r.first_diff).layer, parse_key(r.first_diff).field)
                if r.first_diff else None for n, r in zip([2, 3, 4], fast.rows)]
    assert list(fast.changes) == _changes([2, 3, 4], relative)


# ---------------------------------------------------------------- the JSON and bad input

def test_json_shape(tiny):
    s = _session(tiny, n_tokens=2)
    data = json.loads(json.dumps(sweep(s, "toggle:norm", settings=_all_exact(s)).as_dict()))
    assert set(data) == {"what", "baseline", "tolerance", "settings", "values", "rows", "changes", "notes", "line"}
    assert data["what"] == "toggle:norm" and data["values"] == ["fast", "exact"]
    assert data["tolerance"] == Tolerance().spec()
    for row in data["rows"]:
        assert set(row) == {"value", "first_diff", "first_far", "n_diff", "n_far", "logits_nmse", "flips",
                            "changed", "failed"}
    assert data["changes"] == [r["value"] for r in data["rows"] if r["changed"]]
    assert data["rows"][1]["first_diff"] is None and data["rows"][1]["logits_nmse"] == 0.0


@pytest.mark.parametrize("what, values, words", [
    ("toggle:nope", None, "no toggle 'nope'"),
    ("batch", None, "hf subject"),
    ("widths", None, "choose from toggle:NAME"),
    ("toggle:norm", ["fast", "slow"], "norm takes fast, exact"),
    ("m", [0, 1], "at least 1"),
    ("prompt", [9], "outside 1..4"),
    ("m", [1, 1], "twice"),
])
def test_bad_input_is_one_line(tiny, what, values, words):
    with pytest.raises(UsageError) as e:
        sweep(_session(tiny, n_tokens=2), what, values)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_parse_values():
    assert parse_values("m", "1..3,8") == [1, 2, 3, 8]
    assert parse_values("toggle:norm", "exact, fast") == ["exact", "fast"]
    for bad in ("", "1..x", "4..2"):
        with pytest.raises(UsageError):
            parse_values("m", bad)


@pytest.mark.parametrize("text, says", [
    ("1..3000000", "3000000 values, but a sweep of m takes at most 4096 (one run per value"),
    ("1..99999999999999999999", "99999999999999999999 values, but a sweep of m takes at most 4096"),
    ("1..4000,1..4000", "8000 values"),
    ("١..٣", "'١..٣' is not a whole number or a range A..B (digits 0-9)"),
    ("1_0", "'1_0' is not a whole number"),
])
def test_values_are_counted_before_any_list_is_made(text, says):
    """A range's size is its two ends' difference: refused past the limit without a list of that size."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(UsageError) as e:
            parse_values("m", text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert says in str(e.value) and "\n" not in str(e.value) and peak < 1 << 20


def test_the_limit_is_what_this_run_can_take(tiny):
    from kestrel_tui.session.sweep import value_limit

    s = _session(tiny, n_tokens=2)
    ctx = tiny.cfg.max_positions
    assert value_limit(s, "m") == (ctx - 4, f"the widest M: the model's context of {ctx} less the prompt's 4 tokens")
    assert value_limit(s, "prompt") == (4, "the prompt's 4 tokens")
    assert value_limit(s, "toggle:norm") == (2, "norm has 2 values")
    with pytest.raises(UsageError, match=f"5 values, but a sweep of prompt takes at most 4 \\(the prompt's 4 tokens\\)"):
        parse_values("prompt", "1..5", value_limit(s, "prompt"))
    with pytest.raises(UsageError, match="3 values, but a sweep of toggle:norm takes at most 2"):
        parse_values("toggle:norm", "fast,exact,fast", value_limit(s, "toggle:norm"))
    assert parse_values("m", f"1..{ctx - 4}", value_limit(s, "m"))[-1] == ctx - 4


@pytest.mark.parametrize("argv, says", [
    (["--what", "m", "--values", "1..100000000"], "--values '1..100000000': 100000000 values, but a sweep of m takes"
                                                  " at most 4080 (the widest M: the model's context of 4096 less the"
                                                  " prompt's 16 tokens)"),
    (["--what", "m", "--values", "1..99999999999999999999"], "99999999999999999999 values"),
    (["--what", "m", "--values", ""], "--values '': no values"),
    (["--what", "m", "--values", " , "], "no values"),
])
def test_sweep_command_refuses_values_in_one_line(capsys, argv, says):
    from clitools import one_line_error, run_cli

    code, out, err = run_cli(capsys, "sweep", *argv, "--tokens", "1", "--no-cache")
    assert code == 2 and out == "" and says in one_line_error(err)


# ---------------------------------------------------------------- batch composition on hf


VOCAB, HF_PROMPT, HF_N = 256, [5, 77, 190, 33], 3


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    """kind -> (a tiny f32 Qwen3 checkpoint, our f32 Model of it)."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from hfmodels import tiny

    from kestrel_tui.model.hf import load_model

    out = {}
    for kind, seed in (("dense", 3), ("moe", 4)):
        model = tiny(kind, seed)
        path = tmp_path_factory.mktemp("sweep_hf") / kind
        model.save_pretrained(path)
        out[kind] = (str(path), load_model(str(path), "f32"))
    return out


def _hf_session(hf_ckpt, kind="dense", deep=False):
    from kestrel_tui.engines.base import EngineSpec

    path, ours = hf_ckpt[kind]
    subject = make_engine(EngineSpec("hf", path), ours, kv="f32", deep=deep)
    return Session(ours, HF_PROMPT, HF_N, subject=subject, kv="f32", deep=deep)


def _plain_batched_logits(model, prompt, others, forced):
    """The target's logits per position, decoded in a left-padded batch by transformers alone (no hooks):
    one forward for the prompts, then one token a step, the others greedy, the target forced."""
    import torch
    from transformers import DynamicCache

    from kestrel_tui.engines.hf_batch import target_row

    row = target_row(len(others))
    prompts = [list(p) for p in others]
    prompts.insert(row, list(prompt))
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_arg(model, cache), use_cache=True)
        logits = [out.logits[row, width - len(prompt) + j].numpy().copy() for j in range(len(prompt))]
        for tok in forced:
            nxt = out.logits[:, -1].argmax(-1)
            nxt[row] = tok
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions, **cache_arg(model, cache),
                        use_cache=True)
            logits.append(out.logits[row, -1].numpy().copy())
    return logits


def test_batch_composition_where_the_logits_say(hf_ckpt):
    """Alone vs in a batch of 1..3 other prompts: where the target's logits first differ bit for bit from
    alone (a plain transformers decode written here), against the sweep's first DIFF, NMSE and changes."""
    import torch
    from transformers import AutoModelForCausalLM

    from kestrel_tui.engines.hf_batch import other_prompts

    plain = AutoModelForCausalLM.from_pretrained(hf_ckpt["dense"][0], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    s = _hf_session(hf_ckpt)
    counts = [0, 1, 2, 3]
    result = sweep(s, "batch", counts, tol=None)
    forced = [p.token for p in s.reference().positions[len(HF_PROMPT):]]
    others = other_prompts(VOCAB, len(HF_PROMPT), max(counts))
    alone = _plain_batched_logits(plain, HF_PROMPT, [], forced)
    first_positions = []
    for n, row in zip(counts, result.rows):
        logits = _plain_batched_logits(plain, HF_PROMPT, others[:n], forced)
        differ = [t for t, (a, b) in enumerate(zip(alone, logits)) if not np.array_equal(a.view(np.uint32),
                                                                                        b.view(np.uint32))]
        first_positions.append(differ[0] if differ else None)
        assert (parse_key(row.first_diff).t if row.first_diff else None) == first_positions[-1], n
        assert row.logits_nmse == max(key_metrics(a, b).nmse for a, b in zip(alone, logits)), n
    assert list(result.changes) == _changes(counts, first_positions)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_batched_row_is_the_targets(hf_ckpt, kind):
    """Alone, the batch runner gives the hf engine's own bits at every key; in a batch with padding (a
    longer neighbour) every key of the target's row is within the default tolerance of alone: a wrong
    row or a column off by the padding would be far."""
    from kestrel_tui.engines.base import RunRequest
    from kestrel_tui.engines.hf_batch import BatchRunner

    s = _hf_session(hf_ckpt, kind, deep=True)
    eng = s.subject_engine
    values = {t.name: t.default for t in eng.toggles}
    forced = [p.token for p in s.reference().positions[len(HF_PROMPT):]]
    own = eng.run(RunRequest(HF_PROMPT, HF_N, values, forced=forced))
    runner = BatchRunner(eng, values)
    try:
        alone = runner.run(HF_PROMPT, HF_N, forced=forced)
        padded = runner.run(HF_PROMPT, HF_N, [[9] * 7, [1, 2]], forced=forced)
    finally:
        runner.close()
    assert alone.hashes() == own.hashes()
    assert list(padded.hashes()) == list(alone.hashes())
    far = [k for k in alone.hashes() if not Tolerance().holds(key_metrics(alone.raw(k), padded.raw(k)))]
    assert far == []


def test_the_sweep_command(capsys):
    """`kestrel-tui sweep --what m`: the rows the library gives, exit 1 where the answer changes."""
    from clitools import run_cli

    code, out, err = run_cli(capsys, "sweep", "--what", "m", "--values", "1..3", "--exact", "none", "--tokens", "2",
                             "--no-cache", "--json")
    r = json.loads(out)
    assert [row["value"] for row in r["rows"]] == [1, 2, 3] and r["what"] == "m"
    assert code == (1 if r["changes"] else 0), err
    code, out, _ = run_cli(capsys, "sweep", "--what", "m", "--values", "1..2", "--exact", "all", "--tokens", "2",
                           "--no-cache")
    assert code == 0 and "the same answer for every value" in out


@pytest.mark.anyio
async def test_s_opens_the_sweep_screen(small_model, tmp_path, make_app, settle):
    from kestrel_tui.app.screens.sweep import SweepScreen
    from kestrel_tui.session.inputs import default_prompt
    from kestrel_tui.session.session import Session

    app = make_app(Session(small_model, default_prompt(small_model.cfg.vocab), 2, subject="sim"), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await pilot.pause()
        assert isinstance(app.screen, SweepScreen)
        await settle(pilot)
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.main
