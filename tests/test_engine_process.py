"""The process engine: a separate OS process appending dump lines (and sidecar records), read live."""
from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kestrel_tui.engines.base import EngineFailed, EngineSpec, RunRequest, Toggle
from kestrel_tui.engines.build import make_backend, make_engine
from kestrel_tui.engines.builtin import run_decode
from kestrel_tui.engines.process import ProcessConfig, invocation
from kestrel_tui.trace.dump import DumpTail
from kestrel_tui.engines.sidecar import SidecarError, SidecarReader, read_sidecar, write_record
from kestrel_tui.errors import UsageError
from kestrel_tui.trace.dump import DumpError
from kestrel_tui.trace.fnv import fnv1a64
from kestrel_tui.trace.run import Cancelled

from toytools import N, PROMPT, gone, model, ref, toy_options  # noqa: F401 - model, ref: fixtures

ROOT = Path(__file__).resolve().parents[1]


def toy(*extra, raw=True, forced=True, **options):
    return toy_options(*extra, raw=raw, forced=forced, **options)


EXACT = Toggle("exact", ("none", "all"), "all", key="TOY_EXACT")


def engine(model, options, toggles=(EXACT,)):
    return make_engine(EngineSpec("process", options=options, toggles=toggles), model)


def request(values=None, **kw):
    return RunRequest(list(PROMPT), N, values if values is not None else {"exact": "all"}, **kw)


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def wait_gone(pid: int, within: float = 1.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if gone(pid):
            return True
        time.sleep(0.01)
    return gone(pid)


# ---------------------------------------------------------------------------------------------- the toy


def test_positions_arrive_while_the_process_runs(model, ref, tmp_path):
    pidfile = tmp_path / "pid"
    eng = engine(model, toy("--sleep", "0.15", "--pid-file", str(pidfile)))
    seen = []

    def on_position(pos):
        seen.append((pos.t, time.monotonic(), not gone(int(pidfile.read_text()))))

    tr = eng.run(request(on_position=on_position, forced=ref.generated[:N]))
    end = time.monotonic()
    assert [t for t, _, _ in seen] == list(range(len(PROMPT) + N))
    assert seen[0][2], "the first position came before the process exited"
    assert end - seen[0][1] > 0.3  # three decode positions of 0.15 s each still to go
    assert tr.hashes() == ref.hashes()  # all exact: the cpu reference, bit for bit
    assert [p.token for p in tr.positions] == [p.token for p in ref.positions]
    assert [p.prompt for p in tr.positions] == [True] * 3 + [False] * 3
    assert tr.generated == ref.generated  # logits from the sidecar
    assert wait_gone(int(pidfile.read_text()))


def test_env_toggles_change_hashes_like_the_in_process_sim(model, ref):
    eng = engine(model, toy(raw=False))
    assert eng.caps.forcing and not eng.caps.raw
    forced = ref.generated[:N]
    fast = eng.run(request({"exact": "none"}, forced=forced))
    sim = run_decode(make_backend("sim", model, exact="none"), PROMPT, N, forced=forced)
    assert fast.hashes() == sim.hashes() != ref.hashes()
    assert all(p.logits is None and p.raw is None for p in fast.positions)
    assert [p.token for p in fast.positions] == PROMPT + forced  # known: we passed them


def test_one_env_var_per_op(model, ref):
    toggles = tuple(Toggle(op, ("0", "1"), "1", key=f"TOY_{op.upper()}_EXACT") for op in ("norm", "gemm"))
    eng = engine(model, toy(raw=False, forced=False), toggles)
    assert not eng.caps.forcing
    got = eng.run(request({"norm": "1", "gemm": "0"}))
    sim = run_decode(make_backend("sim", model, exact="norm"), PROMPT, N)
    assert got.hashes() == sim.hashes()
    assert [p.token for p in got.positions[3:]] == [-1] * N  # free run, no logits: unknown


def test_exit_midway_is_one_line_with_code_and_stderr_and_partial(model, ref):
    eng = engine(model, toy("--fail-after", "4"))
    with pytest.raises(EngineFailed) as ei:
        eng.run(request(forced=ref.generated[:N]))
    msg = one_line(ei.value)
    assert "exited with code 3" in msg and "failing after position 4 as asked" in msg
    assert "after 4 positions" in msg
    part = ei.value.partial
    assert [p.t for p in part.positions] == [0, 1, 2, 3]  # position 4 never completed
    assert part.hashes() == ref.hashes(4)
    assert part.positions[3].raw is not None


def test_hang_times_out_and_kills_the_group(model, tmp_path):
    pidfile, childfile = tmp_path / "pid", tmp_path / "child"
    eng = engine(model, toy("--hang-after", "3", "--pid-file", str(pidfile), "--spawn-child", str(childfile),
                            timeout=8))  # well past the toy's start on a busy machine
    t0 = time.monotonic()
    with pytest.raises(EngineFailed) as ei:
        eng.run(request())
    assert time.monotonic() - t0 < 12
    msg = one_line(ei.value)
    assert "timed out after 8 s (timeout); killed it after 3 positions" in msg
    assert [p.t for p in ei.value.partial.positions] == [0, 1, 2]
    assert wait_gone(int(pidfile.read_text())) and wait_gone(int(childfile.read_text()))


def test_idle_timeout(model):
    eng = engine(model, toy("--hang-after", "3", raw=False, idle_timeout=4))  # more than the toy's start
    with pytest.raises(EngineFailed, match=r"wrote nothing for 4 s \(idle_timeout\)") as ei:
        eng.run(request())
    assert len(ei.value.partial.positions) == 3


def test_cancel_kills_the_child_quickly(model, tmp_path):
    pidfile = tmp_path / "pid"
    eng = engine(model, toy("--sleep", "1", "--pid-file", str(pidfile), raw=False))
    cancel = threading.Event()
    got = []

    def on_position(pos):
        got.append(pos.t)
        if pos.t == 3:  # the app sets it from another thread: do the same
            threading.Timer(0.05, cancel.set).start()

    with pytest.raises(Cancelled):
        eng.run(RunRequest(list(PROMPT), 20, {"exact": "all"}, on_position=on_position, cancel=cancel))
    assert got == [0, 1, 2, 3]  # the next position was 1 s away
    assert gone(int(pidfile.read_text())), "the child is gone by the time run returns"


def test_cancel_latency(model):
    eng = engine(model, toy("--hang-after", "3", raw=False))
    cancel = threading.Event()
    when = {}

    def on_position(pos):
        if pos.t == 0:
            def go():
                when["set"] = time.monotonic()
                cancel.set()
            threading.Timer(0.2, go).start()

    with pytest.raises(Cancelled):
        eng.run(request(on_position=on_position, cancel=cancel))
    assert time.monotonic() - when["set"] < 1.5  # 20 ms polls and a 0.1 s grace; seconds spare for a busy machine


def test_stop_ends_the_run_early(model):
    eng = engine(model, toy("--sleep", "0.2", raw=False))
    got = []
    tr = eng.run(RunRequest(list(PROMPT), 10, {"exact": "all"}, on_position=lambda p: got.append(p.t),
                            stop=lambda: len(got) >= 4))
    assert [p.t for p in tr.positions] == [0, 1, 2, 3]


def test_sidecar_raw_values_bit_for_bit(model, ref):
    eng = engine(model, toy("--token-records"))
    tr = eng.run(request(forced=ref.generated[:N]))
    for p, q in zip(tr.positions, ref.positions):
        assert list(p.raw) == list(q.raw)
        for k, a in q.raw.items():
            b = p.raw[k]
            assert b.dtype == a.dtype and b.shape == a.shape, k
            if a.dtype == np.float32:
                assert np.array_equal(b.view(np.uint32), a.view(np.uint32)), k
            else:
                assert np.array_equal(b, a), k
        assert np.array_equal(p.logits.view(np.uint32), q.logits.view(np.uint32))
        assert p.token == q.token  # t<T>_token records


def test_partial_last_line_counts_at_a_clean_exit(model, ref):
    eng = engine(model, toy("--partial-line", raw=False))
    tr = eng.run(request(forced=ref.generated[:N]))
    assert tr.hashes() == ref.hashes()


def test_command_not_found_is_a_usage_error(model):
    # refused when the engine is built: before a headless command opens its output file
    with pytest.raises(UsageError) as ei:
        engine(model, {"command": "/nonexistent/xyz --flag", "dump_env": "D"})
    assert one_line(ei.value) == ("process engine: command '/nonexistent/xyz' not found;"
                                  " fix `command` in the profile")


@pytest.mark.parametrize("options, words", [
    ({"command": "x", "dump_env": "D", "colour": 1}, "unknown option 'colour'"),
    ({"dump_env": "D"}, "needs `command`"),
    ({"command": ["x"]}, "set `dump_env`"),
    ({"command": "x {dumpp}", "dump_env": "D"}, "unknown placeholder {dumpp}"),
    ({"command": "x", "dump_env": "NOT A NAME"}, "`dump_env`"),
    ({"command": "x", "dump_env": "D", "timeout": -1}, "`timeout`"),
    ({"command": "x 'open", "dump_env": "D"}, "cannot split"),
    ({"command": "x", "dump_env": "D", "env": {"A": True}}, "`env` A"),
    ({"command": "x {model}", "dump_env": "D"}, "names no model"),
])
def test_bad_options_are_one_line(model, options, words):
    with pytest.raises(UsageError) as ei:
        engine(model, options, ())
    assert words in one_line(ei.value)


def test_toggle_without_a_key_is_refused(model):
    with pytest.raises(UsageError, match="toggle 'x' has no key"):
        engine(model, {"command": [sys.executable, "{dump}"]}, (Toggle("x", ("a", "b"), "b"),))


# ---------------------------------------------------------------------------------------------- unit parts


def test_invocation_maps_toggles_to_env_and_flags():
    cfg = ProcessConfig(command=("prog", "-n", "{n_tokens}", "--forced", "{forced_ids}", "--ids={forced_ids}",
                                 "{dump}"),
                        dump_env="DUMP", env=(("FIXED", "1"), ("GONE", ""), ("F", "{forced_ids}")))
    toggles = (Toggle("cuda", ("off", "on"), "on", key="--cuda"), Toggle("dev", ("0", "1"), key="--device"),
               Toggle("ex", ("0", "1"), "1", key="EXACT"), Toggle("unset", ("x", ""), "", key="UNSET"))
    base = {"GONE": "1", "UNSET": "1", "KEEP": "1"}
    req = RunRequest([5, 6], 2, {"cuda": "on", "dev": "1", "ex": "1", "unset": ""})
    argv, env = invocation(cfg, toggles, req, "/d", None, base)
    assert argv == ["prog", "-n", "2", "/d", "--cuda", "--device", "1"]  # free run: the forcing args go
    assert env == {"KEEP": "1", "FIXED": "1", "DUMP": "/d", "EXACT": "1"}
    req = RunRequest([5, 6], 2, {"cuda": "off", "dev": "0", "ex": "0", "unset": "x"}, forced=[7, 8])
    argv, env = invocation(cfg, toggles, req, "/d", None, base)
    assert argv == ["prog", "-n", "2", "--forced", "7,8", "--ids=7,8", "/d", "--device", "0"]
    assert env["F"] == "7,8" and env["EXACT"] == "0" and env["UNSET"] == "x"


def test_dump_tail_waits_for_the_line_end(tmp_path):
    p = tmp_path / "d.txt"
    p.write_bytes(b"")
    tail = DumpTail(str(p))
    with open(p, "ab") as f:
        f.write(b"t0_emb 00000000000000ab\nt0_l0_x 0000")
        f.flush()
        assert tail.poll() == [(1, "t0_emb", 0xAB)]
        assert tail.poll() == []
        f.write(b"0000000000CD\r\n\n")
        f.flush()
        assert tail.poll() == [(2, "t0_l0_x", 0xCD)]
        f.write(b"t0_logits 0000000000000001\n")
        f.flush()
        with pytest.raises(DumpError, match=r"d\.txt:3: malformed line: blank line"):
            tail.poll()
    tail.close()


def test_sidecar_reader_while_growing_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**32, size=(3, 5), dtype=np.uint32).view(np.float32)  # NaNs and denormals included
    b = np.arange(-4, 4, dtype=np.int8)
    buf = io.BytesIO()
    write_record(buf, "t0_l0_x", a)
    write_record(buf, "t0_l0_k", b)
    data = buf.getvalue()
    p = tmp_path / "r.bin"
    p.write_bytes(b"")
    r = SidecarReader(p)
    got = []
    with open(p, "ab") as f:
        for i in range(0, len(data), 7):  # 7-byte dribbles: headers and payloads split anywhere
            f.write(data[i:i + 7])
            f.flush()
            got += list(r.poll())
    r.check_end()
    r.close()
    assert [t for t, _, _ in got] == ["t0_l0_x", "t0_l0_k"]
    assert np.array_equal(got[0][1].view(np.uint32), a.view(np.uint32)) and got[0][1].shape == (3, 5)
    assert np.array_equal(got[1][1], b) and got[1][2] == data.index(b"t0_l0_k")


def test_sidecar_bf16_widens_exactly(tmp_path):
    x = np.array([1.5, -2.25, np.inf], dtype=np.float32)
    p = tmp_path / "r.bin"
    p.write_bytes(b"t0_emb bf16 3 6\n" + (x.view(np.uint32) >> 16).astype("<u2").tobytes())
    assert np.array_equal(read_sidecar(p)["t0_emb"], x)


@pytest.mark.parametrize("content, words", [
    (b"t0_emb f33 2 8\n" + bytes(8), "offset 0: bad record header: unknown dtype 'f33'"),
    (b"t0_emb f32 2 8\n" + bytes(8) + b"t0_x f32 2 9\n" + bytes(9), "offset 23: bad record header: byte count 9"),
    (b"t0_emb f32 2 8\n" + bytes(5), "offset 0: record 't0_emb' is truncated: 5 of 8 bytes"),
    (b"x" * 600, "offset 0: no header line within 512 bytes"),
])
def test_bad_sidecar_names_file_and_offset(tmp_path, content, words):
    p = tmp_path / "r.bin"
    p.write_bytes(content)
    with pytest.raises(SidecarError) as ei:
        read_sidecar(p)
    assert one_line(ei.value).startswith(str(p)) and words in str(ei.value)


# ---------------------------------------------------------------------------------------------- odd engines


def script(model, code: str, **options):
    """An engine that is a few lines of Python writing to the dump named by $D."""
    return engine(model, {"command": [sys.executable, "-c", code], "dump_env": "D", **options}, ())


def test_malformed_dump_line_names_file_and_line_and_keeps_it(model):
    eng = script(model, "import os; f = open(os.environ['D'], 'a'); f.write('t0_emb 00000000000000ab\\n'"
                        " 't3_emb 12\\n'); f.close()")
    with pytest.raises(EngineFailed) as ei:
        eng.run(request())
    msg = one_line(ei.value)
    m = re.search(r"(/\S+/dump\.txt):2: malformed line: hash '12' has 2 hex digits", msg)
    assert m, msg
    assert Path(m[1]).is_file()  # kept as evidence
    shutil.rmtree(Path(m[1]).parent)


def test_out_of_order_key_is_an_error(model):
    lines = "".join(f"{k} {i:016x}\\n" for i, k in enumerate(["t0_emb", "t3_emb", "t4_emb", "t3_l0_x"]))
    eng = script(model, f"import os; open(os.environ['D'], 'a').write('{lines}')")
    with pytest.raises(EngineFailed, match=r"dump\.txt:4: key 't3_l0_x' arrives after position 3 was complete") \
            as ei:
        eng.run(request())
    shutil.rmtree(Path(re.search(r"(/\S+)/dump\.txt", str(ei.value))[1]))


def test_exit_zero_without_lines(model):
    with pytest.raises(EngineFailed, match=r"exited 0 but wrote no dump lines to \$D"):
        script(model, "print('hello')").run(request())


def test_killed_by_signal(model):
    eng = script(model, "import os, signal; open(os.environ['D'], 'a').write('t0_emb 00000000000000ab\\n');"
                        " os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(EngineFailed, match="was killed by signal SIGSEGV after 0 positions"):
        eng.run(request())


def test_keys_beyond_the_last_position_end_the_run(model):
    code = ("import os, time\nfor t in range(100):\n    open(os.environ['D'], 'a').write(f't{t}_emb {t:016x}\\n')\n"
            "    time.sleep(0.01)\ntime.sleep(30)")
    t0 = time.monotonic()
    tr = script(model, code, timeout=10).run(request())
    assert time.monotonic() - t0 < 5
    assert [p.hashes for p in tr.positions] == [{f"t{t}_emb": t} for t in range(len(PROMPT) + N)]
    assert all(p.token == -1 for p in tr.positions)  # no {prompt_ids}: its own prompt, unknown


# ---------------------------------------------------------------------------------------------- C writer


def _docs_c_program() -> str:
    text = (ROOT / "docs" / "engines-process.md").read_text()
    return re.search(r"```c\n(.*?)```", text, re.S)[1]


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_c_writer_from_the_docs(tmp_path):
    src = tmp_path / "demo.c"
    src.write_text(_docs_c_program())
    exe = tmp_path / "demo"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(src)], check=True, capture_output=True, timeout=60)
    eng = make_engine(EngineSpec("process", options={"command": [str(exe), "{n_prompt}"], "dump_env": "VLLM_L2_DUMP",
                                                     "raw_env": "KESTREL_RAW"}), None)
    tr = eng.run(RunRequest([0, 0, 0], 0, {}))
    assert len(tr.positions) == 3
    for p in tr.positions:
        i = np.arange(8, dtype=np.float32)
        emb = np.float32(0.5) * np.float32(p.t) + np.float32(0.25) * i
        want = {f"t{p.t}_emb": emb, f"t{p.t}_l0_x": emb * emb,
                f"t{p.t}_logits": ((np.arange(16) * 7 + p.t) % 16).astype(np.float32)}
        assert list(p.hashes) == list(want)
        for k, a in want.items():
            assert np.array_equal(p.raw[k].view(np.uint32), a.view(np.uint32)), k
            assert p.hashes[k] == fnv1a64(a), k
        assert p.top1 == int(np.argmax(want[f"t{p.t}_logits"]))


# ---------------------------------------------------------------------------------------------- bisection


def test_bisect_over_the_toy_env_toggles_ends_at_the_minimal_set(model, ref):
    from kestrel_tui.backends.toggles import TOGGLES
    from kestrel_tui.session.bisect import bisect
    from kestrel_tui.session.session import Session
    from kestrel_tui.engines.builtin import OP_TOGGLES

    toggles = tuple(Toggle(t.name, ("0", "1"), "1", owns=t.owns, key=f"TOY_{t.name.upper()}_EXACT")
                    for t in OP_TOGGLES)
    sub = engine(model, toy(raw=False), toggles)
    session = Session(model, PROMPT, N, reference="cpu", subject=sub)
    res = bisect(session)
    # what the in-process sim needs to equal cpu: every op whose fast version alone breaks it
    needed = {op for op in TOGGLES if run_decode(make_backend("sim", model, exact=frozenset(set(TOGGLES) - {op})),
                                                  PROMPT, N, forced=ref.generated[:N]).hashes() != ref.hashes()}
    assert needed and res.moves
    assert res.all_ok and res.minimal == needed
    assert session.last.all_ok and session.last.sub.hashes() == ref.hashes()


def test_an_engine_with_a_longer_own_prompt_is_named(model):
    eng = script(model, "import os, time; open(os.environ['D'], 'a').write('t32_emb 00000000000000ab\\n');"
                        " time.sleep(30)")
    with pytest.raises(EngineFailed, match=r"first key 't32_emb' is past the last position asked for \(5\)"):
        eng.run(request())


# ---------------------------------------------------------------------------------------------- hostile output


def test_exit_midway_keeps_a_position_whose_declared_fields_all_arrived(model, ref):
    from kestrel_tui.trace.keys import FIELDS

    # the toy writes position 4 whole, then exits 3: with `fields` declared, position 4 is known complete
    eng = engine(model, toy("--fail-after", "4", raw=False, fields=["emb", *FIELDS, "logits"]))
    with pytest.raises(EngineFailed) as ei:
        eng.run(request(forced=ref.generated[:N]))
    msg = one_line(ei.value)
    assert "exited with code 3 after 5 positions" in msg, msg
    assert [p.t for p in ei.value.partial.positions] == [0, 1, 2, 3, 4]
    assert ei.value.partial.hashes() == ref.hashes(5)
    # killed for hanging after position 3 (idle_timeout): position 3 was written whole, and is kept
    eng = engine(model, toy("--hang-after", "3", raw=False, idle_timeout=4, fields=["emb", *FIELDS, "logits"]))
    with pytest.raises(EngineFailed, match=r"wrote nothing for 4 s \(idle_timeout\); killed it after 4 positions"):
        eng.run(request(forced=ref.generated[:N]))
    # a field it never writes: position 4 is not known whole, and is not kept
    eng = engine(model, toy("--fail-after", "4", raw=False, fields=["emb", *FIELDS, "logits", "pnrm"]))
    with pytest.raises(EngineFailed) as ei:
        eng.run(request(forced=ref.generated[:N]))
    assert [p.t for p in ei.value.partial.positions] == [0, 1, 2, 3]


def test_a_line_of_megabytes_fails_at_once_naming_its_line(model):
    code = ("import os\nf = open(os.environ['D'], 'a')\nf.write('t0_emb 00000000000000ab\\n')\n"
            "f.write('x' * (64 << 20))\nf.close()")
    t0 = time.monotonic()
    with pytest.raises(EngineFailed) as ei:
        script(model, code).run(request())
    msg = one_line(ei.value)
    m = re.search(r"(/\S+)/dump\.txt:2: a line longer than 4096 bytes", msg)
    assert m, msg
    assert time.monotonic() - t0 < 20
    shutil.rmtree(m[1])


def test_dump_tail_reads_in_bounded_chunks(tmp_path):
    p = tmp_path / "d.txt"
    lines = [f"t{i}_emb {i:016x}\n" for i in range(1000)]
    p.write_text("".join(lines))
    tail = DumpTail(str(p), max_bytes=100)
    got, polls = [], 0
    while True:
        got += tail.poll()
        polls += 1
        if tail.caught_up:
            break
    assert [(n, t, h) for n, t, h in got] == [(i + 1, f"t{i}_emb", i) for i in range(1000)]
    assert polls >= len("".join(lines)) // 100  # never more than max_bytes a poll
    tail.close()
    p.write_bytes(b"t0_emb 00000000000000ab\n" + b"y" * 5000)
    tail = DumpTail(str(p), max_bytes=1000)
    with pytest.raises(DumpError, match=r"d\.txt:2: a line longer than 4096 bytes"):
        for _ in range(10):
            tail.poll()
    tail.close()


def test_an_engines_stderr_is_inert_in_the_message(model):
    code = ("import sys; sys.stderr.write('\\x1b]0;owned\\x07\\x1b[2J' + 'z' * 5000 + ' boom\\n'); sys.exit(1)")
    with pytest.raises(EngineFailed) as ei:
        script(model, code).run(request())
    msg = one_line(ei.value)
    assert "\x1b" not in msg and "\x07" not in msg and msg.endswith("boom") and len(msg) < 600, msg


def test_the_cli_says_which_command_a_profile_runs_before_running_it(tmp_path, capsys):
    from clitools import run_cli

    marker = tmp_path / "ran"
    prof = tmp_path / "p.toml"
    prof.write_text(f'''tokens = 1
[reference]
engine = "cpu"
[subject]
engine = "process"
[subject.options]
command = [{sys.executable!r}, "-c", "open({str(marker)!r}, 'w'); import sys; sys.exit(4)", "{{dump}}"]
env = {{ KESTREL_TEST_FLAG = "1" }}
''')
    code, _, err = run_cli(capsys, "run", "--profile", prof)
    assert code != 0 and marker.exists()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    name = os.path.basename(sys.executable)  # the engine is named after its program: python or python3
    want = f"process engine {name}: running KESTREL_TEST_FLAG=1 {sys.executable} -c"
    assert any(ln.startswith(want) and "{dump}" in ln for ln in lines), err
    assert lines.index(next(ln for ln in lines if ln.startswith(want))) < len(lines) - 1  # before its failure
