"""Which dumped rows are the reference's request: alignment by the dumped input_ids and positions.

A serving engine runs many requests in one forward, their tokens flattened into rows: a request's
rows in one forward are consecutive and so are their positions (a prefill chunk p..p+n-1, or one
decode token). A *segment* is such a run of rows; a *request* is a chain of segments over the
forwards, each starting at the position after the last one. Segments are linked to open chains in
row order, preferring a chain that agrees with the wanted tokens when the segment does (so two
requests that swap rows between forwards stay apart when their tokens differ). Requests with the
same tokens cannot be told apart by ids and positions: they are taken in the order they appear.

The reference's request is the chain whose tokens equal the wanted ones (the session's prompt and
forced tokens) at every position both have; `request` picks among several (0: the first).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from ...errors import UsageError


@dataclass(frozen=True)
class Row:
    step: int
    row: int
    token: int
    pos: int


@dataclass(eq=False)
class Chain:
    rows: list[Row] = field(default_factory=list)
    agrees: bool = True

    @property
    def next_pos(self) -> int:
        return self.rows[-1].pos + 1


def _agrees(rows: list[Row], want: list[int] | None) -> bool:
    return want is None or all(r.pos >= len(want) or want[r.pos] == r.token for r in rows)


def chains(steps: list[tuple[np.ndarray, np.ndarray]], want: list[int] | None = None
           ) -> tuple[list[Chain], dict[int, list[tuple[int, int]]]]:
    """Every request's chain, in order of first appearance, and each forward's segments ([start, end) rows,
    in row order: a request's logits row is its segment's index). ``steps[s]`` = (input_ids, positions).

    A run of consecutive positions is one segment, except where it continues a request and the next
    position is the one another request of the forward waits for: decode rows of two requests whose
    positions happen to follow each other (3 of one, 4 of the next) are two requests, not one."""
    found: list[Chain] = []
    segs: dict[int, list[tuple[int, int]]] = {}
    # the chains a later forward may continue, by (next position, agrees with want): heaps of chain indices,
    # so that a segment finds its chain without a walk over every request the dump ever held
    open_at: dict[tuple[int, bool], list[int]] = {}

    def take(p: int, ok: bool) -> int | None:
        """The first open chain waiting for position p, one whose agreement is the segment's first."""
        for key in ((p, ok), (p, not ok)):
            heap = open_at.get(key)
            if heap:
                c = heapq.heappop(heap)
                if not heap:
                    del open_at[key]
                return c
        return None

    for s, (ids, pos) in enumerate(steps):
        taken: list[int] = []  # a request has one segment a forward: open again once the forward is read
        segs[s] = []
        i, n = 0, len(ids)
        while i < n:
            first = Row(s, i, int(ids[i]), int(pos[i]))
            chosen = take(first.pos, _agrees([first], want))
            j = i + 1
            while j < n and pos[j] == pos[j - 1] + 1 and not (
                    chosen is not None and ((int(pos[j]), True) in open_at or (int(pos[j]), False) in open_at)):
                j += 1
            seg = [Row(s, r, int(ids[r]), int(pos[r])) for r in range(i, j)]
            if chosen is None:
                found.append(Chain())
                chosen = len(found) - 1
            c = found[chosen]
            taken.append(chosen)
            c.rows += seg
            c.agrees = c.agrees and _agrees(seg, want)
            segs[s].append((i, j))
            i = j
        for t in taken:
            heapq.heappush(open_at.setdefault((found[t].next_pos, found[t].agrees), []), t)
    return found, segs


def pick(found: list[Chain], want: list[int] | None, request: int, where: str) -> tuple[Chain, list[str]]:
    """The reference's chain and the notes on how it was chosen; a one-line UsageError when none fits."""
    notes = []
    fit = [c for c in found if c.agrees and c.rows and (want is None or c.rows[0].pos < len(want))]
    if any(c.rows[0].pos == 0 for c in fit):  # a request computed from its first token beats a cached prefix's
        fit = [c for c in fit if c.rows[0].pos == 0]
    if not fit:
        have = ", ".join(f"positions {c.rows[0].pos}..{c.rows[-1].pos} starting {[r.token for r in c.rows[:4]]}"
                         for c in found[:3]) or "no rows"
        raise UsageError(f"{where}: no dumped request has the session's tokens (the dump has {len(found)}"
                         f" request{'s' * (len(found) != 1)}: {have}); run the same prompt as the dump's")
    if request >= len(fit):
        raise UsageError(f"{where}: request={request}, but {len(fit)} dumped request{'s' * (len(fit) != 1)}"
                         f" match the tokens; choose 0..{len(fit) - 1}")
    if len(fit) > 1:
        notes.append(f"{len(fit)} dumped requests match the tokens; request {request} is taken")
    c = fit[request]
    if c.rows[0].pos:
        notes.append(f"the dump starts this request at position {c.rows[0].pos} (earlier positions were not"
                     f" computed: a cached prefix, or skipped passes); those keys read missing")
    return c, notes
