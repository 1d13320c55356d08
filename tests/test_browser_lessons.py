"""The Lessons page in a real browser: a lesson runs from its button and shows its verdict and figures."""

from __future__ import annotations

import re

from playwright.sync_api import sync_playwright
from test_browser import SHOTS, chromium_page

VERDICT = re.compile(r"The run (supports|contradicts|partly supports) the claim|No verdict")


def test_the_sink_lesson_runs_from_its_button_and_shows_its_verdict(server: str) -> None:
    with sync_playwright() as pw:
        page = chromium_page(pw)
        page.goto(server, timeout=120_000)
        page.get_by_text("Start here").click(timeout=300_000)
        page.get_by_text("1. Attention sinks").wait_for(timeout=300_000)
        page.get_by_role("button", name="Run").click()
        page.get_by_text(VERDICT).first.wait_for(timeout=600_000)
        page.locator(".js-plotly-plot").first.wait_for(timeout=60_000)
        page.wait_for_timeout(2000)
        assert page.locator('[data-testid="stException"]').count() == 0
        assert "first 4 tokens" in page.locator("p", has_text=VERDICT).first.inner_text()
        page.screenshot(path=str(SHOTS / "lesson-sinks.png"))
        page.context.browser.close()
