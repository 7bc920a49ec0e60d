"""The logprob mismatch view (L): the histogram of a run's log-ratios against the tally's, the worst-token
and first-far jumps, the SVG export (never over a file), a run without logits, and the bins' bands."""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from kestrel_tui.app.screens import mismatch as mismatch_screen
from kestrel_tui.app.screens.mismatch import MISMATCH_SVG, NO_LOGITS, MismatchScreen, write_mismatch
from kestrel_tui.app.screens.main import MainScreen
from kestrel_tui.app.widgets.histogram import Histogram, bin_spans, edge_rows, histogram_bins, representative
from kestrel_tui.engines.base import EngineSpec
from kestrel_tui.engines.build import make_engine
from kestrel_tui.errors import UsageError
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import Session
from kestrel_tui.trace.keys import logits_key
from kestrel_tui.trace.logprobs import CLIP_BANDS, MismatchTally, bin_labels, bin_of

from test_app import notes

N_TOKENS = 4
SVG = "{http://www.w3.org/2000/svg}"


def forward_session(model) -> Session:
    """cpu reference, sim subject scoring every position in one forward pass."""
    sub = make_engine(EngineSpec("sim", options={"schedule": "forward"}), model)
    return Session(model, default_prompt(model.cfg.vocab), N_TOKENS, subject=sub)


async def open_view(pilot, settle) -> MismatchScreen:
    await settle(pilot)
    await pilot.press("L")
    await settle(pilot)
    screen = pilot.app.screen
    assert isinstance(screen, MismatchScreen)
    return screen


# ---- the bins ------------------------------------------------------------------------------------


def test_bin_spans_are_the_tallys_bins():
    """Each bin's interval holds values bin_of puts in that bin: the view's classes follow logprobs.py's edges."""
    spans = bin_spans()
    assert len(spans) == len(bin_labels())
    reps = np.array([representative(s) for s in spans])
    assert list(bin_of(reps)) == list(range(len(spans)))


def test_each_bin_is_marked_by_the_clip_bands_it_lies_outside():
    kinds = {b.label: b.kind for b in histogram_bins([0] * len(bin_labels()))}
    assert kinds["= 0"] == "bitwise" and kinds["NaN"] == "nan"
    for label, span in zip(bin_labels(), bin_spans()):
        if kinds[label] in ("bitwise", "nan"):
            continue
        r = math.exp(representative(span))
        outside = sum(not (lo <= r <= hi) for lo, hi in CLIP_BANDS)
        assert kinds[label] == ("inside", "narrow", "wide")[outside], label
    assert [v for v, _ in edge_rows()] == sorted(v for band in CLIP_BANDS for v in band)


# ---- the SVG ---------------------------------------------------------------------------------------


def tally_of(log_ratios) -> MismatchTally:
    t = MismatchTally()
    t.add([0.0] * len(log_ratios), log_ratios)
    return t


def test_the_svg_has_a_bar_per_bin_with_its_count_and_the_band_edges(tmp_path):
    t = tally_of([0.0, 0.0, -0.15, 0.3, 2.0, math.nan, 1e-5])

    class M:  # what write_mismatch reads of a RunMismatch
        tally = t

        def as_dict(self):
            return t.figures()

    write_mismatch(tmp_path, M(), "a <title> & more")
    root = ET.parse(tmp_path / MISMATCH_SVG).getroot()
    assert root.tag == f"{SVG}svg"
    bars = [r for r in root.iter(f"{SVG}rect") if "bar" in r.get("class", "").split()]
    assert [b.get("data-bin") for b in bars] == bin_labels()
    assert [int(b.get("data-count")) for b in bars] == t.histogram
    edges = [e for e in root.iter(f"{SVG}line") if e.get("class") == "band-edge"]
    assert sorted(float(e.get("data-log-ratio")) for e in edges) == sorted(math.log(v) for b in CLIP_BANDS for v in b)
    assert {e.get("data-band") for e in root.iter(f"{SVG}rect") if e.get("class") == "band"} == \
        {f"{lo:g}, {hi:g}" for lo, hi in CLIP_BANDS}
    assert "a <title> & more" in "".join(root.itertext())


def test_the_export_never_writes_over_a_file(tmp_path):
    t = tally_of([0.1])

    class M:
        tally = t

        def as_dict(self):
            return t.figures()

    (tmp_path / MISMATCH_SVG).write_text("kept")
    with pytest.raises(UsageError):
        write_mismatch(tmp_path, M(), "x")
    assert (tmp_path / MISMATCH_SVG).read_text() == "kept"


# ---- the view --------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_view_shows_the_runs_tally_and_exports_it(small_model, tmp_path, make_app, settle):
    app = make_app(forward_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_view(pilot, settle)
        mm = app.main.result.mismatch
        assert mm is not None and mm.tally.tokens == N_TOKENS + 1
        shown = screen.query_one(Histogram).bins
        assert [b.label for b in shown] == bin_labels()
        assert [b.count for b in shown] == mm.tally.histogram
        assert f"position {mm.worst_position}" in str(screen.query_one("#mismatch-worst").render())

        await pilot.press("x")
        await settle(pilot)
        first = screen.last_export
        assert first is not None and (first / MISMATCH_SVG).is_file() and (first / "screenshot.svg").is_file()
        root = ET.parse(first / MISMATCH_SVG).getroot()
        bars = [r for r in root.iter(f"{SVG}rect") if "bar" in r.get("class", "").split()]
        assert [int(b.get("data-count")) for b in bars] == mm.tally.histogram
        before = (first / MISMATCH_SVG).read_bytes()
        await pilot.press("x")  # a second export: a folder of its own, the first left as it was
        await settle(pilot)
        assert screen.last_export != first and (first / MISMATCH_SVG).read_bytes() == before


@pytest.mark.anyio
async def test_a_failed_export_says_its_error_in_one_line(small_model, tmp_path, make_app, settle, monkeypatch):
    def fail(folder, mismatch, title):
        raise OSError("no space left\nsecond line")

    monkeypatch.setattr(mismatch_screen, "write_mismatch", fail)
    app = make_app(forward_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_view(pilot, settle)
        await pilot.press("x")
        await settle(pilot)
        [folder] = (tmp_path / "exports").iterdir()
        assert screen.last_export is None and not screen.busy
        assert str(screen.query_one("#mismatch-status").render()) == \
            f"export failed: no space left (the unfinished export is {folder})"
        assert notes(app)[-1] == "no space left"


@pytest.mark.anyio
async def test_w_puts_the_grids_cursor_on_the_worst_token(small_model, tmp_path, make_app, settle):
    app = make_app(forward_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await open_view(pilot, settle)
        main = app.main
        main.home()
        worst = main.result.mismatch.worst_position
        assert worst is not None and worst != 0
        await pilot.press("w")
        await pilot.pause()
        assert isinstance(app.screen, MainScreen)
        assert main.board.key(main.cursor.t, main.cursor.row, main.cursor.col) == logits_key(worst)


@pytest.mark.anyio
async def test_F_puts_the_grids_cursor_on_the_first_far_key(small_model, tmp_path, make_app, settle):
    app = make_app(forward_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("T")  # a tolerance on: the DIFF keys are judged
        screen = await open_view(pilot, settle)
        main = app.main
        far = main.board.tolerance.first_far
        assert far is not None
        assert f"first far key: {far}\n" in str(screen.query_one("#mismatch-worst").render())
        main.home()
        await pilot.press("F")
        await pilot.pause()
        assert isinstance(app.screen, MainScreen)
        assert main.board.key(main.cursor.t, main.cursor.row, main.cursor.col) == far


@pytest.mark.anyio
async def test_a_run_without_logits_says_so_in_one_line(small_model, tmp_path, make_app, settle, monkeypatch):
    app = make_app(forward_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        monkeypatch.setattr(type(app.main.result), "mismatch", property(lambda self: None))
        screen = await open_view(pilot, settle)
        assert str(screen.query_one("#mismatch-status").render()) == NO_LOGITS
        assert screen.query_one(Histogram).bins == ()
        await pilot.press("x")
        await settle(pilot)
        assert screen.last_export is None and NO_LOGITS in notes(app)
