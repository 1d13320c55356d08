"""An arena run as a saved record: its results JSON opened again, every table and chart drawn from its rows."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from kvlab.errors import KvlabError
from kvlab.experiments.plan import ArenaSettings
from kvlab.saved import Stamp, stamp_of

ARENA_FORMAT = 1  # the "kvlab_arena" field of results.json


@dataclass
class SavedArena:
    """What the arena page draws from a file: the rows, the grid's settings, the workloads' names, its stamp."""

    table: pd.DataFrame
    settings: ArenaSettings
    workloads: list[str]
    cancelled: bool
    stamp: Stamp


def arena_from_json(data: object) -> SavedArena:
    """A saved arena run (``results.json``, the page's JSON download) checked, with no model."""
    if not isinstance(data, dict) or data.get("kvlab_arena") != ARENA_FORMAT:
        raise KvlabError(f"this is not a kvlab arena run (no 'kvlab_arena': {ARENA_FORMAT})")
    try:
        settings = ArenaSettings(**data["settings"])
        rows = data["rows"]
        workloads = [str(w) for w in data.get("workloads", [])]
    except (KeyError, TypeError) as exc:
        raise KvlabError(f"the arena file is incomplete or malformed ({exc})") from exc
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise KvlabError("the arena file holds no result rows")
    table = pd.DataFrame(rows)  # JSON's null reads back as NaN in numeric columns, as the run's table held it
    return SavedArena(older_rows(table), settings, workloads, bool(data.get("cancelled", False)), stamp_of(data))


def older_rows(table: pd.DataFrame) -> pd.DataFrame:
    """Rows saved by an older kvlab, in today's columns: before extra prefills were recorded none ran; before a
    policy's own time was split from its share of the batch, ``time_s`` held both (and no turn time was kept)."""
    if "extra_prefill_tokens" not in table:
        table = table.assign(extra_prefill_tokens=0, extra_prefill_s=0.0)
    if "own_s" not in table and "time_s" in table:
        own = table["evict_ms"] / 1000 + table["extra_prefill_s"]
        table = table.assign(turn_s=None, own_s=own, shared_s=table["time_s"] - own).drop(columns="time_s")
    return table
