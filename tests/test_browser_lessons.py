"""The Lessons page in a real browser: a lesson runs from its button and shows its verdict and figures."""

from __future__ import annotations

import re
import shutil

from playwright.sync_api import sync_playwright
from test_browser import FLAGS, SHOTS, server  # noqa: F401 — server is the streamlit fixture

VERDICT = re.compile(r"The run (supports|contradicts|partly supports) the claim|No verdict")


def test_the_sink_lesson_runs_from_its_button_and_shows_its_verdict(server: str) -> None:  # noqa: F811
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (apt-get install chromium); .ci/run installs it"
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
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
        browser.close()
