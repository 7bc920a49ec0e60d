"""Engines by name: `make_engine` builds one through the engine table (registry.py)."""
from __future__ import annotations

from ..errors import UsageError
from ..model.weights import Model
from .decoders import BACKENDS, CPU_IMPLS, cpu_impl, make_backend  # noqa: F401 (re-exported)
from .registry import ENGINE_TABLE, ENGINES, names  # noqa: F401 (ENGINES re-exported)


def make_engine(spec, model: Model | None, kv: str = "q8", deep: bool = False, impl: str = "auto",
                cuda_options: str | None = None):
    """An EngineSpec -> an Engine. ``model`` is the loaded model of spec.model (the built-ins decode it;
    hf and process read their own files and use it only for its shape). ``impl``: the cpu engine's
    implementation of the contract (cpu_impl); ``cuda_options``: the run's --cuda-options, over a cuda
    engine's own options and the environment (CudaOptions.of)."""
    from .base import EngineSpec

    spec = spec if isinstance(spec, EngineSpec) else EngineSpec(str(spec))
    entry = ENGINE_TABLE.get(spec.engine)
    if entry is None:
        raise UsageError(f"unknown engine {spec.engine!r}; choose from {', '.join(ENGINES)}")
    if "schedule" in spec.options:
        from .schedule import parse_schedule

        if not entry.schedules:
            raise UsageError(f"engine {spec.engine}: runs its own passes, so it takes no schedule; the engines"
                             f" that do: {', '.join(names(schedules=True))}")
        parse_schedule(spec.options["schedule"], f"engine {spec.engine}: schedule")
    others = [str(k) for k in spec.options if k != "schedule"]
    if others and not entry.options:
        raise UsageError(f"engine {spec.engine}: takes no options but schedule (got {', '.join(others)});"
                         f" its toggles are the op families")
    return entry.factory(spec, model, kv=kv, deep=deep, impl=impl, cuda_options=cuda_options)
