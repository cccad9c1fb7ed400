"""Shared fixtures.

``tokenizer`` is the default model's tokenizer (cheap once the model cache exists). ``model`` is the
default model itself; only integration tests should use it. Both load through
``deployments.model_loader`` with the default cache (``$CONSTRAINED_SERVE_CACHE`` or
``~/.cache/constrained-serve``), so only the first run of a machine pays for de-quantizing the GGUF file.
Tests under ``tests/integration`` are marked ``integration`` automatically.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_INTEGRATION_DIR = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _INTEGRATION_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tokenizer():
    from deployments.model_loader import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def model():
    from deployments.model_loader import load_model

    return load_model()


@pytest.fixture
def data_dir(tmp_path):
    """A data directory whose embedded Redis (started by a manager under test) is shut down afterwards."""
    from deployments.redis_server import close_embedded

    path = str(tmp_path / "data")
    yield path
    close_embedded(path)


# The shared Ray Serve app (one start-up for tests/serve and tests/security).
from serve_app import ADMIN_TOKEN, APP_NAME, ServeApp, serve_app  # noqa: E402,F401
