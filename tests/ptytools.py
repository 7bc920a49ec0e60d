"""The app under a real terminal that hangs up: a pty whose master side is closed, as a terminal window
or `tmux kill-session` closes it (imported by tests/test_hangup.py and scripts/hangup_trials.py).

The app runs as `python -m kestrel_tui.cli ...` under ``pty.fork()``: it leads a session whose controlling
terminal is the pty, so closing the master is a real hangup (the kernel hangs the terminal up, sends
SIGHUP and makes every later write fail). Its descendants are noted just before the hangup, to check
that none outlives it.
"""
from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import sys
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALT_SCREEN = b"\x1b[?1049h"


@dataclass
class Hangup:
    """One trial: how long the app lived after its terminal hung up, and what it left behind."""
    ended_after: float | None          # seconds from closing the master to the app's exit; None: it did not
    status: int | None                 # the app's exit status (-N: killed by signal N), once it ended
    descendants: list[int] = field(default_factory=list)   # what the app had started, just before
    left_running: list[int] = field(default_factory=list)  # of those, still running at the end
    left_folders: list[str] = field(default_factory=list)  # kestrel-* entries left in TMPDIR
    screen: bytes = b""


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # [state, ppid, pgrp, session, ...]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (by parent links, read from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            children.setdefault(int(st[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _read_all(fd: int, buf: bytearray, stop: threading.Event) -> None:
    # never blocked in read when the master is closed: a close waits for a read in flight to return
    while not stop.is_set():
        if not select.select([fd], [], [], 0.02)[0]:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            return
        buf += data


def app_env(tmp: Path) -> dict[str, str]:
    """The tool's environment: its own TMPDIR and reference cache, this checkout first on the path."""
    env = dict(os.environ, TMPDIR=str(tmp), XDG_CACHE_HOME=str(tmp / "cache"), TERM="xterm-256color",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONSAFEPATH", None)
    return env


def hang_up(args: list[str], tmp: Path, cwd: Path, *, busy: float, ready=None, wait: float = 10.0,
            start_within: float = 120.0) -> Hangup:
    """Start the app with ``args`` under a pty, let it work ``busy`` seconds once it has the screen (and
    ``ready(pid)`` holds, when given), close the master, and wait up to ``wait`` seconds for it to end;
    still there then, it is killed (SIGKILL) and the trial says it did not end."""
    env = app_env(tmp)
    pid, master = pty.fork()
    if pid == 0:  # the child: exec at once (the parent may have threads)
        try:
            os.chdir(cwd)
            os.execve(sys.executable, [sys.executable, "-m", "kestrel_tui.cli", *args], env)
        finally:
            os._exit(127)
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    screen, stop = bytearray(), threading.Event()
    reader = threading.Thread(target=_read_all, args=(master, screen, stop), daemon=True)
    reader.start()
    closed = False
    try:
        end = time.monotonic() + start_within
        while (ALT_SCREEN not in screen or (ready is not None and not ready(pid))) and time.monotonic() < end:
            if os.waitpid(pid, os.WNOHANG)[0]:
                raise AssertionError(f"the app ended before the hangup: {bytes(screen[-2000:])!r}")
            time.sleep(0.05)
        assert ALT_SCREEN in screen, f"the app did not take the screen: {bytes(screen[-2000:])!r}"
        time.sleep(busy)
        below = descendants(pid)
        stop.set()
        reader.join()
        os.close(master)  # the hangup
        closed = True
        t0 = time.monotonic()
        status = None
        while time.monotonic() - t0 < wait:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
                break
            time.sleep(0.01)
        ended = time.monotonic() - t0 if status is not None else None
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        time.sleep(0.2)  # a group SIGKILLed at the end needs a moment to be reaped by init
        left = [p for p in below if running(p)]
        for p in left:  # a failed trial must not leave them for the next one
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        folders = sorted(e.name for e in tmp.iterdir() if e.name.startswith("kestrel-"))
        return Hangup(ended, status, below, left, folders, bytes(screen))
    finally:
        stop.set()
        reader.join()
        if not closed:
            os.close(master)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
