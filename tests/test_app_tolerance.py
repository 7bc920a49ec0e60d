"""The tolerance key (T): DIFF keys read close/far after a run, the status names the first far key,
the detail panel shows NMSE / max rel. err / max ULP, and the cycle ends back at the plain DIFF view."""
from __future__ import annotations

import pytest

from kestrel_tui.app.parts.tolerance import TOLERANCES
from kestrel_tui.app.state import Cursor
from kestrel_tui.app.widgets.grid import cell_text
from kestrel_tui.session.session import RunSettings
from kestrel_tui.trace.compare import CLOSE, FAR, NAN_ULP, Status, Tolerance
from kestrel_tui.trace.dump import write_dump

from test_app import diff_app, make_session, notes, screen_text

pytestmark = pytest.mark.anyio


def grid_texts(main) -> dict[str, str]:
    """What the grid writes in each DIFF key's cell (cell_text of the board's status and verdict)."""
    board = main.board
    out = {}
    for key, st in board.status.items():
        if st is Status.DIFF:
            out[key] = cell_text(board.cell(key, board.slot(int(key.split("_")[0][1:]))), board.sides,
                                 board.verdict(key))
    return out


def ulp_text(m) -> str:
    return "NaN" if m.max_ulp == NAN_ULP else str(m.max_ulp)


def detail_text(main, key: str) -> str:
    c = main.board.locate(key)
    main._set_cursor(Cursor(c.t, c.row, c.col if c.col >= 0 else main.cursor.col))
    panel = main.query_one("#detail")
    return str(panel.render())


async def test_tolerance_cycle(small_model, tmp_path, make_app, settle):
    assert TOLERANCES == (None, Tolerance(), Tolerance(nmse=1e-4), Tolerance(nmse=None, ulp=4))
    engine = make_session(small_model).run(RunSettings())  # independent: what the engine says
    app = make_app(make_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        plain = main.status.text
        assert set(grid_texts(main).values()) == {"DIFF"}  # off by default: today's view
        assert "first far" not in plain

        for tol in TOLERANCES[1:]:
            await pilot.press("T")
            await settle(pilot)
            assert main.tolerance == tol
            want = engine.tolerance(tol)
            assert want.first_far is not None
            texts = grid_texts(main)
            assert set(texts.values()) <= {CLOSE, FAR}
            assert {k for k, v in texts.items() if v == FAR} == {k for k, v in want.verdict.items() if v == FAR}
            assert sum(v == CLOSE for v in texts.values()) == want.n_close
            cause = engine.cause_of(want.first_far)  # the event the first far key follows, named with it
            after = f" (after {cause.short})" if cause is not None else ""
            assert main.status.text.startswith(f"first DIFF {engine.first_diff} · first far {want.first_far}{after}"
                                               f" at {tol.spec()} · {want.n_close} close · {want.n_far} far ·")
            far = detail_text(main, want.first_far)
            m = want.metrics[want.first_far]
            assert f"far nmse {m.nmse:.3g} rel {m.max_rel_err:.3g} ulp {ulp_text(m)}" in far
            assert "first far" in far

        assert engine.tolerance(TOLERANCES[2]).n_close > 0  # the cycle did show some "close" cells

        await pilot.press("T")  # back to off
        await settle(pilot)
        assert main.tolerance is None and main.board.tolerance is None
        assert set(grid_texts(main).values()) == {"DIFF"}
        assert main.status.text == plain
        assert "nmse" not in detail_text(main, engine.first_diff)


async def test_tolerance_close_key_detail_and_new_run_drops_it(small_model, tmp_path, make_app, settle):
    engine = make_session(small_model).run(RunSettings())
    tol = TOLERANCES[2]  # nmse <= 1e-4: many close keys
    want = engine.tolerance(tol)
    app = make_app(make_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        for _ in range(2):
            await pilot.press("T")
        await settle(pilot)
        close = next(k for k, v in want.verdict.items() if v == CLOSE)
        text = detail_text(main, close)
        m = want.metrics[close]
        assert f"close nmse {m.nmse:.3g} rel {m.max_rel_err:.3g} ulp {ulp_text(m)}" in text
        assert cell_text(Status.DIFF, main.board.sides, main.board.verdict(close)) == "close"

        old = main.board.tolerance
        main.start_run()  # a new run drops the old verdicts at once...
        assert main.board.tolerance is None and "first far" not in main.status.text
        await settle(pilot)
        assert main.board.tolerance is not old and main.board.tolerance.tolerance == tol  # ...and is judged
        await pilot.press("1")  # a toggle reruns: judged again when it ends
        await settle(pilot)
        again = make_session(small_model).run(RunSettings(exact=frozenset({"norm"}))).tolerance(tol)
        assert main.board.tolerance is not None and main.board.first_far == again.first_far
        assert f"first far {again.first_far}" in main.status.text


async def test_tolerance_diff_mode_says_hash_only_once(small_model, tmp_path, settle):
    ref = make_session(small_model).reference()
    sub = make_session(small_model).run(RunSettings()).sub
    pa, pb = tmp_path / "a.txt", tmp_path / "b.txt"
    write_dump(pa, ref.hashes().items())
    write_dump(pb, sub.hashes().items())
    app = diff_app(tmp_path, pa, pb)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        before = main.status.text
        for _ in range(3):
            await pilot.press("T")
            await settle(pilot)
        assert sum("hash-only dumps" in n for n in notes(app)) == 1
        assert main.tolerance is None and main.status.text == before
        assert "DIFF" in screen_text(app)


async def test_tolerance_in_palette_and_help(small_model, tmp_path, make_app, settle):
    app = make_app(make_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        cmds = app.main.palette_commands()
        assert any(action == "tolerance" and "key T" in help_ for _, help_, action in cmds)
        await pilot.press("question_mark")
        await pilot.pause()
        text = screen_text(app)
        assert "cycle the tolerance" in text and "close" in text


async def test_a_profiles_tolerance_is_on_when_the_app_opens(tmp_path, settle):
    """The profile's `tolerance` is what the app judges with from its first run (as --tol is for `run`),
    and it joins the T cycle right after off."""
    from kestrel_tui.app.app import KestrelApp
    from kestrel_tui.app.source import LiveSource, config_loader
    from kestrel_tui.session.inputs import run_config

    prof = tmp_path / "p.toml"
    prof.write_text('tolerance = "nmse=1e-5,ulp=64"\ntokens = 2\nprompt_ids = [1, 2]\n'
                    '[reference]\nengine = "cpu"\n[subject]\nengine = "sim"\n')
    config = run_config(profile=str(prof), cpu_impl="numpy", no_cache=True)
    app = KestrelApp(LiveSource(config_loader(config)), export_dir=tmp_path / "exports")
    want = Tolerance(nmse=1e-5, ulp=64)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.tolerance == want and main.board.tolerance.tolerance == want
        assert f"at {want.spec()}" in main.status.text
        await pilot.press("T")
        await settle(pilot)
        assert main.tolerance == TOLERANCES[1]  # then the built-in cycle
        for _ in range(len(TOLERANCES) - 1):
            await pilot.press("T")
        await settle(pilot)
        assert main.tolerance is None  # off, and the next press comes back to the profile's
        await pilot.press("T")
        assert main.tolerance == want
