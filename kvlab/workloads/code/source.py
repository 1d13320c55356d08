"""Where the code to edit comes from: files in ``data/code``, uploads, installed modules, pasted text.

Installed modules are read at run time from the file ``importlib`` finds for them; the module itself
is not imported (only its parent packages are, as ``find_spec`` requires), so nothing runs.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.files import MB, read_bytes
from kvlab.paths import CODE_DIR, EDITS_DIR

MAX_BYTES = 1 * MB  # far past any embedded model's context; the file's tokens are checked next
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def code_files() -> list[Path]:
    """The project's own code files for editing."""
    return sorted(CODE_DIR.glob("*.py"))


def edit_scripts() -> list[Path]:
    """The scripted edit sequences."""
    return sorted(EDITS_DIR.glob("*.json"))


def decode_bytes(data: bytes, name: str = "upload", max_bytes: int = MAX_BYTES) -> str:
    """UTF-8 text of an upload; KvlabError if it is too large, not UTF-8 or empty."""
    if len(data) > max_bytes:
        raise KvlabError(f"{name} is {len(data):,} bytes; the limit is {max_bytes:,}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvlabError(f"{name} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x})") from None
    if not text.strip():
        raise KvlabError(f"{name} is empty")
    return text.replace("\r\n", "\n")


def read_file(path: str | Path, max_bytes: int = MAX_BYTES) -> str:
    """A local file's text, with the same checks as an upload."""
    return decode_bytes(read_bytes(path, "code file"), Path(path).name, max_bytes)


def module_source(name: str, max_bytes: int = MAX_BYTES) -> tuple[str, str]:
    """(source text, file path) of an installed Python module such as ``json.decoder``."""
    name = name.strip()
    if not _MODULE_NAME.fullmatch(name):
        raise KvlabError(f"{name!r} is not a module name (e.g. json.decoder)")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise KvlabError(f"module {name!r} could not be found: {exc}") from None
    if spec is None:
        raise KvlabError(f"no installed module is called {name!r}")
    origin = spec.origin or ""
    if origin == "frozen":  # stdlib modules frozen into the interpreter still ship their .py file
        origin = getattr(spec.loader_state, "filename", None) or origin
    if not origin.endswith(".py") or not Path(origin).is_file():
        what = Path(origin).name if origin else "a namespace package"  # the name, not where the server keeps it
        raise KvlabError(f"module {name!r} has no Python source file (it is {what})")
    return read_file(origin, max_bytes), origin
