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
