"""PyCUDA setup: the device, its primary context, and the compiled kernel modules.

One `Runtime` per process (`runtime()`), created on first use. Every public
entry of the backend runs inside `rt.active()`, which makes the device's
primary context current on the calling thread — the app drives backends from
worker threads, and a CUDA context is per thread.

Each kernels/*.cu file is one module, compiled once with nvcc through PyCUDA
(`-fmad=false`, the device's own sm_XY). The kernels/*.cuh headers are pasted
into the source instead of included, so PyCUDA's compile cache keys on
everything the module uses. Anything missing — PyCUDA, a driver, a device, nvcc, or a kernel that
does not compile — raises UsageError with one line ending in the fallback.
"""
from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ...errors import UsageError



def _kernel_dir() -> Path:
    """The .cu sources, read by path: an installed wheel carries them as kestrel_tui/kernels/ (setup.py
    copies the top-level kernels/ folder there); a checkout or an editable install reads kernels/ at the
    root. kernels/ is a plain data folder, not a package, so it shadows no `kernels` module (Hugging
    Face's, which transformers imports, among them)."""
    installed = Path(__file__).resolve().parents[2] / "kernels"
    if (installed / "common.cuh").is_file():
        return installed
    return Path(__file__).resolve().parents[3] / "kernels"


KERNEL_DIR = _kernel_dir()
MODULES = ("gemv", "norm", "rope", "kvquant", "attention", "moe", "fused", "hash", "transcend")


def nvcc_options() -> list[str]:
    """The kernels' nvcc options: no FMA contraction; wait-only PDL unless built with the trigger
    (options.pdl_trigger: each kernel triggers its successor early, kernels/common.cuh pdl_wait)."""
    from .options import pdl_trigger

    return ["-fmad=false", "-std=c++17"] + (["-DKESTREL_PDL_TRIGGER"] if pdl_trigger() else [])


NVCC_OPTIONS = nvcc_options()
FALLBACK = "the sim subject is the fallback (--subject sim)"


class CudaUnavailable(UsageError):
    """No usable GPU; ``reason`` alone lets a caller with another fallback (bench) word its own line."""

    def __init__(self, reason: str):
        super().__init__(f"cuda subject: {reason}; {FALLBACK}")
        self.reason = reason

# a kernel parameter's PTX type -> its PyCUDA argument format (P: pointer, i: int, f: float)
PTX_FORMATS = {".u64": "P", ".u32": "i", ".s32": "i", ".f32": "f"}


def ptx_formats(ptx: str) -> dict[str, str]:
    """Every kernel's argument format, read from its compiled .entry: the .cu parameter lists are
    the one place the formats are written."""
    return {m[1]: "".join(PTX_FORMATS[t] for t in re.findall(r"\.param\s+(\.\w+)", m[2]))
            for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx)}


def compile_ptx(source: str, arch: str) -> str:
    """The PTX of a module's source: through PyCUDA (its compile cache) where it is installed, else
    nvcc itself (the tests' fake driver)."""
    try:
        from pycuda.compiler import compile as nvcc_compile
    except ImportError:
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "m.cu", Path(tmp) / "m.ptx"
            src.write_text(source)
            proc = subprocess.run(["nvcc", f"-arch={arch}", *NVCC_OPTIONS, "--ptx", "-o", str(out), str(src)],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"nvcc --ptx failed: {proc.stderr.strip()[:300]}")
            return out.read_text()
    return nvcc_compile(source, options=NVCC_OPTIONS, arch=arch, no_extern_c=True, target="ptx").decode()


def kernel_formats(arch: str) -> dict[str, str]:
    """Every kernel of every module: its PyCUDA argument format."""
    formats: dict[str, str] = {}
    for name in MODULES:
        formats.update(ptx_formats(compile_ptx(module_source(name), arch)))
    return formats


_lock = threading.Lock()
_runtime: "Runtime | None" = None


def module_source(name: str, text: str | None = None, kernel_dir: Path = KERNEL_DIR) -> str:
    """The .cu text (kernels/<name>.cu, or `text` in its place) with its kernels/*.cuh and *.h headers
    inlined, each once (what PyCUDA compiles and caches on). kernel_dir: where the headers are read
    (another tree's kernels/, for the GPU scripts that compare versions)."""
    seen: set[str] = set()

    def inline(text: str) -> str:
        def header(m: re.Match) -> str:
            if m.group(1) in seen:
                return ""
            seen.add(m.group(1))
            return inline((kernel_dir / m.group(1)).read_text().replace("#pragma once\n", ""))
        return re.sub(r'#include "([\w.]+\.(?:cuh|h))"\n?', header, text)

    return inline(text if text is not None else (kernel_dir / f"{name}.cu").read_text())


class Runtime:
    def __init__(self) -> None:
        try:
            import pycuda.driver as cuda
            from pycuda.compiler import SourceModule
        except ImportError as e:
            raise CudaUnavailable(f"PyCUDA is not installed ({e}; pip install 'kestrel-tui[cuda]')") from None
        self.cuda = cuda
        try:
            cuda.init()
            count = cuda.Device.count()
        except Exception as e:  # pycuda.driver.Error, or a missing libcuda
            raise CudaUnavailable(f"no usable CUDA driver ({str(e).strip() or type(e).__name__})") from None
        if count == 0:
            raise CudaUnavailable("no CUDA device found")
        if shutil.which("nvcc") is None:
            raise CudaUnavailable("nvcc is not on PATH (the kernels are compiled at start)")
        self.device = cuda.Device(0)
        major, minor = self.device.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.name = self.device.name()
        self.ctx = self.device.retain_primary_context()
        self.smem_per_sm = self.device.get_attribute(cuda.device_attribute.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
        self._graveyard: list = []
        self._grave_lock = threading.Lock()
        self.modules = {}
        with self.active():
            for name in MODULES:
                try:
                    self.modules[name] = SourceModule(module_source(name), options=NVCC_OPTIONS, arch=self.arch,
                                                      no_extern_c=True)
                except Exception as e:  # CompileError, or nvcc failing to start
                    first = next((ln.strip() for ln in str(e).splitlines() if "error" in ln), str(e).strip())
                    raise CudaUnavailable(f"kernels/{name}.cu failed to compile for {self.arch}"
                                          f" ({first[:200]})") from None
            self.formats = kernel_formats(self.arch)  # PyCUDA's launch formats, from the PTX
        self._prepared: dict[tuple[str, str], object] = {}
        self.kernel_names: dict[int, tuple[str, str]] = {}  # id(prepared kernel) -> (module, name)
        self.pdl = None  # pdl.PdlLauncher, made by the first graph capture that asks for it
        self.pdl_error: str | None = None

    @contextlib.contextmanager
    def active(self):
        self.ctx.push()
        try:
            if self._graveyard:
                with self._grave_lock:
                    dead, self._graveyard = self._graveyard, []
                del dead  # freed here, with the context current
            yield self
        finally:
            self.cuda.Context.pop()

    def bury(self, objects) -> None:
        """Keep device objects of a dropped backend until the context is current again.
        The app drops backends in whichever thread held the last reference, where the
        context is not current and PyCUDA could not free them."""
        with self._grave_lock:
            self._graveyard.extend(o for o in objects if o is not None)

    def kernel(self, module: str, name: str):
        """A prepared kernel: call as k.prepared_call(grid, block, *args) (ints for pointers)."""
        key = (module, name)
        fn = self._prepared.get(key)
        if fn is None:
            fn = self.modules[module].get_function(name)
            fn.prepare(self.formats[name])
            self._prepared[key] = fn
            self.kernel_names[id(fn)] = key
        return fn


def runtime() -> Runtime:
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime
