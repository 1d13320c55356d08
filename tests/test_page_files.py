"""The files pages take and give: every upload refused above its own limit, every limit within the server's (a saved
run, however long, opens where it was downloaded), and every download served without running the page again."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from kvlab.files import MB
from kvlab.saved import MAX_RECORD_BYTES
from kvlab.workloads.chat.files import MAX_SCBENCH_BYTES

ROOT = Path(__file__).resolve().parents[1]
SERVER_MB = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())["server"]["maxUploadSize"]


def calls(name: str) -> list[tuple[str, ast.Call]]:
    """Every call of ``name`` (a function or a method) in the pages and ui/, with where it is."""
    found = []
    for path in sorted([*(ROOT / "app_pages").glob("*.py"), *(ROOT / "ui").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = node.func if isinstance(node, ast.Call) else None
            if func is not None and name in (getattr(func, "attr", None), getattr(func, "id", None)):
                found.append((f"{path.name}:{node.lineno}", node))
    return found


def test_every_uploader_states_its_own_limit() -> None:
    found = {name: calls(name) for name in ("file_uploader", "new_files")}
    assert len(found["file_uploader"]) >= 5 and len(found["new_files"]) >= 2  # the pages' uploaders were found
    unlimited = [where for name, limit in (("file_uploader", "max_upload_size"), ("new_files", "max_mb"))
                 for where, call in found[name] if limit not in {k.arg for k in call.keywords}]
    assert not unlimited, f"uploaders without a limit of their own: {unlimited}"


def test_every_download_is_served_without_a_rerun() -> None:
    """A download's click that runs the page again drops the files the last run offered: a second download clicked
    during that run found its file gone (a walk: the arena's JSON right after its CSV)."""
    buttons = calls("download_button")
    assert len(buttons) >= 15
    rerun = [where for where, call in buttons
             if not any(k.arg == "on_click" and getattr(k.value, "value", None) == "ignore" for k in call.keywords)]
    assert not rerun, f"downloads that run the page again: {rerun}"


def test_the_server_takes_the_largest_file_kvlab_reads() -> None:
    # a 12-turn chat session at 770 tokens is 8.5 MB: a saved run must open where it was saved
    assert MAX_RECORD_BYTES <= MAX_SCBENCH_BYTES <= SERVER_MB * MB
    assert MAX_SCBENCH_BYTES > (SERVER_MB - 1) * MB  # and not much more: the server's limit is that file's
