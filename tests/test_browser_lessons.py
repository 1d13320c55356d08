"""The Lessons page in a real browser: every lesson runs from its button and shows its verdict and figures,
the page's figures download at once as a zip holding one file per figure shown, and the run's own JSON download
holds what the lesson measured (checked per lesson below: these runs are the lessons' only runs on the embedded
model in the suite)."""

from __future__ import annotations

import io
import json
import re
import time
import zipfile

import pytest
from playwright.sync_api import Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from test_browser import SHOTS, chromium_page

from kvlab.lessons import LESSONS
from kvlab.lessons.planted import FACT
from kvlab.lessons.streams import CACHE, CHUNK, TOKENS

pytestmark = [pytest.mark.browser, pytest.mark.model, pytest.mark.slow]

VERDICT = re.compile(r"The run (supports|contradicts|partly supports) the claim|No verdict")
DECIDING = ("supports", "mixed", "contradicts")
# CacheBlend's speed part is a timing: on a loaded runner its spread may straddle the claimed 2.2x, which the
# lesson rightly calls inconclusive; its quality part must still be decided.
DECIDED = {"cacheblend": DECIDING + ("inconclusive",)}
RUN_S = 600  # a lesson takes 15–80 s on an idle 2-core CPU; a busy shared one has taken four times that


def open_lesson(page: Page, server: str, number: int, key: str) -> None:
    """The Lessons page with lesson ``number`` picked; the first comes through the home page's start link."""
    if number == 1:
        page.goto(server, timeout=120_000)
        page.get_by_text("Start here").click(timeout=300_000)
    else:
        page.goto(f"{server}/lessons", timeout=120_000)
        page.get_by_text(f"{number}. {LESSONS[key].title}").click(timeout=300_000)
    page.get_by_role("heading", name=LESSONS[key].title).wait_for(timeout=300_000)


def main_text(page: Page) -> str:
    """The main area's text, for a failure message that says what the page showed instead."""
    return page.locator('[data-testid="stMain"]').inner_text()[-2000:]


def run_record(page: Page) -> dict:
    """The lesson run's JSON, as its download button gives it."""
    with page.expect_download(timeout=120_000) as info:
        page.get_by_role("button", name="Download this run (JSON)").click()
    return json.loads(open(info.value.path(), "rb").read())


def check_sinks(result: dict) -> None:
    assert len(result["first_share"]) == 30  # one share per layer of SmolLM2-135M


def check_planted_fact(result: dict) -> None:
    assert result["policies"]["full"]["correct"], result["policies"]["full"]["reply"]
    assert [result["token_texts"][p] for p in result["fact_positions"]] == list(FACT)  # SmolLM2: one token per digit


def check_agnostic(result: dict) -> None:
    """Every policy held to the byte budget (DuoAttention too), on six questions Full answers."""
    assert len(result["cases"]) == 6 and all(c["policies"]["full"]["correct"] for c in result["cases"])
    for case in result["cases"]:
        assert all(p["error"] is None for p in case["policies"].values())
        budget = int(case["budget_mib"] * (1 << 20))
        assert all(p["kv_bytes"] <= budget for n, p in case["policies"].items() if n != "full")


def check_streams(result: dict) -> None:
    runners = result["runners"]
    assert result["tokens"] == TOKENS
    assert all(r["error"] is None and len(r["nll"]) == TOKENS - 1 for r in runners.values())
    assert runners["full"]["max_position"] == TOKENS - 2  # dense: every token held, positions grow with the text
    assert runners["streamingllm"]["max_position"] < CACHE + CHUNK  # re-rotated: inside the cache


CHECKS = {"sinks": check_sinks, "planted_fact": check_planted_fact, "agnostic": check_agnostic,
          "streams": check_streams}


def figures_zip(page: Page) -> list[str]:
    """The files in the sidebar's download-all zip."""
    with page.expect_download(timeout=120_000) as info:
        page.get_by_role("button", name="Download all figures").click()
    return zipfile.ZipFile(io.BytesIO(open(info.value.path(), "rb").read())).namelist()


@pytest.mark.parametrize("number, key", list(enumerate(LESSONS, start=1)))
def test_each_lesson_runs_from_its_button_and_shows_its_verdict(server: str, number: int, key: str) -> None:
    with sync_playwright() as pw:
        page = chromium_page(pw)
        open_lesson(page, server, number, key)
        if key == "windows":  # it needs the windowed model: the page offers the switch
            page.get_by_role("button", name="Switch to the embedded Gemma-3-270M").click(timeout=60_000)
        run = page.get_by_role("button", name="Run", exact=True)
        run.wait_for(timeout=300_000)  # Gemma converts once (about 100 s) on a fresh cache
        t0 = time.perf_counter()
        run.click()  # at once, as a user does: the page may still be redrawing after the lesson change
        title = re.escape(LESSONS[key].title)
        started = page.get_by_text(re.compile(rf"^(Running|Done|Failed): {title}"))
        try:
            started.first.wait_for(timeout=120_000)
        except PlaywrightTimeout:
            pytest.fail(f"the Run click started nothing; the page shows: {main_text(page)}")
        verdict = page.locator("p", has_text=VERDICT).first
        ended = verdict.or_(page.locator('[data-testid="stException"]')).or_(
            page.get_by_text(re.compile(r"^Failed: ")))
        ended.first.wait_for(timeout=RUN_S * 1000)
        assert verdict.is_visible(), f"no verdict; the page shows: {main_text(page)}"
        took = time.perf_counter() - t0
        charts = page.locator(".js-plotly-plot")
        charts.first.wait_for(timeout=60_000)
        page.wait_for_timeout(2000)
        assert page.locator('[data-testid="stException"]').count() == 0
        assert page.get_by_text(re.compile(r"^Failed: ")).count() == 0
        text = verdict.inner_text()
        assert re.search(r"\d", text), text  # written from the run's numbers
        if key == "sinks":
            assert "first 4 tokens" in text
        if key == "windows":
            assert "Gemma" in page.locator('[data-testid="stSidebar"]').inner_text()
        shown = charts.count()
        assert shown >= 1 and len(figures_zip(page)) == shown
        record = run_record(page)
        outcome, said = record["verdict"]["outcome"], record["verdict"]["text"]
        assert record["lesson"] == key and outcome in DECIDED.get(key, DECIDING), said
        if outcome == "inconclusive":  # only the timing may be left open, and it says so
            assert "speed: whether the time to first token falls" in said
            assert "closes most of the gap is open" not in said
        if key == "streams":
            assert outcome != "contradicts", said
        if key == "agnostic":
            assert "6 of them recalled by Full" in text and shown == 4  # with DuoAttention's head split
        CHECKS.get(key, lambda _: None)(record["result"])
        page.screenshot(path=str(SHOTS / f"lesson-{key}.png"), full_page=True)
        print(f"lesson {key}: verdict after {took:.0f} s, {shown} figures")
        page.context.browser.close()


def test_a_run_click_right_after_a_lesson_change_runs_that_lesson(server: str) -> None:
    """Clicked before the page has redrawn, Run still runs the lesson just picked (with a Run key per lesson
    the click went to the previous lesson's button and started nothing)."""
    with sync_playwright() as pw:
        page = chromium_page(pw)
        page.goto(f"{server}/lessons", timeout=120_000)
        run = page.get_by_role("button", name="Run", exact=True)
        run.wait_for(timeout=300_000)
        page.get_by_text(f"6. {LESSONS['ordering'].title}").click()
        run.click()
        title = re.escape(LESSONS["ordering"].title)
        page.get_by_text(re.compile(rf"^(Running|Done): {title}")).first.wait_for(timeout=120_000)
        page.locator("p", has_text=VERDICT).first.wait_for(timeout=RUN_S * 1000)
        page.context.browser.close()
