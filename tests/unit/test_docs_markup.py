"""The OpenAPI document behind /docs carries Markdown, not Sphinx markup (:class:`X`, ``x``)."""

from __future__ import annotations

import json
import re

from fastapi.testclient import TestClient

from config import ServerSettings
from deployments.docs import sphinx_to_markdown
from deployments.ingress import Ingress

SPHINX = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|ref|doc):`|``")


def test_served_openapi_has_no_sphinx_roles(tmp_path):
    ingress = Ingress(ServerSettings(admin_token="t", data_dir=str(tmp_path)), None, None)
    client = TestClient(ingress.http_app)
    spec = client.get("/openapi.json").json()
    text = json.dumps(spec)
    assert not SPHINX.search(text), SPHINX.findall(text)[:5]
    # the descriptions are still there, as Markdown code spans
    assert "`POST /v1/generate`" in spec["components"]["schemas"]["GenerateBody"]["description"]
    assert client.get("/openapi.json").json() == spec  # rewritten once, the same every time


def test_sphinx_to_markdown():
    assert sphinx_to_markdown("a :class:`~processors.labels.LabelTables` b") == "a `LabelTables` b"
    assert sphinx_to_markdown(":func:`processors.compile.build` and ``x: 1``") == "`processors.compile.build` and `x: 1`"
    assert sphinx_to_markdown("no markup, `one` backquote") == "no markup, `one` backquote"
