"""The view model behind the grid: per-key status of one comparison, filled position by position.

Workers never touch a Board: they post messages and the main screen applies
them on the UI thread, so widgets can read it while rendering without locks.
The same Board serves a live run (reference vs subject, positions arriving in
order) and diff mode (two dump files, complete at once, keys possibly missing
on either side).

The board has a slot per position present and a row per layer present, not
one per index: a dump's indices are whatever its engine wrote (t1000000000
is a valid key), and sizing by the largest index would allocate billions of
cells. A live run's positions and layers are 0..n-1, so there slot == position.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..trace.compare import Comparison, Status
from ..trace.keys import ALL_FIELDS, emb_key, key_name, logits_key, order_key, parse_key

MISMATCH = (Status.DIFF, Status.MISSING_REF, Status.MISSING_SUB)

RawGetter = Callable[[str], np.ndarray | None]  # a key -> its raw buffer on one side


def _no_raw(_key: str) -> None:
    return None


@dataclass(frozen=True)
class Cursor:
    t: int  # slot: index into Board.positions (the position itself in a live run)
    row: int  # 0 = emb, 1..n_layers = the layers present, n_layers+1 = logits
    col: int  # field column; kept while on emb/logits so moving back restores it


class Board:
    """Statuses of every key of one comparison, addressed by (slot, row, column).

    positions and layers: the indices present, ascending (range(n) for a live run).
    """

    def __init__(self, positions: Sequence[int], layers: Sequence[int], fields: Sequence[str], *,
                 prompt_len: int | None = None, sides: tuple[str, str] = ("ref", "sub"), live: bool = True):
        self.positions = tuple(positions) or (0,)  # never empty: the cursor needs a slot to stand on
        self.layers = tuple(layers)
        self.n_positions = len(self.positions)
        self.n_layers = len(self.layers)
        self.fields = tuple(fields)
        self.prompt_len = prompt_len  # None: unknown (dump files carry no prompt boundary)
        self.sides = sides
        self.live = live  # live: absent keys of a position not yet run are PENDING
        self.q8_inputs = False  # q4_0 weights: GEMV outputs show whether their q8_0 input codes agree
        # (key, status) -> True for a key missing because that side's engine never makes it: not counted
        self.expected_missing = lambda key, status: False
        self.rows = ("emb", *(f"L{layer}" for layer in self.layers), "logits")
        self._slot = {t: i for i, t in enumerate(self.positions)}
        self._row = {layer: i + 1 for i, layer in enumerate(self.layers)}
        self._col = {f: i for i, f in enumerate(self.fields)}
        self.ref_hashes: dict[str, int] = {}
        self.raw_ref: RawGetter = _no_raw
        self.outside: list[str] = []  # keys the grid has no cell for (foreign tags)
        self.comparison: Comparison | None = None  # diff mode: the two files' comparison, whole
        self.reset()

    def reset(self) -> None:
        """Forget the subject side (a new run starts); the reference hashes stay."""
        n = self.n_positions
        self.version = getattr(self, "version", 0) + 1  # bumped on every change: widgets key caches on it
        self.status: dict[str, Status] = {}
        self.sub_hashes: dict[str, int] = {}
        self.arrived = [not self.live] * n
        self.n_diff = [0] * n
        self.n_missing = [0] * n
        self.top1: list[tuple[int, int] | None] = [None] * n
        self.mismatches: list[str] = []  # DIFF and missing keys, in dataflow order
        self._mm_order: list[tuple] = []
        self.first_diff: str | None = None
        self.first_mismatch: str | None = None
        self.raw_sub: RawGetter = _no_raw
        self.tolerance = None  # session.session.ToleranceSummary of the finished run, or None: plain ok/DIFF
        self.events: list = []  # trace/events.Event of the finished run, in dataflow order
        self.traces = None  # (reference, subject) Traces of the finished run: their ranks (trace/ranks.py)
        self.rank: int | None = None  # the grid's rank filter: a sharded key's cell shows this rank's share
        self.rank_status: dict[str, Status] = {}  # key -> that share's status, for the keys that have shares

    def set_tolerance(self, summary) -> None:
        """DIFF keys judged close/far (a ToleranceSummary), or None for the plain DIFF view."""
        self.version += 1
        self.tolerance = summary

    def verdict(self, key: str | None) -> str | None:
        """"close" | "far" for a judged DIFF key under the current tolerance; None otherwise."""
        tol = self.tolerance
        return None if tol is None or key is None else tol.verdict.get(key)

    @property
    def first_far(self) -> str | None:
        return None if self.tolerance is None else self.tolerance.first_far

    # ---- filling ---------------------------------------------------------

    def add_position(self, t: int, statuses: Mapping[str, Status], sub_hashes: Mapping[str, int],
                     top1: tuple[int, int] | None = None) -> None:
        """One subject position arrived (statuses come in dataflow order)."""
        i = self._slot.get(t)
        if i is None:
            return
        self.version += 1
        self.arrived[i] = True
        self.top1[i] = top1
        self.sub_hashes.update(sub_hashes)
        for k, s in statuses.items():
            self._set(k, s)

    def load(self, cmp: Comparison, a: Mapping[str, int], b: Mapping[str, int]) -> None:
        """A whole comparison at once (diff mode)."""
        self.reset()
        self.comparison, self.outside = cmp, []
        self.ref_hashes, self.sub_hashes = dict(a), dict(b)
        self.arrived = [True] * self.n_positions
        for k, s in cmp.status.items():
            try:
                key = parse_key(k)
            except ValueError:
                key = None
            if key is None or self.locate(k) is None:
                self.outside.append(k)
                if s in MISMATCH:
                    self._note_mismatch(k, s)
                continue
            self._set(k, s)

    def _set(self, k: str, s: Status) -> None:
        self.status[k] = s
        if s in MISMATCH:
            i = self._slot.get(order_key(k)[0])
            if i is not None:
                if s is Status.DIFF:
                    self.n_diff[i] += 1
                elif not self.expected_missing(k, s):
                    self.n_missing[i] += 1
            self._note_mismatch(k, s)

    def _note_mismatch(self, k: str, s: Status) -> None:
        o = order_key(k)
        i = bisect.bisect_left(self._mm_order, o)
        self._mm_order.insert(i, o)
        self.mismatches.insert(i, k)
        if s is Status.DIFF and (self.first_diff is None or o < order_key(self.first_diff)):
            self.first_diff = k
        if self.first_mismatch is None or o < order_key(self.first_mismatch):
            self.first_mismatch = k

    # ---- reading ---------------------------------------------------------

    def key(self, i: int, row: int, col: int) -> str | None:
        t = self.positions[i]
        if row == 0:
            return emb_key(t)
        if row == self.n_layers + 1:
            return logits_key(t)
        if 0 <= col < len(self.fields):
            return key_name(t, self.layers[row - 1], self.fields[col])
        return None

    def cell(self, key: str | None, i: int) -> Status | None:
        """A key's status (i: its slot); None when the key is not part of this comparison at all."""
        if key is None:
            return None
        s = self.rank_status.get(key) if self.rank is not None else None
        s = s if s is not None else self.status.get(key)
        if s is not None:
            return s
        if not self.arrived[i]:
            return Status.PENDING
        return None

    def slot(self, t: int) -> int | None:
        """The slot of position t; None when the board has no such position."""
        return self._slot.get(t)

    def locate(self, key: str) -> Cursor | None:
        """The cell of a key (col -1 for emb/logits: the caller keeps its column)."""
        try:
            k = parse_key(key)
        except ValueError:
            return None
        i = self._slot.get(k.t)
        if i is None:
            return None
        if k.layer is None:
            return Cursor(i, 0 if k.field == "emb" else self.n_layers + 1, -1)
        row = self._row.get(k.layer)
        if row is None or k.field not in self._col:
            return None
        return Cursor(i, row, self._col[k.field])

    def step_mismatch(self, key: str | None, forward: bool = True) -> str | None:
        """The next (or previous) DIFF/missing key after `key` in dataflow order, wrapping around."""
        if not self.mismatches:
            return None
        if key is None:
            return self.mismatches[0 if forward else -1]
        o = order_key(key)
        if forward:
            i = bisect.bisect_right(self._mm_order, o)
            return self.mismatches[i % len(self.mismatches)]
        i = bisect.bisect_left(self._mm_order, o) - 1
        return self.mismatches[i]  # -1 wraps to the last

    def position_state(self, i: int) -> str:
        """pending | ok | diff | flip | missing — one token-strip cell (i: a slot)."""
        if not self.arrived[i]:
            return "pending"
        top = self.top1[i]
        if top is not None and top[0] >= 0 and top[1] >= 0 and top[0] != top[1]:  # -1: no logits
            return "flip"
        if self.n_diff[i]:
            return "diff"
        if self.n_missing[i]:
            return "missing"
        return "ok"

    def is_prompt(self, i: int) -> bool | None:
        return None if self.prompt_len is None else self.positions[i] < self.prompt_len

    def row_has_mismatch(self, i: int, row: int) -> bool:
        for col in range(len(self.fields) if 0 < row <= self.n_layers else 1):
            if self.status.get(self.key(i, row, col)) in MISMATCH:
                return True
        return False

    @property
    def complete(self) -> bool:
        return all(self.arrived)

    def counts(self) -> dict[Status, int]:
        out = {s: 0 for s in Status}
        for s in self.status.values():
            out[s] += 1
        return out

    def hashes(self, key: str) -> tuple[int | None, int | None]:
        return self.ref_hashes.get(key), self.sub_hashes.get(key)


def axes_of(keys: Iterable[str]) -> tuple[list[int], list[int], tuple[str, ...]]:
    """(positions, layers, field columns) present in a set of dump keys, positions and layers ascending.

    Known fields keep the dataflow order; fields of other engines follow, sorted.
    """
    positions: set[int] = set()
    layers: set[int] = set()
    seen: set[str] = set()
    for name in keys:
        try:
            k = parse_key(name)
        except ValueError:
            continue
        positions.add(k.t)
        if k.layer is not None:
            layers.add(k.layer)
            seen.add(k.field)
    known = [f for f in ALL_FIELDS if f in seen]
    foreign = sorted(seen - set(ALL_FIELDS))
    return sorted(positions), sorted(layers), tuple(known + foreign)
