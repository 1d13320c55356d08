"""A RAG corpus of one's own, from files: one JSON corpus, or text and markdown files read one document each.

JSON is the built-in corpus's own format (``kvlab.workloads.rag.corpus``), its ``questions`` optional. A
``.txt`` or ``.md`` file is one document, titled by its file name (``opening-hours.md`` → "opening-hours"),
with ids ``d01``, ``d02``… in the order the files come; such a corpus has no question set, so it is asked
free-text questions (no answer check). The page's upload and ``kvlab rag --corpus`` read files through here.
"""

from __future__ import annotations

from pathlib import Path, PurePath
from typing import Sequence

from kvlab.errors import KvlabError
from kvlab.files import MB, decode_utf8, parse_json, read_bytes
from kvlab.workloads.rag.corpus import Corpus, Document, corpus_from_json

MAX_CORPUS_FILE_BYTES = 1 * MB  # per file: a RAG prompt prefills k whole documents, so far longer ones cannot serve
TEXT_SUFFIXES = (".txt", ".md")
KIND = "corpus files"
FILE_SYSTEM = "You are a helpful assistant. Answer the question from the documents."


def corpus_from_files(files: Sequence[tuple[str, bytes]]) -> Corpus:
    """The corpus in ``files`` (name, bytes): one ``.json`` file alone, or any number of ``.txt``/``.md`` files.

    Refused in one sentence naming the file (and the field, for JSON) when a file is too large, not UTF-8,
    not valid JSON, off the schema, empty, or of another type.
    """
    if not files:
        raise KvlabError("no corpus files given")
    suffixes = [PurePath(name).suffix.lower() for name, _ in files]
    for (name, _), suffix in zip(files, suffixes):
        if suffix != ".json" and suffix not in TEXT_SUFFIXES:
            raise KvlabError(f"{name} is not a corpus file: give .txt or .md documents, or one .json corpus")
    if ".json" in suffixes:
        if len(files) > 1:
            raise KvlabError(f"{files[suffixes.index('.json')][0]} is a JSON corpus and comes alone, not with "
                             "other files: put every document in it, or give text files only")
        name, data = files[0]
        return corpus_from_json(parse_json(decode_utf8(data, name, MAX_CORPUS_FILE_BYTES, KIND), name), name)
    docs = []
    for i, (name, data) in enumerate(files):
        text = decode_utf8(data, name, MAX_CORPUS_FILE_BYTES, KIND).strip()
        if not text:
            raise KvlabError(f"{name} is empty: a document needs some text")
        docs.append(Document(id=f"d{i + 1:02d}", title=PurePath(name).stem, text=text))
    title = PurePath(files[0][0]).stem if len(files) == 1 else f"{len(files)} text files"
    return Corpus(name=title, system=FILE_SYSTEM, documents=tuple(docs), questions=())


def corpus_from_paths(paths: Sequence[str | Path]) -> Corpus:
    """``corpus_from_files`` on files on disk (``kvlab rag --corpus``); a file that cannot be read is refused."""
    return corpus_from_files([(Path(path).name, read_bytes(path, "corpus file")) for path in paths])
