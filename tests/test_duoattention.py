"""DuoAttention: the head split's hand-computed keep sets, the binarisation of gates, uneven heads against the
model's own eager forward, bytes held per head, the gate training and kvpress's estimate on tiny models, the
pattern cache, the heatmap, and check-policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import build, reference_mask

from kvlab.engine import head_patterns
from kvlab.engine.head_patterns import GateTraining, HeadPattern, OnTheFly, head_pattern, streaming_mask, train_gates
from kvlab.engine.kvstate import KVState
from kvlab.engine.tiny import byte_tokenizer, tiny_model
from kvlab.errors import KvlabError
from kvlab.experiments.conformance import check_policies
from kvlab.export import to_json
from kvlab.policies import LayerView, make_policy, param_specs
from kvlab.policies.base import UNBOUNDED
from kvlab.policies.duoattention import DuoAttention
from kvlab.policies.evict import evict, keep_per_head
from kvlab.policies.memory import tokens_within
from kvlab.viz.chat import duo_heads_figure
from kvlab.workloads.chat.replay import session_to_json
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.session_file import record_from_json, record_of
from kvlab.workloads.chat.settings import ChatSettings
from kvlab.workloads.stream.settings import StreamSettings, stream_policies

TOL = 1e-4
QUICK = GateTraining(steps=2, context_min=40, context_max=60, num_passkeys=1, passkey_length=2, sink=4, recent=8)


def pattern(gates: list[list[float]], method: str = "trained") -> HeadPattern:
    return HeadPattern("tiny", method, torch.tensor(gates), {}, 1.0)


def duo(gates: list[list[float]], **params) -> DuoAttention:
    """A DuoAttention whose head pattern is ``gates`` [layers, kv_heads] (as ``prepare`` would have found it)."""
    policy = make_policy("duoattention", **params)
    policy.found = pattern(gates)
    return policy


def test_the_lowest_gates_are_streaming_heads() -> None:
    p = pattern([[0.3, 0.8], [0.1, 0.5]])
    # round(4 × 0.5) = 2 streaming heads: the gates 0.1 (layer 1, head 0) and 0.3 (layer 0, head 0)
    assert p.retrieval(0.5).tolist() == [[False, True], [False, True]]
    assert p.retrieval(0.25).tolist() == [[True, True], [False, True]]  # round(1.0): only 0.1
    assert p.retrieval(0.0).all() and not p.retrieval(1.0).any()
    assert pattern([[0.5, 0.5], [0.5, 0.5]]).retrieval(0.25).tolist() == [[False, True], [True, True]]  # ties: first


def test_streaming_heads_keep_exactly_sink_and_recent_retrieval_heads_everything() -> None:
    policy = duo([[0.9, 0.1]], sink=2, recent=3)  # KV head 0 retrieval, KV head 1 streaming
    positions = torch.tensor([[0, 1, 2, 5, 6, 9, 11, 12, 14, 15]] * 2)  # 10 slots after earlier evictions
    view = LayerView(layer=0, budget=4, positions=positions, keys=torch.zeros(2, 10, 4), window_mean={},
                     accumulated=None)
    budgets = policy.head_budgets(0, UNBOUNDED, 2)
    assert budgets == [UNBOUNDED, 5]
    keep = keep_per_head(policy.scores(view), budgets)
    assert positions[0][keep[0]].tolist() == positions[0].tolist()
    assert positions[1][keep[1]].tolist() == [0, 1, 12, 14, 15]  # the 2 sinks and the 3 newest


def test_parameters_are_widgets_and_bad_ones_are_refused() -> None:
    specs = {s.name: s for s in param_specs("duoattention")}
    assert {n: s.default for n, s in specs.items()} == {"sink": 128, "recent": 256, "head_compression_ratio": 0.5,
                                                        "pattern": "trained"}
    assert specs["pattern"].choices == ("trained", "on_the_fly")
    with pytest.raises(KvlabError, match="head_compression_ratio must be between"):
        make_policy("duoattention", head_compression_ratio=1.5)
    with pytest.raises(KvlabError, match="pattern must be one of"):
        make_policy("duoattention", pattern="downloaded")
    with pytest.raises(KvlabError, match="no head pattern yet"):
        make_policy("duoattention").head_budgets(0, 16, 2)
    with pytest.raises(KvlabError, match="exceed the model's context"):
        make_policy("duoattention").validate(16, context_length=300)


def test_no_budget_bounds_it_so_a_byte_budget_runs_it_at_its_own_memory() -> None:
    lm, _ = build("llama")
    policy = make_policy("duoattention")
    assert policy.keeps_growing() and make_policy("kivi", evict_with="duoattention").keeps_growing()
    assert not make_policy("streamingllm").keeps_growing() and make_policy("full").keeps_growing()
    assert tokens_within(policy, lm.facts.kv_bytes(100), lm.facts, 512) == 100  # any budget: it ignores it
    with pytest.raises(KvlabError, match="in some heads at least"):  # streams compare bounded caches
        stream_policies(lm, StreamSettings(policies=("duoattention",)))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_uneven_heads_equal_the_models_own_forward_with_each_heads_evicted_keys_masked(arch: str) -> None:
    lm, reference = build(arch)
    f = lm.facts
    policy = duo([[0.9, 0.1]] * f.n_layers, sink=2, recent=8)  # per layer: KV head 0 retrieval, 1 streaming
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    state = KVState(lm)
    state.append(ids[:30])
    assert evict(state, policy, policy.layer_budgets(16, f.n_layers), None) == 20 * f.n_layers
    hidden = [set(), set(range(2, 22))]  # the streaming head keeps sinks 0, 1 and the newest 22…29
    kept = [[p.tolist() for p in heads] for heads in state.kept_positions()]
    assert kept == [[list(range(30)), [0, 1, *range(22, 30)]]] * f.n_layers
    # bytes held: each head's own keys, 30 + 10 per layer
    assert state.kv_bytes() == (30 + 10) * f.n_layers * f.kv_bytes(1, layers=1, heads=1)
    ours = torch.cat([state.append(ids[30:34]), *[state.append([t]) for t in ids[34:]]])
    own = reference(input_ids=torch.tensor([ids]), attention_mask=reference_mask(lm, 40, hidden, after=30)).logits[0]
    assert (ours - own[30:].float()).abs().max() < TOL
    evict(state, policy, policy.layer_budgets(16, f.n_layers), None)  # 10 more: the streaming head is cut again
    assert state.head_lengths() == [[40, 10]] * f.n_layers
    assert state.kv_bytes() == 50 * f.n_layers * f.kv_bytes(1, layers=1, heads=1)


def test_the_streaming_mask_sees_sinks_and_recent_keys() -> None:
    mask = streaming_mask(6, sink=1, recent=2)
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0],
                                   [1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1]]
    assert streaming_mask(4, 4, 4).equal(torch.ones(4, 4).tril().bool())  # sinks of every key: causal


@pytest.mark.slow
def test_a_head_whose_output_ignores_what_it_attends_to_becomes_the_streaming_head() -> None:
    lm, _ = tiny_model("llama", tokenizer=byte_tokenizer(), context=4096)
    d = lm.facts.head_dim
    attn = lm.model.model.layers[1].self_attn
    with torch.no_grad():
        attn.v_proj.weight[d : 2 * d] = 0  # KV head 1 of layer 1 outputs zero, whatever it sees
    settings = GateTraining(steps=12, context_min=80, context_max=120, num_passkeys=1, passkey_length=3, sink=4,
                            recent=8)
    steps = []
    found = train_gates(lm, settings, on_step=lambda step, losses: steps.append(losses))
    gates = found.gates
    assert len(found.history) == len(steps) == 12 and steps[0]["distill"] == 0.0  # α = 1: mixed is full
    assert found.history[-1]["reg"] < 1.0 and bool(((gates >= 0) & (gates <= 1)).all())
    # only the L1 term pulls on it: its gate falls furthest, so it is the first streaming head
    assert gates.argmin().item() == 1 * lm.facts.n_kv_heads + 1
    assert found.retrieval(1 / gates.numel()).flatten().tolist().index(False) == 1 * lm.facts.n_kv_heads + 1


@pytest.mark.slow
def test_kvpress_estimate_is_the_area_under_the_cumulated_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    lm, _ = tiny_model("llama", tokenizer=byte_tokenizer(), context=4096)
    monkeypatch.setattr(head_patterns, "haystack_texts", lambda: ["A lighthouse stands on the rock. " * 4])
    found = head_patterns.on_the_fly(lm, OnTheFly(num_samples=1, q_len=50))
    assert found.method == "on_the_fly" and found.gates.shape == (lm.facts.n_layers, lm.facts.n_kv_heads)
    # by hand for layer 0, KV head 1: its queries' and keys' means over the text, repeated and rotated
    from kvlab.engine.rope import capture_qk, rotate

    q, k = capture_qk(lm, lm.encode("A lighthouse stands on the rock. " * 4), 0)
    at = torch.arange(50)
    qs = rotate(lm, q.mean(1, keepdim=True).expand(-1, 50, -1), at, 0)[2:4, -1]  # query heads 2, 3 of KV head 1
    ks = rotate(lm, k.mean(1, keepdim=True).expand(-1, 50, -1), at, 0)[1]
    weights = torch.softmax(qs @ ks.T / lm.facts.head_dim ** 0.5, dim=-1)  # [2, 50]
    assert abs(found.gates[0, 1].item() - weights.cumsum(-1).mean().item()) < 1e-5


@pytest.mark.slow
def test_patterns_are_found_once_then_read_from_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(head_patterns, "_found", {})
    lm, _ = tiny_model("llama", tokenizer=byte_tokenizer(), context=4096)
    first = head_pattern(lm, "trained", QUICK)
    files = list((tmp_path / "head_patterns").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["settings"]["steps"] == 2
    assert head_pattern(lm, "trained", QUICK) is first  # this process's
    monkeypatch.setattr(head_patterns, "_found", {})
    monkeypatch.setattr(head_patterns, "train_gates", lambda *a: pytest.fail("trained again"))
    again = head_pattern(lm, "trained", QUICK)  # the disk's
    assert again.gates.equal(first.gates) and again.history == first.history
    other, _ = tiny_model("llama", seed=1, tokenizer=byte_tokenizer(), context=4096)  # same shape, other weights
    keys = {head_patterns.pattern_key(m, "trained", s) for m in (lm, other) for s in (QUICK, GateTraining())}
    assert len(keys) == 4 and head_patterns.pattern_key(lm, "on_the_fly", OnTheFly()) not in keys
    with pytest.raises(KvlabError, match="method must be one of"):
        head_pattern(lm, "downloaded")


def test_the_heatmap_marks_the_retrieval_heads() -> None:
    fig = duo_heads_figure(pattern([[0.3, 0.8], [0.1, 0.5]]), head_compression_ratio=0.5)
    heat = fig.data[0]
    assert [v for row in heat.z for v in row] == pytest.approx([0.3, 0.8, 0.1, 0.5])
    assert heat.text.tolist() == [["", "R"], ["", "R"]]
    assert list(heat.x) == ["kv0", "kv1"] and list(heat.y) == ["L0", "L1"]
    title, notes = fig.layout.title.text.split("<br>")  # the model and the method beneath, where they fit
    assert "2 retrieval of 4" in title and "gate optimisation" in notes and fig.layout.margin.t == 80


@pytest.mark.slow
def test_check_policy_passes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.setitem(head_patterns.DEFAULTS, "trained", QUICK)
    checks = check_policies({"duoattention": {}})["duoattention"]
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    # the conformance conversation is shorter than the default window; a small one makes streaming heads evict,
    # whatever the budget: then only "a budget covering the conversation equals Full" cannot hold
    checks = check_policies({"duoattention": {"sink": 4, "recent": 8}})["duoattention"]
    assert [c.prop for c in checks if not c.passed] == ["a budget covering the conversation equals Full"]
    budget = next(c for c in checks if c.prop == "the budget is never exceeded")
    assert budget.detail.startswith("3 turns: no layer budget bounds it;") and budget.detail.endswith("own 12…12")


@pytest.mark.slow
def test_finding_a_pattern_reports_each_step_and_a_cached_one_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(head_patterns, "_found", {})
    monkeypatch.setitem(head_patterns.DEFAULTS, "trained", QUICK)
    lm, _ = tiny_model("llama", tokenizer=byte_tokenizer(), context=4096)
    told: list[tuple[float, str]] = []
    policy = make_policy("duoattention")
    policy.prepare(lm, lambda fraction, message: told.append((fraction, message)))
    assert [f for f, _ in told] == [0.0, 0.5, 1.0]
    assert "step 2/2" in told[-1][1] and "distillation loss" in told[-1][1]
    again: list[tuple[float, str]] = []
    make_policy("duoattention").prepare(lm, lambda fraction, message: again.append((fraction, message)))
    assert again == []  # this process's pattern: nothing to wait for
    pattern, ratio = policy.learned_heads()
    assert ratio == 0.5 and pattern.gates.shape == (lm.facts.n_layers, lm.facts.n_kv_heads)
    assert make_policy("kivi", evict_with="duoattention").learned_heads() is None  # not prepared yet


@pytest.mark.slow
def test_a_session_file_keeps_the_head_pattern_it_ran_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(head_patterns, "_found", {})
    monkeypatch.setitem(head_patterns.DEFAULTS, "trained", QUICK)
    lm, _ = tiny_model("llama", tokenizer=byte_tokenizer(), context=4096)
    settings = ChatSettings(policies=("full", "duoattention", "snapkv"), budget=16, max_new_tokens=2,
                            params={"duoattention": {"sink": 2, "recent": 4, "head_compression_ratio": 0.25}})
    session = ChatSession(lm, settings)
    session.run_turn("hello there, how are you")
    live = record_of(session)
    assert list(live.heads) == ["duoattention"]
    data = json.loads(to_json(session_to_json(session)))
    (pattern, ratio), = record_from_json(data).heads.values()
    assert ratio == 0.25 and pattern.gates.equal(live.heads["duoattention"][0].gates)
    assert pattern.method == "trained" and pattern.settings["steps"] == 2
    del data["head_patterns"]  # a file from before they were kept opens without one
    assert record_from_json(data).heads == {}
    data["head_patterns"] = {"duoattention": {"pattern": {"gates": []}}}
    with pytest.raises(KvlabError, match="head patterns are malformed"):
        record_from_json(data)
