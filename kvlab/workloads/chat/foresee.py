"""What the policies that read the future (the oracle) are given before a chat turn: Full run alone first.

The whole script's future once, before the first turn; for a single-shot question off the script (asked of turn 1's
caches and rolled back after), the future of its own stream: the conversation so far, the question and its reply. A
kept turn off the script has no future to read, and the oracle fails on it in words (``FutureAttention.at``).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from kvlab.engine.facts import LoadedModel
from kvlab.engine.future import FutureAttention, future_attention
from kvlab.engine.kvstate import KVState
from kvlab.engine.reconstruction import Repeat
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.records import PolicyTurn, TurnResult
from kvlab.workloads.chat.settings import ChatSettings


class Session(Protocol):
    """What ``foresee`` reads of a ``ChatSession`` (named here, not imported: the session calls this module)."""

    lm: LoadedModel
    settings: ChatSettings
    system: str | None
    script: Conversation | None
    policies: dict[str, Any]
    states: dict[str, KVState]
    turns: list[TurnResult]
    script_future: FutureAttention | None

    def fail(self, name: str, records: dict[str, PolicyTurn], exc: Exception) -> None: ...


def foresee(session: Session, live: list[str], records: dict[str, PolicyTurn], phase: Callable[[str], None],
            user_ids: list[int], turn: Turn, keep: bool) -> None:
    """Set each live seer's ``future`` for ``turn`` (``user_ids``: its message's tokens); each Full pass's cost is
    recorded on their rows, and where one cannot run (it outgrows the model's context) they fail with its error."""
    seers = [n for n in live if session.policies[n].needs_future]
    if not seers or session.script is None:
        return
    if session.script_future is None:
        session.script_future = _full_alone(session, session.script.turns, seers, records, phase,
                                            f"the whole script ({len(session.script.turns)} turns)")
    stream = session.script_future
    if stream is None:
        return
    if not keep and not stream.covers(session.states["full"].tokens, user_ids):
        so_far = [Turn(t.user, golden=t.reply, prefill=t.prefill) for t in session.turns]  # the replies it was fed
        stream = _full_alone(session, [*so_far, turn], seers, records, phase,
                             "the conversation so far and this single-shot question")
        if stream is None:
            return
    for name in seers:
        session.states[name].future = stream


def _full_alone(session: Session, turns: Sequence[Turn], seers: list[str], records: dict[str, PolicyTurn],
                phase: Callable[[str], None], what: str) -> FutureAttention | None:
    """Full alone over ``turns``: what every later query of that stream attends to (None, the seers failed, where it
    cannot run)."""
    phase(f"running Full alone over {what} for {', '.join(seers)}")
    t0 = clock()
    alone = type(session)(session.lm, ChatSettings(policies=("full",), max_new_tokens=session.settings.max_new_tokens),
                          session.system)
    try:  # its turns stop on this turn's flags too (``stopping`` nests)
        for t in turns:
            alone.run_turn(t.user, golden=t.golden, prefill=t.prefill, answer=t.answer)
        stream = future_attention(session.lm, alone.states["full"].tokens, [g["end"] for g in alone.segments])
    except KvlabError as exc:
        for name in seers:
            session.fail(name, records, KvlabError(f"Full could not first run {what}: {exc}"))
        return None
    cost = Repeat(tokens=len(stream.tokens), seconds=(clock() - t0) / len(seers))
    for name in seers:
        records[name].repeated(cost)
    return stream
