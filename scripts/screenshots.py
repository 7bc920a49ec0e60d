"""Regenerate screenshots/*.svg: the app's main states, saved by the app itself (App.save_screenshot).

    python scripts/screenshots.py [--out screenshots] [--only main|narrow|diff|mismatch]

The embedded default model (48 layers), 16 prompt + 16 tokens, sim subject,
at 120x40 (plus one at 80x24); the mismatch view's with the sim subject in the forward schedule. Existing files are replaced: these are
illustrations, regenerated from code, not evidence (exports are the evidence
and never overwrite).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_tui.app.app import KestrelApp  # noqa: E402
from kestrel_tui.app.source import DiffSource, LiveSource, loaded  # noqa: E402
from kestrel_tui.engines.base import EngineSpec  # noqa: E402
from kestrel_tui.engines.build import make_engine  # noqa: E402
from kestrel_tui.session.inputs import default_prompt  # noqa: E402
from kestrel_tui.session.session import RunSettings, Session  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402
from kestrel_tui.trace.dump import read_dump, write_dump  # noqa: E402

SIZE = (120, 40)


async def settle(pilot) -> None:
    app = pilot.app
    while True:
        await app.workers.wait_for_complete()
        await pilot.pause()
        if not app.main.busy and not getattr(app.screen, "busy", False):
            await pilot.pause()
            return
        await asyncio.sleep(0.01)


def save(app, out: Path, name: str) -> None:
    path = out / f"{name}.svg"
    path.unlink(missing_ok=True)  # save_screenshot writes in place; remove first so a failure leaves no stale file
    app.save_screenshot(filename=path.name, path=str(out))
    print(f"wrote {path}")


def new_app(model, exports: Path, n_tokens: int = 16, subject="sim") -> KestrelApp:
    session = Session(model, default_prompt(model.cfg.vocab), n_tokens, subject=subject)
    return KestrelApp(LiveSource(lambda _progress: loaded(session)), export_dir=exports)


async def main_states(model, out: Path, exports: Path) -> None:
    app = new_app(model, exports)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        save(app, out, "all-fast")

        # the detail of a DIFF: +norm moves the first DIFF to the K projection (a spread of ULP distances)
        await pilot.press("1")
        await settle(pilot)
        await pilot.press("f")
        await pilot.pause()
        save(app, out, "diff-detail")
        await pilot.press("0")
        await settle(pilot)

        # mid-bisection: a few moves in, still running
        main = app.main
        n0 = len(main.session.history)
        await pilot.press("b")
        while main.phase == "bisecting" and len(main.session.history) - n0 < 3:
            await asyncio.sleep(0.002)
        await pilot.pause()
        save(app, out, "mid-bisection")
        await settle(pilot)
        await pilot.press("f")  # all ok: f just says so
        await pilot.pause(0.1)
        save(app, out, "all-ok")

        # the iso view with every op fast: batch-verify differs from M=1 column by column
        await pilot.press("0")
        await settle(pilot)
        await pilot.press("i")
        await settle(pilot)
        save(app, out, "iso")


async def narrow(model, out: Path, exports: Path) -> None:
    app = new_app(model, exports)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        save(app, out, "narrow-80x24")


async def mismatch(model, out: Path, exports: Path) -> None:
    # the trainer's forward pass re-scoring the rollout's tokens, norm and attention exact (keys 1 and 5),
    # a tolerance on (T): the log-ratios spread over the bands, and the first far key is known
    app = new_app(model, exports, subject=make_engine(EngineSpec("sim", options={"schedule": "forward"}), model))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        for key in ("1", "5", "T"):
            await pilot.press(key)
            await settle(pilot)
        app.clear_notifications()
        await pilot.press("L")
        await settle(pilot)
        save(app, out, "mismatch")


async def diff_mode(model, out: Path, tmp: Path, exports: Path) -> None:
    # two dumps of the same decode: cpu reference vs sim with norm exact, plus one key dropped
    session = Session(model, default_prompt(model.cfg.vocab), 4, subject="sim")
    res = session.run(RunSettings(exact=frozenset({"norm"})))
    a, b = tmp / "cpu.dump", tmp / "sim.dump"
    write_dump(a, ((k, h) for p in res.ref.positions for k, h in p.hashes.items()))
    sub = [(k, h) for p in res.sub.positions for k, h in p.hashes.items() if k != "t17_l3_vs"]
    write_dump(b, sub)
    app = KestrelApp(DiffSource("cpu.dump", "sim.dump", read_dump(a), read_dump(b)), export_dir=exports)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        save(app, out, "diff-mode")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "screenshots"))
    ap.add_argument("--only", choices=("main", "narrow", "diff", "mismatch"), help="regenerate these screenshots only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(None)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        states = {"main": lambda: main_states(model, out, tmp / "exports"),
                  "narrow": lambda: narrow(model, out, tmp / "exports"),
                  "diff": lambda: diff_mode(model, out, tmp, tmp / "exports"),
                  "mismatch": lambda: mismatch(model, out, tmp / "exports")}
        for name, states_of in states.items():
            if args.only in (None, name):
                asyncio.run(states_of())
    return 0


if __name__ == "__main__":
    sys.exit(main())
