"""The built-in backends by name: cpu (the reference: compiled, or numpy), sim (GPU-style fast
variants on the CPU), cuda (PyCUDA). engines/build.py builds engines around them."""
from __future__ import annotations

from ..errors import UsageError
from ..model.config import cuda_unsupported
from ..model.weights import Model
from .base import Backend, NumpyBackend
from .toggles import describe, parse_exact

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
                 deep: bool = False, impl: str = "auto", cuda_options=None) -> Backend:
    toggles = parse_exact(exact) if isinstance(exact, str) else frozenset(exact)
    if name == "cpu":
        if reference_impl(impl)[0] == "compiled":
            from ..cref.backend import CompiledBackend

            return CompiledBackend(model, kv=kv, deep=deep)
        return NumpyBackend(model, kv=kv, name="cpu", deep=deep)
    if name == "sim":
        from .ops_fast import sim_ops

        return NumpyBackend(model, kv=kv, ops=sim_ops(toggles), name=f"sim ({describe(toggles)})", deep=deep)
    if name == "cuda":
        problem = cuda_unsupported(model.cfg)
        if problem:  # refused before any device work: the kernels would silently decode another model
            raise UsageError(f"cuda subject: {problem}; the sim subject is the fallback (--subject sim)")
        from .cuda import make_cuda_backend

        return make_cuda_backend(model, kv=kv, exact=toggles, deep=deep, options=cuda_options)
    raise UsageError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
