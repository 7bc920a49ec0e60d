"""No process outlives the tool: SIGTERM and SIGHUP to a headless command or to the app end every engine
process group (grandchildren included), remove the private temporary folders and leave no hidden
temporary file beside --out; folders a killed tool left are removed at the next start.

Real signals to real processes: the tool runs as `python -m kestrel_tui.cli` with its own TMPDIR, its
reference is the toy process engine (tests/engines/toy_engine.py) that hangs after a few positions
with a sleeping grandchild, and each pid is checked after the signal.
"""
from __future__ import annotations

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
