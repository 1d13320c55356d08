"""The oracle: its evidence (what later queries attend to) against the model's own eager attention, its keep
set, and how a conversation gives it that future — a script run by Full first — or refuses it in words."""

from __future__ import annotations

import threading

import pandas as pd
import pytest
import torch
from tiny_models import build

from kvlab.engine.facts import LoadedModel
from kvlab.engine.future import future_attention
from kvlab.engine.kvstate import to_kv_heads
from kvlab.errors import KvlabError, Stopped
from kvlab.experiments.plan import ArenaSettings
from kvlab.experiments.runner import run_arena, run_cell
from kvlab.experiments.seed_table import seed_cells
from kvlab.policies import LayerView, make_policy
from kvlab.policies.evict import keep_index
from kvlab.viz.arena import fidelity_vs_budget_figure
from kvlab.workloads.chat import foresee
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

SCRIPT = Conversation(name="script", description="three short turns", system=None, turns=(
    Turn(user="My locker code is 4127 and my cat is called Miso.", golden="Noted: locker 4127, cat Miso."),
    Turn(user="Tell me a little about harbours and lighthouses, please."),
    Turn(user="What is my locker code?", prefill="Your locker code is", answer="4127"),
))


@pytest.mark.parametrize("arch", ["llama", "mistral-window", "gemma2"])  # windows; soft-capping
def test_future_attention_is_the_eager_attention_of_every_later_query(arch: str) -> None:
    lm, reference = build(arch)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(3, 128, (30,), generator=g).tolist()
    boundaries = [7, 12, 21]
    future = future_attention(lm, tokens, boundaries)
    with torch.no_grad():
        maps = reference(input_ids=torch.tensor([tokens]), output_attentions=True).attentions  # [1, heads, n, n]
    assert future.boundaries == [7, 12, 21, 30]
    for b in boundaries:
        for layer, attn in enumerate(maps):
            want = attn[0, :, b:, :b].sum(dim=1)  # [heads, b]: every query from b on, each earlier key
            assert (future.at(tokens[:b], layer) - want).abs().max() < 1e-4
    assert float(future.at(tokens, 0).abs().max()) == 0.0  # after the last token nothing attends
    with pytest.raises(KvlabError, match="another conversation"):
        future.at([*tokens[:6], 0], 0)  # a cache of other tokens at an eviction point's length
    with pytest.raises(KvlabError, match="another conversation"):
        future.at(tokens[:8], 0)  # not an eviction point


def test_oracle_keeps_what_later_queries_attend_to_most_per_kv_head() -> None:
    future = torch.tensor([[0.1, 3.0, 0.2, 2.0, 0.0, 1.0], [5.0, 0.0, 0.0, 0.1, 4.0, 0.2]])
    v = LayerView(layer=0, budget=3, positions=torch.arange(6).expand(2, 6), keys=torch.zeros(2, 6, 4),
                  window_mean={}, accumulated=None, future=future)
    index = keep_index(make_policy("oracle").scores(v), v.budget)
    assert v.positions.gather(-1, index).tolist() == [[1, 3, 5], [0, 4, 5]]
    v.future = None
    with pytest.raises(KvlabError, match="not deployable"):
        make_policy("oracle").scores(v)
    assert "not deployable" in make_policy("oracle").summary


def test_a_live_chat_refuses_the_oracle_in_words(tiny: LoadedModel) -> None:
    with pytest.raises(KvlabError, match="oracle keeps what later turns will attend to, so it needs a scripted"):
        ChatSession(tiny, ChatSettings(policies=("oracle",), budget=16))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["original", "rerotated"])
def test_in_a_scripted_conversation_the_oracle_keeps_the_top_of_fulls_future(tiny: LoadedModel, mode: str) -> None:
    settings = ChatSettings(policies=("oracle", "expected_attention", "keydiff"), budget=24, max_new_tokens=4,
                            position_mode=mode)
    session = ChatSession(tiny, settings, script=SCRIPT)
    chosen: list[tuple[list[int], list[torch.Tensor]]] = []  # (tokens at the eviction, positions kept)
    original = session._evict

    def watch(*args, **kwargs):
        original(*args, **kwargs)
        state = session.states["oracle"]
        chosen.append((list(state.tokens), [p.clone() for p in state.positions]))

    session._evict = watch
    for t in SCRIPT.turns:
        turn = session.run_turn(t.user, golden=t.golden, prefill=t.prefill, answer=t.answer)
        for name in ("oracle", "expected_attention", "keydiff"):  # each runs turn after turn in this position mode
            assert turn.policies[name].error is None and turn.policies[name].kl is not None
            assert turn.policies[name].cache_tokens == [min(turn.total_tokens, 24)] * tiny.facts.n_layers
    # Full alone over the same stream, from scratch: the first eviction keeps its future's top 24 per KV head
    future = future_attention(tiny, session.states["full"].tokens, [s["end"] for s in session.segments])
    tokens, positions = chosen[0]
    for layer, kept in enumerate(positions):
        later = to_kv_heads(future.at(tokens, layer), tiny.facts.n_kv_heads)  # [kv_heads, seen]
        assert kept.tolist() == keep_index(later, 24).tolist()


@pytest.mark.slow
def test_off_its_script_the_oracle_reads_the_future_of_the_conversation_so_far_and_that_turn(tiny: LoadedModel
                                                                                               ) -> None:
    """A single-shot question asked of turn 1's caches leaves the script: Full alone runs over turn 1 and that
    question (its greedy reply, where there is no golden one) first, and the oracle keeps the top of that future."""
    session = ChatSession(tiny, ChatSettings(policies=("oracle", "keydiff"), budget=16, max_new_tokens=3),
                          script=SCRIPT)
    session.run_turn(SCRIPT.turns[0].user, golden=SCRIPT.turns[0].golden)
    so_far = list(session.states["full"].tokens)
    chosen: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = []  # tokens, positions before, after
    original = session._evict

    def watch(*args, **kwargs):
        state = session.states["oracle"]
        before = [p.clone() for p in state.positions]
        original(*args, **kwargs)
        chosen.append((list(state.tokens), before, [p.clone() for p in state.positions]))

    session._evict = watch
    single = session.run_turn("Something the script never asks?", keep=False)  # a single-shot question
    oracle = single.policies["oracle"]
    assert oracle.error is None and oracle.kl is not None and single.policies["keydiff"].error is None
    asked = session.user_ids("Something the script never asks?", "")
    fed = tiny.encode(single.reply + session.format.assistant_end)
    stream = [*so_far, *asked, *fed]  # what Full alone ran over: the conversation so far, the question, its reply
    # this turn's own pass, recorded on it: the script's pass as it stood after turn 1, on through the question and
    # its reply
    assert oracle.extra_prefill_tokens == len(asked) + len(fed)
    resumed = session.states["oracle"].future
    assert resumed.tokens == stream and resumed.boundaries[-2:] == [len(so_far) + len(asked), len(stream)]
    fresh = future_attention(tiny, stream, resumed.boundaries)  # the same pass from the first token
    assert all(torch.equal(a, b) for at, bt in zip(resumed.later, fresh.later, strict=True)
               for a, b in zip(at, bt, strict=True))
    future = future_attention(tiny, stream, [len(so_far), len(so_far) + len(asked), len(stream)])
    tokens, held, kept = chosen[0]  # after the question: the reply's queries are its only future
    assert tokens == [*so_far, *asked]
    for layer, (was, now) in enumerate(zip(held, kept)):  # [kv_heads, slots] original positions
        later = to_kv_heads(future.at(tokens, layer), tiny.facts.n_kv_heads).gather(-1, was)
        assert now.tolist() == was.gather(-1, keep_index(later, 16)).tolist()
    t = SCRIPT.turns[1]
    assert session.run_turn(t.user, golden=t.golden).policies["oracle"].error is None  # rolled back: on script again
    assert session.states["oracle"].future is session.script_future
    later = session.run_turn("And one more?", keep=False)  # after turn 2: Full alone replays both turns first
    everything = [*session.states["full"].tokens, *session.user_ids("And one more?", ""),
                  *tiny.encode(later.reply + session.format.assistant_end)]
    assert later.policies["oracle"].error is None and session.states["oracle"].future.tokens == everything
    assert later.policies["oracle"].extra_prefill_tokens == len(everything)
    kept = session.run_turn("Something the script never asks either?")  # kept: its later turns are unknown
    assert "another conversation" in kept.policies["oracle"].error and kept.policies["keydiff"].error is None


@pytest.mark.slow
def test_a_budget_covering_the_conversation_equals_full(tiny: LoadedModel) -> None:
    settings = ChatSettings(policies=("expected_attention", "keydiff", "oracle"), budget=2000, max_new_tokens=5)
    session = ChatSession(tiny, settings, script=SCRIPT)
    for t in SCRIPT.turns:
        turn = session.run_turn(t.user, golden=t.golden, prefill=t.prefill, answer=t.answer)
        assert {p.reply for p in turn.policies.values()} == {turn.policies["full"].reply}
        assert all(p.kl == 0.0 and p.top1 == 1.0 for p in turn.policies.values())


def test_the_arena_chart_draws_the_oracle_as_a_dashed_headroom_line() -> None:
    summary = pd.DataFrame([{"policy": p, "budget": b, "kl": kl, "top1": 0.9, "accuracy": 0.5, "failed": 0}
                            for p, kl in (("full", 0.0), ("snapkv", 0.5), ("oracle", 0.1)) for b in (64, 128)])
    traces = {t.name: t for t in fidelity_vs_budget_figure(summary).data}
    assert traces["oracle: headroom, not deployable"].line.dash == "longdash"
    assert traces["snapkv"].line.dash is None and traces["full"].line.dash == "dash"


@pytest.mark.slow
def test_an_arena_cell_gives_the_oracle_its_script_and_rows_in_both_modes(tiny: LoadedModel) -> None:
    settings = ArenaSettings(policies=("oracle", "keydiff"), budgets=(16,), max_new_tokens=3,
                             modes=("multi-turn", "single-shot"))
    table = run_arena(tiny, [SCRIPT], settings)
    oracle = table[table["policy"] == "oracle"].set_index(["mode", "turn"])["error"]
    assert oracle.loc[[("multi-turn", 1), ("multi-turn", 2), ("multi-turn", 3)]].isna().all()
    # single-shot question 2 follows turn 1 as the script does; question 3, asked right after turn 1, reads the
    # future of its own stream
    assert oracle.loc[[("single-shot", 2), ("single-shot", 3)]].isna().all()
    cells = seed_cells(table).set_index(["family", "workload"])
    assert cells.loc[("oracle (not deployable: reads later turns)", "multi-turn"), "status"] == "measured"
    assert cells.loc[("oracle (not deployable: reads later turns)", "single-shot"), "status"] == "measured"


@pytest.mark.slow
def test_the_cells_of_one_workload_share_fulls_passes_over_its_script_and_questions(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ArenaSettings(policies=("oracle", "keydiff"), budgets=(16, 24), max_new_tokens=3,
                             modes=("multi-turn", "single-shot"))
    alone = pd.concat([pd.DataFrame(run_cell(tiny, SCRIPT, b, settings)) for b in settings.budgets],
                      ignore_index=True)  # each cell its own pass
    passes: list[str] = []
    real = foresee._full_alone
    monkeypatch.setattr(foresee, "_full_alone", lambda *a, **k: passes.append(a[6]) or real(*a, **k))
    shared = run_arena(tiny, [SCRIPT], settings)
    assert passes.count("the whole script (3 turns)") == 1  # the second cell took the first's
    assert passes.count("this single-shot question") == 1  # question 3, asked of turn 1 in both cells
    same = ["budget", "mode", "turn", "policy", "kl", "top1", "correct", "kept_tokens", "extra_prefill_tokens",
            "reply", "error"]
    assert shared[same].equals(alone[same])
    oracle = shared[(shared["policy"] == "oracle") & (shared["turn"] == 1) & (shared["mode"] == "multi-turn")]
    assert (oracle["extra_prefill_s"] > 0).all()  # the second cell counts the pass it was handed
    asked = shared[(shared["policy"] == "oracle") & (shared["turn"] == 3) & (shared["mode"] == "single-shot")]
    assert (asked["extra_prefill_s"] > 0).all()  # and the question's


def test_a_script_too_long_for_the_model_fails_the_oracle_alone_in_words(tiny: LoadedModel) -> None:
    long = Conversation(name="long", description="outgrows the context", system=None,
                        turns=(SCRIPT.turns[0], Turn(user="word " * 3000)))  # ~3000 tokens; the context is 2048
    session = ChatSession(tiny, ChatSettings(policies=("oracle", "keydiff"), budget=16, max_new_tokens=2),
                          script=long)
    turn = session.run_turn(SCRIPT.turns[0].user, golden=SCRIPT.turns[0].golden)
    assert "Full could not first run the whole script (2 turns)" in turn.policies["oracle"].error
    assert "context" in turn.policies["oracle"].error and turn.policies["keydiff"].error is None


def test_a_stop_during_the_full_run_over_the_script_stops_it_at_once(tiny: LoadedModel) -> None:
    session = ChatSession(tiny, ChatSettings(policies=("oracle",), budget=16, max_new_tokens=2), script=SCRIPT)
    cancel, after = threading.Event(), []

    def on_phase(what: str) -> None:
        if what.startswith("running Full alone"):
            cancel.set()

    hook = tiny.model.get_decoder().layers[0].register_forward_pre_hook(
        lambda *_: after.append(1) if cancel.is_set() else None)
    try:
        with pytest.raises(Stopped):
            session.run_turn(SCRIPT.turns[0].user, golden=SCRIPT.turns[0].golden, on_phase=on_phase, stop=cancel)
    finally:
        hook.remove()
    assert after == []  # the inner session's first layer already saw the caller's Cancel
    assert session.states["oracle"].future is None and session.total_tokens == 0
