"""The API docs page, ``/docs``: Swagger UI served by this service, under a Content-Security-Policy.

FastAPI's own ``/docs`` loads Swagger UI's script and stylesheet from a CDN, with no integrity check, and starts it
with an inline script; ``/redoc`` does the same. A script from a third party on a page of this origin could read
whatever the origin keeps in the browser (the console's admin token once lived in ``sessionStorage``). So the app
is built with ``docs_url=None, redoc_url=None`` and this module serves ``/docs`` from ``deployments/docs-ui/``:
Swagger UI's ``swagger-ui-bundle.js`` and ``swagger-ui.css`` (from the ``swagger-ui-dist`` npm package, version in
``docs-ui/VERSION``, Apache-2.0: ``docs-ui/LICENSE``, ``docs-ui/NOTICE``), the page, and ``docs.js``, which starts
Swagger UI on ``/openapi.json``. Every response carries a CSP that allows scripts, styles and requests from this
origin only (Swagger UI's runtime styles go through the CSSOM, which ``style-src`` does not restrict).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response

from deployments.protocol import ServiceError

__all__ = ["DOCS_DIR", "DOCS_HEADERS", "mount_docs", "plain_openapi", "sphinx_to_markdown"]

DOCS_DIR = Path(__file__).with_name("docs-ui")  # a data directory, never a package
#: the files the page is made of, and their media types; nothing else under /docs is served
_FILES = {
    "index.html": "text/html; charset=utf-8",
    "docs.js": "text/javascript; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "LICENSE": "text/plain; charset=utf-8",
    "NOTICE": "text/plain; charset=utf-8",
}
DOCS_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; font-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _docs_file(name: str) -> Response:
    media_type = _FILES.get(name)
    path = DOCS_DIR / name
    if media_type is None or not path.is_file():
        raise ServiceError(404, f"no docs file {name!r}")
    return Response(path.read_bytes(), media_type=media_type, headers=DOCS_HEADERS)


def mount_docs(app: FastAPI) -> None:
    """Serve ``/docs`` and its files (not in the OpenAPI schema). The app must be built with ``docs_url=None``."""
    router = APIRouter()

    @router.get("/docs", include_in_schema=False)
    async def docs_page():
        return _docs_file("index.html")

    @router.get("/docs/{file}", include_in_schema=False)
    async def docs_file(file: str):
        return _docs_file(file)

    app.include_router(router)


# Docstrings here are written for Sphinx (``code``, :class:`Name`); FastAPI copies them into the OpenAPI
# document, where Swagger UI renders Markdown. Rewritten once, when the document is first built.
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|ref|doc):`(~?)([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def sphinx_to_markdown(text: str) -> str:
    """``text`` with Sphinx roles and double-backquoted literals as Markdown code spans
    (:class:`~a.B` -> `B`, :func:`a.f` -> `a.f`, ``x`` -> `x`)."""
    text = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)


def _clean(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: (sphinx_to_markdown(value) if key in ("description", "summary") and isinstance(value, str)
                      else _clean(value)) for key, value in node.items()}
    if isinstance(node, list):
        return [_clean(item) for item in node]
    return node


def plain_openapi(app: FastAPI) -> None:
    """Make ``app``'s OpenAPI document (``/openapi.json``, shown at ``/docs``) carry Markdown, not Sphinx markup,
    in every ``description`` and ``summary``. Call after every other change to ``app.openapi``."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if not getattr(app, "_plain_openapi", False):
            app.openapi_schema = _clean(build())
            app._plain_openapi = True  # type: ignore[attr-defined]
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

