"""The cuda backend: the decode step of backends/decoder.py as a sequence of kernel launches.

Weights and the KV cache stay on the device. A step uploads the tokens (and,
in isolate mode, the reference's buffers), launches one kernel per op — fast
or exact as the toggles say — writing every probe buffer into the arena
(layout.py), hashes all keys of all M columns at the end (one pass of two
launches, kernels/hash.cu), and copies back the logits and the hashes; the
raw buffers only when asked. The kernels run on the default stream, so launch
order is execution order; every key but the logits is hashed on a second
stream while the final norm and lm_head run, and the copies to the host run on
a third behind events. The host waits for the logits first and copies them out
while the logits are hashed, then waits for the hashes.

An M=1 step without a feed (plain decode, the app's and the CLI's step) is
instead one replay of a CUDA graph of the same kernels (graph.py), captured
lazily at the first such step and again after reset(); it is bit-identical to
the direct launches and spares the ~20 Python launches a layer (its kernels
use programmatic dependent launch, pdl.py). Isolate mode and M>1 launch
directly. The graph option (options.py; or graph=False) forces the direct path; a
capture that fails falls back to it silently, and `graph_status` says why.
hashing=False (the benchmarks' baseline) runs the same step without the hash
launches and returns no hashes.

Which kernel each op runs: launches.select_kernels, by the op registry (backends/toggles.py: each
op's kernels by role, kernels/*.cu list the versions; fused.cu's launches take each op's choice
through their flags). The launches of a step: plan.py.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...model.weights import Model
from ...trace.keys import token_keys
from ..base import KV_FIELDS, Backend, StepOut, key_of
from ..toggles import describe
from . import launches
from .launches import FED, SCAN_THREADS, blocks_for, launch, refuse_unsupported
from .plan import plan
from .graph import DecodeGraph
from .layout import HASH_CHUNK, HASH_PIECE, HashWork, Layout
from .options import CudaOptions
from .runtime import runtime
from .weights import device_model

F32 = np.float32


def device_hash_work(cuda, work: HashWork, onepass: bool = False, out: int | None = None) -> dict:
    """Upload a hash work list with its scratch (self-resetting tickets) and output buffer
    (`out`: a device pointer to write the n_keys hashes to instead of an own allocation).
    onepass: scratch for fnv1a64_keys (256 x 8 bytes a chunk) instead of fnv_states/fnv_chunks."""
    # (an empty list still gets a one-element buffer: a launch's pointers are never null)
    hb = {name: cuda.to_device(a if (a := getattr(work, name)).size else np.zeros(1, a.dtype))
          for name in HashWork.ARRAYS}
    nc, nk = max(1, work.n_chunks), max(1, work.n_keys)
    if onepass:
        hb["F"] = cuda.mem_alloc(nc * 256 * 8)
    else:
        hb["snap"], hb["start"] = cuda.mem_alloc(nc * 256 * (HASH_CHUNK // HASH_PIECE)), cuda.mem_alloc(nc)
    hb["tickets"] = cuda.mem_alloc(nk * 4)
    cuda.memset_d32(hb["tickets"], 0, nk)
    # fnv_scan's: the segments' parity flags (8 rounds) and partial sums, the keys' tickets, the
    # launch counter (zeroed once: the kernel tags its flags with the launch's epoch)
    ns = max(1, work.n_seg)
    for name, nbytes in (("agg", ns * 32), ("partial", ns * 8), ("seg_tickets", nk * 4), ("counter", 8)):
        hb[name] = cuda.mem_alloc(nbytes)
        cuda.memset_d32(hb[name], 0, nbytes // 4)
    hb["out"] = cuda.mem_alloc(nk * 8) if out is None else out
    hb["ptr"] = {name: int(a) for name, a in hb.items()}
    hb["n_chunks"], hb["n_seg"] = work.n_chunks, work.n_seg
    hb["onepass"] = onepass
    return hb








def launch_hash(rt, hb: dict, base: int, stream=None, launcher=None,
                kernels=("fnv_scan", "fnv1a64_keys", "fnv_states", "fnv_chunks")) -> None:
    """Hash every span of the work list: fnv_scan for the short ones, then the chunked ones in two
    launches (or one with onepass scratch); launcher: as launches.launch's. kernels: those to
    launch (scripts/gpu/gpu_hash_bench.py times them one by one)."""
    p, n = hb["ptr"], hb["n_chunks"]
    if hb["n_seg"] and "fnv_scan" in kernels:
        launch(rt.kernel("hash", "fnv_scan"), (hb["n_seg"], 1, 1), (SCAN_THREADS, 1, 1), stream, base,
               p["seg_key"], p["seg_off"], p["seg_len"], p["seg_first"], p["seg_n"], p["seg_pow"], p["pow_seg"],
               p["pow_word"], p["agg"], p["partial"], p["seg_tickets"], p["counter"], p["out"], launcher=launcher)
    if not n:
        return
    if hb["onepass"]:
        if "fnv1a64_keys" in kernels:
            launch(rt.kernel("hash", "fnv1a64_keys"), (n, 1, 1), (256, 1, 1), stream, base, p["chunk_key"],
                   p["chunk_off"], p["chunk_len"], p["chunk_pow"], p["key_first"], p["key_n"], p["F"], p["tickets"],
                   p["out"], launcher=launcher)
        return
    if "fnv_states" in kernels:
        launch(rt.kernel("hash", "fnv_states"), (n, 1, 1), (256, 1, 1), stream, base, p["chunk_key"],
               p["chunk_off"], p["chunk_len"], p["key_first"], p["key_n"], p["snap"], p["start"], p["tickets"],
               p["out"], launcher=launcher)
    if "fnv_chunks" in kernels:
        launch(rt.kernel("hash", "fnv_chunks"), (blocks_for(n * (HASH_CHUNK // HASH_PIECE), 128), 1, 1),
               (128, 1, 1), stream, base, p["chunk_key"], p["chunk_off"], p["chunk_len"], p["key_first"],
               p["piece_pow"], p["piece_spow"], p["snap"], p["start"], p["out"], n, launcher=launcher)


class CudaBackend(Backend):
    def __init__(self, model: Model, kv: str = "q8", exact: frozenset[str] = frozenset(), deep: bool = False,
                 graph: bool | None = None, hashing: bool = True, options: CudaOptions | None = None):
        cfg = model.cfg
        refuse_unsupported(cfg)
        self.model, self.kv, self.exact, self.deep = model, kv, frozenset(exact), deep
        # hashing=False: steps return no hashes and launch no hash kernels — only so that the
        # benchmarks can measure what hashing costs through the same step(); switchable any time
        self.hashing = hashing
        # the runtime switches (options.py); graph=False (the benchmarks' and tests' override) wins
        self.options = options if options is not None else CudaOptions.from_env()
        if graph is not None:
            self.options = replace(self.options, graph=bool(graph))
        self.fuse = self.options.fuse  # read by plan.py; same bits either way
        self.rt = runtime()
        self.name = f"cuda ({describe(self.exact)})"
        self.device_name = self.rt.name  # shown by the app's header
        with self.rt.active():
            self.dm = device_model(self.rt, model)
        self._layouts: dict[int, Layout] = {}
        self._arena = self._feed = self._scores = None
        self._arena_size = self._feed_size = self._scores_size = 0
        self._hash_bufs: dict[int, dict] = {}
        self._feed_host: dict[int, np.ndarray] = {}
        self._copy_stream = self._fwd_done = self._hash_done = self._logits_host = self._hash_host = None
        self._logits_done = None
        self._tokens = None
        self._tokens_size = 0
        self._cache = None
        self.capacity = 0
        self._hash_stream = self._body_ready = self._body_done = None
        self._body_launched = False
        # the M=1 decode graphs (graph.py), by `hashing`: each captured by the first eligible step
        self.use_graph = self.options.graph
        self._graph_off_why = ("graph=False" if graph is False else "graph option off") if not self.use_graph else None
        self._graphs: dict[bool, DecodeGraph] = {}
        self.graph_error: str | None = None  # why the capture (or a replay) failed; then direct for good
        self.graph_steps = 0  # steps served by a graph replay
        with self.rt.active():
            self.kernels = launches.select_kernels(self.rt, model, kv, self.exact, self.options)

    def __del__(self):
        try:
            objs = [*self._graphs.values(), self._arena, self._feed, self._scores, self._tokens, self._cache, self._copy_stream,
                    self._fwd_done, self._hash_done, self._logits_done, self._logits_host, self._hash_host, self._hash_stream,
                    self._body_ready, self._body_done, *self._feed_host.values()]
            for hb in self._hash_bufs.values():
                objs += [v for k, v in hb.items() if k not in ("ptr", "n_chunks", "onepass", "out")]
            self.rt.bury(objs)
        except Exception:  # interpreter shutdown, or a failed __init__
            pass

    # ------------------------------------------------------------ setup

    def describe(self) -> str:
        return f"{self.name} on {self.rt.name}"

    @property
    def graph_status(self) -> str:
        """How M=1 steps run: the graph (and its nodes), not captured yet, forced off, or why it failed."""
        if not self.use_graph:
            return f"direct ({self._graph_off_why or 'use_graph=False'})"
        if self.graph_error is not None:
            return f"direct (graph failed: {self.graph_error})"
        if self._graph is None:
            return "graph (not captured yet)"
        g = self._graph
        pdl_note = "PDL" if g.pdl else f"no PDL{f' ({self.rt.pdl_error})' if self.rt.pdl_error else ''}"
        return (f"graph ({g.n_nodes} nodes, {pdl_note}, copies {'in' if g.copies_in_graph else 'after'}"
                f" the graph, {self.graph_steps} steps)")

    @property
    def _graph(self) -> DecodeGraph | None:
        """The decode graph M=1 steps replay now (the one with or without the hash launches)."""
        return self._graphs.get(self.hashing)

    def _drop_graph(self) -> None:
        graphs, self._graphs = list(self._graphs.values()), {}
        if graphs:
            with self.rt.active():
                for g in graphs:
                    g.close()
                del g, graphs  # their device memory is freed here, with the context current

    def reset(self, capacity: int) -> None:
        cfg, cuda = self.model.cfg, self.rt.cuda
        esz = 1 if self.kv == "q8" else 4
        row = cfg.n_kv_heads * cfg.head_dim
        sizes = dict(k=capacity * row * esz, v=capacity * row * esz, ks=capacity * cfg.n_kv_heads * 4,
                     vs=capacity * cfg.n_kv_heads * 4)
        self._drop_graph()  # it baked in the old cache's pointers and the scratch of the old capacity
        with self.rt.active():
            self._cache = None
            per_layer = sum(-(-s // 256) * 256 for s in sizes.values())
            total = per_layer * cfg.n_layers
            self._cache = cuda.mem_alloc(max(total, 1))
            cuda.memset_d8(self._cache, 0, max(total, 1))
            base = int(self._cache)
            self.cache = []
            for li in range(cfg.n_layers):
                off, ptrs = base + li * per_layer, {}
                for name, s in sizes.items():
                    ptrs[name] = off
                    off += -(-s // 256) * 256
                self.cache.append(ptrs)
        self.capacity = capacity
        self._row_bytes = dict(k=row * esz, v=row * esz, ks=cfg.n_kv_heads * 4, vs=cfg.n_kv_heads * 4)

    def _layout(self, M: int) -> Layout:
        lay = self._layouts.get(M)
        if lay is None:
            lay = self._layouts[M] = Layout(self.model.cfg, self.kv, M, self.deep)
        return lay

    def _grow(self, attr: str, size: int):
        cur = getattr(self, f"{attr}_size")
        if cur < size:
            setattr(self, attr, None)
            setattr(self, attr, self.rt.cuda.mem_alloc(size))
            self.rt.cuda.memset_d8(getattr(self, attr), 0, size)  # no stale bits (e.g. expert ids)
            setattr(self, f"{attr}_size", size)
        return int(getattr(self, attr))

    def _hash_tables(self, lay: Layout, which: str) -> dict:
        """The device work list of `which` ("body": every key but the logits; "logits")."""
        hb = self._hash_bufs.get((lay.M, which))
        if hb is None:
            # both lists write into one buffer (body hashes, then the logits'): one copy back
            out = self._hash_bufs.get((lay.M, "out"))
            if out is None:
                out = self._hash_bufs[lay.M, "out"] = {"buf": self.rt.cuda.mem_alloc(max(8, lay.n_keys * 8))}
            ptr = int(out["buf"]) + (0 if which == "body" else 8 * len(lay.body_index))
            work = lay.hash_body if which == "body" else lay.hash_logits
            hb = self._hash_bufs[lay.M, which] = device_hash_work(self.rt.cuda, work, out=ptr)
        return hb

    def hash_out(self, lay: Layout) -> int:
        """Device pointer of the step's n_keys hashes (body keys first; fetch reorders)."""
        self._hash_tables(lay, "body")
        return int(self._hash_bufs[lay.M, "out"]["buf"])

    # ------------------------------------------------------------ the step

    def step(self, tokens: np.ndarray, pos0: int, raw: bool = True, feed=None) -> StepOut:
        tokens = np.ascontiguousarray(np.asarray(tokens).reshape(-1), dtype=np.int32)
        M = len(tokens)
        cfg = self.model.cfg
        if self._cache is None:
            raise RuntimeError("cuda backend: reset(capacity) before step()")
        if pos0 + M > self.capacity:
            raise ValueError(f"KV cache full: positions up to {pos0 + M} > capacity {self.capacity}")
        if M == 1:  # (no numpy reductions for the one token of a decode step)
            if not 0 <= int(tokens[0]) < cfg.vocab:
                raise ValueError(f"token ids must be in 0..{cfg.vocab - 1}")
            if feed is None and self.use_graph and self.graph_error is None:
                out = self._graph_step(int(tokens[0]), pos0, raw)
                if out is not None:
                    return out
        elif M == 0 or tokens.min() < 0 or tokens.max() >= cfg.vocab:
            raise ValueError(f"token ids must be in 0..{cfg.vocab - 1}")
        with self.rt.active():
            lay, T = self.prepare(tokens, pos0, feed)
            self.forward(lay, T, pos0, isolate=feed is not None, hash_body=self.hashing)
            self.copy_logits(lay, T)  # overlaps the logits' hash
            if self.hashing:
                self.hash(lay, T)
            return self.fetch(lay, pos0, raw)

    def _graph_failed(self, what: str, e: Exception) -> None:
        self.graph_error = f"{what}: {type(e).__name__}: {e}"
        graphs, self._graphs = list(self._graphs.values()), {}
        for g in graphs:
            try:
                g.close()
            except Exception:  # the handles are gone with the graph's failure
                pass

    def _graph_step(self, token: int, pos: int, raw: bool) -> StepOut | None:
        """One M=1 step as a replay of the decode graph (captured here the first time); None when
        the capture or the launch failed (graph_error says why; the caller launches directly)."""
        vocab = self.model.cfg.vocab
        with self.rt.active():
            g = self._graph
            if g is None:
                try:
                    g = self._graphs[self.hashing] = DecodeGraph(self, hashing=self.hashing, owned=True,
                                                                 use_pdl=self.options.pdl)
                except Exception as e:  # no graph API, capture refused: the direct path, silently
                    self._graph_failed("capture", e)
                    return None
            try:
                g.launch(token, pos)
            except Exception as e:  # cuGraphLaunch refused: nothing ran
                self._graph_failed("launch", e)
                return None
            # while the graph runs: the key names, hashed once as the keys of the step's dict
            lay = g.lay
            prefix = f"t{pos}_"
            names = [prefix + suffix for suffix in lay.key_suffixes]
            hashes = dict.fromkeys(names) if self.hashing else {}
            early = g.body_early if self.hashing else 0
            if early:  # the body's hashes are on the host while lm_head and the logits' hash run
                g.wait_body()
                hashes.update(zip(names[:early], g.hash_host[:early].tolist()))
            g.wait_logits()
            logits = g.logits_host[:vocab].reshape(1, vocab).copy()  # while the logits are hashed
            g.stream.synchronize()
            if self.hashing:  # what the early fill left (early > 0 only where the merge is the identity)
                hv = g.hash_host[:lay.n_keys]
                hv = hv if lay.merge_identity else hv[lay.merge]
                hashes.update(zip(names[early:], hv[early:].tolist()))
            raws = self._raw_columns(lay, g.arena, [names]) if raw else None
        self.graph_steps += 1
        return StepOut(logits=logits, hashes=[hashes], raw=raws)

    def prepare(self, tokens: np.ndarray, pos0: int, feed) -> tuple[Layout, launches.Target]:
        """Arena, token upload and (isolate) the reference's buffers: the step's layout and the Target
        its launches write to (the default stream). Inside rt.active()."""
        cuda = self.rt.cuda
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        M = len(tokens)
        lay = self._layout(M)
        base = self._grow("_arena", lay.total)
        tokens_ptr = self._grow("_tokens", M * 4)
        cuda.memcpy_htod(tokens_ptr, tokens)
        scores = self._grow("_scores", self.scratch_bytes(M))
        feed_base = None
        if feed is not None:
            feed_base = self._grow("_feed", lay.total)
            host = self._feed_host.get(M)
            if host is None:
                host = self._feed_host[M] = cuda.pagelocked_empty(lay.key_bytes, np.uint8)
            n_layers = self.model.cfg.n_layers
            for m in range(M):
                t = pos0 + m
                for key, (field, layer) in zip(token_keys(t, n_layers, self.deep), lay.key_fields):
                    if field not in FED:
                        continue
                    r = lay.regions[field, layer]
                    buf = np.ascontiguousarray(feed[m][key_of(t, field, layer)], dtype=r.dtype)
                    if buf.nbytes != r.col_bytes:
                        raise ValueError(f"isolate feed {key}: {buf.nbytes} bytes, expected {r.col_bytes}")
                    start = r.offset + m * r.col_bytes
                    host[start:start + r.col_bytes] = buf.reshape(-1).view(np.uint8)
            cuda.memcpy_htod(self._feed, host)
        return lay, launches.Target(stream=None, base=base, tokens=tokens_ptr, scores=scores, feed=feed_base)

    def forward(self, lay: Layout, T: launches.Target, pos0: int, isolate: bool = False, hash_body: bool = False,
                launcher=None) -> None:
        """Queue one step's plan (plan.py) on T's stream, inside rt.active(); launcher: pdl.py's,
        while a graph captures with PDL."""
        steps = plan(self, lay, T, pos0, isolate, hash_body)
        launches.run(self.rt, steps, T.stream, launcher, on_hash_body=lambda: self._launch_body_hash(lay, T))

    def scratch_bytes(self, M: int) -> int:
        return launches.scratch_bytes(self, M)

    def _launch_body_hash(self, lay: Layout, T: launches.Target) -> None:
        """Hash every key but the logits on the hash stream, after what T's stream has queued."""
        self._streams()
        self._body_ready.record(T.stream)
        self._hash_stream.wait_for_event(self._body_ready)
        launch_hash(self.rt, self._hash_tables(lay, "body"), T.base, self._hash_stream)
        self._body_done.record(self._hash_stream)
        self._body_launched = True

    def body_hashes_to_host(self, lay: Layout, host, then=None) -> int:
        """Behind the body's hash on the hash stream (forward started it): the copy of its hashes,
        the first n of hash_out, to pinned `host`, then then(stream) (the graph's external event),
        both before the join in launch_hashes. Returns n."""
        n = len(lay.body_index)
        self.rt.cuda.memcpy_dtoh_async(host[:n], self.hash_out(lay), self._hash_stream)
        if then is not None:
            then(self._hash_stream)
        self._body_done.record(self._hash_stream)
        return n

    def launch_hashes(self, lay: Layout, T: launches.Target, launcher=None) -> None:
        """The logits' hash on T's stream (and the body's, if forward did not start it), then T's
        stream waits for the body's: every hash is final behind it."""
        if not self._body_launched:
            self._launch_body_hash(lay, T)
        launch_hash(self.rt, self._hash_tables(lay, "logits"), T.base, T.stream, launcher)
        if T.stream is not None:  # join the hash stream (a graph capture must end joined)
            T.stream.wait_for_event(self._body_done)
        self._body_launched = False

    def hash(self, lay: Layout, T: launches.Target) -> None:
        """FNV-1a 64 of every key of every column (kernels/hash.cu fnv_scan; the
        logits' on the main stream, the rest on the hash stream unless forward started them),
        then their copy to pinned host memory on the copy stream (fetch waits for it)."""
        cuda = self.rt.cuda
        self.launch_hashes(lay, T)
        if self._hash_host is None or self._hash_host.size < lay.n_keys:
            self._hash_host = cuda.pagelocked_empty(lay.n_keys, np.uint64)
        self._hash_done.record(T.stream)
        self._copy_stream.wait_for_event(self._hash_done)
        self._copy_stream.wait_for_event(self._body_done)  # on the default stream there is no join
        cuda.memcpy_dtoh_async(self._hash_host[:lay.n_keys], self.hash_out(lay), self._copy_stream)

    def _streams(self) -> None:
        if self._copy_stream is None:
            cuda = self.rt.cuda
            # CU_STREAM_NON_BLOCKING (1): no implicit sync with the default stream, so the
            # copies and the body hash really overlap; events order them.
            self._copy_stream, self._fwd_done, self._hash_done = cuda.Stream(1), cuda.Event(), cuda.Event()
            self._logits_done = cuda.Event()
            self._hash_stream, self._body_ready, self._body_done = cuda.Stream(1), cuda.Event(), cuda.Event()

    def copy_logits(self, lay: Layout, T: launches.Target) -> None:
        """Start the logits' copy to pinned host memory on a second stream, after the forward
        pass, so it overlaps the hash kernel on the default stream."""
        cuda = self.rt.cuda
        self._streams()
        n = lay.M * self.model.cfg.vocab
        if self._logits_host is None or self._logits_host.size < n:
            self._logits_host = cuda.pagelocked_empty(n, F32)
        self._fwd_done.record(T.stream)  # the forward pass is queued before it
        self._copy_stream.wait_for_event(self._fwd_done)
        cuda.memcpy_dtoh_async(self._logits_host[:n], T.base + lay.offset("logits"), self._copy_stream)
        self._logits_done.record(self._copy_stream)

    def fetch(self, lay: Layout, pos0: int, raw: bool) -> StepOut:
        cfg = self.model.cfg
        M = lay.M
        # the key names are built while the hash kernels run
        names = [[f"t{pos0 + m}_{suffix}" for suffix in lay.key_suffixes] for m in range(M)]
        self._logits_done.synchronize()
        logits = self._logits_host[:M * cfg.vocab].reshape(M, cfg.vocab).copy()  # while the logits are hashed
        self._copy_stream.synchronize()  # the hashes are on the host
        if self.hashing:
            nk = len(lay.key_fields)
            hv = self._hash_host[:lay.n_keys][lay.merge].tolist()
            hashes = [dict(zip(names[m], hv[m * nk:(m + 1) * nk])) for m in range(M)]
        else:
            hashes = [{} for _ in range(M)]
        raws = self._raw_columns(lay, self._arena, names) if raw else None
        return StepOut(logits=logits, hashes=hashes, raw=raws)

    def _raw_columns(self, lay: Layout, arena, names: list[list[str]]) -> list[dict[str, np.ndarray]]:
        """Every key's buffer of every column, copied from `arena` (the step's, or the graph's own)."""
        host = np.empty(lay.key_bytes, np.uint8)
        self.rt.cuda.memcpy_dtoh(host, arena)
        raws = []
        for m in range(lay.M):
            col = {}
            for key, (field, layer) in zip(names[m], lay.key_fields):
                r = lay.regions[field, layer]
                start = r.offset + m * r.col_bytes
                col[key] = host[start:start + r.col_bytes].view(r.dtype).reshape(r.shape)
            raws.append(col)
        return raws

    def load_kv(self, pos0: int, raws: list[dict[str, np.ndarray]]) -> None:
        cfg, cuda = self.model.cfg, self.rt.cuda
        dt = {"k": np.int8 if self.kv == "q8" else F32, "v": np.int8 if self.kv == "q8" else F32,
              "ks": F32, "vs": F32}
        with self.rt.active():
            for li in range(cfg.n_layers):
                for f in KV_FIELDS:
                    rows = np.ascontiguousarray(np.stack([np.asarray(col[key_of(pos0 + m, f, li)], dtype=dt[f])
                                                          .reshape(-1) for m, col in enumerate(raws)]))
                    if rows.shape[1] * rows.itemsize != self._row_bytes[f]:
                        raise ValueError(f"load_kv {f}: rows of {rows.shape[1] * rows.itemsize} bytes,"
                                         f" expected {self._row_bytes[f]}")
                    cuda.memcpy_htod(self.cache[li][f] + pos0 * self._row_bytes[f], rows)
