"""The RAG page on a corpus of one's own (AppTest, on the tiny model): text files asked free-text questions, a
JSON corpus with its question set, and refusals that leave the corpus and the results in use."""

from __future__ import annotations

import json

import pytest
from page_helpers import open_page
from streamlit.testing.v1 import AppTest

import ui.common
from kvlab.engine.conversion import EMBEDDED
from kvlab.engine.facts import LoadedModel

FILES = [("mill.md", b"# The mill\n\nThe mill at Oda grinds rye on Tuesdays.", "text/markdown"),
         ("ferry.txt", b"The ferry leaves at 7:40 and returns at noon.", "text/plain")]
JSON_CORPUS = {"name": "Harbour notes",
               "documents": [{"id": "h1", "title": "Ferry", "text": "The ferry leaves at 7:40 and returns at noon."},
                             {"id": "h2", "title": "Mill", "text": "The mill at Oda grinds rye on Tuesdays."}],
               "questions": [{"question": "When does the ferry leave?", "answer": "7:40", "docs": ["h1"]}]}


@pytest.fixture
def tiny_page_model(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page runs on the tiny model: it stands in the app's model cache under the embedded model's key."""
    monkeypatch.setitem(ui.common._MODELS, (EMBEDDED, "auto", "auto", False), tiny)


def upload(at: AppTest, files: list | tuple) -> AppTest:
    return at.file_uploader(key="rag_corpus_upload").set_value(files).run()


def ask(at: AppTest, text: str) -> AppTest:
    at.text_input(key="rag_text").set_value(text)
    at.number_input(key="rag_k").set_value(1)
    at.multiselect(key="rag_strategies").set_value(["naive"])
    at.number_input(key="rag_runs").set_value(1)
    return at.button(key="rag_run").click().run()


@pytest.mark.usefixtures("tiny_page_model")
def test_an_uploaded_corpus_is_asked_refused_files_leave_it_in_use() -> None:
    at = open_page("app_pages/rag.py", timeout=120)
    assert at.radio(key="rag_corpus_source").value == "built-in" and at.radio(key="rag_source")
    upload(at, FILES)
    assert not at.exception and not at.error
    assert at.radio(key="rag_corpus_source").value == "own"
    assert not any(r.key == "rag_source" for r in at.radio)  # no question set: free text only, said so
    assert any("This corpus (2 text files) has no question set" in c.value for c in at.caption)
    assert at.selectbox(key="rag_drift_doc").options == ["d01", "d02"]
    assert any("no question set to replay" in i.value for i in at.info)
    ask(at, "When does the ferry leave?")
    assert not at.exception and not at.error
    assert any("**d02** (ferry," in m.value for m in at.markdown)  # BM25 found the ferry file
    assert len(at.session_state["rag_results"]) == 1

    upload(at, [("notes.txt", b"caf\xe9", "text/plain")])
    assert [e.value for e in at.error] == [
        "notes.txt is not UTF-8 text (bad byte at offset 3). The corpus in use stays."]
    assert at.session_state["rag_own_corpus"].name == "2 text files"
    assert len(at.session_state["rag_results"]) == 1 and len(at.main.dataframe) == 2  # the results stay
    upload(at, FILES)  # the refused file taken away again: the same documents, the results kept
    assert not at.error and len(at.session_state["rag_results"]) == 1

    bad = {**JSON_CORPUS, "documents": [{"id": "h1", "title": "Ferry"}]}
    upload(at, ("harbour.json", json.dumps(bad).encode(), "application/json"))
    assert "harbour.json: document 1: field 'text' must be a non-empty string" in at.error[0].value
    assert at.session_state["rag_own_corpus"].name == "2 text files"

    upload(at, ("harbour.json", json.dumps(JSON_CORPUS).encode(), "application/json"))
    assert not at.exception and not at.error
    assert not at.session_state["rag_results"]  # another corpus: a new list of results
    assert at.radio(key="rag_source").value == "From the question set"
    assert at.selectbox(key="rag_pick").options == ["q01 — When does the ferry leave? (answer: 7:40)"]
    assert at.selectbox(key="rag_drift_doc").options == ["h1", "h2"]
    at.button(key="rag_sim_run").click().run()
    assert not at.exception and at.session_state["rag_sim"][0].k.max() == 2  # k up to the corpus's two documents

    upload(at, ("long.txt", b"The mill grinds rye. " * 700, "text/plain"))  # 2,800 tokens: past the context
    assert any("The longest document of long is" in w.value and "context of 2,048" in w.value for w in at.warning)
    at.radio(key="rag_corpus_source").set_value("built-in").run()
    assert not at.warning
    assert not at.exception and len(at.selectbox(key="rag_drift_doc").options) == 14
    assert "rag_sim" not in at.session_state
