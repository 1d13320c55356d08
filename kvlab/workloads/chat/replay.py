"""A chat session saved and rebuilt: plain JSON out, a replay of its turns back in, or a workload from it."""

from __future__ import annotations

from dataclasses import asdict

from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import Progress
from kvlab.errors import KvlabError
from kvlab.saved import stamp
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.record import learned_heads
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings


def session_to_json(session: ChatSession) -> dict:
    """A session as plain JSON: its stamp, settings, conversation, every turn's record, and what the page
    needs to draw them without the model (each token's text, the model's trained windows)."""
    lm = session.lm
    return {
        "kvlab_session": 1,
        **stamp(lm.facts.name),
        "settings": asdict(session.settings),
        "system": session.system,
        "turns": [t.to_dict() for t in session.turns],
        "tokens": [lm.tokenizer.decode([t]) for t in session.states["full"].tokens],
        "layer_windows": list(lm.facts.layer_windows),
        "head_patterns": {name: {"pattern": pattern.to_json(), "head_compression_ratio": ratio}
                          for name, (pattern, ratio) in learned_heads(session).items()},
    }


def session_conversation(session: ChatSession) -> Conversation | None:
    """A chat in progress as a workload: its replies become the golden history (None before turn 1)."""
    if not session.turns:
        return None
    turns = tuple(Turn(user=t.user, golden=t.reply, prefill=t.prefill, answer=t.answer, metric=t.metric)
                  for t in session.turns)
    return Conversation(name="current-chat", description="the conversation on the chat page",
                        system=session.system, turns=turns)


def replay_session(
    lm: LoadedModel, data: object, progress: Progress | None = None
) -> ChatSession:
    """Rebuild a saved session by re-running its turns (greedy decoding makes it identical)."""
    if not isinstance(data, dict) or data.get("kvlab_session") != 1:
        raise KvlabError("this is not a kvlab session file (no 'kvlab_session': 1)")
    try:
        settings = ChatSettings(**{**data["settings"], "policies": tuple(data["settings"]["policies"])})
        turns = [(t["user"], t["reply"] if t["reply_source"] == "golden" else None, t["prefill"], t["answer"],
                  t.get("metric", "contains")) for t in data["turns"]]
    except (KeyError, TypeError) as exc:
        raise KvlabError(f"the session file is incomplete or malformed ({exc})") from exc
    script = Conversation(name="replay", description="a saved session", system=data.get("system"),
                          turns=tuple(Turn(user=u, golden=g, prefill=p, answer=a, metric=m) for u, g, p, a, m in turns))
    session = ChatSession(lm, settings, data.get("system"), script=script)
    for i, (user, golden, prefill, answer, metric) in enumerate(turns):
        session.run_turn(user, golden=golden, prefill=prefill, answer=answer, metric=metric)
        if progress:
            progress((i + 1) / len(turns), f"Replayed turn {i + 1}/{len(turns)}")
    return session
