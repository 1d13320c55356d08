"""Property tests (hypothesis) of the policies, eviction and the engine's paging on random sizes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.policies import make_policy
from kvlab.policies.evict import evict
from kvlab.policies.pyramidkv import selected_pyramid, total_pyramid
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

EVICTING = ["streamingllm", "window", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "expected_attention",
            "keydiff"]
RECENT_KEEPING = ["streamingllm", "window", "h2o", "snapkv", "pyramidkv"]
FEW = settings(max_examples=25, deadline=None)


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


@st.composite
def eviction_cases(draw: st.DrawFn) -> dict:
    name = draw(st.sampled_from(EVICTING))
    params = {}
    if name == "streamingllm":
        params["n_sink"] = draw(st.integers(0, 6))
    if name in ("snapkv", "pyramidkv"):
        params["window"] = draw(st.integers(1, 12))
        params["kernel"] = draw(st.sampled_from([1, 3, 5]))
    if name == "expected_attention":
        params["n_sink"] = draw(st.integers(0, 6))
        params["n_future_positions"] = draw(st.integers(1, 600))
    if name == "keydiff":
        params["block_size"] = draw(st.integers(0, 20))
    policy = make_policy(name, **params)
    budget = draw(st.integers(policy.min_budget(), 40))
    chunks = draw(st.lists(st.integers(1, 50), min_size=1, max_size=3))  # one append per turn
    return {"name": name, "params": params, "budget": budget, "chunks": chunks, "seed": draw(st.integers(0, 99))}


@pytest.mark.slow
@FEW
@given(eviction_cases())
def test_eviction_invariants(tiny: LoadedModel, case: dict) -> None:
    policy = make_policy(case["name"], **case["params"])
    n_layers, kv_heads = tiny.facts.n_layers, tiny.facts.n_kv_heads
    budgets = policy.layer_budgets(case["budget"], n_layers)
    state = KVState(tiny, track_accumulated=policy.needs_accumulated)
    seen = 0
    for i, n in enumerate(case["chunks"]):
        probe = policy.probe()
        state.append(random_ids(n, case["seed"] + i), probe)
        kept_before = [p.clone() for p in state.positions]
        evict(state, policy, budgets, probe)
        seen += n
        assert state.seen == seen
        for layer, (pos, budget) in enumerate(zip(state.positions, budgets)):
            held = min(kept_before[layer].shape[-1], budget)
            assert pos.shape == (kv_heads, held)
            assert state.cache.layers[layer].keys.shape[-2] == held
            assert state.cache.layers[layer].values.shape[-2] == held
            assert bool((pos[:, 1:] > pos[:, :-1]).all())  # strictly increasing per head
            assert bool((pos >= 0).all() and (pos < seen).all())
            # eviction only drops: every kept position was held before
            assert all(bool(torch.isin(pos[h], kept_before[layer][h]).all()) for h in range(kv_heads))
            if case["name"] in RECENT_KEEPING:  # TOVA and Knorm may drop even the newest token
                assert bool((pos[:, -1] == seen - 1).all())
            if case["name"] in ("streamingllm", "expected_attention"):
                sinks = torch.arange(min(case["params"]["n_sink"], seen))
                assert all(bool(torch.isin(sinks, pos[h]).all()) for h in range(kv_heads))
            if case["name"] == "window":
                assert torch.equal(pos, torch.arange(seen - held, seen).expand(kv_heads, held))


@FEW
@given(budget=st.integers(1, 4096), n_layers=st.integers(1, 64), beta=st.floats(1.0, 100.0))
def test_total_pyramid_sums_and_declines(budget: int, n_layers: int, beta: float) -> None:
    out = total_pyramid(budget, n_layers, beta)
    assert len(out) == n_layers and sum(out) == n_layers * budget
    assert all(a >= b for a, b in zip(out, out[1:]))
    assert out[-1] >= 1
    if n_layers > 1:  # the top layer gets about b/β (at least 1), the bottom about 2b − b/β
        assert abs(out[-1] - max(1.0, budget / beta)) <= 1
        assert abs(out[0] - (2 * budget - max(1.0, budget / beta))) <= 1


@FEW
@given(budget=st.integers(1, 4096), n_layers=st.integers(1, 64), beta=st.floats(1.0, 100.0), window=st.integers(1, 64))
def test_selected_pyramid_keeps_the_window_in_every_layer(budget: int, n_layers: int, beta: float, window: int) -> None:
    out = selected_pyramid(budget, n_layers, beta, window)
    assert len(out) == n_layers and all(a >= b for a, b in zip(out, out[1:]))
    assert min(out) >= min(budget, window)
    assert sum(out) >= n_layers * budget  # the integer step rounds down, so the total only grows


MESSAGES = ["Hello there.", "Tell me about the harbour town and its lighthouse.", "What did I just say?",
            "List five fruits, then five vegetables, then five colours, in that order please."]


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(
    policy=st.sampled_from(EVICTING),
    budget=st.integers(8, 48),
    block_size=st.integers(1, 32),
    turns=st.lists(st.sampled_from(MESSAGES), min_size=1, max_size=2),
)
def test_engine_paging_figures_match_the_cache(
    tiny: LoadedModel, policy: str, budget: int, block_size: int, turns: list[str]
) -> None:
    session = ChatSession(tiny, ChatSettings(policies=(policy,), budget=budget, block_size=block_size,
                                             max_new_tokens=3))
    f = tiny.facts
    for message in turns:
        turn = session.run_turn(message)
        for name, rec in turn.policies.items():
            assert rec.error is None
            state = session.states[name]
            blocks = rec.blocks
            assert blocks["bytes_retained"] == rec.kv_bytes == state.kv_bytes()
            assert blocks["retained_tokens"] == sum(rec.cache_tokens) * f.n_kv_heads
            assert blocks["n_blocks"] == f.n_layers * f.n_kv_heads * math.ceil(turn.total_tokens / block_size)
            assert blocks["free"] + blocks["fragmented"] + blocks["full"] == blocks["n_blocks"]
            assert rec.cache_tokens == [len(p[0]) for p in rec.retained]
            expected = session.budget[name].layers
            fits = turn.total_tokens <= budget  # no eviction while the conversation fits the budget
            assert rec.cache_tokens == [turn.total_tokens if fits else min(turn.total_tokens, b) for b in expected]
