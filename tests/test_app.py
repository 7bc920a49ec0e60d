"""Pilot tests: the real app, headless, with the sim subject.

Most tests use the 4-layer model (conftest `small_model`) and few tokens so a
run takes a fraction of a second; the app gets a ready Session through the
same loader path the CLI uses.
"""
from __future__ import annotations

import asyncio
import errno
import html
import json
import re
import threading
import time
from types import SimpleNamespace
from pathlib import Path

import pytest

from kestrel_tui.app.app import KestrelApp
from kestrel_tui.session import inputs
from kestrel_tui.app import export
from kestrel_tui.app.export import new_export_dir, publish
from kestrel_tui.app.screens.help import HelpScreen
from kestrel_tui.app.screens.iso import IsoScreen
from kestrel_tui.app.source import DiffSource, LiveSource, config_loader, loaded
from kestrel_tui.session.inputs import RunConfig, run_config
from kestrel_tui.app.state import Cursor
from kestrel_tui.app.widgets.grid import LABEL_W, STEP, cell_text
from kestrel_tui.backends.toggles import TOGGLES
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.engines.build import make_backend
from kestrel_tui.session.iso import iso
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.errors import UsageError
from kestrel_tui.trace.compare import Status, compare
from kestrel_tui.trace.dump import read_dump, write_dump
from kestrel_tui.trace.keys import emb_key, key_name, logits_key, order_key, token_keys


N_TOKENS = 4

pytestmark = pytest.mark.anyio  # async tests run on anyio's pytest plugin (installed with httpx/textual deps)


def make_session(model, n_tokens=N_TOKENS, cls=Session):
    return cls(model, default_prompt(model.cfg.vocab), n_tokens, subject="sim")


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


def svg_text(svg: str) -> str:
    """The text an SVG screenshot shows: its terminal's text runs (not the window title), unescaped."""
    runs = re.findall(r"<text[^>]*clip-path[^>]*>(.*?)</text>", svg, re.S)
    return html.unescape("".join(runs)).replace("\xa0", " ")


def screen_text(app) -> str:
    return svg_text(app.export_screenshot())


def diff_app(tmp_path: Path, pa, pb) -> KestrelApp:
    """The diff --tui app over two dump files."""
    return KestrelApp(DiffSource(str(pa), str(pb), read_dump(pa), read_dump(pb)), export_dir=tmp_path / "exports")


# ---- toggles ---------------------------------------------------------------


async def test_toggle_key_moves_first_diff_where_engine_says(small_model, tmp_path, make_app, settle):
    session = make_session(small_model)
    engine = make_session(small_model)  # an independent session: what the engine says directly
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        expect0 = engine.run(RunSettings()).first_diff
        assert expect0 is not None
        assert main.board.first_diff == expect0 == main.result.first_diff
        assert main.board.key(main.cursor.t, main.cursor.row, main.cursor.col) == expect0  # cursor follows

        exact: set[str] = set()
        for key, op in (("1", "norm"), ("2", "gemm")):
            await pilot.press(key)
            await settle(pilot)
            exact.add(op)
            want = engine.run(RunSettings(exact=frozenset(exact))).first_diff
            assert main.settings.exact == frozenset(exact)
            assert main.result.settings.exact == frozenset(exact)
            assert main.board.first_diff == want == main.result.first_diff
            assert order_key(want) > order_key(expect0)  # it moved later
            assert main.board.key(main.cursor.t, main.cursor.row, main.cursor.col) == want
            entry = session.history[-1]
            assert (entry.change, entry.after) == (f"+{op}", want)
            assert f"first DIFF {want}" in main.status.text
        # the board agrees with the engine key by key
        cmp = main.result.comparison
        assert all(main.board.status[k] is s for k, s in cmp.status.items())


async def test_switches_and_all_exact(small_model, tmp_path, make_app, settle):
    app = make_app(make_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        await pilot.press("m")
        await settle(pilot)
        assert main.result.settings.mode == "isolate"
        await pilot.press("m", "p", "t")  # each press cancels the previous run and reruns
        await settle(pilot)
        s = main.result.settings
        assert (s.mode, s.prefill, s.forcing) == ("chain", "subject", "free")
        await pilot.press("a")
        await settle(pilot)
        assert main.result.settings.exact == frozenset(TOGGLES)
        await pilot.press("0")
        await settle(pilot)
        assert main.result.settings.exact == frozenset()


async def test_history_counts_changes_not_words(small_model, tmp_path, make_app, settle):
    """Two switches in one run (the first run cancelled by the second key) are two changes."""
    gate = threading.Event()
    session = make_session(small_model, cls=gated_session_class(gate, after=17))
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        main = app.main
        gate.set()
        await settle(pilot)
        gate.clear()
        await pilot.press("m")
        await wait_for(pilot, lambda: main.phase == "running" and sum(main.board.arrived) >= 17)
        await pilot.press("p")  # cancels the "m" run: the next entry holds both switches
        gate.set()
        await settle(pilot)
        assert [h.change for h in session.history] == ["start", "mode isolate prefill subject"]
        shown = screen_text(app)
        assert "2 changes" in shown and "4 changes" not in shown

# ---- bisection ---------------------------------------------------------------


async def test_bisect_ends_all_ok(small_model, tmp_path, make_app, settle):
    session = make_session(small_model)
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.board.first_diff is not None
        n_before = len(session.history)
        await pilot.press("b")
        await settle(pilot)
        assert main.result.all_ok
        assert main.board.first_diff is None and main.board.complete
        assert all(s is Status.OK for s in main.board.status.values())
        moves = session.history[n_before:]
        assert moves and all(m.change.startswith("+") for m in moves)
        assert moves[-1].after is None  # the last move reached all ok
        shown = app.main.query_one("HistoryPanel").entries
        assert shown[-len(moves):] == moves
        assert main.settings == main.result.settings  # the toggles panel shows the minimal set
        assert "all ok" in main.status.text


async def test_bisect_moves_appear_as_they_happen(small_model, tmp_path, make_app, settle):
    app = make_app(make_session(small_model), tmp_path)
    seen: list[tuple[str, int]] = []
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        panel = app.main.query_one("HistoryPanel")
        show = panel.show

        def spy(entries):  # record what the panel was given, and when
            seen.append((app.main.phase, len(entries)))
            show(entries)
        panel.show = spy
        await pilot.press("b")
        await settle(pilot)
    during = [n for phase, n in seen if phase == "bisecting"]
    # one update per move while bisection was still running, each with one entry more
    assert len(during) >= 2 and during == sorted(during) and len(set(during)) == len(during)


# ---- export ------------------------------------------------------------------


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


async def test_export_complete_and_never_overwrites(small_model, tmp_path, make_app, settle):
    session = make_session(small_model)
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        await pilot.press("x")
        await settle(pilot)
        first = main.last_export
        assert first is not None and first.parent == tmp_path / "exports"
        assert str(first) in main.status.text  # the path is shown
        files = folder_bytes(first)
        assert set(files) == {"reference.dump", "subject.dump", "report.json", "screenshot.svg"}
        res = main.result
        assert read_dump(first / "reference.dump") == res.ref.hashes()
        assert read_dump(first / "subject.dump") == res.sub.hashes()
        report = json.loads(files["report.json"])
        assert report["first_diff"] == res.first_diff
        assert report["settings"]["exact"] == []
        assert report["toggles"] == {op: "fast" for op in TOGGLES}
        assert report["model"]["n_layers"] == 4
        assert report["status"] == {k: s.value for k, s in res.comparison.status.items()}
        diff_keys = [k for k, s in res.comparison.status.items() if s is Status.DIFF]
        assert set(report["diff_stats"]) == set(diff_keys)
        st = report["diff_stats"][res.first_diff]
        assert st["n_diff"] > 0 and st["max_ulp"] > 0
        assert [h["change"] for h in report["history"]] == ["start"]
        assert files["screenshot.svg"].startswith(b"<svg")

        await pilot.press("1")
        await settle(pilot)
        await pilot.press("x")
        await settle(pilot)
        second = main.last_export
        assert second != first and second.exists()
        assert folder_bytes(first) == files  # untouched
        report2 = json.loads((second / "report.json").read_text())
        assert report2["settings"]["exact"] == ["norm"]
        assert [h["change"] for h in report2["history"]] == ["start", "+norm"]


def test_new_export_dir_picks_another_name(tmp_path):
    from datetime import datetime

    now = datetime(2025, 1, 2, 3, 4, 5)
    a = new_export_dir(tmp_path, now)
    (a / "keep").write_text("x")
    b = new_export_dir(tmp_path, now)
    assert a != b and a.name == "20250102-030405-1.partial" and b.name == "20250102-030405-2.partial"
    done = publish(a)
    assert done.name == "20250102-030405-1" and (done / "keep").read_text() == "x" and not a.exists()
    # neither a finished folder nor one left unfinished is ever reused
    assert new_export_dir(tmp_path, now).name == "20250102-030405-3.partial"
    # a folder that took the finished name meanwhile is not replaced
    (tmp_path / "20250102-030405-2" / "theirs").mkdir(parents=True)
    with pytest.raises(UsageError, match="appeared"):
        publish(b)
    assert b.exists() and (tmp_path / "20250102-030405-2" / "theirs").is_dir()


async def test_export_refused_while_running(small_model, tmp_path, make_app, settle):
    gate = threading.Event()
    app = make_app(make_session(small_model, cls=gated_session_class(gate, after=2)), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: sum(app.main.board.arrived) >= 2)
        await pilot.press("x")
        assert any("nothing finished to export" in n for n in notes(app))
        gate.set()
        await settle(pilot)
        assert not (tmp_path / "exports").exists() or not any((tmp_path / "exports").iterdir())



def no_space(data, f, **kw):
    f.write('{"kestrel_tui": ')  # half a report, then the disk is full
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["report", "screenshot"])
async def test_failed_export_is_never_a_whole_looking_folder(tmp_path, monkeypatch, where, settle):
    app = diff_app(tmp_path, *write_dumps(tmp_path))
    if where == "report":
        monkeypatch.setattr(export, "json", SimpleNamespace(dump=no_space))
        name = "report.json"
    else:
        monkeypatch.setattr(app, "export_screenshot", lambda **kw: "<svg>\ud800</svg>")  # cannot be encoded
        name = "screenshot.svg"
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        await pilot.press("x")
        await settle(pilot)
        [folder] = (tmp_path / "exports").iterdir()
        assert folder.name.endswith(".partial")  # never renamed to the finished name
        assert not (folder / name).exists()  # and no half-written file under its real name
        assert (folder / f"{name}.partial").exists()
        assert main.last_export is None
        assert main.status.text.startswith("export failed") and str(folder) in main.status.text


async def test_failed_export_replaces_exported_status(tmp_path, settle):
    app = diff_app(tmp_path, *write_dumps(tmp_path))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        await pilot.press("x")
        await settle(pilot)
        assert main.status.text.startswith("exported to")
        (tmp_path / "a-file").write_text("")
        main.export_dir = tmp_path / "a-file"  # no folder can be made there
        await pilot.press("x")
        await settle(pilot)
        assert main.status.text.startswith("export failed") and "a-file" in main.status.text


async def test_export_screenshot_leaves_toasts_out(tmp_path, settle):
    app = diff_app(tmp_path, *write_dumps(tmp_path))
    async with app.run_test(size=(120, 40), notifications=True) as pilot:  # run_test hides toasts by default
        await settle(pilot)
        app.notify("TOASTMARKER", timeout=60)
        await wait_for(pilot, lambda: "TOASTMARKER" in screen_text(app))
        await pilot.press("x")
        await settle(pilot)
        shot = svg_text((app.main.last_export / "screenshot.svg").read_text())
        assert "diff mode (no model)" in shot and "TOASTMARKER" not in shot
        assert "TOASTMARKER" in screen_text(app)  # the toast is back on screen

# ---- diff mode ---------------------------------------------------------------


def write_dumps(tmp_path: Path, n_pos=3, n_layers=2):
    keys = [k for t in range(n_pos) for k in token_keys(t, n_layers)]
    a = {k: (i * 0x9E3779B97F4A7C15) % (1 << 64) for i, k in enumerate(keys)}
    b = dict(a)
    b["t1_l1_attn"] ^= 1          # the first DIFF
    b["t2_l0_nrm"] ^= 2           # a later one
    del b["t1_l0_ks"]             # missing in B, before the first DIFF: shown distinctly, not as DIFF
    b["t2_l1_zz"] = 7             # a foreign field only in B
    pa, pb = tmp_path / "a.dump", tmp_path / "b.dump"
    write_dump(pa, a.items())
    write_dump(pb, b.items())
    return pa, pb


async def test_diff_mode_over_two_dump_files(tmp_path, settle):
    pa, pb = write_dumps(tmp_path)
    a, b = read_dump(pa), read_dump(pb)
    assert compare(a, b).first_diff == "t1_l1_attn"
    app = KestrelApp(DiffSource(str(pa), str(pb), a, b), export_dir=tmp_path / "exports")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        board = main.board
        assert board.first_diff == "t1_l1_attn"
        assert board.key(main.cursor.t, main.cursor.row, main.cursor.col) == "t1_l1_attn"
        assert "zz" in board.fields  # the foreign field gets a column
        c = board.locate("t1_l0_ks")
        assert board.cell("t1_l0_ks", 1) is Status.MISSING_SUB
        assert cell_text(Status.MISSING_SUB, board.sides) == "-B"
        assert board.cell("t2_l1_zz", 2) is Status.MISSING_REF
        assert board.cell("t0_l1_zz", 0) is None  # in neither file: blank, not pending
        assert "first DIFF t1_l1_attn" in main.status.text
        # n walks DIFFs and missing keys in dataflow order
        await pilot.press("n")
        assert board.key(main.cursor.t, main.cursor.row, main.cursor.col) == "t2_l0_nrm"
        await pilot.press("N", "N")
        assert main.cursor == Cursor(c.t, c.row, c.col)
        # nothing to run: run keys are inert, the rest works, export writes a snapshot
        await pilot.press("1", "b", "r")
        await settle(pilot)
        assert main.session is None and main.phase == "idle"
        await pilot.press("x")
        await settle(pilot)
        files = folder_bytes(main.last_export)
        assert set(files) == {"a.dump", "b.dump", "report.json", "screenshot.svg"}
        assert read_dump(main.last_export / "b.dump") == b
        assert json.loads(files["report.json"])["first_diff"] == "t1_l1_attn"



async def test_diff_mode_shows_tags_and_paths_as_written(tmp_path, monkeypatch, settle):
    """Tags and paths are data: `[/x]` and `[red]` are shown, never read as markup."""
    monkeypatch.chdir(tmp_path)
    folder = Path("run[/x]/[red]x")  # the folders "run[", "x]", "[red]x"
    folder.mkdir(parents=True)
    keys = token_keys(0, 1)
    a = {k: i + 1 for i, k in enumerate(keys)} | {"a[/b]": 11, "t0_l0_[/x]": 12, "[red]x": 13}
    b = dict(a, **{"a[/b]": 99})
    del b["[red]x"]
    pa, pb = folder / "a.dump", folder / "b.dump"
    write_dump(pa, a.items())
    write_dump(pb, b.items())
    app = KestrelApp(DiffSource(str(pa), str(pb), read_dump(pa), read_dump(pb)), export_dir=tmp_path / "ex[/x]")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.board.first_diff == "a[/b]"
        text = screen_text(app)
        for literal in ("A run[/x]/[red]x/a.dump", "B run[/x]/[red]x/b.dump", "first DIFF a[/b]", "1 only in A",
                        "3 keys outside the grid", "t0 position 1/1"):
            assert literal in text, literal
        await pilot.press("n")  # the only mismatches are foreign tags: no cell to go to
        assert notes(app)[-1] == "no DIFF in the grid (only keys outside it)"
        await pilot.press("x")  # the export folder's path holds "[/x]" too
        await settle(pilot)
        assert main.status.text == f"exported to {main.last_export}" and "ex[/x]" in main.status.text
        assert str(main.last_export) in notes(app)
        assert json.loads((main.last_export / "report.json").read_text())["first_diff"] == "a[/b]"


async def test_diff_grid_is_sized_by_the_positions_present(tmp_path, settle):
    far = (0, 1_000_000_000, 1_000_000_001)
    keys = [k for t in far for k in (emb_key(t), key_name(t, 7, "attn"), logits_key(t))]
    a = {k: i + 1 for i, k in enumerate(keys)} | {"zz[/x]": 1}  # and a foreign tag, outside the grid
    b = dict(a, **{"zz[/x]": 2})
    b["t1000000000_l7_attn"] ^= 1
    pa, pb = tmp_path / "a.dump", tmp_path / "b.dump"
    write_dump(pa, a.items())
    write_dump(pb, b.items())
    start = time.perf_counter()
    app = diff_app(tmp_path, pa, pb)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        board = main.board
        # one slot per position present, one row per layer present: not a cell per index
        assert board.positions == far and len(board.arrived) == len(board.n_diff) == 3
        assert board.rows == ("emb", "L7", "logits")
        assert board.key(main.cursor.t, main.cursor.row, main.cursor.col) == "t1000000000_l7_attn"
        strip = main.query_one("TokenStrip").render().plain.splitlines()
        assert strip[0].startswith("t1000000000 position 2/3")
        assert strip[1].split() == ["✓", "✗", "✓"]
        await pilot.press("right_square_bracket")
        assert main.query_one("TokenStrip").render().plain.startswith("t1000000001 ")
        assert "…000001" in screen_text(app)  # the grid's header names the position by its last digits
        await pilot.press("N")
        assert board.key(main.cursor.t, main.cursor.row, main.cursor.col) == "t1000000000_l7_attn"
        await pilot.press("n")  # steps over the foreign DIFF and wraps round to the only one with a cell
        assert board.key(main.cursor.t, main.cursor.row, main.cursor.col) == "t1000000000_l7_attn"
        assert not notes(app)
    assert time.perf_counter() - start < 10

# ---- errors ------------------------------------------------------------------


def cli_config(**kw) -> RunConfig:
    """The run's settings as the CLI builds them from its options (run_config)."""
    return run_config(**{"tokens": N_TOKENS, "subject": "sim", **kw})


async def test_unreadable_model_dir_shows_message_and_app_stays_usable(small_model, tmp_path, settle):
    app = KestrelApp(LiveSource(config_loader(cli_config(model=str(tmp_path / "no-such-model")))),
                     export_dir=tmp_path / "exports")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.phase == "error"
        assert "no such model directory" in main.status.text
        assert any("no such model directory" in n for n in notes(app))
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert app.screen is main
        await pilot.press("1", "b", "x")
        assert any("no model is loaded" in n for n in notes(app))
        # recover without restarting: load a model in place
        main.load.start(lambda _progress: loaded(make_session(small_model)))
        await settle(pilot)
        assert main.phase == "idle" and main.result is not None


class FailingSession(Session):
    fail = True

    def run(self, *a, **kw):
        if self.fail:
            raise RuntimeError("subject backend exploded [on purpose]")
        return super().run(*a, **kw)


async def test_run_error_shows_message_and_app_stays_usable(small_model, tmp_path, make_app, settle):
    session = make_session(small_model, cls=FailingSession)
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.phase == "error"
        assert "exploded [on purpose]" in main.status.text
        before = main.cursor
        await pilot.press("j")
        assert main.cursor.row == before.row + 1
        session.fail = False
        await pilot.press("r")
        await settle(pilot)
        assert main.phase == "idle" and main.result.first_diff is not None



@pytest.mark.parametrize("kw, why", [(dict(prompt_ids="1,99999"), "outside the vocabulary"),
                                     (dict(tokens=100_000), "exceed the model's context"),
                                     (dict(tokens=0), "must be at least 1")])
async def test_prompt_errors_are_not_called_model_errors(small_model, tmp_path, monkeypatch, kw, why, settle):
    monkeypatch.setattr(inputs, "model_from_options", lambda config, progress=None: small_model)  # loads fine
    app = KestrelApp(LiveSource(config_loader(cli_config(**kw))), export_dir=tmp_path / "exports")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.phase == "error"
        assert main.status.text.startswith("bad prompt or token count: ") and why in main.status.text
        assert [n.title for n in app._notifications] == ["bad prompt or token count"]
        assert "cannot load the model" not in screen_text(app)

# ---- cancellation ------------------------------------------------------------


def gated_session_class(gate: threading.Event, after: int):
    """A Session whose runs stop after `after` positions until the gate opens."""
    class Gated(Session):
        def run(self, settings, on_position=None, cancel=None, **kw):
            def slow(pos, statuses):
                if on_position:
                    on_position(pos, statuses)
                if pos.t + 1 >= after:
                    gate.wait(30)
            return super().run(settings, on_position=slow, cancel=cancel, **kw)
    return Gated


async def wait_for(pilot, cond, timeout=60.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.01)
        await pilot.pause()


async def test_cancel_mid_run(small_model, tmp_path, make_app, settle):
    gate = threading.Event()
    session = make_session(small_model, n_tokens=6, cls=gated_session_class(gate, after=18))
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        main = app.main
        await wait_for(pilot, lambda: main.phase == "running" and sum(main.board.arrived) >= 18)
        assert main.busy and main.status.query_one("#progress").display
        await pilot.press("escape")
        gate.set()
        await settle(pilot)
        assert main.phase == "cancelled"
        assert 18 <= sum(main.board.arrived) < main.board.n_positions  # filled up to the cancel, no further
        assert main.result is None and session.history == []
        assert "cancelled" in main.status.text
        await pilot.press("r")
        await settle(pilot)
        assert main.phase == "idle" and main.board.complete
        assert [h.change for h in session.history] == ["start"]


async def test_toggle_cancels_run_in_flight(small_model, tmp_path, make_app, settle):
    gate = threading.Event()
    session = make_session(small_model, n_tokens=6, cls=gated_session_class(gate, after=18))
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        main = app.main
        await wait_for(pilot, lambda: main.phase == "running" and sum(main.board.arrived) >= 18)
        await pilot.press("1")  # cancels the blocked run and queues a new one behind it
        gate.set()
        await settle(pilot)
        assert main.phase == "idle"
        assert main.result.settings.exact == frozenset({"norm"})
        # the cancelled run left no history; the finished one is the first
        assert [h.change for h in session.history] == ["start"]
        assert session.history[0].settings.exact == frozenset({"norm"})


async def test_cancel_bisection_restores_settings(small_model, tmp_path, make_app, settle):
    gate = threading.Event()
    session = make_session(small_model, cls=gated_session_class(gate, after=17))
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        main = app.main
        gate.set()
        await settle(pilot)
        before = main.result
        gate.clear()
        await pilot.press("b")  # the first trial run blocks at the gate
        await wait_for(pilot, lambda: main.phase == "bisecting")
        await pilot.press("escape")
        gate.set()
        await settle(pilot)
        assert main.phase == "cancelled"
        assert main.settings == RunSettings() and main.result is before  # toggles match the grid again
        assert "bisection cancelled" in main.status.text
        assert main.query_one("#grid-box").border_title == "hash grid"


# ---- navigation, help, palette, iso -------------------------------------------


async def test_navigation_keys(small_model, tmp_path, make_app, settle):
    app = make_app(make_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        board = main.board
        first = main.cursor
        await pilot.press("j")
        assert main.cursor == Cursor(first.t, first.row + 1, first.col)
        await pilot.press("k", "down", "up")
        assert main.cursor == first
        await pilot.press("l", "right")
        assert main.cursor.col == first.col + 2
        await pilot.press("h", "left")
        assert main.cursor.col == first.col
        await pilot.press("right_square_bracket")
        assert main.cursor.t == first.t + 1
        await pilot.press("left_square_bracket", "left_square_bracket")
        assert main.cursor.t == first.t - 1
        await pilot.press("f")
        assert board.key(main.cursor.t, main.cursor.row, main.cursor.col) == board.first_diff
        await pilot.press("n")
        k = board.key(main.cursor.t, main.cursor.row, main.cursor.col)
        assert k == board.mismatches[1]
        await pilot.press("N")
        assert board.key(main.cursor.t, main.cursor.row, main.cursor.col) == board.first_diff
        for _ in range(60):  # clamps at the edges
            await pilot.press("k")
        assert main.cursor.row == 0
        await pilot.press("pagedown")
        assert main.cursor.row == min(10, len(board.rows) - 1)
        # a click selects the cell under the mouse (line 0 is the sticky header)
        await pilot.click("#grid", offset=(LABEL_W + 2 * STEP + 1, 3))
        assert (main.cursor.row, main.cursor.col) == (2, 2)


async def test_help_lists_every_binding(small_model, tmp_path, make_app, settle):
    app = make_app(make_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        rows = app.screen._rows()
        described = {what for _, _, what in rows}
        for b in app.main.BINDINGS:
            assert (b.tooltip or b.description) in described
        await pilot.press("question_mark")
        assert app.screen is app.main


async def test_command_palette_runs_actions(small_model, tmp_path, make_app, settle):
    app = make_app(make_session(small_model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        titles = [t for t, _, _ in app.main.palette_commands()]
        for op in TOGGLES:
            assert any(op in t for t in titles)
        for word in ("bisect", "export", "iso", "first DIFF", "rerun", "cancel"):
            assert any(word.lower() in t.lower() for t in titles), word
        await pilot.press("ctrl+p")
        await pilot.press(*"switch norm")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await settle(pilot)
        assert app.main.result.settings.exact == frozenset({"norm"})


async def test_iso_view(small_model, tmp_path, make_app, settle):
    session = make_session(small_model)
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("i")
        assert isinstance(app.screen, IsoScreen)
        await settle(pilot)
        screen = app.screen
        m = screen.m
        want = iso(lambda: make_backend("sim", small_model, exact=frozenset()), session.prompt, m)
        assert screen.cols == want
        assert screen.query_one("DataTable").row_count == m
        await pilot.press("minus")
        await settle(pilot)
        assert len(screen.cols) == m - 1
        await pilot.press("escape")
        assert app.screen is app.main


async def test_narrow_terminal_is_usable(small_model, tmp_path, make_app, settle):
    app = make_app(make_session(small_model), tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.has_class("-narrow")
        grid = main.grid
        assert grid.region.width >= 73 and grid.region.height >= 8
        assert main.query_one("#detail").region.height == 4
        await pilot.press("1")
        await settle(pilot)
        assert main.result.settings.exact == frozenset({"norm"})



async def test_below_80x24_one_line_asks_for_room(small_model, tmp_path, make_app, settle):
    app = make_app(make_session(small_model), tmp_path)
    async with app.run_test(size=(60, 20)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.has_class("-too-small")
        assert " ".join(screen_text(app).split()) == "enlarge the terminal to at least 80×24"
        label = main.query_one("#too-small")
        assert label.region.y == 9 and label.region.height == 1  # centred
        for size, small in (((80, 23), True), ((79, 24), True), ((80, 24), False), ((60, 20), True)):
            await pilot.resize_terminal(*size)
            await pilot.pause()
            assert main.has_class("-too-small") is small, size
            assert ("enlarge the terminal" in screen_text(app)) is small
            assert ("kestrel-tui │" in screen_text(app)) is not small
        await pilot.press("1")  # keys still work while the screen asks for room
        await settle(pilot)
        assert main.result.settings.exact == frozenset({"norm"})

@pytest.mark.slow
async def test_default_model_grid_fills_and_scrolls(default_model, tmp_path, make_app, settle):
    session = Session(default_model, default_prompt(default_model.cfg.vocab), 2, subject="sim")
    app = make_app(session, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        main = app.main
        assert len(main.board.rows) == 50
        assert len(main.result.comparison.status) == 530 * main.board.n_positions
        for _ in range(49):
            await pilot.press("j")
        assert main.cursor.row == 49  # logits
        assert main.grid.scroll_offset.y > 0  # scrolled to keep the cursor visible
