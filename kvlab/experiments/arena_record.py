"""An arena run as a saved record: its results JSON opened again, every table and chart drawn from its rows, and
where a replay of it (the same conversations and settings run again) differs from it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pandas as pd

from kvlab.errors import KvlabError
from kvlab.experiments.plan import ArenaSettings
from kvlab.export import records, to_json
from kvlab.policies import POLICIES
from kvlab.saved import Stamp, at_most, differences, stamp_of
from kvlab.workloads.chat.conversation import Conversation, parse_conversation

ARENA_FORMAT = 1  # the "kvlab_arena" field of results.json


@dataclass
class SavedArena:
    """What the arena page draws from a file: the rows, the grid's settings, the workloads' names, its stamp, and
    the conversations it ran (empty in a file saved before they were kept: such a run cannot be replayed)."""

    table: pd.DataFrame
    settings: ArenaSettings
    workloads: list[str]
    cancelled: bool
    stamp: Stamp
    conversations: list[Conversation] = field(default_factory=list)

    @property
    def unreplayable(self) -> str | None:
        """Why this run cannot be replayed, in words (None: it can): a replay runs the whole grid, so a cancelled
        run's file would differ in every row it never reached."""
        if not self.conversations:
            return "it was saved before arena runs kept their conversations"
        if self.cancelled:
            return "it was cancelled before its grid finished, and a replay runs the whole grid; run it again instead"
        return None


def _settings(saved: dict) -> ArenaSettings:
    """The grid a saved run ran; a policy of it not registered here (a plug-in's, not loaded) is named with the way
    to load it, since the file itself is sound."""
    missing = [p for p in saved.get("policies", ()) if isinstance(p, str) and p not in POLICIES]
    if missing:
        raise KvlabError(f"this run used {', '.join(map(repr, missing))}, which {'is' if len(missing) == 1 else 'are'} "
                         "not among the policies loaded here: a plug-in's? Load its file first (--policy-file, or "
                         "KVLAB_POLICY_PATH for the app)")
    return ArenaSettings(**saved)


def arena_from_json(data: object) -> SavedArena:
    """A saved arena run (``results.json``, the page's JSON download) checked, with no model."""
    if not isinstance(data, dict) or data.get("kvlab_arena") != ARENA_FORMAT:
        raise KvlabError(f"this is not a kvlab arena run (no 'kvlab_arena': {ARENA_FORMAT})")
    try:
        settings = _settings(data["settings"])
        rows = data["rows"]
        workloads = [str(w) for w in data.get("workloads", [])]
    except (KeyError, TypeError, AttributeError) as exc:
        raise KvlabError(f"the arena file is incomplete or malformed ({exc})") from exc
    try:
        conversations = [parse_conversation(c) for c in data.get("conversations", [])]
    except (KvlabError, TypeError) as exc:
        raise KvlabError(f"the arena file's conversations are malformed: {exc}") from None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise KvlabError("the arena file holds no result rows")
    table = pd.DataFrame(rows)  # JSON's null reads back as NaN in numeric columns, as the run's table held it
    return SavedArena(older_rows(table), settings, workloads, bool(data.get("cancelled", False)), stamp_of(data),
                      conversations)


ROW_KEYS = ["workload", "budget", "mode", "turn", "policy"]


def replay_differences(saved: pd.DataFrame, again: pd.DataFrame, most: int = 8) -> list[str]:
    """Where a replay's rows differ from the saved run's, timings aside (``kvlab.saved.differences``); empty:
    identical. Rows are matched by workload, budget, mode, turn and policy, whatever order workers returned
    them in; each difference names its row."""
    def rows(table: pd.DataFrame) -> dict[str, dict]:
        plain = json.loads(to_json(records(table)))
        return {" · ".join(f"{k} {r[k]:g}" if isinstance(r[k], float) else f"{k} {r[k]}" for k in ROW_KEYS): r
                for r in plain}

    file, rerun = rows(saved), rows(again)
    out = [f"{key}: only in the {'file' if key in file else 're-run'}"
           for key in sorted(set(file) ^ set(rerun))]
    for key in file.keys() & rerun.keys():
        out += differences(file[key], rerun[key], key, most=None)
    return at_most(sorted(out), most)


def older_rows(table: pd.DataFrame) -> pd.DataFrame:
    """Rows saved by an older kvlab, in today's columns: before extra prefills were recorded none ran; before a
    policy's own time was split from its share of the batch, ``time_s`` held both (and no turn time was kept)."""
    if "extra_prefill_tokens" not in table:
        table = table.assign(extra_prefill_tokens=0, extra_prefill_s=0.0)
    if "own_s" not in table and "time_s" in table:
        own = table["evict_ms"] / 1000 + table["extra_prefill_s"]
        table = table.assign(turn_s=None, own_s=own, shared_s=table["time_s"] - own).drop(columns="time_s")
    return table
