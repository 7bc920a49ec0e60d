"""The hf-dist engine: transformers' own TP and EP over gloo, ranks started by the engine, the keys
gathered in rank order into the hf engine's schema. Tiny Qwen3 / Qwen3-MoE checkpoints made here, with
head counts that split over 2 ranks; one group per setting, shared across the asserts (each start costs
a torch import per rank)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kestrel_tui import procs  # noqa: E402
from kestrel_tui.engines import hf_dist, hf_options, profile, registry  # noqa: E402
from kestrel_tui.engines.base import EngineFailed, EngineSpec, RunRequest, Toggle  # noqa: E402
from kestrel_tui.engines.hf_dist import HEADS, WHOLE, gather, layout_of, make_hf_dist_engine  # noqa: E402
from kestrel_tui.engines.hf_dist_group import RankFailure  # noqa: E402
from kestrel_tui.engines.hf_dist_rank import PLANNED  # noqa: E402
from kestrel_tui.engines.profile import load_profile  # noqa: E402
from kestrel_tui.errors import UsageError  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.trace.compare import Tolerance, compare, key_metrics  # noqa: E402
from kestrel_tui.trace.keys import order_key, parse_key, token_keys  # noqa: E402
from kestrel_tui.trace.ranks import rank_values, sum_key  # noqa: E402
from kestrel_tui.trace.run import Cancelled  # noqa: E402

from clitools import one_line_error, run_cli  # noqa: E402
from rankfaults import env as fault_env  # noqa: E402
from toytools import gone  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, PROMPT, N, LAYERS = 256, [5, 77, 190, 33], 3, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=8, head_dim=16,
              rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False)
SHARDED = ("kraw", "knorm", "kpre", "k", "v", "qrope", "attn")  # ks / vs too under q8
# the experts in qwen3_moe's TP plan as transformers up to 5.24 has them (a slice of every expert a rank, the
# output all-reduced); 5.25 dropped them: the experts are split by EP alone
TP_EXPERTS = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
              "layers.*.mlp.experts": "moe_tp_experts"}
INSTALLED_TP_SPLITS_EXPERTS = any(k.startswith("layers.*.mlp.experts")
                                  for k in transformers.Qwen3MoeConfig.base_model_tp_plan)


def _build(kind: str, seed: int):
    if kind == "moe":  # 2 kv heads: 4 ranks cannot split them
        cfg = transformers.Qwen3MoeConfig(**COMMON, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.Qwen3Config(**COMMON, num_key_value_heads=4, intermediate_size=96)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # large weights: logits and routing far from ties
        for _, p in model.named_parameters():
            scale, shift = (0.2, 1.0) if p.ndim == 1 else (0.25, 0.0)
            p.copy_(shift + scale * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_dist")
    out = {}
    for kind, seed in (("dense", 2), ("moe", 1)):
        _build(kind, seed).save_pretrained(root / kind)
        out[kind] = str(root / kind)
    return out


# dense: f32 KV and the deep set (every replicated field); moe: q8 KV (ks / vs split by heads)
SETUP = {"dense": dict(kv="f32", deep=True), "moe": dict(kv="q8", deep=False)}


def _engine(ckpt, kind, **options):
    return make_hf_dist_engine(EngineSpec("hf-dist", ckpt[kind], {"timeout": 120, **options}), None, **SETUP[kind])


@pytest.fixture(scope="module")
def engines(ckpt):
    made = {kind: _engine(ckpt, kind) for kind in ckpt}
    yield made
    for e in made.values():
        e.close()


def _values(eng, **over):
    return {**{t.name: t.default for t in eng.toggles}, **over}


@pytest.fixture(scope="module")
def runs(engines):
    """(kind, world_size, ep) -> the trace, teacher-forced on the first run's tokens of that kind."""
    cache, forced = {}, {}

    def get(kind, world="2", ep="off"):
        if (kind, world, ep) not in cache:
            eng = engines[kind]
            values = _values(eng, world_size=world, **({"ep": ep} if kind == "moe" else {}))
            trace = eng.run(RunRequest(PROMPT, N, values, forced=forced.get(kind)))
            forced.setdefault(kind, trace.generated[:N])
            cache[kind, world, ep] = trace
        return cache[kind, world, ep]
    return get


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype.itemsize == 4 else a.view(np.uint8)


# ---------------------------------------------------------------- gathering, without processes

def _payload(cols, partial=None):
    return {"raw": cols, "partial": partial or [{} for _ in cols]}


def test_gather_in_rank_order_and_partial_sums():
    full = np.arange(64, dtype=np.float32)
    nrm = np.ones(64, np.float32)
    p0, p1 = np.full(64, 0.25, np.float32), np.full(64, 0.5, np.float32)
    pays = [_payload([{"t3_l0_nrm": nrm, "t3_l0_kraw": full[:32]}], [{"t3_l0_ores": [(p0, p0 + p1)]}]),
            _payload([{"t3_l0_nrm": nrm.copy(), "t3_l0_kraw": full[32:]}], [{"t3_l0_ores": [(p1, p0 + p1)]}])]
    [(hashes, raw, found)] = gather(pays, 3, 1, {"kraw": HEADS, "nrm": WHOLE}, None)
    assert list(hashes) == ["t3_l0_nrm", "t3_l0_kraw"] and found == []
    np.testing.assert_array_equal(raw["t3_l0_kraw"], full)  # rank 0's heads first
    assert [a[0] for a in rank_values(raw, "t3_l0_ores")] == [0.25, 0.5]
    assert raw[sum_key("t3_l0_ores")][0] == 0.75
    assert rank_values(raw, "t3_l0_nrm") is None  # the ranks agree: no per-rank copies


def test_gather_names_a_replicated_disagreement_and_a_bad_shard():
    a, b = np.ones(4, np.float32), np.ones(4, np.float32)
    b.view(np.uint32)[2] ^= 1
    [(_, raw, found)] = gather([_payload([{"t0_emb": a}]), _payload([{"t0_emb": b}])], 0, 1, {}, None)
    assert found == ["t0_emb: replicated, but rank 1 differs from rank 0"]
    assert _bits(rank_values(raw, "t0_emb")[1]).tolist() == _bits(b).tolist()
    shards = [_payload([{"t0_l0_kraw": np.zeros(n, np.float32)}]) for n in (32, 31)]
    with pytest.raises(RankFailure, match=r"disagrees on shapes: .*t0_l0_kraw is \[31\]") as e:
        gather(shards, 0, 1, {"kraw": HEADS}, None)
    assert e.value.rank == 1
    with pytest.raises(RankFailure, match="disagrees on the keys") as e:
        gather([_payload([{"t0_emb": a}]), _payload([{"t0_logits": a}])], 0, 1, {}, None)
    assert e.value.rank == 1


def test_layout_from_the_ranks_plans():
    tp = dict.fromkeys(PLANNED, "")
    tp.update({"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
               "self_attn.o_proj": "rowwise"})
    infos = [{"styles": tp, "heads": (4, 2)}, {"styles": tp, "heads": (4, 2)}]
    q8, f32 = layout_of(infos, (8, 4), "q8"), layout_of(infos, (8, 4), "f32")
    assert {f for f, how in q8.items() if how == HEADS} == {*SHARDED, "ks", "vs"}
    assert f32["ks"] == f32["vs"] == WHOLE and f32["kraw"] == HEADS  # f32 scales: the ones row on every rank
    with pytest.raises(RankFailure, match=r"disagrees on shapes: it holds \(8, 4\)") as e:
        layout_of([infos[0], {"styles": tp, "heads": (8, 4)}], (8, 4), "q8")
    assert e.value.rank == 1
    assert set(layout_of([{"styles": dict.fromkeys(PLANNED, ""), "heads": (8, 4)}], (8, 4), "q8").values()) == {WHOLE}


# ---------------------------------------------------------------- options, without processes

@pytest.mark.parametrize("kind, options, words", [
    ("dense", {"ep": "on"}, "ep=on: expert parallelism needs a qwen3_moe model"),
    ("moe", {"world_size": "4"}, "kv heads 2 do not split over 4 ranks"),
    ("dense", {"world_size": "3"}, "world_size='3' is not allowed; choose from 2|1|4"),
    ("dense", {"threads": 0}, "threads=0: is below 1; want a whole number from 1 to 1024"),
    ("dense", {"timeout": "soon"}, "timeout='soon': is not a number; want a number of seconds above 0"),
    ("dense", {"wrld_size": "2"}, "unknown option 'wrld_size'"),
])
def test_bad_options_are_one_line(ckpt, kind, options, words):
    with pytest.raises(UsageError, match=words) as e:
        make_hf_dist_engine(EngineSpec("hf-dist", ckpt[kind], options), None)
    assert "\n" not in str(e.value) and str(e.value).startswith("hf-dist engine: ")


@pytest.mark.parametrize("options, words", [
    ({"timeout": 1e308}, "timeout=1e+308: is above 604800; want a number of seconds above 0 and at most 604800"),
    ({"timeout": float("inf")}, "timeout=inf: is not finite; want a number of seconds above 0 and at most 604800"),
    ({"load_timeout": "nan"}, "load_timeout='nan': is not finite; want a number of seconds above 0 and at most 604800"),
    ({"load_timeout": 0}, "load_timeout=0: is not above 0; want a number of seconds above 0 and at most 604800"),
    ({"timeout": -5}, "timeout=-5: is below 0; want a number of seconds above 0 and at most 604800"),
    ({"timeout": True}, "timeout=True: is not a number; want a number of seconds above 0 and at most 604800"),
    ({"threads": 10 ** 9}, "threads=1000000000: is above 1024; want a whole number from 1 to 1024"),
    ({"threads": 1.5}, "threads=1.5: is not a whole number; want a whole number from 1 to 1024"),
    ({"threads": "\u0661"}, "threads='\u0661': is not a whole number, written with the digits 0-9; want a whole number"
                            " from 1 to 1024"),
    ({"world_size": 3}, "world_size=3 is not allowed; choose from 2|1|4"),
    ({"world_size": True}, "world_size=True is not allowed; choose from 2|1|4"),
])
def test_every_number_is_finite_and_in_range(ckpt, options, words):
    """What the option was given and what it takes, in one line: a timeout too large to wait for is refused
    here, not by a rank that cannot make a deadline of it (an engine failure, exit 3, before)."""
    with pytest.raises(UsageError) as e:
        make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"], options), None)
    assert str(e.value) == f"hf-dist engine: {words}"


@pytest.mark.parametrize("given, kept", [
    ({"world_size": 1}, {"world_size": "1"}),  # a TOML integer names the world size its string does
    ({"world_size": 2.0, "threads": "1"}, {"world_size": "2", "threads": 1}),
    ({"timeout": 30, "load_timeout": "60.5"}, {"timeout": 30.0, "load_timeout": 60.5}),
])
def test_whole_numbers_in_any_form(ckpt, monkeypatch, given, kept):
    monkeypatch.setattr(hf_dist, "cpu_cores", lambda: 2)
    eng = make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"], given), None)
    assert {k: eng.options[k] for k in kept} == kept
    assert all(type(eng.options[k]) is type(v) for k, v in kept.items())


def test_the_command_line_refuses_a_timeout_past_a_week(ckpt, monkeypatch, capsys, tmp_path):
    _table(monkeypatch)
    prof = tmp_path / "forever.toml"
    prof.write_text('weights = "f32"\nkv = "f32"\n[reference]\nengine = "cpu"\n[subject]\nengine = "hf-dist"\n'
                    '[subject.options]\nworld_size = 1\ntimeout = 1e308\n')
    code, out, err = run_cli(capsys, "run", "--profile", prof, "--model", ckpt["dense"], "--tokens", "2", "--json")
    assert code == 2 and out == ""
    assert one_line_error(err) == (f"kestrel-tui run: error: {prof}:9: subject.options.timeout: hf-dist engine:"
                                   " timeout=1e+308: is above 604800; want a number of seconds above 0 and at most 604800")


def test_toggles_fit_the_model(ckpt, monkeypatch):
    monkeypatch.setattr(hf_dist, "cpu_cores", lambda: 2)  # 4 ranks of 1 thread fit (the machine's rule)
    dense = make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"]), None)
    moe = make_hf_dist_engine(EngineSpec("hf-dist", ckpt["moe"]), None)
    assert dense.toggle("world_size").values == ("2", "1", "4") and dense.toggle("world_size").exact == "1"
    assert moe.toggle("world_size").values == ("2", "1")  # its 2 kv heads do not split over 4
    assert moe.toggle("ep").values == ("off", "on") and "ep" not in {t.name for t in dense.toggles}
    assert moe.describe(_values(moe, ep="on")) == "hf-dist (world_size=2, tp+ep, all_reduce, gloo)"
    assert dense.parallel(_values(dense, world_size="1")).as_dict() == {
        "world_size": 1, "ranks": [0], "backend": "gloo", "plan": "none", "ep_impl": None, "pids": []}


def test_a_world_size_beyond_the_cores(ckpt, monkeypatch):
    """At most 2 CPU threads a core (ranks × threads): above it one line naming the sum and the fix; above
    one a core, a note; the default toggles offer only world sizes that fit."""
    monkeypatch.setattr(hf_dist, "cpu_cores", lambda: 1)
    with pytest.raises(UsageError) as e:
        make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"], {"world_size": "4"}), None)
    assert str(e.value) == ("hf-dist engine: option world_size=4 × threads=1 is 4 CPU threads, and this machine"
                            " gives 1 core (2 threads a core at most); choose world_size=2")
    with pytest.raises(UsageError, match=r"world_size=2 × threads=2 is 4 CPU threads.*choose world_size=1 or fewer"
                                         r" threads$"):
        make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"], {"threads": 2}), None)
    with pytest.raises(UsageError, match=r"^hf-dist engine: toggle world_size world_size=4 × threads=1"):
        make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"], {}, toggles=(
            Toggle("world_size", ("2", "4"), "2", (), "", key="world_size"),)), None)
    one = make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"]), None)
    assert one.toggle("world_size").values == ("2", "1")  # 4 would not fit this machine
    assert one.notes == ("hf-dist: world_size=2 × threads=1 runs 2 CPU threads on 1 core: they take turns, so"
                         " each step is slower (the bits are the same)",)
    monkeypatch.setattr(hf_dist, "cpu_cores", lambda: 2)
    assert make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"]), None).notes == ()
    four = make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"], {"world_size": "4"}), None)
    assert "runs 4 CPU threads on 2 cores" in four.notes[0] and four.toggle("world_size").values == ("4", "2", "1")


def test_a_world_size_beyond_the_cuda_devices(ckpt, monkeypatch):
    monkeypatch.setattr(hf_options, "cuda_ok", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError) as e:
        make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"], {"device": "cuda"}), None)
    assert str(e.value) == ("hf-dist engine: option world_size=2 needs 2 CUDA devices (one a rank), and torch sees"
                            " 1; choose a world size up to 1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    eng = make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"], {"device": "cuda"}), None)
    assert eng.toggle("world_size").values == ("2", "1")  # 4 would need 4 devices


def test_the_command_line_refuses_a_world_size_beyond_the_cores(ckpt, monkeypatch, capsys, tmp_path):
    _table(monkeypatch)
    monkeypatch.setattr(hf_dist, "cpu_cores", lambda: 1)
    prof = tmp_path / "tp4.toml"
    prof.write_text('weights = "f32"\nkv = "f32"\n[reference]\nengine = "cpu"\n[subject]\nengine = "hf-dist"\n'
                    '[subject.options]\nworld_size = "4"\n')
    code, out, err = run_cli(capsys, "run", "--profile", prof, "--model", ckpt["dense"], "--tokens", "2", "--json")
    assert code == 2 and out == ""
    assert one_line_error(err) == (f"kestrel-tui run: error: {prof}:8: subject.options.world_size: hf-dist engine:"
                                   " option world_size=4 × threads=1 is 4 CPU threads, and this machine gives 1"
                                   " core (2 threads a core at most); choose world_size=2")


# ---------------------------------------------------------------- TP=2 against TP=1

@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_key_of_the_schema(runs, kind):
    sub = runs(kind)
    assert len(sub.positions) == len(PROMPT) + N
    for p in sub.positions:
        assert list(p.hashes) == token_keys(p.t, LAYERS, SETUP[kind]["deep"])
        for key in p.hashes:
            assert p.raw[key].dtype == (np.int8 if parse_key(key).field in ("k", "v") and SETUP[kind]["kv"] == "q8"
                                        else np.int32 if key.endswith("_topk") else np.float32), key
        assert p.logits.shape == (VOCAB,)


@pytest.mark.slow
def test_tp2_against_tp1(runs, engines):
    tp1, tp2 = runs("dense", "1"), runs("dense", "2")
    cmp = compare(tp1.hashes(), tp2.hashes())
    # the embedding is a vocab-parallel lookup, the row plus the other rank's zeros: exact (no weight here is
    # -0.0, which would come back +0.0), and so is the first norm of it
    assert cmp.status["t0_emb"].value == cmp.status["t0_l0_nrm"].value == "ok"
    assert cmp.first_diff is not None and order_key(cmp.first_diff) > order_key("t0_l0_nrm")
    far = [k for k in tp1.hashes() if not Tolerance().holds(key_metrics(tp1.raw(k), tp2.raw(k)))]
    assert far == []  # the gathered shards are the TP=1 tensors, in their order, up to rounding
    assert tp1.generated == tp2.generated
    assert "world_size=1" in tp1.backend and "world_size=2, tp, gloo" in tp2.backend
    assert tp2.parallel.as_dict()["ranks"] == [0, 1] and tp2.parallel.plan == "tp" and tp1.parallel.plan == "none"
    for key in ("t4_l1_kraw", "t4_l1_qrope", "t4_l1_attn"):  # a column-parallel key: each rank's heads
        shards = tp2.rank_values(key)
        assert len(shards) == 2 and shards[0].shape[0] * 2 == tp2.raw(key).shape[0]
        np.testing.assert_array_equal(np.concatenate(shards), tp2.raw(key))
    assert tp2.rank_values("t4_l1_nrm") is None and tp1.rank_values("t4_l1_kraw") is None
    assert engines["dense"].findings == []  # replicated keys agreed on both ranks
    for p in tp1.positions:  # no reduction at TP=1: no per-rank entries
        assert not [k for k in p.raw if "@" in k]


@pytest.mark.slow
@pytest.mark.parametrize("kind, ep", [("dense", "off"), ("moe", "off"), ("moe", "on")])
def test_partial_sums_are_reduced(runs, engines, kind, ep):
    """ores = residual + the all-reduce of the ranks' o_proj partials, x = ores + that of the FFN's: bit for
    bit, and with 2 ranks the all-reduce is the one float add of the two partials. A MoE under TP alone has
    the FFN's partials only where the installed transformers' TP plan splits the experts (up to 5.24); from
    5.25 every rank runs them whole: x is replicated, with no partials, and the engine says so."""
    trace = runs(kind, "2", ep)
    ffn_split = kind == "dense" or ep == "on" or INSTALLED_TP_SPLITS_EXPERTS
    fields = ("ores", "x") if ffn_split else ("ores",)
    branches = {f"t{p.t}_l{li}_{f}" for p in trace.positions for li in range(LAYERS) for f in fields}
    assert trace.partial == branches
    said = [n for n in engines[kind].notes if "splits no experts" in n]
    assert len(said) == (kind == "moe" and not INSTALLED_TP_SPLITS_EXPERTS)
    assert trace.findings == []  # every replicated key, x among them where it is one, equal on both ranks
    for p in trace.positions:
        for li in range(LAYERS):
            key = lambda f: f"t{p.t}_l{li}_{f}"  # noqa: E731
            prev = p.raw[f"t{p.t}_emb"] if li == 0 else p.raw[key("x").replace(f"_l{li}_", f"_l{li - 1}_")]
            if not ffn_split:  # a replicated key like any other: no shares, and the ranks agreed on it
                assert rank_values(p.raw, key("x")) is None and trace.rank_values(key("x")) is None
                assert sum_key(key("x")) not in p.raw
            for field, base in (("ores", prev), ("x", p.raw[key("ores")])):
                if field not in fields:
                    continue
                parts = rank_values(p.raw, key(field))
                assert len(parts) == 2, key(field)
                assert [a.tobytes() for a in trace.rank_values(key(field))] == [a.tobytes() for a in parts]
                reduced = p.raw[sum_key(key(field))]
                np.testing.assert_array_equal(_bits(parts[0] + parts[1]), _bits(reduced))
                np.testing.assert_array_equal(_bits(base + reduced), _bits(p.raw[key(field)]))
                assert not np.array_equal(parts[0], parts[1])  # two real shares, not one sum twice


def test_a_tp_plan_that_leaves_the_experts_whole_is_said(ckpt, monkeypatch):
    """transformers 5.25 dropped the experts from qwen3_moe's TP plan: under TP alone every rank runs them
    whole and a MoE layer's x has no per-rank partial sums. A MoE engine that may run so says it in one note;
    with the experts in the plan (up to 5.24), on a dense model, or where every run is on one rank or has EP,
    nothing is said."""
    whole = {k: v for k, v in transformers.Qwen3MoeConfig.base_model_tp_plan.items() if ".mlp.experts" not in k}
    monkeypatch.setattr(transformers.Qwen3MoeConfig, "base_model_tp_plan", whole)
    moe = make_hf_dist_engine(EngineSpec("hf-dist", ckpt["moe"]), None)
    note = (f"hf-dist: transformers {transformers.__version__}'s tensor-parallel plan splits no experts: with"
            f" ep=off every rank runs all of them whole, so a MoE layer's x is replicated and has no per-rank"
            f" partial sums (x@R, x@sum); ep=on splits the experts")
    assert note in moe.notes
    ep_toggle = Toggle("ep", ("on", "off"), "off", (), "", key="ep")
    assert note in make_hf_dist_engine(EngineSpec("hf-dist", ckpt["moe"], {"world_size": 1, "ep": "on"},
                                                  toggles=(Toggle("world_size", ("1", "2"), "1", (), "",
                                                                  key="world_size"), ep_toggle)), None).notes
    for options, toggles in (({"world_size": 1}, ()), ({"ep": "on"}, ()), ({"world_size": 1}, (ep_toggle,))):
        eng = make_hf_dist_engine(EngineSpec("hf-dist", ckpt["moe"], options, toggles=toggles), None)
        assert note not in eng.notes, (options, toggles)
    assert not [n for n in make_hf_dist_engine(EngineSpec("hf-dist", ckpt["dense"]), None).notes if "experts" in n]
    monkeypatch.setattr(transformers.Qwen3MoeConfig, "base_model_tp_plan", whole | TP_EXPERTS)
    assert note not in make_hf_dist_engine(EngineSpec("hf-dist", ckpt["moe"]), None).notes


@pytest.mark.slow
def test_ep2_on_the_moe(runs, engines):
    tp, ep = runs("moe", "2", "off"), runs("moe", "2", "on")
    assert "tp+ep, all_reduce" in ep.backend
    cmp = compare(tp.hashes(), ep.hashes())
    # attention is sharded alike in both: only the experts' sum can part them
    if cmp.first_diff is not None:
        assert order_key(cmp.first_diff) >= order_key("t0_l0_x")
    for k in tp.hashes():
        a, b = tp.raw(k), ep.raw(k)
        if a.dtype == np.int8:  # a q8 code may round the other way
            assert np.abs(a.astype(int) - b).max() <= 1, k
        else:
            assert Tolerance().holds(key_metrics(a, b)), k
    assert tp.generated == ep.generated
    assert engines["moe"].findings == []


@pytest.mark.slow
def test_a_group_serves_runs_and_ends_on_cancel(engines, runs):
    import threading

    eng = engines["dense"]
    values = _values(eng, world_size="2")
    forced = runs("dense", "2").generated[:N]
    first = eng.run(RunRequest(PROMPT, N, values, forced=forced))  # the group of 2 (the last run had 1 rank)
    pids = eng.parallel(values).pids
    assert len(pids) == 2 and all(pid > 0 for pid in pids)
    assert pids[0] in procs._groups  # the group is registered while it lives
    again = eng.run(RunRequest(PROMPT, N, values, forced=forced))
    assert eng.parallel(values).pids == pids and again.hashes() == first.hashes()  # same ranks, same bits
    cancel = threading.Event()
    with pytest.raises(Cancelled):
        eng.run(RunRequest(PROMPT, N, values, cancel=cancel, on_position=lambda p: cancel.set()))
    assert eng.parallel(values).pids == () and all(gone(pid) for pid in pids)
    assert pids[0] not in procs._groups


# ---------------------------------------------------------------- failures

def _fail(ckpt, monkeypatch, faults, **options):
    """A dense TP=2 run with ``faults`` planted, one position a step: (the failure, the ranks' pids, the
    group's folder) after it, with what it kept."""
    for name, value in fault_env(faults).items():
        monkeypatch.setenv(name, value)
    eng = _engine(ckpt, "dense", prefill="token", **options)
    seen = {}

    def on_position(p):
        seen.setdefault("pids", eng.parallel(values).pids)
        seen.setdefault("folder", eng._group.folder)

    values = _values(eng)
    try:
        with pytest.raises(EngineFailed) as e:
            eng.run(RunRequest(PROMPT, N, values, on_position=on_position))
    finally:
        eng.close()
    assert len(seen["pids"]) == 2 and all(pid > 0 for pid in seen["pids"])
    assert all(gone(pid) for pid in seen["pids"]) and not os.path.exists(seen["folder"])
    assert seen["pids"][0] not in procs._groups
    assert "\n" not in str(e.value)
    return e.value, eng


@pytest.mark.slow
def test_a_crashing_rank_ends_the_group(ckpt, monkeypatch):
    err, eng = _fail(ckpt, monkeypatch, "1:replica:2,1:exit:5")
    assert str(err) == "hf-dist engine: at position 5, rank 1 of 2 exited with code 3; all 2 ranks ended, 5" \
                       " positions kept"
    assert [p.t for p in err.partial.positions] == [0, 1, 2, 3, 4]
    # the planted bit in rank 1's replicated nrm is a finding, with both copies kept
    assert eng.findings == ["t2_l0_nrm: replicated, but rank 1 differs from rank 0"]
    copies = rank_values(err.partial.positions[2].raw, "t2_l0_nrm")
    assert (_bits(copies[0]) ^ _bits(copies[1])).tolist() == [1] + [0] * 63


def test_a_raising_rank_is_named_not_the_peer_its_death_resets(ckpt, monkeypatch):
    """A rank that raises reports it; its peer's collective then fails too ("Connection reset by peer"),
    and whichever report comes first, the cause named is the raising rank. The crash of
    test_a_crashing_rank_ends_the_group is the other way round: a rank that ends without a report is the
    cause even when its peer's failure arrives first."""
    err, _ = _fail(ckpt, monkeypatch, "1:raise:5")
    assert str(err).startswith("hf-dist engine: at position 5, rank 1 of 2 raised RuntimeError: planted fault")
    assert len(err.partial.positions) == 5


@pytest.mark.slow
def test_a_hanging_rank_ends_the_group(ckpt, monkeypatch):
    err, _ = _fail(ckpt, monkeypatch, "1:hang:5", timeout=2)
    assert str(err) == "hf-dist engine: at position 5, rank 1 of 2 did not start the step within 2 s; it hangs" \
                       " (timeout); all 2 ranks ended, 5 positions kept"
    assert len(err.partial.positions) == 5


@pytest.mark.slow
def test_a_rank_that_disagrees_on_shapes_ends_the_group(ckpt, monkeypatch):
    err, _ = _fail(ckpt, monkeypatch, "1:shape:5")
    assert str(err) == "hf-dist engine: at position 5, rank 1 of 2 disagrees on shapes: its shard of t5_l0_kraw" \
                       " is [31] where 1/2 of [64] fits; all 2 ranks ended, 5 positions kept"
    assert len(err.partial.positions) == 5


@pytest.mark.slow
def test_a_checkpoint_the_ranks_cannot_load(ckpt, tmp_path):
    import shutil

    bad = tmp_path / "truncated"
    shutil.copytree(ckpt["dense"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # config.json is whole: the engine builds, the ranks fail
    eng = make_hf_dist_engine(EngineSpec("hf-dist", str(bad), {"timeout": 60}), None)
    groups = set(procs._groups)
    try:
        with pytest.raises(EngineFailed, match=r"^hf-dist engine: while loading the model, rank [01] of 2 raised"
                                               r" .*; all 2 ranks ended, 0 positions kept$") as e:
            eng.run(RunRequest(PROMPT, N, _values(eng)))
    finally:
        eng.close()
    assert "\n" not in str(e.value) and e.value.partial.positions == []
    assert set(procs._groups) == groups


# ---------------------------------------------------------------- profiles and the command line

def _table(monkeypatch):
    """The engine table with hf-dist in it, as the profile loader and make_engine read it."""
    def factory(spec, model, kv, deep, impl, cuda_options=None):
        return make_hf_dist_engine(spec, model, kv=kv, deep=deep)

    monkeypatch.setitem(registry.ENGINE_TABLE, "hf-dist", registry.EngineEntry("hf-dist", factory,
                                                                               flag_subject=True))
    for module in (registry, profile):  # the name tuple is read once, at import
        monkeypatch.setattr(module, "ENGINES", tuple(registry.ENGINE_TABLE))


@pytest.mark.parametrize("name, reference, subject", [
    ("cpu-vs-hf-tp2", "cpu", "hf-dist (world_size=2, tp, gloo)"),
    ("hf-tp1-vs-tp2", "hf-dist (world_size=1, gloo)", "hf-dist (world_size=2, tp, gloo)"),
    ("hf-ep2-moe", "hf-dist (world_size=1, gloo)", "hf-dist (world_size=2, tp+ep, all_reduce, gloo)"),
])
def test_the_profiles_build(monkeypatch, ckpt, name, reference, subject):
    from kestrel_tui.engines.build import make_engine

    _table(monkeypatch)
    prof = load_profile(ROOT / "profiles" / f"{name}.toml", model_override=ckpt["moe"])
    model = load_model(ckpt["moe"], "f32")
    described = []
    for spec in (prof.reference, prof.subject):
        eng = make_engine(spec, model, kv=prof.kv)
        described.append(eng.describe(_values(eng)))
        eng.close()
    assert described == [reference, subject]


@pytest.mark.slow
def test_run_json_through_a_profile(monkeypatch, ckpt, capsys):
    _table(monkeypatch)
    code, out, err = run_cli(capsys, "run", "--profile", ROOT / "profiles" / "hf-tp1-vs-tp2.toml",
                             "--model", ckpt["dense"], "--tokens", "2", "--json")
    report = json.loads(out)
    assert report["reference"].startswith("hf-dist (world_size=1")
    assert report["subject"].startswith("hf-dist (world_size=2, tp, gloo")
    assert report["first_diff"] is not None and report["first_far"] is None, report
    sides = report["parallel"]
    assert (sides["reference"]["world_size"], sides["subject"]["world_size"]) == (1, 2)
    assert sides["subject"]["ranks"] == [0, 1] and sides["subject"]["backend"] == "gloo"
    assert code == 0, err


def test_a_schedule_runs_on_every_rank(ckpt, runs):
    """forward at TP=2: each rank runs the whole sequence in one pass (its cache restarts at position 0),
    the keys are those of the ranks' decode up to summation order, and with no tokens given the ranks
    first decode them (the rollout), then score them."""
    base = runs("dense")
    eng = _engine(ckpt, "dense", schedule="forward")
    try:
        forced = [p.token for p in base.positions[len(PROMPT):]]
        for given in (forced, None):
            tr = eng.run(RunRequest(PROMPT, N, _values(eng, world_size="2"), forced=given))
            assert [p.token for p in tr.positions] == [p.token for p in base.positions]
            diff = [k for k, st in compare(base.hashes(), tr.hashes()).status.items() if st.name == "DIFF"]
            far = [k for k in diff if not Tolerance().holds(key_metrics(base.raw(k), tr.raw(k)))]
            assert far == [] and len(tr.positions) == len(PROMPT) + N
        assert "schedule=forward" in eng.describe(_values(eng))
    finally:
        eng.close()
