"""An engine failure is not a DIFF: `run`, `dump`, `bisect` and `iso` exit 3 when an engine crashed, timed
out or wrote nothing, with --json's `failed` naming the side and the reason; bisection over a subject that
crashes on a trial stops there and says so; a tolerance gives a verdict only on keys it could judge."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kestrel_tui.backends.toggles import TOGGLES
from kestrel_tui.session.bisect import bisect
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.engines.base import EngineFailed, RunRequest
from kestrel_tui.engines.builtin import OP_TOGGLES, BuiltinEngine

from clitools import one_line_error, run_cli as run
from toytools import gguf, model  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]
TOY = str(ROOT / "tests" / "engines" / "toy_engine.py")
PROMPT = [1, 1775, 1501]
N = 3

# the toy, except that it dies at once, writing nothing, when $CRASH_ON names a toggle set to exact
CRASH_WHEN = f"""
import os, sys
op = os.environ.get("CRASH_ON", "")
if op and os.environ.get(f"TOY_{{op.upper()}}_EXACT") == "1":
    print(f"crash_when: {{op}} is exact, dying as asked", file=sys.stderr)
    sys.exit(7)
os.execv(sys.executable, [sys.executable, {TOY!r}, *sys.argv[1:]])
"""


@pytest.fixture(scope="module")
def crash_when(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "crash_when.py"
    path.write_text(CRASH_WHEN)
    return str(path)


def q(s) -> str:
    return json.dumps(str(s))


def process_side(side: str, argv: list[str], options: str = "") -> str:
    return (f'[{side}]\nengine = "process"\n\n[{side}.options]\ncommand = [{", ".join(q(a) for a in argv)}]\n'
            f'dump_env = "TOY_DUMP"\n{options}\n')


def toy_argv(*extra, script=TOY) -> list[str]:
    return [sys.executable, script, "--prompt-ids", "{prompt_ids}", "--tokens", "{n_tokens}",
            "--forced-ids", "{forced_ids}", *extra]


def profile(tmp_path, gguf, subject: str, reference: str = '[reference]\nengine = "cpu"\n', toggles: str = "",
            name: str = "p.toml") -> Path:
    f = tmp_path / name
    f.write_text(f"model = {q(gguf)}\ntokens = {N}\nprompt_ids = {PROMPT}\n\n{reference}\n{subject}\n{toggles}")
    return f


def failed_line(err: str, cmd: str, side: str) -> str:
    """The last line of stderr (notes, and which command a profile runs, may come before it)."""
    assert "Traceback" not in err, err
    line = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert line.startswith(f"kestrel-tui {cmd}: the {side} failed"), line
    return line


# ---- run ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how, extra, options, needle", [
    ("crash", ("--fail-after", "1"), "", "exited with code 3"),
    ("timeout", ("--hang-after", "1"), "timeout = 2\n", "timed out after 2 s"),
    ("nothing written", None, "", "wrote no dump lines"),
])
def test_run_on_a_subject_that_fails_exits_3_not_1(capsys, tmp_path, gguf, how, extra, options, needle):
    argv = toy_argv(*extra) if extra is not None else [sys.executable, "-c", "pass"]
    f = profile(tmp_path, gguf, process_side("subject", argv, options))
    code, out, err = run(capsys, "run", "--profile", f, "--json", "--exact", "none")
    rep = json.loads(out)
    assert code == 3, (how, err)
    assert rep["failed"]["side"] == "subject" and needle in rep["failed"]["reason"]
    assert rep["failed"]["engine"] in ("toy_engine.py", "python", Path(sys.executable).name)
    assert sum(needle in ln for ln in err.splitlines()) == 1  # said once, as the last line
    assert failed_line(err, "run", "subject")
    code, out, err = run(capsys, "run", "--profile", f, "--exact", "none")  # the text report too
    assert code == 3 and "first missing" in out and err.splitlines()[-1].startswith("kestrel-tui run: the subject")


def test_a_failed_reference_exits_3_and_is_named_in_json(capsys, tmp_path, gguf):
    f = profile(tmp_path, gguf, '[subject]\nengine = "sim"\n',
                reference=process_side("reference", toy_argv("--fail-after", "1")))
    code, out, err = run(capsys, "run", "--profile", f, "--json")
    assert code == 3
    failed = json.loads(out)["failed"]
    assert failed["side"] == "reference" and "exited with code 3" in failed["reason"]
    assert "exited with code 3" in failed_line(err, "run", "reference")


def test_generate_on_a_failing_reference_exits_3(capsys, tmp_path, gguf):
    f = profile(tmp_path, gguf, '[subject]\nengine = "sim"\n',
                reference=process_side("reference", toy_argv("--fail-after", "1", "--raw", "{raw}")))
    code, out, err = run(capsys, "generate", "--profile", f)
    assert code == 3 and out == "" and "exited with code 3" in failed_line(err, "generate", "reference")


def test_dump_of_a_failing_engine_exits_3_and_writes_nothing_whole(capsys, tmp_path, gguf):
    f = profile(tmp_path, gguf, process_side("subject", toy_argv("--fail-after", "1")))
    out = tmp_path / "d.txt"
    code, _, err = run(capsys, "dump", "--profile", f, "--out", out)
    assert code == 3 and "exited with code 3" in failed_line(err, "dump", "subject")
    assert not out.exists()


def test_a_diff_still_exits_1_and_all_ok_0(capsys, tmp_path, gguf):
    toggle = '[[toggle]]\nname = "exact"\nkey = "TOY_EXACT"\nfast = "none"\nexact = "all"\n'
    f = profile(tmp_path, gguf, process_side("subject", toy_argv()), toggles=toggle)
    code, out, _ = run(capsys, "run", "--profile", f, "--json")
    assert code == 1 and json.loads(out)["failed"] is None
    assert run(capsys, "run", "--profile", f, "--json", "--exact", "all")[0] == 0


# ---- bisect ---------------------------------------------------------------------------------------

def crash_toggles(chosen=("norm", "rope", "expf")) -> str:
    return "".join(f'[[toggle]]\nname = "{t.name}"\nkey = "TOY_{t.name.upper()}_EXACT"\nfast = "0"\nexact = "1"\n'
                   f"owns = {json.dumps(list(t.owns))}\n\n" for t in OP_TOGGLES if t.name in chosen)


def test_bisect_over_a_subject_that_crashes_on_a_trial_stops_and_says_which(capsys, tmp_path, gguf, crash_when):
    others = ",".join(op for op in TOGGLES if op not in ("norm", "rope", "expf"))
    options = f'env = {{ TOY_EXACT = {q(others)}, CRASH_ON = "norm" }}\n'
    f = profile(tmp_path, gguf, process_side("subject", toy_argv(script=crash_when), options),
                toggles=crash_toggles())
    code, out, err = run(capsys, "bisect", "--profile", f, "--json")
    rep = json.loads(out)
    assert code == 3, err
    assert rep["failed"]["side"] == "subject" and "dying as asked" in rep["failed"]["reason"]
    assert rep["failed_trial"] == {"trial": "+norm", "exact": ["norm"]}
    assert not rep["all_ok"] and rep["minimal"] is None and "norm" not in rep["final"]
    line = failed_line(err, "bisect", "subject")
    assert "trial +norm" in line and "dying as asked" in line
    code, out, err = run(capsys, "bisect", "--profile", f)
    assert code == 3 and "still DIFF" not in out and "stopped: the subject failed on the trial +norm" in out


class CrashesOnExact(BuiltinEngine):
    def __init__(self, model, op: str, partial: bool = True):
        super().__init__("sim", model)
        self.op, self.partial = op, partial

    def run(self, req: RunRequest):
        if req.values.get(self.op) == "exact":
            if not self.partial:
                raise EngineFailed(f"sim died ({self.op} exact)")
            trace = super().run(req)
            del trace.positions[len(req.prompt):]
            raise EngineFailed(f"sim stopped ({self.op} exact)", partial=trace)
        return super().run(req)


@pytest.mark.parametrize("partial", [True, False])
def test_bisect_stops_on_the_first_trial_that_fails(model, partial):
    s = Session(model, default_prompt(model.cfg.vocab, 4), 3, subject=CrashesOnExact(model, "norm", partial))
    out = bisect(s)
    assert out.failed is not None and out.failed.side == "subject" and "norm exact" in out.failed.reason
    assert out.failed_trial == "+norm" and out.failed_on.exact == {"norm"}
    assert not out.all_ok and out.minimal is None and out.final == frozenset()
    assert "trial +norm" in out.failure_line(s.binary_toggles)


def test_bisect_whose_start_fails(model):
    s = Session(model, default_prompt(model.cfg.vocab, 4), 3, subject=CrashesOnExact(model, "norm"))
    out = bisect(s, RunSettings(exact=frozenset({"norm"})))
    assert out.failed_trial == "start" and out.final is None and not out.moves


def test_the_app_shows_a_bisection_that_crashed_as_a_failure(model):
    import threading

    from kestrel_tui.app import messages as msg
    from kestrel_tui.app.parts.bisect import BisectDone, bisection

    s = Session(model, default_prompt(model.cfg.vocab, 4), 3, subject=CrashesOnExact(model, "norm"))
    posted = []
    bisection(s, RunSettings(), 1, threading.Event(), threading.Lock(), posted.append)
    assert not any(isinstance(m, BisectDone) for m in posted)
    (failed,) = [m for m in posted if isinstance(m, msg.RunFailed)]
    assert "trial +norm" in str(failed.error) and "norm exact" in str(failed.error)


def test_a_subject_that_finishes_nothing_names_its_side(model):
    s = Session(model, default_prompt(model.cfg.vocab, 4), 2, subject=CrashesOnExact(model, "norm", partial=False))
    with pytest.raises(EngineFailed) as e:  # still an EngineFailed: the app shows it as before
        s.run(RunSettings(exact=frozenset({"norm"})))
    assert e.value.failure.side == "subject" and e.value.failure.engine == "sim"


# ---- iso ------------------------------------------------------------------------------------------

def test_iso_on_a_backend_that_faults_exits_3(capsys, monkeypatch):
    from kestrel_tui.engines import build

    real, made = build.make_backend, []

    def make(*a, **k):
        backend = real(*a, **k)
        made.append(backend)
        if len(made) == 2:  # the verify instance faults, as a device would
            def step(*_a, **_k):
                raise RuntimeError("an illegal memory access was encountered")
            backend.step = step
        return backend

    monkeypatch.setattr(build, "make_backend", make)
    code, out, err = run(capsys, "iso", "--m", "2", "--json")
    assert code == 3
    failed = json.loads(out)["failed"]
    assert failed["side"] == "subject" and "illegal memory access" in failed["reason"]
    assert "M=2 verify step failed: RuntimeError" in failed_line(err, "iso", "subject")


# ---- tolerance ------------------------------------------------------------------------------------

def test_tol_on_hash_only_keys_gives_no_verdict_and_says_why(capsys, tmp_path, gguf):
    f = profile(tmp_path, gguf, process_side("subject", toy_argv()))  # no sidecar: hashes only
    code, out, _ = run(capsys, "run", "--profile", f, "--tol", "nmse=1e-7")
    assert code == 1
    assert "first far: none" not in out
    assert "no verdict" in out and "the subject reports hashes only" in out
    code, out, _ = run(capsys, "run", "--profile", f, "--tol", "nmse=1e-7", "--json")
    rep = json.loads(out)
    assert code == 1 and rep["first_far"] is None and rep["counts_close_far"]["unjudged"] > 0
    assert "could not be judged" in rep["not_close"] and "the subject gave no raw values" in rep["not_close"]


def test_tol_exit_1_without_a_far_key_says_what_else(capsys, small_model):
    from kestrel_tui.trace.compare import Tolerance

    res = Session(small_model, [1, 2, 3, 4], 2).run(RunSettings())
    key = next(k for k, st in res.comparison.status.items() if st.value == "DIFF")
    res.sub.positions[int(key[1:key.index("_")])].raw.pop(key)
    s = res.tolerance(Tolerance(nmse=10.0))
    assert s.n_far == 0 and not s.all_close
    assert s.not_close() == "1 DIFF key could not be judged (the subject gave no raw values for it)"
    from kestrel_tui.commands import print_tolerance

    capsys.readouterr()
    print_tolerance(s)
    out = capsys.readouterr().out
    assert f"first far: none (tolerance nmse=10) among the {s.n_judged} judged DIFF keys" in out
    assert "not all close: no far key, but 1 DIFF key could not be judged" in out


def test_bisect_target_far_on_a_hash_only_subject_is_refused(capsys, tmp_path, gguf):
    f = profile(tmp_path, gguf, process_side("subject", toy_argv()), toggles=crash_toggles())
    code, out, err = run(capsys, "bisect", "--profile", f, "--target", "far")
    line = one_line_error(err)
    assert code == 2 and "reports hashes only" in line and "--target ok" in line and out == ""


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`kestrel-tui run --json | head -c 1`: the closed pipe ends the command with SIGPIPE's status
    (141, as a tool the signal ended), no traceback and no 'Exception ignored' line."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "kestrel_tui.cli", "run", "--tokens", "2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # before the command writes anything: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err
