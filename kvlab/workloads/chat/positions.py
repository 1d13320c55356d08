"""Where a chat's rotary positions reach: each policy's largest position per turn, and whether it passed the
model's trained context, so that a turn past it is marked instead of scored as if nothing happened.

In ``original`` mode every policy's queries sit at their place in the whole conversation, so a conversation
longer than the trained context is refused. In ``rerotated`` mode (StreamingLLM's scheme) queries sit at the
cache's length: a policy that bounds its cache stays inside the trained context however long the chat runs,
while Full (and any cache that grows past it) goes on at positions the model never saw in training.
"""

from __future__ import annotations

from kvlab.engine.chatformat import chat_format
from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.errors import KvlabError
from kvlab.workloads.chat.conversation import Conversation
from kvlab.workloads.chat.records import PolicyTurn


def check_fits(lm: LoadedModel, position_mode: str, total_tokens: int, n_new: int, max_new_tokens: int) -> None:
    """Refuse a turn that would take original positions past the trained context: every policy would then sit
    there, with no cache left inside it to compare; re-rotated positions go on (and are marked where they pass)."""
    limit = lm.facts.context_length
    needed = total_tokens + n_new + max_new_tokens
    if needed > limit and position_mode == "original":
        remedy = (f"shorten the message (with its reply it needs {n_new + max_new_tokens} alone; re-rotated "
                  "positions would run it past the trained context too)" if n_new + max_new_tokens > limit
                  else "start a new conversation or use the re-rotated position mode")
        raise KvlabError(f"this turn needs {needed} positions but the model's context is {limit}; {remedy}")


def check_script_fits(lm: LoadedModel, position_mode: str, conv: Conversation, max_new_tokens: int,
                      questions: int, modes: tuple[str, ...] = ("multi-turn",)) -> None:
    """Refuse, before any turn runs, a conversation whose first ``questions`` turns cannot fit the trained context in
    original positions however short the replies (``check_fits`` would refuse it at the turn that overflows, after
    the others ran): in multi-turn mode every message and golden reply before the last turn, the last message and
    its reply's ``max_new_tokens``; in single-shot mode turn 1 and its reply, then the longest later question.

    Blocks are counted apart, so a token merged across two of them may be counted twice: a margin of two tokens a
    turn keeps a conversation that fits from being refused."""
    if position_mode != "original" or not conv.turns:
        return
    fmt = chat_format(lm.tokenizer, conv.system)
    turns = conv.turns[:questions]
    asked = [len(lm.encode(fmt.user_block(t.user))) for t in turns]
    fed = [len(lm.encode(t.golden + fmt.assistant_end)) if t.golden else 0 for t in turns]
    base = len(fmt.start_ids) + len(lm.encode(fmt.opening)) + max_new_tokens - 2 * len(turns)
    least = base + asked[0]
    if "multi-turn" in modes:
        least = max(least, base + sum(asked) + sum(fed[:-1]))
    if "single-shot" in modes and len(turns) > 1:
        least = max(least, base + asked[0] + fed[0] + max(asked[1:]))
    if least > lm.facts.context_length:
        raise KvlabError(f"{conv.name}: its messages and golden replies with {max_new_tokens} new tokens take at least "
                         f"{least} positions, more than {lm.facts.name}'s context of {lm.facts.context_length}; no "
                         "turn was run")


def reach(record: PolicyTurn, position: int) -> None:
    """Note that one of this policy's queries sat at rotary ``position`` this turn."""
    record.max_position = position if record.max_position is None else max(record.max_position, position)


def reach_next(records: dict[str, PolicyTurn], states: dict[str, KVState], n_new: int) -> None:
    """Note the positions the next ``n_new`` tokens of each named state will take (before they are appended)."""
    for name, state in states.items():
        if n_new:
            reach(records[name], int(state.next_positions(n_new)[-1]))


def first_positions(states: dict[str, KVState]) -> dict[str, int]:
    """Each state's next rotary position: where a reply decoded from it starts."""
    return {name: int(state.next_positions(1)[0]) for name, state in states.items()}


def reach_replies(records: dict[str, PolicyTurn], starts: dict[str, int], replies: dict[str, list[int]]) -> None:
    """Note the positions each policy's own reply was decoded at, from ``starts`` (``first_positions``)."""
    for name, ids in replies.items():
        if ids:
            reach(records[name], starts[name] + len(ids) - 1)


def mark_past(records: dict[str, PolicyTurn], context_length: int) -> None:
    """Mark each record whose largest position passed the trained context (positions 0 … context − 1)."""
    for record in records.values():
        record.past_context = record.max_position is not None and record.max_position >= context_length
