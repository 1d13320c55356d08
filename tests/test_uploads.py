"""Every file a page takes is refused above its own limit, and every limit fits the server's: a saved run, however
long, opens where it was downloaded."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from kvlab.files import MB
from kvlab.saved import MAX_RECORD_BYTES
from kvlab.workloads.chat.files import MAX_SCBENCH_BYTES

ROOT = Path(__file__).resolve().parents[1]
SERVER_MB = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())["server"]["maxUploadSize"]


def test_every_uploader_states_its_own_limit() -> None:
    unlimited = []
    for path in sorted([*(ROOT / "app_pages").glob("*.py"), *(ROOT / "ui").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            wanted = {"file_uploader": "max_upload_size", "new_files": "max_mb"}.get(name)
            if wanted and wanted not in {k.arg for k in node.keywords}:
                unlimited.append(f"{path.name}:{node.lineno}")
    assert not unlimited, f"uploaders without a limit of their own: {unlimited}"


def test_the_server_takes_the_largest_file_kvlab_reads() -> None:
    # a 12-turn chat session at 770 tokens is 8.5 MB: a saved run must open where it was saved
    assert MAX_RECORD_BYTES <= MAX_SCBENCH_BYTES <= SERVER_MB * MB
    assert MAX_SCBENCH_BYTES > (SERVER_MB - 1) * MB  # and not much more: the server's limit is that file's
