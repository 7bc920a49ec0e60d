"""The serving-dump readers against the hf engines on the same run. A tiny Qwen3 / Qwen3-MoE in vLLM's and
SGLang's module tree that computes with transformers' own code (tests/dumpfixtures.py, ``ops="hf"``) writes
per-rank dumps in the three formats at TP=1 and at TP=2 (gloo); read back, their keys are compared with the
hf engine's own keys (TP=1) and the hf-dist engine's (transformers' TP=2 over gloo) for the same checkpoint,
prompt and tokens: bits where no reduction intervenes, close where one does."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dumpfixtures as fx  # noqa: E402
from kestrel_tui.engines.base import EngineSpec, RunRequest  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.engines.dumps.engine import make_dump_engine  # noqa: E402
from kestrel_tui.engines.hf_dist import make_hf_dist_engine  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.trace.compare import key_metrics  # noqa: E402
from kestrel_tui.trace.keys import parse_key  # noqa: E402

PROMPT, N = [5, 77, 19, 33], 3
FORMATS = {"vllm": "vllm-dump", "sglang": "sglang-dump", "dumper": "sglang-dump"}
# layer 0 before its first all-reduce (o_proj): a TP=2 rank computes these from its own heads alone
BEFORE_REDUCE = ("nrm", "kraw", "knorm", "kpre", "k", "v", "qrope", "attn")
REDUCED = 1e-10  # NMSE of a key after an all-reduce


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """kind -> {"ckpt", "model", "sd", "tp1", "tp2"}: the checkpoint, its weights, the dump folders (vllm/,
    sglang/, dumper/)."""
    root = tmp_path_factory.mktemp("dumps_hf")
    out, jobs = {}, []
    for kind, seed in (("dense", 1), ("moe", 2)):
        ckpt = root / f"ckpt_{kind}"
        sd = fx.write_checkpoint(kind, ckpt, seed)
        d = out[kind] = {"ckpt": str(ckpt), "model": load_model(str(ckpt), "f32"), "sd": sd,
                         "tp1": root / f"{kind}_tp1", "tp2": root / f"{kind}_tp2"}
        fx.run_all(sd, kind, [PROMPT], N, d["tp1"], hf_from=ckpt)
        jobs.append((sd, kind, [PROMPT], N, d["tp2"], ckpt))
    fx.run_tp(jobs)
    return out


@pytest.fixture(scope="module")
def hf_runs(made):
    """(kind, world size) -> the hf engine's trace (1) or the hf-dist engine's (2), same prompt, greedy."""
    runs = {}
    for kind, d in made.items():
        hf = make_engine(EngineSpec("hf", d["ckpt"], {}), d["model"], kv="f32", deep=True)
        runs[kind, 1] = hf.run(RunRequest(PROMPT, N, {t.name: t.default for t in hf.toggles}))
        dist = make_hf_dist_engine(EngineSpec("hf-dist", d["ckpt"], {"timeout": 120}), None, kv="f32", deep=True)
        try:
            values = {t.name: t.default for t in dist.toggles} | {"world_size": "2"}
            runs[kind, 2] = dist.run(RunRequest(PROMPT, N, values))
        finally:
            dist.close()
    return runs


def _bits(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype.itemsize == 4 else a


def _read(engine: str, folder, model, hf_trace):
    """The dump in ``folder`` through its engine, on the hf run's tokens."""
    eng = make_dump_engine(EngineSpec(engine, None, {"folder": str(folder)}), model, kv="f32", deep=True)
    forced = [p.token for p in hf_trace.positions[len(PROMPT):]]
    return eng.run(RunRequest(PROMPT, N, {}, forced=forced))


def _held_like_hf(hf, tr, world: int) -> int:
    """Every key of the dump against the hf engine's: bits before a reduction, NMSE after; the count of
    keys held to the bits."""
    assert [p.token for p in tr.positions] == [p.token for p in hf.positions]
    exact = 0
    for k in tr.hashes():
        a, b = np.asarray(hf.raw(k)), np.asarray(tr.raw(k))
        assert a.shape == b.shape and a.dtype == b.dtype, k
        if _before_reduce(k, world):
            assert np.array_equal(_bits(a), _bits(b)), (k, key_metrics(a, b))
            exact += 1
        else:  # after an all-reduce: judged by tolerance (on this machine the bits agree too)
            assert key_metrics(a, b).nmse <= REDUCED, (k, key_metrics(a, b))
    return exact


def _expected_keys(hf, kind, fmt) -> set[str]:
    """The hf engine's keys a dump of this format holds: the engines compute logits for each request's
    last row only, the last forward's logits land in no leaf-hook pass, and FusedMoE is no leaf."""
    want = set(hf.hashes())
    want -= {f"t{t}_logits" for t in range(len(PROMPT) - 1)}
    want -= {k for k in want if "@" in k}  # the hf-dist engine's per-rank entries are raw values, not keys
    if fmt != "dumper":
        want.discard(f"t{len(PROMPT) + N - 1}_logits")
        if kind == "moe":
            want -= {k for k in want if k.endswith("_moe")}
    return want


def _before_reduce(key: str, world: int) -> bool:
    k = parse_key(key)
    return world == 1 or k.field == "emb" or (k.layer == 0 and k.field in BEFORE_REDUCE)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("world", [1, 2])
def test_dump_keys_equal_the_hf_engines_keys(made, hf_runs, kind, world, fmt):
    hf = hf_runs[kind, world]
    tr = _read(FORMATS[fmt], made[kind][f"tp{world}"] / fmt, made[kind]["model"], hf)
    assert set(tr.hashes()) == _expected_keys(hf, kind, fmt)
    exact = _held_like_hf(hf, tr, world)
    assert exact == (len(tr.hashes()) if world == 1 else len(tr.positions) * (1 + len(BEFORE_REDUCE)))


@pytest.fixture(scope="module")
def upstream(made):
    """kind -> {tp: folder}: SGLang's own dumpers (legacy/, dumper/) on the same transformers-computed runs."""
    import test_dump_readers_upstream as up

    if not up.SOURCE:
        pytest.skip("KESTREL_TEST_SGLANG_SOURCE names no SGLang source")
    out, jobs = {}, []
    for kind, d in made.items():
        sd = d["sd"]
        out[kind] = {1: d["tp1"].parent / f"{kind}_tp1_up", 2: d["tp1"].parent / f"{kind}_tp2_up"}
        up.run_upstream(sd, kind, [PROMPT], N, out[kind][1], hf_from=d["ckpt"])
        jobs.append((sd, kind, [PROMPT], N, out[kind][2], d["ckpt"]))
    fx.run_tp(jobs, target=up.run_upstream)
    return out


@pytest.mark.parametrize("fmt", ["legacy", "dumper"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("world", [1, 2])
def test_sglang_s_own_dumpers_of_the_hf_run_equal_the_hf_engines_keys(made, hf_runs, upstream, kind, world, fmt):
    """SGLang's TensorDumper and dumper.py (tests/test_dump_readers_upstream.py runs them) on the same run:
    every key they wrote reads back to the hf engines' bits."""
    hf = hf_runs[kind, world]
    tr = _read("sglang-dump", upstream[kind][world] / fmt, made[kind]["model"], hf)
    assert set(tr.hashes()) == _expected_keys(hf, kind, "dumper" if fmt == "dumper" else "sglang")
    _held_like_hf(hf, tr, world)
