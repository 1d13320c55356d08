"""The % of Full's K/V bytes budget on the chat and arena pages (issue 24 item 4), the held-bytes columns and the
modes flag, under Streamlit's AppTest with the tiny random Llama in place of the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest
from page_helpers import open_page
from streamlit.testing.v1 import AppTest

import ui.common
from kvlab.engine.conversion import EMBEDDED
from kvlab.engine.facts import LoadedModel

SHORT = Path(__file__).resolve().parents[1] / "data" / "conversations" / "cooking-questions.json"


@pytest.fixture
def tiny_page_model(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ui.common._MODELS, (EMBEDDED, "auto", "auto", False), tiny)


def frame_with(at: AppTest, column: str):
    """The first table on the page that has ``column``."""
    return next(d.value for d in at.main.dataframe if column in d.value)


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_page_model")
def test_the_chat_runs_at_a_percent_of_fulls_bytes_and_refuses_a_bad_one() -> None:
    at = open_page("app_pages/chat.py", timeout=120)
    at.radio(key="chat_budget_unit").set_value("percent").run()
    at.number_input(key="chat_budget_percent").set_value(150.0).run()
    assert any(e.value.startswith("Refused") and "at most 100, not 150" in e.value for e in at.error)
    at.number_input(key="chat_budget_percent").set_value(30.0)
    at.multiselect(key="chat_policies").set_value(["streamingllm", "snapkv"])
    at.number_input(key="chat_max_new").set_value(3).run()
    assert not at.error
    for message in ("Tell me about the harbour town, its lighthouse and the boats that come in at night.",
                    "And what do the fishermen sell at the market on Sundays?"):
        at.chat_input[0].set_value(message).run()
        assert not at.exception
    chat = at.session_state.chat
    assert chat.settings.budget_percent == 30 and len(chat.turns) == 2
    for turn in chat.turns:
        full, own = turn.policies["full"], turn.policies["streamingllm"]
        assert own.budget_bytes == int(full.kv_bytes * 0.3) and own.kv_bytes <= own.budget_bytes
        assert turn.policies["snapkv"].budget_tokens >= chat.policies["snapkv"].min_budget()
    assert chat.turns[1].policies["streamingllm"].budget_tokens > chat.turns[0].policies["streamingllm"].budget_tokens
    assert any("budget** 30 % of Full's K/V bytes" in c.value for c in at.caption)
    shown = frame_with(at, "held_share").set_index("policy")
    assert shown.loc["streamingllm", "held_share"] <= 0.3 and shown.loc["full", "held_share"] == 1
    assert shown["budget_kib"].isna().loc["full"]  # Full keeps every token: no number it would ignore
    assert shown.loc["streamingllm", "held_vs_budget"] == "within"  # said beside the bytes, not only in the CSV
    assert shown.loc["full", "held_vs_budget"] == "no budget bounds it"


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_page_model")
def test_the_arena_runs_percent_budgets_shows_held_bytes_and_flags_modes_that_cannot_differ() -> None:
    at = open_page("app_pages/arena.py", timeout=120)
    at.radio(key="arena_budget_unit").set_value("percent").run()
    at.multiselect(key="arena_files").set_value([SHORT])
    at.multiselect(key="arena_policies").set_value(["streamingllm", "pyramidkv", "quest"])
    at.number_input(key="arena_max_new").set_value(2)
    at.number_input(key="arena_max_turns").set_value(2)
    at.text_input(key="arena_budgets").set_value("0,25").run()
    at.button(key="arena_run").click().run()
    assert "arena_job" not in at.session_state
    assert any("more than 0 and at most 100" in e.value for e in at.error), [e.value for e in at.error]
    at.text_input(key="arena_budgets").set_value("25, 50%")
    at.multiselect(key="arena_modes").set_value(["multi-turn", "single-shot"])
    at.button(key="arena_run").click().run()
    assert not at.exception and not at.error
    job = at.session_state["arena_job"]
    job.join(240)
    assert not job.running and job.error is None
    at.run()
    assert not at.exception and not at.error
    rows = job.table
    assert set(rows["budget"]) == {25, 50} and rows["error"].isna().all()
    full = rows[rows["policy"] == "full"].set_index(["budget", "mode", "turn"])["kv_bytes"]
    for name in ("streamingllm", "pyramidkv"):
        own = rows[rows["policy"] == name].set_index(["budget", "mode", "turn"])
        allowed = (full.loc[own.index] * own.index.get_level_values("budget") / 100).astype(int)
        assert (own["budget_kib"] * 1024 == allowed).all() and (own["kv_bytes"] <= allowed).all()
    # (b) the memory-equal table: bytes held next to what the budget allowed, and who keeps every token
    equal = frame_with(at, "held_vs_budget").set_index(["policy", "budget"])
    assert {"budget_kib", "held_kib", "held_kib_max", "held_share"} <= set(equal.columns)
    assert (equal.loc["streamingllm", "held_vs_budget"] == "within").all()
    assert (equal.loc["quest", "held_vs_budget"] == "no budget bounds it").all()
    assert (equal.loc["streamingllm", "held_kib_max"] <= equal.loc["streamingllm", "budget_kib"]).all()
    assert (equal.loc[("streamingllm", 25), "held_kib"] < equal.loc[("streamingllm", 50), "held_kib"])
    # (c) two turns cannot differ between the modes: the table says so, and the page
    drop = frame_with(at, "modes can differ")
    assert len(drop) and not drop["modes can differ"].any()
    assert any("equals multi-turn by construction" in w.value for w in at.warning)


@pytest.mark.usefixtures("tiny_page_model")
def test_the_chat_runs_at_a_byte_budget_and_refuses_a_bad_one(tiny: LoadedModel) -> None:
    at = open_page("app_pages/chat.py", timeout=120)
    at.radio(key="chat_budget_unit").set_value("mib").run()
    at.number_input(key="chat_budget_mib").set_value(0.0).run()
    assert any(e.value.startswith("Refused") and "more than 0 MiB, not 0" in e.value for e in at.error)
    at.number_input(key="chat_budget_mib").set_value(0.05)
    at.multiselect(key="chat_policies").set_value(["streamingllm"])
    at.number_input(key="chat_max_new").set_value(2).run()
    assert not at.error
    at.chat_input[0].set_value("Tell me about the harbour town, its lighthouse and the boats.").run()
    assert not at.exception
    chat = at.session_state.chat
    tokens = int(0.05 * (1 << 20)) // tiny.facts.kv_bytes(1)  # what the bytes hold unquantized
    assert chat.settings.budget_mib == 0.05 and chat.settings.budget_of("streamingllm") == tokens
    assert any(f"budget** 0.05 MiB of K/V: {tokens} tokens per layer per KV head" in c.value for c in at.caption)
