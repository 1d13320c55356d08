"""What the policies that read the future (the oracle) are given before a chat turn: Full run alone first.

The whole script's future once, before the first turn; for a single-shot question off the script (asked of turn 1's
caches and rolled back after), the future of its own stream: the conversation so far, the question and its reply. A
kept turn off the script has no future to read, and the oracle fails on it in words (``FutureAttention.at``).

Every single-shot question is asked of the same conversation, turn 1, so the script's pass keeps Full alone as it
stood there (its session and its attention pass): a question's own pass runs only the question and its reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from kvlab.engine.facts import LoadedModel
from kvlab.engine.future import FutureAttention, Resume, future_attention
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
    segments: list[dict]
    script_future: ScriptFuture | None

    def fail(self, name: str, records: dict[str, PolicyTurn], exc: Exception) -> None: ...

    def fork(self) -> Session: ...

    def run_turn(self, user: str, golden: str | None = None, prefill: str = "", answer: str | None = None
                 ) -> TurnResult: ...


@dataclass
class ScriptFuture:
    """Full alone over the whole script: what its later queries attend to, and Full alone at the end of its turn 1."""

    stream: FutureAttention  # its ``resume`` is the attention pass at the end of turn 1
    first: Session | None  # a Full-alone session after turn 1, where single-shot questions are asked


def foresee(session: Session, live: list[str], records: dict[str, PolicyTurn], phase: Callable[[str], None],
            user_ids: list[int], turn: Turn, keep: bool) -> None:
    """Set each live seer's ``future`` for ``turn`` (``user_ids``: its message's tokens); each Full pass's cost is
    recorded on their rows, and where one cannot run (it outgrows the model's context) they fail with its error."""
    seers = [n for n in live if session.policies[n].needs_future]
    if not seers or session.script is None:
        return
    if session.script_future is None:
        session.script_future = _full_alone(session, _fresh(session), session.script.turns, None, seers, records,
                                            phase, f"the whole script ({len(session.script.turns)} turns)",
                                            keep_first=True)
    script = session.script_future
    if script is None:
        return
    stream = script.stream
    if len(session.turns) > 1:  # past turn 1 for good: no question is asked of it any more, so its caches go
        script.first = stream.resume = None
    if not keep and not stream.covers(session.states["full"].tokens, user_ids):
        first = script.first
        if first is not None and first.states["full"].tokens == session.states["full"].tokens:  # after turn 1
            found = _full_alone(session, first.fork(), [turn], stream.resume, seers, records, phase,
                                "this single-shot question")
        else:
            so_far = [Turn(t.user, golden=t.reply, prefill=t.prefill) for t in session.turns]  # the replies it was fed
            found = _full_alone(session, _fresh(session), [*so_far, turn], None, seers, records, phase,
                                "the conversation so far and this single-shot question")
        if found is None:
            return
        stream = found.stream
    for name in seers:
        session.states[name].future = stream


def _fresh(session: Session) -> Session:
    """A new session of Full alone, with ``session``'s model, system prompt and reply length."""
    return type(session)(session.lm, ChatSettings(policies=("full",),
                                                  max_new_tokens=session.settings.max_new_tokens), session.system)


def _full_alone(session: Session, alone: Session, turns: Sequence[Turn], start: Resume | None, seers: list[str],
                records: dict[str, PolicyTurn], phase: Callable[[str], None], what: str, keep_first: bool = False
                ) -> ScriptFuture | None:
    """Full ``alone`` on through ``turns``: what every later query of its stream attends to (the attention pass
    going on from ``start`` where the stream begins as it did) and, with ``keep_first``, Full alone after the first
    of ``turns`` and its attention pass there. None, the seers failed, where it cannot run."""
    phase(f"running Full alone over {what} for {', '.join(seers)}")
    t0, before = clock(), len(alone.states["full"].tokens)
    first = None
    try:  # its turns stop on this turn's flags too (``stopping`` nests)
        for t in turns:
            alone.run_turn(t.user, golden=t.golden, prefill=t.prefill, answer=t.answer)
            if keep_first and first is None:
                first = alone.fork()
        ends = [g["end"] for g in alone.segments]
        stream = future_attention(session.lm, alone.states["full"].tokens, ends, start=start,
                                  keep_at=first.segments[-1]["end"] if first is not None else None)
    except KvlabError as exc:
        for name in seers:
            session.fail(name, records, KvlabError(f"Full could not first run {what}: {exc}"))
        return None
    # the tokens this pass ran: all but those that both Full alone and its attention pass went on from
    cost = Repeat(tokens=len(stream.tokens) - min(before, stream.resumed), seconds=(clock() - t0) / len(seers))
    for name in seers:
        records[name].repeated(cost)
    return ScriptFuture(stream, first)
