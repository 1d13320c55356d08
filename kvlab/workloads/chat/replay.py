"""A chat session saved and rebuilt: plain JSON out, a replay of its turns back in, or a workload from it."""

from __future__ import annotations

from dataclasses import asdict

from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import Progress
from kvlab.errors import KvlabError
from kvlab.saved import stamp
from kvlab.workloads.chat.conversation import Conversation, Turn, conversation_to_json, parse_conversation
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.session_file import SESSION_FORMAT, learned_heads, session_settings


def session_to_json(session: ChatSession) -> dict:
    """A session as plain JSON: its stamp, settings, conversation, every turn's record, and what the page
    needs to draw them without the model (each token's text, the model's trained windows)."""
    lm = session.lm
    # the finished turns only, and the tokens they hold: the page builds this file when its button is clicked,
    # which may be while the next turn runs
    turns = list(session.turns)
    held = turns[-1].total_tokens if turns else 0
    return {
        "kvlab_session": SESSION_FORMAT,
        **stamp(lm.facts.name),
        "settings": asdict(session.settings),
        "system": session.system,
        "turns": [t.to_dict() for t in turns],
        "script": _script_json(session),
        "tokens": [lm.tokenizer.decode([t]) for t in session.states["full"].tokens[:held]],
        "layer_windows": list(lm.facts.layer_windows),
        "head_patterns": {name: {"pattern": pattern.to_json(), "head_compression_ratio": ratio}
                          for name, (pattern, ratio) in learned_heads(session).items()},
    }


def _script_json(session: ChatSession) -> dict | None:
    """The script a session plays (its turns yet to come included), in the file form; None for a live chat."""
    if session.script is None:
        return None
    try:
        return conversation_to_json(session.script)
    except KvlabError:  # a script the file form cannot hold (a golden reply missing mid-way): the turns still replay
        return None


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
    """Rebuild a saved session by re-running its turns (greedy decoding makes it identical), with the script it
    played where it had one, so that its turns to come can be played after."""
    settings = session_settings(data)
    try:
        played = tuple(Turn(user=t["user"], golden=t["reply"] if t["reply_source"] == "golden" else None,
                            prefill=t["prefill"], answer=t["answer"], metric=t.get("metric", "contains"))
                       for t in data["turns"])
    except (KeyError, TypeError) as exc:
        raise KvlabError(f"the session file is incomplete or malformed ({exc})") from exc
    if data.get("script") is not None:  # the script it played, the turns to come included (the oracle reads them)
        script = parse_conversation(data["script"], "the session file's script")
        if script.turns[:len(played)] != played:
            raise KvlabError("the session file's script does not begin with the turns it saved")
    else:
        script = Conversation(name="replay", description="a saved session", system=data.get("system"), turns=played)
    session = ChatSession(lm, settings, data.get("system"), script=script)
    for i, turn in enumerate(played, 1):
        session.run_turn(turn.user, golden=turn.golden, prefill=turn.prefill, answer=turn.answer, metric=turn.metric)
        if progress:
            progress(i / len(played), f"Replayed turn {i}/{len(played)}")
    return session
