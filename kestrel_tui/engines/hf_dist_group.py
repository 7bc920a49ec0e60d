"""The hf-dist engine's ranks as one process group: started together, in lock step, ended together.

N children ``python -P -m kestrel_tui.engines.hf_dist_rank``, rank 0 leading a process group of its own
and the others joining it (setpgid, so no new session: a group can be joined only within one),
registered in procs.py while they live: a cancel, a failure or the tool's end kills the whole group,
so no rank outlives the engine. A reader thread per rank puts its pickled
messages on one queue in the order they arrive; the engine sends every rank the same step and waits
for all of them.

A rank that fails ends the group, and ``RankFailure`` names it: one that exits (its code or signal and
its stderr's last line), raises (its exception), hangs (it did not start or finish a step within the
timeout: the others wait in a collective for it), or disagrees on shapes (hf_dist.gather).
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
import time
from dataclasses import replace

from .. import procs
from ..text import inert, inert_tail
from ..trace.run import Cancelled
from .child import child_env
from .hf_dist_rank import RankJob

STDERR_TAIL = 300
STDERR_READ = 4096
POLL_S = 0.05
# A rank that dies takes its peers' collectives with it ("Connection reset by peer"), and their reports
# can arrive first: this long is waited for a rank that ended without a report, the cause to name.
CAUSE_GRACE_S = 1.0
STORE = "store"  # the file store's name in the group's folder


class RankFailure(Exception):
    """Rank ``rank`` failed: ``what`` says how, in words that follow "rank R of N"."""

    def __init__(self, rank: int | None, what: str):
        super().__init__(what)
        self.rank, self.what = rank, what


class Group:
    """The running ranks of one RankJob."""

    def __init__(self, job: RankJob, env: dict[str, str], load_timeout: float, step_timeout: float):
        self.world, self.step_timeout = job.world_size, step_timeout
        self.folder = procs.make_folder("kestrel-proc-")
        job = replace(job, store=os.path.join(self.folder, STORE))
        self.procs: list[subprocess.Popen] = []
        self.stderr = [tempfile.TemporaryFile() for _ in range(self.world)]
        self.events: queue.Queue = queue.Queue()
        self.infos: list[dict] = []
        try:
            self._spawn(env)
            for r in range(self.world):
                self._send(r, job)
            self.infos = self._wait_all("ready", None, load_timeout, None)
        except BaseException:
            self.end()
            raise

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.procs)

    def _spawn(self, env: dict[str, str]) -> None:
        argv = [sys.executable, "-P", "-m", "kestrel_tui.engines.hf_dist_rank"]
        base = {**child_env(), **env, "WORLD_SIZE": str(self.world)}
        for r in range(self.world):
            # a group of its own (joining one is allowed only within one session: no setsid)
            lead = {"process_group": 0 if r == 0 else self.procs[0].pid}
            try:
                proc = procs.popen(argv, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr[r],
                                   **lead)
            except OSError as e:  # rank 0 already gone (its group with it), or no python to start
                raise RankFailure(r, f"could not start ({e.strerror or e})") from None
            self.procs.append(proc)
            if r == 0:  # not the terminal's foreground group: Ctrl-C misses it, so the tool ends it
                procs.add_group(proc)
            threading.Thread(target=self._read, args=(r, proc), daemon=True, name=f"hf-dist-rank{r}").start()

    def _read(self, r: int, proc: subprocess.Popen) -> None:
        try:
            while True:
                self.events.put((r, pickle.load(proc.stdout)))
        except Exception:  # EOF, a torn pickle, a closed pipe: the rank is gone or lost its way
            self.events.put((r, ("eof",)))

    def _send(self, r: int, msg) -> None:
        try:
            pickle.dump(msg, self.procs[r].stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.procs[r].stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise RankFailure(r, self._death(r)) from None

    # -- lock step
    def step(self, ids: list[int], pos0: int, cancel: threading.Event | None = None,
             fed: list | None = None) -> list[dict]:
        """Every rank's payload for the forward of ``ids`` at ``pos0`` (pos0 0 starts a new cache); ``fed``:
        what each rank takes with it, in rank order (a graft's share of the reference's values)."""
        for r in range(self.world):
            self._send(r, ("step", list(ids), pos0, fed[r] if fed is not None else None))
        return self._wait_all("out", pos0, self.step_timeout, cancel)

    def _wait_all(self, kind: str, pos0: int | None, timeout: float, cancel) -> list:
        got: dict[int, object] = {}
        started: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._hung(kind, pos0, timeout, started, got)
            try:
                r, msg = self.events.get(timeout=min(POLL_S, left))
            except queue.Empty:
                continue
            if msg[0] == "started" and msg[1] == pos0:
                started.add(r)
            elif msg[0] == kind and (pos0 is None or msg[1] == pos0):
                got[r] = msg[-1]
            elif msg[0] == "failed":
                silent = self._silent_death(r)
                if silent is not None:
                    raise RankFailure(silent, self._death(silent))
                raise RankFailure(r, f"raised {inert(msg[1])}")
            elif msg[0] == "eof":
                raise RankFailure(r, self._death(r))
            else:
                raise RankFailure(r, f"sent {inert(msg[0])!r} where {kind!r} was due (a protocol error)")
        return [got[r] for r in range(self.world)]

    def _silent_death(self, reported: int) -> int | None:
        """A rank that ended without reporting an exception, within CAUSE_GRACE_S of ``reported``'s report:
        a crash whose peers' failures are its consequence. None: the report stands."""
        raised = {reported}
        deadline = time.monotonic() + CAUSE_GRACE_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                r, msg = self.events.get(timeout=min(POLL_S, left))
            except queue.Empty:
                continue
            if msg[0] == "failed":
                raised.add(r)
            elif msg[0] == "eof" and r not in raised:
                return r
        return None

    def _hung(self, kind: str, pos0, timeout: float, started: set[int], got: dict) -> RankFailure:
        if kind == "ready":
            late = [r for r in range(self.world) if r not in got]
            return RankFailure(late[0], f"did not load the model within {timeout:g} s"
                                        f"{_others(late)} (load_timeout)")
        idle = [r for r in range(self.world) if r not in started]
        if idle:
            return RankFailure(idle[0], f"did not start the step within {timeout:g} s{_others(idle)}; it hangs"
                                        f" (timeout)")
        late = [r for r in range(self.world) if r not in got]
        return RankFailure(None, f"ranks {', '.join(map(str, late))} started but did not finish the step within"
                                 f" {timeout:g} s: a collective waits (timeout)")

    def _death(self, r: int) -> str:
        proc = self.procs[r]
        try:
            rc = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "closed its output and went on running"
        f = self.stderr[r]
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - STDERR_READ))
        lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        how = f"was killed by {procs.signal_name(-rc)}" if rc < 0 else f"exited with code {rc}"
        return how + (f"; stderr: {inert_tail(lines[-1], STDERR_TAIL)}" if lines else "")

    # -- the end
    def end(self) -> None:
        """Kill the whole group (a rank holds nothing that needs a goodbye: its store is in our folder),
        reap every rank, remove the folder. Safe to call twice."""
        if self.procs:
            procs.signal_group(self.procs[0].pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None and not f.closed:
                    try:
                        f.close()
                    except OSError:
                        pass
        if self.procs:
            procs.drop_group(self.procs[0])
        for f in self.stderr:
            f.close()
        self.procs, self.stderr = [], []
        procs.remove_folder(self.folder)


def _others(ranks: list[int]) -> str:
    return f" (nor did rank{'s' * (len(ranks) > 2)} {', '.join(map(str, ranks[1:]))})" if len(ranks) > 1 else ""
