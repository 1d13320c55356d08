"""Exactness of the per-policy KV state on a tiny random Llama (mechanics, not behaviour)."""

from __future__ import annotations

import copy

import pytest
import torch
from device_reads import Reads
from tiny_models import eager_forward

from kvlab.engine.attention import Probe, forward_context
from kvlab.engine.batched_decode import generate_batched, generate_keeping
from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.engine.rope import rotate
from kvlab.policies import make_policy
from kvlab.policies.evict import evict

TOL = 1e-3  # float32 noise of a cached loop is ~1e-5 here; a wrong position or mask shows up as >0.1


def tokens(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> torch.nn.Module:
    """The same weights on transformers' own eager attention, which honours a 4D mask."""
    ref = copy.deepcopy(tiny.model)
    ref.set_attn_implementation("eager")
    return ref


def plain_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The model's own eager logits for ``ids`` [tokens, vocab]."""
    return eager_forward(lm, ids)[0]


@pytest.mark.slow
def test_full_state_equals_one_forward(tiny: LoadedModel) -> None:
    ids = tokens(90)
    state = KVState(tiny)
    parts = [state.append(ids[a:b]) for a, b in [(0, 40), (40, 41), (41, 75), (75, 90)]]
    assert (torch.cat(parts) - plain_logits(tiny, ids)).abs().max() < TOL
    assert state.lengths() == [90] * 4
    assert state.positions[2][1].tolist() == list(range(90))


def test_attention_probe_matches_explicit_softmax(tiny: LoadedModel) -> None:
    ids = tokens(50)
    probe = Probe(windows=(8,), colsum=True)
    with forward_context(probes=probe), torch.no_grad():
        tiny.model(input_ids=torch.tensor([ids]))
    eager = copy.deepcopy(tiny.model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attn = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    for layer in range(4):
        a = attn[layer][0]  # [heads, q, k]
        assert torch.allclose(probe.window_means[8][layer], a[:, -8:].mean(1), atol=1e-5)
        assert torch.allclose(probe.colsums[layer], a.sum(1), atol=1e-4)


@pytest.mark.parametrize("name", ["streamingllm", "window", "h2o", "snapkv", "pyramidkv", "tova", "knorm"])
def test_eviction_with_original_positions_equals_masked_forward(
    tiny: LoadedModel, reference: torch.nn.Module, name: str
) -> None:
    ids = tokens(70, seed=3)
    policy = make_policy(name)
    state = KVState(tiny, track_accumulated=policy.needs_accumulated)
    probe = Probe(windows=policy.probe_windows())
    state.append(ids[:50], probe)
    budgets = policy.layer_budgets(24, 4)
    evict(state, policy, budgets, probe)
    assert state.lengths() == budgets
    tail = state.append(ids[50:])
    # reference: queries 50.. see only what each layer/head kept, plus the new tokens causally
    masks = []
    for layer in range(4):
        visible = torch.tril(torch.ones(70, 70, dtype=torch.bool)).repeat(4, 1, 1)  # [heads, q, k]
        for kv in range(2):
            keep = torch.zeros(50, dtype=torch.bool)
            keep[state.positions[layer][kv][state.positions[layer][kv] < 50]] = True
            visible[2 * kv : 2 * kv + 2, 50:, :50] = keep
        masks.append(visible)
    expected = layerwise_masked_logits(reference, ids, masks)[50:]
    assert (tail - expected).abs().max() < TOL


def layerwise_masked_logits(ref: torch.nn.Module, ids: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
    """Forward with a different [heads, q, k] visibility mask in every layer (via a pre-hook)."""
    hooks = []
    for layer, visible in zip(ref.model.layers, masks):
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None]
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, m=mask: (args, {**kwargs, "attention_mask": m}), with_kwargs=True))
    try:
        with torch.no_grad():
            return ref(input_ids=torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.slow
def test_budget_covering_everything_is_full(tiny: LoadedModel) -> None:
    ids = tokens(60, seed=5)
    for name in ["streamingllm", "h2o", "snapkv", "pyramidkv"]:
        policy = make_policy(name)
        state = KVState(tiny, track_accumulated=policy.needs_accumulated)
        probe = Probe(windows=policy.probe_windows())
        first = state.append(ids[:40], probe)
        evict(state, policy, policy.layer_budgets(2000, 4), probe)
        rest = state.append(ids[40:])
        assert (torch.cat([first, rest]) - plain_logits(tiny, ids)).abs().max() < TOL


def test_streamingllm_keeps_sinks_and_newest(tiny: LoadedModel) -> None:
    state = KVState(tiny)
    policy = make_policy("streamingllm", n_sink=4)
    state.append(tokens(100))
    evict(state, policy, [20] * 4, None)
    for layer in range(4):
        for head in range(2):
            assert state.positions[layer][head].tolist() == [0, 1, 2, 3, *range(84, 100)]


def test_rerotated_mode_places_keys_at_their_slots(tiny: LoadedModel) -> None:
    ids = tokens(60, seed=9)
    state = KVState(tiny, position_mode="rerotated")
    state.append(ids[:48])
    evict(state, make_policy("streamingllm"), [16] * 4, None)
    assert state.rope_positions[0][0].tolist() == list(range(16))
    assert state.positions[0][0].tolist() == [0, 1, 2, 3, *range(36, 48)]
    kept = [ids[p] for p in state.positions[0][0].tolist()]
    _, fresh, _ = eager_forward(tiny, kept)  # the kept tokens prefilled alone: slots 0..15, as layer 0 sees them
    assert (state.cache.layers[0].keys[0] - fresh[0]).abs().max() < 1e-4
    # the next query sits at the cache length, not at the original position
    state.append(ids[48:52])
    assert state.rope_positions[0][0].tolist()[-4:] == [16, 17, 18, 19]
    assert state.positions[0][0].tolist()[-4:] == [48, 49, 50, 51]


def test_generate_leaves_cache_unchanged(tiny: LoadedModel) -> None:
    state = KVState(tiny)
    logits = state.append(tokens(20))
    before = [layer.keys.clone() for layer in state.cache.layers]
    out = state.generate(logits[-1], 6, stop_ids=set())
    assert len(out) == 6
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, state.cache.layers))
    assert state.generate(logits[-1], 6, stop_ids={out[0]}) == []


def test_decoding_appends_in_place_and_never_under_another_view(tiny: LoadedModel) -> None:
    """A decoding step writes its key into the layer's room (no copy of the held keys), while every snapshot, every
    state sharing the tensors and every shorter view keeps what it saw: an append lands only past every view."""
    state = KVState(tiny)
    state.append(tokens(20))
    layer = state.cache.layers[0]
    start, snap = layer.keys.data_ptr(), state.snapshot()
    held = layer.keys.clone()
    twin = KVState(tiny)
    twin.restore(snap)  # another state holding the very same tensors
    state.forward(torch.tensor([5]), state.next_positions(1), None)
    state.forward(torch.tensor([6]), state.next_positions(1) + 1, None, already=1)
    assert layer.keys.shape[-2] == 22 and layer.keys.data_ptr() == start  # in place: the same storage
    assert torch.equal(layer.keys[:, :, :20], held)
    assert torch.equal(snap["layers"][0]["keys"], held) and torch.equal(twin.cache.layers[0].keys, held)
    twin.forward(torch.tensor([7]), twin.next_positions(1), None)  # its view ends before the room's end: a copy
    assert twin.cache.layers[0].keys.data_ptr() != start and torch.equal(layer.keys[:, :, :20], held)
    before_cut = layer.keys  # a view past the cut, as a snapshot taken mid-generation would hold
    newest = before_cut[:, :, 20:].clone()
    state.truncate([20] * 4)  # a shorter view of the room, as a finished generation leaves
    state.forward(torch.tensor([8]), state.next_positions(1), None)
    assert layer.keys.data_ptr() != start  # appended into a new room, not over the slots it dropped
    assert torch.equal(before_cut[:, :, 20:], newest) and torch.equal(snap["layers"][0]["keys"], held)


@pytest.mark.slow
def test_batched_generation_equals_each_cache_alone(tiny: LoadedModel) -> None:
    ids = tokens(80, seed=11)
    states, first = [], []
    for name, budget in [("full", 1000), ("streamingllm", 20), ("snapkv", 30), ("pyramidkv", 24)]:
        policy = make_policy(name)
        state = KVState(tiny, position_mode="rerotated" if name == "streamingllm" else "original")
        probe = Probe(windows=policy.probe_windows())
        logits = state.append(ids, probe)
        evict(state, policy, policy.layer_budgets(budget, 4), probe)
        states.append(state)
        first.append(logits[-1])
    alone = [s.generate(f, 12, stop_ids=set()) for s, f in zip(states, first)]
    lengths = [s.lengths() for s in states]
    together = generate_batched(states, first, 12, stop_ids=set())
    assert together == alone
    assert [s.lengths() for s in states] == lengths
    # stopping: a row that hits a stop token ends; the others go on
    stop = {alone[1][3]}
    assert generate_batched(states, first, 12, stop_ids=stop)[1] == alone[1][:3]


@pytest.mark.slow
def test_generate_kept_equals_generate_then_append_and_drop_last_undoes_it(tiny: LoadedModel) -> None:
    ids = tokens(30, seed=13)
    kept, fed_again = KVState(tiny), KVState(tiny)
    first = kept.append(ids)[-1]
    fed_again.append(ids)
    reply, logits = kept.generate_kept(first, 8, stop_ids=set())
    assert reply == fed_again.generate(first, 8, stop_ids=set()) and len(reply) == 8
    assert logits.shape[0] == 8 and kept.seen == 37 and kept.tokens == ids + reply[:7]
    again = fed_again.append(reply[:7])
    assert (logits[1:] - again).abs().max() < TOL and (logits[0] - first).abs().max() == 0
    for layer in range(4):
        assert torch.equal(kept.positions[layer], fed_again.positions[layer])
        assert (kept.cache.layers[layer].keys - fed_again.cache.layers[layer].keys).abs().max() < TOL
    kept.drop_last(7)
    assert kept.lengths() == [30] * 4 and kept.seen == 30 and kept.tokens == ids
    assert kept.positions[0][0].tolist() == list(range(30))
    with pytest.raises(ValueError):
        KVState(tiny, track_accumulated=True).generate_kept(first, 2, stop_ids=set())


def test_rerotated_per_layer_budgets_keep_each_layers_newest_key_next_to_the_query(tiny: LoadedModel) -> None:
    ids = tokens(70, seed=21)
    state = KVState(tiny, position_mode="rerotated")
    policy = make_policy("pyramidkv", window=4)
    probe = Probe(windows=policy.probe_windows())
    state.append(ids[:64], probe)
    evict(state, policy, [40, 30, 20, 10], probe)
    assert state.lengths() == [40, 30, 20, 10]
    query = 40  # the longest layer's length: where the next token sits
    for layer, held in enumerate(state.lengths()):
        assert state.rope_positions[layer][0].tolist() == list(range(query - held, query))
        assert state.positions[layer][0].tolist()[-4:] == [60, 61, 62, 63]  # the window, newest last
    state.append(ids[64:66])
    assert [p[0].tolist()[-3:] for p in state.rope_positions] == [[39, 40, 41]] * 4
    # layer 3's keys were turned to slots 30…39: equal to rotating its original-mode keys by slot − position
    original = KVState(tiny)
    original.append(ids[:64], probe := Probe(windows=policy.probe_windows()))
    evict(original, policy, [40, 30, 20, 10], probe)
    delta = (torch.arange(30, 40) - original.positions[3])[None]
    turned = rotate(tiny, original.cache.layers[3].keys, delta, 3)
    assert (turned - state.cache.layers[3].keys[:, :, :10]).abs().max() < TOL


def one_head_short(state: KVState, layer: int) -> torch.Tensor:
    """A keep mask [kv_heads, slots] of ``layer`` that drops the first 3 keys of head 0 only."""
    keep = state.layers[layer].real.clone()
    keep[0, :3] = False
    return keep


def test_uneven_is_read_once_per_mask_and_follows_every_change(tiny: LoadedModel) -> None:
    """``uneven`` is kept between reads of the device (a decoding step asks it of every layer), and stays right
    through appends, per-head cuts and a restored snapshot."""
    ids = tokens(60, seed=23)
    state = KVState(tiny)
    policy = make_policy("adakv")
    probe = Probe(windows=policy.probe_windows())
    state.append(ids[:50], probe)
    before = state.snapshot()

    def check() -> None:
        assert [lay.uneven for lay in state.layers] == [not bool(lay.real.all()) for lay in state.layers]

    check()
    evict(state, policy, policy.layer_budgets(20, 4), probe)
    check()
    state.keep(1, one_head_short(state, 1))
    assert state.layers[1].uneven
    check()
    state.append(ids[50:55])
    check()
    expected = [not bool(lay.real.all()) for lay in state.layers]
    assert expected[1]
    Reads.count = 0
    with Reads():
        assert [lay.uneven for lay in state.layers] == expected  # known since the cuts and the append: no read
        state.truncate([n - 2 for n in state.lengths()])
        assert [lay.uneven for lay in state.layers] == expected
    assert Reads.count == sum(expected)  # only a padded layer's cut asks its new mask again
    check()
    state.restore(before)
    assert not any(lay.uneven for lay in state.layers)
    check()


def test_a_decoding_step_reads_one_value_from_the_device(tiny: LoadedModel) -> None:
    """On a GPU every read of a tensor's value (``item``, ``int``, ``bool``) waits for the queued kernels; a step of
    a kept reply reads one, its token, once each layer's padding is known (eviction's own cuts read per layer)."""
    Reads.count = 0
    ids = tokens(60, seed=29)
    state = KVState(tiny)
    policy = make_policy("adakv")
    probe = Probe(windows=policy.probe_windows())
    state.append(ids[:-1], probe)
    evict(state, policy, policy.layer_budgets(20, 4), probe)
    state.keep(2, one_head_short(state, 2))
    first = state.append(ids[-1:])[-1]  # an append after the cuts keeps what they know of the padding
    steps = 8
    with Reads():
        reply, _ = state.generate_kept(first, steps, stop_ids=set())
    assert len(reply) == steps
    assert Reads.count == steps  # each step's token


def test_batched_decoding_reads_no_value_per_step(tiny: LoadedModel) -> None:
    """Rows decoded together (Full's kept on its own cache, evicted caches on a slab, one with padded heads) read
    the same values from the device whatever the number of steps: the tokens come back in one ``tolist`` a step."""
    ids = tokens(60, seed=31)
    reads = []
    for steps in (3, 9):
        states, first = [], []
        for name in ("full", "snapkv", "adakv"):
            policy = make_policy(name)
            state = KVState(tiny)
            probe = Probe(windows=policy.probe_windows())
            first.append(state.append(ids, probe)[-1])
            if name != "full":
                evict(state, policy, policy.layer_budgets(24, 4), probe)
            states.append(state)
        states[2].keep(1, one_head_short(states[2], 1))
        Reads.count = 0
        with Reads():
            replies, _ = generate_keeping(states, first, steps, stop_ids=set())
        assert all(len(r) == steps for r in replies)
        reads.append(Reads.count)
    assert reads[0] == reads[1], reads
