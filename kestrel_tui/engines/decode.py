"""The decode loop every engine that steps a model runs: the positions in the passes its schedule says.

An engine hands it a ``step`` — one forward of some tokens from a position, returning each column's
hashes, raw buffers and logits (backends.base.StepOut) — and the loop does the rest the same way for
all of them: the passes of the schedule (engines/schedule.py; decode: the prompt in one step or token
by token, then one position a step), the reference's prefill in place of its own where the engine
takes one, each next token forced or the last position's top-1, cancel and stop checked between
passes, every position recorded in the trace and handed to ``on_position``. A schedule that scores
given tokens (forward, verify) without forced tokens first decodes them itself, unrecorded, and
starts over (``restart``). An empty prompt never gets here: a RunRequest refuses one (engines/base.py).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..backends.base import StepOut
from ..trace.rawstore import RawStore
from ..trace.run import Cancelled, Position, Trace
from ..errors import UsageError
from .base import RunRequest
from .schedule import DECODE, Schedule

Step = Callable[[list[int], int], StepOut]  # (tokens, pos0) -> their columns


def decode_loop(req: RunRequest, trace: Trace, step: Step, *, token_prefill: bool = False,
                take_prefill: Callable[[list[Position]], None] | None = None,
                schedule: Schedule = DECODE, restart: Callable[[], None] | None = None) -> Trace:
    """Run ``req`` through ``step`` into ``trace`` (its store keeps the raw buffers) and return it.

    token_prefill: under the decode schedule, the prompt one token a step (cancel checked between them).
    take_prefill: how the engine takes the reference's prompt positions (``req.prefill_from``) as its
    own prefill — their KV rows into its cache; None: it runs its own prefill.
    schedule: which positions share a step. restart: empties the engine's cache, for the rollout a
    schedule that scores given tokens runs first when it is given none (None: it needs them given)."""
    if trace.store is None:
        trace.store = RawStore()
    store, P = trace.store, len(req.prompt)
    forced = req.forced
    if schedule.scores_given_tokens and forced is None:
        if restart is None:
            raise UsageError(f"schedule {schedule} scores given tokens, and this run has none: run it with"
                             f" teacher forcing")
        rollout = Trace(backend=trace.backend, prompt=list(req.prompt), store=RawStore())
        quiet = RunRequest(req.prompt, req.n_tokens, req.values, prefill_from=req.prefill_from,
                           feed_from=req.feed_from, raw=False, cancel=req.cancel, stop=req.stop, graft=req.graft)
        decode_loop(quiet, rollout, step, token_prefill=token_prefill, take_prefill=take_prefill)
        forced = [p.top1 for p in rollout.positions[P - 1:P - 1 + req.n_tokens]]
        restart()

    def check_cancel():
        if req.cancel is not None and req.cancel.is_set():
            raise Cancelled()

    def add(p: Position):
        trace.positions.append(p)
        if req.on_position:
            req.on_position(p)

    def record(out: StepOut, pos0: int, tokens: list[int]):
        keep = req.raw and out.raw is not None
        for m, tok in enumerate(tokens):
            add(Position(t=pos0 + m, token=tok, prompt=pos0 + m < P, hashes=out.hashes[m],
                         raw=store.keep(out.raw[m]) if keep else None, logits=np.ascontiguousarray(out.logits[m])))

    def token_at(t: int) -> int:
        if t < P:
            return req.prompt[t]
        return forced[t - P] if forced is not None else trace.positions[-1].top1

    check_cancel()
    if req.prefill_from is not None and take_prefill is not None:
        src = req.prefill_from.positions[:P]
        take_prefill(src)
        for p in src:
            add(p)
        groups = schedule.generated_groups(P, req.n_tokens)
    else:
        groups = schedule.groups(P, req.n_tokens, token_prefill)
    for i, (pos0, m) in enumerate(groups):
        if i:
            check_cancel()
        if pos0 + m > P and req.stop is not None and req.stop():
            break
        tokens = [token_at(t) for t in range(pos0, pos0 + m)]
        record(step(tokens, pos0), pos0, tokens)
    return trace
