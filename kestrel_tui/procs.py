"""What the tool leaves running or on disk while it works, so that none of it outlives the tool.

Engines start their commands in sessions of their own (engines/process.py, engines/child.py), so that
a cancel can end a command's whole process group; the other side of that is that a terminal's SIGHUP or
a ``kill`` reaches the tool alone, and the tool must end the groups itself. Every live group, private
temporary folder and hidden temporary file is registered here while it exists, and ``cleanup`` ends
and removes whatever is still registered: the CLI calls it when a command or the app ends, however it
ends (SIGTERM and SIGHUP included).

A private folder carries its owner's pid in its name (``kestrel-proc-<pid>-…``), so the folders of a
tool that could clean nothing (SIGKILL, a power loss) are removed by ``sweep`` at the next start, once
that pid is gone. A folder kept as evidence (a message names a file in it) holds a ``KEPT`` file, and
the sweep leaves it alone.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

# what stops the tool as Ctrl-C does: `kill` and a terminal that hangs up (the CLI and the app catch them)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
FOLDER_PREFIXES = ("kestrel-proc-", "kestrel-llama-")
KEPT = "KEPT"          # in a folder kept as evidence: never swept
TERM_GRACE_S = 0.1     # SIGTERM, then SIGKILL after this: cancellation must be quick
_OWNED_RE = re.compile(r"kestrel-(?:proc|llama)-([0-9]{1,10})-")

_lock = threading.Lock()
_groups: dict[int, object] = {}   # process group id -> its leader's Popen
_folders: set[str] = set()
_files: dict[str, object] = {}   # hidden temporary file -> what to do with it at the end


def signal_name(n: int) -> str:
    """A signal's name for a message: SIGSEGV; SIGRTMIN+6 for a real-time one; else its number."""
    try:
        return signal.Signals(n).name
    except ValueError:
        pass
    lo, hi = getattr(signal, "SIGRTMIN", None), getattr(signal, "SIGRTMAX", None)
    if lo is not None and hi is not None and lo <= n <= hi:
        return f"SIGRTMIN+{n - lo} (signal {n})"
    return f"signal {n}"


# ---------------------------------------------------------------------------------------------- groups


def add_group(proc) -> None:
    """``proc`` leads a process group of its own (start_new_session=True)."""
    with _lock:
        _groups[proc.pid] = proc


def drop_group(proc) -> None:
    with _lock:
        _groups.pop(proc.pid, None)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone


def kill_group(proc) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after a short grace, reap the leader, unregister
    it. Also run after a clean exit: whatever the command left in its group goes with it."""
    signal_group(proc.pid, signal.SIGTERM)
    if proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(TERM_GRACE_S)
    signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    drop_group(proc)


def end_groups() -> None:
    """SIGTERM every registered group, SIGKILL them after a short grace, reap the leaders."""
    with _lock:
        groups = list(_groups.items())
        _groups.clear()
    if not groups:
        return
    for pgid, _ in groups:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    for _, proc in groups:
        with contextlib.suppress(Exception):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for pgid, proc in groups:
        signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(5)


# ---------------------------------------------------------------------------------------------- folders


def make_folder(prefix: str) -> str:
    """A private temporary folder, ``<prefix><our pid>-<random>``, registered until removed or kept."""
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    with _lock:
        _folders.add(path)
    return path


def add_folder(path: str | os.PathLike) -> None:
    """A folder made elsewhere (a TemporaryDirectory named like make_folder's), removed by cleanup."""
    with _lock:
        _folders.add(os.fspath(path))


def remove_folder(path: str | os.PathLike) -> None:
    path = os.fspath(path)
    shutil.rmtree(path, ignore_errors=True)
    with _lock:
        _folders.discard(path)


def keep_folder(path: str | os.PathLike, why: str) -> None:
    """The folder is evidence a message names: it stays, now and at the next start."""
    path = os.fspath(path)
    with contextlib.suppress(OSError):
        with open(os.path.join(path, KEPT), "w", encoding="utf-8") as f:
            f.write(why + "\n")
    with _lock:
        _folders.discard(path)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we can judge: leave its folder
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def sweep(root: str | None = None) -> list[str]:
    """Remove our users' private folders whose owner process is gone; returns what was removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    uid = os.getuid()
    for e in entries:
        m = _OWNED_RE.match(e.name)
        if not m:
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if not e.is_dir(follow_symlinks=False) or st.st_uid != uid:
                continue
            if _alive(int(m[1])) or os.path.exists(os.path.join(e.path, KEPT)):
                continue
        except OSError:
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        removed.append(e.path)
    return removed


# ---------------------------------------------------------------------------------------------- files


def add_file(path: str | os.PathLike, abandon=None) -> None:
    """A hidden temporary file (files.py) that must not outlive the tool: at the end ``abandon()`` is
    called (it keeps the file under a name that says what it is), or the file is removed."""
    with _lock:
        _files[os.fspath(path)] = abandon


def drop_file(path: str | os.PathLike) -> None:
    with _lock:
        _files.pop(os.fspath(path), None)


# ---------------------------------------------------------------------------------------------- the end


def cleanup() -> None:
    """End every registered process group, remove every registered folder and hidden file."""
    end_groups()
    with _lock:
        folders, files = list(_folders), list(_files.items())
        _folders.clear()
        _files.clear()
    for path in folders:
        shutil.rmtree(path, ignore_errors=True)
    for path, abandon in files:
        if abandon is not None:
            with contextlib.suppress(Exception):
                abandon()
        with contextlib.suppress(OSError):
            os.unlink(path)
