"""Fixtures for the integration tests: a data directory whose embedded Redis is shut down afterwards."""

from __future__ import annotations

import pytest

from deployments.redis_server import close_embedded


@pytest.fixture
def data_dir(tmp_path):
    path = str(tmp_path / "data")
    yield path
    close_embedded(path)
