"""The RAG corpus: documents and questions with checkable answers, loaded from JSON.

File format (``data/rag/corpus.json``)::

    {
      "name": "...", "description": "...",
      "system": "system prompt placed before the documents",
      "documents": [{"id": "d01", "title": "...", "text": "natural prose"}, ...],
      "questions": [{"id": "q01", "question": "...", "answer": "48213",
                     "answer_prefix": "The door code for the lamp room is",
                     "docs": ["d01"]}, ...]
    }

``answer`` is checked as a case-insensitive substring of the model's greedy continuation;
``answer_prefix`` starts the assistant's reply for the model; ``docs`` names the document(s)
that hold the answer. Document ids sort in the order fixed-ordering uses. ``questions`` may be left
out (a corpus of one's own is then asked free-text questions); ``title``, ``answer`` and ``answer_prefix``
too. ``kvlab.workloads.rag.upload`` reads the same format from uploads, and text files as documents.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.files import MB, decode_utf8, parse_json, read_bytes
from kvlab.paths import RAG_CORPUS

DEFAULT_CORPUS = RAG_CORPUS
DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answer: str | None = None  # None for free-text questions: no correctness check
    answer_prefix: str = ""
    docs: tuple[str, ...] = ()

    def is_right(self, continuation: str) -> bool | None:
        """Whether the answer appears in the continuation (None when there is no answer)."""
        if self.answer is None:
            return None
        return self.answer.lower() in continuation.lower()


@dataclass(frozen=True)
class Corpus:
    name: str
    system: str
    documents: tuple[Document, ...]
    questions: tuple[Question, ...]

    def doc(self, doc_id: str) -> Document:
        for doc in self.documents:
            if doc.id == doc_id:
                return doc
        raise KvlabError(f"unknown document id {doc_id!r}")

    def digest(self) -> str:
        """A fingerprint of what the strategies read (system text and documents), to tell whether a saved run was
        made on this corpus."""
        text = json.dumps([self.system, [asdict(d) for d in self.documents]], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def index(self, doc_id: str) -> int:
        """Position of a document in id order (Prompt Cache's reserved slot)."""
        return sorted(d.id for d in self.documents).index(doc_id)


def _need(entry: dict, key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip():
        raise KvlabError(f"{where}: field {key!r} must be a non-empty string")
    return value


def _optional(entry: dict, key: str, where: str, default: str | None) -> str | None:
    """A field that may be left out, but is a string where it is given (a number as an answer is refused)."""
    value = entry.get(key, default)
    if value is not default and not isinstance(value, str):
        raise KvlabError(f"{where}: field {key!r} must be a string")
    return value


def parse_questions(items: object, doc_ids: set[str], where: str, required: bool = True) -> tuple[Question, ...]:
    """Validate a list of question entries against the corpus's document ids (an empty list where not required)."""
    if not isinstance(items, list) or (required and not items):
        raise KvlabError(f"{where}: field 'questions' must be a {'non-empty ' if required else ''}list")
    out = []
    for i, q in enumerate(items):
        tag = f"{where}: question {i + 1}"
        if not isinstance(q, dict):
            raise KvlabError(f"{tag} is not an object")
        docs = q.get("docs", [])
        if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
            raise KvlabError(f"{tag}: field 'docs' must be a list of document ids")
        unknown = [d for d in docs if d not in doc_ids]
        if unknown:
            raise KvlabError(f"{tag}: field 'docs' names unknown document(s) {unknown}")
        out.append(Question(id=str(q.get("id", f"q{i + 1:02d}")), question=_need(q, "question", tag),
                            answer=_optional(q, "answer", tag, None),
                            answer_prefix=_optional(q, "answer_prefix", tag, "") or "", docs=tuple(docs)))
    return tuple(out)


def corpus_from_json(raw: object, name: str) -> Corpus:
    """A corpus from its parsed JSON (the format above); ``name`` is the file's, for refusals that point into it.

    ``questions`` may be left out: such a corpus is asked free-text questions, with no answer check.
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("documents"), list) or not raw["documents"]:
        raise KvlabError(f"{name}: expected an object with a non-empty 'documents' list")
    docs = []
    for i, d in enumerate(raw["documents"]):
        tag = f"{name}: document {i + 1}"
        if not isinstance(d, dict):
            raise KvlabError(f"{tag} is not an object")
        docs.append(Document(id=_need(d, "id", tag), title=_optional(d, "title", tag, "") or "",
                             text=_need(d, "text", tag)))
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise KvlabError(f"{name}: field 'id' must be unique, and {dup!r} names two documents")
    questions = parse_questions(raw.get("questions", []), set(ids), name, required=False)
    stem = Path(name).stem
    return Corpus(name=_optional(raw, "name", name, stem) or stem,
                  system=_optional(raw, "system", name, DEFAULT_SYSTEM) or DEFAULT_SYSTEM,
                  documents=tuple(docs), questions=questions)


def load_corpus(path: str | Path = DEFAULT_CORPUS) -> Corpus:
    """Read and validate a corpus file; KvlabError with a one-line reason when it is malformed."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvlabError(f"cannot read corpus {path}: {exc}") from exc
    return corpus_from_json(raw, path.name)


def load_questions(path: str | Path, corpus: Corpus) -> tuple[Question, ...]:
    """Questions from a separate file: a JSON list, or an object with a 'questions' list."""
    path = Path(path)
    name = f"question file {path.name}"
    raw = parse_json(decode_utf8(read_bytes(path, "question file"), name, MB, "question files"), name)
    items = raw.get("questions") if isinstance(raw, dict) else raw
    return parse_questions(items, {d.id for d in corpus.documents}, path.name)
