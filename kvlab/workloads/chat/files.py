"""Workload files of every schema kvlab reads: its own conversation JSON, and SCBench's JSONL, JSON or parquet.

The schema is recognised by the file's extension (``.jsonl``, ``.parquet``) and content: objects with
``multi_turns`` are SCBench records, everything else is kvlab's conversation format
(``kvlab.workloads.chat.conversation``), one per file or, in a ``.jsonl`` file (``kvlab tasks`` writes
them), one per line.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.files import MB, check_size, decode_utf8, read_bytes
from kvlab.workloads.chat.conversation import Conversation, conversation_from_bytes, parse_conversation
from kvlab.workloads.chat.scbench import hub_records, records_conversations

MAX_SCBENCH_BYTES = 270 * MB  # SCBench's largest task files are about 256 MiB (268 MB)


def _text(data: bytes, filename: str) -> str:
    return decode_utf8(data, filename, MAX_SCBENCH_BYTES, "SCBench files")


def _jsonl(text: str, filename: str) -> list:
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise KvlabError(f"{filename} line {n} is not valid JSON: {err.msg}") from None
    return records


def _parquet(data: bytes, filename: str) -> list:
    try:
        import pandas as pd
        import pyarrow  # noqa: F401  (pandas reads parquet through it)
    except ImportError:
        raise KvlabError(f"{filename}: reading parquet needs the pyarrow package, which is not installed; "
                         "pass the task's JSONL file instead") from None
    try:
        frame = pd.read_parquet(io.BytesIO(data))
    except Exception as exc:  # a damaged or foreign file: one line naming it
        raise KvlabError(f"{filename} is not a readable parquet file ({type(exc).__name__})") from None
    return json.loads(frame.to_json(orient="records", force_ascii=False))


def _is_scbench(obj: object) -> bool:
    first = obj[0] if isinstance(obj, list) and obj else obj
    return isinstance(first, dict) and "multi_turns" in first


def _conversations(objs: list, filename: str, record: str | None) -> list[Conversation]:
    """kvlab conversations, one per line of a JSONL file (``record``: only the one of that name)."""
    stem = Path(filename).stem
    convs = []
    for n, obj in enumerate(objs, 1):
        try:
            convs.append(parse_conversation(obj, name=f"{stem}-{n}"))
        except KvlabError as err:
            raise KvlabError(f"{filename} line {n}: {err}") from None
    if record is None:
        return convs
    chosen = [c for c in convs if c.name == record]
    if not chosen:
        raise KvlabError(f"{filename} has no conversation named {record!r}; its names: "
                         f"{', '.join(c.name for c in convs[:8])}{' …' if len(convs) > 8 else ''}")
    return chosen


def workloads_from_bytes(data: bytes, filename: str, record: str | None = None) -> list[Conversation]:
    """The conversations in an uploaded or read file: one for kvlab's format, one per SCBench record or line
    of a JSONL file (only the one whose id or name is ``record`` when given). Every failure is a one-line
    KvlabError naming the file."""
    suffix = Path(filename).suffix.lower()
    if suffix in (".jsonl", ".parquet") or record is not None:
        check_size(data, filename, MAX_SCBENCH_BYTES, "SCBench files")
    if suffix == ".parquet":
        records = _parquet(data, filename)
    elif suffix == ".jsonl":
        records = _jsonl(_text(data, filename), filename)
        if not records:  # neither format's: no line holds a record
            raise KvlabError(f"{filename} holds no record: a JSONL workload has one conversation (kvlab's format) "
                             "or one SCBench record per line")
        if not any(_is_scbench(r) for r in records):
            return _conversations(records, filename, record)
    else:
        try:
            obj = json.loads(_text(data, filename)) if len(data) <= MAX_SCBENCH_BYTES else None
        except json.JSONDecodeError:
            obj = None  # kvlab's loader says where the JSON breaks
        if not _is_scbench(obj):
            if record is not None:
                raise KvlabError(f"{filename} is not an SCBench file (records with 'multi_turns'); --record "
                                 "picks a record of one")
            return [conversation_from_bytes(data, filename)]
        records = obj if isinstance(obj, list) else [obj]
    try:
        return records_conversations(records, Path(filename).name, record)
    except KvlabError as err:
        raise KvlabError(f"{filename}: {err}") from None


def load_workloads(path: str | Path, record: str | None = None) -> list[Conversation]:
    """Read a workload file of any schema (see ``workloads_from_bytes``)."""
    return workloads_from_bytes(read_bytes(path, "workload file"), Path(path).name, record)


def workloads_of(files: list[str], scbench: str | None, record: str | None = None) -> list[Conversation]:
    """The conversations of workload files and of an SCBench task from the hub (``--scbench``)."""
    convs = [c for f in files for c in load_workloads(f, record)]
    if scbench is not None:
        convs += records_conversations(hub_records(scbench), scbench, record)
    if not convs:
        raise KvlabError("name a workload file or an SCBench task (--scbench TASK)")
    return convs
