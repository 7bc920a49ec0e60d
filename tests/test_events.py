"""Discrete events named (trace/events.py): an expert set that flipped, a top-1 flip and its margin, a
q8 scale a ULP off; found from both sides' raw values, shown by run (text and --json) and the app."""
import json

import numpy as np
import pytest

from kestrel_tui.app.state import Cursor
from kestrel_tui.engines.build import make_engine
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.trace.compare import Status, Tolerance
from kestrel_tui.trace.events import (event_before, expert_event, find_events, logit_margin, scale_event,
                                      token_event)
from kestrel_tui.trace.keys import order_key, parse_key

from clitools import run_cli as run

f32 = np.float32


def test_expert_sets_not_orders():
    router = np.array([0.1, 2.0, 1.5, 1.499, -3], f32)
    assert expert_event("t3_l2_topk", np.array([1, 2]), np.array([2, 1]), router) is None  # same set
    e = expert_event("t3_l2_topk", np.array([1, 2]), np.array([1, 3]), router)
    assert e.kind == "experts" and e.margin == float(f32(1.5)) - float(f32(1.499))  # in float64 from the f32 logits
    assert "{2} -> {3}" in e.line and "t3 l2" in e.line
    assert expert_event("t3_l2_topk", np.array([1]), np.array([4]), None).margin is None


def test_token_margin_and_near_tie():
    assert logit_margin(np.array([3, 1, 2.5], f32)) == pytest.approx(0.5)
    assert logit_margin(np.array([1, 1], f32)) == 0.0
    rng = np.random.default_rng(1)
    ref = rng.normal(size=1000).astype(f32)
    ref[7], ref[9] = 10.0, 9.999
    drift = (ref + rng.normal(scale=0.01, size=1000)).astype(f32)  # ordinary drift, RMS ~0.01
    drift[7], drift[9] = 9.998, 10.0
    near = token_event("t4_logits", ref, drift)
    assert near.near_tie and near.margin == pytest.approx(0.001, rel=1e-2) and "a near-tie" in near.line
    clear = ref.copy()
    clear[9] = 5.0  # the reference's top-1 is clear by 5
    jump = clear.copy()  # every logit exact but one, which jumps past the top: no drift explains it
    jump[3] = 11.0
    far = token_event("t4_logits", clear, jump)
    assert not far.near_tie and far.margin == pytest.approx(5.0) and "beyond the drift" in far.line
    assert token_event("t4_logits", np.array([0, 2.0], f32), np.array([0, 3.0], f32)) is None  # same top-1


def test_scale_one_ulp_only():
    a = np.array([0.5, 0.25], f32)
    b = a.copy()
    b[1] = np.nextafter(b[1], f32(1))
    e = scale_event("t2_l1_vs", a, b)
    assert e.kind == "q8-scale" and "1 of 2 V-row" in e.line
    c = b.copy()
    c[0] = 0.75  # more than a ULP somewhere: drift, not one rounding
    assert scale_event("t2_l1_vs", a, c) is None


def test_event_before_skips_token_flips():
    ev = find_events(["t2_l1_vs", "t3_logits"], {"t2_l1_vs": np.array([1.0], f32), "t3_logits": np.array([0, 2.0], f32)}.get,
                     {"t2_l1_vs": np.nextafter(np.array([1.0], f32), f32(2)), "t3_logits": np.array([2.5, 2.0], f32)}.get)
    assert [e.kind for e in ev] == ["q8-scale", "token"]
    assert event_before(ev, "t5_l0_nrm").key == "t2_l1_vs"  # the token flip at t3 is an outcome
    assert event_before(ev, "t1_l0_nrm") is None


@pytest.fixture(scope="module")
def deep_run(request):
    """The embedded model (48 layers), deep keys, sim all fast: routing drifts far enough to flip."""
    model = request.getfixturevalue("default_model")
    session = Session(model, default_prompt(model.cfg.vocab), 6, subject="sim", deep=True)
    return session.run(RunSettings(exact=frozenset()))


def test_every_flipped_expert_set_is_one_event(deep_run):
    res = deep_run
    topk = [k for k, st in res.comparison.status.items() if st is Status.DIFF and parse_key(k).field == "topk"]
    flipped = [k for k in topk if set(res.ref.raw(k).tolist()) != set(res.sub.raw(k).tolist())]
    events = {e.key: e for e in res.events if e.kind == "experts"}
    assert flipped and sorted(events) == sorted(flipped)
    for key in flipped:  # the margin recomputed from the reference's router logits
        router = np.sort(res.ref.raw(key.replace("topk", "router")).astype(np.float64))[::-1]
        k = res.ref.raw(key).size
        assert events[key].margin == pytest.approx(router[k - 1] - router[k])
    assert [e.key for e in res.events] == sorted((e.key for e in res.events), key=order_key)


def test_flips_carry_the_reference_margin(deep_run):
    for s in deep_run.tokens:
        logits = deep_run.ref.positions[s.t].logits
        top = np.sort(logits.astype(np.float64))[-2:]
        assert s.ref_margin == pytest.approx(top[1] - top[0])
    flips = {f"t{s.t}_logits" for s in deep_run.tokens if s.flip}
    assert flips == {e.key for e in deep_run.events if e.kind == "token"}


def test_run_json_names_events_and_what_the_first_far_follows(capsys, small_model):
    code, out, _ = run(capsys, "run", "--exact", "none", "--deep", "--tol", "nmse=1e-7", "--json", "--no-cache",
                       "--tokens", "4")
    r = json.loads(out)
    kinds = r["n_events"]
    assert set(kinds) == {"experts", "token", "q8-scale"} and sum(kinds.values()) >= len(r["events"]) > 0
    keys = [e["key"] for e in r["events"]]
    assert keys == sorted(keys, key=order_key)
    want = None  # the last expert or scale event at or before the first far key, found here from the list
    for e in r["events"]:
        if e["kind"] != "token" and order_key(e["key"]) <= order_key(r["first_far"]):
            want = e
    assert r["first_far_after"] == want
    for flip in r["top1_flips"]:
        assert flip["ref_margin"] is not None and flip["near_tie"] in (True, False)
    assert code == 1


@pytest.mark.anyio
async def test_the_detail_panel_says_what_a_key_follows(default_model, deep_run, tmp_path, make_app, settle):
    engine = deep_run  # an independent session's run: what the engine says
    session = Session(default_model, default_prompt(default_model.cfg.vocab), 6, subject="sim", deep=True)
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        expert = next(e for e in engine.events if e.kind == "experts")
        later = next(k for k, st in engine.comparison.status.items() if st is Status.DIFF
                     and order_key(k) > order_key(expert.key) and engine.cause_of(k) is expert)
        for key, text in ((expert.key, expert.line), (later, "after " + expert.line)):
            c = main.board.locate(key)
            main._set_cursor(Cursor(c.t, c.row, c.col))
            await pilot.pause()
            assert text in str(main.query_one("#detail").render()).replace("\n", " "), key


def test_a_planted_router_bias_is_named_as_the_routing_flip(tmp_path):
    """A tiny transformers Qwen3-MoE whose layer-1 gate is nudged so that, at one decode position, the
    expert ranked k+1 by the reference overtakes the k-th (the nudge computed here from the reference's
    own pnrm and router logits): the run names exactly that expert flip, and the far keys follow it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hfmodels import tiny
    from safetensors.torch import load_file, save_file

    from kestrel_tui.engines.base import EngineSpec
    from kestrel_tui.model.hf import load_model

    tiny("moe", seed=3).save_pretrained(tmp_path / "clean")
    clean = load_model(str(tmp_path / "clean"), "f32")
    prompt, n, layer, k = [5, 77, 190, 33], 6, 1, 2
    ref = Session(clean, prompt, n, reference=make_engine("cpu", clean, kv="f32", deep=True), subject="sim",
                  kv="f32", deep=True).reference()

    def sets(add):  # the reference's top-k sets at every decode position with ``add`` [E] per position
        out = {}
        for t in range(len(prompt), len(prompt) + n):
            r = ref.raw(f"t{t}_l{layer}_router").astype(np.float64) + add(t)
            out[t] = set(np.argsort(-r, kind="stable")[:k].tolist())
        return out

    base = sets(lambda t: 0.0)
    chosen = None
    for t in sorted(base, key=lambda t: np.diff(np.sort(ref.raw(f"t{t}_l{layer}_router"))[::-1][k - 1:k + 1])[0]
                    * -1):
        r = ref.raw(f"t{t}_l{layer}_router").astype(np.float64)
        order = np.argsort(-r, kind="stable")
        e_in, margin = int(order[k]), float(r[order[k - 1]] - r[order[k]])
        h = ref.raw(f"t{t}_l{layer}_pnrm").astype(np.float64)
        alpha = 1.5 * margin + 1e-3
        bump = {u: np.eye(8)[e_in] * alpha * float(ref.raw(f"t{u}_l{layer}_pnrm").astype(np.float64) @ h) / (h @ h)
                for u in base}
        after = sets(lambda u: bump[u])
        if [u for u in base if after[u] != base[u]] == [t]:
            chosen = (t, e_in, alpha * h / (h @ h))
            break
    assert chosen is not None, "no position's flip stays alone at these weights"
    t_flip, e_in, delta = chosen
    (tmp_path / "bias").mkdir()
    for f in (tmp_path / "clean").iterdir():
        (tmp_path / "bias" / f.name).write_bytes(f.read_bytes())
    sd = load_file(tmp_path / "bias" / "model.safetensors")
    w = sd[f"model.layers.{layer}.mlp.gate.weight"].clone()
    w[e_in] += torch.from_numpy(delta.astype(np.float32))
    sd[f"model.layers.{layer}.mlp.gate.weight"] = w
    save_file(sd, tmp_path / "bias" / "model.safetensors", metadata={"format": "pt"})

    sub = make_engine(EngineSpec("hf", str(tmp_path / "bias"), {"dtype": "float32"}), clean, kv="f32", deep=True)
    res = Session(clean, prompt, n, reference=make_engine("cpu", clean, kv="f32", deep=True), subject=sub, kv="f32",
                  deep=True).run(RunSettings())
    flips = [e for e in res.events if e.kind == "experts"]
    assert [e.key for e in flips] == [f"t{t_flip}_l{layer}_topk"], [e.line for e in flips]
    assert f"t{t_flip} l{layer}: the expert set flipped" in flips[0].line
    # the nudge moves every position's router logits a little (far topw keys before it too); the far keys
    # from the flip on follow it
    verdict = res.tolerance(Tolerance()).verdict
    after = [k for k, v in verdict.items() if v == "far" and order_key(k) > order_key(flips[0].key)]
    assert after and all(res.cause_of(k) == flips[0] for k in after)
