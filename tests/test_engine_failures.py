"""A subject or reference that stops midway: bisection does not take a crash for a fix, a failed
reference is one line in the CLI, and isolation needs a reference it can be fed from."""
from __future__ import annotations

import os

import pytest

from kestrel_tui.session.bisect import bisect
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.engines.base import EngineFailed, RunRequest
from kestrel_tui.engines.builtin import BuiltinEngine
from kestrel_tui.errors import UsageError
from kestrel_tui.model.hf import load_model

from clitools import one_line_error, run_cli


@pytest.fixture(scope="module")
def model():
    return load_model(None, n_layers=2)


class CrashesOnExact(BuiltinEngine):
    """sim, except that switching ``op`` to exact makes the engine stop after the prompt."""

    def __init__(self, model, op: str):
        super().__init__("sim", model)
        self.op = op

    def run(self, req: RunRequest):
        trace = super().run(req)
        if req.values.get(self.op) == "exact":
            del trace.positions[len(req.prompt):]
            raise EngineFailed(f"sim stopped ({self.op} exact)", partial=trace)
        return trace


def test_bisect_does_not_take_a_crash_for_a_fix(model):
    sub = CrashesOnExact(model, "norm")  # norm owns the first DIFF (t*_l0_nrm): tried first, and it crashes
    s = Session(model, default_prompt(model.cfg.vocab, 4), 3, subject=sub)
    first = s.run(RunSettings(), record=False).first_diff
    out = bisect(s)
    assert all("+norm" != m.change for m in out.moves), [m.line() for m in out.moves]
    assert not out.all_ok or "norm" not in out.minimal
    crashed = s.run(RunSettings(exact=frozenset({"norm"})), record=False)
    assert crashed.failed and crashed.n_missing > 0 and not crashed.all_ok and crashed.first_problem is not None
    assert first is not None


def test_isolation_needs_a_reference_it_can_feed(model):
    # the reference keeps its KV in f32, the session's subject in q8: its buffers cannot be fed
    s = Session(model, default_prompt(model.cfg.vocab, 4), 2, reference=BuiltinEngine("cpu", model, kv="f32"),
                subject="sim", kv="q8")
    res = s.run(RunSettings(mode="isolate"))
    assert any("chained instead" in n for n in res.notes)  # kv differs: no feeding, said so, no crash


def test_a_reference_that_fails_is_one_line_in_the_cli(capsys, tmp_path):
    import sys
    from pathlib import Path

    toy = Path(__file__).resolve().parent / "engines" / "toy_engine.py"
    prof = tmp_path / "p.toml"
    prof.write_text(f'''tokens = 3
[reference]
engine = "process"
[reference.options]
command = [{str(sys.executable)!r}, {str(toy)!r}, "--prompt-ids", "{{prompt_ids}}", "--tokens", "{{n_tokens}}",
           "--fail-after", "1"]
dump_env = "TOY_DUMP"
[subject]
engine = "sim"
''')
    for argv in (["run", "--profile", prof], ["dump", "--profile", prof, "--backend", "reference",
                                               "--out", tmp_path / "d.txt"]):
        code, _, err = run_cli(capsys, *argv)
        said, *rest = err.splitlines()  # first the command the profile runs, then the failure
        assert said.startswith("process engine toy_engine.py: running ") and "--fail-after 1" in said, err
        assert code == 3 and "exited with code" in one_line_error("\n".join(rest))  # 3: an engine failed
    assert not (tmp_path / "d.txt").exists()


def test_a_built_in_side_with_its_own_model_is_refused(capsys, tmp_path, model):
    from kestrel_tui.model.gguf import write_gguf

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(model, a)
    write_gguf(model, b)
    prof = tmp_path / "p.toml"
    prof.write_text(f'[reference]\nengine = "cpu"\nmodel = "{a}"\n[subject]\nengine = "sim"\nmodel = "{b}"\n')
    code, _, err = run_cli(capsys, "run", "--profile", prof)
    line = one_line_error(err)
    assert code == 2 and "decodes the model the reference loads" in line and f"{prof}:" in line


# ---------------------------------------------------------------- a child that dies: any signal, any CPU

PROBE = """
import os, resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file wherever the test runs
sig = int(os.environ["KESTREL_TEST_SIGNAL"])
print("probe: about to die of", sig, file=sys.stderr, flush=True)
os.kill(os.getpid(), sig)
"""


def _probe_job(first_import: str):
    from kestrel_tui.engines.base import EngineSpec
    from kestrel_tui.engines.child import Job

    return Job(first_import, "kestrel_tui.engines.builtin:BuiltinEngine", EngineSpec("probe"), None, "q8", False)


def _realtime() -> int:
    import signal

    return signal.SIGRTMIN + 6


@pytest.mark.parametrize("sig, name", [("SIGSEGV", "SIGSEGV"), ("SIGILL", "SIGILL"), ("SIGBUS", "SIGBUS"),
                                       ("SIGABRT", "SIGABRT"), ("rt", "SIGRTMIN+6")])
def test_a_child_killed_by_any_signal_is_one_line_naming_it(tmp_path, monkeypatch, sig, name):
    """The child crashes on purpose (it kills itself), so what the message says does not depend on how
    a native library happens to crash on this CPU."""
    import signal

    from kestrel_tui.engines.child import in_child

    (tmp_path / "kestrel_crash_probe.py").write_text(PROBE)
    n = _realtime() if sig == "rt" else int(getattr(signal, sig))
    monkeypatch.setenv("KESTREL_TEST_SIGNAL", str(n))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(EngineFailed) as ei:
        in_child(_probe_job("kestrel_crash_probe"))
    text = str(ei.value)
    assert "\n" not in text and f"its process was killed by {name}" in text and "after 0 positions" in text, text
    assert "probe: about to die of" in text  # its stderr's last line


def test_a_child_imports_nothing_from_the_working_directory(tmp_path, monkeypatch):
    """A model folder a user downloaded may hold a llama_cpp.py: the child must import the installed one."""
    from kestrel_tui.engines.child import in_child

    marker = tmp_path / "ran"
    for name in ("llama_cpp", "kestrel_cwd_probe"):
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([".", str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(EngineFailed) as ei:
        in_child(_probe_job("kestrel_cwd_probe"))
    assert "No module named 'kestrel_cwd_probe'" in str(ei.value)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pass
    else:
        try:  # the installed llama_cpp imports, then the probe job builds (or fails to): either is fine
            in_child(_probe_job("llama_cpp"))
        except (EngineFailed, UsageError):
            pass
    assert not marker.exists(), marker.read_text()
