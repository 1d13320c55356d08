"""A RAG corpus of one's own: JSON in the built-in format, text and markdown files as documents, each refusal
one sentence naming the file (and the field); ``kvlab rag --corpus`` reads the same files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import kvlab.cli.rag as rag_command
from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.paths import RAG_CORPUS
from kvlab.workloads.rag.corpus import DEFAULT_SYSTEM, load_corpus
from kvlab.workloads.rag.upload import FILE_SYSTEM, MAX_CORPUS_FILE_BYTES, corpus_from_files, corpus_from_paths

DOCS = [{"id": "a", "title": "The mill", "text": "The mill at Oda grinds rye on Tuesdays."},
        {"id": "b", "text": "The ferry leaves at 7:40 and returns at noon."}]
QUESTIONS = [{"question": "When does the ferry leave?", "answer": "7:40", "docs": ["b"]}]


def as_json(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_the_built_in_corpus_file_reads_as_an_upload() -> None:
    built_in = load_corpus()
    assert corpus_from_files([("corpus.json", RAG_CORPUS.read_bytes())]) == built_in
    assert corpus_from_paths([RAG_CORPUS]) == built_in


def test_a_json_corpus_with_and_without_questions() -> None:
    corpus = corpus_from_files([("mine.json", as_json({"documents": DOCS, "questions": QUESTIONS}))])
    assert corpus.name == "mine" and corpus.system == DEFAULT_SYSTEM
    assert [(d.id, d.title) for d in corpus.documents] == [("a", "The mill"), ("b", "")]
    (q,) = corpus.questions
    assert (q.id, q.answer, q.docs, q.answer_prefix) == ("q01", "7:40", ("b",), "")
    assert q.is_right("It leaves at 7:40.")
    bare = corpus_from_files([("bare.json", as_json({"name": "Notes", "system": "Be brief.", "documents": DOCS}))])
    assert (bare.name, bare.system, bare.questions) == ("Notes", "Be brief.", ())


def test_text_and_markdown_files_are_one_document_each_titled_by_file_name() -> None:
    corpus = corpus_from_files([("opening-hours.md", b"# Hours\n\nOpen 9 to 5.\n"),
                                ("ferry.txt", "\ufeffThe ferry leaves at 7:40.".encode())])
    assert [(d.id, d.title, d.text) for d in corpus.documents] == [
        ("d01", "opening-hours", "# Hours\n\nOpen 9 to 5."), ("d02", "ferry", "The ferry leaves at 7:40.")]
    assert corpus.questions == () and corpus.system == FILE_SYSTEM and corpus.name == "2 text files"
    assert corpus_from_files([("ferry.txt", b"The ferry.")]).name == "ferry"


@pytest.mark.parametrize("files, message", [
    ([("notes.txt", b"caf\xe9")], "notes.txt is not UTF-8 text (bad byte at offset 3)"),
    ([("big.md", b"x" * (MAX_CORPUS_FILE_BYTES + 1))], "big.md is 1.0 MB; corpus files are limited to 1 MB"),
    ([("cut.json", b'{"documents": [')], "cut.json is not valid JSON (line 1, column 16"),
    ([("list.json", b"[1, 2]")], "list.json: expected an object with a non-empty 'documents' list"),
    ([("c.json", as_json({"documents": [{"id": "a", "text": "  "}]}))],
     "c.json: document 1: field 'text' must be a non-empty string"),
    ([("c.json", as_json({"documents": [{"text": "x"}]}))], "c.json: document 1: field 'id' must be a non-empty"),
    ([("c.json", as_json({"documents": ["x"]}))], "c.json: document 1 is not an object"),
    ([("c.json", as_json({"documents": DOCS + DOCS[:1]}))], "c.json: field 'id' must be unique, and 'a' names two"),
    ([("c.json", as_json({"documents": DOCS, "questions": {"q": 1}}))], "c.json: field 'questions' must be a list"),
    ([("c.json", as_json({"documents": DOCS, "questions": [{"answer": "x"}]}))],
     "c.json: question 1: field 'question' must be a non-empty string"),
    ([("c.json", as_json({"documents": DOCS, "questions": [{"question": "Code?", "answer": 7}]}))],
     "c.json: question 1: field 'answer' must be a string"),
    ([("c.json", as_json({"documents": DOCS, "questions": [{"question": "Code?", "docs": ["z"]}]}))],
     "c.json: question 1: field 'docs' names unknown document(s) ['z']"),
    ([("c.json", as_json({"documents": DOCS, "title": 3, "name": 5}))], "c.json: field 'name' must be a string"),
    ([("empty.txt", b" \n ")], "empty.txt is empty"),
    ([("slides.pdf", b"%PDF")], "slides.pdf is not a corpus file: give .txt or .md documents, or one .json"),
    ([("a.txt", b"x"), ("c.json", as_json({"documents": DOCS}))], "c.json is a JSON corpus and comes alone"),
    ([], "no corpus files given"),
])
def test_bad_files_are_refused_naming_the_file_and_field(files: list, message: str) -> None:
    with pytest.raises(KvlabError) as err:
        corpus_from_files(files)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_cli_refuses_a_corpus_without_questions_before_loading_a_model(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    doc = tmp_path / "ferry.txt"
    doc.write_text("The ferry leaves at 7:40.")
    assert main(["rag", "--corpus", str(doc), str(tmp_path / "gone.md")]) == 2
    assert "corpus file not found" in capsys.readouterr().err
    assert main(["rag", "--corpus", str(doc), "--model", str(tmp_path / "no-model")]) == 2
    assert "the corpus 'ferry' has no questions: ask one with --question" in capsys.readouterr().err


def test_the_cli_runs_a_question_on_text_files(tmp_path: Path, tiny: LoadedModel,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rag_command, "load_model", lambda *a, **k: tiny)
    (tmp_path / "mill.md").write_text("# The mill\n\nThe mill at Oda grinds rye on Tuesdays.")
    (tmp_path / "ferry.txt").write_text("The ferry leaves at 7:40 and returns at noon.")
    out = tmp_path / "r.json"
    assert main(["rag", "--corpus", str(tmp_path / "mill.md"), str(tmp_path / "ferry.txt"), "--k", "1",
                 "--question", "When does the ferry leave?", "--strategies", "naive", "--runs", "1",
                 "--answer-tokens", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["corpus"]["name"] == "2 text files" and data["kvlab_rag"] == 1
    assert data["questions"][0]["retrieved"][0][0] == "d02"  # BM25 finds the ferry file

    # no --k: the default 3, or every document of a smaller corpus (a refusal of the default was the answer before)
    assert main(["rag", "--corpus", str(tmp_path / "mill.md"), str(tmp_path / "ferry.txt"), "--question", "Rye?",
                 "--strategies", "naive", "--runs", "1", "--answer-tokens", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["questions"][0]["settings"]["k"] == 2


def test_the_cli_replays_a_saved_run_and_names_what_differs(tmp_path: Path, tiny: LoadedModel,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(rag_command, "load_model", lambda *a, **k: tiny)
    out = tmp_path / "r.json"
    # fixed ordering's prefix cache carries over from question to question: the replay starts on fresh caches too
    assert main(["rag", "--limit", "2", "--k", "2", "--strategies", "naive,fixed", "--runs", "1",
                 "--answer-tokens", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["questions"][1]["settings"]["strategies"] == ["naive", "fixed"]
    capsys.readouterr()
    assert main(["rag", "--replay", str(out), "--out", str(tmp_path / "again.json")]) == 0
    assert f"every question equals {out}'s" in capsys.readouterr().out
    data["questions"][1]["results"][2]["tokens_reused"] += 1
    out.write_text(json.dumps(data))
    tampered = out.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert main(["rag", "--replay", str(out)]) == 1  # no --out: the replay writes nothing, least of all its file
    err = capsys.readouterr().err
    assert "kvlab: error: the replay on" in err and "differs from" in err
    assert re.search(r"question 2 \(q\d+\) · fixed\.tokens_reused: \d+ in the file", err), err
    assert out.read_bytes() == tampered and not (tmp_path / "rag_result.json").exists()
    assert main(["rag", "--replay", str(out), "--csv", str(out)]) == 2
    assert f"--csv {out} is the file being replayed" in capsys.readouterr().err and out.read_bytes() == tampered
    (tmp_path / "mill.md").write_text("# The mill\n\nThe mill at Oda grinds rye on Tuesdays.")
    assert main(["rag", "--replay", str(out), "--corpus", str(tmp_path / "mill.md"), "--out", "o.json"]) == 2
    assert "replay it on that corpus" in capsys.readouterr().err
    del data["corpus"]
    out.write_text(json.dumps(data))
    assert main(["rag", "--replay", str(out), "--out", str(tmp_path / "o.json")]) == 2
    assert "saved before RAG runs kept their corpus and settings" in capsys.readouterr().err
