"""The cuda subject: the decode step as PyCUDA kernels (kernels/*.cu), fast or exact per op.

    make_cuda_backend(model, kv, exact, deep) -> Backend

Raises UsageError (one line, naming the sim fallback) when PyCUDA, a driver, a
device or nvcc is missing, or a kernel fails to compile. Module map:
runtime.py (device, context, compiled modules), weights.py (weights on the
device), layout.py (the step's buffers and the hash work list), backend.py
(the step), graph.py (the M=1 step as a CUDA graph, which step() replays).
"""
from __future__ import annotations

from ...model.weights import Model


def make_cuda_backend(model: Model, kv: str = "q8", exact: frozenset[str] = frozenset(), deep: bool = False,
                      graph: bool | None = None, options=None):
    """options: the runtime switches (options.CudaOptions; None: the environment's defaults);
    graph=False: direct launches whatever the options say."""
    from .backend import CudaBackend

    return CudaBackend(model, kv=kv, exact=frozenset(exact), deep=deep, graph=graph, options=options)


__all__ = ["make_cuda_backend"]
