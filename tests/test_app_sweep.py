"""The sweep screen: a snapshot of the table and the chart, its export, and the chart's drawing.

The snapshot sweeps the batch-verify width M 1..8 on the sim, all fast, on a 2-layer model: a dot at
M=1 (every logit's bits equal), bars from M=2 on, the changes marked. Update the baseline with
`pytest tests/test_app_sweep.py --snapshot-update` and look at the SVG before committing it.
"""
from __future__ import annotations

import json
import math

import pytest

from kestrel_tui.app.screens import sweep as sweep_screen
from kestrel_tui.app.screens.sweep import SWEEP_JSON, SWEEP_SVG, SweepScreen
from kestrel_tui.app.widgets.chart import MARK, MISSING, ZERO, Point, bar_eighths, chart_lines, chart_svg, decades
from kestrel_tui.model.config import default_config
from kestrel_tui.model.weights import synthetic_model
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import Session

from test_app import notes


@pytest.fixture(scope="module")
def tiny():
    return synthetic_model(default_config().with_layers(2), "q4_0")


def _app(make_app, model, tmp_path):
    return make_app(Session(model, default_prompt(model.cfg.vocab, 4), 8, subject="sim"), tmp_path)


def _open_sweep(settle, **kw):
    async def run_before(pilot):
        await settle(pilot)
        main = pilot.app.main
        pilot.app.push_screen(SweepScreen(main.session, main.settings, "m", range(1, 9), lock=main.run_lock, **kw))
        await settle(pilot)
    return run_before


def test_sweep_screen(snap_compare, tiny, tmp_path, make_app, settle):
    assert snap_compare(_app(make_app, tiny, tmp_path), terminal_size=(120, 40), run_before=_open_sweep(settle))


@pytest.mark.anyio
async def test_sweep_screen_rows_and_export(tiny, tmp_path, make_app, settle):
    app = _app(make_app, tiny, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await _open_sweep(settle)(pilot)
        screen = app.screen
        assert isinstance(screen, SweepScreen)
        result = screen.result
        assert [r.value for r in screen.rows] == list(range(1, 9)) == list(result.values)
        assert screen.query_one("#sweep-table").row_count == 8
        await pilot.press("x")
        await settle(pilot)
        folder = screen.last_export
        assert folder is not None and not folder.name.endswith(".partial")
        data = json.loads((folder / SWEEP_JSON).read_text())
        assert data == json.loads(json.dumps(result.as_dict()))
        svg = (folder / SWEEP_SVG).read_text()
        assert svg.startswith("<svg") and svg.count(MARK) == len(result.changes)
        assert (folder / "screenshot.svg").read_text().startswith("<svg")
        await pilot.press("w")  # the next setting: the table starts again
        await settle(pilot)
        assert screen.what != "m" and screen.result is not None and screen.result.what == screen.what
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.main


@pytest.mark.anyio
async def test_a_failed_sweep_export_says_its_error_in_one_line(tiny, tmp_path, make_app, settle, monkeypatch):
    def fail(folder, result):
        raise OSError("no space left\nsecond line")

    monkeypatch.setattr(sweep_screen, "write_sweep", fail)
    app = _app(make_app, tiny, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        app.push_screen(SweepScreen(main.session, main.settings, "m", range(1, 3), lock=main.run_lock))
        await settle(pilot)
        screen = app.screen
        await pilot.press("x")
        await settle(pilot)
        [folder] = (tmp_path / "exports").iterdir()
        assert screen.last_export is None and not screen.busy
        assert str(screen.query_one("#sweep-status").render()) == \
            f"export failed: no space left (the unfinished export is {folder})"
        assert notes(app)[-1] == "no space left"


def test_chart_draws_zero_as_a_dot_and_marks_the_changes():
    pts = [Point("1", 0.0, False), Point("2", 1e-14, True), Point("3", 1e-3, False), Point("4", None, True)]
    assert decades(pts) == (-14, -3)
    lines = chart_lines(pts, rows=4)
    text = ["".join(piece for piece, _ in line) for line in lines]
    axis, labels, marks = text[-3], text[-2], text[-1]
    assert axis.count(ZERO) == 1 and axis.count(MISSING) == 1
    assert marks.count(MARK) == 2
    assert labels.split() == ["1", "2", "3", "4"]
    # the columns: 1 has no bar, 2 the smallest visible one, 3 reaches the top row
    top = lines[0]
    assert top[3][0].strip() == "█" and top[1][0].strip() == "" and top[2][0].strip() == ""
    assert lines[3][2][0].strip() != ""  # the bottom row holds 2's bar


def test_bar_heights_follow_the_log_scale():
    lo, hi, rows = -12, -2, 5
    heights = [bar_eighths(10.0 ** e, lo, hi, rows) for e in range(lo, hi + 1)]
    assert heights == sorted(heights) and heights[0] == 1 and heights[-1] == rows * 8
    assert bar_eighths(math.inf, lo, hi, rows) == rows * 8


def test_chart_svg_is_inert_and_whole():
    svg = chart_svg("t<&>", [Point("a<b>\x1b[2J", 1e-5, True), Point("c", 0.0, False)])
    assert "<b>" not in svg and "\x1b" not in svg and "t&lt;&amp;&gt;" in svg
    assert svg.strip().endswith("</svg>") and svg.count(MARK) == 1
