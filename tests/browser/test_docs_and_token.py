"""The admin token stays out of reach of other pages, in headless Chromium against the shared app.

* ``/docs`` is Swagger UI served by the service itself: the page renders the API with every request going to
  this origin (anything else is blocked and recorded here), under a Content-Security-Policy of its own, with no
  CSP violation; ``/redoc`` (CDN scripts) is gone.
* The console keeps the admin token in memory only: after "Use token" neither ``sessionStorage`` nor
  ``localStorage`` holds it, and a page of the same origin (``/docs``) cannot find it; its link to ``/docs``
  opens a new tab without an opener.
"""

from __future__ import annotations

import pytest
import requests
from playwright.sync_api import expect

pytestmark = pytest.mark.serve

TIMEOUT = 60
TOKEN = "serve-test-token"


def _same_origin_only(context, origin: str) -> list[str]:
    """Block every request that leaves ``origin``; return the list they are recorded in."""
    foreign: list[str] = []

    def route(r):
        url = r.request.url
        if url.startswith(origin + "/") or url.startswith("data:"):
            r.continue_()
        else:
            foreign.append(url)
            r.abort()

    context.route("**/*", route)
    return foreign


def test_docs_are_served_locally_under_a_csp(browser, serve_app):
    r = requests.get(f"{serve_app.url}/docs", timeout=TIMEOUT)
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "http" not in csp and "unsafe-inline" not in csp, csp
    assert "cdn" not in r.text and "https://" not in r.text and "<script>" not in r.text, r.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "docs.js"):
        a = requests.get(f"{serve_app.url}/docs/{asset}", timeout=TIMEOUT)
        assert a.status_code == 200 and a.headers["content-security-policy"] == csp, asset
    assert requests.get(f"{serve_app.url}/docs/../openapi.json", timeout=TIMEOUT).status_code in (200, 404)
    assert requests.get(f"{serve_app.url}/docs/secret.txt", timeout=TIMEOUT).status_code == 404
    assert requests.get(f"{serve_app.url}/redoc", timeout=TIMEOUT).status_code == 404
    assert requests.get(f"{serve_app.url}/docs/oauth2-redirect", timeout=TIMEOUT).status_code == 404

    context = browser.new_context()
    foreign = _same_origin_only(context, serve_app.url)
    page = context.new_page()
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{serve_app.url}/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("constrained-serve", timeout=60_000)
    expect(page.locator("#operations-generate-generate_v1_generate_post")).to_be_visible()
    context.close()
    assert foreign == [] and violations == [] and errors == [], (foreign, violations, errors)


def test_console_keeps_the_token_in_memory_only(browser, serve_app):
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{serve_app.url}/console")
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    expect(page.locator("#token-status")).to_have_text("token set for this tab")
    # the token works (an admin route answers) ...
    page.locator('#scenario-table tr[data-name="sentiment"] button').click()
    expect(page.locator("#history-table tbody tr").first).to_be_visible(timeout=60_000)
    # ... and is in no storage another page of this origin could read
    stored = page.evaluate("() => JSON.stringify([Object.entries(sessionStorage), Object.entries(localStorage), document.cookie])")
    assert TOKEN not in stored, stored
    assert page.locator("#token-input").input_value() == ""
    link = page.locator("footer a[href='/docs']")
    assert link.get_attribute("target") == "_blank"
    assert set(link.get_attribute("rel").split()) >= {"noopener", "noreferrer"}
    with context.expect_page() as opened:
        link.click()
    docs = opened.value
    docs.wait_for_load_state()
    assert docs.evaluate("() => window.opener") is None
    found = docs.evaluate("() => JSON.stringify([Object.entries(sessionStorage), Object.entries(localStorage), document.cookie])")
    assert TOKEN not in found, found
    # a reload forgets it: the page asks again
    page.reload()
    expect(page.locator("#token-status")).to_have_text("no token: read-only")
    context.close()
