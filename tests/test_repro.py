"""Repro bundles (session/repro.py): one op of a run in a folder, replayed by a numpy-only replay.py.

The replay's functions (session/replay_template.py, copied into every bundle) are checked against
ours bit for bit on random inputs, and every op's replay against the run's reference output bit for
bit; planted bugs (the sim with one op fast, a transformers checkpoint with a scaled weight) are
bundled and replayed in a fresh virtual environment that holds numpy and nothing else.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kestrel_tui.backends import ops_exact
from kestrel_tui.backends.toggles import TOGGLES
from kestrel_tui.errors import UsageError
from kestrel_tui.model.config import default_config
from kestrel_tui.model.quant import quantize_q4_0_ggml, quantize_q8_0, quantize_rows_q8
from kestrel_tui.model.weights import Linear, synthetic_model
from kestrel_tui.numerics import transcend
from kestrel_tui.numerics.linalg import gemv
from kestrel_tui.session import repro
from kestrel_tui.session.refcache import model_fingerprint
from kestrel_tui.session.repro import PLANS, default_key, write_bundle
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.trace.compare import Tolerance, key_metrics, parse_tolerance
from replaytools import copy_away, numpy_only_python, run_replay

F32 = np.float32
PROMPT = [5, 77, 190, 33]
N = 2
T = len(PROMPT)  # the first decoded position: the prompt ran in the reference (prefill=reference)


def _load_template():
    spec = importlib.util.spec_from_file_location("replay_under_test", repro.TEMPLATE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


R = _load_template()


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


# ---------------------------------------------------------------- the replay's functions are ours

def _f32_patterns(rng, n, lo_exp=-30, hi_exp=12):
    """Random float32s of both signs over a range of magnitudes, plus random bit patterns."""
    mags = np.ldexp(rng.uniform(1, 2, n), rng.integers(lo_exp, hi_exp, n)).astype(F32)
    signs = np.where(rng.random(n) < 0.5, F32(-1), F32(1))
    return mags * signs


def test_expf_and_silu_are_ours_bit_for_bit():
    rng = np.random.default_rng(1)
    edges = np.array([0, -0.0, np.inf, -np.inf, np.nan, 88.7228394, 88.72284, -104, -104.00001, -103.99,
                      1e-30, -1e-30, 2**-149, -(2**-149), 1e-8, 0.5, -87.3, 80.0], F32)
    x = np.concatenate([edges, rng.uniform(-110, 92, 1500).astype(F32), _f32_patterns(rng, 800, -40, 7),
                        rng.integers(0, 2**32, 300, dtype=np.uint64).astype(np.uint32).view(F32)])
    with np.errstate(invalid="ignore", over="ignore"):
        assert same_bits(R.expf(x), transcend.expf(x))
        assert same_bits(R.silu(x), transcend.silu(x))


def test_cosf_sinf_are_ours_bit_for_bit():
    """Every branch: tiny, small, the direct polynomial, Cody-Waite with each quadrant, near-integer
    reductions, RoPE's range (angles up to the context length); inf and nan."""
    rng = np.random.default_rng(2)
    pio4 = np.array(0x3F490FDB, np.uint32).view(F32)
    edges = np.array([0, -0.0, 2**-14, -(2**-14), 2**-8, -(2**-8), 0.1, pio4, np.nextafter(pio4, F32(1)),
                      np.pi / 2, np.pi, 3 * np.pi / 2, 1e5, 6.5e6, 7e6, np.inf, -np.inf, np.nan], F32)
    x = np.concatenate([edges, rng.uniform(0, 40960, 1200).astype(F32), _f32_patterns(rng, 1200, -16, 23),
                        (np.arange(1, 400) * F32(np.pi / 2)).astype(F32)])
    with np.errstate(invalid="ignore"):
        c, s = R.sincosf(x)
        assert same_bits(c, transcend.cosf(x)) and same_bits(s, transcend.sinf(x))


def test_sums_norms_and_quantizers_are_ours_bit_for_bit():
    from kestrel_tui.numerics.reduce import lane_sum, seq_sum, sumsq_block8

    rng = np.random.default_rng(3)
    for n in (7, 32, 33, 259, 1000):
        t = (rng.standard_normal((3, n)) * rng.uniform(0.01, 100, (3, 1))).astype(F32)
        assert same_bits(R.lane_sum(t, -1), lane_sum(t, -1)) and same_bits(R.seq_sum(t), seq_sum(t))
        assert same_bits(R.sumsq_block8(t), sumsq_block8(t))
        w = rng.uniform(0.5, 1.5, n).astype(F32)
        assert same_bits(R.rmsnorm(t, w, 1e-6), ops_exact.rmsnorm(t, w, 1e-6))
    x = (rng.standard_normal((8, 64)) * 3).astype(F32)
    x[2] = 0  # an all-zero row: d = 0, no division
    w = rng.uniform(0.5, 1.5, 64).astype(F32)
    assert same_bits(R.qknorm(x, w, 1e-6), ops_exact.qknorm(x, w, 1e-6))
    for got, want in zip(R.quantize_q8_0(x), quantize_q8_0(x)):
        assert same_bits(got, want.reshape(got.shape))
    for got, want in zip(R.quantize_rows_q8(x), quantize_rows_q8(x)):
        assert same_bits(got, want)


@pytest.mark.parametrize("fmt", ["q4_0", "f32"])
def test_gemv_is_ours_bit_for_bit(fmt):
    rng = np.random.default_rng(4)
    out, inp = 1100, 320  # more rows than the replay's step: two chunks
    w = (rng.standard_normal((out, inp)) * 0.1).astype(F32)
    lin = Linear(out, inp, blocks=quantize_q4_0_ggml(w)) if fmt == "q4_0" else Linear(out, inp, w=w)
    x = (rng.standard_normal(inp) * 2).astype(F32)
    bias = rng.standard_normal(out).astype(F32)
    stored = lin.blocks if fmt == "q4_0" else lin.w
    assert same_bits(R.gemv(stored, x), gemv(lin, x[None])[0])
    assert same_bits(R.gemv(stored, x, bias), gemv(lin, x[None])[0] + bias)
    if fmt == "q4_0":
        assert same_bits(R.dequantize_q4_0(lin.blocks[:3]), lin.rows(np.arange(3)))


@pytest.mark.parametrize("factor", [None, 1.2071])
def test_rope_is_ours_bit_for_bit(factor):
    rng = np.random.default_rng(5)
    inv_freq = (1.0 / 1e6 ** (np.arange(32) / 32)).astype(F32)
    x = rng.standard_normal((4, 64)).astype(F32)
    for t in (0, 3, 1234, 40000):
        cos, sin = ops_exact.rope_cos_sin(np.array([t]), inv_freq)
        if factor is not None:
            cos, sin = cos * F32(factor), sin * F32(factor)
        want = ops_exact.rope(x[None], cos, sin)[0]
        got = R.rope(x, *R.rope_tables({"position": t, "rope_factor": factor}, inv_freq))
        assert same_bits(got, want)


@pytest.mark.parametrize("kv", ["q8", "f32"])
def test_attention_is_ours_bit_for_bit(kv):
    rng = np.random.default_rng(6)
    n_t, n_kv, nh, hd = 9, 2, 8, 64
    rows = (rng.standard_normal((n_t, n_kv, hd)) * 2).astype(F32), rng.standard_normal((n_t, n_kv, hd)).astype(F32)
    if kv == "q8":
        (k, ks), (v, vs) = (quantize_rows_q8(r) for r in rows)
    else:
        (k, v), ks, vs = rows, np.ones((n_t, n_kv), F32), np.ones((n_t, n_kv), F32)
    q = (rng.standard_normal((nh, hd)) * 3).astype(F32)
    scale = F32(1 / np.sqrt(hd))
    want = ops_exact.attention(q[None], dict(k=k, ks=ks, v=v, vs=vs), np.array([n_t - 1]), scale)[0]
    assert same_bits(R.attention(q, k, ks, v, vs, float(scale)), want)


def test_routing_and_experts_are_ours_bit_for_bit():
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((5, 16)) * 2).astype(F32)
    logits[3, 4] = logits[3, 9]  # a tie: the lower index first
    for norm in (True, False):
        idx, w = ops_exact.route(logits, 4, norm)
        for m in range(5):
            got_idx, got_w = R.route(logits[m], 4, norm)
            assert np.array_equal(got_idx, idx[m]) and same_bits(got_w, w[m])
    x = (rng.standard_normal(64) * 4).astype(F32)
    assert same_bits(R.silu(x), ops_exact.silu(x))


def test_metrics_and_verdicts_are_ours():
    rng = np.random.default_rng(8)
    a = rng.standard_normal(300).astype(F32)
    cases = [a, a + F32(1e-6), np.nextafter(a, F32(9)), a * F32(1.01)]
    b = a.copy()
    b[5] = np.nan
    c = a.copy()
    c[:3] = 0
    cases += [b, c, np.zeros_like(a)]
    tols = [Tolerance(), parse_tolerance("ulp=2"), parse_tolerance("nmse=1e-4,rel=0.02"), parse_tolerance("ulp=0")]
    for other in cases:
        want = key_metrics(a, other)
        got = R.metrics(a, other)
        assert (got["nmse"], got["max_rel_err"], got["max_ulp"]) == (want.nmse, want.max_rel_err, want.max_ulp)
        for tol in tols:
            crit = {"nmse": tol.nmse, "ulp": tol.ulp, "rel": tol.rel}
            verdict = R.judge(got, crit)[0]
            expect = "ok" if same_bits(a, other) else ("close" if tol.holds(want) else "far")
            assert verdict == expect, (tol, want)
    ints = np.array([3, -7, 127], np.int8), np.array([3, -5, 127], np.int8)
    assert R.metrics(*ints)["max_ulp"] == key_metrics(*ints).max_ulp == 2


# ---------------------------------------------------------------- every op replays the reference's bits

def _mixed(fmt: str, layers: int = 2):
    """The default's dims, ``layers`` layers, the last one a dense MLP inside the MoE model."""
    cfg = replace(default_config().with_layers(layers), mlp_only_layers=(layers - 1,), intermediate=96)
    return synthetic_model(cfg, fmt)


def _run(model, kv: str, deep: bool, settings: RunSettings | None = None, subject="sim"):
    session = Session(model, PROMPT, N, subject=subject, kv=kv, deep=deep)
    return session, session.run(settings or RunSettings(exact=frozenset(TOGGLES) - {"norm"}), record=False)


def _key(field: str, layer: int, t: int = T) -> str:
    return f"t{t}_{field}" if field in ("emb", "logits") else f"t{t}_l{layer}_{field}"


def _load_bundle(folder: Path):
    case = json.loads((folder / "case.json").read_text())
    load = {k: np.load(folder / p) for k, p in case["weights"].items()}
    ins = {side: {k: np.load(folder / p) for k, p in case["inputs"][side].items()} for side in ("reference", "subject")}
    return case, load, ins


def _replays_reference(session, result, key: str, tmp_path: Path) -> None:
    folder = tmp_path / key
    write_bundle(session, result, folder, key=key, tol=Tolerance())
    case, weights, ins = _load_bundle(folder)
    got = np.asarray(R.OPS[case["op"]["kind"]](ins["reference"], weights, case["const"]))
    want = repro._raw(result.ref, key)
    assert same_bits(got.reshape(want.shape), want), key
    lines, _ = R.replay(folder)  # every check replay.py makes of a bundle passes this genuine one
    assert lines[1].startswith("reference ref-op(reference's inputs) vs reference's output: ok"), lines


DEEP = [f for f in PLANS if f not in ("router", "topk", "topw")]


@pytest.fixture(scope="module")
def q4_deep():
    return _run(_mixed("q4_0"), "q8", True)


@pytest.fixture(scope="module")
def f32_deep():
    return _run(_mixed("f32"), "f32", True)


@pytest.mark.parametrize("field", list(PLANS))
def test_every_op_replays_the_reference_q4_0_q8(q4_deep, tmp_path, field):
    _replays_reference(*q4_deep, _key(field, 0), tmp_path)  # layer 0: the MoE layer


@pytest.mark.parametrize("field", ["emb", "kraw", "k", "v", "vs", "qrope", "attn", "ores", "moe", "x", "logits"])
def test_every_op_replays_the_reference_f32_f32(f32_deep, tmp_path, field):
    _replays_reference(*f32_deep, _key(field, 1), tmp_path)  # layer 1: the dense MLP


def test_ops_of_a_run_without_deep_keys_replay_the_reference(tmp_path):
    """Without kpre the K row is RoPE then q8 of knorm; without moe the layer output is the whole FFN."""
    session, result = _run(_mixed("q4_0"), "q8", False)
    for key in (_key("k", 0), _key("ks", 1), _key("x", 0), _key("x", 1)):
        _replays_reference(session, result, key, tmp_path)


def test_a_dense_layer_has_no_router_to_bundle(q4_deep, tmp_path):
    with pytest.raises(UsageError, match="dense MLP"):
        write_bundle(*q4_deep, tmp_path / "b", key=_key("router", 1))


# ---------------------------------------------------------------- planted bugs, replayed with numpy only

@pytest.fixture(scope="session")
def numpy_only(tmp_path_factory):
    """A fresh virtual environment whose packages are numpy and nothing else."""
    return numpy_only_python(tmp_path_factory.mktemp("numpy-only"))


def _replay_elsewhere(py: str, folder: Path, tmp_path: Path) -> tuple[int, str]:
    """Copy the bundle away from the repository and replay it there."""
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    p = run_replay(py, copy_away(folder, tmp_path / "elsewhere"), timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout


@pytest.fixture(scope="module")
def norm_fast(small_model):
    """The sim with every op exact but norm: its first DIFF is the first nrm key it computes."""
    return _run(small_model, "q8", False)


def test_a_planted_fast_norm_replays_far_then_close(norm_fast, numpy_only, tmp_path):
    session, result = norm_fast
    strict = parse_tolerance("ulp=0")
    assert result.first_diff == f"t{T}_l0_nrm" and default_key(result, strict) == result.first_diff
    far = write_bundle(session, result, tmp_path / "far", tol=strict)
    assert far.key == result.first_diff and far.verdict == "far"
    code, out = _replay_elsewhere(numpy_only, far.path, tmp_path)
    assert code == 1 and out.splitlines()[-1].startswith("verdict: far"), out
    assert "reference ref-op(reference's inputs) vs reference's output: ok" in out
    close = write_bundle(session, result, tmp_path / "close", key=far.key, tol=Tolerance())
    assert close.verdict == result.tolerance(Tolerance()).verdict[far.key] == "close"
    code, out = _replay_elsewhere(numpy_only, close.path, tmp_path)
    assert code == 0 and out.splitlines()[-1].startswith("verdict: close"), out


def test_an_exact_op_on_drifted_inputs_says_only_the_inputs_drifted(tmp_path):
    """kraw's GEMV is exact in this sim, its input nrm is not: the run's key is far, the op's line ok
    (f32 weights: no q8_0 rounding of the input absorbs the drift)."""
    session, result = _run(synthetic_model(default_config().with_layers(1), "f32"), "f32", False)
    key = f"t{T}_l0_kraw"
    b = write_bundle(session, result, tmp_path / "b", key=key, tol=parse_tolerance("ulp=0"))
    case, _, ins = _load_bundle(b.path)
    assert case["inputs"]["subject"]["x"] != case["inputs"]["reference"]["x"]  # the drifted nrm, kept apart
    assert same_bits(ins["subject"]["x"], result.sub.raw(f"t{T}_l0_nrm"))
    lines, code = R.replay(b.path)
    assert b.verdict == "far" and code == 0, lines
    assert lines[2].startswith("op        ref-op(subject's inputs) vs subject's output: ok")
    assert lines[3].startswith("run       reference's output vs subject's output: far")
    assert "only its inputs drifted" in lines[-1]


def test_an_isolated_run_feeds_the_reference_inputs(small_model, tmp_path):
    session, result = _run(small_model, "q8", False, RunSettings(exact=frozenset(TOGGLES) - {"norm"},
                                                                 mode="isolate"))
    key = f"t{T}_l1_nrm"
    b = write_bundle(session, result, tmp_path / "b", key=key)
    case, _, _ = _load_bundle(b.path)
    assert case["inputs"]["subject"] == case["inputs"]["reference"] and "isolated" in case["inputs_note"]
    assert R.replay(b.path)[1] == 1  # no tolerance: a DIFF of the op itself is far


HF_PROMPT, HF_N = [5, 77, 190, 33], 2


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A tiny dense Qwen3 saved clean and with layer 1's v_proj scaled by 1.01; the cpu reference on the
    clean weights against hf on the perturbed copy (f32 weights and cache)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hfmodels import plant, tiny

    from kestrel_tui.engines.base import EngineSpec
    from kestrel_tui.engines.build import make_engine
    from kestrel_tui.model.hf import load_model

    root = tmp_path_factory.mktemp("planted")
    tiny("dense", seed=2).save_pretrained(root / "clean")
    plant(root / "clean", root / "bug", {"model.layers.1.self_attn.v_proj.weight": 1.01})
    clean = load_model(str(root / "clean"), "f32")
    sub = make_engine(EngineSpec("hf", str(root / "bug"), {"dtype": "float32"}), clean, kv="f32")
    session = Session(clean, HF_PROMPT, HF_N, reference=make_engine("cpu", clean, kv="f32"), subject=sub, kv="f32")
    return session, session.run(RunSettings(), record=False)


def test_a_planted_weight_replays_far_and_a_close_key_close(planted, numpy_only, tmp_path):
    session, result = planted
    tol = Tolerance()
    far = write_bundle(session, result, tmp_path / "far", tol=tol)
    assert far.key == result.tolerance(tol).first_far and far.key.endswith("_l1_v") and far.verdict == "far"
    code, out = _replay_elsewhere(numpy_only, far.path, tmp_path)
    assert code == 1 and "verdict: far - the subject's op computes otherwise" in out, out
    close_key = next(k for k, v in result.tolerance(tol).verdict.items() if v == "close" and k.endswith("_l0_kraw"))
    close = write_bundle(session, result, tmp_path / "close", key=close_key, tol=tol)
    code, out = _replay_elsewhere(numpy_only, close.path, tmp_path)
    assert close.verdict == "close" and code == 0 and out.splitlines()[-1].startswith("verdict: close"), out
    # the dense MLP and the f32 cache's attention of this checkpoint replay the cpu reference's bits
    for key in (far.key, f"t{T}_l1_attn", f"t{T}_l1_x", f"t{T}_logits"):
        _replays_reference(session, result, key, tmp_path)


# ---------------------------------------------------------------- what a bundle says, and what it refuses

def test_case_json_says_what_it_is(norm_fast, tmp_path, monkeypatch):
    monkeypatch.setenv("KESTREL_TEST_SETTING", "1\x1b[2J")
    monkeypatch.setenv("CUDA_FAKE_TOKEN", "s3cret")
    session, result = norm_fast
    tol = parse_tolerance("ulp=1 nrm:ulp=0")
    b = write_bundle(session, result, tmp_path / "b", tol=tol)
    case = json.loads((b.path / "case.json").read_text())
    assert case["key"] == b.key and (case["position"], case["layer"], case["field"]) == (T, 0, "nrm")
    assert case["model"]["fingerprint"] == model_fingerprint(session.model)
    assert case["prompt"] == PROMPT and case["tokens"]["reference"][:T] == PROMPT
    assert case["op"]["rules"] == "L1 (R2)" and case["tolerance"]["rule"] == "nrm"
    assert case["tolerance"]["criteria"] == {"nmse": None, "ulp": 0, "rel": None}
    assert case["verdict"]["run"] == result.tolerance(tol).verdict[b.key] == "far"
    assert case["verdict"]["metrics"] == result.metrics(b.key).as_dict()
    assert case["engines"]["subject"]["describe"] == session.subject_engine.describe(
        result.settings.values(session.toggles))
    assert case["versions"]["numpy"] == np.__version__ and case["reference_is_contract"] is True
    assert case["env"]["KESTREL_TEST_SETTING"] == "1\\x1b[2J" and case["env"]["CUDA_FAKE_TOKEN"] == "(left out)"
    readme = (b.path / "README.md").read_text()
    assert "python replay.py" in readme and "Attach to an upstream issue" in readme
    assert (b.path / "replay.py").read_text() == repro.TEMPLATE.read_text()


def test_never_overwrites_and_leaves_nothing_half_written(norm_fast, tmp_path, monkeypatch):
    session, result = norm_fast
    (tmp_path / "taken").mkdir()
    with pytest.raises(UsageError, match="already exists; kestrel-tui never overwrites"):
        write_bundle(session, result, tmp_path / "taken")
    assert list((tmp_path / "taken").iterdir()) == []
    first = write_bundle(session, result, repro.free_folder(tmp_path, result.first_diff))
    second = repro.free_folder(tmp_path, result.first_diff)
    assert first.path.name == f"repro-{result.first_diff}" and second.name == f"repro-{result.first_diff}-2"
    shutil.rmtree(first.path)

    def broken(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(repro.np, "save", broken)
    with pytest.raises(UsageError, match="not written .No space left on device"):
        write_bundle(session, result, tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_bounded_size(norm_fast, tmp_path):
    session, result = norm_fast
    key = f"t{T}_logits"
    with pytest.raises(UsageError) as e:
        write_bundle(session, result, tmp_path / "b", key=key, max_mb=0.1)
    msg = str(e.value)
    assert "\n" not in msg and "over --max-mb 0.1; raise it to 1" in msg and "lm_head" in msg
    assert not (tmp_path / "b").exists()
    b = write_bundle(session, result, tmp_path / "b", key=key, max_mb=1)
    on_disk = sum(p.stat().st_size for p in b.path.rglob("*") if p.is_file())
    assert b.nbytes <= on_disk <= b.nbytes + 64 * 1024  # npy headers, case.json, README


def test_bad_keys_are_one_line(norm_fast, tmp_path):
    session, result = norm_fast
    for key, match in (("t99_l0_nrm", "no such key"), ("t4_l0_bogus", "no such key")):
        with pytest.raises(UsageError, match=match) as e:
            write_bundle(session, result, tmp_path / "b", key=key)
        assert "\n" not in str(e.value)
    clean = Session(session.model, PROMPT, N, subject="sim")
    ok = clean.run(RunSettings(exact=frozenset(TOGGLES)), record=False)
    with pytest.raises(UsageError, match="no DIFF key; name the key"):
        write_bundle(clean, ok, tmp_path / "b")
    assert write_bundle(clean, ok, tmp_path / "b", key=f"t{T}_l0_nrm").verdict == "ok"


def test_the_repro_command_and_its_json(capsys, tmp_path):
    """`kestrel-tui repro`: the bundle of the first DIFF (every op exact but norm), its JSON, and a folder
    that exists refused in one line."""
    from clitools import one_line_error, run_cli

    out = tmp_path / "bundle"
    args = ["repro", out, "--exact", "all", "--toggle", "norm=fast", "--tokens", "2", "--no-cache", "--json"]
    code, stdout, err = run_cli(capsys, *args)
    r = json.loads(stdout)
    assert code == 0 and r["key"] == "t16_l0_nrm" and r["verdict"] == "far" and (out / "replay.py").is_file(), err
    arrays = sum(f.stat().st_size for f in out.rglob("*.npy"))  # the arrays' data and the replay, as counted
    assert arrays - 4096 < r["bytes"] <= sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "never overwrites" in one_line_error(err)


@pytest.mark.anyio
async def test_the_app_writes_a_bundle_on_w(small_model, tmp_path, make_app, settle):
    from kestrel_tui.backends.toggles import TOGGLES
    from kestrel_tui.session.inputs import default_prompt
    from kestrel_tui.session.session import RunSettings, Session

    session = Session(small_model, default_prompt(small_model.cfg.vocab), 2, subject="sim")
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        main.settings = RunSettings(exact=frozenset(TOGGLES) - {"norm"})
        main.start_run()
        await settle(pilot)
        await pilot.press("w")
        await settle(pilot)
        folder = tmp_path / "exports" / f"repro-{main.result.first_diff}"  # the cursor follows the first DIFF
        assert main.status.text.startswith(f"repro bundle {folder}: {main.result.first_diff}"), main.status.text
        assert (folder / "case.json").is_file() and (folder / "replay.py").is_file()
