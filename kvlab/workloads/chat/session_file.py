"""A chat as saved records: a session file opened without the model, and a replay checked against the file."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.engine.head_patterns import HeadPattern
from kvlab.errors import KvlabError
from kvlab.saved import Stamp, at_most, same_number, stamp_of
from kvlab.workloads.chat.records import TurnResult
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

SESSION_FORMAT = 2  # the "kvlab_session" field of a session file; 2 writes kept positions as runs
READ_FORMATS = (1, SESSION_FORMAT)
HeadSplit = tuple[HeadPattern, float]  # a learned head pattern and the share of streaming heads it is split at


@dataclass
class ChatRecord:
    """What the chat page draws: a conversation's settings and turn records, live or read from a file.

    ``stamp`` is None for the session running on the page; ``texts`` holds each original token's text
    (None for files saved before they were kept: the maps then show positions only).
    """

    settings: ChatSettings
    system: str | None
    turns: list[TurnResult]
    texts: list[str] | None
    windows: tuple[int | None, ...]  # the model's trained window per layer (None: full attention)
    stamp: Stamp | None = None
    heads: dict[str, HeadSplit] = field(default_factory=dict)  # per policy that learned one (DuoAttention)


def record_of(session: ChatSession) -> ChatRecord:
    """The records of the session in progress."""
    lm = session.lm
    texts = [lm.tokenizer.decode([t]) for t in session.states["full"].tokens]  # every policy was fed these
    return ChatRecord(session.settings, session.system, list(session.turns), texts, lm.facts.layer_windows,
                      heads=learned_heads(session))


def learned_heads(session: ChatSession) -> dict[str, HeadSplit]:
    """The head patterns the session's policies learned from the model, by policy."""
    return {name: split for name, p in session.policies.items() if (split := p.learned_heads()) is not None}


def session_settings(data: object) -> ChatSettings:
    """A session file's settings, once it is known to be one (its "kvlab_session" is a format kvlab reads)."""
    if not isinstance(data, dict) or "kvlab_session" not in data:
        raise KvlabError(f"this is not a kvlab session file (no 'kvlab_session': {SESSION_FORMAT})")
    if data["kvlab_session"] not in READ_FORMATS:
        raise KvlabError(f"this is a kvlab session file of format {data['kvlab_session']!r}, which this kvlab (formats "
                         f"{', '.join(map(str, READ_FORMATS))}) cannot read; a newer kvlab may have written it")
    try:
        return ChatSettings(**{**data["settings"], "policies": tuple(data["settings"]["policies"])})
    except (KeyError, TypeError, AttributeError) as exc:
        raise KvlabError(f"the session file is incomplete or malformed ({exc})") from exc


def record_from_json(data: object) -> ChatRecord:
    """A saved session's records, checked, with no model: every figure and table is drawn from them."""
    settings = session_settings(data)
    try:
        turns = [TurnResult.from_dict(t) for t in data["turns"]]
    except (KeyError, TypeError, AttributeError) as exc:
        raise KvlabError(f"the session file is incomplete or malformed ({exc})") from exc
    if not turns:
        raise KvlabError("the session file holds no turn")
    texts = data.get("tokens")
    complete = isinstance(texts, list) and len(texts) == turns[-1].total_tokens
    if not (complete and all(isinstance(t, str) for t in texts)):
        texts = None  # older files kept no token texts; a list of the wrong length would mislabel the maps
    windows = data.get("layer_windows")
    windows = tuple(windows) if isinstance(windows, list) else ()
    return ChatRecord(settings, data.get("system"), turns, texts, windows, stamp_of(data), heads_from_json(data))


def heads_from_json(data: dict) -> dict[str, HeadSplit]:
    """The head patterns a session file saved (none in files from before they were kept)."""
    saved = data.get("head_patterns", {})
    try:
        return {name: (HeadPattern.from_json(split["pattern"]), float(split["head_compression_ratio"]))
                for name, split in saved.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise KvlabError(f"the session file's head patterns are malformed ({exc})") from exc


def replay_differences(saved: list[TurnResult], again: list[TurnResult]) -> list[str]:
    """Where a replay differs from the saved turns (replies, kept tokens, bytes, scores), at most eight places
    named; empty: identical."""
    out = [] if len(saved) == len(again) else [f"turns saved {len(saved)}, replayed {len(again)}"]
    for old, new in zip(saved, again):
        n = old.index + 1
        if old.reply != new.reply:
            out.append(f"turn {n}: the reply fed to every cache differs")
        for name, o in old.policies.items():
            p = new.policies.get(name)
            if p is None:
                out.append(f"turn {n}: {name} was not replayed")
                continue
            checks = (("reply", o.reply == p.reply), ("kept tokens", o.retained == p.retained),
                      ("bytes held", o.kv_bytes == p.kv_bytes), ("KL", same_number(o.kl, p.kl)),
                      ("top-1", same_number(o.top1, p.top1)), ("error", o.error == p.error))
            what = [w for w, same in checks if not same]
            if what:
                out.append(f"turn {n}, {name}: {', '.join(what)} differ")
    return at_most(out)
