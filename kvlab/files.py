"""A user's file read in words: refused when missing, a folder, unreadable, too large, not UTF-8 text, or not valid
JSON (with where it breaks)."""

from __future__ import annotations

import json
from pathlib import Path

from kvlab.errors import KvlabError

# a megabyte as Streamlit's file uploader counts a limit in the browser (2²⁰ bytes on Windows): a limit that is a whole
# number of these is the limit the widget states and enforces
MB = 1_000_000


def read_bytes(path: str | Path, what: str = "file") -> bytes:
    """The bytes of a local file; ``what`` names it in the refusal ("conversation file", "corpus file", …)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise KvlabError(f"{what} {path} is a folder, not a file")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise KvlabError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise KvlabError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def check_size(data: bytes, name: str, max_bytes: int, kind: str) -> None:
    """Refuse ``data`` over ``max_bytes``; ``kind`` names what the limit is for, e.g. "conversation files"."""
    if len(data) > max_bytes:
        raise KvlabError(f"{name} is {len(data) / MB:.1f} MB; {kind} are limited to {max_bytes / MB:g} MB")


def decode_utf8(data: bytes, name: str, max_bytes: int, kind: str) -> str:
    """``data`` as UTF-8 text (a BOM dropped), refused over ``max_bytes`` (see ``check_size``)."""
    check_size(data, name, max_bytes, kind)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise KvlabError(f"{name} is not UTF-8 text (bad byte at offset {err.start})") from None


def parse_json(text: str, name: str) -> object:
    """``text`` as JSON; a truncated or broken file is refused with the line and column where it breaks."""
    if not text.strip():
        raise KvlabError(f"{name} is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise KvlabError(f"{name} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
