"""What the tool leaves running or on disk while it works, so that none of it outlives the tool.

Engines start their commands in sessions of their own (engines/process.py, engines/child.py), so that
a cancel can end a command's whole process group; the other side of that is that a terminal's SIGHUP or
a ``kill`` reaches the tool alone, and the tool must end the groups itself. Every live group, private
temporary folder and hidden temporary file is registered here while it exists, and ``cleanup`` ends
and removes whatever is still registered: the CLI calls it when a command or the app ends, however it
ends (SIGTERM and SIGHUP included).

A tool that can clean nothing (SIGKILL, the out-of-memory killer) must not leave its engines running
either. ``popen`` starts every engine command through a small wrapper (``_LEASH``) that, before it
execs the command in place (same pid, same group), sets PR_SET_PDEATHSIG (Linux) and, for a group's
leader, leaves a watcher in the group: it reads a pipe whose only writer is the tool, and at its end of
file (the tool is gone, however it went) kills the whole group, grandchildren included. A program that
calls setsid itself leaves the group and is beyond reach. Each group is also recorded on disk
(``kestrel-group-<owner pid>-<group id>``: owner and leader with their start times, so a reused pid
is not mistaken for them), and ``sweep`` at the next start ends a recorded group whose owner is gone.

A private folder carries its owner's pid in its name (``kestrel-proc-<pid>-…``), so the folders of a
tool that could clean nothing are removed by ``sweep`` at the next start, once that pid is gone. A
folder kept as evidence (a message names a file in it) holds a ``KEPT`` file, and the sweep leaves it
alone.

When the app must end on a stop signal and something will not let go (a worker thread that does not
look at its cancel, a terminal that hung up), ``end_on_stop_signals`` ends the process a moment later,
after running ``cleanup``.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# what stops the tool as Ctrl-C does: `kill` and a terminal that hangs up (the CLI and the app catch them)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
FOLDER_PREFIXES = ("kestrel-proc-", "kestrel-llama-")
KEPT = "KEPT"          # in a folder kept as evidence: never swept
TERM_GRACE_S = 0.1     # SIGTERM, then SIGKILL after this: cancellation must be quick
LAST_RESORT_S = 1.0    # after a stop signal the process is gone within this (plus cleanup), stuck or not
EXIT_HANDLERS_S = 0.5  # what the interpreter's exit handlers get then (a TemporaryDirectory's removal)
GROUP_RECORD = "kestrel-group-"  # + <owner pid>-<group id>: a started group, for the next start's sweep
_OWNED_RE = re.compile(r"kestrel-(?:proc|llama)-([0-9]{1,10})-")
_RECORD_RE = re.compile(re.escape(GROUP_RECORD) + r"([0-9]{1,10})-([0-9]{1,10})")

_lock = threading.Lock()
_cleanup_lock = threading.Lock()  # one cleanup at a time: a stop signal's ending waits for one in flight
_groups: dict[int, object] = {}   # process group id -> its leader's Popen
_folders: set[str] = set()
_files: dict[str, object] = {}   # hidden temporary file -> what to do with it at the end
_ending: list[int] = []  # the exit status a stop signal ends the process with, once one came (end_on_stop_signals)


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
    """``proc`` leads a process group of its own (start_new_session=True); recorded until dropped."""
    with _lock:
        if _groups.get(proc.pid) is proc:
            return
        _groups[proc.pid] = proc
    _record_group(proc.pid)


def drop_group(proc) -> None:
    with _lock:
        _groups.pop(proc.pid, None)
    _unrecord_group(proc.pid)


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
        _unrecord_group(pgid)


# ---------------------------------------------------------------------------------------------- starting

# The wrapper every engine command starts in (``python -I -S -c _LEASH LEASH ERR LEAD LC_CTYPE ARGV...``):
# it runs in the command's own process, before exec, so the group's watcher is in the command's session
# and group (the tool cannot put a process there: a group is joined only from within its session), and
# the command stays the group's leader with the pid Popen returned. It holds only what Popen passed
# (0, 1, 2, LEASH, ERR): the watcher swaps 0-2 for /dev/null, so no pipe of the command's stays open.
# Exec fails: the errno goes back through ERR (closed by a successful exec), as Popen reports its own.
_LEASH = r"""# kestrel-tui: ends this process group when kestrel-tui is gone (kestrel_tui/procs.py)
import os, sys
leash, err, lead, lc, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], sys.argv[5:]
os.set_inheritable(err, False)
if lc == "-":  # Python's start may coerce a C locale (LC_CTYPE=C.UTF-8): the command gets the original
    os.environ.pop("LC_CTYPE", None)
else:
    os.environ["LC_CTYPE"] = lc[1:]
if sys.platform.startswith("linux"):
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL: kept across exec
    except Exception:
        pass
if lead:
    pid = os.fork()
    if pid == 0:
        try:
            if os.fork() == 0:  # the watcher: a grandchild, so the command never sees it as a child
                os.close(err)
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.close(null)
                while os.read(leash, 512):
                    pass
                os.killpg(0, 9)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
os.close(leash)
try:
    os.execvp(argv[0], argv)
except OSError as e:
    os.write(err, str(e.errno or 0).encode())
if lead:
    os.killpg(0, 9)
os._exit(127)
"""
_leash_fds: tuple[int, int, int] | None = None  # (our pid, read end, write end): the write end is never closed


def _leash() -> int:
    """The read end of the pipe the watchers read: at its end of file this process is gone."""
    global _leash_fds
    with _lock:
        if _leash_fds is None or _leash_fds[0] != os.getpid():
            if _leash_fds is not None:  # a forked copy of the tool: the parent's pipe is not ours to hold
                for fd in _leash_fds[1:]:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            r, w = os.pipe()  # not inheritable: only the watchers get the read end (pass_fds)
            _leash_fds = (os.getpid(), r, w)
        return _leash_fds[1]


def _read_to_end(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 64):
        out += chunk
    return out


def popen(args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)`` for an engine command (``args`` a list), which does not outlive
    the tool: started in the wrapper above, registered with add_group when it leads a group of its own
    (start_new_session=True or process_group=0). A command that cannot be executed raises the OSError
    Popen would raise. PR_SET_PDEATHSIG fires when the *thread* that started the command ends: start
    commands from the main thread or a pool's worker, which live as long as the tool."""
    lead = bool(kwargs.get("start_new_session")) or kwargs.get("process_group") == 0
    if not sys.executable or not hasattr(os, "fork"):
        proc = subprocess.Popen(args, **kwargs)
        if lead:
            add_group(proc)
        return proc
    args = list(args)
    lc = (kwargs.get("env") if kwargs.get("env") is not None else os.environ).get("LC_CTYPE")
    leash = _leash()
    err_r, err_w = os.pipe()
    pass_fds = (*kwargs.pop("pass_fds", ()), leash, err_w)
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LEASH, str(leash), str(err_w), str(int(lead)),
                                 "-" if lc is None else "=" + lc, *args], pass_fds=pass_fds, **kwargs)
    except BaseException:
        os.close(err_r)
        raise
    finally:
        os.close(err_w)
    try:
        failed = _read_to_end(err_r)  # end of file: exec'd (or gone)
    except BaseException:  # a stop signal while it starts: it goes with it
        _end_started(proc, lead)
        raise
    finally:
        os.close(err_r)
    if failed:
        _end_started(proc, lead)
        code = int(failed) if failed.isdigit() else 0
        raise OSError(code, os.strerror(code), args[0])  # FileNotFoundError, PermissionError... as Popen's
    if lead:
        add_group(proc)
    return proc


def _end_started(proc: subprocess.Popen, lead: bool) -> None:
    if lead:
        signal_group(proc.pid, signal.SIGKILL)
    else:
        with contextlib.suppress(OSError):
            proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


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
    """End the recorded process groups whose owner is gone (sweep_groups) and remove our user's private
    folders whose owner process is gone; returns the folders removed."""
    root = root or tempfile.gettempdir()
    sweep_groups(root)
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


# ---------------------------------------------------------------------------------------------- group records


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot; /proc), or None: not running, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22, counted from the state (field 3)
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or "-"
    except OSError:
        return "-"


def _record_path(owner: int, pgid: int, root: str | None = None) -> str:
    return os.path.join(root or tempfile.gettempdir(), f"{GROUP_RECORD}{owner}-{pgid}")


def _record_group(pgid: int) -> None:
    """``<boot id> <owner pid> <owner start> <group id> <leader start>``, for the next start's sweep."""
    owner, leader = _start_time(os.getpid()), _start_time(pgid)
    if owner is None or leader is None:
        return  # no /proc (or the leader is gone already): nothing to tell a pid's reuse apart by
    line = f"{_boot_id()} {os.getpid()} {owner} {pgid} {leader}\n"
    with contextlib.suppress(OSError):
        fd = os.open(_record_path(os.getpid(), pgid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(line)


def _unrecord_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(_record_path(os.getpid(), pgid))


def _group_members(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[2]) == pgid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _orphaned(record: str) -> tuple[bool, int] | None:
    """(whether the record's group is to be ended, its id); None: not a record to act on (its owner runs,
    or it is not one we wrote)."""
    parts = record.split()
    if len(parts) != 5 or not all(p.isdigit() for p in parts[1:]):
        return None
    boot, owner, owner_start, pgid, leader_start = parts[0], *map(int, parts[1:])
    if pgid <= 1:
        return None
    if boot != _boot_id():
        return False, pgid  # from before a reboot: nothing of it runs
    if _start_time(owner) == owner_start:
        return None  # its owner runs: the group is its business
    leader = _start_time(pgid)
    if leader is not None:
        # the same leader (pid and start time) still there; another process under that pid means the id
        # was free at some point, so the group had ended
        return leader == leader_start, pgid
    # the leader is gone: members left in the group (a grandchild) keep its id from being reused
    return bool(_group_members(pgid)), pgid


def sweep_groups(root: str | None = None) -> list[int]:
    """End the recorded groups whose owner is gone (SIGKILL), remove their records; returns their ids."""
    root = root or tempfile.gettempdir()
    ended = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return ended
    uid = os.getuid()
    for e in entries:
        if not _RECORD_RE.fullmatch(e.name):
            continue
        try:
            if not e.is_file(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != uid:
                continue
            with open(e.path, encoding="ascii") as f:
                verdict = _orphaned(f.read(200))
        except (OSError, UnicodeDecodeError):
            continue
        if verdict is None:
            continue
        end, pgid = verdict
        if end:
            signal_group(pgid, signal.SIGKILL)
            ended.append(pgid)
        with contextlib.suppress(OSError):
            os.unlink(e.path)
    return ended


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
    """End every registered process group, remove every registered folder and hidden file. One at a time:
    a second call waits for the one in flight. After a stop signal (end_on_stop_signals) it ends the
    process too."""
    with _cleanup_lock:
        _cleanup()
    if _ending:
        _exit_now(_ending[0])


def _cleanup() -> None:
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




def _exit_now(code: int) -> None:
    """End the process as a normal exit would, less what may take long: the interpreter's exit handlers
    run (the weakref finalizers among them remove the TemporaryDirectory folders an engine or a raw store
    made) for EXIT_HANDLERS_S at most, as one may wait for the thread that holds the process up; the
    interpreter's teardown is skipped (seconds with torch loaded, and a stop signal's thread is frozen
    in it)."""
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        t = threading.Thread(target=run, daemon=True, name="kestrel-exit-handlers")
        t.start()
        t.join(EXIT_HANDLERS_S)
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(code)


def _noted(signum, frame) -> None:
    """A stop signal's Python handler: it does nothing itself; the wakeup fd takes the signal to the thread
    of end_on_stop_signals."""


def end_on_stop_signals(on_stop, code: int, within: float = LAST_RESORT_S) -> None:
    """From now on SIGTERM and SIGHUP call ``on_stop()`` from a thread of their own, whatever the main
    thread is doing (blocked included: the kernel may hand the signal to any thread, and a Python handler
    runs only when the main thread does), and then the process ends with ``code`` at the end of the
    first ``cleanup`` (the CLI's, once the app has returned), or ``within`` seconds after the signal,
    whichever comes first: ``cleanup`` first (it waits for one in flight), then _exit_now. For a process
    that a stop signal must end and that may be held up by what it cannot interrupt: a worker thread in
    a long call, a terminal that hung up with output still queued, a slow teardown. Main thread only
    (signal.set_wakeup_fd)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    stops = {int(s) for s in STOP_SIGNALS}

    def watch() -> None:
        while not stops & set(os.read(r, 64)):  # every Python-handled signal's number comes through
            pass
        _ending.append(code)
        with contextlib.suppress(Exception):
            on_stop()
        time.sleep(within)
        cleanup()  # it ends the process

    threading.Thread(target=watch, daemon=True, name="kestrel-stop-signals").start()
    signal.set_wakeup_fd(w)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _noted)
