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
        raise KvlabError(
            f"this turn needs {needed} positions but the model's context is {limit}; "
            "start a new conversation or use the re-rotated position mode"
        )


def check_script_fits(lm: LoadedModel, position_mode: str, conv: Conversation) -> None:
    """Refuse, before any turn runs, a conversation whose messages and golden replies alone take original positions
    past the trained context (``check_fits`` would refuse it only at the turn that overflows, after the others ran).

    Blocks are counted apart, so a token merged across two of them may be counted twice: a margin of two tokens a
    turn keeps a conversation that fits from being refused."""
    if position_mode != "original":
        return
    fmt = chat_format(lm.tokenizer, conv.system)
    least = len(fmt.start_ids) + len(lm.encode(fmt.opening)) - 2 * len(conv.turns)
    least += sum(len(lm.encode(fmt.user_block(t.user))) for t in conv.turns)
    least += sum(len(lm.encode(t.golden + fmt.assistant_end)) for t in conv.turns if t.golden)
    if least > lm.facts.context_length:
        raise KvlabError(f"{conv.name}: its messages and golden replies alone take at least {least} positions, more "
                         f"than {lm.facts.name}'s context of {lm.facts.context_length}; no turn was run")


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
