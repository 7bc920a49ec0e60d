"""The built-in backends as engines: cpu (the reference), sim and cuda (the subjects).

Their toggles are the op families of backends/toggles.py (fast or exact
kernels); they honour every session setting, since they share the
reference's KV format and can be fed its buffers. `run_decode` runs a backend
through the engines' one decode loop (engines/decode.py), as the engines' runs do.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Callable

import numpy as np

from ..backends.base import Backend
from ..backends.toggles import OWNERS, TOGGLES, describe
from ..errors import UsageError
from ..model.weights import Model
from ..trace.rawstore import RawStore
from ..trace.run import Position, Trace
from .base import Capabilities, Engine, Graft, RunRequest, Toggle, fast_exact
from .decode import decode_loop
from .decoders import cpu_impl, make_backend
from .schedule import DECODE, Schedule, parse_schedule


def _owned_fields(op: str) -> tuple[str, ...]:
    return tuple(f for f, owners in OWNERS.items() if op in owners)


OP_TOGGLES = tuple(fast_exact(op, owns=_owned_fields(op), help=f"switch {op} between fast and exact")
                   for op in TOGGLES)


class BuiltinEngine(Engine):
    _caps = Capabilities(prefill_from=True, forcing=True, isolate=True, logits=True, raw=True)

    def __init__(self, kind: str, model: Model, kv: str = "q8", deep: bool = False, impl: str = "auto",
                 cuda_options=None, schedule: Schedule = DECODE):
        self.name, self.model, self.kv, self.deep = kind, model, kv, deep
        self.cuda_options = cuda_options  # a cuda subject's runtime switches (backends/cuda/options.py)
        self.own_schedule = schedule  # the side's option; a toggle switches it back to decode
        self.toggles = () if kind == "cpu" else OP_TOGGLES  # cpu is all exact by definition
        if schedule != DECODE:  # the side's schedule, switchable back to decode (bisection's exact choice)
            self.toggles = (*self.toggles, schedule_toggle(schedule))
        # the cpu reference's implementation (the same bits either way); a fallback is said once
        self.impl, why = cpu_impl(impl) if kind == "cpu" else ("numpy", None)
        self.notes: tuple[str, ...] = (why,) if why else ()

    def exact_ops(self, values: Mapping[str, str]) -> frozenset[str]:
        return frozenset(t.name for t in self.toggles if values.get(t.name) == t.exact and t.name in TOGGLES)

    def schedule(self, values: Mapping[str, str]) -> Schedule:
        return parse_schedule(values["schedule"]) if "schedule" in values else self.own_schedule

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
        schedule = self.schedule(values)
        what = [describe(self.exact_ops(values))] if self.name != "cpu" else []
        what += [f"schedule {schedule}"] if schedule != DECODE else []
        return f"{self.name} ({', '.join(what)})" if what else self.name

    @property
    def caps(self) -> Capabilities:
        # a graft feeds the numpy decoder single buffers: the sim takes them; the cuda kernels read either
        # all their own buffers or, in isolate mode, all the reference's, and the cpu is never a subject
        return replace(self._caps, graft=self.name == "sim")

    def run(self, req: RunRequest):
        if req.graft is not None and not self.caps.graft:
            raise UsageError(f"{self.name} subject: no graft (its kernels take every buffer of a step from one"
                             f" place: their own, or in isolate mode the reference's); graft on sim or hf")
        return decode_request(self.backend(req.values), req, schedule=self.schedule(req.values))


def schedule_toggle(schedule: Schedule) -> Toggle:
    return Toggle("schedule", (str(schedule), "decode"), "decode", owns=(),
                  help=f"run the positions in the passes of schedule {schedule}, or decode (token by token)")


def run_decode(backend: Backend, prompt: list[int], n_tokens: int, *, forced: list[int] | None = None,
               raw: bool = True, prefill_from: Trace | None = None, feed_from: Trace | None = None,
               on_position: Callable[[Position], None] | None = None,
               cancel: threading.Event | None = None, stop: Callable[[], bool] | None = None,
               store: RawStore | None = None, graft: Graft | None = None) -> Trace:
    """Run the prompt and n_tokens decode positions on ``backend``.

    forced: the tokens to consume after the prompt (teacher forcing), else greedy.
    prefill_from: a trace whose prompt positions (hashes, raw buffers and KV rows)
    stand in for this backend's own prefill. feed_from: isolate mode — every op
    takes the reference trace's buffers as inputs. graft: at its sites only, the reference's buffers
    stand in for the backend's own (the cause test).
    """
    return decode_request(backend, RunRequest(list(prompt), n_tokens, {}, forced=forced, prefill_from=prefill_from,
                                              feed_from=feed_from, raw=raw, on_position=on_position, cancel=cancel,
                                              stop=stop, graft=graft), store)


def decode_request(backend: Backend, req: RunRequest, store: RawStore | None = None,
                   schedule: Schedule = DECODE) -> Trace:
    """``req`` on ``backend``, through the engines' decode loop (engines/decode.py) in ``schedule``'s
    passes; its raw buffers in ``store`` (None: a store of its own)."""
    n_positions = len(req.prompt) + req.n_tokens
    backend.reset(n_positions)
    label = backend.describe() + (f" schedule {schedule}" if schedule != DECODE else "")
    trace = Trace(backend=label, prompt=list(req.prompt), store=store or RawStore())

    def feed(pos0: int, m: int):
        if req.feed_from is not None:
            return [req.feed_from.positions[pos0 + i].raw for i in range(m)]
        if req.graft is not None:
            ref = req.graft.reference.positions
            return [{k: ref[t].raw[k] for k in req.graft.keys(t) if k in ref[t].raw}
                    for t in range(pos0, pos0 + m)]
        return None

    def step(tokens: list[int], pos0: int):
        return backend.step(np.array(tokens), pos0, raw=req.raw, feed=feed(pos0, len(tokens)))

    return decode_loop(req, trace, step, take_prefill=lambda src: backend.load_kv(0, [p.raw for p in src]),
                       schedule=schedule, restart=lambda: backend.reset(n_positions))
