"""Uploads in a real browser: an SCBench-schema JSONL on the arena page and a corpus of one's own on the RAG page,
each after a bad file of its kind that is refused in one sentence while the page goes on. No long model work:
the arena's run is cancelled as soon as it starts, and the RAG page runs no question."""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import Locator, Page, sync_playwright
from test_browser import SHOTS, chromium_page

from kvlab.paths import RETRIEVAL_DIR
from kvlab.workloads.chat.conversation import list_workloads, load_conversation

pytestmark = [pytest.mark.browser, pytest.mark.model]  # Chromium against the app, which loads the embedded model

RECORD = {"id": 4, "context": "The boat key number is 6613. The shed code is 2290.",
          "multi_turns": [{"input": "What is the boat key number?", "answer": "6613"},
                          {"input": "What is the shed code?", "answer": "2290"}]}
BUDGETS = 4  # the arena's default budgets, 64,128,256,512 tokens


def uploader(page: Page, text: str) -> Locator:
    """The file input of the uploader whose label holds ``text``."""
    return page.locator('[data-testid="stFileUploader"]').filter(has_text=text).locator('input[type="file"]')


def no_exception(page: Page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0


def test_scbench_and_corpus_uploads_with_a_bad_file_of_each_kind(server: str) -> None:
    with sync_playwright() as pw:
        page = chromium_page(pw)
        page.goto(f"{server}/arena", timeout=120_000)
        page.get_by_role("heading", name="arena").first.wait_for(timeout=300_000)
        workload = uploader(page, "upload a workload")
        bad = json.dumps({**RECORD, "multi_turns": [{"input": "q"}]}) + "\n"
        workload.set_input_files(files=[{"name": "scbench_kv.jsonl", "mimeType": "application/jsonl",
                                         "buffer": bad.encode()}])
        page.get_by_text("scbench_kv.jsonl").first.wait_for(timeout=60_000)
        page.get_by_role("button", name="Run the grid").click()
        page.get_by_text("multi_turns[0] has no 'answer'").wait_for(timeout=120_000)
        no_exception(page)
        workload.set_input_files(files=[{"name": "scbench_kv.jsonl", "mimeType": "application/jsonl",
                                         "buffer": (json.dumps(RECORD) + "\n").encode()}])
        page.wait_for_timeout(1500)
        page.get_by_role("button", name="Run the grid").click()
        cancel = page.get_by_role("button", name="Cancel")
        cancel.wait_for(timeout=300_000)  # accepted: the grid runs with the SCBench session in it
        progress = page.get_by_text(re.compile(r"\d+/\d+ turns")).first.inner_text()
        default = len(load_conversation(list_workloads(RETRIEVAL_DIR)[0]).turns)  # the picker's default workload
        assert f"/{(default + len(RECORD['multi_turns'])) * BUDGETS} turns" in progress, progress
        assert page.get_by_text("has no 'answer'").count() == 0
        page.screenshot(path=str(SHOTS / "arena_scbench_upload.png"), full_page=True)
        cancel.click()  # a busy CPU may take minutes over the turn in progress: the page is not kept waiting
        page.get_by_text("Cancelling: the turn in progress").or_(
            cancel.and_(page.locator(":disabled"))).or_(page.get_by_role("button", name="Run the grid").and_(
                page.locator(":enabled"))).first.wait_for(timeout=120_000)
        no_exception(page)

        page.goto(f"{server}/rag", timeout=120_000)
        page.get_by_role("heading", name="RAG").first.wait_for(timeout=300_000)
        corpus = uploader(page, "Your corpus")
        corpus.set_input_files(files=[
            {"name": "mill.md", "mimeType": "text/markdown", "buffer": b"# The mill\n\nThe mill grinds rye."},
            {"name": "ferry.txt", "mimeType": "text/plain", "buffer": b"The ferry leaves at 7:40."}])
        page.get_by_text("This corpus (2 text files) has no question set: type your").wait_for(timeout=120_000)
        page.get_by_text("2 text files (2 documents)").wait_for(timeout=60_000)
        no_exception(page)
        corpus.set_input_files(files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"caf\xe9"}])
        page.get_by_text("notes.txt is not UTF-8 text (bad byte at offset 3). The corpus in use stays.").wait_for(
            timeout=120_000)
        assert page.get_by_text("2 text files (2 documents)").count() == 1  # still the corpus in use
        assert page.get_by_label("Your question (no answer check)").is_editable()
        no_exception(page)
        page.screenshot(path=str(SHOTS / "rag_corpus_upload.png"), full_page=True)
        page.context.browser.close()
