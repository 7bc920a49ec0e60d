"""The cause test (session/graft.py): graft the reference's values at the first far key, rerun, and
name every source in order. Planted bugs in tiny transformers checkpoints made here (the hf subject
through forward hooks), and the built-in sim through fed steps."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kestrel_tui.backends.toggles import OWNERS, TOGGLES
from kestrel_tui.engines.base import EngineSpec
from kestrel_tui.engines.build import make_engine
from kestrel_tui.errors import UsageError
from kestrel_tui.session.graft import graft, site_of
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.trace.compare import Status, Tolerance
from kestrel_tui.trace.keys import order_key

from clitools import one_line_error, run_cli as run

PROMPT, N = [5, 77, 190, 33], 4


def test_sim_graft_ends_at_the_next_op_the_sim_changes(small_model):
    """Every op exact but norm: each source is a field the norm op owns, each after the one before, and
    the first is the plain run's first DIFF."""
    session = Session(small_model, default_prompt(small_model.cfg.vocab), 3, subject="sim")
    settings = RunSettings(exact=frozenset(TOGGLES) - {"norm"})
    plain = session.run(settings, record=False)
    result = graft(session, settings, limit=4)
    assert result.start == plain.first_diff and len(result.sources) == 4
    keys = [s.key for s in result.sources]
    assert keys == sorted(keys, key=order_key) and len(set(keys)) == 4
    for s in result.sources:
        assert "norm" in OWNERS[s.site[0]], s
    for before, after in zip(result.sources, result.sources[1:]):
        assert before.next_key == after.key
    # what the last run says, checked here: its first DIFF outside the grafted sites is the one left
    grafted = {site_of(k) for k in keys}
    left = next(k for k, st in result.last.comparison.status.items()
                if st is Status.DIFF and site_of(k) not in grafted)
    assert result.remaining == left


def test_a_start_key_that_is_ok_or_missing_is_refused(small_model):
    """--key names where grafting starts: a key whose bits agree is the source of nothing."""
    session = Session(small_model, default_prompt(small_model.cfg.vocab), 2, subject="sim")
    settings = RunSettings(exact=frozenset(TOGGLES) - {"norm"})
    plain = session.run(settings, record=False)
    ok = next(k for k, st in plain.comparison.status.items() if st is Status.OK)
    with pytest.raises(UsageError) as e:
        graft(session, settings, start=ok)
    assert str(e.value) == (f"--key {ok}: ok in this run, not DIFF, so nothing comes from it; graft starts at a DIFF"
                            f" key (the first is {plain.first_diff})")
    for key in ("", "t999_l0_x"):
        with pytest.raises(UsageError, match="the run has no such key"):
            graft(session, settings, start=key)
    assert graft(session, settings, limit=1, start=plain.first_diff).start == plain.first_diff


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_key_is_refused_not_taken_as_the_default(capsys, tmp_path, key):
    code, out, err = run(capsys, "graft", "--key", key, "--tokens", "1", "--no-cache")
    assert code == 2 and out == "" and f"--key {key!r}: no key named" in one_line_error(err)
    code, out, err = run(capsys, "repro", tmp_path / "b", "--key", key, "--tokens", "1", "--no-cache")
    assert code == 2 and out == "" and f"--key {key!r}: no key named" in one_line_error(err)


def test_a_subject_that_cannot_graft_says_so(small_model):
    session = Session(small_model, [1, 2], 2, subject=make_engine("cpu", small_model))
    with pytest.raises(UsageError, match="cannot take the reference's values"):
        graft(session, RunSettings())


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A tiny dense Qwen3 saved clean, with layer 1's v_proj perturbed ("one"), and with its down_proj too
    ("two"); profiles comparing the cpu reference on the clean weights with hf on each."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hfmodels import plant, tiny

    root = tmp_path_factory.mktemp("planted")
    tiny("dense", seed=2, n_layers=3).save_pretrained(root / "clean")
    bugs = {"one": ["model.layers.1.self_attn.v_proj.weight"],
            "two": ["model.layers.1.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight"]}
    for name, weights in bugs.items():
        plant(root / "clean", root / name, {w: 1.01 for w in weights})
        (root / f"{name}.toml").write_text(
            f'model = "clean"\nweights = "f32"\nkv = "f32"\ntokens = {N}\nprompt_ids = {PROMPT}\n'
            f'[reference]\nengine = "cpu"\n[subject]\nengine = "hf"\nmodel = "{name}"\n'
            f'options = {{ dtype = "float32" }}\n')
    return root


def _session(planted, name: str, deep: bool = False) -> Session:
    from kestrel_tui.model.hf import load_model

    clean = load_model(str(planted / "clean"), "f32")
    sub = make_engine(EngineSpec("hf", str(planted / name), {"dtype": "float32"}), clean, kv="f32", deep=deep)
    return Session(clean, PROMPT, N, reference=make_engine("cpu", clean, kv="f32", deep=deep), subject=sub,
                   kv="f32", deep=deep)


def _far_outside(result, tol, grafted) -> list[str]:
    summary = result.tolerance(tol)
    return [k for k, v in summary.verdict.items() if v == "far" and site_of(k) not in grafted]


def test_one_planted_bug_is_the_only_source(planted):
    session = _session(planted, "one")
    tol = Tolerance()
    result = graft(session, RunSettings(), tol=tol)
    assert [s.site for s in result.sources] == [("v", 1)] and result.remaining is None
    assert result.line() == "the only source: v l1"
    assert _far_outside(result.last, tol, {("v", 1), ("vs", 1)}) == []
    after = [k for k, st in result.last.comparison.status.items() if order_key(k) > order_key(result.start)]
    assert after and all(result.last.comparison.status[k] is Status.OK or
                         result.last.tolerance(tol).verdict.get(k) == "close" or site_of(k) == ("v", 1)
                         for k in after)


@pytest.mark.parametrize("deep, second", [(False, ("x", 1)), (True, ("moe", 1))])
def test_two_planted_bugs_are_two_sources_in_order(planted, deep, second):
    """v_proj shows first at the attention's value; grafted, the down_proj's error is left, at the MLP's
    output (a deep key) or else at the layer's output."""
    session = _session(planted, "two", deep=deep)
    tol = Tolerance()
    plain = session.run(RunSettings(), record=False)
    result = graft(session, RunSettings(), tol=tol)
    assert result.start == plain.tolerance(tol).first_far and site_of(result.start) == ("v", 1)
    assert [s.site for s in result.sources] == [("v", 1), second] and result.remaining is None
    assert _far_outside(result.last, tol, {("v", 1), ("vs", 1), second}) == []


def test_graft_command(capsys, planted):
    code, out, err = run(capsys, "graft", "--profile", planted / "two.toml", "--json", "--no-cache")
    r = json.loads(out)
    assert code == 0 and [(s["field"], s["layer"]) for s in r["sources"]] == [("v", 1), ("x", 1)]
    assert r["remaining"] is None and r["line"] == "2 sources, in order: v l1, x l1" and r["tolerance"] == "nmse=1e-07"
    code, out, _ = run(capsys, "graft", "--profile", planted / "two.toml", "--limit", "1", "--no-cache")
    assert code == 1 and "the limit left another at t4_l1_x" in out
    code, _, err = run(capsys, "graft", "--profile", planted / "two.toml", "--key", "t4_l9_v", "--no-cache")
    assert code == 2 and "no such key" in one_line_error(err)


@pytest.mark.anyio
async def test_the_app_grafts_on_g(small_model, tmp_path, make_app, settle):
    """g in the app: the same sources as graft() on an independent session, named on the status line."""
    settings = RunSettings(exact=frozenset(TOGGLES) - {"norm"})
    want = graft(Session(small_model, default_prompt(small_model.cfg.vocab), 2, subject="sim"), settings)
    session = Session(small_model, default_prompt(small_model.cfg.vocab), 2, subject="sim")
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        main.settings = settings
        await pilot.press("g")
        await settle(pilot)
        assert main.status.text.startswith(f"graft: {want.line()}"), main.status.text
        assert main.result is not None and main.phase == "idle"
        assert main.result.comparison.status == want.last.comparison.status  # the grid: every source grafted
