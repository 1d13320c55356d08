"""A chat that outgrows the model: on a tiny model with a short trained context, bounded policies in re-rotated mode
go on inside it, while Full is marked on every turn past it: in the records, the table, the chart and the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from page_helpers import open_page
from transformers import PreTrainedTokenizerBase

import kvlab.cli.chat
import ui.common
from kvlab.cli import main
from kvlab.engine.conversion import EMBEDDED
from kvlab.engine.facts import LoadedModel
from kvlab.engine.tiny import tiny_model
from kvlab.errors import KvlabError
from kvlab.export import to_json
from kvlab.viz.chat import fidelity_lines
from kvlab.workloads.chat.records import PolicyTurn, turn_table
from kvlab.workloads.chat.replay import session_to_json
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.session_file import record_from_json
from kvlab.workloads.chat.settings import ChatSettings
from ui.tables import PAST_MARK

CONTEXT = 160  # the tiny model's trained context: a few turns of the messages below pass it
MESSAGE = "Tell me one more thing about the lighthouse keeper and his logbook of passing ships, please."
REPLY = "He wrote down every ship he saw, with the weather and the wind."


@pytest.fixture(scope="module")
def short(tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
    """A tiny random Llama with the embedded tokenizer (its chat format) and a trained context of CONTEXT."""
    return tiny_model("llama", tokenizer=tokenizer, context=CONTEXT)[0]


def chat(lm: LoadedModel, turns: int, mode: str = "rerotated") -> ChatSession:
    session = ChatSession(lm, ChatSettings(policies=("full", "window", "streamingllm"), budget=32, max_new_tokens=3,
                                           position_mode=mode))
    for _ in range(turns):
        session.run_turn(MESSAGE, golden=REPLY)
    return session


@pytest.mark.slow
def test_bounded_policies_stay_inside_the_trained_context_and_full_is_marked_past_it(short: LoadedModel) -> None:
    session = chat(short, 6)
    assert session.total_tokens > CONTEXT + 100  # the conversation outgrew the model
    first = next(t.index for t in session.turns if t.total_tokens > CONTEXT)
    for t in session.turns:
        full = t.policies["full"]
        assert full.max_position == t.total_tokens - 1 and full.past_context == (t.index >= first)
        for name in ("window", "streamingllm"):
            p = t.policies[name]
            assert p.error is None and not p.past_context and p.max_position < CONTEXT
            assert p.kl is not None  # still scored, against a reference that says where it is untrained
    table = turn_table(session.turns)
    assert table.query("policy == 'full'")["past_context"].tolist() == [t.index >= first for t in session.turns]
    assert not table.query("policy != 'full'")["past_context"].any()
    figure = fidelity_lines(table)
    assert any("past its trained context" in (a.text or "") for a in figure.layout.annotations)

    data = json.loads(to_json(session_to_json(session)))  # the file as written
    again = record_from_json(data)
    assert [[(p.max_position, p.past_context) for p in t.policies.values()] for t in again.turns] == \
        [[(p.max_position, p.past_context) for p in t.policies.values()] for t in session.turns]
    for t in data["turns"]:  # a file from before the marks still opens, unmarked
        for p in t["policies"].values():
            del p["max_position"], p["past_context"]
    old = record_from_json(data)
    assert all(p.max_position is None and not p.past_context for t in old.turns for p in t.policies.values())


@pytest.mark.slow
def test_original_positions_past_the_trained_context_are_still_refused(short: LoadedModel) -> None:
    session = chat(short, 1, mode="original")
    with pytest.raises(KvlabError, match="re-rotated position mode"):
        for _ in range(6):
            session.run_turn(MESSAGE, golden=REPLY)


def test_a_record_without_the_marks_reads_as_unmarked() -> None:
    rec = PolicyTurn.from_dict({"policy": "full", "reply": "r"})
    assert rec.max_position is None and rec.past_context is False


@pytest.mark.slow
def test_the_chat_page_marks_full_in_its_table_from_the_turn_it_passes_the_context(
        short: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ui.common._MODELS, (EMBEDDED, "auto", "auto", False), short)
    at = open_page("app_pages/chat.py", timeout=300)
    at.number_input(key="chat_budget").set_value(16)
    at.number_input(key="chat_max_new").set_value(3)
    at.radio(key="chat_mode").set_value("rerotated")
    for _ in range(12):  # until the conversation passes the trained context
        at.chat_input[0].set_value(MESSAGE).run()
        assert not at.exception and not at.error, [e.value for e in at.error]
        if at.session_state.chat.total_tokens > CONTEXT:
            break
        assert not any("past_context" in df.value for df in at.dataframe)  # no turn past it: no column of blanks
    table = next(df.value for df in at.dataframe if "past_context" in df.value)
    assert table.query("policy == 'full'")["past_context"].iloc[-1] == PAST_MARK
    assert (table.query("policy == 'streamingllm'")["past_context"] == "").all()
    assert any("**past trained context** ⚠" in c.value for c in at.caption)


@pytest.mark.slow
def test_the_cli_table_marks_the_turns_past_the_trained_context(short: LoadedModel, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvlab.cli.chat, "load_model", lambda *a, **k: short)
    conv = tmp_path / "long.json"
    conv.write_text(json.dumps([{"role": role, "content": text} for _ in range(6)
                                for role, text in (("user", MESSAGE), ("assistant", REPLY))]))
    out = tmp_path / "r.json"
    assert main(["chat", "--conversation", str(conv), "--policies", "streamingllm", "--budget", "32",
                 "--position-mode", "rerotated", "--max-new-tokens", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert any(r[1] == "full" and "PAST" in r for r in rows) and not any(r[1] != "full" and "PAST" in r for r in rows)
    assert f"trained context of {CONTEXT:,}" in printed
    turns = json.loads(out.read_text())["turns"]
    assert turns[-1]["policies"]["full"]["past_context"] and not turns[0]["policies"]["full"]["past_context"]
