"""Every engine by name, in one table: how it is built and what the rest of the tool asks of it.

`build.make_engine` builds through the table; the profile loader's engine checks, the command
line's engine choices and the docs' engine lists (tests/test_engine_table.py) are read from it.
A new engine is one entry here (docs/architecture.md, "Adding an engine").

This module imports nothing heavy: the profile loader and the command line's parser read it
before any model or engine library is loaded. The factories import their engine when called.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields


# (spec, model, kv=, deep=, impl=, cuda_options=) -> Engine; make_engine has already refused a name the
# table lacks and options given to an engine that takes none
Factory = Callable[..., object]


@dataclass(frozen=True)
class EngineEntry:
    name: str
    factory: Factory
    builtin: bool = False         # a backend of decoders.make_backend: its toggles are the op families (so a
                                  # profile gives it no [[toggle]]) and it decodes the reference's model
    options: bool = True          # takes [side.options] (cpu and sim have nothing to switch but op families
                                  # and their schedule)
    schedules: bool = False       # runs its positions in the passes of a schedule (option schedule)
    flag_subject: bool = False    # --subject NAME without a profile: the engine needs nothing a flag cannot give
    out_of_process: bool = False  # runs in a child process (engines/child.py): a native crash ends the child
    bench: bool = False           # `kestrel-tui bench --subject NAME` has speed figures for it


def _builtin(spec, model, kv, deep, impl, cuda_options=None):
    """cpu, sim, cuda; a cuda engine's switches are made here, from the side's options and the run's
    --cuda-options text (``cuda_options``), and a model its kernels cannot run is refused now."""
    from ..backends.cuda.options import CudaOptions
    from .builtin import BuiltinEngine
    from .decoders import check_decoder
    from .schedule import DECODE, parse_schedule

    check_decoder(spec.engine, model)
    options = {k: v for k, v in spec.options.items() if k != "schedule"}
    schedule = parse_schedule(spec.options["schedule"], f"{spec.engine} option schedule") \
        if "schedule" in spec.options else DECODE
    return BuiltinEngine(spec.engine, model, kv=kv, deep=deep, impl=impl, schedule=schedule,
                         cuda_options=CudaOptions.of(options, cuda_options) if spec.engine == "cuda" else None)


def _hf(spec, model, kv, deep, impl, cuda_options=None):
    from .hf import make_hf_engine

    return make_hf_engine(spec, model, kv=kv, deep=deep)


def _hf_dist(spec, model, kv, deep, impl, cuda_options=None):
    from .hf_dist import make_hf_dist_engine

    return make_hf_dist_engine(spec, model, kv=kv, deep=deep)


def _process(spec, model, kv, deep, impl, cuda_options=None):
    from .process import make_process_engine

    return make_process_engine(spec, model, kv=kv, deep=deep)


def _llamacpp(spec, model, kv, deep, impl, cuda_options=None):
    from dataclasses import replace

    from .child import Job, OutOfProcess
    from .llamacpp import make_llamacpp_engine

    # this process keeps an unloaded engine for toggles and labels; the library loads only in the child
    inner = make_llamacpp_engine(spec, model, kv=kv, deep=deep, load=False)
    return OutOfProcess(inner, Job("llama_cpp", "kestrel_tui.engines.llamacpp:make_llamacpp_engine",
                                   replace(spec, model=inner.path), inner.ours.cfg, kv, deep))


def _dump(spec, model, kv, deep, impl, cuda_options=None):
    from .dumps.engine import dump_factory

    return dump_factory(spec, model, kv=kv, deep=deep)


# The order is the order every message and the docs list them in.
ENGINE_TABLE: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("cpu", _builtin, builtin=True, options=False, schedules=True, bench=True),
    EngineEntry("sim", _builtin, builtin=True, options=False, schedules=True, flag_subject=True),
    EngineEntry("cuda", _builtin, builtin=True, schedules=True, flag_subject=True, bench=True),
    EngineEntry("hf", _hf, schedules=True, flag_subject=True),
    EngineEntry("hf-dist", _hf_dist, schedules=True, flag_subject=True),  # N ranks, its own process group
    EngineEntry("process", _process),  # its command comes from a profile
    EngineEntry("llama.cpp", _llamacpp, schedules=True, out_of_process=True),
    EngineEntry("vllm-dump", _dump),    # a recorded run: its folder comes from a profile
    EngineEntry("sglang-dump", _dump),
)}

ENGINES = tuple(ENGINE_TABLE)
_FACTS = tuple(f.name for f in fields(EngineEntry) if f.type in ("bool", bool))


def names(**facts: bool) -> tuple[str, ...]:
    """The engines, in table order, whose facts have the given values: names(builtin=True)."""
    unknown = set(facts) - set(_FACTS)
    if unknown:
        raise TypeError(f"unknown engine fact {', '.join(sorted(unknown))}; the facts are {', '.join(_FACTS)}")
    return tuple(e.name for e in ENGINE_TABLE.values() if all(getattr(e, k) == v for k, v in facts.items()))


BUILTIN = names(builtin=True)
