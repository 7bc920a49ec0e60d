"""One backend's run over a prompt: prefill, then greedy or teacher-forced decode (trace/run.py
says what the trace it returns holds)."""
from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from ..backends.base import Backend
from ..trace.rawstore import RawStore
from ..trace.run import Cancelled, Position, Trace


def argmax_token(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def run_decode(backend: Backend, prompt: list[int], n_tokens: int, *, forced: list[int] | None = None,
               raw: bool = True, prefill_from: Trace | None = None, feed_from: Trace | None = None,
               on_position: Callable[[Position], None] | None = None,
               cancel: threading.Event | None = None, stop: Callable[[], bool] | None = None,
               store: RawStore | None = None) -> Trace:
    """Run the prompt and n_tokens decode positions.

    forced: the tokens to consume after the prompt (teacher forcing), else greedy.
    prefill_from: a trace whose prompt positions (hashes, raw buffers and KV rows)
    stand in for this backend's own prefill. feed_from: isolate mode — every op
    takes the reference trace's buffers as inputs.
    """
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    P = len(prompt)
    backend.reset(P + n_tokens)
    store = store or RawStore()
    trace = Trace(backend=backend.describe(), prompt=list(prompt), store=store)

    def check_cancel():
        if cancel is not None and cancel.is_set():
            raise Cancelled()

    def feed(pos0: int, m: int):
        return None if feed_from is None else [feed_from.positions[pos0 + i].raw for i in range(m)]

    def record(out, pos0: int, tokens: list[int]):
        for m, tok in enumerate(tokens):
            pos = Position(t=pos0 + m, token=tok, prompt=pos0 + m < P, hashes=out.hashes[m],
                           raw=store.keep(out.raw[m]) if out.raw else None, logits=out.logits[m])
            trace.positions.append(pos)
            if on_position:
                on_position(pos)

    check_cancel()
    if prefill_from is not None:
        src = prefill_from.positions[:P]
        backend.load_kv(0, [p.raw for p in src])
        for p in src:
            trace.positions.append(p)
            if on_position:
                on_position(p)
    else:
        record(backend.step(np.array(prompt), 0, raw=raw, feed=feed(0, P)), 0, list(prompt))
    for i in range(n_tokens):
        check_cancel()
        if stop is not None and stop():
            break
        t = P + i
        tok = forced[i] if forced is not None else trace.positions[-1].top1
        record(backend.step(np.array([tok]), t, raw=raw, feed=feed(t, 1)), t, [tok])
    return trace
