"""No process outlives the tool: SIGTERM and SIGHUP to a headless command or to the app end every engine
process group (grandchildren included), remove the private temporary folders and leave no hidden
temporary file beside --out; folders a killed tool left are removed at the next start. A terminal that
hangs up ends the app within 3 s, whatever it is doing. A tool killed outright (SIGKILL) takes its
engines with it, grandchildren included, and a group it recorded is ended at the next start.

Real signals to real processes: the tool runs as `python -m kestrel_tui.cli` with its own TMPDIR, its
reference is the toy process engine (tests/engines/toy_engine.py) that hangs after a few positions
with a sleeping grandchild, and each pid is checked after the signal. A hangup is a real one: the
master side of the app's pty closed (tests/ptytools.py).
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from kestrel_tui import procs
from kestrel_tui.app.app import KestrelApp
from ptytools import descendants, hang_up, running
from toytools import TOY, gone

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGHUP, id="SIGHUP")]


def wait_for(cond, within: float, what: str) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    assert cond(), what


def _kill_leftovers(*pids: int) -> None:
    for pid in pids:
        if pid <= 0:  # not known (the test failed before it was read): kill(-1) would signal every process
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def hanging_profile(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A profile whose reference is the toy, hanging after position 2 with a grandchild asleep."""
    pidfile, childfile = tmp_path / "toy.pid", tmp_path / "grandchild.pid"
    prof = tmp_path / "hang.toml"
    prof.write_text(f'''tokens = 3
prompt_ids = [1, 1775, 1501]
[reference]
engine = "process"
[reference.options]
command = [{sys.executable!r}, {TOY!r}, "--prompt-ids", "{{prompt_ids}}", "--tokens", "{{n_tokens}}",
           "--hang-after", "2", "--pid-file", {str(pidfile)!r}, "--spawn-child", {str(childfile)!r}]
dump_env = "TOY_DUMP"
[subject]
engine = "sim"
''')
    return prof, pidfile, childfile


def tool_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONSAFEPATH", None)
    return env


def ours(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("kestrel-"))


def _pids(pidfile: Path, childfile: Path) -> tuple[int, int]:
    wait_for(lambda: pidfile.exists() and childfile.exists() and childfile.read_text().strip(), 120,
             "the toy engine and its grandchild started")
    return int(pidfile.read_text()), int(childfile.read_text())


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("cmd", ["run", "dump"])
def test_a_signal_to_a_headless_command_ends_every_engine_process(tmp_path, sig, cmd):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    prof, pidfile, childfile = hanging_profile(tmp_path)
    outdir = tmp_path / "out"
    outdir.mkdir()
    argv = [sys.executable, "-m", "kestrel_tui.cli", cmd, "--profile", str(prof), "--no-cache"]
    if cmd == "dump":
        argv += ["--backend", "reference", "--out", str(outdir / "ref.txt")]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=tool_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    toy = grandchild = -1
    try:
        toy, grandchild = _pids(pidfile, childfile)
        wait_for(lambda: ours(tmp), 30, "the engine's private folder exists")
        time.sleep(0.5)  # the toy is in its hang by now, or nearly: either way the run is in flight
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "Traceback" not in err, err
        wait_for(lambda: gone(toy) and gone(grandchild), 10, "the engine and its grandchild are gone")
        assert ours(tmp) == [], "no private folder is left"
        assert [p.name for p in outdir.iterdir() if p.name.startswith(".")] == [], "no hidden temporary file"
        assert not (outdir / "ref.txt").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _kill_leftovers(toy, grandchild)


def _reader(fd: int, buf: bytearray) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            return
        buf += data


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_to_the_app_ends_every_engine_process_and_restores_the_terminal(tmp_path, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    prof, pidfile, childfile = hanging_profile(tmp_path)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(tool_env(tmp), TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_tui.cli", "--profile", str(prof), "--no-cache"],
                            cwd=tmp_path, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    screen = bytearray()
    threading.Thread(target=_reader, args=(master, screen), daemon=True).start()
    toy = grandchild = -1
    try:
        toy, grandchild = _pids(pidfile, childfile)
        wait_for(lambda: b"\x1b[?1049h" in screen, 30, "the app took the screen")
        time.sleep(0.5)
        at = len(screen)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert proc.returncode == 130, bytes(screen[-2000:])
        wait_for(lambda: gone(toy) and gone(grandchild), 10, "the engine and its grandchild are gone")
        assert ours(tmp) == [], "no private folder is left"
        time.sleep(0.3)  # the last bytes through the pty
        assert b"\x1b[?1049l" in screen[at:], "the terminal's main screen is back"
        assert b"Traceback" not in screen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_leftovers(toy, grandchild)
        os.close(master)


def test_folders_a_killed_tool_left_are_removed_at_the_next_start(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = [tmp / f"kestrel-proc-{dead.pid}-abc123", tmp / f"kestrel-llama-{dead.pid}-def456"]
    live = tmp / f"kestrel-proc-{os.getpid()}-ghi789"      # its owner (this test) still runs
    kept = tmp / f"kestrel-proc-{dead.pid}-kept00"          # evidence a message named
    other = tmp / "kestrel-proc-notapid"                    # not ours to judge
    for d in (*left, live, kept, other):
        d.mkdir()
        (d / "dump.txt").write_text("t0_emb 0000000000000001\n")
    (kept / "KEPT").write_text("kept as evidence\n")
    a = tmp_path / "a.txt"
    a.write_text("t0_emb 0000000000000001\n")
    rc = subprocess.run([sys.executable, "-m", "kestrel_tui.cli", "diff", str(a), str(a)], cwd=tmp_path,
                        env=tool_env(tmp), capture_output=True, text=True, timeout=120)
    assert rc.returncode == 0, rc.stderr
    assert ours(tmp) == sorted(p.name for p in (live, kept, other))


def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    prof, pidfile, childfile = hanging_profile(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_tui.cli", "run", "--profile", str(prof), "--no-cache"],
                            cwd=tmp_path, env=tool_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    toy = grandchild = -1
    try:
        toy, grandchild = _pids(pidfile, childfile)
        time.sleep(0.5)
        for _ in range(5):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.01)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Traceback" not in err, err
        wait_for(lambda: gone(toy) and gone(grandchild), 10, "the engine and its grandchild are gone")
        assert ours(tmp) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _kill_leftovers(toy, grandchild)


# ---------------------------------------------------------------------------------------------- a hangup

HANGUP_S = 3.0  # a hung-up app is gone within this
GIVE_UP_S = 10.0  # still there then, it is killed and the test fails


@pytest.fixture
def driver():
    """Makes the app's terminal driver as the app does (its signal handlers are put back afterwards)."""
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGTSTP, signal.SIGCONT)}

    async def make():  # a driver is made inside the app's loop
        app = KestrelApp(None)
        return app.driver_class(app)

    yield lambda: asyncio.run(make())
    for sig, handler in old.items():
        signal.signal(sig, handler)


class _HungUp:
    """A terminal that hung up: every write fails, as on a pty whose master was closed."""

    def write(self, text):
        raise OSError(errno.EIO, "Input/output error")

    def flush(self):
        raise OSError(errno.EIO, "Input/output error")

    def fileno(self):
        return 2


def test_the_apps_output_thread_drains_once_the_terminal_fails_writes(driver, monkeypatch):
    from textual.drivers._writer_thread import MAX_QUEUED_WRITES, WriterThread

    monkeypatch.setattr(sys, "__stderr__", _HungUp())
    writer = WriterThread(driver()._file)  # what the driver writes the screen through
    writer.start()

    def draw_then_close():
        for _ in range(MAX_QUEUED_WRITES * 3):
            writer.write("\x1b[H frame")
        writer.stop()

    t = threading.Thread(target=draw_then_close, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "writes after a hangup block the app (the output thread stopped draining)"


def test_a_continue_without_a_stop_does_not_take_the_screen_again(driver, monkeypatch):
    d = driver()
    started = []
    monkeypatch.setattr(d, "start_application_mode", lambda: started.append("screen taken"))
    monkeypatch.setattr(d, "stop_application_mode", lambda: None)
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)  # Ctrl-Z's SIGSTOP to ourselves
    d._sigcont_application()  # what a hangup sends along with SIGHUP
    assert started == []
    d._sigtstp_application()  # Ctrl-Z, then fg
    d._sigcont_application()
    assert started == ["screen taken"]


def _hung_up_cleanly(h) -> None:
    assert h.ended_after is not None, f"still running {GIVE_UP_S:g} s after the hangup (killed)"
    assert h.ended_after <= HANGUP_S, f"the app took {h.ended_after:.2f} s to end after the hangup"
    assert h.left_running == [], "engine processes outlived the app"
    assert h.left_folders == [], "private folders outlived the app"
    assert b"Traceback" not in h.screen


def test_a_hangup_mid_run_ends_the_app_and_every_engine_process(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    prof, pidfile, childfile = hanging_profile(tmp_path)
    h = hang_up(["--profile", str(prof), "--no-cache"], tmp, tmp_path, busy=0.5, wait=GIVE_UP_S,
                ready=lambda pid: childfile.exists() and childfile.read_text().strip() != "")
    _hung_up_cleanly(h)
    toy, grandchild = int(pidfile.read_text()), int(childfile.read_text())
    assert {toy, grandchild} <= set(h.descendants)


def test_a_hangup_while_hf_dist_ranks_start_ends_the_app_within_3_s(tmp_path):
    """The engine's start (transformers' import, the checkpoint's export, the ranks' load) looks at no
    cancel: the app must not wait for it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    h = hang_up(["--profile", str(ROOT / "profiles" / "cpu-vs-hf-tp2.toml"), "--tokens", "200", "--no-cache"],
                tmp, tmp_path, busy=1.0, wait=GIVE_UP_S)
    _hung_up_cleanly(h)


# ---------------------------------------------------------------------------------------------- SIGKILL

SLEEPER = """tokens = 2
prompt_ids = [1, 1775, 1501]
[reference]
engine = "cpu"
[subject]
engine = "process"
[subject.options]
command = ["sh", "-c", "sleep 1000; echo done"]
dump_env = "SLEEPER_DUMP"
"""  # the shell stays (it has more to run after its sleep): a command with a child


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _the_sleeper(tool: int) -> tuple[int, int]:
    """(the shell, its sleep) among the tool's descendants, once they run."""
    found: dict[str, int] = {}

    def look():
        for pid in descendants(tool):
            argv = _cmdline(pid)
            if argv[:1] == ["sleep"]:
                found["sleep"] = pid
            elif argv[:2] == ["sh", "-c"] and "sleep 1000" in argv[2]:
                found["sh"] = pid
        return len(found) == 2

    wait_for(look, 120, "the subject's shell and its sleep run")
    return found["sh"], found["sleep"]


@pytest.mark.parametrize("how", ["run", "app"])
def test_a_tool_killed_outright_takes_its_engines_with_it(tmp_path, how):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    prof = tmp_path / "sleeper.toml"
    prof.write_text(SLEEPER)
    argv = [sys.executable, "-m", "kestrel_tui.cli", *(["run"] if how == "run" else []), "--profile", str(prof),
            "--no-cache"]
    io = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "stdin": subprocess.DEVNULL}
    master = None
    if how == "app":  # the app on a terminal of its own, which stays open: no hangup, a SIGKILL alone
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        io = {"stdout": slave, "stderr": slave, "stdin": slave}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=dict(tool_env(tmp), TERM="xterm-256color"),
                            start_new_session=True, **io)
    if master is not None:
        os.close(slave)
        threading.Thread(target=_reader, args=(master, bytearray()), daemon=True).start()
    sh = sleep = -1
    try:
        sh, sleep = _the_sleeper(proc.pid)
        proc.kill()  # SIGKILL: the tool cleans nothing
        proc.wait()
        wait_for(lambda: gone(sh) and gone(sleep), 5, "the subject's shell and sleep died with the tool")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_leftovers(sh, sleep)
        if master is not None:
            os.close(master)


OWNER = """
import os, subprocess, sys
from kestrel_tui import procs
p = subprocess.Popen(["sleep", "1000"], start_new_session=True, stdout=subprocess.DEVNULL)  # the record alone tells
procs.add_group(p)
print(p.pid, flush=True)
if sys.argv[1] == "dies":
    os._exit(0)  # nothing cleaned
sys.stdin.read()
"""


def test_a_group_recorded_by_a_dead_owner_is_ended_at_the_next_start(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    owners, groups = {}, {}
    for name in ("dead", "live", "reused"):
        owners[name] = subprocess.Popen([sys.executable, "-c", OWNER, "lives" if name == "live" else "dies"],
                                        env=tool_env(tmp), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        groups[name] = int(owners[name].stdout.readline())
    try:
        for name in ("dead", "reused"):
            owners[name].wait(30)
        records = {name: tmp / f"{procs.GROUP_RECORD}{owners[name].pid}-{groups[name]}" for name in owners}
        assert all(r.exists() for r in records.values()), sorted(p.name for p in tmp.iterdir())
        # as if the pid of "reused" named another process now: its start time is not the recorded one
        fields = records["reused"].read_text().split()
        records["reused"].write_text(" ".join([*fields[:4], str(int(fields[4]) + 1)]) + "\n")
        a = tmp_path / "a.txt"
        a.write_text("t0_emb 0000000000000001\n")
        rc = subprocess.run([sys.executable, "-m", "kestrel_tui.cli", "diff", str(a), str(a)], cwd=tmp_path,
                            env=tool_env(tmp), capture_output=True, text=True, timeout=120)
        assert rc.returncode == 0, rc.stderr
        wait_for(lambda: gone(groups["dead"]), 5, "the dead owner's group is ended")
        assert not records["dead"].exists()
        assert running(groups["live"]) and records["live"].exists(), "a live owner's group is its own"
        assert running(groups["reused"]), "a process that merely has the recorded pid is left alone"
        assert not records["reused"].exists()
    finally:
        _kill_leftovers(*groups.values())
        owners["live"].communicate("", timeout=30)
