"""The built-in backends as engines: cpu (the reference), sim and cuda (the subjects).

Their toggles are the op families of backends/toggles.py (fast or exact
kernels); they honour every session setting, since they share the
reference's KV format and can be fed its buffers.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..backends.select import make_backend, reference_impl
from ..backends.toggles import OWNERS, TOGGLES, describe
from ..model.weights import Model
from .base import Capabilities, Engine, RunRequest, fast_exact


def _owned_fields(op: str) -> tuple[str, ...]:
    return tuple(f for f, owners in OWNERS.items() if op in owners)


OP_TOGGLES = tuple(fast_exact(op, owns=_owned_fields(op), help=f"switch {op} between fast and exact")
                   for op in TOGGLES)


class BuiltinEngine(Engine):
    caps = Capabilities(prefill_from=True, forcing=True, isolate=True, logits=True, raw=True)

    def __init__(self, kind: str, model: Model, kv: str = "q8", deep: bool = False, impl: str = "auto",
                 cuda_options=None):
        self.name, self.model, self.kv, self.deep = kind, model, kv, deep
        self.cuda_options = cuda_options  # a cuda subject's runtime switches (backends/cuda/options.py)
        self.toggles = () if kind == "cpu" else OP_TOGGLES  # cpu is all exact by definition
        # the cpu reference's implementation (the same bits either way); a fallback is said once
        self.impl, why = reference_impl(impl) if kind == "cpu" else ("numpy", None)
        self.notes: tuple[str, ...] = (why,) if why else ()

    def exact_ops(self, values: Mapping[str, str]) -> frozenset[str]:
        return frozenset(t.name for t in self.toggles if values.get(t.name) == t.exact)

    def backend(self, values: Mapping[str, str]):
        return make_backend(self.name, self.model, kv=self.kv, exact=self.exact_ops(values) if self.toggles
                            else "all", deep=self.deep, impl=self.impl, cuda_options=self.cuda_options)

    def owners(self, field_name: str) -> tuple[str, ...]:
        return OWNERS.get(field_name, ()) if self.toggles else ()

    def prefill_problem(self, reference: Engine) -> str | None:
        if not isinstance(reference, BuiltinEngine) or reference.kv != self.kv:
            return f"{self.name} takes KV rows only from a built-in reference with kv {self.kv}"
        return None

    def describe(self, values: Mapping[str, str]) -> str:
        return self.name if not self.toggles else f"{self.name} ({describe(self.exact_ops(values))})"

    def run(self, req: RunRequest):
        from ..engine.run import run_decode

        return run_decode(self.backend(req.values), req.prompt, req.n_tokens, forced=req.forced, raw=req.raw,
                          prefill_from=req.prefill_from, feed_from=req.feed_from, on_position=req.on_position,
                          cancel=req.cancel, stop=req.stop)
