"""The cuda backend against a fake driver: no GPU, the step's wiring on the CPU (nvcc only to read
the kernels' argument formats from their PTX, as the runtime does).

_FakeRuntime stands in for backends/cuda/runtime.py (its PyCUDA driver, _FakeDriver, keeps every
allocation as a host buffer at a fake address; its kernels, _FakeKernel, check each launch's
arguments against the kernels' formats, every pointer inside a live allocation, whole-warp blocks
and dynamic shared memory only where opted in) and _FakeLibcuda for the driver entry points
graph.py and pdl.py call through ctypes. Checked on it: the step launches every kernel that way
and returns the cpu backend's keys, shapes and dtypes; the device-generated synthetic model, the
decode graph (capture, replay, fallbacks), the PDL launcher's structures and routing, the P.V
spread, the fused kernels' wiring, and every accepted head_dim.

The nvcc compile checks and the host-compiled replica checks are in test_kernels_compile.py.
"""
from __future__ import annotations

import contextlib
import functools
import shutil
import struct
from dataclasses import replace

import numpy as np
import pytest

from kestrel_tui.backends.cuda.layout import SCAN_MAX
from kestrel_tui.model.config import default_config

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (the kernels' formats are"
                                " read from their PTX)")


@functools.lru_cache(maxsize=None)
def formats() -> dict[str, str]:
    from kestrel_tui.backends.cuda.runtime import kernel_formats

    return kernel_formats("sm_90")


class _FakeDriver:
    """Just enough of pycuda.driver: allocations are host buffers at fake addresses."""

    # an H200's per-block shared memory (232448) less attn_exact_pv_q8's static 35840: the dynamic
    # memory it may opt in to
    smem_optin = 232448 - 35840

    class function_attribute:  # noqa: N801 (pycuda.driver's name)
        MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def __init__(self):
        self.allocs: dict[int, np.ndarray] = {}
        self.next = 1 << 32
        self.optin: dict[str, int] = {}  # kernel -> set_attribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)

    def _find(self, ptr: int, n: int = 1) -> tuple[np.ndarray, int]:
        ptr = int(ptr)
        for base, buf in self.allocs.items():
            if base <= ptr and ptr + n <= base + buf.size:
                return buf, ptr - base
        raise AssertionError(f"pointer {ptr:#x} (+{n}) outside every live allocation")

    def mem_alloc(self, n):
        base = self.next
        self.next += (n + 4095) // 4096 * 4096 + 4096
        self.allocs[base] = np.zeros(n, np.uint8)
        return base

    def to_device(self, arr):
        p = self.mem_alloc(arr.nbytes)
        self.memcpy_htod(p, arr)
        return p

    def memset_d8(self, p, v, n):
        buf, o = self._find(p, n)
        buf[o:o + n] = v

    def memset_d32(self, p, v, n):
        self.memset_d8(p, 0, 4 * n)

    def memcpy_htod(self, p, arr):
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        buf, o = self._find(p, raw.size)
        buf[o:o + raw.size] = raw

    def memcpy_dtoh(self, arr, p):
        raw = arr.reshape(-1).view(np.uint8)
        buf, o = self._find(p, raw.size)
        raw[:] = buf[o:o + raw.size]

    def memcpy_dtod(self, dst, src, n):
        b1, o1 = self._find(dst, n)
        b2, o2 = self._find(src, n)
        b1[o1:o1 + n] = b2[o2:o2 + n]

    def pagelocked_empty(self, n, dtype):
        return np.empty(n, dtype)

    def memcpy_dtoh_async(self, arr, p, stream=None):
        self.memcpy_dtoh(arr, p)

    def memcpy_htod_async(self, p, arr, stream=None):
        self.memcpy_htod(p, arr)

    class Stream:
        handle = 0x5EED

        def __init__(self, flags=0):
            pass

        def wait_for_event(self, ev):
            pass

        def synchronize(self):
            pass

    class Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def time_till(self, other):
            return 1.0

    class Context:
        @staticmethod
        def synchronize():
            pass


class _FakeKernel:
    def __init__(self, drv, name):
        self.drv, self.name, self.fmt = drv, name, formats()[name]
        self.calls = 0

    def prepared_call(self, grid, block, *args, shared_size=0):
        assert len(args) == len(self.fmt), f"{self.name}: {len(args)} args for format {self.fmt}"
        assert 0 <= shared_size <= self.drv.optin.get(self.name, 0) or shared_size == 0, \
            (self.name, shared_size, "dynamic shared memory without opting in")
        self.shared_size = shared_size
        struct.pack("".join({"P": "Q", "i": "i", "f": "f"}[c] for c in self.fmt), *args)  # types
        for c, a in zip(self.fmt, args):
            if c == "P" and a:
                self.drv._find(a)
        assert all(g >= 1 for g in grid) and block[0] % 32 == 0 and block[0] <= 1024, (self.name, grid, block)
        self.calls, self.block = self.calls + 1, block

    def prepared_async_call(self, grid, block, stream, *args, shared_size=0):
        self.prepared_call(grid, block, *args, shared_size=shared_size)

    def set_attribute(self, attr, value):
        assert attr == _FakeDriver.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES
        assert value <= self.drv.smem_optin, (self.name, value)
        self.drv.optin[self.name] = value


class _FakeRuntime:
    name, arch = "fake GPU", "sm_90"

    def __init__(self):
        self.cuda = _FakeDriver()
        self.kernels: dict[str, _FakeKernel] = {}
        self.kernel_names: dict[int, tuple[str, str]] = {}
        self.pdl, self.pdl_error = None, None
        self.formats = formats()

    @contextlib.contextmanager
    def active(self):
        yield self

    def bury(self, objects):
        pass

    def kernel(self, module, name):
        k = self.kernels.setdefault(name, _FakeKernel(self.cuda, name))
        self.kernel_names[id(k)] = (module, name)
        return k


@pytest.mark.parametrize("weights,kv,deep,exact", [("q4_0", "q8", False, "all"), ("q4_0", "q8", True, "none"),
                                                    ("f32", "f32", False, "norm,attention")])
def test_step_wiring_against_fake_driver(monkeypatch, weights, kv, deep, exact):
    from kestrel_tui.backends import cuda as cuda_pkg
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.toggles import parse_exact
    from kestrel_tui.model.weights import synthetic_model
    from kestrel_tui.trace.keys import token_keys

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    # a vocabulary whose logits are two of fnv_scan's segments
    cfg = replace(default_config().with_layers(2), vocab=5000) if weights == "q4_0" else default_config().with_layers(2)
    model = synthetic_model(cfg, weights)
    sub = cuda_pkg.make_cuda_backend(model, kv=kv, exact=parse_exact(exact), deep=deep)
    ref = NumpyBackend(model, kv=kv, deep=deep)
    for b in (sub, ref):
        b.reset(8)
    prompt = np.array([5, 9, 11])
    r_out, s_out = ref.step(prompt, 0), sub.step(prompt, 0)
    sub.load_kv(0, r_out.raw)
    s_iso = sub.step(np.array([7]), 3, feed=ref.step(np.array([7]), 3).raw)
    for r_col, s_col in zip(r_out.raw, s_out.raw):
        assert list(s_col) == list(r_col)
        for key in r_col:
            assert (s_col[key].shape, s_col[key].dtype) == (r_col[key].shape, r_col[key].dtype), key
    assert list(s_iso.hashes[0]) == token_keys(3, 2, deep)
    assert s_out.logits.shape == r_out.logits.shape
    # two steps, each: the body keys (on the hash stream) and the logits, all by fnv_scan
    assert fake.kernels["fnv_scan"].calls == 4 and not {"fnv_states", "fnv_chunks"} & set(fake.kernels)
    assert -(-cfg.vocab * 4 // SCAN_MAX) == (2 if weights == "q4_0" else 1)


class _FakeLibcuda:
    """The driver entry points graph.py calls through ctypes; records the capture calls."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def fn(*args):
            self.calls.append(name)
            return 0
        return fn


def test_device_synthetic_model_graph_and_bench_wiring(monkeypatch):
    """The full-size path on a small config: weights generated on the (fake) device, an M=1 step
    captured as a graph (the capture entry points faked), the batch widths' split-K grids, and
    the bench's bookkeeping."""
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import graph as gr
    from kestrel_tui.backends.cuda import launches, make_cuda_backend
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.model.config import qwen3_30b_a3b_config
    from kestrel_tui.perf import cuda as perf

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    lib = _FakeLibcuda()
    monkeypatch.setattr(gr, "_cu", lambda: lib)
    model = DeviceSyntheticModel(default_config().with_layers(2))
    b = make_cuda_backend(model)
    b.reset(40)
    assert fake.kernels["gen_q4"].calls == 1 + 1 + 2 * 8  # embed, lm_head, 8 matrices a layer
    for M in (1, 2, 5, 8):
        out = b.step(np.arange(M) + 3, 0, raw=False)
        assert out.logits.shape == (M, model.cfg.vocab) and len(out.hashes) == M
    lay = b._layout(1)
    marks = np.arange(1, lay.n_keys + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    fake.cuda.memcpy_htod(b.hash_out(lay), marks)  # the hash kernels' output, as the (fake) copies read it
    g = gr.DecodeGraph(b, hashing=True)
    # the capture ran the step's plan on the graph's own Target: no launch state on the backend
    assert not any(hasattr(b, a) for a in ("stream", "dpos", "cap_s", "base", "tokens_ptr"))
    capture = [c for c in lib.calls if c.startswith("cuStream") or c.startswith("cuEventRecord")]
    # two events the host waits on in the middle of a replay: the body's hashes on the host (every
    # key but the logits, while lm_head runs), then the logits (while the logits' hash runs)
    assert capture[:4] == ["cuStreamBeginCapture_v2", "cuEventRecordWithFlags", "cuEventRecordWithFlags",
                           "cuStreamEndCapture"]
    assert g.logits_event and g.body_early == lay.n_keys - 1
    # the early copy and the one at the end (the logits' hash alone) fill every hash, each in its place
    assert (g.hash_host[:lay.n_keys] == marks).all()
    logits, hashes = g.step(7, 9)
    assert logits.shape == (model.cfg.vocab,) and len(hashes) == len(g.keys(9))
    g.close()
    r = perf.decode_bench(model, ctx=8, steps=2, warm=1, log=lambda *_: None)
    assert set(r) == {"fast", "exact", "exact_over_fast"}
    bv = perf.batch_verify(model, frozenset(), n_pos=6, widths=(2, 5), n_prompt=3, log=lambda *_: None)
    assert bv["widths"][5]["ndiff_per_column"] == [0] * 5  # the fake device returns zeros
    assert perf.graph_equals_direct(model, frozenset(), n_pos=3)["key_diffs"] == 0
    fb = perf.active_bytes(qwen3_30b_a3b_config(48), 1024)
    assert 1.5e9 < fb["total"] < 2.0e9, fb
    assert launches.gemv_split(1, False) == 1 and launches.gemv_split(3, False) == 2 and launches.gemv_split(8, False) == 1
    assert all(launches.gemv_split(m, True) == 1 for m in range(1, 9))


def test_step_replays_graph_for_m1_and_falls_back(monkeypatch):
    """CudaBackend.step: M=1 without a feed replays the decode graph (captured at the first such
    step and again after reset), returning the direct path's keys and raw buffers (names, shapes,
    dtypes); M>1 and isolate launch directly; KESTREL_CUDA_GRAPH=0 and a failing capture keep the
    direct path, the latter saying why in graph_status."""
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import graph as gr
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.model.weights import synthetic_model
    from kestrel_tui.trace.keys import token_keys

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    lib = _FakeLibcuda()
    monkeypatch.setattr(gr, "_cu", lambda: lib)
    monkeypatch.delenv("KESTREL_CUDA_GRAPH", raising=False)
    model = synthetic_model(default_config().with_layers(2), "q4_0")
    g_b, d_b = make_cuda_backend(model), make_cuda_backend(model, graph=False)
    assert g_b.use_graph and not d_b.use_graph and g_b.graph_status == "graph (not captured yet)"
    for b in (g_b, d_b):
        b.reset(8)
        b.step(np.array([5, 9, 11]), 0, raw=False)  # M=3: direct
    assert g_b.graph_steps == 0 and "cuStreamBeginCapture_v2" not in lib.calls
    g_out, d_out = g_b.step(np.array([7]), 3), d_b.step(np.array([7]), 3)
    assert g_b.graph_steps == 1 and d_b.graph_steps == 0 and lib.calls.count("cuGraphLaunch") == 1
    assert list(g_out.hashes[0]) == list(d_out.hashes[0]) == token_keys(3, 2, False)
    assert g_out.logits.shape == d_out.logits.shape == (1, model.cfg.vocab) and g_out.logits.dtype == np.float32
    assert all(isinstance(v, int) for v in g_out.hashes[0].values())
    assert len(g_out.raw) == 1 and list(g_out.raw[0]) == list(d_out.raw[0])
    for key, a in d_out.raw[0].items():
        assert (g_out.raw[0][key].shape, g_out.raw[0][key].dtype) == (a.shape, a.dtype), key
    assert g_b.step(np.array([8]), 4, raw=False).raw is None and g_b.graph_steps == 2
    assert lib.calls.count("cuStreamBeginCapture_v2") == 1 and g_b.graph_status.startswith("graph (")
    ref = NumpyBackend(model)
    ref.reset(8)
    ref.step(np.array([5, 9, 11, 7, 8]), 0)
    g_b.step(np.array([1]), 5, feed=ref.step(np.array([1]), 5).raw)  # isolate: direct
    assert g_b.graph_steps == 2
    g_b.reset(16)  # a new cache and capacity: captured again at the next M=1 step
    assert g_b._graph is None
    g_b.step(np.array([5]), 0, raw=False)
    assert lib.calls.count("cuStreamBeginCapture_v2") == 2 and g_b.graph_steps == 3

    monkeypatch.setenv("KESTREL_CUDA_GRAPH", "0")
    off = make_cuda_backend(model)
    off.reset(4)
    off.step(np.array([5]), 0, raw=False)
    assert off.graph_steps == 0 and off.graph_status == "direct (graph option off)"
    assert lib.calls.count("cuStreamBeginCapture_v2") == 2

    monkeypatch.delenv("KESTREL_CUDA_GRAPH")

    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(gr, "_cu", no_driver)
    broken = make_cuda_backend(model)
    broken.reset(4)
    for t in range(2):
        out = broken.step(np.array([5 + t]), t)
        assert list(out.hashes[0]) == token_keys(t, 2, False) and out.raw is not None
    assert broken.graph_steps == 0 and broken._graph is None
    assert broken.graph_status == "direct (graph failed: capture: OSError: libcuda.so.1: cannot open shared object file)"

    class _NoInstantiate(_FakeLibcuda):
        def __getattr__(self, name):
            if name == "cuGraphInstantiateWithFlags":
                return lambda *args: 999
            return super().__getattr__(name)

    lib2 = _NoInstantiate()
    monkeypatch.setattr(gr, "_cu", lambda: lib2)
    refused = make_cuda_backend(model)
    refused.reset(4)
    out = refused.step(np.array([5]), 0)
    assert refused.graph_steps == 0 and "CUresult 999" in refused.graph_status
    assert not hasattr(refused, "stream")  # the failed capture had nothing of the backend's to restore
    assert list(out.hashes[0]) == token_keys(0, 2, False) and "cuGraphLaunch" not in lib2.calls


@pytest.mark.parametrize("graph", [True, False])
def test_hashing_off_launches_no_hash_kernels(monkeypatch, graph):
    """hashing=False (what the benchmarks compare against): the same step with no hash launches
    and no hashes; switching back hashes every key again (a second graph, captured on demand)."""
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import graph as gr
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.model.weights import synthetic_model
    from kestrel_tui.trace.keys import token_keys

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    lib = _FakeLibcuda()
    monkeypatch.setattr(gr, "_cu", lambda: lib)
    b = make_cuda_backend(synthetic_model(default_config().with_layers(2), "q4_0"), graph=graph)
    b.reset(8)
    b.hashing = False
    out = b.step(np.array([5]), 0, raw=False)
    assert out.hashes == [{}] and out.logits.shape == (1, b.model.cfg.vocab)
    assert not {"fnv_scan", "fnv_states", "fnv_chunks"} & set(fake.kernels)
    b.hashing = True
    assert list(b.step(np.array([6]), 1, raw=False).hashes[0]) == token_keys(1, 2, False)
    assert fake.kernels["fnv_scan"].calls == 2  # every key (the logits too) within fnv_scan's limit
    assert lib.calls.count("cuStreamBeginCapture_v2") == (2 if graph else 0)
    assert b.graph_steps == (2 if graph else 0)


def _fake_pdl(monkeypatch, fake):
    """A libcuda for graph.py and pdl.py whose cuLaunchKernelEx and cuFuncSetAttribute record
    their calls, and `fake`'s PdlLauncher on it (no modules to load). Returns the launches
    (LaunchConfig fields and the first attribute, a dict each) and the opt-ins ((attr, bytes))."""
    import ctypes

    from kestrel_tui.backends.cuda import graph as gr
    from kestrel_tui.backends.cuda import pdl
    from kestrel_tui.backends.cuda.runtime import MODULES

    launched, opted_in = [], []

    class _Lib(_FakeLibcuda):
        def __getattr__(self, name):
            if name == "cuLaunchKernelEx":
                def fn(cfg, f, params, extra):
                    c = ctypes.cast(cfg, ctypes.POINTER(pdl.LaunchConfig)).contents
                    a = c.attrs.contents
                    launched.append(dict(grid=c.gridDimX, block=c.blockDimX, n_attrs=c.numAttrs, attr=a.id,
                                         value=a.value[0], shared=c.sharedMemBytes))
                    return 0
                return fn
            if name == "cuFuncSetAttribute":
                def fn(f, attr, value):
                    opted_in.append((attr, value.value))
                    return 0
                return fn
            return super().__getattr__(name)

    lib = _Lib()
    monkeypatch.setattr(gr, "_cu", lambda: lib)
    launcher = object.__new__(pdl.PdlLauncher)  # a launcher without modules to load
    launcher.lib, launcher.signatures, launcher.names = lib, fake.formats, fake.kernel_names
    launcher.modules, launcher.functions, launcher.opted_in = {m: ctypes.c_void_p(1) for m in MODULES}, {}, {}
    launcher.attr = pdl.LaunchAttribute(id=pdl.LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    launcher.attr.value[0] = 1
    fake.pdl = launcher
    return launched, opted_in


def test_pdl_launch_structures_and_routing(monkeypatch):
    """The driver structures of cuLaunchKernelEx as laid out in cuda.h, and a capture with PDL:
    every kernel launched on the capturing stream goes through cuLaunchKernelEx with the
    programmatic-serialization attribute and its arguments packed per the kernels' formats; launches on
    other streams (the body hashes) stay PyCUDA's."""
    import ctypes

    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import graph as gr
    from kestrel_tui.backends.cuda import make_cuda_backend, pdl
    from kestrel_tui.model.weights import synthetic_model

    assert ctypes.sizeof(pdl.LaunchAttribute) == 72 and pdl.LaunchAttribute.value.offset == 8
    assert [getattr(pdl.LaunchConfig, f).offset for f in ("sharedMemBytes", "hStream", "attrs", "numAttrs")] == \
        [24, 32, 40, 48] and ctypes.sizeof(pdl.LaunchConfig) == 56

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    launched, _ = _fake_pdl(monkeypatch, fake)
    b = make_cuda_backend(synthetic_model(default_config().with_layers(2), "q4_0"))
    b.reset(8)
    before = sum(k.calls for k in fake.kernels.values())
    g = gr.DecodeGraph(b, hashing=True)
    pycuda_calls = sum(k.calls for k in fake.kernels.values()) - before
    assert g.pdl and launched and all(x["n_attrs"] == 1 and x["attr"] == 6 and x["value"] == 1 for x in launched)
    assert pycuda_calls == 1  # the body hash (fnv_scan) on its own stream
    monkeypatch.setenv("KESTREL_CUDA_PDL", "0")  # the pdl option off: the graph captures without
    off = make_cuda_backend(b.model)
    off.reset(8)
    off.step(np.array([5]), 0, raw=False)
    assert not off._graph.pdl and "no PDL" in off.graph_status


def test_exact_pv_spread_one_block_an_sm(monkeypatch):
    """attn_exact_pv_q8 takes half an SM's shared memory (unused) so no two of its blocks share an
    SM: opted in above 48 KB, on PyCUDA's launch and on the PDL launcher's (cuFuncSetAttribute,
    sharedMemBytes); no spread for the fast kernels, with the pv_spread option off, or where the
    runtime does not know its SMs' shared memory."""
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import graph as gr
    from kestrel_tui.backends.cuda import launches, make_cuda_backend, pdl
    from kestrel_tui.backends.toggles import TOGGLES
    from kestrel_tui.model.weights import synthetic_model
    from kestrel_tui.perf import cuda as perf

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    assert launches.pv_spread_bytes(fake) == 0  # nothing known: no spread
    fake.smem_per_sm = 233472  # an H200's
    assert launches.pv_spread_bytes(fake) == 116736
    assert launches.pv_spread_bytes(fake, enabled=False) == 0  # the pv_spread option off
    model = synthetic_model(default_config().with_layers(2), "q4_0")
    fast = make_cuda_backend(model)
    fast.reset(8)
    fast.step(np.array([5, 9]), 0, raw=False)
    assert fast.kernels.pv_spread == 0 and fake.kernels["attn_fast_part_q8"].shared_size == 0
    exact = make_cuda_backend(model, exact=frozenset(TOGGLES))
    exact.reset(8)
    exact.step(np.array([5, 9]), 0, raw=False)
    pv = fake.kernels["attn_exact_pv_q8"]
    assert exact.kernels.pv_spread == 116736 and pv.shared_size == 116736 and fake.cuda.optin["attn_exact_pv_q8"] == 116736
    pv.shared_size = None
    prof = perf.kernel_profile(model, frozenset(TOGGLES), ctx=4, reps=1)  # its timed launches pass it on
    assert prof["kernels"]["attn_exact_pv_q8"][0] == 2 and pv.shared_size == 116736

    launched, opted_in = _fake_pdl(monkeypatch, fake)
    gr.DecodeGraph(exact, hashing=True)
    assert [x["shared"] for x in launched if x["shared"]] == [116736] * 2  # one P·V a layer, nothing else
    assert opted_in == [(pdl.FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 116736)]


def test_graph_without_the_logits_event_when_refused(monkeypatch):
    """A driver that refuses the external event record: the graph is captured again without it
    (the host then waits for the whole replay), copies still inside; steps still work."""
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import graph as gr
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.model.weights import synthetic_model
    from kestrel_tui.trace.keys import token_keys

    class _NoEvent(_FakeLibcuda):
        def __getattr__(self, name):
            if name == "cuEventRecordWithFlags":
                return lambda *args: 801  # CUDA_ERROR_NOT_SUPPORTED
            return super().__getattr__(name)

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    lib = _NoEvent()
    monkeypatch.setattr(gr, "_cu", lambda: lib)
    b = make_cuda_backend(synthetic_model(default_config().with_layers(2), "q4_0"))
    b.reset(8)
    out = b.step(np.array([5]), 0, raw=False)
    g = b._graph
    assert g is not None and b.graph_steps == 1 and not g.logits_event and g.copies_in_graph
    assert lib.calls.count("cuStreamBeginCapture_v2") == 2 and list(out.hashes[0]) == token_keys(0, 2, False)


@pytest.mark.parametrize("fuse,weights", [(True, "q4_0"), (True, "f32"), (False, "q4_0")])
def test_fused_launch_wiring(monkeypatch, fuse, weights):
    """Outside isolate mode a q8-KV MoE step launches kernels/fused.cu's kernels and none of the ops
    they replace: heads_fused a layer; with q4_0 weights gate, up and silu are one launch
    (experts_swiglu, no silu_mul) and the down GEMV adds the expert sum (the combine fold), with
    f32 weights the expert sum goes with the next norm (combine_rmsnorm). Isolate mode, and the
    fuse option off (KESTREL_CUDA_FUSE=0), launch every op on its own."""
    from kestrel_tui.backends import cuda as cuda_pkg
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.model.weights import synthetic_model

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    monkeypatch.setenv("KESTREL_CUDA_FUSE", "1" if fuse else "0")
    n = 3
    model = synthetic_model(default_config().with_layers(n), weights)
    sub = cuda_pkg.make_cuda_backend(model, graph=False)
    assert sub.fuse is fuse
    ref = NumpyBackend(model)
    for b in (sub, ref):
        b.reset(8)

    def calls() -> dict[str, int]:
        return {name: k.calls for name, k in fake.kernels.items()}

    def launched(before: dict[str, int]) -> dict[str, int]:
        return {k: c - before.get(k, 0) for k, c in calls().items() if c - before.get(k, 0)}

    separate = {"qknorm_fast", "rope_fast", "kvquant_fast", "combine_fast", "quantize_q8_0_fast"}
    fused_only = {"heads_fused", "combine_rmsnorm_fast", "down_combine_fast", "experts_swiglu_fast"}
    c0 = calls()
    sub.step(np.array([5, 9, 11]), 0)
    plain = launched(c0)
    if fuse:
        comb = weights == "q4_0"
        experts = "gemv_q4_experts_fast" if comb else "gemv_f32_experts_fast"
        want = {"heads_fused": n, "gemv_q4_x3_fast": n if comb else 0, "down_combine_fast": n if comb else 0,
                "experts_swiglu_fast": n if comb else 0, "silu_mul_fast": 0 if comb else n,
                experts: 0 if comb else 2 * n, "combine_rmsnorm_fast": 0 if comb else n,
                # the final norm and each layer's post-attention norm, and its input norm where no
                # expert sum goes with it (layer 0, or every one with the combine fold)
                "rmsnorm_fast": 2 * n + 1 if comb else n + 1}
        assert {k: plain.get(k, 0) for k in want} == want, plain
        assert not separate & set(plain), plain
    else:
        assert not fused_only & set(plain), plain
        assert all(plain[k] == n for k in separate | {"silu_mul_fast"}), plain
        assert plain["gemv_q4_experts_fast"] == 2 * n, plain  # gate and up, then down
    c1 = calls()
    sub.step(np.array([7]), 3, feed=ref.step(np.array([7]), 3).raw)
    iso = launched(c1)
    assert not fused_only & set(iso), iso
    assert all(iso[k] == n for k in ("qknorm_fast", "rope_fast", "kvquant_fast", "combine_fast", "silu_mul_fast")), iso


@pytest.mark.parametrize("head_dim", range(16, 257, 16))
def test_every_accepted_head_dim_launches_whole_warps_inside_allocations(monkeypatch, head_dim):
    """The backend takes any head_dim that is a multiple of 16 up to 256 (split or single-kernel
    attention, fused or separate heads); past one 256-position exact-attention tile, fast and
    exact, every launch stays inside live allocations with whole-warp blocks (the fake driver
    checks both)."""
    from dataclasses import replace

    from kestrel_tui.backends import cuda as cuda_pkg
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.toggles import TOGGLES
    from kestrel_tui.model.weights import synthetic_model

    for exact in (frozenset(), frozenset(TOGGLES)):
        # a model of its own each time: its device weights are cached by the model, and another
        # fake driver's addresses would only match this one's by chance
        model = synthetic_model(replace(default_config().with_layers(1), head_dim=head_dim), "q4_0")
        fake = _FakeRuntime()
        monkeypatch.setattr(be, "runtime", lambda fake=fake: fake)
        sub = cuda_pkg.make_cuda_backend(model, graph=False, exact=exact)
        sub.reset(264)
        sub.step(np.arange(260) % 50 + 1, 0)
        sub.step(np.array([3]), 260)
        assert any(k.calls for n, k in fake.kernels.items() if n.startswith("attn_")), head_dim


@pytest.mark.parametrize("head_dim,fused", [(64, True), (80, False), (128, True), (256, True), (192, False)])
def test_heads_fused_only_where_a_lane_holds_its_rope_pairs(monkeypatch, head_dim, fused):
    """heads_fused pairs register i with i + hd/64 (rope_regs<1|2|4>): other head_dims take the
    separate kernels."""
    from dataclasses import replace

    from kestrel_tui.backends import cuda as cuda_pkg
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.model.weights import synthetic_model

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    model = synthetic_model(replace(default_config().with_layers(1), head_dim=head_dim), "q4_0")
    sub = cuda_pkg.make_cuda_backend(model, graph=False)
    sub.reset(4)
    sub.step(np.array([1, 2]), 0)
    used = {n for n, k in fake.kernels.items() if k.calls}
    assert ("heads_fused" in used) is fused, used
    assert ("rope_fast" in used) is not fused, used


# ------------------------------------------------------------ dense MLP layers inside a qwen3_moe model

# transformers' two ways to make a qwen3_moe layer dense (model/config.py Config.layer_is_moe), on 4
# layers: dense, MoE, dense, MoE (a MoE layer's expert sum goes on into a dense layer, and a dense
# layer's output into a MoE one); MoE, dense, MoE, MoE (the last layer's sum goes to the final norm).
# intermediate_size 320 is wider than the k = 4 slots of 64 of an expert layer: the scratch follows it.
MIXED = {"sparse-step-2": dict(decoder_sparse_step=2), "mlp-only-1": dict(mlp_only_layers=(1,))}
MIXED_KINDS = {"sparse-step-2": [False, True, False, True], "mlp-only-1": [True, False, True, True]}


def _mixed_config(style: str):
    from dataclasses import replace

    cfg = replace(default_config().with_layers(4), intermediate=320, **MIXED[style])
    assert [cfg.layer_is_moe(li) for li in range(4)] == MIXED_KINDS[style]
    return cfg


@pytest.mark.parametrize("style", MIXED)
@pytest.mark.parametrize("weights,kv,deep", [("q4_0", "q8", False), ("q4_0", "q8", True), ("f32", "f32", True)])
def test_mixed_model_step_returns_the_references_keys(monkeypatch, style, weights, kv, deep):
    """The cuda subject takes a qwen3_moe model with dense layers (cuda_unsupported says nothing),
    and a prefill, a decode step and an isolate step return the cpu reference's keys, shapes and
    dtypes — with --deep, a dense layer's empty router/topk/topw and its MLP output as moe —,
    every launch inside live allocations with the kernels' argument formats."""
    from kestrel_tui.backends import cuda as cuda_pkg
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.model.config import cuda_unsupported
    from kestrel_tui.model.weights import synthetic_model
    from kestrel_tui.trace.keys import token_keys

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    cfg = _mixed_config(style)
    assert cuda_unsupported(cfg) is None
    model = synthetic_model(cfg, weights)
    sub = cuda_pkg.make_cuda_backend(model, kv=kv, deep=deep, graph=False)
    ref = NumpyBackend(model, kv=kv, deep=deep)
    for b in (sub, ref):
        b.reset(8)
    outs = [(ref.step(np.array([5, 9, 11]), 0), sub.step(np.array([5, 9, 11]), 0)),
            (ref.step(np.array([7]), 3), sub.step(np.array([7]), 3))]
    r_iso = ref.step(np.array([8]), 4)
    outs.append((r_iso, sub.step(np.array([8]), 4, feed=r_iso.raw)))
    for r_out, s_out in outs:
        for r_col, s_col in zip(r_out.raw, s_out.raw, strict=True):
            assert list(s_col) == list(r_col)
            for key in r_col:
                assert (s_col[key].shape, s_col[key].dtype) == (r_col[key].shape, r_col[key].dtype), key
    assert list(outs[-1][1].hashes[0]) == token_keys(4, 4, deep)
    if deep:  # a dense layer's router buffers are empty on both sides: the arena holds nothing for them
        lay = sub._layout(1)
        for li, moe in enumerate(MIXED_KINDS[style]):
            for f, n in (("router", cfg.n_experts), ("topk", cfg.top_k), ("topw", cfg.top_k)):
                assert outs[1][0].raw[0][f"t3_l{li}_{f}"].shape == (n if moe else 0,)
                assert lay.regions[f, li].col_bytes == (4 * n if moe else 0)


def _args(item, *names):
    """Named arguments of a GEMV / router / combine launch (the kernels' parameter order)."""
    n = item.kernel.name
    if n.startswith("gemv_q4_x3") or n.startswith("gemv_q4_experts") or n.startswith("gemv_f32_experts"):
        raise AssertionError(n)
    order = {"gemv_q4": ("w", "d", "x_q", "x_d", "res", "y", "out", "nb", "M"),
             "gemv_f32": ("w", "x", "res", "y", "out", "inp", "M"),
             "router": ("logits", "topk", "topw", "E", "k", "norm", "exact"),
             "combine_rmsnorm": ("y", "topw", "ores", "moe", "x", "k", "moe_exact", "w", "out"),
             "down_combine": ("w", "d", "y", "topk", "aq", "ad", "n", "nb", "k", "topw", "ores", "moe", "x"),
             "experts_swiglu": ("wg", "dg", "wu", "du", "topk", "xq", "xd", "x_div", "out", "nb", "a", "aq", "ad"),
             "silu_mul": ("g", "u", "a", "aq", "ad", "n"),
             "combine": ("y", "topw", "res", "moe", "x", "n", "k")}
    prefix = max((p for p in order if n.startswith(p + "_")), key=len)
    named = dict(zip(order[prefix], item.args))
    return tuple(named[k] for k in names)


@pytest.mark.parametrize("style", MIXED)
@pytest.mark.parametrize("weights,fuse,deep", [("q4_0", True, False), ("q4_0", True, True), ("f32", True, False),
                                               ("q4_0", False, False), ("f32", False, True)])
def test_mixed_model_launch_plan(monkeypatch, style, weights, fuse, deep):
    """plan.py decides per layer: a dense layer launches the dense GEMVs — gate_proj and up_proj of
    intermediate_size rows, down_proj into x with the residual (and, with --deep, once more
    into moe without it) — and no router, expert or combine launch; a MoE layer its router, its
    experts and its expert sum: gate, up and silu in one launch that writes the q8_0 of silu's
    output for the down GEMV (experts_swiglu, fused q4_0), else the expert GEMVs and silu_mul.
    Each expert sum goes where the next layer's input norm or the final norm reads it, whatever
    kind of layer comes next: folded into the down GEMV (q4_0), with the next norm
    (combine_rmsnorm, f32) or on its own (the fuse option off)."""
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.cuda.launches import Launch, Target
    from kestrel_tui.backends.cuda.options import CudaOptions
    from kestrel_tui.backends.cuda.plan import plan
    from kestrel_tui.model.weights import synthetic_model

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    cfg = _mixed_config(style)
    b = make_cuda_backend(synthetic_model(cfg, weights), deep=deep, graph=False, options=CudaOptions(fuse=fuse))
    b.reset(8)
    lay, base = b._layout(2), 1 << 40
    items = [it for it in plan(b, lay, Target(None, base, tokens=1, scores=2), 0) if isinstance(it, Launch)]

    def A(name, li=None):
        return base + lay.offset(name, li)

    def kind(it):
        return it.kernel.name.rsplit("_", 1)[0]  # the fast/exact suffix off

    def using(w):  # the launches that read weight matrix w
        return [it for it in items if w.w in it.args]

    gemv = "gemv_q4" if weights == "q4_0" else "gemv_f32"
    swiglu = fuse and weights == "q4_0"
    moe_layers = [li for li, m in enumerate(MIXED_KINDS[style]) if m]
    silus = iter(it for it in items if kind(it) == "silu_mul")
    for li, moe in enumerate(MIXED_KINDS[style]):
        W = b.dm.layers[li]
        if not moe:
            assert W["gate"] is None
            for name in ("gate_proj", "up_proj"):
                (it,) = using(W[name])
                assert kind(it) == gemv and _args(it, "out") == (cfg.intermediate,), (li, name, it.kernel.name)
            downs = using(W["down_proj"])
            assert [kind(it) for it in downs] == [gemv] * (1 + deep)
            assert [_args(it, "out", "res", "y") for it in downs] == \
                [(cfg.hidden, 0, A("moe", li))] * deep + [(cfg.hidden, A("ores", li), A("x", li))]
            assert _args(next(silus), "n") == (2 * cfg.intermediate,)  # M = 2
        else:
            (r,) = using(W["gate"])
            assert kind(r) == gemv and _args(r, "out", "y") == (cfg.n_experts, A("router", li))
            (gu,) = using(W["gate_proj"])
            assert using(W["up_proj"]) == [gu]
            if swiglu:  # the down GEMV reads the q8_0 it writes; g and u stay inside
                assert kind(gu) == "experts_swiglu"
                assert _args(gu, "topk", "out", "a", "aq", "ad") == \
                    (A("topk", li), cfg.moe_intermediate, A("a"), A("aq"), A("ad"))
                assert gu.grid == (cfg.moe_intermediate // 32, 2 * cfg.top_k, 1)
            else:
                assert kind(gu) == gemv + "_experts"
                assert _args(next(silus), "n") == (2 * cfg.top_k * cfg.moe_intermediate,)
    assert next(silus, None) is None  # no silu_mul but the ones above
    routed = [_args(it, "topk", "topw") for it in items if kind(it) == "router"]
    assert routed == [(A("topk", li), A("topw", li)) for li in moe_layers]
    sums = {k: [it for it in items if kind(it) == k] for k in ("down_combine", "combine_rmsnorm", "combine")}
    if fuse and weights == "q4_0":
        assert [_args(it, "topw", "ores", "moe", "x") for it in sums["down_combine"]] == \
            [(A("topw", li), A("ores", li), A("moe", li), A("x", li)) for li in moe_layers]
        assert not sums["combine_rmsnorm"] and not sums["combine"]
    elif fuse:  # the next norm (a layer's input norm, or the final one) adds the sum in
        nxt = [A("nrm", li + 1) if li + 1 < cfg.n_layers else A("fnrm") for li in moe_layers]
        assert [_args(it, "topw", "x", "out") for it in sums["combine_rmsnorm"]] == \
            [(A("topw", li), A("x", li), out) for li, out in zip(moe_layers, nxt)]
        assert not sums["down_combine"] and not sums["combine"]
    else:
        assert [_args(it, "topw", "x") for it in sums["combine"]] == [(A("topw", li), A("x", li)) for li in moe_layers]
        assert not sums["down_combine"] and not sums["combine_rmsnorm"]
    # every layer's attention reads the previous layer's x, whoever wrote it
    for li in range(1, cfg.n_layers):
        (o,) = using(b.dm.layers[li]["o_proj"])
        assert _args(o, "res") == (A("x", li - 1),)


def test_mixed_device_synthetic_model_matches_its_host_twin(monkeypatch):
    """The device generator and its host twin (model/device_synthetic.py) make a mixed model's
    matrices in the same order, with the same seeds and shapes: a dense layer's MLP of
    intermediate_size where the config says, no router; its step runs on the fake device."""
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
    from kestrel_tui.model import device_synthetic as twin

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    device_calls, host_calls = [], []
    gen = fake.kernel("gemv", "gen_q4")
    real_call = gen.prepared_call

    def record(grid, block, w, d, n, seed, dscale, **kw):
        device_calls.append((n, seed, np.float32(dscale)))
        return real_call(grid, block, w, d, n, seed, dscale, **kw)

    monkeypatch.setattr(gen, "prepared_call", record)
    real_blocks = twin.gen_q4_blocks

    def blocks(n, seed, dscale, start=0, count=None):
        if start == 0:
            host_calls.append((n, seed, np.float32(dscale)))
        return real_blocks(n, seed, dscale, start=start, count=count)

    monkeypatch.setattr(twin, "gen_q4_blocks", blocks)
    cfg = _mixed_config("mlp-only-1")
    dev = DeviceSyntheticModel(cfg, seed=2)
    b = make_cuda_backend(dev, graph=False)
    host = twin.device_synthetic_model(cfg, seed=2)
    assert device_calls == host_calls and len(device_calls) == 2 + 8 * 3 + 7
    for li, (dl, hl) in enumerate(zip(b.dm.layers, host.layers, strict=True)):
        assert (dl["gate"] is None) is (hl.gate is None) is (not cfg.layer_is_moe(li))
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin, want = dl[name], getattr(hl, name)
            assert (lin.experts, lin.out, lin.inp) == ((want.blocks.shape[0] if want.blocks.ndim == 4 else 0),
                                                       want.out, want.inp), (li, name)
        assert dl["gate_proj"].out == cfg.layer_ffn_dim(li)
    b.reset(4)
    assert b.step(np.array([1, 2]), 0, raw=False).logits.shape == (2, cfg.vocab)


def test_dense_model_deep_keys(monkeypatch):
    """--deep on a dense qwen3 model (every layer dense): the reference's 17 fields a layer, the
    MLP output as moe and empty router buffers, as for a dense layer inside a MoE model."""
    from kestrel_tui.backends.base import NumpyBackend
    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.model.config import Config
    from kestrel_tui.model.weights import synthetic_model
    from kestrel_tui.trace.keys import token_keys

    fake = _FakeRuntime()
    monkeypatch.setattr(be, "runtime", lambda: fake)
    cfg = Config(arch="qwen3", n_layers=2, hidden=256, n_heads=8, n_kv_heads=2, head_dim=64, vocab=2048,
                 rope_theta=1e6, eps=1e-6, tie_embeddings=False, max_positions=64, intermediate=320)
    model = synthetic_model(cfg, "q4_0")
    sub, ref = make_cuda_backend(model, deep=True, graph=False), NumpyBackend(model, deep=True)
    for b in (sub, ref):
        b.reset(8)
    r_out, s_out = ref.step(np.array([5, 9]), 0), sub.step(np.array([5, 9]), 0)
    for r_col, s_col in zip(r_out.raw, s_out.raw, strict=True):
        assert list(s_col) == list(r_col)
        for key in r_col:
            assert (s_col[key].shape, s_col[key].dtype) == (r_col[key].shape, r_col[key].dtype), key
    assert list(s_out.hashes[1]) == token_keys(1, 2, True)
    assert fake.kernels["router_fast"].calls == 0


@pytest.mark.parametrize("n_experts", [128, 992])
def test_exact_router_has_a_warp_for_its_ordered_sum(monkeypatch, n_experts):
    """The exact router's block holds one warp more than its experts (moe.cuh: it forms S while
    the others rank); up to MOE_MAX_EXPERTS (launch.cuh) that stays a block of at most 1024."""
    from dataclasses import replace

    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.toggles import TOGGLES
    from kestrel_tui.model.weights import synthetic_model

    for exact, name, extra in ((frozenset(), "router_fast", 0), (frozenset(TOGGLES), "router_exact", 32)):
        # a model of its own each time: its device weights are cached by the model
        model = synthetic_model(replace(default_config().with_layers(1), n_experts=n_experts), "q4_0")
        fake = _FakeRuntime()
        monkeypatch.setattr(be, "runtime", lambda fake=fake: fake)
        sub = make_cuda_backend(model, graph=False, exact=exact)
        sub.reset(4)
        sub.step(np.array([1, 2]), 0)
        assert fake.kernels[name].block == ((n_experts + 31) // 32 * 32 + extra, 1, 1)


@pytest.mark.parametrize("what", ["experts", "top_k", "attention_bias"])
def test_unsupported_model_refused_in_one_line(monkeypatch, what):
    """The router beyond its block, or a feature the kernels lack: refused before any device work, so a
    long reference run does not end in the refusal, and by the backend made directly, with one line."""
    from dataclasses import replace

    from kestrel_tui.backends.cuda import backend as be
    from kestrel_tui.backends.cuda import make_cuda_backend
    from kestrel_tui.backends.cuda.launches import MAX_EXPERTS, MAX_TOPK
    from kestrel_tui.engines.decoders import check_decoder
    from kestrel_tui.errors import UsageError
    from kestrel_tui.model.weights import synthetic_model

    monkeypatch.setattr(be, "runtime", lambda: _FakeRuntime())
    if what == "experts":
        cfg, said = replace(default_config().with_layers(1), n_experts=MAX_EXPERTS + 1), (
            rf"{MAX_EXPERTS + 1} experts are not supported \(at most {MAX_EXPERTS}\)")
    elif what == "top_k":
        cfg, said = replace(default_config().with_layers(1), n_experts=128, top_k=MAX_TOPK + 1), (
            rf"top_k {MAX_TOPK + 1} is not supported \(at most {MAX_TOPK}\)")
    else:
        cfg, said = replace(default_config().with_layers(1), attention_bias=True), (
            r"attention_bias \(q/k/v/o projection biases\) is not implemented")
    model = synthetic_model(cfg, "q4_0")
    refusal = rf"^cuda subject: {said}; the sim subject is the fallback \(--subject sim\)$"
    with pytest.raises(UsageError, match=refusal):  # when the engine table builds the engine
        check_decoder("cuda", model)
    with pytest.raises(UsageError, match=refusal):  # and by the backend made directly
        make_cuda_backend(model, graph=False)
