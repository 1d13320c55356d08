"""Running several caches together equals running each alone (tiny random Llama, mechanics)."""

from __future__ import annotations

import copy

import pytest
import torch

from kvlab.engine import batched, batched_decode
from kvlab.engine.attention import Probe
from kvlab.engine.batched import append_together, groups_of_identical
from kvlab.engine.batched_decode import generate_batched
from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.errors import KvlabError, Stopped
from kvlab.policies import make_policy
from kvlab.policies.evict import evict
from kvlab.workloads.chat import session as session_module
from kvlab.workloads.chat.reply_feed import reply_holders
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

TOL = 1e-4


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def mixed_states(lm: LoadedModel, mode: str = "original") -> list[KVState]:
    """Two untouched caches (one tracking H2O sums) and three that evicted differently (one per-layer)."""
    ids = tokens(60, seed=21)
    out = []
    for name, budget in [("full", 1000), ("h2o", 1000), ("h2o", 24), ("snapkv", 30), ("pyramidkv", 24)]:
        policy = make_policy(name)
        state = KVState(lm, mode, track_accumulated=policy.needs_accumulated)
        probe = Probe(windows=policy.probe_windows())
        state.append(ids, probe)
        evict(state, policy, policy.layer_budgets(budget, lm.facts.n_layers), probe)
        out.append(state)
    return out


def clone(states: list[KVState]) -> list[KVState]:
    return copy.deepcopy(states, memo={id(states[0].lm): states[0].lm})


def test_untouched_caches_are_grouped_and_evicted_ones_are_not(tiny: LoadedModel) -> None:
    states = mixed_states(tiny)
    assert [s.diverged for s in states] == [False, False, True, True, True]
    assert groups_of_identical(states) == [[0, 1], [2], [3], [4]]
    other = KVState(tiny)
    other.append(tokens(60, seed=22))  # untouched too, but other tokens
    assert groups_of_identical([states[0], other]) == [[0], [1]]


@pytest.mark.slow
@pytest.mark.parametrize("mode, rows_per_forward", [("original", 8), ("rerotated", 8), ("original", 2)])
def test_append_together_equals_each_alone(
    tiny: LoadedModel, mode: str, rows_per_forward: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = tokens(9, seed=23)
    monkeypatch.setattr(batched, "LOGITS_BUDGET", rows_per_forward * len(new) * tiny.facts.vocab_size)
    together = mixed_states(tiny, mode)
    alone = clone(together)
    windows = [(4,), (), (3, 8), (8,), (2,)]
    probes_t = [Probe(windows=w) for w in windows]
    probes_a = [Probe(windows=w) for w in windows]
    logits_t = append_together(together, new, probes_t)
    logits_a = [s.append(new, p) for s, p in zip(alone, probes_a)]
    for t, a, lt, la, pt, pa in zip(together, alone, logits_t, logits_a, probes_t, probes_a):
        assert (lt - la).abs().max() < TOL
        assert t.lengths() == a.lengths() and t.seen == a.seen and t.tokens == a.tokens
        for layer in range(tiny.facts.n_layers):
            assert torch.equal(t.positions[layer], a.positions[layer])
            assert torch.equal(t.rope_positions[layer], a.rope_positions[layer])
            assert (t.cache.layers[layer].keys - a.cache.layers[layer].keys).abs().max() < TOL
            assert (t.cache.layers[layer].values - a.cache.layers[layer].values).abs().max() < TOL
            if t.track_accumulated:
                assert (t.accumulated[layer] - a.accumulated[layer]).abs().max() < TOL
            for n in pa.windows:
                assert (pt.window_means[n][layer] - pa.window_means[n][layer]).abs().max() < TOL
    # the follower shares the leader's tensors, which are replaced, never changed: the leader's next append and
    # cut leave the follower's cache as it was
    assert together[1].cache.layers[0].keys.data_ptr() == together[0].cache.layers[0].keys.data_ptr()
    held = [(lay.keys.clone(), lay.values.clone()) for lay in together[1].cache.layers]
    together[0].append(tokens(3, seed=5))
    together[0].keep(0, torch.arange(together[0].lengths()[0]).expand(tiny.facts.n_kv_heads, -1) % 2 == 0)
    for lay, (keys, values) in zip(together[1].cache.layers, held):
        assert torch.equal(lay.keys, keys) and torch.equal(lay.values, values)


@pytest.mark.slow
def test_reduce_sees_every_state_once(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched, "LOGITS_BUDGET", 1)  # one row per forward
    states = mixed_states(tiny)
    new = tokens(6, seed=26)
    expected = [s.argmax(-1).tolist() for s in append_together(clone(states), new)]
    seen: list[int] = []
    out = append_together(states, new, reduce=lambda i, logits: seen.append(i) or logits.argmax(-1).tolist())
    assert sorted(seen) == list(range(len(states))) and out == expected


@pytest.mark.slow
def test_a_long_cache_attends_apart_from_short_ones_in_the_same_forward(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    long = KVState(tiny)
    long.append(tokens(200, seed=27))
    short = []
    for seed in (28, 29, 30):
        state = KVState(tiny)
        state.append(tokens(200, seed=seed))
        evict(state, make_policy("window"), [10] * tiny.facts.n_layers, None)
        short.append(state)
    states = [short[0], long, *short[1:]]
    assert batched_decode.row_groups(states, room=1) == [[1], [0, 2, 3]]  # the short ones: not padded to the long one
    runs: list[int] = []
    real = batched_decode.run_groups

    def counted(lm: LoadedModel, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        runs.append(ids.shape[0])
        return real(lm, ids, *args, **kwargs)

    monkeypatch.setattr(batched_decode, "run_groups", counted)
    first = [torch.randn(tiny.facts.vocab_size, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    alone = [s.generate(f, 8, stop_ids=set()) for s, f in zip(states, first)]
    assert generate_batched(states, first, 8, set()) == alone
    assert runs == [4] * 7  # one forward per step for every row; the last token is never fed


@pytest.mark.slow
def test_last_logits_only(tiny: LoadedModel) -> None:
    states = mixed_states(tiny)
    new = tokens(7, seed=24)
    full = append_together(clone(states), new)
    last = append_together(states, new, logits_to_keep=1)
    assert all(f.shape[0] == 7 and tail.shape[0] == 1 for f, tail in zip(full, last))
    assert all((f[-1] - tail[0]).abs().max() < TOL for f, tail in zip(full, last))


@pytest.mark.slow
def test_identical_caches_decode_once_with_the_same_reply(tiny: LoadedModel) -> None:
    states = mixed_states(tiny)
    first = append_together(states, tokens(5, seed=25), logits_to_keep=1)
    first = [f[-1] for f in first]
    alone = [s.generate(f, 10, stop_ids=set()) for s, f in zip(states, first)]
    streamed: dict[int, list[int]] = {}
    together = generate_batched(states, first, 10, set(), lambda row, ids: streamed.__setitem__(row, list(ids)))
    assert together == alone
    assert together[0] == together[1]  # identical caches: one row decoded for both
    assert streamed == dict(enumerate(alone))  # every policy still streams its own reply


@pytest.mark.slow
def test_session_with_a_budget_above_the_chat_matches_full_exactly(tiny: LoadedModel) -> None:
    settings = ChatSettings(policies=("full", "streamingllm", "h2o", "snapkv"), budget=2000, max_new_tokens=6)
    session = ChatSession(tiny, settings)
    for text in ["Hello there, how are you?", "Tell me more about it."]:
        turn = session.run_turn(text)
        assert {p.reply for p in turn.policies.values()} == {turn.policies["full"].reply}
        assert all(p.kl == 0.0 and p.top1 == 1.0 for p in turn.policies.values())


@pytest.mark.slow
@pytest.mark.parametrize("policies", [("full",), ("full", "streamingllm", "window")])
def test_a_reply_kept_from_decoding_equals_a_reply_fed_again(
    tiny: LoadedModel, policies: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = ChatSettings(policies=policies, budget=40, max_new_tokens=6)
    kept = ChatSession(tiny, settings)
    fed = ChatSession(tiny, settings)
    holders: list[list[str]] = []  # kept's, turn by turn; fed's caches keep nothing

    def holding(lm: LoadedModel, states: dict, policies: dict, names: list[str]) -> list[str]:
        if states is fed.states:
            return []
        holders.append(reply_holders(lm, states, policies, names))
        return holders[-1]

    monkeypatch.setattr(session_module, "reply_holders", holding)
    full = kept.states["full"]
    calls: list[int] = []
    original = full.generate_kept
    monkeypatch.setattr(full, "generate_kept", lambda *a, **k: calls.append(1) or original(*a, **k))
    for text in ["Hello there, how are you today?", "Tell me more about it, please.", "And then?"]:
        a, b = kept.run_turn(text), fed.run_turn(text)
        assert {n: p.reply for n, p in a.policies.items()} == {n: p.reply for n, p in b.policies.items()}
        assert a.total_tokens == b.total_tokens
        for name in policies:
            assert a.policies[name].kl == pytest.approx(b.policies[name].kl, abs=1e-4)
            assert a.policies[name].retained == b.policies[name].retained
            for x, y in zip(kept.states[name].cache.layers, fed.states[name].cache.layers):
                assert (x.keys - y.keys).abs().max() < TOL
    # every cache kept Full's reply while all were still Full's; then Full's alone, beside the others
    assert holders == ([list(policies), ["full"], ["full"]] if len(policies) > 1 else [["full"]] * 3)
    assert len(calls) == (3 if policies == ("full",) else 1)


class Interrupted(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("policies, fail_at", [
    (("full",), "stream"),  # Full's reply kept from decoding, cut off mid-stream
    (("full", "streamingllm", "h2o"), "stream"),  # batched decoding cut off mid-stream
    (("full", "streamingllm", "h2o"), "forward"),  # the second forward of the reply feed fails
])
def test_an_interrupted_turn_leaves_the_session_as_before(
    tiny: LoadedModel, policies: tuple[str, ...], fail_at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = ChatSettings(policies=policies, budget=24, max_new_tokens=6)
    broken, clean = ChatSession(tiny, settings), ChatSession(tiny, settings)
    for session in (broken, clean):
        session.run_turn("Hello there, how are you today? Tell me everything.")
    shots = 0

    def stream(policy: str, text: str) -> None:
        nonlocal shots
        shots += 1
        if shots == 4:
            raise Interrupted

    if fail_at == "forward":
        monkeypatch.setattr(batched, "LOGITS_BUDGET", 1)  # one row per forward, so a later one can fail
        real = batched.KVState.forward
        calls = []

        def flaky(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise Interrupted
            return real(self, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(batched.KVState, "forward", flaky)
            with pytest.raises(Interrupted):
                broken.run_turn("A second message.", golden="A golden reply of some length.")
    else:
        with pytest.raises(Interrupted):
            broken.run_turn("A second message.", on_token=stream)
    assert len(broken.turns) == 1 and broken.total_tokens == clean.total_tokens
    a, b = broken.run_turn("And a third one?"), clean.run_turn("And a third one?")
    assert {n: p.reply for n, p in a.policies.items()} == {n: p.reply for n, p in b.policies.items()}
    assert {n: p.retained for n, p in a.policies.items()} == {n: p.retained for n, p in b.policies.items()}
    for name in policies:
        assert broken.states[name].tokens == clean.states[name].tokens
        assert [x.keys.shape for x in broken.states[name].cache.layers] == \
            [x.keys.shape for x in clean.states[name].cache.layers]


class PageRerun(BaseException):
    """What a Streamlit page raises in a callback when it is run again mid-turn."""


def test_a_turn_cut_short_from_outside_is_told_once_and_an_error_or_a_stop_is_not(tiny: LoadedModel) -> None:
    session = ChatSession(tiny, ChatSettings(policies=("full", "streamingllm"), budget=24, max_new_tokens=4))

    def raising(exc: BaseException, stop_first: bool = False):
        def on_token(policy: str, text: str) -> None:
            if stop_first:  # Stop's click also ends the page's run: the stop is what the page reports
                session.request_stop()
            raise exc
        return on_token

    with pytest.raises(PageRerun):
        session.run_turn("Hello there, how are you?", on_token=raising(PageRerun()))
    assert session.take_cut_short(1) == "Hello there, how are you?" and session.take_cut_short(1) is None
    # errors and stops are shown by their callers; a bug is an error, not a turn cut short
    for exc, stop_first in ((KvlabError("refused"), False), (Stopped("stopped"), False), (RuntimeError("bug"), False),
                            (PageRerun(), True)):
        with pytest.raises(type(exc)):
            session.run_turn("Hello again.", on_token=raising(exc, stop_first))
        assert session.take_cut_short(1) is None
    assert not session.turns and session.total_tokens == 0


def test_feeding_nothing_is_a_no_op(tiny: LoadedModel) -> None:
    states = mixed_states(tiny)
    lengths = [s.lengths() for s in states]
    assert all(x.shape[0] == 0 for x in append_together(states, []))
    assert [s.lengths() for s in states] == lengths
