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
