"""Fixtures of the tests/serve modules (the shared app itself, ``serve_app``, is in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def client(serve_app):
    """The official ``openai`` client on the shared app (no retries; 180 s a request)."""
    from helpers import openai_client

    return openai_client(serve_app.url, timeout=180)
