"""Conversation files: validation errors, round trips, and the shipped workloads in data/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.workloads.chat.conversation import (
    MAX_FILE_BYTES,
    MAX_TURNS,
    Conversation,
    Turn,
    chat_messages,
    conversation_to_json,
    first_turns,
    list_workloads,
    load_conversation,
    parse_conversation,
)

DATA = Path(__file__).resolve().parents[1] / "data"
CONVERSATIONS = list_workloads(DATA / "conversations")
RETRIEVAL = list_workloads(DATA / "retrieval")


def user(text: str = "hello") -> dict:
    return {"role": "user", "content": text}


def reply(text: str = "hi there", **extra: str) -> dict:
    return {"role": "assistant", "content": text, **extra}


GOOD = {
    "name": "demo",
    "description": "two turns",
    "messages": [
        {"role": "system", "content": "Be brief."},
        user("The shed code is 12345. What is the shed code?"),
        reply("The shed code is 12345.", prefill="The shed code is", answer="12345"),
        user("Thanks!"),
    ],
}


def test_parse_object_with_system_golden_and_open_last_turn() -> None:
    conv = parse_conversation(GOOD)
    assert conv == Conversation(
        name="demo", description="two turns", system="Be brief.",
        turns=(Turn(user="The shed code is 12345. What is the shed code?", golden="The shed code is 12345.",
                    prefill="The shed code is", answer="12345"),
               Turn(user="Thanks!")),
    )
    assert conv.has_golden and sum(t.answer is not None for t in conv.turns) == 1


def test_bare_list_takes_the_given_name() -> None:
    conv = parse_conversation([user("a"), reply("b"), user("c"), reply("d")], name="chat")
    assert conv.name == "chat" and conv.description == "" and conv.system is None
    assert [(t.user, t.golden) for t in conv.turns] == [("a", "b"), ("c", "d")]


def test_user_only_list_is_turns_without_golden_replies() -> None:
    conv = parse_conversation([user("a"), user("b"), user("c")])
    assert [t.user for t in conv.turns] == ["a", "b", "c"]
    assert not conv.has_golden and all(t.golden is None and t.prefill == "" for t in conv.turns)


@pytest.mark.parametrize("obj, message", [
    ("just text", "not str"),
    (42, "not int"),
    (None, "not NoneType"),
    ({"name": "x"}, "no 'messages'"),
    ({"messages": "hi"}, "'messages' must be a list"),
    ({"messages": [user()], "nmae": "x"}, "unknown top-level field(s) 'nmae'"),
    ({"messages": [user()], "name": 3}, "'name' must be a string"),
    ([], "no user message"),
    ([{"role": "system", "content": "s"}], "no user message"),
    (["hello"], "message 1 must be an object"),
    ([{"content": "hi"}], "message 1 has no 'role'"),
    ([{"role": "user"}], "message 1 has no 'content'"),
    ([{"role": "bot", "content": "hi"}], "role 'bot'"),
    ([{"role": "user", "content": ["hi"]}], "'content' must be a string, not list"),
    ([user("   ")], "message 1 is an empty user message"),
    ([user(), reply(""), user()], "message 2 is an empty assistant message"),
    ([user(), {"role": "assistant", "content": "x", "anwser": "1"}], "unknown field(s) 'anwser'"),
    ([user(), reply(), reply()], "message 3 is 'assistant' but 'user' was expected"),
    ([user(), user(), reply()], "message 2 is 'user' but 'assistant' was expected"),
    ([reply(), user()], "message 1 is 'assistant' but 'user' was expected"),
    ([user(), {"role": "system", "content": "s"}], "message 2 is a system message"),
    ([{"role": "user", "content": "q", "answer": "1"}], "'answer' is only allowed on assistant messages"),
    ([user(), reply("x 1", answer=1)], "'answer' must be a string, not int"),
    ([user(), reply("x 1", answer=" ")], "'answer' is empty"),
    ([user(), reply("The code is 1.", answer="2")], "answer '2' does not occur"),
    ([user(), reply("The code is 1.", prefill="The code is 1", answer="1")], "does not occur in the reply after"),
    ([user(), reply("The code is 1.", prefill="A code is")], "does not start with its prefill"),
    ([user()] * (MAX_TURNS + 1), f"{MAX_TURNS + 1} turns; at most {MAX_TURNS}"),
])
def test_bad_conversations_raise_one_clear_line(obj: object, message: str) -> None:
    with pytest.raises(KvlabError) as err:
        parse_conversation(obj)
    text = str(err.value)
    assert message in text, text
    assert "\n" not in text


def test_max_turns_is_allowed() -> None:
    assert len(parse_conversation([user(), reply()] * MAX_TURNS).turns) == MAX_TURNS


def test_first_turns_cuts_and_refuses_fewer_than_one() -> None:
    conv = parse_conversation([user("a"), user("b"), user("c")])
    assert [t.user for t in first_turns(conv, 2).turns] == ["a", "b"]
    assert first_turns(conv, None) is conv and first_turns(conv, 9).turns == conv.turns
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(KvlabError, match=f"at least 1, not {re.escape(repr(bad))}$"):
            first_turns(conv, bad)


@pytest.mark.parametrize("obj", [
    GOOD,
    [user("a"), user("b")],
    {"name": "n", "description": "d", "messages": [user("ü ✓"), reply("ok", prefill="o")]},
])
def test_round_trip(obj: object) -> None:
    conv = parse_conversation(obj)
    text = json.dumps(conversation_to_json(conv))
    assert parse_conversation(json.loads(text)) == conv


def test_unrepresentable_conversation_is_refused() -> None:
    conv = Conversation("x", "", None, (Turn("a"), Turn("b", golden="c")))
    with pytest.raises(KvlabError, match="turn 1 has no golden reply"):
        conversation_to_json(conv)


def test_chat_messages_carry_golden_history() -> None:
    conv = parse_conversation(GOOD)
    assert chat_messages(conv, 1) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The shed code is 12345. What is the shed code?"},
        {"role": "assistant", "content": "The shed code is 12345."},
        {"role": "user", "content": "Thanks!"},
    ]
    with pytest.raises(KvlabError, match="out of range"):
        chat_messages(conv, 2)
    with pytest.raises(KvlabError, match="turn 1 has no golden reply"):
        chat_messages(parse_conversation([user("a"), user("b")]), 1)


def test_load_file_errors(tmp_path: Path) -> None:
    cases = {
        "missing.json": None,
        "latin1.json": "[{\"role\": \"user\", \"content\": \"caf\u00e9\"}]".encode("latin-1"),
        "broken.json": b"[{\"role\": \"user\",",
        "big.json": b" " * (MAX_FILE_BYTES + 1),
        "badrole.json": b"[{\"role\": \"robot\", \"content\": \"hi\"}]",
    }
    expected = {
        "missing.json": "conversation file not found",
        "latin1.json": "latin1.json is not UTF-8 text (bad byte at offset 33)",
        "broken.json": "broken.json is not valid JSON (line 1, column 18: Expecting property name enclosed in "
                       "double quotes)",
        "big.json": "big.json is 2.0 MB; conversation files are limited to 2 MB",
        "badrole.json": "badrole.json: message 1 has role 'robot'",
    }
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        with pytest.raises(KvlabError) as err:
            load_conversation(tmp_path / name)
        assert expected[name] in str(err.value)
    with pytest.raises(KvlabError, match="conversation file .* is a folder, not a file"):
        load_conversation(tmp_path)
    with pytest.raises(KvlabError, match="conversation file not found"):
        load_conversation(tmp_path / "gone.json")


def test_load_file_names_from_stem_and_accepts_bom(tmp_path: Path) -> None:
    path = tmp_path / "my-chat.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([user("hi")]).encode())
    assert load_conversation(path).name == "my-chat"


def test_list_workloads(tmp_path: Path) -> None:
    for name in ("b.json", "a.json", "notes.txt"):
        (tmp_path / name).write_text("[]")
    (tmp_path / "dir.json").mkdir()
    assert [p.name for p in list_workloads(tmp_path)] == ["a.json", "b.json"]
    with pytest.raises(KvlabError, match="workload folder not found"):
        list_workloads(tmp_path / "nope")


def template_tokens(model: LoadedModel, conv: Conversation) -> int:
    """Tokens of the whole conversation (golden replies included) under the chat template."""
    messages = chat_messages(conv, len(conv.turns) - 1)
    if conv.turns[-1].golden is not None:
        messages.append({"role": "assistant", "content": conv.turns[-1].golden})
    return len(model.encode(model.tokenizer.apply_chat_template(messages, tokenize=False)))


@pytest.mark.model
def test_shipped_conversations(model: LoadedModel) -> None:
    convs = [load_conversation(p) for p in CONVERSATIONS]
    assert [c.name for c in convs] == [p.stem for p in CONVERSATIONS]
    assert len(convs) >= 3 and sum(c.has_golden for c in convs) >= 3
    checked = [sum(t.answer is not None for t in c.turns) for c in convs]
    assert max(checked) >= 5, "a fact-recall session with checked answers"
    for conv in convs:
        assert len(conv.turns) >= 6 and conv.description, conv.name
        if conv.has_golden:
            assert template_tokens(model, conv) <= 1500, conv.name


@pytest.mark.model
@pytest.mark.parametrize("path", RETRIEVAL, ids=lambda p: p.stem)
def test_retrieval_session(path: Path, model: LoadedModel) -> None:
    conv = load_conversation(path)
    assert conv.name == path.stem and conv.description
    text = conv.turns[0].user
    answers = [t.answer for t in conv.turns]
    assert 3 <= len(answers) <= 5 and None not in answers
    assert len(set(answers)) == len(answers)
    for turn in conv.turns:
        assert re.fullmatch(r"\d{5}", turn.answer), turn.answer
        assert text.count(turn.answer) == 1, turn.answer
        assert turn.golden == f"{turn.prefill} {turn.answer}."
        for later in conv.turns[1:]:
            assert turn.answer not in later.user
    labels = [t.prefill for t in conv.turns]
    assert len(set(labels)) == len(labels), "every key has a distinct label"
    # the question of turn 1 follows the text, inside the first user message
    assert text.rstrip().endswith("?") and text.index(conv.turns[0].answer) < len(text) - 200
    assert 1000 <= len(model.encode(text)) <= 3000
    assert template_tokens(model, conv) <= 3500


def test_enough_retrieval_sessions() -> None:
    assert len(RETRIEVAL) >= 8
    assert sum(len(load_conversation(p).turns) for p in RETRIEVAL) >= 30
