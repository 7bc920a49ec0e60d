"""Which implementation decodes the cpu reference: compiled where built, numpy on request or as the
fallback (said in one line), the same bits through the session either way."""
from __future__ import annotations

import pytest

import kestrel_tui.cref as cref_pkg
from kestrel_tui.backends.base import NumpyBackend
from kestrel_tui.cref.backend import CompiledBackend
from kestrel_tui.session.session import Session
from kestrel_tui.engines.build import make_backend, make_engine
from kestrel_tui.errors import UsageError

from clitools import run_cli as run


@pytest.fixture
def not_built(monkeypatch):
    """As on a machine whose install found no C compiler."""
    monkeypatch.setattr(cref_pkg, "built_path", lambda: None)
    monkeypatch.setattr(cref_pkg, "_LIBS", {})


def test_compiled_is_the_default_where_built(small_model, cref):
    assert isinstance(make_backend("cpu", small_model), CompiledBackend)
    assert isinstance(make_backend("cpu", small_model, impl="numpy"), NumpyBackend)
    assert make_engine("cpu", small_model).notes == ()


def test_fallback_is_numpy_and_says_so(small_model, not_built):
    eng = make_engine("cpu", small_model)
    assert eng.impl == "numpy" and isinstance(eng.backend({}), NumpyBackend)
    (note,) = eng.notes
    assert note.startswith("the reference runs on numpy: the compiled reference is not built")
    with pytest.raises(UsageError, match="--cpu-impl compiled: the compiled reference is not built"):
        make_engine("cpu", small_model, impl="compiled")


def test_session_hashes_equal_across_implementations(small_model, cref):
    traces = {}
    for impl in ("compiled", "numpy"):
        s = Session(small_model, [1, 2, 3], 4, reference=make_engine("cpu", small_model, impl=impl), subject="sim")
        traces[impl] = s.reference()
    assert traces["compiled"].hashes() == traces["numpy"].hashes()
    assert traces["compiled"].generated == traces["numpy"].generated


def test_cli_cpu_impl_flag(capsys, tmp_path, cref, monkeypatch):
    """--cpu-impl picks the implementation that runs (counted), and the dumps agree."""
    calls = {"compiled": 0}
    step = CompiledBackend.step

    def counted(self, *a, **kw):
        calls["compiled"] += 1
        return step(self, *a, **kw)

    monkeypatch.setattr(CompiledBackend, "step", counted)
    dumps, steps = {}, {}
    for impl in ("compiled", "numpy"):
        before = calls["compiled"]
        out = tmp_path / f"{impl}.txt"
        code, _, err = run(capsys, "dump", "--cpu-impl", impl, "--prompt-ids", "1,2,3", "--tokens", "2",
                           "--out", out, "--no-cache")
        assert code == 0, err
        dumps[impl], steps[impl] = out.read_text(), calls["compiled"] - before
    assert steps == {"compiled": 3, "numpy": 0}  # a prefill and two decode steps, or none
    assert dumps["compiled"] == dumps["numpy"]


def test_cli_fallback_note_and_refusal(capsys, not_built):
    code, out, err = run(capsys, "generate", "--prompt-ids", "1,2", "--tokens", "2", "--no-cache")
    assert code == 0 and "note: the reference runs on numpy" in err, err
    code, out, err = run(capsys, "generate", "--cpu-impl", "compiled", "--prompt-ids", "1,2", "--tokens", "2")
    assert code == 2 and err.count("\n") == 1 and "--cpu-impl compiled" in err, err
