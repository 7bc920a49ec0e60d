"""Bugs that exist only under parallelism, planted in a rank's shard after transformers has sharded the
model (tests/rankfaults.py's ShardFault, the hooks module the ranks are handed), hunted the way a user hunts
them: the cpu reference against hf-dist at 2 ranks over gloo, f32 weights and KV, teacher forcing,
tolerance NMSE <= 1e-7. Per bug: the first far key is at the layer and field the bug is in, and the
per-rank view (trace/ranks.compare_shares) names the rank — held against a clean run of the same world
size (a partial sum means something only there) and, for a column-parallel key, against the
reference's slice too. Tiny Qwen3 / Qwen3-MoE checkpoints made here with transformers' own classes."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kestrel_tui.engines.base import EngineSpec  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.engines.hf_dist import make_hf_dist_engine  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.session.session import Session  # noqa: E402
from kestrel_tui.trace.compare import Tolerance  # noqa: E402
from kestrel_tui.trace.keys import parse_key  # noqa: E402
from kestrel_tui.trace.ranks import compare_shares  # noqa: E402

from rankfaults import SHARD_SCALE, Fault, ShardFault, faults_from, planted  # noqa: E402

PROMPT, N, LAYERS = [5, 77, 190, 33], 3, 2
TOL = Tolerance()
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=8, head_dim=16,
              rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False)
SCALE_K = "1:scale_shard:L1.self_attn.k_proj"   # column-parallel: rank 1's kv heads of layer 1
SCALE_K0 = "0:scale_shard:L1.self_attn.k_proj"  # at world size 1, rank 0's shard would be the whole weight
SWAP_DOWN = "*:swap_shards:L1.mlp.down_proj"    # row-parallel: ranks 0 and 1 each hold the other's columns
MISPLACE = "1:ep_misplace:L1"                   # EP: rank 1's experts of layer 1 one place off


def _build(kind: str, seed: int):
    if kind == "moe":
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
    root = tmp_path_factory.mktemp("hf_dist_planted")
    out = {}
    for kind, seed in (("dense", 2), ("moe", 1)):
        _build(kind, seed).save_pretrained(root / kind)
        out[kind] = str(root / kind)
    return out


@pytest.fixture(scope="module")
def hunt(ckpt):
    """(kind, fault, world_size, ep) -> the RunResult of the cpu reference against hf-dist with that fault
    planted (None: a clean run), and the subject's findings."""
    done = {}

    def get(kind, fault=None, world="2", ep="off"):
        if (kind, fault, world, ep) not in done:
            model = load_model(ckpt[kind], "f32")
            options = {"timeout": 120, "prefill": "token", "world_size": world, **({"ep": ep} if kind == "moe" else {})}
            sub = make_hf_dist_engine(EngineSpec("hf-dist", ckpt[kind], options), model, kv="f32", deep=True)
            session = Session(model, PROMPT, N, reference=make_engine("cpu", model, kv="f32", deep=True),
                              subject=sub, kv="f32", deep=True)
            with planted(fault):
                try:
                    res = session.run(replace(session.initial_settings(), prefill="subject"))
                finally:
                    sub.close()
            assert res.failed is None, res.failed
            done[kind, fault, world, ep] = res, list(sub.findings)
        return done[kind, fault, world, ep]
    return get


def _named(report) -> list[int]:
    """The ranks whose share is not bit-equal to the clean run's."""
    return [s.rank for s in report if s.status != "ok"]


def _far(report) -> list[int]:
    """The ranks whose share is beyond the tolerance against the reference's slice."""
    return [s.rank for s in report if s.status == "DIFF" and not s.nmse <= TOL.nmse]


# ---------------------------------------------------------------- the hook itself, without processes

def test_the_fault_hook_parses_shard_faults():
    assert faults_from(f"{SCALE_K},{SWAP_DOWN},{MISPLACE},1:exit:5") == (
        ShardFault(1, "scale_shard", 1, "self_attn.k_proj"), ShardFault(None, "swap_shards", 1, "mlp.down_proj"),
        ShardFault(1, "ep_misplace", 1, "mlp.experts"), Fault(1, "exit", 5))
    for bad in ("1:swap_shards:L1.mlp.down_proj", "*:scale_shard:L1.self_attn.k_proj", "1:scale_shard:1",
                "1:scale_shard:Lx.self_attn.k_proj"):
        with pytest.raises(SystemExit, match="want RANK:KIND:POSITION .* or RANK:KIND:L<layer>"):
            faults_from(bad)


# ---------------------------------------------------------------- planted bugs, hunted

@pytest.mark.slow
@pytest.mark.parametrize("kind, ep", [("dense", "off"), ("moe", "on")])
def test_a_clean_run_has_no_far_key(hunt, kind, ep):
    """The control: what the planted runs find far, the clean split does not."""
    res, findings = hunt(kind, ep=ep)
    assert res.first_diff is not None  # BLAS's order and the split sums: bits differ, within tolerance
    assert res.tolerance(TOL).first_far is None and res.tolerance(TOL).n_far == 0
    assert findings == []


@pytest.mark.slow
def test_a_scaled_column_parallel_shard(hunt):
    clean, _ = hunt("dense")
    res, findings = hunt("dense", SCALE_K)
    key = res.tolerance(TOL).first_far
    assert key == "t0_l1_kraw"  # the projection's own output, at the first position; everything before ok
    # against the reference's slice of the whole tensor: rank 1's heads far, rank 0's within tolerance
    against_ref = compare_shares(res.ref, res.sub, key)
    assert _far(against_ref) == [1] and against_ref[1].nmse > 1e-5
    # against a clean run of 2 ranks: rank 0's heads bit for bit, rank 1's not
    assert _named(compare_shares(clean.sub, res.sub, key)) == [1]
    mine, clean_one = res.sub.rank_values(key)[1], clean.sub.rank_values(key)[1]
    np.testing.assert_allclose(mine, clean_one * SHARD_SCALE, rtol=1e-5)  # the fault is what it says
    # the per-head norm takes the scale back out: knorm is back within tolerance of the reference
    assert TOL.holds(res.metrics("t0_l1_knorm"))
    assert findings == []  # every replicated key still agrees across the ranks: only the shares tell


@pytest.mark.slow
def test_swapped_row_parallel_shards(hunt):
    clean, _ = hunt("dense")
    res, findings = hunt("dense", SWAP_DOWN)
    # the FFN's output (the all-reduce of down_proj's partials): each rank's input columns met the other's
    # weights
    assert res.tolerance(TOL).first_far == "t0_l1_moe"
    key = "t0_l1_x"  # the key the partial sums are kept under (the FFN's output plus the residual)
    assert [s.status for s in compare_shares(res.ref, res.sub, key)] == ["partial", "partial"]  # vs 1 rank
    assert _named(compare_shares(clean.sub, res.sub, key)) == [0, 1]  # both ranks' partial sums moved
    assert _named(compare_shares(clean.sub, res.sub, "t0_l1_ores")) == []  # the attention branch did not
    assert findings == []


@pytest.mark.slow
def test_a_misplaced_expert_under_ep(hunt):
    clean, _ = hunt("moe", ep="on")
    res, findings = hunt("moe", MISPLACE, ep="on")
    key = res.tolerance(TOL).first_far
    k = parse_key(key)
    assert (k.layer, k.field) == (1, "moe")  # the experts' weighted sum of layer 1
    routed = f"t{k.t}_l1_topk"
    assert res.sub.raw(routed).tobytes() == clean.sub.raw(routed).tobytes()  # the router chose alike
    assert set(res.sub.raw(routed).tolist()) & {4, 5, 6, 7}  # a token went to rank 1's experts (4 to 7)
    x = f"t{k.t}_l1_x"  # the all-reduce of the ranks' expert outputs
    assert _named(compare_shares(clean.sub, res.sub, x)) == [1]
    assert findings == []


@pytest.mark.slow
def test_one_rank_holds_no_shard(hunt):
    """The faults at world size 1 (rank 0's k_proj too, which is the whole weight there): nothing is
    sharded, nothing planted, nothing far."""
    res, _ = hunt("dense", f"{SCALE_K},{SCALE_K0},{SWAP_DOWN}", world="1")
    assert res.tolerance(TOL).first_far is None
