"""One M=1 decode step captured as a CUDA graph and replayed at any position.

At M = 1 a step is ~20 kernels a layer (~900 for 48 layers), and launching them
one by one from Python costs more than the kernels themselves. The graph is
recorded once by running the step's plan (launches.py, the same one a direct
step runs, on the graph's own Target) and the hash launches on a capturing
stream; then every token costs one graph launch. The position is
not baked into the graph: the kernels that use it (RoPE table, KV write,
attention) read it from a device int (their `dpos` argument), which is
uploaded with the token before each replay; the fast attention's scores
scratch is sized for the whole cache (stride cap_s = capacity).

PyCUDA 2026.1 (the wheel this project ships for the H200) exposes no graph API,
so capture, instantiate and launch go through the driver API with ctypes
(cuStreamBeginCapture_v2 in relaxed mode, cuStreamEndCapture,
cuGraphInstantiateWithFlags, cuGraphLaunch); PyCUDA's launches on the
capturing stream are recorded like any other, or, where the driver takes it,
the main stream's kernels go through pdl.py (programmatic dependent launch).
The logits' copy to the host records an external event, so the host can copy
the logits out while the graph still hashes them (wait_logits). So does the copy of
the body's hashes (every key but the logits, hashed on the hash stream while the
final norm and lm_head run): the host fills the step's dict with them while
lm_head and the logits' hash are still running (wait_body), and only the logits'
hash is left for after the step.

The graph owns its arena, token/position buffer and scores scratch, so steps
of other widths on the same backend cannot move them; it shares the backend's
weights and KV cache. Replays are exact replays of the same kernels, so a
graph step's keys equal a direct step's.

CudaBackend.step replays one of these (owned=True: it holds its backend weakly,
so the pair is no reference cycle, and its driver handles are destroyed when
it is freed, which the backend arranges with the context current).
"""
from __future__ import annotations

import ctypes
import weakref

import numpy as np

from .launches import Target
from .pdl import launcher_for, stream_handle

CAPTURE_MODE_RELAXED = 2
EVENT_DISABLE_TIMING = 0x2
EVENT_RECORD_EXTERNAL = 0x1  # a record node the host can wait on (not a capture-internal fork/join)


def _cu():
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphInstantiateWithFlags", "cuGraphLaunch",
                 "cuGraphGetNodes", "cuGraphExecDestroy", "cuGraphDestroy", "cuEventCreate", "cuEventRecordWithFlags",
                 "cuEventSynchronize", "cuEventDestroy_v2"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (CUresult {rc})")


class DecodeGraph:
    def __init__(self, backend, hashing: bool = True, owned: bool = False, use_pdl: bool | None = None):
        self.graph = ctypes.c_void_p()
        self.exec = ctypes.c_void_p()
        self.ev_logits = ctypes.c_void_p()  # recorded in the graph once the logits are on the host
        self.logits_event = False  # whether the captured graph records it (else wait for the stream)
        self.ev_body = ctypes.c_void_p()  # recorded once the body's hashes are on the host
        self.body_early = 0  # how many hashes (the first of hash_host) it covers; 0: none recorded
        self.pdl = False  # whether the main stream's kernels were captured with PDL (pdl.py)
        self.lib = None
        b = self.b = weakref.proxy(backend) if owned else backend
        self.rt = rt = backend.rt
        cuda, cfg = rt.cuda, backend.model.cfg
        self.hashing = hashing
        self.lib = _cu()
        with rt.active():
            # use_pdl None: the backend's pdl option (options.py)
            self.launcher = launcher_for(rt) if (backend.options.pdl if use_pdl is None else use_pdl) else None
            try:
                self._build(b, cuda, cfg, hashing)
            except BaseException:
                self._destroy()  # a failed capture or instantiation leaves no driver handles behind
                raise

    def _build(self, b, cuda, cfg, hashing: bool) -> None:
        self.lay = lay = b._layout(1)
        self.arena = cuda.mem_alloc(lay.total)
        cuda.memset_d8(self.arena, 0, lay.total)
        self.inbuf = cuda.mem_alloc(8)  # [token, position] int32
        cuda.memset_d8(self.inbuf, 0, 8)
        self.scores = cuda.mem_alloc(max(4, b.scratch_bytes(1)))
        self.host_in = cuda.pagelocked_empty(2, np.int32)
        self.logits_host = cuda.pagelocked_empty(cfg.vocab, np.float32)
        self.hash_host = cuda.pagelocked_empty(max(1, lay.n_keys), np.uint64)
        self.stream = cuda.Stream(1)
        self._h = stream_handle(self.stream)
        b._streams()
        if hashing:  # the work lists are uploaded before the capture (no copies inside it)
            self.hb_body, self.hb_logits = b._hash_tables(lay, "body"), b._hash_tables(lay, "logits")
        self.cstream = cuda.Stream(1)
        self.ev_fwd, self.ev_copied = cuda.Event(), cuda.Event()
        for ev in (self.ev_logits, self.ev_body):
            _check(self.lib.cuEventCreate(ctypes.byref(ev), ctypes.c_uint(EVENT_DISABLE_TIMING)), "cuEventCreate")
        err = None
        # the most the capture takes: PDL, the copies back inside the graph, the logits' event
        tries = [(launcher, copies, event) for launcher in dict.fromkeys((self.launcher, None))
                 for copies, event in ((True, True), (True, False), (False, False))]
        for launcher, copies, event in tries:
            try:
                self._capture(copies, launcher, event)
                self.copies_in_graph, self.pdl = copies, launcher is not None
                err = None
                break
            except Exception as e:  # noqa: PERF203
                err = e
        if err is not None:
            raise err
        n = ctypes.c_size_t(0)
        _check(self.lib.cuGraphGetNodes(self.graph, None, ctypes.byref(n)), "cuGraphGetNodes")
        self.n_nodes = n.value
        _check(self.lib.cuGraphInstantiateWithFlags(ctypes.byref(self.exec), self.graph, ctypes.c_ulonglong(0)),
               "cuGraphInstantiateWithFlags")

    def _capture(self, copies: bool, launcher, event: bool) -> None:
        """Record one step on self.stream. copies: the logits' copy to the host on a forked stream
        (overlapping the logits' hash) and the hashes' copy, as graph nodes; event: an external
        event after the logits' copy (wait_logits). launcher: the main stream's kernels are
        launched with PDL (pdl.py), or None."""
        b, cuda, lay = self.b, self.b.rt.cuda, self.lay
        self.logits_event, self.body_early = False, 0
        # the graph's own buffers; the position is read from the device (dpos) at every replay
        T = Target(stream=self.stream, base=int(self.arena), tokens=int(self.inbuf), scores=int(self.scores),
                   dpos=int(self.inbuf) + 4, cap_s=b.capacity)
        h = ctypes.c_void_p(stream_handle(self.stream))
        _check(self.lib.cuStreamBeginCapture_v2(h, ctypes.c_int(CAPTURE_MODE_RELAXED)), "cuStreamBeginCapture")
        err = None
        try:
            self._record(b, cuda, lay, T, copies, event, launcher)
        except Exception as e:  # end the capture whatever happens
            err = e
        finally:
            graph = ctypes.c_void_p()
            rc = self.lib.cuStreamEndCapture(h, ctypes.byref(graph))
            b._body_launched = False
        if err is not None:
            if graph:
                self.lib.cuGraphDestroy(graph)
            raise err
        _check(rc, "cuStreamEndCapture")
        self.graph = graph

    def _record(self, b, cuda, lay, T: Target, copies: bool, event: bool, launcher) -> None:
        """The step's work on the capturing stream: the step's plan, the logits' copy, the hashes."""
        b.forward(lay, T, 0, hash_body=self.hashing, launcher=launcher)
        if self.hashing and copies and event and lay.merge_identity:  # M = 1: the body's keys come first
            self.body_early = b.body_hashes_to_host(lay, self.hash_host,
                                                    lambda s: self._record_external(self.ev_body, s))
        if copies:
            self.ev_fwd.record(self.stream)
            self.cstream.wait_for_event(self.ev_fwd)
            cuda.memcpy_dtoh_async(self.logits_host, int(self.arena) + lay.offset("logits"), self.cstream)
            if event:  # the host may read the logits while the logits' hash still runs
                self._record_external(self.ev_logits, self.cstream)
                self.logits_event = True
            self.ev_copied.record(self.cstream)
        if self.hashing:
            b.launch_hashes(lay, T, launcher)
        if copies:
            self.stream.wait_for_event(self.ev_copied)
            if self.hashing:  # what the body's early copy left: the logits' hash
                n = self.body_early
                cuda.memcpy_dtoh_async(self.hash_host[n:lay.n_keys], b.hash_out(lay) + self.hash_host.itemsize * n,
                                       self.stream)

    def _record_external(self, ev, stream) -> None:
        """An event record node the host can wait on (cuEventSynchronize) in the middle of a replay."""
        _check(self.lib.cuEventRecordWithFlags(ev, ctypes.c_void_p(stream_handle(stream)),
                                               ctypes.c_uint(EVENT_RECORD_EXTERNAL)), "cuEventRecordWithFlags")

    def launch(self, token: int, pos: int) -> None:
        """Queue one step (token upload, the graph, the copies back); inside rt.active()."""
        b, cuda = self.b, self.b.rt.cuda
        if pos + 1 > b.capacity:
            raise ValueError(f"KV cache full: position {pos} >= capacity {b.capacity}")
        self.host_in[0], self.host_in[1] = token, pos
        cuda.memcpy_htod_async(self.inbuf, self.host_in, self.stream)
        _check(self.lib.cuGraphLaunch(self.exec, ctypes.c_void_p(self._h)), "cuGraphLaunch")
        if self.copies_in_graph:
            return
        lay = self.lay
        cuda.memcpy_dtoh_async(self.logits_host, int(self.arena) + lay.offset("logits"), self.stream)
        if self.hashing:
            cuda.memcpy_dtoh_async(self.hash_host[:lay.n_keys], b.hash_out(lay), self.stream)

    def wait_logits(self) -> None:
        """Block until this replay's logits are on the host (its hashes may still be running)."""
        if self.logits_event:
            _check(self.lib.cuEventSynchronize(self.ev_logits), "cuEventSynchronize")
        else:
            self.stream.synchronize()

    def wait_body(self) -> None:
        """Block until this replay's first body_early hashes (the body's) are on the host."""
        _check(self.lib.cuEventSynchronize(self.ev_body), "cuEventSynchronize")

    def step(self, token: int, pos: int) -> tuple[np.ndarray, np.ndarray | None]:
        """One decode step: (logits [vocab], hashes [n_keys] in key order, or None)."""
        with self.rt.active():
            self.launch(token, pos)
            self.wait_logits()
            logits = self.logits_host.copy()  # overlaps the logits' hash
            self.stream.synchronize()
        hashes = self.hash_host[:self.lay.n_keys][self.lay.merge].copy() if self.hashing else None
        return logits, hashes

    def keys(self, pos: int) -> list[str]:
        return [f"t{pos}_{s}" for s in self.lay.key_suffixes]

    def _destroy(self) -> None:
        """Destroy the driver handles (with the context current)."""
        if self.lib is None:
            return
        if self.exec:
            self.lib.cuGraphExecDestroy(self.exec)
            self.exec = ctypes.c_void_p()
        if self.graph:
            self.lib.cuGraphDestroy(self.graph)
            self.graph = ctypes.c_void_p()
        for name in ("ev_logits", "ev_body"):
            if getattr(self, name):
                self.lib.cuEventDestroy_v2(getattr(self, name))
                setattr(self, name, ctypes.c_void_p())

    def close(self) -> None:
        with self.rt.active():
            self._destroy()

    def __del__(self):
        # a backend buries its graph (runtime.bury), so this runs where the context is current
        try:
            self._destroy()
        except Exception:  # interpreter shutdown
            pass
