"""The per-rank view (trace/ranks.py) and the app's ranks: the header's world size, each rank's share in
the detail panel, the grid's rank filter (R). A stand-in parallel subject: the reference's own trace
with one rank's heads of one key changed, so which rank differs is known."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import pytest

from kestrel_tui.app.state import Cursor
from kestrel_tui.engines.base import Capabilities, Engine
from kestrel_tui.engines.build import make_engine
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import Session
from kestrel_tui.trace.compare import Status
from kestrel_tui.trace.ranks import RankShare, compare_shares, line
from kestrel_tui.trace.run import Trace

f32 = np.float32


@dataclass
class Parallel:
    world_size: int


@dataclass
class ShardedTrace(Trace):
    """Every per-layer attn key split into world_size equal head slices; ``partial`` keys as given."""
    world: int = 2
    partial: set = field(default_factory=set)
    parallel: Parallel | None = None

    def rank_values(self, key):
        if not key.endswith("_attn"):
            return None
        return tuple(np.split(np.asarray(self.raw(key)), self.world))


class Whole:
    """A one-rank trace: raw values only."""
    def __init__(self, raw):
        self._raw = raw

    def raw(self, key):
        return self._raw.get(key)


def test_shares_against_a_whole_tensor_and_against_the_same_ranks():
    a = np.arange(8, dtype=f32)
    b = a.copy()
    b[6] += 1
    sub = ShardedTrace("sub", [])
    sub.raw = {"t0_l0_attn": b}.get
    assert compare_shares(Whole({"t0_l0_attn": a}), sub, "t0_l0_attn")[0] == RankShare(0, "ok")
    report = compare_shares(Whole({"t0_l0_attn": a}), sub, "t0_l0_attn")
    assert [s.status for s in report] == ["ok", "DIFF"] and report[1].nmse > 0
    assert line(report).startswith("ranks: r0 ok · r1 DIFF (")
    ref = ShardedTrace("ref", [])
    ref.raw = {"t0_l0_attn": a}.get  # the same world size: rank against rank
    assert [s.status for s in compare_shares(ref, sub, "t0_l0_attn")] == ["ok", "DIFF"]
    sub.partial = {"t0_l0_attn"}  # a sum's shares against a whole tensor: no verdict of their own
    assert [s.status for s in compare_shares(Whole({"t0_l0_attn": a}), sub, "t0_l0_attn")] == ["partial"] * 2
    assert compare_shares(Whole({}), sub, "t0_l0_nrm") is None  # not a sharded key


class RankBug(Engine):
    """The reference's values, but rank 1's heads of one attn key nudged: a stand-in for a TP subject."""
    name = "tp-standin"
    caps = Capabilities(raw=True)

    def __init__(self, reference, key):
        self.reference, self.key = reference, key

    def run(self, req):
        ref = self.reference.run(req)
        out = ShardedTrace("tp-standin", list(ref.prompt), parallel=Parallel(2))
        for p in ref.positions:
            p = copy.copy(p)
            p.raw = dict(p.raw)
            if self.key in p.raw:
                a = np.array(p.raw[self.key])
                a[len(a) // 2] = np.nextafter(a[len(a) // 2], f32(np.inf))
                p.raw[self.key] = a
                from kestrel_tui.trace.fnv import fnv1a64
                p.hashes = {**p.hashes, self.key: fnv1a64(a)}
            out.positions.append(p)
            if req.on_position:
                req.on_position(p)
        return out


@pytest.mark.anyio
async def test_the_app_shows_ranks(small_model, tmp_path, make_app, settle):
    key = "t17_l2_attn"
    cpu = make_engine("cpu", small_model)
    session = Session(small_model, default_prompt(small_model.cfg.vocab), 3, subject=RankBug(cpu, key))
    app = make_app(session, tmp_path)
    async with app.run_test(size=(140, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.result.comparison.status[key] is Status.DIFF and main.result.first_diff == key
        assert "ranks sub 2" in str(main.query_one("#header").render())
        c = main.board.locate(key)
        main._set_cursor(Cursor(c.t, c.row, c.col))
        await pilot.pause()
        assert "ranks: r0 ok · r1 DIFF" in str(main.query_one("#detail").render())
        await pilot.press("R")
        assert main.board.rank == 0 and main.board.cell(key, c.t) is Status.OK  # rank 0's heads agree
        await pilot.press("R")
        assert main.board.rank == 1 and main.board.cell(key, c.t) is Status.DIFF
        await pilot.press("R")
        assert main.board.rank is None and main.board.cell(key, c.t) is Status.DIFF
