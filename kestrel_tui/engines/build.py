"""Backends by name: cpu (the reference: compiled, or numpy), sim (GPU-order emulation), cuda (PyCUDA)."""
from __future__ import annotations

from ..backends.base import Backend, NumpyBackend
from ..backends.toggles import describe, parse_exact
from ..errors import UsageError
from ..model.config import cuda_unsupported
from ..model.weights import Model

BACKENDS = ("cpu", "sim", "cuda")


REFERENCE_IMPLS = ("auto", "compiled", "numpy")


def reference_impl(impl: str = "auto") -> tuple[str, str | None]:
    """Which implementation of the contract decodes the cpu reference: ("compiled" | "numpy", why the
    compiled one is not used, or None). auto takes the compiled reference wherever it is built."""
    if impl not in REFERENCE_IMPLS:
        raise UsageError(f"--reference {impl}: choose from {', '.join(REFERENCE_IMPLS)}")
    if impl == "numpy":
        return "numpy", None
    from ..cref import Unavailable, load

    try:
        load()
    except Unavailable as e:
        if impl == "compiled":
            raise UsageError(f"--reference compiled: {e}") from None
        return "numpy", f"the reference runs on numpy: {e}"
    return "compiled", None


def make_backend(name: str, model: Model, kv: str = "q8", exact: str | frozenset = "all",
                 deep: bool = False, impl: str = "auto") -> Backend:
    toggles = parse_exact(exact) if isinstance(exact, str) else frozenset(exact)
    if name == "cpu":
        if reference_impl(impl)[0] == "compiled":
            from ..cref.backend import CompiledBackend

            return CompiledBackend(model, kv=kv, deep=deep)
        return NumpyBackend(model, kv=kv, name="cpu", deep=deep)
    if name == "sim":
        from ..backends.ops_fast import sim_ops

        return NumpyBackend(model, kv=kv, ops=sim_ops(toggles), name=f"sim ({describe(toggles)})", deep=deep)
    if name == "cuda":
        problem = cuda_unsupported(model.cfg)
        if problem:  # refused before any device work: the kernels would silently decode another model
            raise UsageError(f"cuda subject: {problem}; the sim subject is the fallback (--subject sim)")
        from ..backends.cuda import make_cuda_backend

        return make_cuda_backend(model, kv=kv, exact=toggles, deep=deep)
    raise UsageError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")


ENGINES = (*BACKENDS, "hf", "process", "llama.cpp")


def make_engine(spec, model: Model | None, kv: str = "q8", deep: bool = False, impl: str = "auto"):
    """An EngineSpec -> an Engine. ``model`` is the loaded model of spec.model (the built-ins decode it;
    hf and process read their own files and use it only for its shape). ``impl``: the cpu engine's
    implementation of the contract (reference_impl)."""
    from .base import EngineSpec

    spec = spec if isinstance(spec, EngineSpec) else EngineSpec(str(spec))
    if spec.engine in BACKENDS:
        from .builtin import BuiltinEngine

        if spec.options:
            raise UsageError(f"engine {spec.engine}: takes no options (got {', '.join(map(str, spec.options))});"
                             f" its toggles are the op families")
        if spec.engine == "cuda":
            problem = cuda_unsupported(model.cfg)
            if problem:
                raise UsageError(f"cuda subject: {problem}; the sim subject is the fallback (--subject sim)")
        return BuiltinEngine(spec.engine, model, kv=kv, deep=deep, impl=impl)
    if spec.engine == "hf":
        from .hf import make_hf_engine

        return make_hf_engine(spec, model, kv=kv, deep=deep)
    if spec.engine == "process":
        from .process import make_process_engine

        return make_process_engine(spec, model, kv=kv, deep=deep)
    if spec.engine == "llama.cpp":  # in a child process: a llama.cpp crash must not take the app down
        from dataclasses import replace

        from .child import Job, OutOfProcess
        from .llamacpp import make_llamacpp_engine

        inner = make_llamacpp_engine(spec, model, kv=kv, deep=deep, load=False)
        return OutOfProcess(inner, Job("llama_cpp", "kestrel_tui.engines.llamacpp:make_llamacpp_engine",
                                       replace(spec, model=inner.path), inner.ours.cfg, kv, deep))
    raise UsageError(f"unknown engine {spec.engine!r}; choose from {', '.join(ENGINES)}")
