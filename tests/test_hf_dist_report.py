"""The headless reports of a split run name the rank: `run` and `graft`, text and --json, with a bug planted
in one rank's shard of o_proj (tests/rankfaults.py) at TP=2 over gloo, against one rank through
profiles/hf-tp1-vs-tp2.toml (its reference reports its o_proj / down_proj sums as 2 ranks' partials,
split_sums). A tiny dense Qwen3 made here with transformers' own classes; 2 positions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kestrel_tui.trace.compare import Tolerance, key_metrics  # noqa: E402
from kestrel_tui.trace.ranks import judged  # noqa: E402

from clitools import run_cli  # noqa: E402
from rankfaults import env as fault_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "hf-tp1-vs-tp2.toml"
O_PROJ = "1:scale_shard:L1.self_attn.o_proj"  # row-parallel: rank 1's columns of layer 1's o_proj × 1.01


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=4, head_dim=16, intermediate_size=96, rope_theta=1e6,
                                   rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(2)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # large weights: logits far from ties
        for _, p in model.named_parameters():
            scale, shift = (0.2, 1.0) if p.ndim == 1 else (0.25, 0.0)
            p.copy_(shift + scale * torch.randn(p.shape, generator=g))
    path = tmp_path_factory.mktemp("hf_dist_report") / "dense"
    model.save_pretrained(path)
    return str(path)


def _planted(monkeypatch, faults):
    for name, value in fault_env(faults).items():
        monkeypatch.setenv(name, value)


def _cli(capsys, ckpt, *argv):
    return run_cli(capsys, *argv, "--profile", PROFILE, "--model", ckpt, "--tokens", "1", "--no-cache")


@pytest.mark.slow
def test_run_names_the_rank_of_a_far_partial_sum(monkeypatch, capsys, ckpt):
    _planted(monkeypatch, O_PROJ)
    code, out, err = _cli(capsys, ckpt, "run", "--json")
    report = json.loads(out)
    assert code == 1 and report["first_far"] == "t0_l1_ores", err
    far = report["ranks"]["first_far"]
    assert far["key"] == "t0_l1_ores" and far["far"] == [1]
    r0, r1 = far["ranks"]
    assert (r0["rank"], r1["rank"], r1["verdict"]) == (0, 1, "far") and r1["nmse"] > 1e-5
    # rank 0's partial is its GEMM on its shard: the same as the reference's, to rounding of the inputs
    assert r0["verdict"] in ("ok", "close") and r0.get("nmse", 0.0) <= Tolerance().nmse
    first = report["ranks"]["first_diff"]  # a head-split key: each rank's heads against the reference's slice
    assert first["key"] == report["first_diff"] and [r["rank"] for r in first["ranks"]] == [0, 1]
    assert first["far"] == []

    code, out, err = _cli(capsys, ckpt, "run")
    assert code == 1
    line = next(ln for ln in out.splitlines() if "t0_l1_ores by rank" in ln)
    assert " · r1 far (nmse " in line and line.endswith(": rank 1's share is far"), line


class _Split:
    """A trace of 2 ranks by hand: ``shares`` key -> each rank's share, ``whole`` key -> the gathered value."""

    def __init__(self, whole, shares=None, partial=()):
        self.whole, self.shares, self.partial = whole, shares or {}, set(partial)

    def raw(self, key):
        return self.whole.get(key)

    def rank_values(self, key):
        return self.shares.get(key)


def test_each_share_judged_and_a_key_not_split_said_so():
    import numpy as np

    heads = np.arange(1, 9, dtype=np.float32)
    off = heads.copy()
    off[5] *= 1.01  # rank 1's second head
    ref = _Split({"t0_l0_kraw": heads, "t0_l0_nrm": heads})
    sub = _Split({"t0_l0_kraw": off, "t0_l0_nrm": heads}, {"t0_l0_kraw": (off[:4], off[4:])})
    view = judged(ref, sub, "t0_l0_kraw", Tolerance())
    assert [r["verdict"] for r in view["ranks"]] == ["ok", "far"] and view["far"] == [1]
    assert view["ranks"][1]["nmse"] > 1e-7 and "nmse" not in view["ranks"][0]
    nmse = key_metrics(heads[4:], off[4:]).nmse
    assert view["line"] == f"t0_l0_kraw by rank: r0 ok · r1 far (nmse {nmse:.3g}): rank 1's share is far"
    # without a tolerance the bits decide: DIFF
    assert [r["verdict"] for r in judged(ref, sub, "t0_l0_kraw", None)["ranks"]] == ["ok", "DIFF"]
    plain = judged(ref, sub, "t0_l0_nrm", Tolerance())
    assert plain["ranks"] is None and plain["far"] == [] and "no share" in plain["line"]
    # a partial sum with nothing of its world size to be held to is said to be one, not judged
    sub.shares["t0_l0_ores"], sub.partial = (heads, heads), {"t0_l0_ores"}
    ref.whole["t0_l0_ores"] = heads
    partial = judged(ref, sub, "t0_l0_ores", Tolerance())
    assert [r["verdict"] for r in partial["ranks"]] == ["partial", "partial"] and partial["far"] == []


# ---------------------------------------------------------------- graft on hf-dist: the cause test over ranks

@pytest.mark.slow
def test_graft_at_the_far_partial_sum_removes_every_far_key_after_it(monkeypatch, capsys, ckpt):
    _planted(monkeypatch, O_PROJ)
    code, out, err = _cli(capsys, ckpt, "graft", "--json")
    report = json.loads(out)
    assert report["start"] == "t0_l1_ores", err
    assert report["sources"] == [{"field": "ores", "layer": 1, "key": "t0_l1_ores", "next": None}]
    assert report["remaining"] is None and code == 0
    assert report["ranks"]["first_far"]["far"] == [1]  # the run before grafting names the rank

    code, out, err = _cli(capsys, ckpt, "graft")
    assert code == 0 and "the only source: ores l1" in out, out + err
    assert "before grafting, first far t0_l1_ores by rank: " in out and "rank 1's share is far" in out


@pytest.mark.slow
def test_graft_at_an_earlier_split_key_leaves_the_far_key(monkeypatch, capsys, ckpt):
    """kraw of layer 0 is split by heads: each rank takes its slice of the reference's; the bug is after it."""
    _planted(monkeypatch, O_PROJ)
    code, out, err = _cli(capsys, ckpt, "graft", "--json", "--key", "t0_l0_kraw", "--limit", "1")
    report = json.loads(out)
    assert report["sources"] == [{"field": "kraw", "layer": 0, "key": "t0_l0_kraw", "next": "t0_l1_ores"}], err
    assert report["remaining"] == "t0_l1_ores" and code == 1


def test_each_rank_is_fed_its_share_of_the_reference():
    import numpy as np

    from kestrel_tui.engines.base import Graft
    from kestrel_tui.engines.hf_dist import HEADS, WHOLE, graft_shares

    class Ref:
        positions = [type("P", (), {"raw": {"t0_l0_kraw": np.arange(8.0), "t0_l0_x": np.arange(4.0),
                                            "t0_l0_k": np.arange(8.0).reshape(4, 2),
                                            "t0_l0_v": -np.arange(8.0).reshape(4, 2)}})()]

    layout = {"kraw": HEADS, "k": HEADS, "v": HEADS, "x": WHOLE}
    fed = graft_shares(Graft(Ref(), frozenset({("kraw", 0), ("x", 0), ("k", 0)})), 0, 1, 2, layout, "f32")
    (sites0, r0), (_, r1) = fed
    assert sites0 == frozenset({("kraw", 0), ("x", 0), ("k", 0)})
    assert r0[0]["t0_l0_kraw"].tolist() == [0, 1, 2, 3] and r1[0]["t0_l0_kraw"].tolist() == [4, 5, 6, 7]
    assert r0[0]["t0_l0_x"].tolist() == r1[0]["t0_l0_x"].tolist() == [0, 1, 2, 3]  # replicated: whole
    # a key row site takes the attention's rows: each rank its kv heads of k and v
    assert r1[0]["t0_l0_k"].tolist() == [[4, 5], [6, 7]] and r1[0]["t0_l0_v"].shape == (2, 2)
    assert graft_shares(None, 0, 1, 2, layout, "f32") is None


# ---------------------------------------------------------------- where head-split keys are bit-equal

@pytest.mark.slow
def test_head_split_keys_against_one_rank(ckpt):
    """docs/engines-distributed.md, "Which keys are bit-equal": with the prompt token by token on both sides
    (one row a GEMM), TP=2's heads of layer 0 are bit for bit one rank's; the prompt batched on one side only
    moves them within rounding (a batch's GEMM against a row's: another kernel), at one rank as at two."""
    from dataclasses import replace

    from kestrel_tui.engines.base import EngineSpec
    from kestrel_tui.engines.hf_dist import make_hf_dist_engine
    from kestrel_tui.model.hf import load_model
    from kestrel_tui.session.session import Session
    from kestrel_tui.trace.compare import Status
    from kestrel_tui.trace.keys import parse_key

    model = load_model(ckpt, "f32")
    opts = {"timeout": 120, "prefill": "token", "attn_implementation": "eager", "threads": 1}
    ref = make_hf_dist_engine(EngineSpec("hf-dist", ckpt, {**opts, "world_size": "1"}), model, kv="f32", deep=True)
    sub = make_hf_dist_engine(EngineSpec("hf-dist", ckpt, opts), model, kv="f32", deep=True)
    session = Session(model, [5, 77, 190, 33], 2, reference=ref, subject=sub, kv="f32", deep=True)

    def run(world, prefill):
        s = replace(session.initial_settings(), prefill="subject")
        for name, value in (("world_size", world), ("prefill", prefill)):
            s = s.pick(next(t for t in session.toggles if t.name == name), value)
        return session.run(s, record=False)
    try:
        split = {"kraw", "knorm", "kpre", "k", "v", "qrope", "attn"}
        token = run("2", "token")
        layer0 = [k for k in token.comparison.status if parse_key(k).layer == 0 and parse_key(k).field in split]
        assert len(layer0) == 6 * len(split) and all(token.comparison.status[k] is Status.OK for k in layer0)
        assert token.tolerance(Tolerance()).first_far is None
        for world in ("2", "1"):
            batched = run(world, "batched")
            summary = batched.tolerance(Tolerance())
            assert summary.first_far is None and summary.n_close > 0  # bits may move; never beyond 1e-7
    finally:
        ref.close()
        sub.close()
