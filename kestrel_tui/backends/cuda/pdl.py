"""Programmatic dependent launch (PDL) for the kernels of a captured decode graph.

At M = 1 a decode step is ~16 small kernels a layer, and in a CUDA graph part of
each one's time is the gap between the end of one kernel and the start of the
next. With PDL (sm_90+) a kernel is launched with the attribute
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so it may be scheduled
once every block of the kernel before it has exited (or, built with the trigger,
options.pdl_trigger, once each has passed its own wait), ahead of that grid's
teardown; every kernel begins with kernels/common.cuh pdl_wait()
(griddepcontrol.wait), which holds it until its predecessors have finished and
their writes are visible. Nothing a step writes is read or written before that
wait (the dense GEMVs load their first weights ahead of it), so the kernels
compute exactly what they compute without PDL (tests/test_cuda.py compares
graph steps with direct launches bit for bit). A launch with dynamic shared
memory (the exact P·V kernel's, launches.pv_spread_bytes) opts this module's
copy of the kernel in with cuFuncSetAttribute first.

PyCUDA 2026.1 launches through cuLaunchKernel only, so this module loads the
same compiled code (pycuda.compiler.compile: the cubin SourceModule built, from
PyCUDA's cache) into a second module with ctypes and launches from it with
cuLaunchKernelEx. It is used only while a DecodeGraph captures, for the launches on
the graph's main stream (launches.run is handed the launcher); direct launches keep
PyCUDA's path.
The `pdl` option (options.py) turns it off.
"""
from __future__ import annotations

import ctypes

LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_ARG = {"P": ctypes.c_uint64, "i": ctypes.c_int32, "f": ctypes.c_float}


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (CUresult {rc})")


class PdlLauncher:
    """The runtime's kernels, loaded again through the driver API and launched with PDL.
    Create and use it with the runtime's context current."""

    def __init__(self, rt, lib=None):
        from pycuda.compiler import compile as nvcc_compile

        from .runtime import MODULES, NVCC_OPTIONS, module_source

        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        for name in ("cuModuleLoadData", "cuModuleGetFunction", "cuModuleUnload", "cuLaunchKernelEx",
                     "cuFuncSetAttribute"):
            getattr(self.lib, name).restype = ctypes.c_int
        self.signatures = rt.formats
        self.modules: dict[str, ctypes.c_void_p] = {}
        self.functions: dict[str, ctypes.c_void_p] = {}
        self.opted_in: dict[str, int] = {}  # kernel -> the dynamic shared memory it may take
        self.names = rt.kernel_names  # id(PyCUDA Function) -> (module, kernel name)
        self.attr = LaunchAttribute(id=LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value[0] = 1  # programmaticStreamSerializationAllowed
        try:
            for mod in MODULES:
                cubin = nvcc_compile(module_source(mod), options=NVCC_OPTIONS, arch=rt.arch, no_extern_c=True)
                handle = ctypes.c_void_p()
                _check(self.lib.cuModuleLoadData(ctypes.byref(handle), ctypes.c_char_p(cubin)), "cuModuleLoadData")
                self.modules[mod] = handle
        except BaseException:
            self.close()
            raise

    def _function(self, module: str, name: str) -> ctypes.c_void_p:
        fn = self.functions.get(name)
        if fn is None:
            fn = ctypes.c_void_p()
            _check(self.lib.cuModuleGetFunction(ctypes.byref(fn), self.modules[module], name.encode()),
                   f"cuModuleGetFunction({name})")
            self.functions[name] = fn
        return fn

    def launch(self, k, grid, block, stream_handle: int, args, shared: int = 0) -> None:
        module, name = self.names[id(k)]
        fmt = self.signatures[name]
        if len(args) != len(fmt):
            raise ValueError(f"{name}: {len(args)} arguments for the format {fmt}")
        values = [_ARG[c](int(a) if c != "f" else float(a)) for c, a in zip(fmt, args)]
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        fn = self._function(module, name)
        if shared and self.opted_in.get(name, 0) < shared:  # past 48 KB less its static memory: opt in
            _check(self.lib.cuFuncSetAttribute(fn, FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(shared)),
                   f"cuFuncSetAttribute({name})")
            self.opted_in[name] = shared
        cfg = LaunchConfig(*(int(g) for g in grid), *(int(b) for b in block), shared, ctypes.c_void_p(stream_handle),
                           ctypes.pointer(self.attr), 1)
        _check(self.lib.cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None),
               f"cuLaunchKernelEx({name})")

    def close(self) -> None:
        """Unload the modules: only once no captured graph holds their functions (the runtime
        keeps its launcher for the life of the process)."""
        for handle in self.modules.values():
            self.lib.cuModuleUnload(handle)
        self.modules, self.functions, self.opted_in = {}, {}, {}


def launcher_for(rt) -> PdlLauncher | None:
    """The runtime's launcher, made once; None below sm_90, or when it failed to set up
    (rt.pdl_error says why). With the context current."""
    if int(rt.arch.removeprefix("sm_")) < 90:
        return None
    if rt.pdl is None and rt.pdl_error is None:
        try:
            rt.pdl = PdlLauncher(rt)
        except Exception as e:  # no cuLaunchKernelEx, a module that does not load: no PDL
            rt.pdl_error = f"{type(e).__name__}: {e}"
    return rt.pdl


def stream_handle(stream) -> int:
    """The CUstream of a PyCUDA Stream (its `handle` property; `handle_int` in some builds)."""
    h = getattr(stream, "handle", None)
    if h is None:
        h = stream.handle_int
    return int(h() if callable(h) else h)
