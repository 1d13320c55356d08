"""One real-browser test: `streamlit run` headless, Debian's Chromium driven by Playwright."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> str:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.port", str(port),
         "--server.headless", "true"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/_stcore/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_pages_in_a_real_browser(server: str) -> None:
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (apt-get install chromium); .ci/run installs it"
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{server}/chat", timeout=120_000)
        page.get_by_text("Send a message or load a scripted conversation").wait_for(timeout=300_000)
        budget = page.get_by_label("Budget (tokens per layer per KV head)")
        budget.fill("48")
        budget.press("Enter")
        reply_len = page.get_by_label("Max reply tokens")
        reply_len.fill("12")
        reply_len.press("Enter")
        page.wait_for_timeout(1500)
        box = page.get_by_placeholder("Message the model")
        box.fill("My name is Ada and my shed code is 55102. What is a KV cache, briefly?")
        box.press("Enter")
        page.locator('[data-testid="stChatMessage"]').nth(1).wait_for(timeout=600_000)
        page.locator(".js-plotly-plot").first.wait_for(timeout=600_000)
        page.wait_for_timeout(3000)
        assert page.locator('[data-testid="stException"]').count() == 0
        assert page.locator(".js-plotly-plot").count() >= 2
        page.screenshot(path=str(SHOTS / "chat.png"), full_page=True)
        for path, title in [("rag", "RAG"), ("code_edits", "Code edits"), ("arena", "arena")]:
            page.goto(f"{server}/{path}", timeout=120_000)
            page.get_by_role("heading", name=title).first.wait_for(timeout=300_000)
            page.wait_for_timeout(2000)
            assert page.locator('[data-testid="stException"]').count() == 0, path
            page.screenshot(path=str(SHOTS / f"{path}.png"), full_page=True)
        # still on the arena page: a file that is not UTF-8 gets a message, and the page goes on
        page.locator('[data-testid="stFileUploader"] input[type="file"]').set_input_files(
            files=[{"name": "latin1.json", "mimeType": "application/json", "buffer": b'{"name": "caf\xe9"}'}])
        page.get_by_text("latin1.json").first.wait_for(timeout=60_000)
        page.get_by_role("button", name="Run the grid").click()
        page.get_by_text("latin1.json is not UTF-8 text").wait_for(timeout=60_000)
        assert page.locator('[data-testid="stException"]').count() == 0
        assert page.get_by_role("button", name="Run the grid").is_enabled()
        browser.close()
