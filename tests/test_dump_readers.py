"""The serving-dump readers (kestrel_tui/engines/dumps) on dumps of a tiny Qwen3 and Qwen3-MoE written in
vLLM's and SGLang's formats by tests/dumpfixtures.py (their module tree and shard layouts, a writer that
follows each engine's dumper source; TP=2 through torch.distributed over gloo): every key against the
cpu reference, TP=2 shards put together bit for bit, the partial sums by tolerance, a batch aligned to
the single request, hostile folders in one line, and the engine through a profile."""
from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dumpfixtures as fx  # noqa: E402
from kestrel_tui.engines.base import EngineSpec, RunRequest  # noqa: E402
from kestrel_tui.engines.dumps import detect_engine, read_folder  # noqa: E402
from kestrel_tui.engines.dumps.engine import make_dump_engine  # noqa: E402
from kestrel_tui.errors import UsageError  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.trace.compare import Tolerance, key_metrics  # noqa: E402
from kestrel_tui.trace.keys import parse_key  # noqa: E402

PROMPT, OTHER, N = [5, 77, 19, 33], [90, 3, 41], 3
FORMATS = {"vllm": "vllm-dump", "sglang": "sglang-dump", "dumper": "sglang-dump"}
EXACT_L0 = ("nrm", "kraw", "knorm", "kpre", "k", "ks", "v", "vs", "qrope", "attn")  # before the first all-reduce
REDUCED = 1e-10  # NMSE between a TP=2 and a TP=1 key after an all-reduce (measured: below 2e-12)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """kind -> {"ckpt", "model", "tp1", "tp2", "batch", "twice"}: folders holding vllm/, sglang/, dumper/."""
    root = tmp_path_factory.mktemp("dumps")
    out, jobs = {}, []
    for kind, seed in (("dense", 1), ("moe", 2)):
        sd = fx.write_checkpoint(kind, root / f"ckpt_{kind}", seed)
        d = out[kind] = {"ckpt": root / f"ckpt_{kind}", "model": load_model(str(root / f"ckpt_{kind}"), "f32")}
        for name, prompts in (("tp1", [PROMPT]), ("batch", [OTHER, PROMPT]), ("twice", [PROMPT, PROMPT])):
            d[name] = root / f"{kind}_{name}"
            fx.run_all(sd, kind, prompts, N, d[name])
        d["tp2"] = root / f"{kind}_tp2"
        jobs.append((sd, kind, [PROMPT], N, d["tp2"]))
    fx.run_tp(jobs)
    return out


@pytest.fixture(scope="module")
def refs(dumps):
    from kestrel_tui.engines.build import make_engine

    return {kind: make_engine("cpu", d["model"], kv="f32", deep=True).run(RunRequest(PROMPT, N, {}))
            for kind, d in dumps.items()}


def _engine(folder, fmt, model, kv="f32", deep=True, **options):
    return make_dump_engine(EngineSpec(FORMATS[fmt], None, {"folder": str(folder / fmt), **options}), model, kv=kv,
                            deep=deep)


def _run(eng, ref):
    forced = [p.token for p in ref.positions[len(PROMPT):]]
    return eng.run(RunRequest(PROMPT, N, {}, forced=forced))


def _bits(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_key_means_what_the_reference_means(dumps, refs, kind, fmt):
    d, ref = dumps[kind], refs[kind]
    tr = _run(_engine(d["tp1"], fmt, d["model"]), ref)
    assert [p.token for p in tr.positions] == [p.token for p in ref.positions]
    want = set(ref.hashes())
    if fmt != "dumper" and kind == "moe":  # FusedMoE is no leaf: its output is not in a leaf-hook dump
        want -= {k for k in want if k.endswith("_moe")}
    # the engines compute logits only for each request's last row, and the last forward's come with none
    want -= {f"t{t}_logits" for t in range(len(PROMPT) - 1)}
    if fmt != "dumper":
        want.discard(f"t{len(PROMPT) + N - 1}_logits")
    assert set(tr.hashes()) == want
    tol = Tolerance()
    for k in want:
        a, b = ref.raw(k), tr.raw(k)
        assert a.shape == b.shape and a.dtype == b.dtype, k
        assert tol.holds(key_metrics(a, b)), (k, key_metrics(a, b))
    assert any("moe" in n for n in tr.notes) == (fmt != "dumper" and kind == "moe")


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_shards_put_together_equal_tp1(dumps, kind, fmt):
    one, two = read_folder(dumps[kind]["tp1"] / fmt), read_folder(dumps[kind]["tp2"] / fmt)
    assert set(two.hashes()) == set(one.hashes())
    n_exact = 0
    for k in one.hashes():
        a, b = np.asarray(one.raw(k)), np.asarray(two.raw(k))
        key = parse_key(k)
        if key.field == "emb" or (key.layer == 0 and key.field in EXACT_L0):
            assert np.array_equal(_bits(a), _bits(b)), k  # column shards and the vocab-parallel embedding
            n_exact += 1
        else:
            assert key_metrics(a, b).nmse <= REDUCED, (k, key_metrics(a, b))
    assert n_exact == len(one.positions) * (1 + len(EXACT_L0))
    kraw = "t0_l0_kraw"
    shards = two.rank_values(kraw)  # each rank's heads, as the app shows them
    assert len(shards) == 2 and np.array_equal(np.concatenate(shards), np.asarray(two.raw(kraw)))


def test_partial_sums_are_added_in_rank_order_and_judged_by_tolerance(dumps):
    two, one = read_folder(dumps["moe"]["tp2"] / "dumper"), read_folder(dumps["moe"]["tp1"] / "dumper")
    moe = sorted(k for k in two.hashes() if k.endswith("_moe"))
    assert moe and set(moe) == two.partial
    for k in moe:
        r0, r1 = two.rank_values(k)
        total = np.asarray(two.raw(k))
        assert np.array_equal(_bits(r0 + r1), _bits(total))
        assert key_metrics(np.asarray(one.raw(k)), total).nmse <= REDUCED
        assert key_metrics(np.asarray(one.raw(k)), r0).nmse > 1e-3  # one rank's share is no full tensor
    assert not one.partial


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_batch_is_aligned_to_the_single_request(dumps, refs, fmt):
    d, ref = dumps["moe"], refs["moe"]
    single = _run(_engine(d["tp1"], fmt, d["model"]), ref)
    batch = _run(_engine(d["batch"], fmt, d["model"]), ref)
    assert batch.hashes() == single.hashes()  # the fixture's rows do not depend on their neighbours
    first = read_folder(d["batch"] / fmt)  # no tokens to match: the first request, OTHER
    assert first.prompt == OTHER
    twice = _engine(d["twice"], fmt, d["model"], request=1)
    got = _run(twice, ref)
    assert got.hashes() == single.hashes()
    assert any("2 dumped requests match" in n for n in got.notes)
    with pytest.raises(UsageError, match="request=2, but 2 dumped requests"):
        _run(_engine(d["twice"], fmt, d["model"], request=2), ref)


def test_q8_kv_keys_are_our_quantization_of_their_rows(dumps):
    from kestrel_tui.backends.ops_exact import kvquant
    from kestrel_tui.engines.build import make_engine

    d = dumps["dense"]
    ref = make_engine("cpu", d["model"], kv="q8", deep=True).run(RunRequest(PROMPT, N, {}))
    tr = _run(_engine(d["tp1"], "vllm", d["model"], kv="q8"), ref)
    k, ks = kvquant(np.asarray(tr.raw("t2_l1_kpre")))
    assert np.array_equal(tr.raw("t2_l1_k"), k) and np.array_equal(_bits(tr.raw("t2_l1_ks")), _bits(ks))
    assert tr.raw("t2_l1_v").dtype == np.int8 == ref.raw("t2_l1_v").dtype


# ---- hostile folders: one line, naming the file and the fix


def _one_line(fn, match: str):
    with pytest.raises(UsageError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and match in msg, msg
    return msg


def _copy(dumps, name="tp2", fmt="vllm", tmp_path=None, kind="dense"):
    dst = tmp_path / f"{name}_{fmt}"
    shutil.copytree(dumps[kind][name] / fmt, dst)
    return dst


def _rank_dir(folder, tp):
    return next(p for p in folder.iterdir() if p.name.startswith(f"TP{tp}_"))


class _Runs:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_with_code_is_refused_before_it_runs(dumps, tmp_path):
    folder = _copy(dumps, tmp_path=tmp_path)
    marker = tmp_path / "ran"
    p = _rank_dir(folder, 1) / "Pass00002.pt"
    d = torch.load(p, weights_only=True)
    d["model.layers.0.self_attn.attn"] = _Runs(marker)
    torch.save(d, p)
    msg = _one_line(lambda: read_folder(folder), "Pass00002.pt: refused")
    assert "system" in msg and not marker.exists()
    with open(p, "wb") as f:  # a bare pickle, not torch's zip
        pickle.dump({"x": _Runs(marker)}, f)
    _one_line(lambda: read_folder(folder), "refused")
    assert not marker.exists()


def test_bad_folders_are_one_line(dumps, tmp_path):
    _one_line(lambda: read_folder(tmp_path), "not a vLLM or SGLang dump folder")
    folder = _copy(dumps, tmp_path=tmp_path)
    p = _rank_dir(folder, 1) / "Pass00001.pt"
    d = torch.load(p, weights_only=True)
    torch.save([d["model.embed_tokens"]], p)
    _one_line(lambda: read_folder(folder), "holds a list, not a dict")
    d["model.layers.0.self_attn.k_norm"] = d["model.layers.0.self_attn.k_norm"][:, :1].repeat(1, 3, 1)
    torch.save(d, p)
    _one_line(lambda: read_folder(folder), "disagree")
    d["model.layers.0.self_attn.k_norm"] = "not a tensor"
    torch.save(d, p)
    _one_line(lambda: read_folder(folder), "is a str, not a tensor")
    (_rank_dir(folder, 1) / "Pass00003.pt").unlink()
    _one_line(lambda: read_folder(folder), "copy every pass of every rank")
    shutil.rmtree(_rank_dir(folder, 0))
    _one_line(lambda: read_folder(folder), "lacks the folder of TP rank 0")


def test_a_missing_last_rank_is_caught_by_the_model_s_heads(dumps, refs, tmp_path):
    folder = _copy(dumps, tmp_path=tmp_path)
    shutil.rmtree(_rank_dir(folder, 1))  # TP0 alone looks like a whole TP=1 run
    eng = make_dump_engine(EngineSpec("vllm-dump", None, {"folder": str(folder)}), dumps["dense"]["model"])
    _one_line(lambda: _run(eng, refs["dense"]), "hold 2 of the model's 4 query heads")


def test_bad_dumper_records_are_one_line(dumps, tmp_path):
    folder = _copy(dumps, fmt="dumper", tmp_path=tmp_path, kind="moe")
    exp = next(folder.iterdir())
    f = next(p for p in exp.iterdir() if "name=non_intrusive__model.layers.0.self_attn.attn.output" in p.name)
    torch.save({"value": torch.zeros(3)}, f)
    _one_line(lambda: read_folder(folder), "is not a dumper record")
    moe = next(p for p in exp.iterdir() if "name=moe" in p.name)
    rec = torch.load(moe, weights_only=True)
    torch.save({**rec, "meta": {**rec["meta"], "dims": "t h[tp:partial] x"}}, moe)
    _one_line(lambda: read_folder(folder), "names 3")
    rec2 = dict(rec, value=rec["value"][:, :5].clone(), meta={**rec["meta"], "name": "qrope"})  # 5 per row
    torch.save(rec2, moe.with_name(moe.name.replace("name=moe", "name=qrope")))
    moe.unlink()
    _one_line(lambda: read_folder(folder), "does not fit qrope's [heads, 16] layout")


def test_detects_the_engine(dumps):
    d = dumps["dense"]["tp1"]
    assert [detect_engine(d / f) for f in FORMATS] == ["vllm-dump", "sglang-dump", "sglang-dump"]
    assert detect_engine(d) is None


# ---- the engine through a profile, by the engine table (registry.py is the coordinator's to extend)


def test_the_engine_through_a_profile(dumps, refs, tmp_path, monkeypatch):
    from kestrel_tui.engines import profile as profile_mod
    from kestrel_tui.engines import registry
    from kestrel_tui.engines.build import make_engine
    from kestrel_tui.engines.dumps.engine import dump_factory
    from kestrel_tui.trace.compare import Status, classify, compare

    for name in ("vllm-dump", "sglang-dump"):
        monkeypatch.setitem(registry.ENGINE_TABLE, name, registry.EngineEntry(name, dump_factory))
    monkeypatch.setattr(profile_mod, "ENGINES", tuple(registry.ENGINE_TABLE))
    d = dumps["moe"]
    path = tmp_path / "serving.toml"
    path.write_text(f'model = "{d["ckpt"]}"\nweights = "f32"\nkv = "f32"\n[reference]\nengine = "cpu"\n'
                    f'[subject]\nengine = "sglang-dump"\n[subject.options]\nfolder = "{d["tp2"] / "dumper"}"\n')
    prof = profile_mod.load_profile(str(path))
    sub = make_engine(prof.subject, d["model"], kv="f32", deep=True)
    assert sub.name.startswith("sglang-dump") and not sub.caps.forcing
    ref = refs["moe"]
    tr = _run(sub, ref)
    cmp = compare(ref.hashes(), tr.hashes())
    judged = {k: classify(s, ref.raw(k), tr.raw(k))[0] for k, s in cmp.status.items() if s is Status.DIFF}
    assert judged and set(judged.values()) == {"close"}
    assert tr.partial <= set(judged)  # a partial-sum key is never ok by bits: judged by tolerance
    with pytest.raises(UsageError, match="unknown option 'fodler'"):
        make_engine(EngineSpec("vllm-dump", None, {"fodler": "x"}), d["model"])


def test_requests_are_told_apart_by_ids_and_positions():
    from kestrel_tui.engines.dumps.tokens import chains, pick

    a = [1, 2, 3, 4, 5]
    steps = [(np.array([1, 2, 3, 7, 8]), np.array([0, 1, 2, 0, 1])),  # two prefills in one forward
             (np.array([9, 4]), np.array([2, 3])),   # B's decode at 2, then A's at 3: consecutive, two requests
             (np.array([5, 6]), np.array([4, 3]))]   # rows swapped back
    found, segs = chains(steps, a)
    assert [[r.token for r in c.rows] for c in found] == [[1, 2, 3, 4, 5], [7, 8, 9, 6]]
    assert segs[1] == [(0, 1), (1, 2)]
    assert pick(found, a, 0, "dump")[0] is found[0]
    cached = [(np.array([3, 7]), np.array([2, 0])), (np.array([4]), np.array([3]))]  # A from position 2 on
    c, notes = pick(chains(cached, a)[0], a, 0, "dump")
    assert [r.pos for r in c.rows] == [2, 3] and "starts this request at position 2" in notes[0]
    with pytest.raises(UsageError, match="no dumped request has the session's tokens"):
        pick(chains(steps, [1, 2, 9])[0], [1, 2, 9], 0, "dump")


def test_diff_reads_two_dump_folders_and_judges_them(dumps, capsys):
    """`diff` on TP=1 and TP=2 dumps: the bits part after the first all-reduce, the partial sums are named
    as such, and --tol judges every DIFF key close (exit 0)."""
    from clitools import run_cli

    one, two = dumps["moe"]["tp1"] / "dumper", dumps["moe"]["tp2"] / "dumper"
    code, out, err = run_cli(capsys, "diff", one, two)
    assert code == 1 and "first DIFF: " in out and "partial sums added over ranks" in out, out + err
    code, out, err = run_cli(capsys, "diff", one, two, "--tol", "nmse=1e-10")
    assert code == 0 and "first far: none" in out and " 0 far" in out, out + err
    code, out, err = run_cli(capsys, "diff", one, two, "--tol", "ulp=0")  # the bits: every DIFF key far
    assert code == 1 and "first far: t" in out, out + err
    code, _, err = run_cli(capsys, "diff", one, one.parent.parent / "nothing-here")
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err


def test_diff_names_a_folder_missing_its_last_rank(dumps, capsys, tmp_path):
    """TP0 alone reads as a whole TP=1 run; against a whole dump its head-split keys have half the shape."""
    from clitools import run_cli

    whole = dumps["dense"]["tp2"] / "vllm"
    half = _copy(dumps, tmp_path=tmp_path)
    shutil.rmtree(_rank_dir(half, 1))
    code, out, err = run_cli(capsys, "diff", whole, half)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "t0_l0_kraw is [32]" in err and f"a rank's folder is missing from {half}" in err, err
    code, out, err = run_cli(capsys, "diff", dumps["dense"]["tp1"] / "vllm", whole)  # TP=1 vs TP=2: no error
    assert code == 1 and "first DIFF" in out, out + err
