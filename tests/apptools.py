"""The Pilot helpers the app tests share (imported by several test files)."""
from __future__ import annotations

import asyncio

from kestrel_tui.app.app import KestrelApp
from kestrel_tui.app.source import LiveSource, loaded


def make_app(session, tmp_path) -> KestrelApp:
    """The app on a ready session, exporting under tmp_path."""
    return KestrelApp(LiveSource(lambda _progress: loaded(session)), export_dir=tmp_path / "exports")


async def settle(pilot, timeout: float = 120.0) -> None:
    """Wait until no worker runs and every message they posted has been handled."""
    app = pilot.app
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        await app.workers.wait_for_complete()
        await pilot.pause()
        screen = app.screen
        if not app.main.busy and not getattr(screen, "busy", False):
            await pilot.pause()
            return
        if loop.time() > deadline:
            raise TimeoutError(f"app still busy: {app.main.phase}")
        await asyncio.sleep(0.01)
