"""The cuda backend's runtime switches, in one frozen value passed to the backend.

None of them changes a bit (tests/test_cuda.py compares each way with the others); they change
how a step is launched, for speed, and so that a user can rule the launch machinery out:

    graph      M=1 steps replay a captured CUDA graph (graph.py); off: every step launches directly
    pdl        the graph's kernels use programmatic dependent launch (pdl.py; sm_90 and newer)
    fuse       fused launches (kernels/fused.cu) outside isolate mode; off: one launch per op
    pv_spread  the exact P·V kernel's blocks one to an SM (launches.pv_spread_bytes)

Set them with a profile's `[subject.options]` of a cuda subject or `--cuda-options graph=off,...`;
the environment gives the defaults (KESTREL_CUDA_GRAPH, KESTREL_CUDA_PDL, KESTREL_CUDA_FUSE,
KESTREL_PV_SPREAD: 0/off/false/no turn one off) and is read here only. KESTREL_PDL_TRIGGER is a
build option of the kernels (on by default: each triggers its successor early; 0/off/false/no
builds them wait-only), read once by runtime.py's nvcc_options through `pdl_trigger()`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Mapping

from ...errors import UsageError

ENV = {"graph": "KESTREL_CUDA_GRAPH", "pdl": "KESTREL_CUDA_PDL", "fuse": "KESTREL_CUDA_FUSE",
       "pv_spread": "KESTREL_PV_SPREAD"}
_OFF, _ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes")


@dataclass(frozen=True)
class CudaOptions:
    graph: bool = True
    pdl: bool = True
    fuse: bool = True
    pv_spread: bool = True

    @classmethod
    def of(cls, options: Mapping[str, object] = {}, flag: str | None = None) -> "CudaOptions":
        """A cuda side's switches: the environment's defaults, the side's own options (a profile's
        [subject.options]), then --cuda-options. Every run's CudaOptions is made here."""
        return cls.from_env().set(dict(options)).parse(flag)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "CudaOptions":
        return cls(**{name: env.get(var, "1").strip().lower() not in _OFF for name, var in ENV.items()})

    def set(self, values: Mapping[str, object]) -> "CudaOptions":
        """These options with some switched: {"graph": "off", ...} (on/off, true/false, 1/0)."""
        names = [f.name for f in fields(self)]
        changes = {}
        for name, value in values.items():
            if name not in names:
                raise UsageError(f"cuda option {name!r}: choose from {', '.join(names)}")
            v = str(value).strip().lower() if not isinstance(value, bool) else ("on" if value else "off")
            if v not in _OFF + _ON:
                raise UsageError(f"cuda option {name}={value}: say on or off")
            changes[name] = v in _ON
        return replace(self, **changes)

    def parse(self, spec: str | None) -> "CudaOptions":
        """`graph=off,pdl=off` (the --cuda-options flag) applied to these options."""
        items = [s.strip() for s in (spec or "").split(",") if s.strip()]
        bad = [s for s in items if "=" not in s]
        if bad:
            raise UsageError(f"--cuda-options {bad[0]!r}: write NAME=on|off, e.g. graph=off")
        return self.set(dict(s.split("=", 1) for s in items))

    def describe(self) -> str:
        off = [f.name for f in fields(self) if not getattr(self, f.name)]
        return "" if not off else "off: " + ",".join(off)


def pdl_trigger(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the kernels are built to trigger their successors early (kernels/common.cuh pdl_wait):
    yes unless KESTREL_PDL_TRIGGER turns it off."""
    return env.get("KESTREL_PDL_TRIGGER", "1").strip().lower() not in _OFF
