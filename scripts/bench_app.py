"""Latency and frame-time figures for the app (results/app-bench.md records them).

    python scripts/bench_app.py [--reps 6] [--nav-tokens 240]

Runs the real app headless at 120x40. Every frame the app hands to its driver
is also encoded to terminal bytes here (headless mode skips that step), so a
"frame" costs what it would cost on a terminal minus the write itself. Times
are measured from just before the key press to the first frame showing the
effect:

1. toggle latency (default 48-layer model, 16 prompt + 16 tokens, sim):
   key `1` -> first frame with a cell of the new run (the prompt positions,
   copied from the reference), -> first frame with a subject-computed position
   (the first decode step), -> the frame with the run's final first DIFF.
2. navigation (default model over 256 positions: 16 prompt + 240 tokens):
   key -> next frame for hjkl, [ ], n/N; and the cost of a full repaint.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from textual._compositor import CompositorUpdate  # noqa: E402
from textual.app import App  # noqa: E402

from kestrel_tui.app.app import KestrelApp  # noqa: E402
from kestrel_tui.app.source import LiveSource, loaded  # noqa: E402
from kestrel_tui.session.inputs import default_prompt  # noqa: E402
from kestrel_tui.session.session import Session  # noqa: E402
from kestrel_tui.model.hf import load_model  # noqa: E402

SIZE = (120, 40)


class Frames:
    """Timestamps of frames, with a predicate checked against app state at each frame."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.watch: list[tuple[callable, list]] = []
        self.encode_s: list[float] = []

    def install(self) -> None:
        orig = App._display
        frames = self

        def display(app, screen, renderable):
            if isinstance(renderable, CompositorUpdate):
                t0 = time.perf_counter()
                renderable.render_segments(app.console)  # what a real terminal driver would do
                frames.encode_s.append(time.perf_counter() - t0)
            now = time.perf_counter()
            frames.times.append(now)
            for cond, out in list(frames.watch):
                if not out and cond():
                    out.append(now)
            return orig(app, screen, renderable)

        App._display = display

    def when(self, cond) -> list:
        out: list[float] = []
        self.watch.append((cond, out))
        return out


async def settle(pilot) -> None:
    app = pilot.app
    while True:
        await app.workers.wait_for_complete()
        await pilot.pause()
        if not app.main.busy:
            await pilot.pause()
            return
        await asyncio.sleep(0.01)


def ms(xs: list[float]) -> str:
    xs = sorted(x * 1000 for x in xs)
    p95 = xs[min(len(xs) - 1, int(0.95 * len(xs)))]
    return f"median {statistics.median(xs):7.1f} ms   p95 {p95:7.1f} ms   max {xs[-1]:7.1f} ms   (n={len(xs)})"


async def toggle_latency(frames: Frames, model, reps: int) -> dict[str, list[float]]:
    session = Session(model, default_prompt(model.cfg.vocab), 16, subject="sim")
    app = KestrelApp(LiveSource(lambda _progress: loaded(session)), export_dir="/tmp/kestrel-bench-exports")
    out: dict[str, list[float]] = {"first cell": [], "first decoded cell": [], "final first DIFF": []}
    finals: list[str] = []
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        main = app.main
        P = len(session.prompt)
        for _ in range(reps):
            target = main.settings.exact ^ {"norm"}
            rid = main._run_id + 1  # the run the key press starts
            first = frames.when(lambda: main._run_id == rid and any(main.board.arrived))
            decoded = frames.when(lambda: main._run_id == rid and main.board.arrived[P])
            final = frames.when(lambda: main._run_id == rid and main.phase == "idle"
                                and main.result is not None and main.result.settings.exact == target)
            t0 = time.perf_counter()
            await pilot.press("1")
            await settle(pilot)
            await pilot.pause(0.05)  # let the last frame land
            for name, got in (("first cell", first), ("first decoded cell", decoded), ("final first DIFF", final)):
                out[name].append(got[0] - t0)
            finals.append(f"{'+norm' if 'norm' in target else '-norm'} -> {main.result.first_diff}")
            frames.watch.clear()
    print("toggle runs:", "; ".join(dict.fromkeys(finals)))
    return out


async def navigation(frames: Frames, model, n_tokens: int) -> tuple[dict[str, list[float]], list[float]]:
    session = Session(model, default_prompt(model.cfg.vocab), n_tokens, subject="sim")
    app = KestrelApp(LiveSource(lambda _progress: loaded(session)), export_dir="/tmp/kestrel-bench-exports")
    plan = [("j", 49), ("k", 49), ("l", 10), ("h", 10), ("right_square_bracket", 120),
            ("left_square_bracket", 120), ("n", 60), ("N", 60)]
    out: dict[str, list[float]] = {}
    async with app.run_test(size=SIZE) as pilot:
        t0 = time.perf_counter()
        await settle(pilot)
        main = app.main
        print(f"navigation run: {main.board.n_positions} positions x {len(main.board.rows)} rows,"
              f" {len(main.result.comparison.status)} keys, reference + subject in {time.perf_counter() - t0:.1f} s")
        for key, n in plan:
            for _ in range(n):
                before = len(frames.times)
                t0 = time.perf_counter()
                await pilot.press(key)
                while len(frames.times) == before:
                    await asyncio.sleep(0.0005)
                out.setdefault(key, []).append(frames.times[before] - t0)
        # full repaint of the main screen: every widget's lines, composited
        repaint = []
        for _ in range(50):
            for w in main.walk_children():
                w.refresh()  # drop every widget's cached lines, so all of them render again
            t0 = time.perf_counter()
            update = main._compositor.render_update(full=True)
            update.render_segments(app.console)
            repaint.append(time.perf_counter() - t0)
    return out, repaint


async def main_async(args) -> None:
    frames = Frames()
    frames.install()
    model = load_model(None)
    print(f"kestrel-tui app bench · {time.strftime('%Y-%m-%d')} · python {sys.version.split()[0]}"
          f" · terminal {SIZE[0]}x{SIZE[1]} headless (frames encoded to terminal bytes)")
    print(f"model: {model.name} {model.cfg.n_layers} layers, subject sim\n")
    lat = await toggle_latency(frames, model, args.reps)
    print("key 1 (toggle norm) -> ...")
    for name, xs in lat.items():
        print(f"  {name:<20} {ms(xs)}")
    print()
    nav, repaint = await navigation(frames, model, args.nav_tokens)
    print("navigation, key -> next frame")
    for key, xs in nav.items():
        print(f"  {key:<22} {ms(xs)}")
    allk = [x for xs in nav.values() for x in xs]
    print(f"  {'all keys':<22} {ms(allk)}")
    print(f"full repaint (compose + encode, 120x40): {ms(repaint)}")
    enc = frames.encode_s
    print(f"per-frame terminal encoding during the session: {ms(enc)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6, help="toggle presses to time")
    ap.add_argument("--nav-tokens", type=int, default=240, help="generated tokens for the navigation run")
    asyncio.run(main_async(ap.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
