"""The second embedded model, Gemma-3-270M (a base model), and prompts built as the tokenizer builds them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from page_helpers import open_page

from kvlab.engine.chatformat import PLAIN_DESCRIPTION, chat_format
from kvlab.engine.conversion import EMBEDDED_MODELS, GEMMA, cache_dir, embedded_model
from kvlab.engine.facts import LoadedModel
from kvlab.paths import CONVERSATIONS_DIR
from kvlab.policies import POLICIES
from kvlab.workloads.chat.conversation import load_conversation
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings
from kvlab.workloads.code.edits import encode_checked
from kvlab.workloads.rag.corpus import load_corpus
from kvlab.workloads.rag.prompt import build_layout
from ui.common import cached_model


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    """Gemma-3-270M as the pages load it (a cache hit for the chat page test)."""
    return cached_model(GEMMA, "auto", "auto", False, None)


@pytest.mark.model
@pytest.mark.slow
def test_gemma_loads_from_its_package_with_its_own_facts(gemma: LoadedModel) -> None:
    assert embedded_model("gemma3-270m") is EMBEDDED_MODELS[GEMMA]
    assert (cache_dir() / EMBEDDED_MODELS[GEMMA].folder / "model.safetensors").is_file()
    f = gemma.facts
    assert (f.n_layers, f.n_heads, f.n_kv_heads, f.head_dim, f.vocab_size) == (18, 4, 1, 256, 262144)
    full = [i for i, w in enumerate(f.layer_windows) if w is None]
    assert full == [5, 11, 17] and {w for w in f.layer_windows if w is not None} == {512}
    rope = gemma.model.config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] == 1e4 and rope["full_attention"]["rope_theta"] == 1e6
    assert f.rope_theta == 1e6  # the global layers' base
    assert gemma.model.config.final_logit_softcapping is None


@pytest.mark.model
@pytest.mark.slow
def test_gemma_prompts_start_with_bos_and_replies_are_not_empty(gemma: LoadedModel) -> None:
    bos = gemma.tokenizer.bos_token_id
    fmt = chat_format(gemma.tokenizer, None)
    assert fmt.plain and fmt.start_ids == (bos,)
    chat = ChatSession(gemma, ChatSettings(policies=("full",), max_new_tokens=10))
    assert chat.user_ids("What is the capital of France?", "")[0] == bos
    assert encode_checked(gemma, "x = 1\n")[0] == bos
    corpus = load_corpus()
    assert build_layout(gemma, corpus, [corpus.documents[0].id], corpus.questions[0]).prefix[0] == bos
    # why it matters: without <bos> the model's first token is a line break, which ends the reply
    ids = gemma.encode(fmt.user_block("What is the capital of France?"))
    with torch.inference_mode():
        first = int(gemma.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
    assert first in fmt.stop_ids
    turn = chat.run_turn("What is the capital of France?")
    assert "Paris" in turn.reply


@pytest.mark.model
def test_smollm2_prompts_get_no_bos(model: LoadedModel) -> None:
    fmt = chat_format(model.tokenizer, None)
    assert not fmt.plain and fmt.start_ids == ()
    chat = ChatSession(model, ChatSettings(policies=("full",)))
    assert chat.user_ids("Hi", "") == model.encode(fmt.opening + fmt.user_block("Hi"))
    assert encode_checked(model, "x = 1\n") == model.encode("x = 1\n")


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["original", "rerotated"])
def test_scripted_conversation_runs_every_policy_on_gemma(gemma: LoadedModel, mode: str) -> None:
    conv = load_conversation(CONVERSATIONS_DIR / "personal-facts.json")
    settings = ChatSettings(policies=tuple(POLICIES), budget=64, position_mode=mode, max_new_tokens=6)
    chat = ChatSession(gemma, settings, conv.system, script=replace(conv, turns=conv.turns[:2]))
    for t in conv.turns[:2]:
        turn = chat.run_turn(t.user, t.golden, t.prefill, t.answer)
        assert {n: r.error for n, r in turn.policies.items()} == {n: None for n in POLICIES}
        assert all(r.reply.strip() for r in turn.policies.values()), {n: r.reply for n, r in turn.policies.items()}
    assert chat.total_tokens > 64  # the budget made every policy but Full evict


@pytest.mark.model
@pytest.mark.slow
def test_chat_page_works_with_a_base_model(gemma: LoadedModel) -> None:
    at = open_page("app_pages/chat.py")
    at.sidebar.radio(key="model_source").set_value(EMBEDDED_MODELS[GEMMA].label).run()
    assert not at.exception
    assert PLAIN_DESCRIPTION in [i.value for i in at.info]
    at.multiselect(key="chat_policies").set_value(["streamingllm"])
    at.number_input(key="chat_budget").set_value(32)
    at.number_input(key="chat_max_new").set_value(8)
    at.chat_input[0].set_value("What is the capital of France?").run()
    assert not at.exception and not at.error
    assert len(at.chat_message) == 2
    assert "Paris" in at.chat_message[1].markdown[0].value
    assert at.session_state["chat"].lm is gemma


@pytest.mark.model
@pytest.mark.slow
def test_the_code_page_on_gemma_says_sharing_cannot_run_before_a_click(gemma: LoadedModel) -> None:
    at = open_page("app_pages/chat.py")
    at.sidebar.radio(key="model_source").set_value(EMBEDDED_MODELS[GEMMA].label).run()
    at.switch_page("app_pages/code_edits.py").run()  # the model picked on one page is the next page's
    assert not at.exception
    assert at.session_state["ce_session"].lm is gemma
    said = " ".join(e.value for e in at.error)
    assert "Measuring is not available: " in said and "not available for this architecture" in said
    assert at.button(key="ce_measure").disabled
