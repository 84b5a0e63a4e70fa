"""Whether this machine can run MiniWoB's browser, for the tests that need one."""

from __future__ import annotations


def browser_unavailable() -> str | None:
    """Why Chromium and its driver cannot run here (the one-line BrowserUnavailableError),
    or None when they can."""
    from environments.miniwob.browser import BrowserUnavailableError, find_browser

    try:
        find_browser()
    except BrowserUnavailableError as e:
        return str(e)
    return None
