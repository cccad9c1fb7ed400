"""Fixtures for the unit tests: the tiny hand-built tokenizer (see ``processors/testing.py``)."""

from __future__ import annotations

import pytest

from processors.testing import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def eos(tok):
    return tok.eos_token_id
