"""The app and the chat page under Streamlit's AppTest, on the embedded model."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from page_helpers import APP, open_page
from streamlit.testing.v1 import AppTest

from kvlab.engine import head_patterns
from kvlab.engine.head_patterns import GateTraining
from kvlab.workloads.chat.replay import session_to_json
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

pytestmark = pytest.mark.model  # the app loads the embedded model

TIMEOUT = 600


def chat_app() -> AppTest:
    at = open_page("app_pages/chat.py", timeout=TIMEOUT)
    at.multiselect(key="chat_policies").set_value(["streamingllm", "snapkv"])
    at.number_input(key="chat_budget").set_value(32)
    at.number_input(key="chat_max_new").set_value(6)
    return at


def test_home_page_renders_with_model_facts(embedded_config) -> None:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert not at.exception
    assert "kvlab" in at.title[0].value
    facts = at.sidebar.table[0].value
    assert dict(zip(facts.fact, facts.value))["KV heads"] == str(embedded_config.num_key_value_heads)


def test_chat_turn_runs_and_draws_every_chart(embedded_config) -> None:
    at = chat_app()
    at.chat_input[0].set_value("My boat key number is 40917. Remember it, please.").run()
    assert not at.exception and not at.error
    assert len(at.chat_message) == 2
    charts = at.get("plotly_chart")
    assert len(charts) >= 6  # sinks, profile, 2 retained maps, bytes, block map, fidelity
    at.chat_input[0].set_value("What is my boat key number?").run()
    assert not at.exception
    assert len(at.chat_message) == 4
    saved = at.session_state["chat"]
    assert [t.index for t in saved.turns] == [0, 1]
    assert saved.turns[1].policies["snapkv"].cache_tokens == [32] * embedded_config.num_hidden_layers
    fidelity = next(d.value for d in at.main.dataframe if "kl" in d.value)
    assert not {"correct", "metric"} & set(fidelity)  # a live chat has no answer to check: no column of n/a


def test_a_live_message_to_the_oracle_is_refused_with_the_message_quoted() -> None:
    at = chat_app()
    at.multiselect(key="chat_policies").set_value(["oracle", "streamingllm"])
    at.chat_input[0].set_value("My wifi password is 48213.").run()
    assert not at.exception and not at.chat_message
    said = " ".join(e.value for e in at.error)
    assert "a live chat has no future to read. Not run: your message “My wifi password is 48213.”" in said
    at.multiselect(key="chat_policies").set_value(["streamingllm"])
    at.chat_input[0].set_value("My wifi password is 48213.").run()  # sent again, it runs
    assert not at.exception and len(at.chat_message) == 2


def test_bad_input_gives_a_message_and_keeps_the_session() -> None:
    at = chat_app()
    at.number_input(key="chat_budget").set_value(3)
    at.multiselect(key="chat_policies").set_value(["streamingllm", "quest"])
    at.chat_input[0].set_value("Hello").run()
    assert not at.exception
    said = " ".join(e.value for e in at.error)
    assert "streamingllm: budget 3 is below its minimum of 5" in said and "quest: budget 3 is below its minimum" in said
    at.multiselect(key="chat_policies").set_value(["streamingllm"])
    at.number_input(key="chat_budget").set_value(32).run()
    at.chat_input[0].set_value("Hello").run()
    assert not at.exception and len(at.chat_message) == 2
    at.chat_input[0].set_value("1234567890" * 1900).run()
    assert any("context" in e.value for e in at.error)
    assert len(at.session_state["chat"].turns) == 1


def test_an_empty_message_is_not_sent_and_the_first_turn_takes_the_settings_as_they_are() -> None:
    at = chat_app()
    at.chat_input[0].set_value("   ").run()
    assert not at.exception and "the message is empty" in at.error[0].value and not at.chat_message
    at.number_input(key="chat_budget").set_value(48).run()
    at.chat_input[0].set_value("Hi there").run()
    assert not at.exception and len(at.chat_message) == 2
    assert at.session_state["chat"].settings.budget == 48


def test_scripted_conversation_plays_a_turn() -> None:
    at = chat_app()
    at.button(key="chat_script_load").click().run()
    assert not at.exception and not at.error
    at.button(key="chat_next").click().run()
    assert not at.exception
    session = at.session_state["chat"]
    assert len(session.turns) == 1
    script = at.session_state["script"]
    assert session.turns[0].user == script.turns[0].user
    json.dumps(at.session_state["chat"].turns[0].to_dict())


def test_a_script_whose_answers_the_replies_cannot_hold_is_warned_of() -> None:
    at = chat_app()
    at.number_input(key="chat_max_new").set_value(1).run()
    retrieval = next(p for p in at.selectbox(key="chat_script_file").options if "apartment-sublet" in p)
    at.selectbox(key="chat_script_file").set_value(retrieval)  # a script with answers to check
    at.button(key="chat_script_load").click().run()
    at.run()  # the script's panel, drawn from the run after the click
    assert not at.exception and any(w.value.startswith("Replies are cut at 1 token, but ") for w in at.warning)
    at.number_input(key="chat_max_new").set_value(48).run()
    at.button(key="chat_reset").click().run()
    at.button(key="chat_script_load").click().run()
    at.run()
    assert at.session_state["script"] is not None and not any("Replies are cut" in w.value for w in at.warning)


def test_a_script_no_turn_has_run_on_takes_the_settings_as_they_are_at_its_first_turn() -> None:
    at = chat_app()
    at.button(key="chat_script_load").click().run()
    at.number_input(key="chat_budget").set_value(48).run()
    at.button(key="chat_next").click().run()
    assert not at.exception and not at.error
    session = at.session_state["chat"]
    assert len(session.turns) == 1 and session.settings.budget == 48
    assert session.system == at.session_state["script"].system and session.script is at.session_state["script"]


def test_quest_block_map_shows_the_pages_its_last_query_read() -> None:
    at = chat_app()
    at.multiselect(key="chat_policies").set_value(["quest"])
    at.chat_input[0].set_value("My boat key number is 40917. Remember it, please.").run()
    assert not at.exception and not at.error
    assert at.selectbox(key="chat_block_policy").value == "quest"
    heat = json.loads(next(c for c in at.get("plotly_chart") if "blocks of" in c.proto.spec).proto.spec)["data"][0]
    assert heat["colorbar"]["ticktext"][-1] == "held, not read by the last query"
    z = np.frombuffer(base64.b64decode(heat["z"]["bdata"]), dtype=heat["z"]["dtype"])  # plotly's typed-array JSON
    assert {2, 3} <= set(z.tolist())  # read and held-but-not-read blocks both drawn
    assert any("light blue blocks are held but were not read" in c.value for c in at.caption)


def test_a_script_plays_and_a_saved_session_opens_without_a_model_run() -> None:
    at = chat_app()
    at.button(key="chat_script_load").click().run()
    assert not at.exception and not at.error
    assert not any("Send a message" in i.value for i in at.info)  # the script's buttons say what to press
    for _ in range(2):
        at.button(key="chat_next").click().run()
    assert not at.exception and len(at.session_state["chat"].turns) == 2
    fed = [c.value for c in at.caption if "every cache was fed this" in c.value]
    assert len(fed) == 2  # the newest turn too
    assert at.select_slider(key="chat_turn").value == 2
    at.chat_input[0].set_value("1234567890" * 1900).run()  # refused: longer than the context
    assert not at.exception and at.error
    assert at.select_slider(key="chat_turn").value == 2 and len(at.session_state["chat"].turns) == 2
    # loading a script over a conversation in progress asks first; keeping it changes nothing
    session = at.session_state["chat"]
    at.button(key="chat_script_load").click().run()
    assert any("replaces the conversation on the page (2 turns)" in w.value for w in at.warning)
    at.button(key="chat_replace_no").click().run()
    assert at.session_state["chat"] is session and not any("replaces" in w.value for w in at.warning)
    # no turn of this script has an answer to check: no answer columns, where every cell read "n/a" and "—" (the
    # marks of a table with answers are tests/test_ui_figures.py's)
    assert any("kl" in d.value for d in at.main.dataframe) and not any("correct" in d.value for d in at.main.dataframe)

    saved = json.dumps(session_to_json(session)).encode()
    at.button(key="chat_reset").click().run()
    at.file_uploader(key="chat_restore").set_value(("kvlab-session.json", saved, "application/json")).run()
    assert not at.exception and not at.error
    assert "chat" not in at.session_state  # no session was built: nothing ran on the model
    assert any("Opened from a file, no model run" in i.value for i in at.info)
    assert len(at.chat_message) == 4 and len(at.get("plotly_chart")) >= 5
    assert [t.to_dict() for t in at.session_state["chat_view"].turns] == json.loads(saved)["turns"]
    at.button(key="chat_replay").click().run()
    assert not at.exception
    assert any("every turn (replies, kept tokens, bytes, scores) equals the file's" in s.value for s in at.success)
    assert len(at.session_state["chat"].turns) == 2
    assert at.session_state["script"] == session.script and "chat_next" in [b.key for b in at.button]  # goes on


def test_a_bad_model_id_leaves_the_page_on_the_model_it_had() -> None:
    at = chat_app()
    at.sidebar.radio(key="model_source").set_value("Hub id or local folder").run()
    assert not at.exception and at.title[0].value == "Multi-turn chat" and at.chat_input  # empty id: page kept
    at.sidebar.text_input(key="model_id").set_value("./no-such-model-folder").run()
    assert not at.exception
    assert any("no model folder" in e.value for e in at.sidebar.error)
    assert any("Still on" in w.value for w in at.sidebar.warning)
    assert at.chat_input and at.main.expander  # the page is drawn, not blank


def test_a_saved_duoattention_session_draws_its_head_pattern(tiny, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))  # the tiny model's pattern is trained here, not reused
    monkeypatch.setitem(head_patterns.DEFAULTS, "trained", GateTraining(steps=2, context_min=40, context_max=60))
    session = ChatSession(tiny, ChatSettings(policies=("full", "duoattention"), budget=16, max_new_tokens=2,
                                             params={"duoattention": {"sink": 2, "recent": 4}}))
    session.run_turn("Where did I leave the red umbrella?")
    at = open_page("app_pages/chat.py", timeout=TIMEOUT)
    saved = json.dumps(session_to_json(session)).encode()
    at.file_uploader(key="chat_restore").set_value(("kvlab-session.json", saved, "application/json")).run()
    assert not at.exception and not at.error
    assert [t.label for t in at.tabs][-1] == "Head pattern"
    heat = at.get("plotly_chart")[-1].proto.spec
    assert "DuoAttention heads: R = " in heat and "tiny-llama; the authors" in heat and "gate optimisation" in heat


def test_a_profile_layer_kept_from_a_deeper_model_falls_back_inside_this_ones_layers(embedded_config) -> None:
    at = chat_app()
    at.session_state["chat_profile_layer"] = 99  # kept (persisted) from a model with more layers
    at.chat_input[0].set_value("My gate code is 5521.").run()
    assert not at.exception
    assert at.slider(key="chat_profile_layer").value == embedded_config.num_hidden_layers // 2


def test_play_all_leaves_no_button_for_turns_that_are_not_there() -> None:
    """A walk found Next turn and Play all still drawn at 12/12 turns played."""
    at = chat_app()
    script = {"name": "two", "description": "two turns", "messages": [
        {"role": "user", "content": "My locker code is 4127."}, {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "What is my locker code?"}]}
    at.file_uploader(key="chat_script_upload").set_value(("two.json", json.dumps(script).encode(), "application/json"))
    at.button(key="chat_script_load").click().run()
    assert not at.exception and {"chat_next", "chat_all"} <= {b.key for b in at.button}
    at.button(key="chat_next").click().run()
    at.button(key="chat_all").click().run()
    assert not at.exception and len(at.session_state["chat"].turns) == 2
    assert not {"chat_next", "chat_all"} & {b.key for b in at.button}
    # the turn this run played stands under the one before, above the script's line (a walk found that line, and
    # the bar, between turn 1 and the turns Play all went on with)
    said = [e.value for e in at.main if type(e).__name__ in ("Markdown", "Caption")]
    line = next(i for i, v in enumerate(said) if "2/2 turns played" in v)
    assert said.index("What is my locker code?") < line
