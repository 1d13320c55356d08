"""Scripted conversations: the workload files in ``data/conversations/`` and ``data/retrieval/``.

File format (UTF-8 JSON, at most 2 MB)::

    {"name": "wifi-and-vault",
     "description": "one line on what the workload tests",
     "messages": [
       {"role": "system", "content": "..."},
       {"role": "user", "content": "..."},
       {"role": "assistant", "content": "The wifi password is 48213.",
        "prefill": "The wifi password is", "answer": "48213"},
       {"role": "user", "content": "..."}]}

- ``name`` and ``description`` are optional strings; the name defaults to the file's stem.
- A bare JSON list of messages (the ``messages`` value alone) is accepted too.
- ``system`` is optional and may only be the first message. Without it the tokenizer's chat
  template supplies its own default system prompt.
- Each user message starts a turn. Assistant messages are optional golden replies (SCBench's
  golden mode: the history carries them instead of the model's own replies). When any assistant
  message is present, roles alternate user/assistant strictly and the last message may be a user
  message (its turn has no golden reply). A file with no assistant messages at all is a plain list
  of user turns; the model's own replies fill the history.
- ``prefill`` (assistant only, optional): the start of the reply that is given to the model
  (teacher-forced) before it continues greedily. The golden reply must start with it.
- ``answer`` (assistant only, optional): a short string that must occur in the model's
  continuation for the turn to count as correct. The golden reply must contain it. Several
  references go one per line.
- ``metric`` (assistant only, optional, with ``answer``): how the answer is checked, one of
  ``kvlab.workloads.chat.metrics.METRICS`` (default ``contains``: every reference occurs).
- At most 64 turns; user messages must not be blank. Unknown fields are refused, so typos surface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.files import MB, decode_utf8, parse_json, read_bytes
from kvlab.workloads.chat.metrics import check_metric, references, shortest_answer

MAX_TURNS = 64
MAX_FILE_BYTES = 2 * MB
ROLES = ("system", "user", "assistant")
_MESSAGE_FIELDS = {"role", "content", "prefill", "answer", "metric"}
_ASSISTANT_ONLY = ("prefill", "answer", "metric")
_TOP_FIELDS = {"name", "description", "messages"}


@dataclass(frozen=True)
class Turn:
    """One user message and, when the file has one, the golden assistant reply."""

    user: str
    golden: str | None = None
    prefill: str = ""
    answer: str | None = None
    metric: str = "contains"  # how ``answer`` is checked (kvlab.workloads.chat.metrics)


@dataclass(frozen=True)
class Conversation:
    """A scripted multi-turn workload: optional system prompt and its turns in order.

    ``notice`` says what the loader changed (a context truncated to fit the model); pages and CLIs show it.
    ``truncatable``: turn 1 may be cut in the middle to fit the model's context, as SCBench does.
    """

    name: str
    description: str
    system: str | None
    turns: tuple[Turn, ...]
    notice: str = ""
    truncatable: bool = False

    @property
    def has_golden(self) -> bool:
        return any(t.golden is not None for t in self.turns)


def check_max_turns(max_turns: int | None, what: str = "max turns") -> None:
    """Refuse a cut of a conversation to fewer than one turn (None: every turn); ``what`` names the value (a flag)."""
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
        raise KvlabError(f"{what} must be a whole number of at least 1, not {max_turns!r}")


def first_turns(conv: Conversation, max_turns: int | None) -> Conversation:
    """The conversation's first ``max_turns`` turns (None: all of them)."""
    check_max_turns(max_turns)
    return conv if max_turns is None else replace(conv, turns=conv.turns[:max_turns])


def short_replies(encode: Callable[[str], list[int]], conversations: list[Conversation],
                  max_new_tokens: int) -> str | None:
    """A warning, in words, where replies cut at ``max_new_tokens`` are shorter than some scored turn of
    ``conversations`` (the turns that will run) needs to say its answer: those turns cannot be right, whatever the
    policy, Full included (a walk read 0 % everywhere for a cut at 4 tokens of a 7-digit number). None where every
    answer fits."""
    need = {(conv.name, i + 1): len(encode(" " + shortest_answer(t.answer, t.metric)))
            for conv in conversations for i, t in enumerate(conv.turns) if t.answer is not None}
    short = {at: n for at, n in need.items() if n > max_new_tokens}
    if not short:
        return None
    (name, turn), most = max(short.items(), key=lambda item: item[1])
    which = ("the one scored turn needs" if len(need) == 1 else
             f"{len(short)} of the {len(need)} scored turns need{'s' * (len(short) == 1)}")
    them = "it" if len(short) == 1 else "them"
    cut = f"{max_new_tokens} token{'s' * (max_new_tokens != 1)}"
    return (f"Replies are cut at {cut}, but {which} more to say the answer ({name}, turn {turn}: {most} tokens), so "
            f"no policy, Full included, can answer {them} right. Give replies {most} tokens or more to score every "
            "turn.")


def _where(index: int) -> str:
    return f"message {index + 1}"


def _check_message(index: int, msg: object) -> dict:
    """Validate one message's shape and field types; return it as a dict."""
    if not isinstance(msg, dict):
        raise KvlabError(f"{_where(index)} must be an object with 'role' and 'content', not {type(msg).__name__}")
    for key in ("role", "content"):
        if key not in msg:
            raise KvlabError(f"{_where(index)} has no '{key}'")
    unknown = sorted(set(msg) - _MESSAGE_FIELDS)
    if unknown:
        raise KvlabError(f"{_where(index)} has unknown field(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: role, content, prefill, answer, metric")
    role = msg["role"]
    if role not in ROLES:
        raise KvlabError(f"{_where(index)} has role {role!r}; expected system, user or assistant")
    if not isinstance(msg["content"], str):
        raise KvlabError(f"{_where(index)} ({role}): 'content' must be a string, not {type(msg['content']).__name__}")
    for key in _ASSISTANT_ONLY:
        if key in msg and role != "assistant":
            raise KvlabError(f"{_where(index)} ({role}): '{key}' is only allowed on assistant messages")
        if key in msg and not isinstance(msg[key], str):
            raise KvlabError(f"{_where(index)}: '{key}' must be a string, not {type(msg[key]).__name__}")
    if role == "user" and not msg["content"].strip():
        raise KvlabError(f"{_where(index)} is an empty user message")
    if role == "assistant":
        _check_assistant(index, msg)
    return msg


def _check_assistant(index: int, msg: dict) -> None:
    content = msg["content"]
    if not content.strip():
        raise KvlabError(f"{_where(index)} is an empty assistant message; leave the golden reply out instead")
    prefill = msg.get("prefill", "")
    if prefill and not content.startswith(prefill):
        raise KvlabError(f"{_where(index)}: the reply does not start with its prefill {prefill!r}")
    if "metric" in msg and "answer" not in msg:
        raise KvlabError(f"{_where(index)}: 'metric' needs an 'answer' to check")
    if "answer" in msg:
        answer = msg["answer"]
        if not answer.strip():
            raise KvlabError(f"{_where(index)}: 'answer' is empty")
        metric = msg.get("metric", "contains")
        try:
            check_metric(metric)
        except KvlabError as err:
            raise KvlabError(f"{_where(index)}: {err}") from None
        if metric == "option" and references(answer)[0] not in "ABCD":
            raise KvlabError(f"{_where(index)}: an 'option' answer starts with its letter A, B, C or D")
        missing = [r for r in references(answer) if r not in content[len(prefill):]]
        if metric != "option" and missing:
            raise KvlabError(f"{_where(index)}: the answer {missing[0]!r} does not occur in the reply after its "
                             "prefill")


def _unwrap(obj: object, name: str) -> tuple[str, str, list]:
    """Split the top-level object into (name, description, messages)."""
    if isinstance(obj, list):
        return name, "", obj
    if not isinstance(obj, dict):
        raise KvlabError(f"a conversation must be a JSON object with 'messages' or a list of messages, "
                         f"not {type(obj).__name__}")
    unknown = sorted(set(obj) - _TOP_FIELDS)
    if unknown:
        raise KvlabError(f"unknown top-level field(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: name, description, messages")
    if "messages" not in obj:
        raise KvlabError("the conversation object has no 'messages' list")
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise KvlabError(f"'messages' must be a list, not {type(messages).__name__}")
    for key in ("name", "description"):
        if key in obj and not isinstance(obj[key], str):
            raise KvlabError(f"'{key}' must be a string, not {type(obj[key]).__name__}")
    return obj.get("name") or name, obj.get("description", ""), messages


def parse_conversation(obj: object, name: str = "conversation") -> Conversation:
    """Validate decoded JSON (object or bare message list) and build a Conversation.

    Raises KvlabError with a one-line message naming the offending message.
    """
    name, description, raw = _unwrap(obj, name)
    messages = [_check_message(i, m) for i, m in enumerate(raw)]
    system = None
    start = 0
    if messages and messages[0]["role"] == "system":
        system, start = messages[0]["content"], 1
    body = messages[start:]
    for i, msg in enumerate(body):
        if msg["role"] == "system":
            raise KvlabError(f"{_where(start + i)} is a system message; only the first message may be one")
    if not any(m["role"] == "user" for m in body):
        raise KvlabError("the conversation has no user message")
    golden_mode = any(m["role"] == "assistant" for m in body)
    turns: list[Turn] = []
    for i, msg in enumerate(body):
        expected = "assistant" if golden_mode and i % 2 else "user"
        if msg["role"] != expected:
            raise KvlabError(f"{_where(start + i)} is {msg['role']!r} but {expected!r} was expected: "
                             f"roles must alternate user/assistant after the optional system message")
        if msg["role"] == "user":
            turns.append(Turn(user=msg["content"]))
        else:
            turns[-1] = Turn(user=turns[-1].user, golden=msg["content"], prefill=msg.get("prefill", ""),
                             answer=msg.get("answer"), metric=msg.get("metric", "contains"))
    if len(turns) > MAX_TURNS:
        raise KvlabError(f"the conversation has {len(turns)} turns; at most {MAX_TURNS} are allowed")
    return Conversation(name=name, description=description, system=system, turns=tuple(turns))


def load_conversation(path: str | Path) -> Conversation:
    """Read and validate a conversation file; every failure is a one-line KvlabError."""
    return conversation_from_bytes(read_bytes(path, "conversation file"), Path(path).name)


def conversation_from_bytes(data: bytes, filename: str) -> Conversation:
    """Validate an uploaded or read file's bytes: size, UTF-8, JSON, then the conversation itself."""
    obj = parse_json(decode_utf8(data, filename, MAX_FILE_BYTES, "conversation files"), filename)
    try:
        return parse_conversation(obj, name=Path(filename).stem)
    except KvlabError as err:
        raise KvlabError(f"{filename}: {err}") from None


def list_workloads(folder: str | Path) -> list[Path]:
    """The conversation files (``*.json``) in a folder, sorted by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KvlabError(f"workload folder not found: {folder}")
    return sorted(p for p in folder.glob("*.json") if p.is_file())


def conversation_to_json(conv: Conversation) -> dict:
    """The file form of a conversation; ``parse_conversation`` of it gives ``conv`` back."""
    messages: list[dict] = []
    if conv.system is not None:
        messages.append({"role": "system", "content": conv.system})
    golden_mode = conv.has_golden
    for i, turn in enumerate(conv.turns):
        messages.append({"role": "user", "content": turn.user})
        if turn.golden is None:
            if (golden_mode and i < len(conv.turns) - 1) or turn.prefill or turn.answer is not None:
                raise KvlabError(f"turn {i + 1} has no golden reply, which the file format only allows "
                                 f"on the last turn or when no turn has one")
            continue
        reply: dict = {"role": "assistant", "content": turn.golden}
        if turn.prefill:
            reply["prefill"] = turn.prefill
        if turn.answer is not None:
            reply["answer"] = turn.answer
            if turn.metric != "contains":
                reply["metric"] = turn.metric
        messages.append(reply)
    return {"name": conv.name, "description": conv.description, "messages": messages}


def chat_messages(conv: Conversation, turn: int) -> list[dict]:
    """Chat-template messages for turn ``turn`` (0-based): system, earlier turns with their
    golden replies, then this turn's user message. Needs golden replies for the earlier turns."""
    if not 0 <= turn < len(conv.turns):
        raise KvlabError(f"turn {turn + 1} is out of range; the conversation has {len(conv.turns)} turns")
    messages = [{"role": "system", "content": conv.system}] if conv.system is not None else []
    for i, t in enumerate(conv.turns[:turn]):
        if t.golden is None:
            raise KvlabError(f"turn {i + 1} has no golden reply to put in the history")
        messages += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.golden}]
    messages.append({"role": "user", "content": conv.turns[turn].user})
    return messages
