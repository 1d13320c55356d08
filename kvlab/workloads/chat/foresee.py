"""What the policies that read the future (the oracle) are given before a chat turn: Full run alone first.

The whole script's future once, before the first turn; for a single-shot question off the script (asked of turn 1's
caches and rolled back after), the future of its own stream: the conversation so far, the question and its reply. A
kept turn off the script has no future to read, and the oracle fails on it in words (``FutureAttention.at``).

Full alone is one ``AttentionPass`` through the conversation's turns: each message, then the reply the conversation
keeps (the golden one, or Full's greedy reply, decoded there). Every single-shot question is asked of the same
conversation, turn 1, so the script's pass is kept as it stood there: a question's own pass runs only the question
and its reply. A session may be handed the script's pass of another with the same model and settings (the arena's
cells of one workload, at other budgets): it runs none of the passes that one ran, and counts their cost all the same.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from kvlab.engine.facts import LoadedModel
from kvlab.engine.future import AttentionPass, FutureAttention, Resume
from kvlab.engine.kvstate import KVState
from kvlab.engine.reconstruction import Repeat
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.positions import check_fits
from kvlab.workloads.chat.records import PolicyTurn, TurnResult
from kvlab.workloads.chat.reply_feed import golden_reply
from kvlab.workloads.chat.settings import ChatSettings


class Session(Protocol):
    """What ``foresee`` reads of a ``ChatSession`` (named here, not imported: the session calls this module)."""

    lm: LoadedModel
    settings: ChatSettings
    script: Conversation | None
    policies: dict[str, Any]
    states: dict[str, KVState]
    turns: list[TurnResult]
    stop_ids: set[int]
    script_future: FutureAttention | None

    def fail(self, name: str, records: dict[str, PolicyTurn], exc: Exception) -> None: ...

    def user_ids(self, user: str, prefill: str, first: bool | None = None) -> list[int]: ...

    def reply_ids(self, reply: str) -> list[int]: ...


def foresee(session: Session, live: list[str], records: dict[str, PolicyTurn], phase: Callable[[str], None],
            user_ids: list[int], turn: Turn, keep: bool) -> None:
    """Set each live seer's ``future`` for ``turn`` (``user_ids``: its message's tokens); each Full pass's cost is
    recorded on their rows, and where one cannot run (it outgrows the model's context) they fail with its error."""
    seers = [n for n in live if session.policies[n].needs_future]
    if not seers or session.script is None:
        return
    if session.script_future is None:
        session.script_future = _full_alone(session, session.script.turns, None, seers, records, phase,
                                            f"the whole script ({len(session.script.turns)} turns)", keep_first=True)
    elif not session.turns:  # a pass another session ran over this script: it is what the seers cost all the same
        _count(session.script_future, seers, records)
    stream = session.script_future
    if stream is None:
        return
    if len(session.turns) > 1:  # past turn 1 for good: no question is asked of it any more, so its pass goes
        stream.resume = None
    tokens = session.states["full"].tokens
    if not keep and not stream.covers(tokens, user_ids):
        question = (tuple(tokens), tuple(user_ids), turn.golden)
        found = stream.asked.get(question)
        if found is not None:  # another session of this script asked it
            _count(found, seers, records)
        elif (start := stream.resume) is not None and start.tokens == tokens:  # after turn 1
            found = _full_alone(session, [turn], start, seers, records, phase, "this single-shot question")
        else:
            so_far = [Turn(t.user, golden=t.reply, prefill=t.prefill) for t in session.turns]  # the replies it was fed
            found = _full_alone(session, [*so_far, turn], None, seers, records, phase,
                                "the conversation so far and this single-shot question")
        if found is None:
            return
        stream.asked[question] = found
        stream = found
    for name in seers:
        session.states[name].future = stream


def _full_alone(session: Session, turns: Sequence[Turn], start: Resume | None, seers: list[str],
                records: dict[str, PolicyTurn], phase: Callable[[str], None], what: str, keep_first: bool = False
                ) -> FutureAttention | None:
    """Full alone on through ``turns`` (from ``start``, or from the first token): what every later query of its
    stream attends to, with, for ``keep_first``, the pass after the first of ``turns`` kept (its ``resume``).
    None, the seers failed, where it cannot run."""
    phase(f"running Full alone over {what} for {', '.join(seers)}")
    t0, lm, max_new = clock(), session.lm, session.settings.max_new_tokens
    stream = AttentionPass(lm, start)
    try:  # its forwards stop on this turn's flags too (the model's layers check them)
        for t in turns:
            ids = session.user_ids(t.user, t.prefill, first=not stream.tokens)
            golden = golden_reply(t.golden, t.prefill) if t.golden else None
            check_fits(lm, "original", len(stream.tokens), len(ids) + (len(lm.encode(t.golden)) if t.golden else 0),
                       max_new)
            logits = stream.feed(ids)
            reply = golden if golden is not None else lm.decode(stream.greedy(logits, max_new, session.stop_ids))
            stream.feed(session.reply_ids(reply))
            if keep_first and stream.resume is None:
                stream.keep()
    except KvlabError as exc:
        for name in seers:
            session.fail(name, records, KvlabError(f"Full could not first run {what}: {exc}"))
        return None
    future = stream.result()
    future.seconds = clock() - t0
    _count(future, seers, records)
    return future


def _count(future: FutureAttention, seers: list[str], records: dict[str, PolicyTurn]) -> None:
    """Full's pass on the seers' rows: the tokens it ran, and its time shared among them."""
    cost = Repeat(tokens=len(future.tokens) - future.resumed, seconds=future.seconds / len(seers))
    for name in seers:
        records[name].repeated(cost)
