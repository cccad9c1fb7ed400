"""Fixtures for the browser tests: headless Chromium (Debian's ``chromium`` package) driven by Playwright.

Playwright's own browser download is not used (nothing outside the package registries is reachable here):
the browser is the system one, found as ``$CHROMIUM`` or ``chromium`` / ``chromium-browser`` on PATH
(``scripts/setup.sh`` installs it). Without it these tests are skipped with the reason, except under CI
(``CI`` set), where they fail.

``CONSOLE_SCREENSHOT_DIR``: when set, the tests save their screenshots of the console there (the README's
``docs/console-*.png`` come from ``CONSOLE_SCREENSHOT_DIR=docs``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

EXPECT_TIMEOUT_MS = 90_000  # a generation on a busy 2-core machine can take a while


def _chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser"):
        if candidate and (found := shutil.which(candidate)):
            return found
    return None


# Module scope, not session: while Playwright's sync API is open, an asyncio loop runs in this thread, and
# later tests that call asyncio.run() (tests/integration) would fail.
@pytest.fixture(scope="module")
def browser():
    from playwright import sync_api  # a test extra: scripts/setup.sh installs it

    executable = _chromium()
    if executable is None:
        reason = "no chromium on PATH (scripts/setup.sh installs Debian's chromium; or set $CHROMIUM)"
        if os.environ.get("CI"):  # CI must run these tests, never count them as passed by skipping
            pytest.fail(reason)
        pytest.skip(reason)
    sync_api.expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, serve_app):
    """A fresh browser context (empty sessionStorage: no admin token) on the console page."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(EXPECT_TIMEOUT_MS)
    page.uncaught = []  # JavaScript exceptions; every test ends with none
    page.on("pageerror", lambda error: page.uncaught.append(str(error)))
    page.goto(f"{serve_app.url}/console")
    yield page
    uncaught = list(page.uncaught)
    context.close()
    assert not uncaught, f"uncaught errors in the page: {uncaught}"


@pytest.fixture
def screenshot():
    """``screenshot(page, name)``: save ``console-<name>.png`` under ``$CONSOLE_SCREENSHOT_DIR`` (if set)."""
    target = os.environ.get("CONSOLE_SCREENSHOT_DIR")

    def take(page, name: str) -> None:
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(Path(target) / f"console-{name}.png"))

    return take
