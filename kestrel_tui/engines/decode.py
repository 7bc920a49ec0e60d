"""The decode loop every engine that steps a model runs: the prompt, then one position at a time.

An engine hands it a ``step`` — one forward of some tokens from a position, returning each column's
hashes, raw buffers and logits (backends.base.StepOut) — and the loop does the rest the same way for
all of them: the prompt in one step or token by token, the reference's prefill in place of its own
where the engine takes one, each next token forced or the last position's top-1, cancel and stop
checked between positions, every position recorded in the trace and handed to ``on_position``.
An empty prompt never gets here: a RunRequest refuses one (engines/base.py).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..backends.base import StepOut
from ..trace.rawstore import RawStore
from ..trace.run import Cancelled, Position, Trace
from .base import RunRequest

Step = Callable[[list[int], int], StepOut]  # (tokens, pos0) -> their columns


def decode_loop(req: RunRequest, trace: Trace, step: Step, *, token_prefill: bool = False,
                take_prefill: Callable[[list[Position]], None] | None = None) -> Trace:
    """Run ``req`` through ``step`` into ``trace`` (its store keeps the raw buffers) and return it.

    token_prefill: the prompt one token a step (cancel checked between them), else in one step.
    take_prefill: how the engine takes the reference's prompt positions (``req.prefill_from``) as its
    own prefill — their KV rows into its cache; None: it runs its own prefill."""
    if trace.store is None:
        trace.store = RawStore()
    store, P = trace.store, len(req.prompt)

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

    check_cancel()
    if req.prefill_from is not None and take_prefill is not None:
        src = req.prefill_from.positions[:P]
        take_prefill(src)
        for p in src:
            add(p)
    elif token_prefill:
        for t, tok in enumerate(req.prompt):
            if t:
                check_cancel()
            record(step([tok], t), t, [tok])
    else:
        record(step(list(req.prompt), 0), 0, list(req.prompt))
    for i in range(req.n_tokens):
        check_cancel()
        if req.stop is not None and req.stop():
            break
        t = P + i
        tok = req.forced[i] if req.forced is not None else trace.positions[-1].top1
        record(step([tok], t), t, [tok])
    return trace
