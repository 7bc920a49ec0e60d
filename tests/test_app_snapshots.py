"""Snapshot tests of the main screen (pytest-textual-snapshot).

The default 48-layer model with the sim subject, after the first run has
finished: nothing on screen depends on time, so the SVGs are repeatable.
Update the baselines with `pytest tests/test_app_snapshots.py --snapshot-update`
and look at the SVGs in tests/__snapshots__/ before committing them.
"""
from __future__ import annotations

import pytest

from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import Session


N_TOKENS = 8


def app_on(make_app, model, tmp_path):
    return make_app(Session(model, default_prompt(model.cfg.vocab), N_TOKENS, subject="sim"), tmp_path)


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])
def test_main_screen(snap_compare, default_model, tmp_path, size, make_app, settle):
    assert snap_compare(app_on(make_app, default_model, tmp_path), terminal_size=size, run_before=settle)


def test_main_screen_after_toggles(snap_compare, small_model, tmp_path, make_app, settle):
    """Two toggles later: the history panel, the toggles panel and the moved first DIFF."""
    async def run_before(pilot):
        await settle(pilot)
        for key in ("1", "2"):
            await pilot.press(key)
            await settle(pilot)

    assert snap_compare(app_on(make_app, small_model, tmp_path), terminal_size=(120, 40), run_before=run_before)


def test_main_screen_too_small(snap_compare, small_model, tmp_path, make_app, settle):
    """Below 80x24: one centred line asking for room, instead of panels that cannot fit."""
    assert snap_compare(app_on(make_app, small_model, tmp_path), terminal_size=(60, 20), run_before=settle)


def test_main_screen_tolerance(snap_compare, small_model, tmp_path, make_app, settle):
    """Tolerance on (T once: nmse <= 1e-7): DIFF keys read close/far, the status names the first far key
    and the detail panel shows the first DIFF's NMSE, max rel. err, max ULP and verdict."""
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("T")
        await settle(pilot)

    assert snap_compare(app_on(make_app, small_model, tmp_path), terminal_size=(120, 40), run_before=run_before)


def test_mismatch_view(snap_compare, small_model, tmp_path, make_app, settle):
    """L after a run of sim in the forward schedule: the log-ratio histogram with the clip bands marked,
    the figures, the worst token and the first DIFF (no tolerance on)."""
    from kestrel_tui.engines.base import EngineSpec
    from kestrel_tui.engines.build import make_engine

    async def run_before(pilot):
        await settle(pilot)
        pilot.app.clear_notifications()  # the note that the schedule prefills itself: a toast times out
        await pilot.press("L")
        await settle(pilot)

    sub = make_engine(EngineSpec("sim", options={"schedule": "forward"}), small_model)
    session = Session(small_model, default_prompt(small_model.cfg.vocab), N_TOKENS, subject=sub)
    assert snap_compare(make_app(session, tmp_path), terminal_size=(120, 40), run_before=run_before)
