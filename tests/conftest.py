"""Shared fixtures.

``tokenizer`` is the default model's tokenizer (cheap once the model cache exists). ``model`` is the
default model itself; only integration tests should use it. Both load through
``deployments.model_loader`` with the default cache (``$CONSTRAINED_SERVE_CACHE`` or
``~/.cache/constrained-serve``), so only the first run of a machine pays for de-quantizing the GGUF file.
Tests under ``tests/integration`` are marked ``integration`` automatically.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
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
    from deployments.storage.redis_server import close_embedded

    path = str(tmp_path / "data")
    yield path
    close_embedded(path)


@pytest.fixture(scope="session")
def start_manager(tokenizer, tmp_path_factory):
    """The real config manager in-process (embedded Redis, the real tokenizer, no replicas), as a context manager:
    ``with start_manager("name", limits=Limits(...)) as manager:`` (keywords: ``ServerSettings`` fields; the data
    directory is a fresh one, the example scenarios are not seeded). ``manager.run(coro)`` runs one of its
    coroutines on the manager's own event loop. On the way out the manager is closed and its Redis stopped."""
    from config import ServerSettings
    from deployments.manager import ConfigManager
    from deployments.storage.redis_server import close_embedded

    @contextmanager
    def start(name: str, **settings):
        data_dir = str(tmp_path_factory.mktemp(name))
        loop = asyncio.new_event_loop()
        manager = ConfigManager(ServerSettings(data_dir=data_dir, **{"seed_examples": False, **settings}),
                                tokenizer=tokenizer)
        manager.run = lambda coro: loop.run_until_complete(coro)
        try:
            yield manager
        finally:
            loop.run_until_complete(manager.close())
            loop.close()
            close_embedded(data_dir)

    return start


# The shared Ray Serve app (one start-up for tests/serve and tests/security).
from serve_app import ADMIN_TOKEN, APP_NAME, ServeApp, serve_app  # noqa: E402,F401
