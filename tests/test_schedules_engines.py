"""Schedules on the engines that run other code: transformers (hf) and llama.cpp, and the cpu reference at
real Qwen3 dimensions; a bug planted in one schedule only is found from the reference at its key."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kestrel_tui.engines.base import EngineSpec, RunRequest  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.session.session import RunSettings, Session  # noqa: E402
from kestrel_tui.trace.compare import parse_tolerance  # noqa: E402

from clitools import run_cli as run  # noqa: E402
from hfmodels import qwen3_06b_shaped  # noqa: E402

PROMPT = [5, 77, 19, 33, 8]
N = 4
HF_F32 = {"device": "cpu", "dtype": "float32", "attn_implementation": "eager"}


@pytest.fixture(scope="module")
def f32_model():
    return load_model(None, "f32", n_layers=2)


def _hf(model, schedule, **over):
    return make_engine(EngineSpec("hf", options={**HF_F32, **over, "schedule": schedule}), model, kv="f32")


def _values(engine):
    return {t.name: t.default for t in engine.toggles}


def test_hf_schedules_run_transformers_in_their_passes(f32_model):
    """Each schedule's passes are what transformers is called with (the widths of input_ids), and the
    forward schedule's keys at every position are transformers' own full-sequence forward's."""
    seen = {}
    for schedule in ("decode", "forward", "chunked:2", "prefix:3", "verify:2"):
        e = _hf(f32_model, schedule)
        widths = []
        hook = e.torch_model(_values(e)).model.embed_tokens.register_forward_hook(
            lambda _m, args, _out: widths.append(args[0].shape[1]))
        try:
            forced = seen.get("tokens")
            tr = e.run(RunRequest(PROMPT, N, _values(e), forced=forced))
        finally:
            hook.remove()
            e.close()
        seen.setdefault("tokens", [p.token for p in tr.positions[len(PROMPT):]])
        seen[schedule] = (widths, tr)
    assert seen["decode"][0] == [5, 1, 1, 1, 1]
    assert seen["forward"][0] == [9]
    assert seen["chunked:2"][0] == [2, 2, 1, 1, 1, 1, 1]
    assert seen["prefix:3"][0] == [3, 2, 1, 1, 1, 1]
    assert seen["verify:2"][0] == [5, 2, 2]
    # the forward schedule's logits are one call of transformers' model on the whole sequence
    ids = PROMPT + seen["tokens"]
    export = _hf(f32_model, "decode")  # its HF export of the embedded model lives as long as the engine
    hf = transformers.AutoModelForCausalLM.from_pretrained(export.model_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    export.close()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    got = np.stack([p.logits for p in seen["forward"][1].positions])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_bug_planted_in_the_prefix_pass_is_found_at_its_key(f32_model):
    """The reused prefix's V rows scaled by 1 + 2^-10 (as a prefix cache that kept a stale or rescaled
    copy would): hf prefix:2 against hf decode — the same engine, two schedules. The first far key is the
    first position's V row in layer 0, and the logprob mismatch of every generated token is reported."""
    ref, sub = _hf(f32_model, "decode"), _hf(f32_model, "prefix:2")

    def stale_prefix(_m, args, out):
        if args[0].shape[1] == 2:  # only the prefix's pass has two columns here (the rest: 3, then 1)
            return out * (1 + 2 ** -10)
        return out

    v_proj = sub.torch_model(RunSettings().values(sub.toggles)).model.layers[0].self_attn.v_proj  # the run's model
    v_proj.register_forward_hook(stale_prefix)
    session = Session(f32_model, PROMPT, N, reference=ref, subject=sub, kv="f32")
    try:
        res = session.run(RunSettings())
        summary = res.tolerance(parse_tolerance("nmse=1e-7"))
        assert summary.first_far == "t0_l0_v"
        mm = res.mismatch
        assert mm.tally.tokens == N + 1 and mm.unscored == 0
        assert mm.tally.bitwise < N + 1 and mm.tally.k3_sum > 0
        # unplanted, the same two schedules differ by summation order only: nothing is far
        v_proj._forward_hooks.clear()
        clean = session.run(RunSettings()).tolerance(parse_tolerance("nmse=1e-7"))
        assert clean.first_far is None
    finally:
        ref.close()
        sub.close()


@pytest.fixture(scope="module")
def qwen3_06b_dir(tmp_path_factory):
    return qwen3_06b_shaped(tmp_path_factory.mktemp("qwen3-0.6b-shaped"))


@pytest.mark.parametrize("weights", ["q4_0", "f32"])
def test_the_cpu_reference_is_bitwise_under_every_schedule_at_qwen3_dimensions(qwen3_06b_dir, weights):
    model = load_model(str(qwen3_06b_dir), weights)
    prompt = [1, 2, 3, 151935, 100000]

    def run(schedule, forced=None):
        e = make_engine(EngineSpec("cpu", options={"schedule": schedule}), model, kv="f32")
        return e.run(RunRequest(prompt, 3, {}, forced=forced))

    decode = run("decode")
    forced = [p.token for p in decode.positions[len(prompt):]]
    for schedule in ("forward", "chunked:2", "prefix:4", "verify:3"):
        tr = run(schedule, forced)
        assert [p.hashes for p in tr.positions] == [p.hashes for p in decode.positions], schedule
        assert all(np.array_equal(p.logits.view(np.uint32), q.logits.view(np.uint32))
                   for p, q in zip(tr.positions, decode.positions)), schedule


@pytest.mark.parametrize("name,schedule", [("trainer-vs-rollout-f32", "forward"), ("trainer-vs-rollout-bf16", "forward"),
                                           ("chunked-prefill", "chunked:4"), ("prefix-reuse", "prefix:6")])
def test_shipped_schedule_profiles_run(capsys, name, schedule):
    """Each shipped schedule profile, headless on the embedded model: its subject runs the schedule, and
    --toggle schedule=decode (the reference's) is all ok — one engine, the same passes, the same bits."""
    profile = Path(__file__).resolve().parents[1] / "profiles" / f"{name}.toml"
    code, out, err = run(capsys, "run", "--profile", profile, "--tokens", "2", "--json")
    report = json.loads(out)
    assert code in (0, 1) and f"schedule={schedule}" in report["subject"], err
    assert report["logprob_mismatch"]["tokens"] == 3
    code, out, err = run(capsys, "run", "--profile", profile, "--tokens", "2", "--toggle", "schedule=decode")
    assert code == 0 and "all ok" in out, out + err
