"""The built-in decoders by name: cpu (the reference: compiled, or numpy), sim (GPU-style fast
variants on the CPU), cuda (PyCUDA). Here, in engines/, above both backends/ and cref/, so that
neither imports the other; builtin.py wraps them as engines."""
from __future__ import annotations

from ..backends.base import Backend, NumpyBackend
from ..backends.toggles import describe, parse_exact
from ..errors import UsageError
from ..model.weights import Model

BACKENDS = ("cpu", "sim", "cuda")
CPU_IMPLS = ("auto", "compiled", "numpy")  # the cpu engine's implementation of the contract (the same bits)


def cpu_impl(impl: str = "auto") -> tuple[str, str | None]:
    """Which implementation of the contract decodes the cpu reference: ("compiled" | "numpy", why the
    compiled one is not used, or None). auto takes the compiled reference wherever it is built."""
    if impl not in CPU_IMPLS:
        raise UsageError(f"--cpu-impl {impl}: choose from {', '.join(CPU_IMPLS)}")
    if impl == "numpy":
        return "numpy", None
    from ..cref import Unavailable, load

    try:
        load()
    except Unavailable as e:
        if impl == "compiled":
            raise UsageError(f"--cpu-impl compiled: {e}") from None
        return "numpy", f"the reference runs on numpy: {e}"
    return "compiled", None


def check_decoder(name: str, model: Model) -> None:
    """What a built-in decoder refuses before any device work: a model the cuda kernels do not implement
    would be decoded as another model, silently. Asked by the engine table when a cuda engine is built
    (before the reference runs) and by make_backend (the app's auto probe makes a backend alone)."""
    if name == "cuda":
        from ..backends.cuda.launches import refuse_unsupported

        refuse_unsupported(model.cfg)


def make_backend(name: str, model: Model, kv: str = "q8", exact: str | frozenset = "all",
                 deep: bool = False, impl: str = "auto", cuda_options=None) -> Backend:
    """A built-in decoder; ``cuda_options``: a cuda one's CudaOptions (None: the environment's)."""
    check_decoder(name, model)
    toggles = parse_exact(exact) if isinstance(exact, str) else frozenset(exact)
    if name == "cpu":
        if cpu_impl(impl)[0] == "compiled":
            from ..cref.backend import CompiledBackend

            return CompiledBackend(model, kv=kv, deep=deep)
        return NumpyBackend(model, kv=kv, name="cpu", deep=deep)
    if name == "sim":
        from ..backends.ops_fast import sim_ops

        return NumpyBackend(model, kv=kv, ops=sim_ops(toggles), name=f"sim ({describe(toggles)})", deep=deep)
    if name == "cuda":
        from ..backends.cuda import make_cuda_backend

        return make_cuda_backend(model, kv=kv, exact=toggles, deep=deep, options=cuda_options)
    raise UsageError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
