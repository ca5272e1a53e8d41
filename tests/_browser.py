"""Headless Chromium for the page tests: Debian's ``chromium`` package driven by Playwright for
Python (``executable_path``; no ``playwright install``). Tests that use ``browser`` skip, saying
why, where either is missing; ``.ci/run`` installs chromium. The ``screenshot`` fixture saves
pages under the run's pytest temp folder (``screenshots/``), or under ``$INFENG_SCREENSHOTS``."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def browser():
    """One Playwright driver and browser per test module, stopped at the module's end: the sync
    driver keeps an asyncio loop running on the main thread, where a later test's asyncio.run
    (the CLI's run-batch, say) would fail, and two sync drivers cannot run at once."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install "
                                                                 "'.[test]')")
    executable = chromium_path()
    if executable is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    playwright = sync_api.sync_playwright().start()
    try:
        browser = playwright.chromium.launch(executable_path=executable, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()
    finally:
        playwright.stop()


@pytest.fixture
def page(browser):
    """A fresh browser context (empty localStorage and sessionStorage) and a page in it; uncaught
    script errors are collected in ``page.errors``, console errors in ``page.console_errors``."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    page = context.new_page()
    page.errors, page.console_errors = [], []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: page.console_errors.append(m.text) if m.type == "error" else None)
    yield page
    context.close()


@pytest.fixture(scope="session")
def screenshot(tmp_path_factory: pytest.TempPathFactory) -> Callable[[object, str], Path]:
    """``screenshot(page, name)`` saves ``name.png`` (docs/img/web-*.png are copies of two of them)."""
    folder = Path(os.environ.get("INFENG_SCREENSHOTS") or tmp_path_factory.getbasetemp() / "screenshots")

    def save(page, name: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.png"
        page.screenshot(path=str(path))
        return path

    return save
