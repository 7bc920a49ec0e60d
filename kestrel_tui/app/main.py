"""Entry points the CLI calls: `kestrel-tui [tui]` and `kestrel-tui diff A B --tui`."""
from __future__ import annotations

from collections.abc import Mapping

from ..session.inputs import RunConfig
from .source import DiffSource, LiveSource, config_loader


def run_app(config: RunConfig) -> int:
    """The debugger on a model (loaded inside the app, so a bad model dir is a message, not a crash)."""
    from .app import KestrelApp

    return _run(KestrelApp(LiveSource(config_loader(config)), signals=True))


def run_diff_app(path_a: str, path_b: str, dump_a: Mapping[str, int], dump_b: Mapping[str, int]) -> int:
    """The same grid over two dump files; no model needed."""
    from .app import KestrelApp

    return _run(KestrelApp(DiffSource(path_a, path_b, dump_a, dump_b), signals=True))


def _run(app) -> int:
    import signal

    from ..procs import STOP_SIGNALS

    old = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        app.run()
    finally:
        # the app's loop leaves SIG_DFL behind: the caller's handlers cover the cleanup that follows
        for sig, handler in old.items():
            if handler is not None:
                signal.signal(sig, handler)
    return app.return_code or 0
