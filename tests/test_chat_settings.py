"""Settings that are true on the chat page (issue 13): refusals, restores, the system message, long inputs, Stop.

Page tests run the tiny random Llama in place of the embedded model, so a turn takes a fraction of a second.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
from page_helpers import open_page
from streamlit.runtime.media_file_manager import MediaFileManager
from transformers import PreTrainedTokenizerBase

import kvlab.workloads.chat.estimate
import kvlab.workloads.chat.replay
import ui.common
from kvlab.engine.chatformat import DEFAULT_SYSTEM, implicit_system
from kvlab.engine.conversion import EMBEDDED
from kvlab.engine.facts import LoadedModel
from kvlab.engine.tiny import byte_tokenizer
from kvlab.errors import KvlabError, Stopped
from kvlab.workloads.chat.budgets import budget_words
from kvlab.workloads.chat.estimate import ask_first_s
from kvlab.workloads.chat.positions import check_fits
from kvlab.workloads.chat.replay import session_to_json
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings
from ui.summaries import settings_summary


@pytest.fixture
def tiny_page_model(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ui.common._MODELS, (EMBEDDED, "auto", "auto", False), tiny)


def small_turns(at) -> None:
    at.number_input(key="chat_budget").set_value(16)
    at.number_input(key="chat_max_new").set_value(3)


@pytest.mark.usefixtures("tiny_page_model")
@pytest.mark.parametrize("key, value, words", [
    ("chat_budget", 0, "budget must be at least 1"),
    ("chat_budget", 100_000_000, "exceeds the model's context"),
    ("chat_snapkv_window", -3, "snapkv: window must be"),
])
def test_a_refused_value_is_said_and_nothing_runs(key: str, value: int, words: str) -> None:
    at = open_page("app_pages/chat.py", timeout=120)
    at.number_input(key=key).set_value(value).run()
    assert any(words in e.value and e.value.startswith("Refused") for e in at.error), [e.value for e in at.error]
    assert at.number_input(key=key).value == value  # kept on screen as typed, not swapped for the last valid one
    at.chat_input[0].set_value("Hello there").run()
    assert not at.exception
    assert "chat" not in at.session_state and not at.chat_message
    assert any(e.value.startswith("Not run") and words in e.value and "Hello there" in e.value for e in at.error)


@pytest.mark.usefixtures("tiny_page_model")
def test_a_refused_value_does_not_stop_a_conversation_under_way_which_keeps_its_settings() -> None:
    at = open_page("app_pages/chat.py", timeout=120)
    small_turns(at)
    at.chat_input[0].set_value("Message number 1").run()
    at.number_input(key="chat_block").set_value(0).run()
    assert any(e.value.startswith("Refused") for e in at.error)
    at.chat_input[0].set_value("Message number 2").run()
    assert not at.exception and len(at.session_state.chat.turns) == 2
    assert at.session_state.chat.settings.block_size == 16 and not any(e.value.startswith("Not run") for e in at.error)


@pytest.mark.usefixtures("tiny_page_model")
def test_downloads_hold_every_turn_and_the_settings_are_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []  # turns in each session file built (the browser test reads both files)
    monkeypatch.setattr(kvlab.workloads.chat.replay, "session_to_json",
                        lambda s: built.append(len(s.turns)) or session_to_json(s))
    deferred: dict[str, Callable[[], str]] = {}  # the session file is built when its button is clicked
    add = MediaFileManager.add_deferred

    def kept(self: MediaFileManager, data: Callable[[], str], *args: object, **kwargs: object) -> str:
        deferred[str(kwargs.get("file_name"))] = data
        return add(self, data, *args, **kwargs)

    monkeypatch.setattr(MediaFileManager, "add_deferred", kept)
    at = open_page("app_pages/chat.py", timeout=120)
    small_turns(at)
    for n in (1, 2):
        deferred.clear()
        at.chat_input[0].set_value(f"Message number {n}").run()
        assert not at.exception
        # right after the first turn, too (the sidebar holds the figures zip); the file is not built by the run
        assert len(at.main.get("download_button")) == 2 and built == [1] * (n - 1)
        assert len(json.loads(deferred["kvlab-session.json"]())["turns"]) == n and built[-1] == n
    summary = " ".join(c.value for c in at.caption)
    assert "This conversation runs with" in summary and "budget** 16" in summary and DEFAULT_SYSTEM in summary
    assert at.session_state.chat.system == DEFAULT_SYSTEM


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_page_model")
def test_settings_changed_clears_after_new_conversation() -> None:
    at = open_page("app_pages/chat.py", timeout=120)
    small_turns(at)
    at.chat_input[0].set_value("Hello").run()
    at.number_input(key="chat_budget").set_value(32).run()
    assert any("Settings changed" in i.value for i in at.info)
    at.button(key="chat_reset").click().run()
    assert not any("Settings changed" in i.value for i in at.info)
    assert "chat" not in at.session_state


@pytest.mark.usefixtures("tiny_page_model")
def test_a_long_message_asks_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvlab.workloads.chat.estimate, "ESTIMATE_FROM_TOKENS", 5)
    monkeypatch.setattr(kvlab.workloads.chat.estimate, "LONG_TURN_S", 0.0)
    at = open_page("app_pages/chat.py", timeout=120)
    small_turns(at)
    at.chat_input[0].set_value("a long message " * 20).run()
    assert any("roughly" in w.value and "Run it anyway" in w.value for w in at.warning)
    assert "chat" not in at.session_state
    at.button(key="chat_long_run").click().run()
    assert not at.exception and len(at.session_state.chat.turns) == 1


@pytest.mark.usefixtures("tiny_page_model")
def test_a_long_message_to_a_conversation_no_turn_has_run_on_is_timed_with_the_panel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvlab.workloads.chat.estimate, "ESTIMATE_FROM_TOKENS", 5)
    monkeypatch.setattr(kvlab.workloads.chat.estimate, "LONG_TURN_S", 0.0)
    at = open_page("app_pages/chat.py", timeout=120)
    small_turns(at)
    at.chat_input[0].set_value("word " * 2100).run()  # past the tiny model's 2,048 positions: refused, no turn
    assert not at.exception and any("context" in e.value for e in at.error)
    assert len(at.session_state.chat.settings.policies) == 5 and not at.session_state.chat.turns
    at.multiselect(key="chat_policies").set_value(["snapkv"]).run()
    at.chat_input[0].set_value("a long message " * 20).run()
    assert any("through 2 policies" in w.value for w in at.warning), [w.value for w in at.warning]
    at.button(key="chat_long_run").click().run()
    assert not at.exception and at.session_state.chat.settings.policies == ("full", "snapkv")
    assert len(at.session_state.chat.turns) == 1


@pytest.mark.slow
def test_a_stopped_turn_leaves_the_session_as_before(tiny: LoadedModel) -> None:
    settings = ChatSettings(policies=("streamingllm", "h2o"), budget=12, max_new_tokens=6)
    plain = ChatSession(tiny, settings)
    stopped = ChatSession(tiny, settings)
    for session in (plain, stopped):
        session.run_turn("My locker code is 4127 and my cat is Miso.")
    calls = []

    def stop_at_third(*_: str) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise Stopped("stop")

    with pytest.raises(Stopped):
        stopped.run_turn("Tell me a long story about the sea.", on_token=stop_at_third)
    assert stopped.wait_idle(1) and len(stopped.turns) == 1
    phases: list[str] = []

    def stop_after_prefill(what: str) -> None:  # the caches already hold the message here
        phases.append(what)
        if what.startswith("evicting after your message"):
            raise Stopped("stop")

    with pytest.raises(Stopped):
        stopped.run_turn("Tell me a long story about the sea.", on_phase=stop_after_prefill)
    assert phases[0].startswith("prefilling your message") and len(phases) == 2
    a = plain.run_turn("What is my locker code?")
    b = stopped.run_turn("What is my locker code?")
    assert a.reply == b.reply and a.total_tokens == b.total_tokens
    assert {n: (p.reply, p.kl, p.retained) for n, p in a.policies.items()} == \
        {n: (p.reply, p.kl, p.retained) for n, p in b.policies.items()}


def test_settings_summary_names_every_setting(tokenizer: PreTrainedTokenizerBase) -> None:
    line = settings_summary(ChatSettings(policies=("snapkv",), budget=64), None)
    assert "full, snapkv (window=32" in line and "budget** 64" in line and "system message** none" in line
    smol = implicit_system(tokenizer)  # SmolLM2's template names itself when the conversation gives no system message
    assert smol == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    line = settings_summary(ChatSettings(policies=("snapkv",), budget=64), None, smol)
    assert f"system message** none given, so the chat template writes its own: “{smol}”" in line
    plain = byte_tokenizer()
    assert implicit_system(plain) is None  # no template: the plain format
    # a budget says whom it holds: a walk read "5 MiB of K/V: 113 tokens" as holding KIVI without eviction too
    kivi = ChatSettings(policies=("snapkv", "kivi"), budget=64, budget_mib=3.0, policy_budgets={"kivi": 200},
                        params={"kivi": {"evict_with": "snapkv"}})
    assert budget_words(kivi) == "3 MiB of K/V: 64 (snapkv), 200 (kivi) tokens per layer per KV head"
    assert budget_words(ChatSettings(policies=("snapkv", "kivi"), budget=64)) == (
        "64 tokens per layer per KV head; kivi: no budget bounds what it keeps")
    plain.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                           "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert implicit_system(plain) is None  # a template that writes a system message only when given one


def test_request_stop_lands_inside_a_forward(tiny: LoadedModel) -> None:
    """Stop from another thread (the page's next run) ends a long decode within a layer, not a whole turn."""
    session = ChatSession(tiny, ChatSettings(policies=("window",), budget=12, max_new_tokens=1024))
    timer = threading.Timer(0.3, session.request_stop)
    t0 = time.perf_counter()
    timer.start()
    with pytest.raises(Stopped):
        session.run_turn("Tell me a long story about the sea. " * 20)
    assert time.perf_counter() - t0 < 2.0
    assert not session.turns and session.total_tokens == 0
    session.settings.max_new_tokens = 3  # a stop asked for earlier is not meant for the next turn
    assert session.run_turn("Hello").index == 0


def test_a_turn_estimate_counts_kvzips_reconstruction_of_the_message(tiny: LoadedModel, monkeypatch) -> None:
    """A walk ran a 3,245-token first turn with KVzip unasked: 24 s, of it 17 s its reconstruction, which the
    estimate left out."""
    from kvlab.workloads.chat import estimate

    def estimated(policies: tuple[str, ...]) -> float:
        ticks = iter([0.0, 0.064, 0.074])  # a 64-token forward in 64 ms, a step in 10 ms
        monkeypatch.setattr(estimate, "clock", lambda: next(ticks))
        return estimate.estimate_turn_s(tiny, ChatSettings(policies=policies, max_new_tokens=4), 3000, fresh=True)

    reply = 2 * 4 * (0.001 + 0.010)  # two policies, each decoding 4 tokens
    assert estimated(("snapkv",)) == pytest.approx(3.0 + reply)  # one prefill serves both caches on turn 1
    assert estimated(("kvzip",)) == pytest.approx((1 + estimate.RECONSTRUCTION_PREFILLS) * 3.0 + reply)


def test_a_message_the_turn_will_refuse_is_not_timed_and_asked_about_first(tiny: LoadedModel) -> None:
    """The page asked "Run it anyway?" about a message that fit the context only without its reply, then the turn
    refused it: the estimate now refuses by the turn's own rule (``check_fits``)."""
    context = tiny.facts.context_length
    original = ChatSettings(policies=("snapkv",), max_new_tokens=16)
    rerotated = ChatSettings(policies=("snapkv",), max_new_tokens=16, position_mode="rerotated")
    assert ask_first_s(tiny, original, context - 400, 390, fresh=False) == 0.0  # fits, but not with its 16 new
    assert ask_first_s(tiny, rerotated, context - 400, 390, fresh=False) > 0.0  # re-rotated positions go on
    assert ask_first_s(tiny, original, 0, 390, fresh=True) > 0.0
    assert ask_first_s(tiny, original, 0, 20, fresh=True) == 0.0  # short: not worth a timed forward


def test_a_message_longer_than_the_context_alone_is_told_to_shorten_not_to_start_over(tiny: LoadedModel) -> None:
    """A walk sent 10.8k tokens to an 8k model and was told to start a new conversation, which could not help."""
    context = tiny.facts.context_length
    with pytest.raises(KvlabError, match=f"shorten the message .with its reply it needs {context + 8} alone; re-rot"):
        check_fits(tiny, "original", 100, context - 8, 16)
    with pytest.raises(KvlabError, match=f"needs {context + 1} positions .*; start a new conversation or use"):
        check_fits(tiny, "original", context - 100, 85, 16)
    check_fits(tiny, "rerotated", 100, context - 8, 16)  # re-rotated positions go on
