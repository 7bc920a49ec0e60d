"""Pilot tests: the app on a process subject (tests/engines/toy_engine.py, a separate OS process).

The toy decodes the 2-layer embedded model with the sim kernels, one env var per
toggle, and writes its dump as it goes; the reference is cpu on the same model,
so with every op exact the two agree bit for bit. Runs are a few positions long
and the toy sleeps per position where a test needs to look at a run in flight.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from kestrel_tui.backends.toggles import TOGGLES
from kestrel_tui.session.session import Session
from kestrel_tui.engines.base import EngineSpec, Toggle
from kestrel_tui.engines.build import make_backend, make_engine
from kestrel_tui.engines.builtin import run_decode
from kestrel_tui.engines.builtin import OP_TOGGLES
from kestrel_tui.trace.compare import Status, compare

from toytools import N, PROMPT, gone, model, ref, toy_options  # noqa: F401 - model, ref: fixtures

pytestmark = pytest.mark.anyio

EXACT = Toggle("exact", ("none", "all"), "all", key="TOY_EXACT", help="every op exact (TOY_EXACT)")
NORM = Toggle("norm", ("0", "1"), "1", owns=("nrm",), key="TOY_NORM_EXACT", help="exact RMSNorm")


def toy(*extra, raw=False, **options):
    return toy_options(*extra, raw=raw, **options)


def toy_session(model, options, toggles=(EXACT,)) -> Session:
    sub = make_engine(EngineSpec("process", options=options, toggles=toggles), model)
    return Session(model, PROMPT, N, reference="cpu", subject=sub)


async def wait_for(pilot, cond, timeout: float = 30.0, what: str = "condition"):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"never: {what} (phase {pilot.app.main.phase})")
        await pilot.pause(0.01)


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


def alive(pid: int) -> bool:
    """Running (not dead, not a zombie waiting to be reaped)."""
    return not gone(pid)


def wait_gone(pid: int, within: float = 2.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.01)
    return not alive(pid)


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def sim_hashes(model, ref, exact):
    return run_decode(make_backend("sim", model, exact=exact), PROMPT, N, forced=ref.generated[:N]).hashes()


# ---- live positions -------------------------------------------------------------------------------


async def test_positions_arrive_while_the_process_runs_then_the_expected_diff(model, ref, tmp_path, make_app, settle):
    pidfile = tmp_path / "pid"
    session = toy_session(model, toy("--sleep", "0.25", "--pid-file", str(pidfile)))
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        main = app.main
        seen = []

        def midway() -> bool:
            board = main.board
            if board is None or main.phase != "running":
                return False
            n = sum(board.arrived)
            pid = read_pid(pidfile)
            if 0 < n < board.n_positions and pid is not None and alive(pid):
                seen.append((n, pid, main.busy, main.status.text))
                return True
            return False

        await wait_for(pilot, midway, what="some positions in while the toy runs")
        n, pid, busy, text = seen[0]
        assert busy and "running" in text
        # what arrived is on the board already, the rest is pending
        board = main.board
        assert board.cell("t0_emb", 0) is Status.OK
        assert board.cell(f"t{len(PROMPT) + N - 1}_emb", board.n_positions - 1) is Status.PENDING
        await settle(pilot)
        assert wait_gone(pid), "the toy is gone once the run is over"
        res = main.result
        want = compare(ref.hashes(), sim_hashes(model, ref, "none"))  # TOY_EXACT=none: the in-process sim
        assert main.phase == "idle" and not main.busy and all(board.arrived)
        assert res.sub.hashes() == sim_hashes(model, ref, "none")
        assert res.first_diff == want.first_diff == board.first_diff is not None
        assert res.n_missing == 0
        assert main.status.text.startswith(f"first DIFF {want.first_diff} · ")
        # what the process cannot honour is said once, in one line
        assert any("runs its own prefill" in m and "\n" not in m for m in notes(app))


# ---- toggles ----------------------------------------------------------------------------------------


async def test_toggles_panel_lists_the_toys_toggles_and_1_reruns_killing_the_old_process(model, ref, tmp_path,
                                                                                          make_app, settle):
    pidfile = tmp_path / "pid"
    session = toy_session(model, toy("--sleep", "0.3", "--pid-file", str(pidfile)), toggles=(EXACT, NORM))
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        main = app.main
        from kestrel_tui.app.widgets.toggles import TogglePanel

        panel = main.query_one(TogglePanel)
        await wait_for(pilot, lambda: main.phase == "running" and main.board is not None
                       and sum(main.board.arrived) >= 1 and read_pid(pidfile) is not None, what="first run going")
        assert panel.toggles == (EXACT, NORM)
        text = panel.render().plain
        assert " 1  exact" in text and " 2  norm" in text
        line1 = next(ln for ln in text.splitlines() if " 1  exact" in ln)
        assert line1.rstrip().endswith("none")  # the default: fast
        first_pid = read_pid(pidfile)
        assert alive(first_pid)
        pidfile.unlink()

        await pilot.press("1")
        assert wait_gone(first_pid), "switching a toggle kills the run in flight"
        await settle(pilot)
        second_pid = read_pid(pidfile)
        assert second_pid is not None and second_pid != first_pid
        assert wait_gone(second_pid)
        res = main.result
        assert main.settings.exact == frozenset({"exact"}) == res.settings.exact
        assert res.all_ok and res.sub.hashes() == ref.hashes()  # TOY_EXACT=all: the cpu reference
        assert main.board.first_diff is None and all(main.board.arrived)
        assert main.status.text.startswith("all ok · ")
        line1 = next(ln for ln in panel.render().plain.splitlines() if " 1  exact" in ln)
        assert line1.rstrip().endswith("all")
        # the cancelled first run recorded nothing: this is the session's first finished run
        assert [h.change for h in session.history] == ["start"] and session.history[-1].after is None

        await pilot.press("1")  # and back: the DIFF of the in-process sim returns
        await settle(pilot)
        assert main.result.first_diff == compare(ref.hashes(), sim_hashes(model, ref, "none")).first_diff
        assert session.history[-1].change == "-exact"


# ---- failures ---------------------------------------------------------------------------------------


async def test_exit_midway_keeps_the_app_usable_and_marks_the_rest_missing(model, ref, tmp_path, make_app, settle):
    # every op exact through the fixed env: the only problem is the exit after position 4
    session = toy_session(model, toy("--fail-after", "4", env={"TOY_EXACT": "all"}), toggles=())
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.phase in ("idle", "error") and not main.busy
        res = main.result
        assert [p.t for p in res.sub.positions] == [0, 1, 2, 3]  # position 4 never completed
        assert res.first_diff is None and not res.all_ok and res.n_missing > 0
        st = res.comparison.status
        for t in (4, 5):
            assert st[f"t{t}_emb"] is Status.MISSING_SUB and st[f"t{t}_logits"] is Status.MISSING_SUB
        assert all(st[k] is Status.OK for k in ref.hashes(4))
        failed = [m for m in notes(app) if "exited with code 3" in m]
        assert len(failed) == 1 and "\n" not in failed[0]
        assert "after 4 positions" in failed[0] and "failing after position 4 as asked" in failed[0]
        assert "\n" not in main.status.text and f"{res.n_missing} missing" in main.status.text

        # the app keeps going: a move and a rerun work
        before = main.cursor
        await pilot.press("down")
        assert main.cursor != before
        n_runs = len(session.history)
        await pilot.press("r")
        await settle(pilot)
        assert len(session.history) == n_runs + 1 and session.history[-1].change == "rerun"
        assert main.result is not res and main.result.n_missing == res.n_missing


async def test_exit_midway_board_shows_the_rest_missing_not_pending(model, tmp_path, make_app, settle):
    session = toy_session(model, toy("--fail-after", "4", env={"TOY_EXACT": "all"}), toggles=())
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        board = app.main.board
        assert board.cell("t5_emb", 5) is Status.MISSING_SUB
        assert board.position_state(5) == "missing"


async def test_hash_only_subject_all_ok_shows_no_flips(model, tmp_path, make_app, settle):
    session = toy_session(model, toy(env={"TOY_EXACT": "all"}), toggles=())
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.result.all_ok
        assert [main.board.position_state(i) for i in range(main.board.n_positions)] == ["ok"] * (len(PROMPT) + N)
        assert not any(s.flip for s in main.result.tokens)


async def test_hang_times_out_in_one_line_and_the_app_stays_usable(model, tmp_path, make_app, settle):
    pidfile = tmp_path / "pid"
    session = toy_session(model, toy("--hang-after", "3", "--pid-file", str(pidfile), timeout=3), toggles=())
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        t0 = time.monotonic()
        await settle(pilot)
        assert time.monotonic() - t0 < 15
        main = app.main
        assert main.phase in ("idle", "error") and not main.busy
        said = [m for m in notes(app) if "timed out" in m]
        assert len(said) == 1 and "\n" not in said[0]
        assert "timed out after 3 s (timeout); killed it after 3 positions" in said[0]
        assert wait_gone(read_pid(pidfile))
        res = main.result
        assert res is not None and res.n_missing > 0
        assert [p.t for p in res.sub.positions] == [0, 1, 2]  # the prompt; position 3 hung unfinished
        before = main.cursor
        await pilot.press("right")
        assert main.cursor != before
        await pilot.press("f")  # nothing differs: the cursor stays put, no crash


# ---- bisection --------------------------------------------------------------------------------------


async def test_b_bisects_over_the_toys_toggles_to_the_minimal_set(model, ref, tmp_path, make_app, settle):
    chosen = ("norm", "rope", "expf")
    # what each chosen op does alone, with every other op exact: the ops whose fast version breaks it
    needed = {op for op in chosen if sim_hashes(model, ref, frozenset(set(TOGGLES) - {op})) != ref.hashes()}
    assert needed
    toggles = tuple(Toggle(t.name, ("0", "1"), "1", owns=t.owns, key=f"TOY_{t.name.upper()}_EXACT")
                    for t in OP_TOGGLES if t.name in chosen)
    toggles += (Toggle("unused", ("0", "1"), "1", key="TOY_UNUSED"),)  # changes nothing: never in the set
    others = ",".join(op for op in TOGGLES if op not in chosen)
    session = toy_session(model, toy(env={"TOY_EXACT": others}), toggles=toggles)
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.result.first_diff is not None
        await pilot.press("b")
        await settle(pilot)
        assert main.phase == "idle"
        mins = ",".join(op for op in session.binary_toggles if op in needed)
        assert main.status.text.startswith(f"all ok · minimal exact set {mins} · ")
        assert any(m == f"all ok; minimal exact set {mins}" for m in notes(app))
        moves = [h for h in session.history if h.change.startswith("+")]
        assert moves and moves[-1].after is None
        assert main.settings.exact == frozenset(needed) == main.result.settings.exact
        assert main.result.all_ok and main.result.sub.hashes() == ref.hashes()
        assert main.board.first_diff is None and all(main.board.arrived)


async def test_the_header_claims_formats_only_for_the_side_that_runs_them(model, tmp_path, make_app, settle):
    """A process runs its own weights and KV: the header says the formats are the reference's."""
    session = toy_session(model, toy(env={"TOY_EXACT": "all"}), toggles=())
    app = make_app(session, tmp_path)
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(pilot)
        text = app.main.query_one("#header").render().plain
        assert f"{model.fmt}, kv {session.kv} (cpu only)" in text
    builtin = Session(model, PROMPT, N, reference="cpu", subject="sim")
    app = make_app(builtin, tmp_path)
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(pilot)
        text = app.main.query_one("#header").render().plain
        assert f"{model.fmt}, kv {builtin.kv} │" in text and "only)" not in text


async def test_a_hash_only_subject_under_a_tolerance_says_no_verdict(model, tmp_path, make_app, settle):
    """With no raw values no DIFF key can be judged: the status says so instead of 'first far —'."""
    session = toy_session(model, toy(env={"TOY_EXACT": "none"}), toggles=())
    app = make_app(session, tmp_path)
    async with app.run_test(size=(200, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert not main.result.all_ok
        await pilot.press("T")
        await settle(pilot)
        text = main.status.text
        assert "no verdict at nmse=1e-07: the" in text and "DIFF keys are hash-only" in text
        assert "first far" not in text
