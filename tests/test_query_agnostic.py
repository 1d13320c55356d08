"""Expected Attention and KeyDiff: their evidence checked against the model's own projections and RoPE, and
their keep sets on hand-built keys with hand-computed answers (statistics, cosine similarity, GQA groups)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import build

from kvlab.engine.kvstate import KVState
from kvlab.engine.rope import mean_rotation, rotate
from kvlab.errors import KvlabError
from kvlab.policies import LayerView, Policy, make_policy
from kvlab.policies.evict import evict, keep_index

SINKS = 2


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


def kept(policy: Policy, v: LayerView) -> list[list[int]]:
    """[kv_head] the original positions the policy keeps, as evict chooses them."""
    return v.positions.gather(-1, keep_index(policy.scores(v), v.budget)).tolist()


# --- Expected Attention's evidence: pre-RoPE query statistics and the averaged rotation -----------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: queries pass q_norm before RoPE
@pytest.mark.parametrize("mode", ["original", "rerotated"])
def test_query_statistics_are_the_models_own_pre_rope_queries(arch: str, mode: str) -> None:
    lm, _ = build(arch)
    attn = lm.model.model.layers[1].self_attn
    captured: list[torch.Tensor] = []
    module = getattr(attn, "q_norm", None) or attn.q_proj  # what RoPE turns, as the model computes it
    hook = module.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    policy = make_policy("expected_attention", n_sink=SINKS)
    state = KVState(lm, mode)
    try:
        for step, n in enumerate((20, 9)):  # the second forward follows an eviction: positions shift in rerotated mode
            probe = policy.probe()
            captured.clear()
            state.append(ids(n, step), probe)
            d = lm.facts.head_dim
            pre = captured[0].reshape(n, lm.facts.n_heads, d).transpose(0, 1)  # [heads, n, d]
            skip = SINKS if step == 0 else 0  # only turn 1 holds the sinks' own queries
            want = pre[:, skip:].double()
            mean = want.mean(1)
            cov = torch.einsum("hni,hnj->hij", want - mean[:, None], want - mean[:, None]) / want.shape[1]
            assert (probe.query_means[SINKS][1] - mean).abs().max() < 1e-4
            assert (probe.query_covs[SINKS][1] - cov).abs().max() < 1e-4
            evict(state, policy, [12] * lm.facts.n_layers, probe)
    finally:
        hook.remove()


@pytest.mark.parametrize("arch", ["llama", "phi3-partial-rotary", "gemma3"])  # partial rotary; per-layer RoPE bases
def test_mean_rotation_is_the_average_of_the_models_rotations(arch: str) -> None:
    lm, _ = build(arch)
    x = torch.randn(5, lm.facts.head_dim, generator=torch.Generator().manual_seed(3))
    for layer in (0, lm.facts.n_layers - 1):
        start, n = 37, 50
        turned = torch.stack([rotate(lm, x[None], p, layer)[0] for p in range(start, start + n)]).mean(0)
        assert (x @ mean_rotation(lm, layer, start, n).T - turned).abs().max() < 1e-5


# --- Expected Attention's keep sets ---------------------------------------------------------------------------

#   positions 0, 1 are the sinks (n_sink=2); the others compete for the two places a budget of 4 leaves
KEYS = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 1],  # sinks
                     [4, 0, 0, 0], [0, 4, 0, 0], [2, 2, 0, 0], [0, 0, 4, 0], [0, 0, 0, 1], [-4, 0, 0, 0]])


def ea_view(means: list[list[float]], cov: torch.Tensor | None = None, value_norms: list[float] | None = None,
            rotation: torch.Tensor | None = None) -> LayerView:
    """One KV head holding KEYS at positions 0..7, the query heads of its group with the given means."""
    heads = len(means)
    values = torch.ones(8, 4) / 2  # norm 1 each
    if value_norms is not None:
        values = values * torch.tensor(value_norms)[:, None]
    return LayerView(layer=0, budget=4, positions=torch.arange(8)[None], keys=KEYS[None], window_mean={},
                     accumulated=None, values=values[None],
                     query_mean={SINKS: torch.tensor(means)},
                     query_cov={SINKS: cov if cov is not None else torch.zeros(heads, 4, 4)},
                     future_rotation=None if rotation is None else (lambda n: rotation))


def test_expected_attention_scores_by_the_rotated_mean_query() -> None:
    ea = make_policy("expected_attention", n_sink=SINKS)
    # k·μ/√d with μ = e1: 2, 0, 1, 0, 0, −2 for positions 2..7 → 2 and 4 join the sinks
    assert kept(ea, ea_view([[1, 0, 0, 0]])) == [[0, 1, 2, 4]]
    # the future rotation turns e1 into e3 (rotate_half pairs dims 0 and 2): position 5 scores 2, the rest 0
    quarter = torch.eye(4)[[2, 1, 0, 3]] * torch.tensor([[-1.0], [1], [1], [1]])  # a quarter turn: e1 → e3
    assert kept(ea, ea_view([[1, 0, 0, 0]], rotation=quarter)) == [[0, 1, 2, 5]]  # ties go to the older slot


def test_expected_attention_covariance_and_value_norms() -> None:
    cov = torch.diag(torch.tensor([0.0, 0, 1.5, 0]))[None]  # ½ kᵀΣk / d = 3 for position 5, 0 elsewhere
    ea = make_policy("expected_attention", n_sink=SINKS)
    assert kept(ea, ea_view([[1, 0, 0, 0]], cov=cov)) == [[0, 1, 2, 5]]
    assert kept(make_policy("expected_attention", n_sink=SINKS, use_covariance=False),
                ea_view([[1, 0, 0, 0]], cov=cov)) == [[0, 1, 2, 4]]
    # softmax of 2, 0, 1, 0, 0, −2: position 3 (e^0) times a value norm of 10 beats position 2 (e^2 = 7.4)
    norms = [1, 1, 1, 10, 1, 1, 1, 1]
    assert kept(ea, ea_view([[1, 0, 0, 0]], value_norms=norms)) == [[0, 1, 2, 3]]
    assert kept(make_policy("expected_attention", n_sink=SINKS, use_vnorm=False),
                ea_view([[1, 0, 0, 0]], value_norms=norms)) == [[0, 1, 2, 4]]


def test_expected_attention_averages_softmaxes_over_the_query_group() -> None:
    ea = make_policy("expected_attention", n_sink=SINKS)
    # alone, head e1 keeps 2, 4 and head e2 keeps 3, 4; the group's mean of the two softmaxes gives
    # position 2: (e²/13.24 + 1/14.11) / 2 = 0.314, 3: 0.300, 4: (e/13.24 + e/14.11) / 2 = 0.199
    assert kept(ea, ea_view([[1, 0, 0, 0]])) == [[0, 1, 2, 4]]
    assert kept(ea, ea_view([[0, 1, 0, 0]])) == [[0, 1, 3, 4]]
    assert kept(ea, ea_view([[1, 0, 0, 0], [0, 1, 0, 0]])) == [[0, 1, 2, 3]]


def test_expected_attention_without_statistics_fails_in_words() -> None:
    v = ea_view([[1, 0, 0, 0]])
    v.query_mean = {}
    with pytest.raises(KvlabError, match="no query statistics"):
        make_policy("expected_attention", n_sink=SINKS).scores(v)
    assert make_policy("expected_attention").min_budget() == 5  # the four sinks and one more


# --- KeyDiff's keep sets ---------------------------------------------------------------------------------------


def kd_view(budget: int, keys: list[list[list[float]]]) -> LayerView:
    k = torch.tensor(keys)
    heads, slots, _ = k.shape
    return LayerView(layer=0, budget=budget, positions=torch.arange(slots).expand(heads, slots), keys=k,
                     window_mean={}, accumulated=None)


def test_keydiff_keeps_the_keys_least_like_the_mean_key_per_kv_head() -> None:
    head0 = [[1, 0], [1, 0.1], [1, -0.1], [0.9, 0], [0, 1]]
    # normalised mean (0.798, 0.2): cosines 0.970, 0.989, 0.941, 0.970, 0.243 → keep 4 and 2
    head1 = [[0, 1], [0, 2], [1, 0], [0, 3], [0, 1.5]]  # mean (0.2, 0.8): 1, 2 … the lone e1 (2) and a tie → 0
    assert kept(make_policy("keydiff", block_size=0), kd_view(2, [head0, head1])) == [[2, 4], [0, 2]]
    # scaling a key does not change its cosine
    scaled = (torch.tensor(head0) * torch.tensor([3.0, 1, 1, 5, 0.5])[:, None]).tolist()
    assert kept(make_policy("keydiff", block_size=0), kd_view(2, [scaled, head1])) == [[2, 4], [0, 2]]


def test_keydiff_blocks_follow_the_paper_and_differ_from_one_anchor() -> None:
    e1, e2 = [1.0, 0.0], [0.0, 1.0]
    keys = [[e1, e1, e2, e2, e2]]
    # one anchor over all: (2 e1 + 3 e2) / 5 is nearer e2, so both e1 keys are the most distinctive
    assert kept(make_policy("keydiff", block_size=0), kd_view(2, keys)) == [[0, 1]]
    # blocks of 1 after the first 2 slots: {0, 1, 2} keeps 2 and 0 (tie → older); {0, 2, 3} and {0, 2, 4}
    # have anchor (e1 + 2 e2) / 3, where e1 (0.447) beats e2 (0.894): 0 and 2 stay
    assert kept(make_policy("keydiff", block_size=1), kd_view(2, keys)) == [[0, 2]]
    # a block as long as the new slots is the one anchor again
    assert kept(make_policy("keydiff", block_size=3), kd_view(2, keys)) == [[0, 1]]
    assert make_policy("keydiff").block_size == 128  # the paper's block


# --- both in a conversation -------------------------------------------------------------------------------------


def test_each_scores_finite_and_keeps_its_budget_on_a_real_cache() -> None:
    lm, _ = build("llama")
    for name in ("expected_attention", "keydiff"):
        for mode in ("original", "rerotated"):
            policy, state = make_policy(name), KVState(lm, mode)
            for step, n in enumerate((40, 9, 17)):
                probe = policy.probe()
                state.append(ids(n, step), probe)
                evict(state, policy, [24] * lm.facts.n_layers, probe)
                assert state.lengths() == [min(state.seen, 24)] * lm.facts.n_layers
            if name == "expected_attention":  # the sinks stay in every head
                assert all(bool((pos[:, :4] == torch.arange(4)).all()) for pos in state.positions)
            assert math.isfinite(sum(float(lay.keys.sum()) for lay in state.layers))
