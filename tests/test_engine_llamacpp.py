"""The llama.cpp engine (engines/llamacpp.py): llama-cpp-python decodes tiny Qwen3 and Qwen3-MoE GGUFs
written here with write_gguf; every key read in ggml's eval callback, compared with the reference on the
same file's weights; what the toggles change; q4_0's first far key; bad input -> one line."""
from __future__ import annotations

import re
import sys
import threading

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from kestrel_tui.backends.ops_exact import kvquant  # noqa: E402
from kestrel_tui.trace.run import Cancelled  # noqa: E402
from kestrel_tui.session.session import RunSettings, Session  # noqa: E402
from kestrel_tui.engines.base import EngineFailed, EngineSpec, RunRequest  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.engines.llamacpp import default_repack  # noqa: E402
from kestrel_tui.engines.schedule import parse_schedule  # noqa: E402
from kestrel_tui.errors import UsageError  # noqa: E402
from kestrel_tui.model.config import Config  # noqa: E402
from kestrel_tui.model.gguf import write_gguf  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.model.quant import quantize_q8_0  # noqa: E402
from kestrel_tui.model.weights import synthetic_model  # noqa: E402
from kestrel_tui.trace.compare import Tolerance, compare, key_metrics  # noqa: E402
from kestrel_tui.trace.keys import parse_key, token_keys  # noqa: E402

PROMPT, N = [1, 2, 3, 4], 3
# repack off: this VM's AMX repack of q4_0 weights segfaults inside llama.cpp (with or without our callback;
# llama_cpp.Llama crashes the same way), so the tests take the plain CPU kernels
OPTS = {"repack": "off"}
EXACT = frozenset({"kv_type", "flash_attn"})  # f32 KV, mul_mat + soft_max attention; n_ubatch stays batched
DENSE = Config(arch="qwen3", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab=512,
               rope_theta=1e6, eps=1e-6, tie_embeddings=True, max_positions=512, intermediate=256)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    out = {}
    for kind in ("moe", "dense"):
        for fmt in ("f32", "q4_0"):
            m = load_model(None, fmt, n_layers=2) if kind == "moe" else synthetic_model(DENSE, fmt, seed=3)
            path = root / f"{kind}_{fmt}.gguf"
            write_gguf(m, path)
            out[kind, fmt] = path
    return out


def _engine(path, fmt="f32", kv="f32", deep=True, **opts):
    ours = load_model(path, fmt, kv=kv)
    return ours, make_engine(EngineSpec("llama.cpp", str(path), {**OPTS, **opts}), ours, kv=kv, deep=deep)


def _values(eng, **kw):
    return {**{t.name: t.default for t in eng.toggles}, **kw}


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_every_key_at_every_position(ggufs, kind):
    ours, eng = _engine(ggufs[kind, "f32"])
    ref = make_engine("cpu", ours, kv="f32", deep=True).run(RunRequest(PROMPT, N, {}))
    tr = eng.run(RunRequest(PROMPT, N, _values(eng)))
    assert [p.t for p in tr.positions] == list(range(len(PROMPT) + N))
    for p, rp in zip(tr.positions, ref.positions):
        assert list(p.hashes) == token_keys(p.t, ours.cfg.n_layers, deep=True)
        assert all(eng.produces(k) for k in p.hashes)
        for k, a in p.raw.items():  # the reference's shapes and dtypes, so metrics compare element by element
            assert a.shape == rp.raw[k].shape and a.dtype == rp.raw[k].dtype, k
    eng.close()


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_f32_matches_the_reference(ggufs, kind):
    ours, eng = _engine(ggufs[kind, "f32"])
    s = Session(ours, PROMPT, 6, reference=make_engine("cpu", ours, kv="f32", deep=True), subject=eng, kv="f32",
                deep=True)
    for forcing in ("teacher", "free"):
        r = s.run(RunSettings(exact=EXACT, prefill="subject", forcing=forcing))
        tol = r.tolerance(Tolerance())
        assert r.notes == () and tol.n_missing == 0 and tol.n_unjudged == 0
        assert tol.n_far == 0, (forcing, tol.first_far, tol.metrics.get(tol.first_far))
        assert r.sub.generated == r.ref.generated
        # bits differ (ggml sums in its own order; rms_norm in double) but every DIFF is close
        assert tol.n_close > 0 and r.comparison.first_diff is not None
    eng.close()


def test_kv_q8_keys_are_our_quantizer_of_llamas_k_and_v(ggufs):
    ours, eng = _engine(ggufs["moe", "f32"], kv="q8")
    tr = eng.run(RunRequest(PROMPT, 1, _values(eng)))
    raw = tr.positions[2].raw
    k, ks = kvquant(raw["t2_l1_kpre"])
    assert raw["t2_l1_k"].dtype == np.int8 and np.array_equal(raw["t2_l1_k"], k) and np.array_equal(raw["t2_l1_ks"], ks)
    assert raw["t2_l1_vs"].shape == (ours.cfg.n_kv_heads,)
    eng.close()


def test_q4_0_first_far_is_a_q8_rounding_flip(ggufs, capsys):
    """q4_0 matmuls quantize their input to q8_0 on both sides (ggml and model/quant.py): a 1-ULP difference
    in an input can move one value across a rounding boundary, and the output of that matmul jumps by one
    weight step. That is the first far key; everything before it is close."""
    ours, eng = _engine(ggufs["moe", "q4_0"], "q4_0")
    ref = make_engine("cpu", ours, kv="f32", deep=True)
    found = []
    for prompt in (PROMPT, [100, 7, 900, 33, 5, 61]):
        s = Session(ours, prompt, 8, reference=ref, subject=eng, kv="f32", deep=True)
        r = s.run(RunSettings(exact=EXACT, prefill="subject"))
        tol = r.tolerance(Tolerance())
        ff = tol.first_far
        line = f"q4_0 prompt {prompt}: {tol.n_far} far, {tol.n_close} close, first far {ff}"
        if ff:
            k = parse_key(ff)
            src = {"ores": "attn", "kraw": "nrm", "v": "nrm", "router": "pnrm", "moe": "pnrm"}.get(k.field)
            assert src is not None, f"first far {ff} is not a q4_0 matmul output"
            name = f"t{k.t}_l{k.layer}_{src}"
            a, b = r.ref.raw(name), r.sub.raw(name)
            (qa, _), (qb, _) = quantize_q8_0(a), quantize_q8_0(b)
            flips = np.flatnonzero(qa.ravel() != qb.ravel())
            i = int(flips[0]) if flips.size else None
            scale = np.abs(a.reshape(-1, 32)).max(axis=1) / np.float32(127)
            line += (f" ({tol.metrics[ff].nmse:.3g}); its input {name} is close"
                     f" ({key_metrics(a, b).nmse:.3g}) but {flips.size} q8_0 code(s) differ")
            if i is not None:
                line += f": element {i} ref {float(a.ravel()[i]):.9g} -> {qa.ravel()[i]}, llama.cpp" \
                        f" {float(b.ravel()[i]):.9g} -> {qb.ravel()[i]} (x/d = {a.ravel()[i] / scale[i // 32]:.5f})"
            assert key_metrics(a, b).nmse <= 1e-7 and flips.size >= 1  # the matmul's input is close...
            found.append(ff)  # ...and one rounding flip makes its output far
        with capsys.disabled():
            print("\n" + line)
    # where a flip happens (and whether one does) depends on the CPU's kernels: on the AMX VM and an AVX2
    # EPYC the short prompt stays close and the longer one flips at t5; whatever the CPU, each far key found
    # was explained above (a q4_0 matmul whose close input moved one q8_0 code)
    assert all(parse_key(f).field in ("ores", "kraw", "v", "router", "moe") for f in found)
    eng.close()


def test_toggles_change_what_they_should(ggufs):
    def hashes(eng, **kw):
        return eng.run(RunRequest(PROMPT + [5, 6], 2, _values(eng, **kw), forced=[7, 8])).hashes()

    _, eng = _engine(ggufs["moe", "f32"], n_threads="1")
    base = hashes(eng, kv_type="f32", flash_attn="off")
    assert hashes(eng, kv_type="f32", flash_attn="off") == base  # deterministic run to run
    # threads split rows among workers; each row is summed in the same order: no bit changes
    assert hashes(eng, kv_type="f32", flash_attn="off", n_threads="2") == base
    # f32 weights: a batched ubatch takes ggml's multi-column matmul (its own summation order) instead of
    # one vec_dot per column, so token by token changes the prompt's first projection; emb and nrm are equal
    tok = compare(base, hashes(eng, kv_type="f32", flash_attn="off", n_ubatch="1"))
    assert tok.first_diff == "t0_l0_kraw"
    # flash attention, an f16 cache: the first DIFF is the attention output of position 0
    assert compare(base, hashes(eng, kv_type="f32", flash_attn="on")).first_diff == "t0_l0_attn"
    assert compare(base, hashes(eng, kv_type="f16", flash_attn="off")).first_diff == "t0_l0_attn"
    eng.close()
    # q4_0 x q8_0 block dots are the same integer sums whatever the batch: n_ubatch changes no projection's
    # bit. The attention's own f32 products (KQ, KQV) of a batch may take another kernel on some CPUs and not
    # on others, so a DIFF, if any, starts at an attn key
    _, eng = _engine(ggufs["moe", "q4_0"], "q4_0", n_threads="1")
    tok = hashes(eng, n_ubatch="1", kv_type="f32", flash_attn="off")
    batched = hashes(eng, kv_type="f32", flash_attn="off")
    first = compare(batched, tok).first_diff
    assert first is None or parse_key(first).field == "attn", first
    before = ("emb", "nrm", "kraw", "knorm", "kpre", "k", "ks", "v", "vs", "qrope")
    layer0 = [k for k in batched if parse_key(k).layer in (None, 0) and parse_key(k).field in before]
    assert layer0 and all(tok[k] == batched[k] for k in layer0)
    eng.close()


def test_default_toggles_and_options(ggufs):
    _, eng = _engine(ggufs["dense", "f32"], deep=False)
    t = {x.name: x for x in eng.toggles}
    assert set(t) >= {"n_ubatch", "flash_attn", "kv_type", "n_threads"} and all(x.key == x.name for x in eng.toggles)
    assert t["n_ubatch"].exact == "1" and t["flash_attn"].exact == "off" and t["kv_type"].exact == "f32"
    assert t["n_threads"].exact is None  # a list toggle
    assert ("n_gpu_layers" in t) == bool(llama_cpp.llama_supports_gpu_offload())
    assert eng.caps.forcing and not eng.caps.prefill_from and not eng.caps.isolate
    assert eng.prefill_problem(eng) is not None
    eng.close()
    _, eng = _engine(ggufs["dense", "f32"], deep=False, type_k="f16", type_v="f32")
    assert {x.name for x in eng.toggles} >= {"type_k", "type_v"} and eng.settings({})["type_k"] == "f16"
    eng.close()


def test_embedded_model_is_exported_when_no_file(ggufs):
    m = load_model(None, "f32", n_layers=1)
    eng = make_engine(EngineSpec("llama.cpp", None, OPTS), m, kv="f32")
    tr = eng.run(RunRequest([1, 2], 1, _values(eng, kv_type="f32", flash_attn="off")))
    assert len(tr.positions) == 3 and tr.positions[0].logits.shape == (m.cfg.vocab,)
    eng.close()


def test_cancel_between_positions(ggufs):
    _, eng = _engine(ggufs["dense", "f32"], deep=False)
    cancel = threading.Event()
    with pytest.raises(Cancelled):
        eng.run(RunRequest(PROMPT, 5, _values(eng), cancel=cancel, on_position=lambda p: cancel.set()))
    # the engine runs again after a cancel (its cache is cleared per run)
    assert len(eng.run(RunRequest(PROMPT, 1, _values(eng))).positions) == 5
    eng.close()


# ---------------------------------------------------------------- bad input: one line, with the fix

def _one_line(excinfo, *parts):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg


def test_missing_llama_cpp(monkeypatch, ggufs):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(UsageError) as e:
        make_engine(EngineSpec("llama.cpp", str(ggufs["moe", "f32"])), load_model(None, "f32", n_layers=2))
    _one_line(e, "pip install -e '.[llama]'", "pip install llama-cpp-python")


def test_built_without_eval_callback(monkeypatch, ggufs):
    import ctypes

    class Old(ctypes.Structure):
        _fields_ = [("n_ctx", ctypes.c_uint32)]

    monkeypatch.setattr(llama_cpp, "llama_context_params", Old)
    with pytest.raises(UsageError) as e:
        make_engine(EngineSpec("llama.cpp", str(ggufs["moe", "f32"])), load_model(None, "f32", n_layers=2))
    _one_line(e, "cb_eval", "pip install -U llama-cpp-python")


def test_bad_files_and_options(tmp_path, ggufs):
    m = load_model(None, "f32", n_layers=2)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 64)
    good = str(ggufs["moe", "f32"])
    cases = [
        ({"model": str(tmp_path / "none.gguf")}, ("no such file", "none.gguf")),
        ({"model": str(text)}, ("not a GGUF file", "notes.gguf")),
        # llama.cpp's own error (its log level ERROR, 4), the first one: the cause, not "failed to load model"
        ({"model": str(junk)}, ("llama.cpp cannot load", "junk.gguf", "(gguf_init_from_reader: number of tensors")),
        ({"model": str(tmp_path)}, (f"{tmp_path} is a folder; it takes a .gguf file", "kestrel-tui export")),
        ({"options": {"n_batch": "4"}}, ("unknown option 'n_batch'", "n_ubatch", "flash_attn")),
        ({"options": {"flash_attn": "yes"}}, ("flash_attn='yes' is not allowed", "off|on")),
        ({"options": {"n_threads": "0"}}, ("n_threads='0'",)),
        ({"options": {"n_threads": 100000}}, ("n_threads=100000 is not allowed; choose from a whole number 1..1024",)),
        ({"options": {"kv_type": "f16", "type_k": "f32"}}, ("kv_type or type_k/type_v",)),
        ({"options": {"env": {"FOO": "1"}}}, ("env 'FOO'", "GGML_CPU_DISABLE_FUSION")),
        ({"options": {"type_v": "q8_0", "flash_attn": "off"}},
         ("refuses a context", "type_v=q8_0", "flash_attn")),
    ]
    if not llama_cpp.llama_supports_gpu_offload():
        cases.append(({"options": {"n_gpu_layers": "all"}}, ("no GPU backend", "DGGML_CUDA=on")))
    for case, parts in cases:
        spec = EngineSpec("llama.cpp", case.get("model", good), {**OPTS, **case.get("options", {})})
        with pytest.raises(UsageError) as e:
            eng = make_engine(spec, m, kv="f32")
            eng.run(RunRequest(PROMPT, 1, _values(eng)))
        _one_line(e, *parts)


@pytest.mark.skipif(default_repack() != "off", reason="the repack crash needs a CPU with AMX")
def test_a_llama_cpp_segfault_ends_its_process_not_ours(ggufs):
    """With repack on, llama.cpp crashes in a multi-token decode of q4_0 weights on AMX CPUs (SIGSEGV on
    some, SIGILL on others): the engine's child dies, the run fails in one line naming the signal, and
    this process (the app) goes on. tests/test_engine_failures.py checks each signal's message."""
    ours, eng = _engine(ggufs["moe", "q4_0"], fmt="q4_0", repack="on")
    with pytest.raises(EngineFailed) as ei:
        eng.run(RunRequest(PROMPT, N, _values(eng)))
    text = str(ei.value)
    assert "\n" not in text and re.search(r"its process was killed by (SIG[A-Z0-9+]+|signal [0-9]+)", text), text
    assert "after 0 positions" in text
    _, ok = _engine(ggufs["moe", "q4_0"], fmt="q4_0")  # the same run without repack, in the same process
    assert len(ok.run(RunRequest(PROMPT, N, _values(ok))).positions) == len(PROMPT) + N


def test_the_exported_gguf_folder_names_its_owner_and_goes_with_the_tool():
    """The embedded model's GGUF lives in kestrel-llama-<pid>-…: removed when the tool ends (procs.cleanup,
    which the CLI runs however a command ends), and by the next start's sweep if the tool was killed."""
    import os
    from pathlib import Path

    from kestrel_tui import procs
    from kestrel_tui.engines.llamacpp import make_llamacpp_engine

    eng = make_llamacpp_engine(EngineSpec("llama.cpp", None, OPTS), load_model(None, "f32", n_layers=2), kv="f32",
                               load=False)
    folder = Path(eng.path).parent
    assert folder.name.startswith(f"kestrel-llama-{os.getpid()}-") and Path(eng.path).is_file()
    procs.cleanup()
    assert not folder.exists()
    eng.close()  # after the cleanup: nothing left to remove, and no error


def test_a_llama_cpp_py_in_the_working_directory_never_runs(tmp_path, ggufs):
    """A model folder a user downloaded may hold a llama_cpp.py: `python -m kestrel_tui.cli` run there
    (the working directory first on sys.path) and the engine's children import the installed library."""
    import os
    import subprocess
    from pathlib import Path

    marker = tmp_path / "ran"
    (tmp_path / "llama_cpp.py").write_text(f"open({str(marker)!r}, 'a').write('imported')\n")
    prof = tmp_path / "p.toml"
    prof.write_text(f'model = {str(ggufs["moe", "f32"])!r}\nweights = "f32"\ntokens = 1\n[reference]\nengine = "cpu"\n'
                    f'[subject]\nengine = "llama.cpp"\n[subject.options]\nrepack = "off"\n')
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, ".", os.environ.get("PYTHONPATH", "")]))
    rc = subprocess.run([sys.executable, "-m", "kestrel_tui.cli", "run", "--profile", str(prof), "--no-cache"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in rc.stderr, rc.stderr
    assert rc.returncode in (0, 1), rc.stderr
    assert not marker.exists()


@pytest.mark.parametrize("schedule", ["forward", "chunked:2", "prefix:2", "verify:2"])
def test_schedules_run_llamas_own_passes(ggufs, schedule):
    """A schedule is llama_decode's batches: every position is there, its keys close to the reference's
    (f32: ggml's order of sums only), and forward / verify score the tokens they are given."""
    ours, eng = _engine(ggufs["dense", "f32"], schedule=schedule)
    # the engine the app holds (its runs go to a child) answers for the inner one
    assert eng.schedule(_values(eng)) == parse_schedule(schedule) and eng.settings({})["schedule"] == schedule
    ref = make_engine("cpu", ours, kv="f32", deep=True)
    s = Session(ours, PROMPT, N, reference=ref, subject=eng, kv="f32", deep=True)
    r = s.run(RunSettings(exact=EXACT, prefill="subject"))
    tol = r.tolerance(Tolerance())
    assert [p.t for p in r.sub.positions] == list(range(len(PROMPT) + N))
    assert [p.token for p in r.sub.positions] == [p.token for p in r.ref.positions]
    assert tol.n_missing == 0 and tol.n_far == 0, (tol.first_far, tol.metrics.get(tol.first_far))
    assert r.mismatch is not None and r.mismatch.tally.tokens == N + 1
    assert f"schedule={schedule}" in r.sub.backend
    eng.close()
