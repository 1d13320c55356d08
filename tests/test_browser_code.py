"""Code edits in a real browser: Stop ends a playing sequence once the edit in progress is measured."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import sync_playwright
from test_browser import SHOTS, chromium_page, done_running

pytestmark = [pytest.mark.browser, pytest.mark.model]  # Chromium against the app, which loads the embedded model


def test_stop_ends_a_playing_sequence_after_the_edit_in_progress(server: str) -> None:
    with sync_playwright() as pw:
        page = chromium_page(pw)
        page.goto(f"{server}/code_edits", timeout=120_000)
        play = page.get_by_role("button", name="Play sequence")
        play.wait_for(timeout=300_000)  # the default file (1.6k tokens) is prefilled first
        done_running(page)
        play.click()
        # the first of the sequence's edits measured: Stop then ends it before the next one is done
        page.locator('[data-testid="stProgress"]').filter(has_text=re.compile(r"^1/\d+: ")).wait_for(timeout=300_000)
        page.get_by_role("button", name="Stop").click()
        done_running(page)
        said = page.get_by_text(re.compile(r"^Stopped, as asked, after \d+ of the sequence's \d+ edits"))
        said.wait_for(timeout=60_000)
        done, total = map(int, re.findall(r"\d+", said.inner_text())[:2])
        assert 1 <= done < total
        assert page.locator('[data-testid="stException"]').count() == 0
        said.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "code-edits-stopped.png"))
        page.context.browser.close()
