"""Real-browser tests: `streamlit run` headless, Debian's Chromium driven by Playwright."""

from __future__ import annotations

import io
import json
import re
import shutil
import time
from pathlib import Path

import pandas as pd
import pytest
from playwright.sync_api import Locator, Page, Playwright, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from kvlab.engine.chatformat import DEFAULT_SYSTEM
from kvlab.engine.facts import LoadedModel
from kvlab.workloads.chat.replay import session_to_json
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

pytestmark = [pytest.mark.browser, pytest.mark.model]  # Chromium against the app, which loads the embedded model

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
APP, IDLE = '[data-testid="stApp"]', '[data-test-script-state="notRunning"]'  # the app and its state between runs
RUN_START_MS = 1_000  # how long a click's rerun may take to begin on a loaded machine


def chromium_page(pw: Playwright) -> Page:
    """A 1400×1000 page in Debian's headless Chromium with the flags above (screenshots go to SHOTS)."""
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (apt-get install chromium); .ci/run installs it"
    SHOTS.mkdir(exist_ok=True)
    return pw.chromium.launch(executable_path=chromium, args=FLAGS).new_page(viewport={"width": 1400, "height": 1000})


def test_pages_in_a_real_browser(server: str) -> None:
    with sync_playwright() as pw:
        page = chromium_page(pw)
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
        done_running(page)  # a click during the upload's run can be lost on a loaded machine
        page.get_by_role("button", name="Run the grid").click()
        page.get_by_text("latin1.json is not UTF-8 text").wait_for(timeout=60_000)
        assert page.locator('[data-testid="stException"]').count() == 0
        assert page.get_by_role("button", name="Run the grid").is_enabled()
        page.context.browser.close()


SHED = ["My name is Ada and my shed code is 55102.", "What is my shed code?", "And what is my name?"]
STORY = "Write a long story about a lighthouse keeper and the sea."
CHAT = ChatSettings(policies=("streamingllm",), budget=40, block_size=8, max_new_tokens=32)


def download(page: Page, label: str) -> bytes:
    """One file from the chat's Save / restore popover."""
    open_popover(page)
    with page.expect_download(timeout=60_000) as info:  # the popover may reach below the window
        page.get_by_role("button", name=label).dispatch_event("click")
    data = Path(info.value.path()).read_bytes()
    page.keyboard.press("Escape")
    done_running(page)  # closing the popover reruns the page: the next download waits for its buttons
    return data


def to_middle(element: Locator) -> None:
    """Scroll ``element`` to the middle of the window."""
    element.evaluate("e => e.scrollIntoView({block: 'center'})")


def open_popover(page: Page, name: str = "Save / restore session") -> None:
    """Open a popover from the middle of the window, so that its contents fit below it (a popover opened at the
    window's bottom edge reaches past it, where no scrolling brings it)."""
    button = page.get_by_role("button", name=name, exact=True)
    to_middle(button)
    button.click()


def click_in_popover(page: Page, popover: str, name: str) -> None:
    """Open ``popover`` and click its button ``name`` at once, during the run that opening the chat's script
    popover starts (the app must close it all the same). A rerun that ends after the popover opened can scroll
    the page under it, carrying the popover past the window's edge with its anchor; as a user would, scroll the
    anchor back into the middle and click again."""
    open_popover(page, popover)
    click_in_open_popover(page, popover, name)


def click_in_open_popover(page: Page, popover: str, name: str) -> None:
    """Click button ``name`` of the open ``popover``; where a rerun carried the popover off the window, scroll its
    anchor back into the middle, and where a rerun on a loaded machine closed it (its choices kept), open it
    again, as a user would, before clicking again."""
    anchor = page.get_by_role("button", name=popover, exact=True)
    target = page.get_by_role("button", name=name, exact=True)
    for _ in range(4):
        try:
            target.click(timeout=10_000)
            return
        except PlaywrightTimeout:
            if target.count() == 0:
                anchor.click()
            else:
                to_middle(anchor)
    target.click(timeout=10_000)


def done_running(page: Page) -> None:
    """Wait until the app's script run has finished: the app's ``data-test-script-state`` reads ``notRunning``
    (this Streamlit never draws its running indicator, so waiting for that to go returned at once). Called right
    after a click, the rerun it starts may not have begun yet: it gets a moment to begin first."""
    try:
        page.locator(f"{APP}:not({IDLE})").wait_for(timeout=RUN_START_MS)
    except PlaywrightTimeout:
        pass  # the run had ended already, or nothing started one
    page.locator(f"{APP}{IDLE}").wait_for(timeout=600_000)


def send(page: Page, text: str) -> None:
    box = page.get_by_placeholder("Message the model")
    box.fill(text)
    box.press("Enter")


def set_number(page: Page, label: str, value: int) -> None:
    field = page.get_by_label(label)
    field.fill(str(value))
    field.press("Enter")
    page.wait_for_timeout(800)


@pytest.mark.slow
def test_chat_settings_stop_downloads_and_restore(server: str, model: LoadedModel, tmp_path: Path) -> None:
    """Issue 13: a refused budget runs nothing; Stop ends a turn in < 2 s and leaves no trace; downloads
    after 1, 2 and 3 turns hold 1, 2 and 3 turns; a restore shows the restored settings."""
    with sync_playwright() as pw:
        page = chromium_page(pw)
        page.goto(f"{server}/chat", timeout=120_000)
        page.get_by_text("Send a message or load a scripted conversation").wait_for(timeout=300_000)

        set_number(page, "Budget (tokens per layer per KV head)", 0)
        page.get_by_text("Refused: the budget must be at least 1").wait_for(timeout=30_000)
        send(page, SHED[0])
        page.get_by_text("Not run: the budget must be at least 1").wait_for(timeout=30_000)
        assert page.locator('[data-testid="stChatMessage"]').count() == 0
        assert page.get_by_text("This conversation runs with").count() == 0

        for name in ("h2o", "snapkv", "pyramidkv"):
            page.get_by_role("button", name=f"Remove {name}").click()
            page.wait_for_timeout(800)
        set_number(page, "Budget (tokens per layer per KV head)", CHAT.budget)
        set_number(page, "Block size", CHAT.block_size)
        set_number(page, "Max reply tokens", CHAT.max_new_tokens)
        files = {}
        for n, text in enumerate(SHED, 1):
            send(page, text)
            page.get_by_text(re.compile(rf"^Turn {n}: 2 policies")).wait_for(timeout=600_000)
            done_running(page)  # until then the popover still shows the last run's (stale) buttons
            files[n] = download(page, "Download session (JSON)")
            assert len(json.loads(files[n])["turns"]) == n
            table = pd.read_csv(io.BytesIO(download(page, "Download per-turn table (CSV)")))
            assert sorted(set(table["turn"])) == list(range(1, n + 1))
            if n == 1:  # a turn stopped midway leaves no trace: the next turn equals a session without it
                send(page, STORY)
                page.locator('[data-testid="stChatMessage"]').filter(has_text="▌").wait_for(timeout=600_000)
                t0 = time.perf_counter()
                page.get_by_role("button", name="Stop").click()
                notice = page.get_by_text("Stopped: the turn ended")
                notice.wait_for(timeout=30_000)
                waited = time.perf_counter() - t0
                ended = float(re.search(r"ended ([\d.]+) s after Stop", notice.inner_text()).group(1))
                # the server measures click to rollback; the browser's wait adds the round trip and drawing
                assert ended < 2.0 and waited < 10.0, (ended, waited)
                page.screenshot(path=str(SHOTS / "chat-stopped.png"))
                assert len(json.loads(download(page, "Download session (JSON)"))["turns"]) == 1
        page.screenshot(path=str(SHOTS / "chat-three-turns.png"), full_page=True)

        reference = ChatSession(model, CHAT, DEFAULT_SYSTEM)
        for text, saved in zip(SHED, json.loads(files[3])["turns"]):
            turn = reference.run_turn(text)
            assert saved["user"] == text and saved["reply"] == turn.reply
            for name, rec in turn.policies.items():
                assert saved["policies"][name]["reply"] == rec.reply
                assert saved["policies"][name]["kl"] == pytest.approx(rec.kl, rel=1e-3, abs=1e-5)

        page.get_by_role("button", name="New conversation").click()
        set_number(page, "Budget (tokens per layer per KV head)", 64)
        open_popover(page)
        restore = tmp_path / "one-turn.json"
        restore.write_bytes(files[1])
        page.locator('[data-testid="stFileUploader"]').filter(has_text="Open a saved session").locator(
            'input[type="file"]').set_input_files(str(restore))
        page.get_by_text("Opened from a file, no model run").wait_for(timeout=60_000)
        page.get_by_role("button", name="Replay it").click()
        page.get_by_text("This conversation runs with").wait_for(timeout=600_000)
        page.wait_for_timeout(1500)
        assert page.get_by_label("Budget (tokens per layer per KV head)").input_value() == str(CHAT.budget)
        assert page.get_by_label("Block size").input_value() == str(CHAT.block_size)
        assert page.get_by_label("Max reply tokens").input_value() == str(CHAT.max_new_tokens)
        assert page.get_by_role("button", name="Remove h2o").count() == 0
        assert "budget 40 tokens" in page.get_by_text("This conversation runs with").inner_text()
        assert page.get_by_text("Settings changed").count() == 0
        assert page.locator('[data-testid="stException"]').count() == 0
        page.screenshot(path=str(SHOTS / "chat-restored.png"), full_page=True)
        page.context.browser.close()


def test_a_message_sent_while_a_turn_runs_says_the_running_turn_was_undone(server: str) -> None:
    """The page runs again on the new message and ends the running turn there: the caches roll back, and the page
    must say so rather than drop the first message without a word."""
    with sync_playwright() as pw:
        page = chromium_page(pw)
        page.goto(f"{server}/chat", timeout=120_000)
        page.get_by_text("Send a message or load a scripted conversation").wait_for(timeout=300_000)
        send(page, STORY)
        page.locator('[data-testid="stChatMessage"]').filter(has_text="▌").wait_for(timeout=600_000)
        send(page, SHED[0])
        page.get_by_text(re.compile(r"^Turn 1: 5 policies")).wait_for(timeout=600_000)
        done_running(page)
        notice = page.get_by_text(f"Your message “{STORY}” was still being answered when the page ran again")
        assert notice.count() == 1
        users = page.locator('[data-testid="stChatMessage"]').filter(has_text=SHED[0])
        assert users.count() >= 1 and page.locator('[data-testid="stChatMessage"]').filter(has_text=STORY).count() == 0
        assert page.locator('[data-testid="stException"]').count() == 0
        page.screenshot(path=str(SHOTS / "chat-cut-short.png"))
        page.context.browser.close()


@pytest.mark.slow
def test_play_all_plays_every_turn_with_its_figures(server: str) -> None:
    """Issue 24: *Play all* on a six-turn script plays every turn in one run (a Stop button per turn, so no
    duplicate key), says 6/6, and each turn picked on the *Show turn* slider draws its figures."""
    with sync_playwright() as pw:
        page = chromium_page(pw)
        page.goto(f"{server}/chat", timeout=120_000)
        page.get_by_text("Send a message or load a scripted conversation").wait_for(timeout=300_000)
        for name in ("h2o", "snapkv", "pyramidkv"):
            page.get_by_role("button", name=f"Remove {name}").click()
            page.wait_for_timeout(800)
        set_number(page, "Budget (tokens per layer per KV head)", 48)
        set_number(page, "Max reply tokens", 8)
        done_running(page)  # on a loaded machine a popover opened during that run came back closed
        page.get_by_role("button", name="Scripted conversation", exact=True).click()
        page.get_by_label("Workload").click()
        page.get_by_role("option", name="conversations/cooking-questions").click()
        done_running(page)
        click_in_open_popover(page, "Scripted conversation", "Load")
        done_running(page)
        page.keyboard.press("Escape")
        done_running(page)
        page.get_by_role("button", name="Play all").click()
        try:  # a click that lands during a rerun is lost on a loaded machine: the user clicks again
            page.get_by_text(re.compile(r"Playing the script|Turn \d/6")).first.wait_for(timeout=60_000)
        except PlaywrightTimeout:
            done_running(page)
            if page.get_by_text("cooking-questions: 0/6 turns played").count():
                page.get_by_role("button", name="Play all").click()
        try:  # about 30 s here, 45 s beside a CPU hog
            page.get_by_text("cooking-questions: 6/6 turns played").wait_for(timeout=300_000)
        except PlaywrightTimeout as exc:  # say where it stopped: the CI log is all a later reader sees
            played = page.locator('[data-testid="stCaptionContainer"]').filter(has_text="turns played")
            # each turn's status line, and any warning or error
            told = page.locator('[data-testid="stExpander"] summary, [data-testid="stAlert"], '
                                '[data-testid="stException"]')
            said = [*played.all_inner_texts(), *told.all_inner_texts()]
            raise AssertionError(f"Play all did not reach 6/6 turns; the page shows: {said}") from exc
        done_running(page)
        assert page.locator('[data-testid="stException"]').count() == 0
        assert page.locator('[data-testid="stChatMessage"]').count() == 12
        slider = page.locator('[data-testid="stSlider"]').filter(has_text="Show turn").get_by_role("slider")
        for turn in range(6, 0, -1):
            title = page.locator(".js-plotly-plot").filter(has_text=f"(turn {turn})")
            title.first.wait_for(timeout=120_000)
            assert page.locator('[data-testid="stException"]').count() == 0, turn
            if turn > 1:
                slider.focus()
                slider.press("ArrowLeft")
                done_running(page)
        page.screenshot(path=str(SHOTS / "chat-play-all.png"), full_page=True)
        page.context.browser.close()


def popover_open(page: Page, button: str, within_ms: int = 30_000) -> bool:
    """Whether the popover that ``button`` opens still shows its contents after ``within_ms`` (it closes on the
    rerun that follows the click, which a busy machine delays)."""
    body = page.locator('[data-testid="stPopoverBody"]').filter(has=page.get_by_role("button", name=button, exact=True))
    try:
        body.first.wait_for(state="hidden", timeout=within_ms)
    except PlaywrightTimeout:
        return True
    return False


def test_load_closes_the_script_popover_and_asks_before_replacing_a_conversation(server: str) -> None:
    """Issue 24: Load closes its popover (it covered Play all), the "Send a message" hint goes, and loading over
    a conversation in progress asks first."""
    with sync_playwright() as pw:
        page = chromium_page(pw)
        page.goto(f"{server}/chat", timeout=120_000)
        page.get_by_text("Send a message or load a scripted conversation").wait_for(timeout=300_000)
        for name in ("h2o", "snapkv", "pyramidkv"):
            page.get_by_role("button", name=f"Remove {name}").click()
            page.wait_for_timeout(800)
        set_number(page, "Max reply tokens", 6)
        click_in_popover(page, "Scripted conversation", "Load")
        page.get_by_role("button", name="Play all").wait_for(timeout=120_000)
        done_running(page)
        assert not popover_open(page, "Load")
        assert page.get_by_text("Send a message or load a scripted conversation").count() == 0
        page.screenshot(path=str(SHOTS / "chat-script-loaded.png"))
        page.get_by_role("button", name="Next turn").click()  # nothing covers it
        page.get_by_text(re.compile(r"^Turn 1: 2 policies")).wait_for(timeout=600_000)
        done_running(page)
        click_in_popover(page, "Scripted conversation", "Load")
        page.get_by_text("replaces the conversation on the page (1 turn)").wait_for(timeout=60_000)
        assert not popover_open(page, "Load")
        page.screenshot(path=str(SHOTS / "chat-replace-asks.png"))
        page.get_by_role("button", name="Keep the conversation").click()
        page.get_by_text("replaces the conversation").wait_for(state="detached", timeout=60_000)
        done_running(page)
        assert page.locator('[data-testid="stChatMessage"]').count() == 2  # the conversation is still there
        assert page.locator('[data-testid="stException"]').count() == 0
        page.context.browser.close()


def test_a_saved_session_opens_with_its_turns_and_figures_without_a_model_run(
        server: str, model: LoadedModel, tmp_path: Path) -> None:
    """Issue 24: uploading a saved session draws its turns and figures at once from the file, labelled."""
    session = ChatSession(model, CHAT, DEFAULT_SYSTEM)
    for text in SHED[:2]:
        session.run_turn(text)
    saved = tmp_path / "two-turns.json"
    saved.write_text(json.dumps(session_to_json(session)), encoding="utf-8")
    with sync_playwright() as pw:
        page = chromium_page(pw)
        page.goto(f"{server}/chat", timeout=120_000)
        page.get_by_text("Send a message or load a scripted conversation").wait_for(timeout=300_000)
        open_popover(page)
        page.locator('[data-testid="stFileUploader"]').filter(has_text="Open a saved session").locator(
            'input[type="file"]').set_input_files(str(saved))
        page.get_by_text("Opened from a file, no model run").wait_for(timeout=60_000)
        page.locator(".js-plotly-plot").first.wait_for(timeout=60_000)
        done_running(page)
        assert page.locator('[data-testid="stChatMessage"]').count() == 4
        for turn in session.turns:
            assert page.get_by_text(turn.reply, exact=False).count() >= 1
        assert page.locator(".js-plotly-plot").count() >= 2
        label = page.locator('[data-testid="stAlert"]').filter(has_text="Opened from a file").inner_text()
        assert f"model {model.facts.name}" in label  # the file's stamp
        assert page.get_by_text("This conversation ran with").count() == 1
        assert page.get_by_text(re.compile(r"^Turn \d: \d policies")).count() == 0  # no turn ran
        assert page.locator('[data-testid="stException"]').count() == 0
        assert page.get_by_role("button", name="Replay it").count() == 1  # the re-run stays one click away
        page.screenshot(path=str(SHOTS / "chat-opened-from-file.png"), full_page=True)
        page.context.browser.close()
