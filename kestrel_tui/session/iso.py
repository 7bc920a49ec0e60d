"""Batch-verify vs M=1 decode on one backend (the seed's [ISODIFF] probe).

Speculative decoding is only correct if verifying M draft tokens in one
M-column step gives, column by column, exactly the logits that M single-token
decode steps give. The subject greedy-decodes M tokens one at a time, then a
fresh instance verifies the same M tokens in one step; each column's full
logits are compared byte by byte — top-1 agreement is not enough, a 1-ULP
difference elsewhere flips a boundary token later.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..backends.base import Backend
from ..engines.base import EngineFailed
from ..engines.builtin import run_decode
from ..bounds import Number
from ..errors import UsageError
from ..trace.compare import compare, diff_stats
from ..trace.keys import MAX_INDEX
from ..trace.run import Cancelled

WIDTH = Number(whole=True, lo=1, hi=MAX_INDEX, unit="columns")  # M; the model's context bounds it further
DEFAULT_WIDTH = 5


def failing(what: str, fn):
    """fn(), with what the backend raises (a driver error, a kernel fault) as one EngineFailed line:
    the subject failed, which is neither a difference nor bad input."""
    try:
        return fn()
    except (UsageError, Cancelled):
        raise
    except Exception as e:  # noqa: BLE001 - any failure inside the backend is the engine's
        detail = " ".join(str(e).split())[:300]
        raise EngineFailed(f"{what} failed: {type(e).__name__}" + (f": {detail}" if detail else "")) from None


@dataclass(frozen=True)
class IsoColumn:
    j: int  # column in the verify batch
    t: int  # its position
    token: int
    ndiff: int  # logits elements whose bits differ
    first_index: int | None  # first differing logit (vocab id)
    max_ulp: int
    first_diff_key: str | None  # first differing probe key in dataflow order
    top1_single: int
    top1_batch: int


def iso(make: callable, prompt: list[int], m: int, cancel: threading.Event | None = None) -> list[IsoColumn]:
    """make() returns a fresh subject backend. Returns one IsoColumn per verify column."""
    P = len(prompt)
    single = failing("the M=1 decode", lambda: run_decode(make(), prompt, m, cancel=cancel))
    drafts = [p.token for p in single.positions[P:]]
    batch: Backend = make()

    def verify():
        batch.reset(P + m)
        batch.step(np.array(prompt), 0, raw=False)
        return batch.step(np.array(drafts), P, raw=False)

    out = failing(f"the M={m} verify step", verify)
    cols = []
    for j in range(m):
        ref = single.positions[P + j]
        st = diff_stats(ref.logits, out.logits[j])
        cmp = compare(ref.hashes, out.hashes[j])
        cols.append(IsoColumn(j=j, t=P + j, token=drafts[j], ndiff=st.n_diff, first_index=st.first_index,
                              max_ulp=st.max_ulp, first_diff_key=cmp.first_diff,
                              top1_single=ref.top1, top1_batch=int(np.argmax(out.logits[j]))))
    return cols
