import functools

import pytest

from kestrel_tui.model.config import default_config
from kestrel_tui.model.weights import synthetic_model


@functools.lru_cache(maxsize=None)
def _model(n_layers: int, fmt: str):
    return synthetic_model(default_config().with_layers(n_layers), fmt)


@pytest.fixture(scope="session")
def default_model():
    """The embedded default (48 layers, q4_0)."""
    return _model(48, "q4_0")


@pytest.fixture(scope="session")
def small_model():
    """The default's dims with 4 layers: cheap enough for many runs."""
    return _model(4, "q4_0")


@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio; async tests use anyio's pytest plugin


@pytest.fixture(autouse=True, scope="session")
def _reference_cache_in_tmp(tmp_path_factory):
    """The reference cache of the commands and the app under test lives in a temporary folder,
    never in the user's ~/.cache."""
    import os

    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def cref():
    """The compiled reference's library (kestrel_tui/cref): the one `pip install` built, or the build
    named by KESTREL_TEST_CREF_LIB (a test-only override for work on the C sources). Not built is an
    error here, never a skip: every machine that runs the suite has a C compiler."""
    import os

    from kestrel_tui.cref import load

    return load(os.environ.get("KESTREL_TEST_CREF_LIB") or None)


# ---- the Pilot helpers of the app tests (test_app*.py, test_refcache.py)


def _make_app(session, tmp_path):
    """The app on a ready session, exporting under tmp_path."""
    from kestrel_tui.app.app import KestrelApp
    from kestrel_tui.app.source import LiveSource, loaded

    return KestrelApp(LiveSource(lambda _progress: loaded(session)), export_dir=tmp_path / "exports")


async def _settle(pilot, timeout: float = 120.0) -> None:
    """Wait until no worker runs and every message they posted has been handled."""
    import asyncio

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


@pytest.fixture
def make_app():
    """The factory `make_app(session, tmp_path) -> KestrelApp`: the app on a ready session (through the
    loader path the CLI uses), exporting under tmp_path / "exports"."""
    return _make_app


@pytest.fixture
def settle():
    """The coroutine function `await settle(pilot, timeout=120.0)`: wait until no worker runs and every
    message they posted has been handled (TimeoutError past the timeout); also a snapshot's run_before."""
    return _settle
