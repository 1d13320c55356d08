"""Behaviour on the embedded SmolLM2-135M: sinks exist, policies keep what they claim, Full is exact."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import eager_forward

from kvlab.engine.attention import Probe
from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.errors import KvlabError
from kvlab.policies import make_policy
from kvlab.policies.evict import evict
from kvlab.workloads.chat.replay import replay_session, session_to_json
from kvlab.workloads.chat.session import MAX_MESSAGE_CHARS, ChatSession
from kvlab.workloads.chat.settings import ChatSettings

TEXT = (
    "The harbour town wakes before dawn. Fishing boats slip out past the breakwater while the baker "
    "on Quay Street lights his ovens. By seven the market square fills with crates of mackerel, crab "
    "and samphire, and the ferry to the islands sounds its horn twice before it leaves. Visitors come "
    "for the cliffs and the lighthouse, which has guided ships since 1843, but locals will tell you "
    "the real treasure is the library above the post office, where the tide tables of two centuries "
    "are kept in leather ledgers. In winter the storms close the ferry for days at a time, and the "
    "town turns inward: choirs rehearse in the chapel, the pub runs quiz nights, and children learn "
    "to mend nets from their grandparents. "
)


@pytest.fixture(scope="module")
def text_ids(model: LoadedModel) -> list[int]:
    return model.encode(TEXT * 2)


@pytest.mark.model
def test_full_state_is_exact_on_embedded_model(model: LoadedModel, text_ids: list[int]) -> None:
    state = KVState(model)
    logits = torch.cat([state.append(text_ids[:150]), state.append(text_ids[150:151]), state.append(text_ids[151:])])
    own, _, _ = eager_forward(model, text_ids)  # transformers' own eager attention
    assert (logits - own).abs().max() < 1e-3


@pytest.mark.model
def test_attention_sinks_exist(model: LoadedModel, text_ids: list[int]) -> None:
    probe = Probe(windows=(64,))
    KVState(model).append(text_ids, probe)
    n = len(text_ids)
    first = torch.stack([probe.window_means[64][layer][:, 0]
                         for layer in range(model.facts.n_layers)])  # [layers, heads]
    per_layer = first.mean(1)
    uniform = 1.0 / n
    # most layers put far more than a uniform share on token 0; the deep layers most of all
    assert (per_layer > 20 * uniform).sum() >= 15
    assert per_layer[12:].mean() > 0.2
    assert per_layer[:12].mean() < per_layer[12:].mean()


@pytest.mark.model
def test_policies_keep_what_they_claim(model: LoadedModel, text_ids: list[int]) -> None:
    kept = {}
    for name in ["streamingllm", "h2o", "snapkv"]:
        policy = make_policy(name)
        state = KVState(model, track_accumulated=policy.needs_accumulated)
        probe = Probe(windows=policy.probe_windows())
        state.append(text_ids, probe)
        evict(state, policy, [64] * model.facts.n_layers, probe)
        assert state.lengths() == [64] * model.facts.n_layers
        kept[name] = state.positions
    n = len(text_ids)
    for layer in range(model.facts.n_layers):
        assert kept["streamingllm"][layer][0].tolist() == [0, 1, 2, 3, *range(n - 60, n)]
    for name in ["h2o", "snapkv"]:
        gaps = [(p[1:] - p[:-1] > 1).sum().item() for layer in kept[name] for p in layer]
        assert sum(g >= 3 for g in gaps) > 0.8 * len(gaps), f"{name} should keep scattered positions"
        assert any(not torch.equal(layer[0], layer[1]) for layer in kept[name]), f"{name} selects per KV head"


@pytest.mark.model
def test_chat_session_records_and_budget_semantics(model: LoadedModel) -> None:
    settings = ChatSettings(policies=("streamingllm", "snapkv", "h2o", "pyramidkv"), budget=48, max_new_tokens=6)
    session = ChatSession(model, settings)
    first = session.run_turn("My locker combination is 31415. Please remember it.")
    second = session.run_turn("What is my locker combination?", prefill="Your locker combination is", answer="31415")
    assert set(second.policies) == {"full", "streamingllm", "snapkv", "h2o", "pyramidkv"}
    full = second.policies["full"]
    assert full.kl == 0.0 and full.top1 == 1.0 and full.cache_tokens == [second.total_tokens] * model.facts.n_layers
    for name in ["streamingllm", "snapkv", "h2o"]:
        rec = second.policies[name]
        assert rec.cache_tokens == [48] * model.facts.n_layers and rec.error is None
        assert rec.blocks["free"] + rec.blocks["fragmented"] + rec.blocks["full"] == rec.blocks["n_blocks"]
        assert rec.blocks["bytes_retained"] == rec.kv_bytes
        assert len(rec.sink_mass) == model.facts.n_layers and len(rec.sink_mass[0]) == model.facts.n_heads
    budgets = session.budget["pyramidkv"].layers
    assert budgets == make_policy("pyramidkv").layer_budgets(48, model.facts.n_layers)
    assert budgets[0] == 32 + 32  # window 32 + PyramidKV's top step: twice budget − window = 16
    assert second.policies["pyramidkv"].cache_tokens == [min(b, second.total_tokens) for b in budgets]
    assert [s["role"] for s in second.segments] == ["user", "assistant", "user", "assistant"]
    assert second.segments[-1]["end"] == second.total_tokens
    assert first.reply_source == "full" and second.reply.startswith("Your locker combination is")
    # save → restore → replay gives identical records
    again = replay_session(model, json.loads(json.dumps(session_to_json(session))))
    clock_free = {"policies": None, "turn_s": None}  # a turn's wall-clock time differs between any two runs
    assert [t.to_dict() | clock_free for t in again.turns] == [
        {**t.to_dict(), **clock_free} for t in session.turns
    ]
    for a, b in zip(again.turns, session.turns):
        for name in a.policies:
            assert a.policies[name].reply == b.policies[name].reply
            assert a.policies[name].retained == b.policies[name].retained
            assert a.policies[name].kl == pytest.approx(b.policies[name].kl, abs=1e-6)


@pytest.mark.model
def test_budget_covering_conversation_matches_full(model: LoadedModel) -> None:
    settings = ChatSettings(policies=("streamingllm", "snapkv", "h2o"), budget=4000, max_new_tokens=5)
    session = ChatSession(model, settings)
    for msg in ["Name three rivers in Europe.", "Which of them is the longest?"]:
        turn = session.run_turn(msg)
        for rec in turn.policies.values():
            assert rec.kl < 1e-6 and rec.top1 == 1.0
            assert rec.reply == turn.policies["full"].reply


@pytest.mark.model
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": 3, "policies": ("streamingllm",)}, "below its minimum"),
        ({"budget": 100_000}, "exceeds the model's context"),
        ({"policies": ("lru",)}, "unknown policy"),
        ({"position_mode": "sideways"}, "position mode"),
    ],
)
def test_bad_settings_are_refused_clearly(model: LoadedModel, kwargs: dict, message: str) -> None:
    with pytest.raises(KvlabError, match=message):
        ChatSession(model, ChatSettings(**kwargs))


@pytest.mark.model
def test_bad_messages_leave_session_intact(model: LoadedModel) -> None:
    session = ChatSession(model, ChatSettings(policies=("streamingllm",), budget=32, max_new_tokens=4))
    session.run_turn("Hello there.")
    tokens = session.total_tokens
    with pytest.raises(KvlabError, match="empty"):
        session.run_turn("   ")
    with pytest.raises(KvlabError, match="context"):
        session.run_turn("1234567890" * 1900)  # digits are one token each: 19k tokens
    with pytest.raises(KvlabError, match="limit"):
        session.run_turn("w" * (MAX_MESSAGE_CHARS + 1))
    assert session.total_tokens == tokens and len(session.turns) == 1
    assert session.run_turn("Still there?").index == 1
