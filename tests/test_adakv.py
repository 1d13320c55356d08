"""AdaKV: hand-computed keep sets (GQA grouping, the per-head floor, one top-k over the layer's heads),
Full at a covering budget, and multi-turn chats where heads really hold different numbers of keys."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine.attention import Probe
from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState, to_kv_heads
from kvlab.errors import KvlabError
from kvlab.policies import LayerView, make_policy, param_specs
from kvlab.policies.adakv import AdaKV
from kvlab.policies.evict import evict, keep_shared
from kvlab.policies.snapkv import SnapKV
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

TOL = 1e-4
KV0 = [0.70, 0.50, 0.40, 0.35, 0.30, 0.25, 0.20]  # window votes on the 7 prefix slots of KV head 0 (concentrated)
KV1 = [0.00, 0.10, 0.03, 0.15, 0.04, 0.05, 0.06]  # and of KV head 1 (diffuse)


def snapkv_view() -> LayerView:
    """8 slots, 2 KV heads of 2 query heads each; the window is the newest slot; budget 4 per head."""
    spread = torch.tensor([0.2, -0.2, 0.2, -0.2, 0.2, -0.2, 0.2, 0.0])  # the two query heads of a group differ
    kv = torch.tensor([KV0 + [0.0], KV1 + [0.0]])  # [kv_heads, slots]
    per_query_head = torch.stack([kv[0] + spread, kv[0] - spread, kv[1] + spread, kv[1] - spread])  # [heads, slots]
    return LayerView(layer=0, budget=4, positions=torch.arange(8).expand(2, 8), keys=torch.zeros(2, 8, 4),
                     window_mean={1: to_kv_heads(per_query_head, 2)}, accumulated=None)


def kept(alpha: float) -> list[list[int]]:
    """[kv_head] the slots AdaKV keeps on ``snapkv_view``, as evict chooses them."""
    view = snapkv_view()
    keep = keep_shared(make_policy("adakv", alpha_safeguard=alpha).scores(view), view.budget)
    return [torch.nonzero(row).flatten().tolist() for row in keep]


@pytest.fixture
def snapkv_window_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapped SnapKV observes one query, unpooled, so the votes above are its scores."""
    monkeypatch.setattr(AdaKV, "wrapped", lambda self: SnapKV(window=1, kernel=1))


def test_one_top_k_over_the_layers_heads_with_a_floor_per_head(snapkv_window_of_one: None) -> None:
    # the newest slot (SnapKV's window) is forced in both heads; floor int(4 · 0.5) = 2: KV head 1 keeps its best
    # prefix slot (3: 0.15); the other 4 of the 8 go to the best scores of either head, all in head 0
    assert kept(0.5) == [[0, 1, 2, 3, 4, 7], [3, 7]]
    # no floor: 6 of 8 to head 0's prefix, head 1 keeps only the window
    assert kept(0.0) == [[0, 1, 2, 3, 4, 5, 7], [7]]
    # a floor of the whole budget is SnapKV per head: 4 each
    assert kept(1.0) == [[0, 1, 2, 7], [1, 3, 6, 7]]


def test_the_scorer_is_any_registered_scoring_policy_and_parameters_are_widgets() -> None:
    from kvlab.policies import POLICIES

    scorers = AdaKV.choices("scorer")  # read off the registry, so a plug-in scoring policy is one too
    assert all(name in POLICIES and POLICIES[name].evicts and not make_policy(name).shared_budget for name in scorers)
    assert {"kvzip", "expected_attention", "keydiff"} <= set(scorers)  # the query-agnostic scorers too
    assert not {"full", "quest", "kivi", "oracle", "adakv", "duoattention"} & set(scorers)
    specs = {s.name: s for s in param_specs("adakv")}
    assert specs["scorer"].kind == "choice" and specs["scorer"].default == "snapkv"
    alpha = specs["alpha_safeguard"]
    assert alpha.default == 0.2 and (alpha.min, alpha.max) == (0, 1)
    assert make_policy("adakv", scorer="h2o").needs_accumulated
    with pytest.raises(KvlabError, match="scorer must be one of"):
        make_policy("adakv", scorer="quest")
    with pytest.raises(KvlabError, match="alpha_safeguard must be between"):
        make_policy("adakv", alpha_safeguard=1.5)


def test_over_kvzip_it_ranks_the_reconstruction_scores_with_a_floor_per_head() -> None:
    """Head 0 concentrated, head 1 diffuse; budget 3 per head, 6 over the layer; no sink among positions 10–17."""
    recon = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.1, 0.1, 0.1], [0.05, 0.3, 0.02, 0.01, 0.2, 0.03, 0.04, 0.06]])

    def kept(alpha: float, first: int = 10) -> list[list[int]]:
        view = LayerView(layer=0, budget=3, positions=torch.arange(first, first + 8).expand(2, 8),
                         keys=torch.zeros(2, 8, 4), window_mean={}, accumulated=None, reconstruction=recon)
        policy = make_policy("adakv", scorer="kvzip", alpha_safeguard=alpha)
        keep = keep_shared(policy.scores(view), view.budget)
        return [torch.nonzero(row).flatten().tolist() for row in keep]

    assert kept(0.2) == [[0, 1, 2, 3, 4], [1]]  # floor int(3 · 0.2) = 0: the flattened top 6
    assert kept(0.7) == [[0, 1, 2, 3], [1, 4]]  # floor 2: head 1's 0.3 and 0.2, then head 0's best two more
    assert kept(1.0) == [[0, 1, 2], [1, 4, 7]]  # floor 3: KVzip per head
    # from position 3, slot 0 is one of KVzip's 4 sinks (infinite score) in each head: head 1 keeps only it
    assert kept(0.2, first=3) == [[0, 1, 2, 3, 4], [0]]
    policy = make_policy("adakv", scorer="kvzip")
    assert policy.needs_reconstruction and policy.repeat_spec() == make_policy("kvzip").repeat_spec()
    assert policy.shared_budget and not policy.model_budget  # AdaKV's one top-k per layer, not KVzip's over the model


def test_over_keydiff_and_expected_attention_it_reads_what_they_read() -> None:
    assert make_policy("adakv", scorer="keydiff").wrapped().block_size == 0  # kvpress's one-anchor score
    assert make_policy("adakv", scorer="expected_attention").probe().queries_from == (4,)


def test_over_kvzip_a_chat_repeats_each_append_and_spends_the_layer_budget_over_its_heads(tiny: LoadedModel) -> None:
    budget = 24
    settings = ChatSettings(policies=("full", "adakv"), budget=budget, max_new_tokens=4,
                            params={"adakv": {"scorer": "kvzip"}})
    session = ChatSession(tiny, settings)
    for message in ["Tell me about the harbour town and its lighthouse.", "What did I just say?"]:
        turn = session.run_turn(message)
        rec, state = turn.policies["adakv"], session.states["adakv"]
        assert rec.error is None and rec.extra_prefill_tokens > 0 and rec.extra_prefill_s > 0
        for lengths in state.head_lengths():
            assert sum(lengths) == tiny.facts.n_kv_heads * min(budget, turn.total_tokens)
        assert state.reconstructed == state.seen


def test_a_budget_covering_the_conversation_equals_full(tiny: LoadedModel) -> None:
    session = ChatSession(tiny, ChatSettings(policies=("full", "adakv"), budget=1500, max_new_tokens=4))
    for message in ["Hello there.", "Tell me about the harbour town and its lighthouse."]:
        turn = session.run_turn(message)
        rec = turn.policies["adakv"]
        assert rec.error is None and rec.kl < 1e-6 and rec.top1 == 1.0
        assert rec.reply == turn.policies["full"].reply and rec.kv_bytes == turn.policies["full"].kv_bytes


@pytest.mark.parametrize("mode", ["original", "rerotated"])
def test_a_multi_turn_chat_holds_uneven_heads_within_the_layer_budget(tiny: LoadedModel, mode: str) -> None:
    f = tiny.facts
    budget = 40  # above SnapKV's window of 32, which every head keeps: 16 slots per layer left to share
    settings = ChatSettings(policies=("full", "adakv", "snapkv", "quest"), budget=budget, position_mode=mode,
                            max_new_tokens=4, params={"adakv": {"alpha_safeguard": 0.5}})
    session = ChatSession(tiny, settings)
    uneven = False
    for message in ["Tell me about the harbour town and its lighthouse.", "What did I just say?",
                    "List five fruits, then five vegetables, then five colours, in that order please."]:
        turn = session.run_turn(message)
        rec, state = turn.policies["adakv"], session.states["adakv"]
        assert rec.error is None
        for layer, (lengths, lay) in enumerate(zip(state.head_lengths(), state.layers)):
            assert sum(lengths) == f.n_kv_heads * min(budget, turn.total_tokens)  # spent over the heads together
            assert min(lengths) >= min(32, turn.total_tokens)  # the window, which covers the floor of 20
            assert lay.held == max(lengths)
            assert rec.retained[layer] == [p.tolist() for p in state.kept_positions()[layer]]
            uneven |= len(set(lengths)) > 1
            if mode == "rerotated":  # each head's own keys end right before the next query
                query = max(state.lengths())
                for rope, real in zip(lay.rope_positions, lay.real):
                    assert rope[real].tolist() == list(range(query - int(real.sum()), query))
        held = sum(map(sum, state.head_lengths()))
        assert rec.kv_bytes == state.kv_bytes() == held * f.kv_bytes(1, layers=1, heads=1)
        assert rec.blocks["retained_tokens"] == held and rec.blocks["bytes_retained"] == rec.kv_bytes
        assert rec.kv_bytes == turn.policies["snapkv"].kv_bytes  # equal memory to uniform SnapKV
        assert rec.cache_tokens == turn.policies["snapkv"].cache_tokens == [min(budget, turn.total_tokens)] * f.n_layers
    assert uneven


def test_eviction_keeps_only_what_each_head_held(tiny: LoadedModel) -> None:
    policy = make_policy("adakv", scorer="h2o")
    state = KVState(tiny, track_accumulated=True)
    probe = Probe(windows=policy.probe_windows())
    ids = torch.randint(100, 20000, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    state.append(ids[:40], probe)
    evict(state, policy, [12] * tiny.facts.n_layers, probe)
    before = [[p.clone() for p in heads] for heads in state.kept_positions()]
    probe = Probe(windows=policy.probe_windows())
    state.append(ids[40:], probe)
    dropped = evict(state, policy, [12] * tiny.facts.n_layers, probe)
    assert dropped == 2 * 20 * tiny.facts.n_layers  # 24 held + 20 new per head: 64 → 24 per layer
    for layer, heads in enumerate(state.kept_positions()):
        assert sum(len(p) for p in heads) == 24
        for head, pos in enumerate(heads):
            old = torch.cat([before[layer][head], torch.arange(40, 60)])
            assert bool(torch.isin(pos, old).all()) and bool((pos[1:] > pos[:-1]).all())


def test_kivi_over_adakv_spends_one_budget_over_the_heads(tiny: LoadedModel) -> None:
    ids = torch.randint(100, 20000, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    kept = {}
    for policy in [make_policy("adakv"), make_policy("kivi", bits=16, evict_with="adakv")]:
        state = KVState(tiny)
        probe = policy.probe()
        state.append(ids, probe)
        evict(state, policy, [40] * tiny.facts.n_layers, probe)  # above SnapKV's window of 32, as AdaKV's default
        kept[policy.name] = [[p.tolist() for p in heads] for heads in state.kept_positions()]
    assert kept["kivi"] == kept["adakv"]
    assert any(len({len(p) for p in heads}) > 1 for heads in kept["adakv"])  # heads hold different numbers
