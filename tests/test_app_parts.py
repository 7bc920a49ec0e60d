"""The main screen made of parts (kestrel_tui/app/parts/): app modules stay small, each message a part's
worker posts has one part to handle it, diff mode hides every key that needs a model, and the help
screen lists every view's keys."""
from __future__ import annotations

from pathlib import Path

import pytest

from kestrel_tui.app.messages import WorkerMessage
from kestrel_tui.app.screens.help import HelpScreen
from kestrel_tui.app.screens.main import PARTS, RUN_ACTIONS
from kestrel_tui.app.screens.sweep import SweepScreen

from test_app import diff_app, notes, write_dumps

APP = Path(__file__).resolve().parents[1] / "kestrel_tui" / "app"
LIMIT = 400  # lines: a module read in one sitting


def test_every_app_module_is_under_400_lines():
    long = {str(p.relative_to(APP)): n for p in sorted(APP.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) >= LIMIT}
    assert not long, f"app modules of {LIMIT} lines or more: {long}"


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_each_worker_message_has_one_part_to_handle_it():
    messages = [m for m in _subclasses(WorkerMessage) if m.__module__.startswith("kestrel_tui.app")]
    assert len(messages) >= 15  # the decode's, loading's, bisect's, graft's, repro's, export's, tolerance's
    for m in messages:
        if any(issubclass(sub, m) for sub in _subclasses(m)):
            continue  # a base (RunMessage): what is posted is one of its subclasses
        handlers = [p.__name__ for p in PARTS if m.handler_name in vars(p)]
        assert len(handlers) == 1, (m.__name__, handlers)


def test_the_keys_that_run_something_are_the_ones_diff_mode_hides():
    assert {"graft", "repro", "sweep", "bisect", "iso", "toggle", "rerun"} <= RUN_ACTIONS
    assert not {"export", "tolerance", "rank", "move", "first_diff"} & RUN_ACTIONS


@pytest.mark.anyio
async def test_diff_mode_leaves_out_graft_repro_and_sweep(tmp_path, settle):
    app = diff_app(tmp_path, *write_dumps(tmp_path))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        actions = {action for _, _, action in app.main.palette_commands()}
        assert "export" in actions and not {"graft", "repro", "sweep"} & actions
        await pilot.press("g", "w", "s")  # keys for runs over two dump files: nothing happens, nothing to say
        await settle(pilot)
        assert app.screen is app.main and notes(app) == []


@pytest.mark.anyio
async def test_help_lists_the_sweep_views_keys(tmp_path, settle):
    app = diff_app(tmp_path, *write_dumps(tmp_path))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        rows = {(section, what) for section, _, what in app.screen._rows()}
        for b in SweepScreen.BINDINGS:
            assert ("sweep view", b.tooltip) in rows


@pytest.mark.anyio
async def test_help_names_schedules_their_toggle_and_the_mismatch_view(tmp_path, settle):
    import io

    from rich.console import Console

    from kestrel_tui.app.screens.mismatch import MismatchScreen
    from kestrel_tui.engines.schedule import GRAMMAR

    app = diff_app(tmp_path, *write_dumps(tmp_path))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        rows = {(section, what) for section, _, what in app.screen._rows()}
        for b in MismatchScreen.BINDINGS:
            assert ("mismatch view", b.tooltip) in rows
        assert any(section == "main" and what.startswith("logprob mismatch view") for section, what in rows)
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(app.screen._text())
        text = " ".join(console.export_text().split())
        assert GRAMMAR in text and "schedule toggle" in text and "L opens its view" in text
