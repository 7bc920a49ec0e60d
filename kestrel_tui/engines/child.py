"""An engine whose native library runs in a child process: its crash ends the child, not the app.

llama.cpp segfaults in some configurations (docs/engines-llamacpp.md: q4_0 repack on AMX
CPUs), and a segfault cannot be caught in the process it happens in. So the app keeps
an engine object for what it asks between runs (toggles, capabilities, keys, labels)
and each run — and one load check when the engine is built — goes to a fresh
``python -m kestrel_tui.engines.child_main``, which imports the library before anything else
(a library loaded after other extensions can clash with them) and streams the
positions back as pickles. A child that dies is one line: its signal or exit code and
its stderr's last line, with the positions it finished.

The child imports nothing from the folder it runs in: a model folder a user downloaded may
hold a ``llama_cpp.py``, and Python would import that before the installed library. So the
child starts with ``-P`` (no unsafe path first) and finds kestrel_tui through PYTHONPATH,
and child_main drops every path entry that is the working directory before the import.
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from .. import procs
from ..errors import UsageError
from ..text import inert_tail
from .base import Engine, EngineFailed, EngineSpec, RunRequest

STDERR_TAIL = 300  # characters of the child's stderr a failure message keeps
STDERR_READ = 4096  # bytes of the end of the child's stderr read for that line
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder kestrel_tui is imported from


@dataclass(frozen=True)
class Job:
    """What the child needs: where the engine's factory is, what to build, what to do."""
    first_import: str                  # the native library, imported before kestrel's modules
    factory: str                       # "kestrel_tui.engines.llamacpp:make_llamacpp_engine"
    spec: EngineSpec
    cfg: object                        # the reference model's Config (the engine reads only its shape)
    kv: str
    deep: bool
    request: RunRequest | None = None  # None: build (load) the engine and report success


@dataclass(frozen=True)
class ModelShape:
    """Stands in for a Model in the child: the factories read ``cfg`` only once the file is given."""
    cfg: object


def in_child(job: Job):
    """Run `job` in a fresh interpreter; returns the Trace (or None for a load check)."""
    from ..trace.run import Cancelled, Position, Trace
    from ..trace.rawstore import RawStore

    req = job.request
    bare = None if req is None else replace(req, on_position=None, cancel=None, stop=None)
    stderr = tempfile.TemporaryFile()
    try:
        # in a session of its own: the tool's signals miss it, so the tool ends it (procs registers it)
        proc = procs.popen(child_argv(job.first_import), env=child_env(), stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    except BaseException:
        stderr.close()
        raise
    messages: queue.Queue = queue.Queue()

    def read():
        try:
            while True:
                messages.put(pickle.load(proc.stdout))
        except (EOFError, pickle.UnpicklingError, OSError, ValueError):
            # ValueError: the pipe closed under this thread by the run's end (a read of a closed file)
            messages.put(("eof",))

    threading.Thread(target=read, daemon=True, name="engine-child-reader").start()
    try:
        pickle.dump(replace(job, request=bare), proc.stdin)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass  # the child died at once: its exit status says why
    store = RawStore()
    trace = Trace(backend=job.spec.engine, prompt=list(req.prompt) if req else [], store=store)
    try:
        while True:
            if req is not None and req.cancel is not None and req.cancel.is_set():
                raise Cancelled()
            try:
                msg = messages.get(timeout=0.05)
            except queue.Empty:
                continue
            kind = msg[0]
            if kind == "pos":
                pos: Position = msg[1]
                pos.raw = store.keep(pos.raw)
                trace.positions.append(pos)
                if req.on_position:
                    req.on_position(pos)
                if req.stop is not None and req.stop():
                    return trace
            elif kind == "done":
                trace.backend = msg[1] or trace.backend
                return trace if req is not None else None
            elif kind == "usage":
                raise UsageError(msg[1])
            elif kind == "failed":
                raise EngineFailed(msg[1], partial=trace)
            elif kind == "cancelled":
                raise Cancelled()
            else:  # eof: the child is gone without a word (or wrote something that is not a message)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    _stop(proc)
                raise EngineFailed(_death(job, proc.returncode, stderr, len(trace.positions)), partial=trace)
    finally:
        _stop(proc)
        stderr.close()


def child_argv(first_import: str) -> list[str]:
    return [sys.executable, "-P", "-m", "kestrel_tui.engines.child_main", first_import]


def child_env() -> dict[str, str]:
    """The environment with kestrel_tui's folder first on PYTHONPATH: -P leaves the working directory
    out, and a checkout run as ``python -m kestrel_tui.cli`` is found only through it."""
    env = dict(os.environ)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = PACKAGE_ROOT + (os.pathsep + rest if rest else "")
    return env


def _death(job: Job, rc: int | None, stderr, n: int) -> str:
    stderr.seek(0, os.SEEK_END)
    stderr.seek(max(0, stderr.tell() - STDERR_READ))
    lines = [ln for ln in stderr.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    how = f"was killed by {procs.signal_name(-rc)}" if rc is not None and rc < 0 else f"exited with code {rc}"
    tail = f"; stderr: {inert_tail(lines[-1], STDERR_TAIL)}" if lines else ""
    return f"{job.spec.engine} engine: its process {how} after {n} position{'s' * (n != 1)}{tail}"


def _stop(proc: subprocess.Popen) -> None:
    """Kill the child's whole group (also after a clean exit: nothing it started outlives it)."""
    procs.signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    procs.drop_group(proc)
    if proc.stdout:
        proc.stdout.close()


class OutOfProcess(Engine):
    """``inner`` answers every question between runs; runs (and a load check now) happen in a child."""

    def __init__(self, inner: Engine, job: Job):
        self.inner, self.job = inner, job
        self.name, self.toggles, self.caps, self.fields = inner.name, inner.toggles, inner.caps, inner.fields
        in_child(job)  # the library loads the file once in a child: a file it refuses fails here, in one line

    def __getattr__(self, name: str):  # the rest (settings, path, options...) is the inner engine's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def device_name(self) -> str:
        return getattr(self.inner, "device_name", self.name)

    # Engine's own answers would shadow the inner engine's (__getattr__ sees only what Engine lacks)
    def settings(self, values):
        return self.inner.settings(values)

    def schedule(self, values):
        return self.inner.schedule(values)

    def owners(self, field_name: str) -> tuple[str, ...]:
        return self.inner.owners(field_name)

    def prefill_problem(self, reference: Engine) -> str | None:
        return self.inner.prefill_problem(reference)

    def describe(self, values) -> str:
        return self.inner.describe(values)

    def run(self, req: RunRequest):
        return in_child(replace(self.job, request=req))

    def close(self) -> None:
        self.inner.close()
