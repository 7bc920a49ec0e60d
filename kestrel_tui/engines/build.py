"""Engines by name: the built-in backends (backends/select.py) and the foreign engines."""
from __future__ import annotations

from ..backends.select import BACKENDS, REFERENCE_IMPLS, make_backend, reference_impl  # noqa: F401 (re-exported)
from ..errors import UsageError
from ..model.config import cuda_unsupported
from ..model.weights import Model

ENGINES = (*BACKENDS, "hf", "process", "llama.cpp")


def make_engine(spec, model: Model | None, kv: str = "q8", deep: bool = False, impl: str = "auto"):
    """An EngineSpec -> an Engine. ``model`` is the loaded model of spec.model (the built-ins decode it;
    hf and process read their own files and use it only for its shape). ``impl``: the cpu engine's
    implementation of the contract (reference_impl)."""
    from .base import EngineSpec

    spec = spec if isinstance(spec, EngineSpec) else EngineSpec(str(spec))
    if spec.engine in BACKENDS:
        from .builtin import BuiltinEngine

        cuda_options = None
        if spec.engine == "cuda":  # its runtime switches are options (backends/cuda/options.py)
            from ..backends.cuda.options import CudaOptions

            cuda_options = CudaOptions.from_env().set(dict(spec.options))
            problem = cuda_unsupported(model.cfg)
            if problem:
                raise UsageError(f"cuda subject: {problem}; the sim subject is the fallback (--subject sim)")
        elif spec.options:
            raise UsageError(f"engine {spec.engine}: takes no options (got {', '.join(map(str, spec.options))});"
                             f" its toggles are the op families")
        return BuiltinEngine(spec.engine, model, kv=kv, deep=deep, impl=impl, cuda_options=cuda_options)
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
